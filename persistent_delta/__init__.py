"""persistent_delta: durable, multi-consumer embedding delta tracking for TorchRec.

TorchRec's ``ModelDeltaTracker`` keeps "which rows changed" in process memory; persistent_delta
writes it to an append-only LMDB log, so deltas and consumer positions survive restarts.

The names here are what a user needs, by role. Everything else stays importable from its
package (``persistent_delta.log``, ``.trainer``, ``.read``, ``.serve``, ``.adapters``,
``.fleet``), and every error from :mod:`persistent_delta.errors`.
"""

from importlib import metadata as _metadata

# in the trainer
from persistent_delta.config import Durability, RetentionBound
from persistent_delta.trainer.attach import attach
from persistent_delta.trainer.tracker import PersistentDeltaTracker, PersistentTrackerConfig
from persistent_delta.trainer.save_shards import save_local_shards

# reading, in any process
from persistent_delta.read.polling import Consumer
from persistent_delta.read.consumer import DeltaConsumer, DeltaReader
from persistent_delta.read.results import DeltaPoll, MergedDelta, RankDelta, TableDelta

# serving replicas
from persistent_delta.serve.apply import Applied, apply_poll, load_base
from persistent_delta.log.zch_records import ZchDelta
from persistent_delta.serve.raw_id_map import RawIdMap

# across hosts
from persistent_delta.fleet.ship import Shipper, upload_base
from persistent_delta.fleet.remote import RemoteConsumer

# TorchRec's DeltaStore, on disk
from persistent_delta.adapters.delta_store import LmdbDeltaStore

# the errors most callers catch (all of them: persistent_delta.errors)
from persistent_delta.errors import LogLockedError, OffsetOutOfRangeError, PersistentDeltaError

try:  # one home for the version: pyproject.toml
    __version__ = _metadata.version("persistent_delta")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

__all__ = [
    # in the trainer
    "attach",
    "PersistentTrackerConfig",
    "PersistentDeltaTracker",
    "Durability",
    "RetentionBound",
    "save_local_shards",
    # reading, in any process
    "Consumer",
    "DeltaConsumer",
    "DeltaReader",
    "DeltaPoll",
    "RankDelta",
    "TableDelta",
    "MergedDelta",
    # serving replicas
    "load_base",
    "apply_poll",
    "Applied",
    "RawIdMap",
    "ZchDelta",
    # across hosts
    "Shipper",
    "upload_base",
    "RemoteConsumer",
    # TorchRec's DeltaStore, on disk
    "LmdbDeltaStore",
    # errors
    "PersistentDeltaError",
    "OffsetOutOfRangeError",
    "LogLockedError",
]
