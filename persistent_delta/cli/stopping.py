"""How the long-running commands (``ship``, ``exporter``, ``top``) stop on SIGTERM/SIGINT.

Owns: their signal handlers, and the rule that they exit within a second of the signal
whatever they are blocked on.

Design note
-----------
The first signal sets the command's stop event: each command's loop watches it and ends as it
would at its end (the shipper after its step, the exporter closing its endpoint, ``top`` its
screen). A handler that only sets an event is not enough when the main thread is blocked
elsewhere: Python runs the handler, then retries the interrupted system call (PEP 475: a
blocking ``open`` of a FIFO waits again), and a wait on the server goes on to its timeout. So
the first signal also wakes a timer thread: while the command is still inside its
:class:`StopOnSignals` block :data:`~persistent_delta.config.STOP_GRACE_S` later, the timer
sends the signal again to the main thread (``pthread_kill``), which interrupts the blocked
call, and this time the handler raises :class:`SystemExit` -- not an ``Exception``, so the
library's ``except Exception`` retries let it through while its ``with`` and ``finally``
blocks still close what they opened. The timer sends it again every grace period in case
some layer held it up. On leaving the block, an exception raised after the signal becomes
:class:`~persistent_delta.errors.CommandStoppedError`, which ``main`` reports on stderr
before exiting 0. Run as the program, ``main`` then ends the process at once
(:func:`exit_now`): the interpreter's teardown alone takes over half a second once torch is
loaded.

Thread-safety: enter and leave the block on one thread; handlers are installed only when that
is the main thread (elsewhere only the caller's event stops the command).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, Callable, Dict, NoReturn, Optional, Type

from persistent_delta.config import STOP_GRACE_S
from persistent_delta.errors import CommandStoppedError

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_stopped_by = 0  # the signal that stopped a command of this process (0: none)


def stopped_by() -> int:
    """The signal that stopped a long-running command in this process, or 0."""
    return _stopped_by


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` at once, after flushing stdout, stderr and the log
    handlers: for a command run as the program that a signal stopped, which has closed what it
    opened. The interpreter's teardown (over half a second once torch is loaded) would delay
    the exit a supervisor waits for, and it has nothing left to release. The flushes are
    :func:`bounded`: a terminal or pipe that stopped reading would block them, and keep the
    stopped command alive, for good."""
    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        logging.shutdown()

    bounded(flush)
    os._exit(code)


def bounded(fn: Callable[[], None], timeout: float = STOP_GRACE_S / 2) -> None:
    """Run ``fn`` (a write to the command's output) for at most ``timeout`` seconds, on a
    daemon thread: after a stop signal, output that cannot be written (a terminal that stopped
    reading) is given up, not waited for. (Two of them -- the stop message, the last flushes
    -- after the grace period keep the exit within a second of the signal.)"""
    thread = threading.Thread(target=fn, name="persistent-delta-stop-output", daemon=True)
    thread.start()
    thread.join(timeout)


class StopOnSignals:
    """A block in which SIGTERM/SIGINT set ``event`` and, ``grace_s`` later, interrupt what the
    main thread is blocked on (see the module's design note).

    Args:
        event: the command's stop event, watched by its loop.
        what: names the command in the error (``"ship"``).
        grace_s: how long the loop has to end by itself (default
            :data:`~persistent_delta.config.STOP_GRACE_S`).

    Raises:
        CommandStoppedError: on leaving the block, when it ended by an exception after a signal
            (interrupted, or failing because it was).
    """

    def __init__(self, event: threading.Event, what: str, grace_s: Optional[float] = None) -> None:
        self.event = event
        self.what = what
        self.grace_s = STOP_GRACE_S if grace_s is None else float(grace_s)
        self.signum = 0  # the signal that stopped the command (0: none yet)
        self.interrupted = False
        self._done = threading.Event()
        self._signalled = threading.Event()
        self._saved: Dict[int, Any] = {}
        self._timer: Optional[threading.Thread] = None
        self._main = threading.main_thread().ident

    def __enter__(self) -> "StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            # started here, not in the handler: the main thread may hold threading's own locks
            # (starting a thread of its own) at the moment the handler runs
            self._timer = threading.Thread(target=self._interrupt, name="pd-stop", daemon=True)
            self._timer.start()
            for sig in SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self._done.is_set():
            return
        if self.signum:  # sent again by the timer (or by the user): the loop did not end in time
            self.interrupted = True
            raise SystemExit(0)
        self.signum = signum
        self.event.set()
        self._signalled.set()

    def _interrupt(self) -> None:
        self._signalled.wait()
        while not self._done.wait(self.grace_s):
            assert self._main is not None
            signal.pthread_kill(self._main, self.signum)

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._done.set()
        self._signalled.set()
        if self._timer is not None:
            self._timer.join()  # no signal of ours is in flight once the handlers are restored
        for sig, old in self._saved.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if self.signum:
            global _stopped_by
            _stopped_by = self.signum
        if exc is None or not self.signum or isinstance(exc, CommandStoppedError):
            return
        name = signal.Signals(self.signum).name
        if self.interrupted:
            why = f"it was still running {self.grace_s:g} s after the signal (blocked), so it was interrupted"
        else:
            why = f"it was interrupted: {exc}"
        raise CommandStoppedError(f"{self.what} stopped by {name}: {why}", signal=self.signum) from exc
