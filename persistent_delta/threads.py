"""How many torch intra-op threads the read path's own calls use.

Owns: the thread count a reader's polls, ``merged()`` and ``apply_poll`` run with
(``LogOptions.read_threads``, default 1), and how a thread of the library's own (the background
writer: ``WriterOptions.torch_threads``) sets its count for its life.

Why one thread: the read path copies rows (gather, concatenate, scatter into a replica's
tables) and is bound by memory, not by cores. With torch's OpenMP backend every parallel region
leaves its worker threads spinning for a while after it ends (libgomp's default wait policy).
On a machine whose cores a trainer keeps busy, a replica's spinning workers take those cores
from the trainer and from the replica's own main thread, so one thread gives a fresher replica
for less CPU, and costs little on an idle machine (figures: ``benchmarks/README.md``).

How: ``torch.set_num_threads`` around the call, restored after. With the OpenMP backend the
count is the calling thread's own (OpenMP's per-thread setting): other threads of the process
keep theirs; torch also takes it as the default of a thread that first runs a torch op while
it is in force. With any other backend the thread pool is process-wide, so the count is left
alone there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_per_thread: Optional[bool] = None


def _openmp() -> bool:
    global _per_thread
    if _per_thread is None:
        _per_thread = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _per_thread


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the body with ``n`` torch intra-op threads on the calling thread (0: unchanged)."""
    if n <= 0 or not _openmp():
        yield
        return
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def set_for_this_thread(n: int) -> None:
    """In a thread of the library's own: ``n`` intra-op threads for the rest of its life (0:
    unchanged). The thread that starts it wraps the start in :func:`default_kept`."""
    if n <= 0 or not _openmp():
        return
    torch.get_num_threads()  # this thread's lazy init first, so the setting sticks
    torch.set_num_threads(n)


@contextlib.contextmanager
def default_kept() -> Iterator[None]:
    """Give back torch's default count after the body, in which a thread started there ran
    :func:`set_for_this_thread` (``torch.set_num_threads`` also sets the default that threads
    starting later pick up; the caller's own count is its value before the body)."""
    if not _openmp():  # set_for_this_thread changes nothing there
        yield
        return
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["default_kept", "intra_op_threads", "set_for_this_thread"]
