"""``persistent-delta top`` in a pseudo-terminal: it draws the ranks and consumers with their lag
and health, redraws when a consumer commits, and ends cleanly on SIGTERM."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from typing import Tuple

import pytest
import torch

pytest.importorskip("rich")

from logs import fill_ranks  # noqa: E402
from procs import REPO  # noqa: E402

from persistent_delta import DeltaConsumer  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


class Screen:
    """What a child drew on a pseudo-terminal, escape sequences removed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    def read_until(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            m = rx.search(self.text)
            if m:
                self.text = self.text[m.end():]  # later reads look at later draws
                return m
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    break  # the child closed the terminal
                self.text += ANSI.sub("", chunk.decode(errors="replace"))
        raise AssertionError(f"{pattern!r} never drawn; last screen:\n{self.text[-3000:]}")

    def drain_until_exit(self, proc: subprocess.Popen, timeout: float = 30.0) -> int:
        """Read what the child still draws, as a terminal does, until it exits: a terminal that
        stopped reading would block its last draws (a full pseudo-terminal buffer)."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    os.read(self.fd, 65536)
                except OSError:
                    break  # the child closed the terminal
        return proc.wait(max(0.0, deadline - time.monotonic()))


def start_top(root: str, interval: str) -> Tuple["subprocess.Popen[bytes]", int]:
    """``persistent-delta top ROOT`` in a fresh pseudo-terminal (160 x 50); returns the process
    and the terminal's side to read."""
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="160",
               LINES="50", TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "persistent_delta", "top", root, "--interval", interval],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    return proc, master


def test_top_draws_and_redraws_in_a_terminal(tmp_path):
    root = str(tmp_path / "job")
    fill_ranks(root, lambda r, b: [("t0", torch.tensor([b, b + 1]), None)], ranks=2, batches=10)
    slow = DeltaConsumer(root, "slow")
    slow.poll(max_batches=3)
    slow.commit()
    proc, master = start_top(root, "0.3")
    try:
        screen = Screen(master)
        row = r"│\s*{rank}\s*│\s*slow\s*│\s*lookups\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*\d+\s*│[^│]*│\s*(\w+)"
        screen.read_until(r"RANK.*BATCH.*LOG-START")
        m = screen.read_until(row.format(rank=1))
        assert (m.group(1), m.group(2), m.group(3)) == ("3", "7", "ok")
        slow.poll()
        slow.commit()  # the next draw shows it caught up
        m = screen.read_until(row.format(rank=1).replace(r"(\d+)\s*│\s*(\d+)", r"(10)\s*│\s*(\d+)"))
        assert m.group(2) == "0"
        proc.send_signal(signal.SIGTERM)
        assert screen.drain_until_exit(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        slow.close()


def test_top_exits_on_sigterm_when_its_terminal_stopped_reading(tmp_path):
    """A terminal that stopped reading (a paused pager, a stuck ssh session) fills the
    pseudo-terminal's buffer and blocks top's draws, and then its last draw and its stop
    message on stderr. SIGTERM still ends it, with status 0: after the signal, output that
    cannot be written is given up (it used to wait on that write for good)."""
    root = str(tmp_path / "job")
    fill_ranks(root, lambda r, b: [("t0", torch.tensor([b, b + 1]), None)], ranks=2, batches=10)
    proc, master = start_top(root, "0.05")
    try:
        screen = Screen(master)
        screen.read_until(r"RANK.*BATCH.*LOG-START")  # drawing; from now on nobody reads
        deadline, blocked = time.monotonic() + 60, ""
        while time.monotonic() < deadline and not blocked:  # until a draw blocks in the tty's write
            time.sleep(0.5)
            with open(f"/proc/{proc.pid}/wchan") as f:
                where = f.read()
            blocked = where if where in ("wait_woken", "n_tty_write") else ""
        assert blocked, "top's draws never blocked on the terminal"
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_names_and_errors_from_data_are_drawn_with_control_characters_escaped():
    from rich.console import Console

    from persistent_delta.cli.top import View, draw, printable

    assert printable("ok-name") == "ok-name"
    assert printable("a\x1b[2Jb\n") == "a\\x1b[2Jb\\n"
    console = Console(width=120, record=True, file=open(os.devnull, "w"))
    console.print(draw(View(when=0.0, errors=["server said \x1b[2J[bold]hi"])))
    text = console.export_text()
    assert "\\x1b[2J[bold]hi" in text and "\x1b" not in text


def test_consumer_names_that_share_a_prefix_stay_apart_at_80_columns():
    """At 80 columns rich elided every one of these to ``serving.…``; each is drawn whole now
    (folded at worst, never cut)."""
    from rich.console import Console

    from persistent_delta.cli.top import View, draw
    from persistent_delta.ops.positions import ConsumerOffsets, RankOffsets

    names = ["serving.int8", "serving.quant", "serving.snapshots", "checkpoint.incremental-writer"]
    consumers = [ConsumerOffsets(n, "snapshots", 10, 0, 12, 2, 1, 40, 2560, time.time(), "trainer", "ok")
                 for n in names]
    view = View(when=time.time(), ranks=[RankOffsets(0, "/tmp/r0", 0, 12, 12, consumers)])
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(draw(view))
    text = console.export_text()
    assert "…" not in text, text
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if "CONSUMER " in line and "CHANNEL" in line)
    a, b = lines[head].index("CONSUMER"), lines[head].index("CHANNEL")
    drawn: list = []
    for line in lines[head + 2:]:  # (after the header's rule) a row, or a folded row's next line
        if not line.strip():
            break
        if line.startswith("└"):
            break
        piece = line[a:b].strip(" │")
        if line[:a].strip(" │"):
            drawn.append(piece)
        else:
            drawn[-1] += piece
    assert drawn == names, text
    assert "HEALTH" in text and text.count(" ok") >= len(names), text  # every column still drawn
