"""Exceptions raised by persistent_delta.

Owns: the error types; each says what a caller can do about it.

Every failure a caller can act on has its own subclass of :class:`PersistentDeltaError`; the
message says what happened, why, and how to fix it. Library errors (py-lmdb, msgpack) are
wrapped with ``raise ... from exc`` so the original cause stays visible.

The errors come in families, one base class each, so a caller can catch a kind of failure:

- :class:`UsageError`: the call cannot work as made (an argument, the call order, a closed
  handle, a handle carried across a fork); fix the calling code.
- :class:`LogError`: a log on disk cannot be opened, read or written as asked (not a log,
  another format or configuration, a damaged record, a full disk, permissions, the writer lock).
- :class:`ConsumerError`: a consumer or its position (unknown, out of range, moved meanwhile,
  the wrong role, a poll short of some ranks).
- :class:`WriterError`: the tracker's background writer failed.
- :class:`CheckpointError`: a base or an increment cannot be used for a restore.
- :class:`StreamError`: across hosts -- the stream server, the job's stream and buckets, the
  stream key, and :class:`RejectedMessageError`, a message a reader refuses and skips (it does
  not authenticate or does not fit the job's tables).
- :class:`CommandStoppedError` stands alone: a command stopped on request, not a failure.

Every class has a ``retriable`` class attribute: True when the same call, made again later
unchanged, can succeed without anyone acting first (the stream server unreachable or slow, a
lock held by another process, ranks that have not completed a batch yet); False when something
must change first (the input, the configuration, the data, the disk, a permission). A retry
loop asks ``exc.retriable`` instead of listing classes.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Optional


class PersistentDeltaError(Exception):
    """Base class of every error raised on purpose by persistent_delta.

    ``retriable`` (a class attribute): whether the same call, made again later unchanged, can
    succeed without anyone acting first. False unless a class says otherwise."""

    retriable: ClassVar[bool] = False


# ---------------------------------------------------------------- usage

class UsageError(PersistentDeltaError):
    """The call cannot work as made: a malformed argument, inputs in the wrong order, a handle
    used after ``close()`` or carried across a fork, a range the log cannot answer exactly. Fix
    the calling code; nothing was written."""


class InvalidInputError(UsageError, ValueError):
    """An argument is malformed: float or negative ids, states whose rows differ from the ids,
    a negative or decreasing ``batch_idx``, an invalid consumer name, a bad range."""


class RankDirectoryError(InvalidInputError):
    """A rank's log directory (``<root>/rank-<r>``, holding ``data.mdb``) was given where a job's
    log root is expected: readers, consumers, shippers and the tools read every rank of the job
    from the root. Pass the parent directory the message names (to read some ranks only, pass
    ``ranks=`` too). ``path`` is the path given, ``rank`` its rank, ``root`` the parent."""

    def __init__(self, message: str, path: str = "", rank: int = 0, root: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.rank = rank
        self.root = root


class OrderError(InvalidInputError):
    """Inputs that cannot be applied in this order: a gap, an overlap, or an input out of order."""


class StaleBaseError(OrderError):
    """A snapshots poll does not continue the tables it was to be applied to: on some rank it
    starts after the position they continue from -- the base's (its batch, or the publish
    after it), then the end of the poll applied before. The publishes in between are in
    neither, so their rows would be served stale with nothing to say so: a replica restarted
    with an old base and its consumer's committed position, or registered after the publishes
    following its base were deleted (``delete_on_read``). Nothing was applied. Start from a
    fresh base (``save_local_shards`` again on the trainer, then ``load_base``; across hosts
    ``RemoteConsumer.bootstrap()``). ``rank``, ``start`` (the poll's first position) and
    ``position`` (where the tables continue from) say where."""

    def __init__(self, message: str, rank: int = 0, start: int = 0, position: int = 0) -> None:
        super().__init__(message)
        self.rank = rank
        self.start = start
        self.position = position


class ReplicaMismatchError(InvalidInputError):
    """A poll cannot be applied exactly to an inference model's tables: a table the model lacks,
    a table of other rows or dimension, or rows of a format that would not give TorchRec's own
    quantized bytes (bfloat16 rows into an int8 table). Nothing was written."""


class ServingLockError(InvalidInputError):
    """An apply was called on a thread that holds the replica's read side (from inside
    ``InferenceReplica.serving()`` or a request): it would wait for itself forever. Nothing was
    written; apply from the consumer loop's thread."""


class UnsupportedTrackingError(InvalidInputError, AssertionError):
    """A tracking mode the model cannot serve, refused as TorchRec refuses it (an
    ``AssertionError`` there, with the same text), e.g. EMBEDDING on an EmbeddingBagCollection."""


class UnsupportedModeError(InvalidInputError, NotImplementedError):
    """A tracking mode this library does not implement (TorchRec raises
    ``NotImplementedError``)."""


class LogClosedError(UsageError):
    """The store, log or tracker was used after ``close()``."""


class ForkedProcessError(UsageError):
    """An LMDB environment opened in one process was used from a forked child."""


class InexactRangeError(UsageError):
    """A batch range the log cannot answer exactly: the trainer's window filter stored each
    row once per read window, so a range starting inside such a window would miss the rows
    recorded earlier in it. The message names the exact alternatives."""


# ---------------------------------------------------------------- the log

class LogError(PersistentDeltaError):
    """A log on disk (or data in the log's formats) cannot be opened, read or written as asked:
    not a log, another format version or configuration, a damaged record or file, a full disk,
    an I/O error, permissions, or the writer lock held by another process."""


class NotALogError(LogError):
    """The directory does not hold a persistent_delta log (and creating one was not asked for)."""


class FormatMismatchError(LogError):
    """The log, or a checkpoint base or increment part, was written with another format version,
    and cannot be read by this one."""


class ConfigMismatchError(LogError):
    """The log was written with another update mode, tracking mode or table set."""


class WorldSizeMismatchError(ConfigMismatchError):
    """A checkpoint's tracker state does not fit this job's ranks: it was saved with another
    world size, or it holds no state for this rank (only other ranks'). Each rank's log and
    table shards belong to the layout they were written with, so another rank's state (or
    none) is never loaded in its place. Restore with the world size the checkpoint was saved
    with; to go on with another, start a fresh log (``PersistentTrackerConfig(fresh=True)`` or
    another path) and give replicas a new base."""


class CorruptRecordError(LogError):
    """A stored record failed its checksum or could not be decoded."""


class DamagedLogError(CorruptRecordError):
    """The LMDB file itself is damaged (truncated, meta pages inconsistent, a broken B-tree):
    opening or reading it could kill the process (SIGBUS) or return wrong data, so it is not
    opened. The message names the file."""


class LogFullError(LogError):
    """The disk is full (or the map cannot grow further); nothing committed was lost."""


class LogIOError(LogError):
    """An I/O error from the disk (EIO) while the filesystem has space: the device, not the log,
    failed. Nothing committed before it was lost; the log is reopened at its last commit."""

    retriable = True  # the log is reopened at its last commit; the device may recover


class ReadOnlyLogError(LogError):
    """A write was attempted on a log opened read-only, or the directory is not writable."""


class LogAccessError(LogError, PermissionError):
    """This user may not read the log (its root or a rank directory is owner-only and owned by
    another user). Run as the log's owner, or create the log with group access
    (``PERSISTENT_DELTA_GROUP_ACCESS=1``) and join its group."""


class LogOwnershipError(LogError, PermissionError):
    """A rank directory or data file is owned by another uid than the log root (or is a
    symbolic link): another user may have planted it, so it is not read. Remove it and keep the
    log root writable by its owner only."""


class LogLockedError(LogError):
    """Another process (or another open handle in this process) holds the log's writer lock."""

    retriable = True  # the holder may stop, or its claim expire


# ---------------------------------------------------------------- consumers and positions

class ConsumerError(PersistentDeltaError):
    """A consumer or its position: an unknown name, a position outside the log, a position
    moved by someone else, the wrong role, or a poll that lacks some ranks' part."""


class UnknownConsumerError(ConsumerError, KeyError, AssertionError):
    """The consumer name is not registered in the log. Also an ``AssertionError``: TorchRec's
    tracker asserts on an unknown consumer in ``get_unique``/``clear``, and code written
    against it catches that."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class OffsetOutOfRangeError(ConsumerError):
    """A consumer position lies below the log start (its data was deleted) or past its end."""


class ConsumerConflictError(ConsumerError):
    """A consumer's position moved between a read and the commit of that read (another
    writer changed it); the read is not committed."""


class ConsumerRoleError(ConsumerError):
    """A trainer's consumer was asked for the use it does not have: ``get_unique`` (or
    ``consume_exact``) on a consumer that publishes, or ``publish`` on one that reads. Both move
    the one position the consumer has, so mixing them loses rows silently (a publish after a
    read carries nothing of what was read). The role is recorded in the log at the consumer's
    first use. Use two consumer names, one per use; to change a consumer's role, remove it and
    add it again."""


class IncompletePollError(ConsumerError):
    """A poll does not hold every rank's part of the batches it covers (its ranks were read
    up to different ends, or a rank is missing), and the caller asked for complete ones."""

    retriable = True  # the ranks short of the batches may complete them


class RanksBehindError(IncompletePollError):
    """A snapshots poll was asked to be complete while some rank of the job is behind: it
    completed a batch the other ranks published in without publishing in it (``publish()``
    called on some ranks only, or a different number of steps apart), so the job's polls stop
    at its end and the replica would keep the other ranks' newer rows stale. ``behind`` is rank
    -> the newest stamp it lacks (``DeltaPoll.behind``). Call ``tracker.publish(consumer)`` on
    every rank at the same steps. Nothing was applied."""

    retriable = True  # the ranks behind catch up at their next publish

    def __init__(self, message: str, behind: Optional[Dict[int, int]] = None) -> None:
        super().__init__(message)
        self.behind = dict(behind or {})


class RanksBehindWarning(ConsumerError, UserWarning):
    """A snapshots reader found a rank of the job behind (see :class:`RanksBehindError`);
    warned once per rank as it falls behind, by the poll that finds it. ``poll.behind`` says
    which ranks and stamps."""


# ---------------------------------------------------------------- the background writer

class WriterError(PersistentDeltaError):
    """The background writer failed; the original error is chained as ``__cause__``."""


class WriterLogFullError(WriterError, LogFullError):
    """The background writer failed because the disk is full (or the map cannot grow): both a
    :class:`WriterError` and a :class:`LogFullError`, so either ``except`` catches it. Free space,
    then ``resume()``; nothing queued was dropped."""


# ---------------------------------------------------------------- the stream

class StreamError(PersistentDeltaError):
    """Across hosts: the stream server (unreachable, refusing), the job's stream and buckets
    (missing, another layout, a compare-and-set lost), the stream key, or a message a reader
    refuses (:class:`RejectedMessageError`)."""


class TransportError(StreamError):
    """The stream (NATS JetStream, or another transport) could not be reached in time, or
    refused a request; the message names the server and what was asked. Shippers retry;
    remote consumers raise it from the call that needed the server."""

    retriable = True  # the server may be back, a leader elected, the request answered


class PermissionDeniedError(TransportError, PermissionError):
    """The stream server refused a request for this user's permissions (its NATS
    ``authorization`` block): the message names the subject. A denied publish or key write is
    otherwise only a timeout. See ``docs/guides/security.md`` for the permissions each side needs."""

    retriable = False  # denied again until the server's permissions change


class JobNotFoundError(StreamError):
    """The job's stream or buckets do not exist on the server: no shipper of the job has run
    there yet, or they were deleted. Only the shipper side (a shipper, ``upload_base``) creates
    them; a remote consumer never does (it may hold read-only permissions)."""


class StreamLayoutError(StreamError):
    """A shipper asked for another stream layout than the job has: a job's layout (one stream,
    or a stream per group of ``ranks_per_stream`` ranks) is fixed by its first shipper and
    recorded in the job's ``meta`` bucket, and its streams never mix two layouts."""


class KeyConflictError(StreamError):
    """A compare-and-set on a key-value bucket of the stream lost: the key exists (create) or
    is no longer at the revision given (update). Read the key again and decide; a remote
    consumer's claim on its name is the one caller today."""


class StreamKeyError(StreamError):
    """A shipper, remote consumer or tool has no stream key (and was not told ``insecure=True``),
    or a key file is unreadable, malformed or readable by others. Create one with
    ``persistent-delta keygen PATH`` and pass it (``key=``, ``--key-file``,
    ``PERSISTENT_DELTA_STREAM_KEY_FILE``) to the shipper and every consumer of the job."""


class KeyFileError(StreamKeyError):
    """A stream key file is refused before a byte of it is read: the path (followed through its
    symbolic links, as a Kubernetes secret volume lays a key out) ends at something other than
    a regular file (a FIFO, a device, a socket, a directory: opening one could block), or the
    file is readable by others, or owned by a user other than the reader and root
    (``docs/guides/security.md``, "Key files"). ``path`` is the path given, ``target`` the
    file it resolves to, ``refused`` what was refused (``"a FIFO"``, ``"mode 0644"``, ...)."""

    def __init__(self, message: str, path: str = "", target: str = "", refused: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.target = target
        self.refused = refused


class RejectedMessageError(StreamError):
    """A message, bucket value or base from the stream that a reader refuses: it does not
    authenticate (:class:`AuthenticationError`) or does not fit the job's tables
    (:class:`StreamDataError`). Nothing of it is applied and no position moves past it; readers
    report it and skip it (``RemoteConsumer.rejected``). ``subject`` and ``seq`` say which one."""

    def __init__(self, message: str, subject: str = "", seq: int = 0) -> None:
        super().__init__(message)
        self.subject = subject
        self.seq = seq


class AuthenticationError(RejectedMessageError):
    """A message, bucket value or base on the stream failed its authenticator: forged, altered,
    or signed with a key this reader does not hold. Readers report it and skip the message
    (``RemoteConsumer.rejected``); ``subject`` and ``seq`` say which one. Check who publishes on
    the job's subjects (``docs/guides/security.md``) and that both sides hold the job's key."""


class StreamDataError(RejectedMessageError):
    """A record from the stream (or a base) does not match the job's table metadata: another
    row width or dtype, ids outside the rank's shard, a range or stamp out of bounds, a size
    past the reader's limits. Nothing of it is applied and no position moves past it; ``subject``
    and ``seq`` say which message."""


class OlderLogError(StreamDataError):
    """A genuine message, table metadata or base of an older log of a rank than the newest the
    reader has seen authenticated for it: the job's previous run (before a start afresh, or a
    log created anew), replayed by a client of the server or left on a stream kept across the
    restart. Readers report it and skip it (``RemoteConsumer.rejected``); nothing of it is
    applied. It means someone publishes the old run's data again: check who may publish on the
    job's subjects (``docs/guides/security.md``)."""


# ---------------------------------------------------------------- checkpoints

class CheckpointError(PersistentDeltaError):
    """A base or an increment (``persistent_delta.checkpoint``) cannot be used for a restore:
    the subclass says why. Nothing was loaded into the model when it is raised."""


class IncompleteBaseError(CheckpointError):
    """A base directory is not a complete base: torch.distributed.checkpoint writes its
    ``.metadata`` last, so a directory without it is a save that did not finish (a crash inside
    ``dcp.save``), and one without ``persistent_delta_base.json`` was not adopted as a base. Restore
    from an older base, or take a new one (``Checkpoints.save_base``)."""


class IncrementChainError(CheckpointError):
    """The increments after a base do not form one chain: a gap (an increment missing or
    incomplete before a complete one), a duplicate (two increments of one step), an increment
    of another base, of another job (another log identity of a rank) or of another run mixed
    with this one's parts, or a damaged part. Restore from the base alone, or move the named
    directory away after checking it."""


class ShardLayoutError(ConfigMismatchError, CheckpointError):
    """A base or increment was saved with another world size, sharding plan or column split
    than this job's: its per-rank shards (and row-wise Adagrad's 1-D momentum of a column-wise
    table) cannot be resharded. Restore with the world size and plan it was saved with."""


# ---------------------------------------------------------------- a stop, not a failure

class CommandStoppedError(PersistentDeltaError):
    """A long-running command (``ship``, ``exporter``, ``top``) was stopped by SIGTERM/SIGINT
    while blocked -- in a system call, a wait on the server -- and interrupted rather than
    ending its loop. The command line reports it on stderr and exits 0: the stop was asked
    for. ``signal`` is the signal's number."""

    def __init__(self, message: str, signal: int = 0) -> None:
        super().__init__(message)
        self.signal = signal
