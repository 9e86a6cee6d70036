"""persistent_delta: durable, multi-consumer embedding delta tracking for TorchRec.

TorchRec's ``ModelDeltaTracker`` keeps "which rows changed" in process memory; persistent_delta
writes it to an append-only LMDB log, so deltas and consumer offsets survive restarts.
"""

from persistent_delta.config import Durability, LogOptions
from persistent_delta.consumer import DeltaConsumer, DeltaPoll
from persistent_delta.errors import (
    ConfigMismatchError,
    CorruptRecordError,
    ForkedProcessError,
    FormatMismatchError,
    InvalidInputError,
    LogClosedError,
    LogFullError,
    LogLockedError,
    NotALogError,
    OffsetOutOfRangeError,
    PersistentDeltaError,
    ReadOnlyLogError,
    UnknownConsumerError,
    WriterError,
)
from persistent_delta.log import DeltaLog
from persistent_delta.store import LmdbDeltaStore
from persistent_delta.tracker import PersistentDeltaTracker, PersistentTrackerConfig, attach

__version__ = "0.1.0"

__all__ = [
    "ConfigMismatchError",
    "CorruptRecordError",
    "DeltaConsumer",
    "DeltaLog",
    "DeltaPoll",
    "Durability",
    "ForkedProcessError",
    "FormatMismatchError",
    "InvalidInputError",
    "LmdbDeltaStore",
    "LogClosedError",
    "LogFullError",
    "LogLockedError",
    "LogOptions",
    "NotALogError",
    "OffsetOutOfRangeError",
    "PersistentDeltaError",
    "ReadOnlyLogError",
    "UnknownConsumerError",
    "WriterError",
    "PersistentDeltaTracker",
    "PersistentTrackerConfig",
    "attach",
]
