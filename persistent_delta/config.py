"""Tunables and durability levels, in one place.

Owns: every tunable's default and how a setting is resolved. Everywhere (trackers, stores,
consumers, tools) a setting resolves the same way: **an explicit argument, then the
``PERSISTENT_DELTA_*`` environment variable, then the default** (:meth:`LogOptions.resolve`).
The environment variables (read when a log is opened):

=====================================  ==========================================================
``PERSISTENT_DELTA_DURABILITY``        ``sync`` | ``no_metasync`` | ``on_flush`` (default)
``PERSISTENT_DELTA_MAP_SIZE``          initial LMDB map size in bytes (default 1 GiB)
``PERSISTENT_DELTA_MAX_MAP_SIZE``      largest map the log may grow to (default 16 TiB)
``PERSISTENT_DELTA_MAX_READERS``       LMDB reader slots, fixed by the first opener (default 256)
``PERSISTENT_DELTA_TUNE_MALLOC``       ``1``: a writer raises glibc's malloc thresholds (default ``0``;
                                       see :mod:`persistent_delta.log.alloc`)
``PERSISTENT_DELTA_RETENTION_*``       ``MAX_BATCHES`` / ``MAX_BYTES``: the retention bound (default
                                       off; see :class:`RetentionBound`)
``PERSISTENT_DELTA_GROUP_ACCESS``      ``1``: logs created group-readable/writable (default owner-only)
``PERSISTENT_DELTA_READ_THREADS``      torch intra-op threads of a reader's polls and ``apply_poll``
                                       (default 1; ``0``: the process's own setting)
``PERSISTENT_DELTA_STALL_AFTER_S``     the least time without a commit, while data arrives, before
                                       a consumer's health says stalled (default 30; see
                                       :mod:`persistent_delta.ops.health`)
``PERSISTENT_DELTA_STREAM_KEY_FILE``   the job's stream key file(s) for shippers and remote consumers
                                       (``os.pathsep``-separated: the first signs, any verifies;
                                       see :mod:`persistent_delta.fleet.auth`)
=====================================  ==========================================================
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, fields, replace
from typing import List, Optional, Union

from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

from persistent_delta.errors import InvalidInputError


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
        raise InvalidInputError(f"{name}={raw!r} is not an integer") from None


#: A consumer's health (:mod:`persistent_delta.ops.health`) says stalled only after at least this
#: long without a commit: a consumer that just started has no window of its own to judge by.
STALL_AFTER_S = 30.0


def stall_after_s(value: Optional[float] = None) -> float:
    """The stall threshold: ``value``, then ``PERSISTENT_DELTA_STALL_AFTER_S``, then
    :data:`STALL_AFTER_S`.

    Raises:
        InvalidInputError: the environment variable is not a non-negative number.
    """
    if value is not None:
        return float(value)
    raw = os.environ.get("PERSISTENT_DELTA_STALL_AFTER_S")
    if not raw:
        return STALL_AFTER_S
    try:
        out = float(raw)
    except ValueError:
        raise InvalidInputError(f"PERSISTENT_DELTA_STALL_AFTER_S={raw!r} is not a number of seconds") from None
    if out < 0:
        raise InvalidInputError(f"PERSISTENT_DELTA_STALL_AFTER_S={raw!r} must be >= 0")
    return out


#: A long-running command (``ship``, ``exporter``, ``top``) stopped by SIGTERM/SIGINT ends its loop;
#: one still running this long after the signal -- blocked in a system call or a wait on the
#: server -- is interrupted (:mod:`persistent_delta.cli.stopping`), so it exits within a second.
STOP_GRACE_S = 0.5

#: The metrics endpoint (:mod:`persistent_delta.ops.endpoint`): handler threads (beside its one
#: acceptor thread), how long a connection may stay silent before it is closed, and how many may be
#: open at once (past it the oldest idle one is closed to admit a new one).
METRICS_HANDLER_THREADS = 4
METRICS_READ_TIMEOUT_S = 10.0
METRICS_MAX_CONNECTIONS = 64

STREAM_KEY_FILE_ENV = "PERSISTENT_DELTA_STREAM_KEY_FILE"


def stream_key_files() -> List[str]:
    """The stream key files named by ``PERSISTENT_DELTA_STREAM_KEY_FILE`` (``os.pathsep``-separated;
    the first signs, any verifies), or ``[]``."""
    raw = os.environ.get(STREAM_KEY_FILE_ENV, "")
    return [p for p in raw.split(os.pathsep) if p]


def _env_durability(default: Durability) -> Durability:
    raw = os.environ.get("PERSISTENT_DELTA_DURABILITY")
    if not raw:
        return default
    try:
        return Durability(raw)
    except ValueError:
        choices = ", ".join(d.value for d in Durability)
        raise InvalidInputError(f"PERSISTENT_DELTA_DURABILITY={raw!r}: choose one of {choices}") from None


#: The most LMDB reader slots a log may ask for (its reader table takes 64 bytes a slot).
MAX_READERS_LIMIT = 1 << 20


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
        readahead: read each record ahead, whole, before it is used
            (:class:`~persistent_delta.log.lmdbenv.Prefetch`). The map itself is read page by
            page (no OS readahead), so a cold open or a short read costs what it touches, not
            the device's readahead window around every page. Leave it on: without it a cold
            read of a large record faults in its pages one by one.
        group_access: create logs group-readable and -writable (files 0660, directories 0770,
            whatever the umask) so that readers running as another user of the group work;
            default owner-only (0600 / 0700). Environment: ``PERSISTENT_DELTA_GROUP_ACCESS=1``.
        tune_malloc: opt in to raising glibc's malloc thresholds once per process when a log
            is opened (writing or reading), so LMDB's write buffers and a reader's poll results
            are reused instead of page-faulted in afresh (faster appends of large values; a
            poll's one buffer is kept by glibc itself up to its 32 MiB mmap-threshold maximum).
            Off by default because it is process-wide (see :mod:`persistent_delta.log.alloc`).
        read_threads: torch intra-op threads a reader's polls, ``merged()`` and
            :func:`~persistent_delta.serve.apply.apply_poll` run with (default 1; 0: the process's
            own setting). The read path is memory-bound; parallel regions leave OpenMP's
            workers spinning after them, which on a machine shared with a trainer took cores
            from the trainer and doubled a replica's p99 freshness (see
            :mod:`persistent_delta.threads`). Environment: ``PERSISTENT_DELTA_READ_THREADS``.
    """

    durability: Durability = Durability.ON_FLUSH
    map_size: int = 1 << 30
    max_map_size: int = 1 << 44
    max_readers: int = 256
    readahead: bool = True
    tune_malloc: bool = False
    group_access: bool = False
    read_threads: int = 1

    @property
    def file_mode(self) -> int:
        """Permissions of the files a writer creates: owner-only by default (embedding values
        and optimizer state are data); ``group_access`` adds group read/write (LMDB readers
        write ``lock.mdb``, so a reader in the group needs write access)."""
        return 0o660 if self.group_access else 0o600

    @property
    def dir_mode(self) -> int:
        return 0o770 if self.group_access else 0o700

    @staticmethod
    def resolve(
        durability: Optional[Union[Durability, str]] = None,
        map_size: Optional[int] = None,
        max_map_size: Optional[int] = None,
        max_readers: Optional[int] = None,
        tune_malloc: Optional[bool] = None,
        group_access: Optional[bool] = None,
        read_threads: Optional[int] = None,
    ) -> "LogOptions":
        """The options in force: each explicit (non-None) argument, else its environment
        variable, else the default.

        Raises:
            InvalidInputError: a bad value (argument or environment variable).
        """
        d = LogOptions()
        base = LogOptions(
            durability=_env_durability(d.durability),
            map_size=_env_int("PERSISTENT_DELTA_MAP_SIZE", d.map_size),
            max_map_size=_env_int("PERSISTENT_DELTA_MAX_MAP_SIZE", d.max_map_size),
            max_readers=_env_int("PERSISTENT_DELTA_MAX_READERS", d.max_readers),
            tune_malloc=_env_int("PERSISTENT_DELTA_TUNE_MALLOC", int(d.tune_malloc)) != 0,
            group_access=_env_int("PERSISTENT_DELTA_GROUP_ACCESS", int(d.group_access)) != 0,
            read_threads=_env_int("PERSISTENT_DELTA_READ_THREADS", d.read_threads),
        )
        explicit = dict(durability=durability, map_size=map_size, max_map_size=max_map_size,
                        max_readers=max_readers, tune_malloc=tune_malloc, group_access=group_access,
                        read_threads=read_threads)
        kw = {k: v for k, v in explicit.items() if v is not None}
        if isinstance(kw.get("durability"), str):
            try:
                kw["durability"] = Durability(kw["durability"])
            except ValueError:
                raise InvalidInputError(f"unknown durability {kw['durability']!r}") from None
        return replace(base, **kw)  # type: ignore[arg-type]

    from_env = resolve  # the name before 0.2

    def __post_init__(self) -> None:
        if not isinstance(self.durability, Durability):
            raise InvalidInputError(f"durability must be a Durability, got {self.durability!r}")
        if self.map_size <= 0 or self.max_map_size < self.map_size:
            raise InvalidInputError(f"bad map sizes: map_size={self.map_size}, max_map_size={self.max_map_size}")
        if self.max_map_size > 1 << 62:
            raise InvalidInputError(f"max_map_size must be at most 2**62 bytes, got {self.max_map_size}")
        if not 1 <= self.max_readers <= MAX_READERS_LIMIT:  # LMDB's reader table: an unsigned int, 64 B a slot
            raise InvalidInputError(f"max_readers must be between 1 and {MAX_READERS_LIMIT}, got {self.max_readers} "
                                    "(PERSISTENT_DELTA_MAX_READERS or LogOptions(max_readers=))")
        if isinstance(self.read_threads, bool) or not isinstance(self.read_threads, int) or self.read_threads < 0:
            raise InvalidInputError(
                f"read_threads must be an integer >= 0 (0: the process's setting), got {self.read_threads!r}")


@dataclass(frozen=True)
class WriterOptions:
    """Background writer tunables (see :mod:`persistent_delta.trainer.writer`).

    Args:
        max_pending_bytes: bytes of captured records the training thread may have queued
            before it waits for the writer (backpressure). Nothing is ever dropped.
        max_pending_steps: steps that may be queued before the training thread waits.
        torch_threads: intra-op threads for the writer thread's tensor work (filtering,
            dedup). The default 1 keeps it from starting a second OpenMP team that competes
            with training's for the cores; 0 leaves torch's setting.
        linger_steps: group commit of small steps: the writer starts a transaction once this
            many steps are queued, or ``linger_bytes`` captured bytes are, or the oldest queued
            step has waited ``linger_s`` seconds, whichever comes first; a ``flush()`` (or
            anything that waits for the writer, such as ``get_unique``), backpressure and
            ``close()`` start it at once. Small steps (ids only) then share one transaction's
            fixed costs; large steps (embeddings) are processed as soon as they arrive,
            overlapping training (lingering them would move their work onto the next read,
            which waits for it). A process crash loses at most what was not yet committed.
            ``linger_steps=1`` commits each step as soon as it is queued.
        linger_s: the longest a queued step waits for the group commit (see ``linger_steps``).
        linger_bytes: captured bytes that start the group commit at once (see ``linger_steps``),
            and where one transaction stops gathering: a backlog of larger steps commits one
            step a transaction (a step's records always go in one).
        inline_publish: ``publish()`` commits its transaction (the rows it gathered, with the
            step's records captured so far) itself, on the calling thread, after what the
            writer thread was handed before (:meth:`~persistent_delta.trainer.writer.BackgroundWriter.commit_inline`):
            the transaction starts at once, instead of after a hand-off to the writer thread,
            which must first get the GIL and a core (on a busy host, a tail of tens of ms in a
            replica's freshness). The call then lasts the commit too (the encode, checksums,
            row-format conversions and LMDB's commit of the publish; with
            ``Durability.SYNC``, its fsync): work on the training thread that the writer thread
            does otherwise. ``False`` (the default): handed to the writer thread; the call
            returns after the gather. Turn it on where freshness matters more than the
            training thread's time (figures: ``docs/performance.md``).
    """

    max_pending_bytes: int = 512 << 20
    max_pending_steps: int = 64
    torch_threads: int = 1
    linger_steps: int = 8
    linger_s: float = 0.25
    linger_bytes: int = 4 << 20
    inline_publish: bool = False

    def __post_init__(self) -> None:
        if self.max_pending_bytes <= 0 or self.max_pending_steps <= 0:
            raise InvalidInputError("max_pending_bytes and max_pending_steps must be positive")
        if self.linger_steps < 1 or self.linger_s < 0 or self.linger_bytes < 0:
            raise InvalidInputError(
                f"linger_steps must be >= 1, linger_s and linger_bytes >= 0; got {self.linger_steps}, "
                f"{self.linger_s}, {self.linger_bytes}"
            )
        if self.torch_threads < 0:
            raise InvalidInputError(f"torch_threads must be >= 0, got {self.torch_threads}")


    def with_overrides(self, **overrides: object) -> "WriterOptions":
        """These options with each non-None override applied (validated)."""
        names = {f.name for f in fields(self)}
        unknown = set(overrides) - names
        if unknown:
            raise InvalidInputError(f"unknown writer options {sorted(unknown)}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]


@dataclass(frozen=True)
class RetentionBound:
    """How far a registered consumer may fall behind the log end before it is expired (see
    :mod:`persistent_delta.log.position_rules`). Off by default: a registered consumer then holds back
    ``delete_on_read`` retention without limit, like a durable subscription.

    Args:
        max_batches: expire a consumer more than this many batches behind the log end.
        max_bytes: expire consumers, oldest first, while the records they hold back (stored
            bytes of their channel from the lowest position to its end) exceed this.

    The bound applies to each channel on its own: lookups consumers (the trainer's, out-of-
    process ones, a shipper's) and snapshots consumers (a replica's, a shipper's), in batches
    and in bytes of that channel.

    An expired consumer no longer holds back retention; its next read gets
    :class:`~persistent_delta.errors.OffsetOutOfRangeError` (or its reset policy), and a commit
    re-arms it. Environment: ``PERSISTENT_DELTA_RETENTION_MAX_BATCHES``,
    ``PERSISTENT_DELTA_RETENTION_MAX_BYTES``.
    """

    max_batches: Optional[int] = None
    max_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_batches", "max_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InvalidInputError(f"RetentionBound.{name} must be a positive int or None, got {v!r}")

    @property
    def enabled(self) -> bool:
        return self.max_batches is not None or self.max_bytes is not None

    @staticmethod
    def resolve(max_batches: Optional[int] = None, max_bytes: Optional[int] = None) -> "RetentionBound":
        """Explicit arguments, then the environment variables, then off."""

        def env(name: str) -> Optional[int]:
            v = _env_int(name, 0)
            return v if v > 0 else None

        return RetentionBound(
            max_batches=max_batches if max_batches is not None else env("PERSISTENT_DELTA_RETENTION_MAX_BATCHES"),
            max_bytes=max_bytes if max_bytes is not None else env("PERSISTENT_DELTA_RETENTION_MAX_BYTES"),
        )


@dataclass
class PersistentTrackerConfig(DeltaTrackerConfig):
    """TorchRec's ``DeltaTrackerConfig`` plus where and how to persist.

    Every setting left at ``None`` resolves as everywhere in the library: the
    ``PERSISTENT_DELTA_*`` environment variable, then the default
    (:mod:`persistent_delta.config`).

    Args:
        path: log root; rank ``r`` writes ``<path>/rank-<r>``. Required.
        durability: what a crash can lose (see :class:`~persistent_delta.Durability`).
        fresh: start a fresh log, discarding what ``<path>/rank-<r>`` holds. Without it, opening
            a log written with another tracking mode or table set raises ``ConfigMismatchError``.
        async_writes: commit from a background thread (default). ``False`` commits each step
            on the training thread (simpler to reason about, slower).
        writer: the background writer's options (:class:`~persistent_delta.config.WriterOptions`).
        retention: the retention bound (:class:`~persistent_delta.config.RetentionBound`; off).
        map_size: initial LMDB map size (it grows by itself).
        tune_malloc: ``True`` raises glibc's malloc thresholds for this process (faster
            commits of large records; process-wide, see :mod:`persistent_delta.log.alloc`).
        max_pending_bytes: shortcut for ``writer.max_pending_bytes``; a shortcut that is set
            wins over ``writer``.
        max_pending_steps: shortcut for ``writer.max_pending_steps``.
        writer_torch_threads: shortcut for ``writer.torch_threads`` (default 1; 0 leaves
            torch's setting).
        linger_steps: shortcut for ``writer.linger_steps``.
        linger_s: shortcut for ``writer.linger_s``.
        linger_bytes: shortcut for ``writer.linger_bytes``.
        rank: this process's rank; default ``torch.distributed.get_rank()`` (0 when not
            initialised).
        zch_raw_ids: record managed-collision tables' raw ids and slot reassignments (side
            records, :mod:`persistent_delta.trainer.zch_capture`; default True). False records their slot ids
            only, as any table's.
        track_eval: record the lookups of forwards run in eval mode too (default True, as TorchRec's
            tracker: every forward is recorded, a validation pass's rows included, though it
            changes no row). False skips the lookups made while the tracked modules are in eval
            mode (``model.eval()``); the batch index still advances with every forward.
    """

    path: str = ""
    durability: Optional[Durability] = None
    fresh: bool = False
    async_writes: bool = True
    writer: Optional[WriterOptions] = None
    retention: Optional[RetentionBound] = None
    map_size: Optional[int] = None
    tune_malloc: Optional[bool] = None
    max_pending_bytes: Optional[int] = None
    max_pending_steps: Optional[int] = None
    writer_torch_threads: Optional[int] = None
    linger_steps: Optional[int] = None
    linger_s: Optional[float] = None
    linger_bytes: Optional[int] = None
    rank: Optional[int] = None
    zch_raw_ids: bool = True
    track_eval: bool = True

    def writer_options(self) -> WriterOptions:
        """The writer's options: ``writer`` (or the defaults) with the shortcuts applied."""
        return (self.writer or WriterOptions()).with_overrides(
            max_pending_bytes=self.max_pending_bytes, max_pending_steps=self.max_pending_steps,
            torch_threads=self.writer_torch_threads, linger_steps=self.linger_steps, linger_s=self.linger_s,
            linger_bytes=self.linger_bytes,
        )

    def validate(self) -> None:
        """Raise :class:`InvalidInputError` for a config no tracker can use."""
        if not self.path:
            raise InvalidInputError("PersistentTrackerConfig.path is required (the log root directory)")
        if not isinstance(self.tracking_mode, TrackingMode):
            raise InvalidInputError(f"tracking_mode must be a TrackingMode, got {self.tracking_mode!r}")

    def log_options(self) -> LogOptions:
        return LogOptions.resolve(durability=self.durability, map_size=self.map_size, tune_malloc=self.tune_malloc)
