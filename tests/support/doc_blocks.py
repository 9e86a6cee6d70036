"""The code blocks of README.md and docs/**/*.md, and running them as a reader would.

A page's blocks run in order in one fresh directory (so a command can read the log an earlier
block wrote), each Python block in a fresh namespace with the repository on ``sys.path``
(``from examples.tiny_model import tiny_trainer`` works as from a clone's root). In a
``console`` block every ``$ persistent-delta ...`` line runs (in process, through
:func:`persistent_delta.cli.main.main`, what the console script calls) and must exit 0; a
``yaml`` block (a configuration snippet) must load as a mapping. A block right after a
``<!-- fragment -->`` line is not run: used only where a block needs what a page cannot build
(a multi-rank managed-collision trainer, say); shell blocks other than
``console`` (``bash``: make, pip, servers on your hosts) and ``text`` are never run.

A page whose Python blocks read ``NATS_URL`` gets a local NATS JetStream server
(:class:`persistent_delta.testing.LocalServer`, 127.0.0.1, a free port) for its blocks, its
address in ``NATS_URL``.

``python doc_blocks.py PAGE...`` runs the pages' blocks and prints one JSON line per block.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```\s*$", re.M | re.S)
FRAGMENT = "<!-- fragment -->"
RESULT = "doc-block-result: "  # prefix of the result lines (the blocks print too)


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    fragment: bool

    @property
    def runs(self) -> bool:
        return not self.fragment and self.lang in ("python", "console", "yaml")


def doc_pages() -> List[str]:
    """README.md and every Markdown page under docs/, relative to the repository."""
    pages = ["README.md"]
    for base, _, files in os.walk(os.path.join(REPO, "docs")):
        pages += sorted(os.path.relpath(os.path.join(base, f), REPO) for f in files if f.endswith(".md"))
    return pages


def blocks(page: str) -> List[Block]:
    """The fenced code blocks of ``page``, in order."""
    text = open(os.path.join(REPO, page)).read()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip().splitlines()
        fragment = bool(before) and before[-1].strip() == FRAGMENT
        indent = len(m.group("indent"))
        body = "\n".join(line[indent:] for line in m.group("body").splitlines())
        out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group("lang"), body, fragment))
    return out


def console_commands(code: str) -> List[str]:
    """The ``$ persistent-delta ...`` lines of a console block (comments stripped)."""
    cmds = []
    for line in code.splitlines():
        if line.startswith("$ persistent-delta "):
            cmds.append(line[2:].split(" #", 1)[0].strip())
    return cmds


def run_block(block: Block) -> None:
    """Run one block in the current directory; raise on failure."""
    if block.lang == "python":
        code = compile(block.code, f"{block.page}:{block.line}", "exec")
        exec(code, {"__name__": "__main__"})
        return
    if block.lang == "yaml":  # a configuration snippet: it must at least load
        import yaml

        if not isinstance(yaml.safe_load(block.code), dict):
            raise ValueError("a yaml block that is not a mapping")
        return
    from persistent_delta.cli.main import main as cli_main  # what the console script runs

    for cmd in console_commands(block.code):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):  # rich writes to sys.stdout
            rc = cli_main(shlex.split(cmd)[1:], stdout=out)
        if rc != 0:
            raise RuntimeError(f"`{cmd}` exited {rc}:\n{out.getvalue()}\n{err.getvalue()}")


def main(pages: List[str]) -> int:
    sys.path.insert(0, REPO)
    failed = 0
    for page in pages:
        with tempfile.TemporaryDirectory(prefix="pd-docs-") as cwd:
            os.chdir(cwd)
            server = None
            if any(b.runs and b.lang == "python" and "NATS_URL" in b.code for b in blocks(page)):
                from persistent_delta.testing import LocalServer

                server = LocalServer(os.path.join(cwd, "nats"))
                server.start()
                os.environ["NATS_URL"] = server.url
            for block in blocks(page):
                if not block.runs:
                    continue
                t0 = time.monotonic()
                error = None
                try:
                    run_block(block)
                except BaseException:  # report every block's failure, keep going
                    error = traceback.format_exc()
                    failed += 1
                print("\n" + RESULT + json.dumps(dict(asdict(block), ok=error is None, error=error,
                                      seconds=round(time.monotonic() - t0, 2))), flush=True)
            if server is not None:
                server.stop()
            os.chdir(REPO)
    import gc
    gc.collect()  # close what the examples left open before the interpreter exits
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
