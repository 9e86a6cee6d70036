"""Tunables and durability levels, in one place.

Every default here can be overridden by a constructor argument; the ones operators need can also
be set with environment variables (read when a log is opened):

=================================  ==========================================================
``PERSISTENT_DELTA_DURABILITY``    ``sync`` | ``no_metasync`` | ``on_flush`` (default)
``PERSISTENT_DELTA_MAP_SIZE``      initial LMDB map size in bytes (default 1 GiB)
``PERSISTENT_DELTA_MAX_MAP_SIZE``  largest map the log may grow to (default 16 TiB)
``PERSISTENT_DELTA_MAX_READERS``   LMDB reader slots, fixed by the first opener (default 256)
``PERSISTENT_DELTA_TUNE_MALLOC``   ``1``: a writer raises glibc's malloc thresholds (default ``0``;
                                   see :mod:`persistent_delta.alloc`)
=================================  ==========================================================
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, replace


class Durability(enum.Enum):
    """What a crash can lose. A process crash (SIGKILL, OOM kill, segfault) loses nothing
    committed at every level: LMDB commits are atomic and the page cache survives the process.
    The levels differ on an OS crash or power loss:

    * ``SYNC``: every commit is fsynced (data and meta pages). Nothing committed is lost.
    * ``NO_METASYNC``: data pages are fsynced at commit, the meta page is not. The log stays
      consistent; the last commit(s) may be undone. ``flush()`` makes everything durable.
    * ``ON_FLUSH`` (default): no fsync at commit. Everything committed before the last
      ``flush()`` survives; later commits may be lost, and LMDB documents that the file can be
      damaged if the OS reorders writes (run ``persistent-delta verify`` after an OS crash).
      Call ``flush()`` before declaring a model checkpoint complete.
    """

    SYNC = "sync"
    NO_METASYNC = "no_metasync"
    ON_FLUSH = "on_flush"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _env_durability(default: Durability) -> Durability:
    raw = os.environ.get("PERSISTENT_DELTA_DURABILITY")
    if not raw:
        return default
    try:
        return Durability(raw)
    except ValueError:
        choices = ", ".join(d.value for d in Durability)
        raise ValueError(f"PERSISTENT_DELTA_DURABILITY={raw!r}: choose one of {choices}") from None


@dataclass(frozen=True)
class LogOptions:
    """Options of one log environment.

    Args:
        durability: see :class:`Durability`.
        map_size: initial LMDB map size in bytes. The map grows by itself (doubling) when full,
            so this is only a starting point; it is never shrunk below the current file size.
        max_map_size: the map never grows past this; a write that needs more raises
            :class:`~persistent_delta.errors.LogFullError`.
        max_readers: LMDB reader slots (fixed by the first process that opens the log).
        readahead: OS readahead on the map. Leave it on: cold reads were 40x slower without.
        tune_malloc: opt in to raising glibc's malloc thresholds once per process when a log
            is opened for writing, so LMDB's write buffers are reused instead of page-faulted
            in at every commit (appends of large values ~2x faster). Off by default because
            it is process-wide (see :mod:`persistent_delta.alloc`).
    """

    durability: Durability = Durability.ON_FLUSH
    map_size: int = 1 << 30
    max_map_size: int = 1 << 44
    max_readers: int = 256
    readahead: bool = True
    tune_malloc: bool = False

    @staticmethod
    def from_env(**overrides: object) -> "LogOptions":
        """Defaults, then environment variables, then ``overrides`` (non-None values)."""
        base = LogOptions(
            durability=_env_durability(Durability.ON_FLUSH),
            map_size=_env_int("PERSISTENT_DELTA_MAP_SIZE", 1 << 30),
            max_map_size=_env_int("PERSISTENT_DELTA_MAX_MAP_SIZE", 1 << 44),
            max_readers=_env_int("PERSISTENT_DELTA_MAX_READERS", 256),
            tune_malloc=_env_int("PERSISTENT_DELTA_TUNE_MALLOC", 0) != 0,
        )
        kw = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(kw.get("durability"), str):
            kw["durability"] = Durability(kw["durability"])
        opts = replace(base, **kw)  # type: ignore[arg-type]
        if opts.map_size <= 0 or opts.max_map_size < opts.map_size:
            raise ValueError(f"bad map sizes: map_size={opts.map_size}, max_map_size={opts.max_map_size}")
        return opts


@dataclass(frozen=True)
class WriterOptions:
    """Background writer tunables (see :mod:`persistent_delta.writer`).

    Args:
        max_pending_bytes: bytes of captured records the training thread may have queued
            before it waits for the writer (backpressure). Nothing is ever dropped.
        max_pending_steps: steps that may be queued before the training thread waits.
        torch_threads: intra-op threads for the writer thread's tensor work (filtering,
            dedup). The default 1 keeps it from starting a second OpenMP team that competes
            with training's for the cores; 0 leaves torch's setting.
        linger_steps / linger_s / linger_bytes: group commit of small steps. The writer
            starts a transaction once ``linger_steps`` steps or ``linger_bytes`` captured bytes
            are queued, or the oldest queued step has waited ``linger_s`` seconds, whichever
            comes first; a ``flush()`` (or anything that waits for the writer, such as
            ``get_unique``), backpressure and ``close()`` start it at once. Small steps (ids
            only) then share one transaction's fixed costs; large steps (embeddings) are
            processed as soon as they arrive, overlapping training (lingering them measured
            ~3% slower steps, the deferred work landing on the next read). A process crash
            loses at most what was not yet committed. ``linger_steps=1`` commits each step as
            soon as it is queued.
    """

    max_pending_bytes: int = 512 << 20
    max_pending_steps: int = 64
    torch_threads: int = 1
    linger_steps: int = 8
    linger_s: float = 0.25
    linger_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if self.max_pending_bytes <= 0 or self.max_pending_steps <= 0:
            raise ValueError("max_pending_bytes and max_pending_steps must be positive")
        if self.linger_steps < 1 or self.linger_s < 0 or self.linger_bytes < 0:
            raise ValueError(
                f"linger_steps must be >= 1, linger_s and linger_bytes >= 0; got {self.linger_steps}, "
                f"{self.linger_s}, {self.linger_bytes}"
            )
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")

