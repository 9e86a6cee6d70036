"""persistent_delta: durable, multi-consumer embedding delta tracking for TorchRec.

TorchRec's ``ModelDeltaTracker`` keeps "which rows changed" in process memory; persistent_delta
writes it to an append-only LMDB log, so deltas and consumer offsets survive restarts.
"""

from persistent_delta.read.apply import Applied, apply_poll
from persistent_delta.config import Durability, LogOptions, RetentionBound, WriterOptions
from persistent_delta.read.consumer import DeltaConsumer, DeltaReader
from persistent_delta.errors import (
    ConfigMismatchError,
    ConsumerConflictError,
    CorruptRecordError,
    DamagedLogError,
    ForkedProcessError,
    FormatMismatchError,
    IncompletePollError,
    InexactRangeError,
    InvalidInputError,
    LogClosedError,
    LogFullError,
    LogIOError,
    LogLockedError,
    NotALogError,
    OffsetOutOfRangeError,
    PersistentDeltaError,
    ReadOnlyLogError,
    UnknownConsumerError,
    UnsupportedModeError,
    UnsupportedTrackingError,
    WriterError,
)
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.read.results import DeltaPoll, MergedDelta, RankDelta, TableDelta
from persistent_delta.log.schema import ConsumerEntry, Delivery, ShardInfo
from persistent_delta.read.store import LmdbDeltaStore
from persistent_delta.trainer.tracker import PersistentDeltaTracker, PersistentTrackerConfig, attach
from persistent_delta.read.raw_ids import PersistentRawIdTracker, install_raw_id_tracker
from persistent_delta.log.zch_records import RawIdMap, ZchDelta

__version__ = "0.1.0"

__all__ = [
    "Applied",
    "apply_poll",
    "ConfigMismatchError",
    "ConsumerConflictError",
    "ConsumerEntry",
    "Delivery",
    "IncompletePollError",
    "InexactRangeError",
    "MergedDelta",
    "RankDelta",
    "RetentionBound",
    "ShardInfo",
    "TableDelta",
    "WriterOptions",
    "CorruptRecordError",
    "DamagedLogError",
    "DeltaConsumer",
    "DeltaLog",
    "DeltaPoll",
    "DeltaReader",
    "Durability",
    "ForkedProcessError",
    "FormatMismatchError",
    "InvalidInputError",
    "LmdbDeltaStore",
    "LogClosedError",
    "LogFullError",
    "LogIOError",
    "LogLockedError",
    "LogOptions",
    "NotALogError",
    "OffsetOutOfRangeError",
    "PersistentDeltaError",
    "ReadOnlyLogError",
    "UnknownConsumerError",
    "UnsupportedModeError",
    "UnsupportedTrackingError",
    "WriterError",
    "PersistentDeltaTracker",
    "PersistentTrackerConfig",
    "attach",
    "PersistentRawIdTracker",
    "install_raw_id_tracker",
    "RawIdMap",
    "ZchDelta",
]
