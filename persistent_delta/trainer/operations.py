"""What the background writer runs: one small named type per kind of write.

Owns: the vocabulary of the writer's queue. The training thread builds one of these and hands it
to :meth:`~persistent_delta.trainer.writer.BackgroundWriter.submit` (or, without a background
writer, to :func:`~persistent_delta.trainer.writer.commit_operations`); the writer groups the
queued operations into one write transaction and dispatches on their type
(:func:`~persistent_delta.trainer.writer.commit_operations`): first every :class:`StepWrite`'s
records and batch index, then each :class:`PublishWrite` and :class:`Compaction` in the order they
were submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

from persistent_delta.config import RetentionBound
from persistent_delta.log.records import AppendRecord
from persistent_delta.trainer.publish import Captured


@dataclass
class StepWrite:
    """A captured step's records, appended with the tracker's batch index.

    Args:
        records: records to append (their tensors may still be in flight from a device:
            ``events``).
        curr_batch_idx: the tracker's batch index, persisted in the same transaction (None: left
            as it is).
        events: ``torch.cuda.Event`` s (anything with ``synchronize()``) of the device-to-host
            copies the records wait for; the writer waits for them before its transaction.
        dedup: merge records sharing (fqn, batch_idx) before writing (FIRST/LAST rule).
    """

    records: List[AppendRecord] = field(default_factory=list)
    curr_batch_idx: Optional[int] = None
    events: List[Any] = field(default_factory=list)
    dedup: bool = True


@dataclass
class PublishWrite:
    """A captured publish (:func:`persistent_delta.trainer.publish.capture`), written by
    :func:`persistent_delta.trainer.publish.write_publish`: the consumer's move, the snapshot
    records and retention, in one transaction. The writer commits it without lingering (a
    caller may wait to read it).

    Args:
        captured: the publish as captured (its records hold ``captured.nbytes`` until written).
        compact: compact behind the consumer's read (TorchRec's consume rule).
        delete_on_read: enforce retention on both channels.
        bound: the retention bound (consumers beyond it are expired).
    """

    captured: Captured
    compact: bool
    delete_on_read: bool
    bound: Optional[RetentionBound] = None


@dataclass
class Compaction:
    """``auto_compact``'s compaction of ``[largest consumer position, end)``
    (:func:`persistent_delta.log.position_rules.compact_behind`), run after the records queued
    before it.

    Args:
        end: the batch the compaction stops before (exclusive).
    """

    end: int


# Everything the writer's queue may hold; the writer dispatches on the type.
Operation = Union[StepWrite, PublishWrite, Compaction]

__all__ = ["Compaction", "Operation", "PublishWrite", "StepWrite"]
