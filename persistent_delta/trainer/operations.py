"""What the background writer runs: one small named type per kind of write.

Owns: the vocabulary of the writer's queue. The training thread builds one of these and hands it
to :meth:`~persistent_delta.trainer.writer.BackgroundWriter.submit` (or, without a background
writer, to :func:`~persistent_delta.trainer.writer.commit_operations`); the writer groups the
queued operations into one write transaction and dispatches on their type
(:func:`~persistent_delta.trainer.writer.commit_operations`): first every :class:`StepWrite`'s
records and batch index, then each :class:`PublishRequest` and :class:`Compaction` in the order
they were submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from persistent_delta.config import RetentionBound
from persistent_delta.log import codec
from persistent_delta.log.records import AppendRecord
from persistent_delta.log.schema import ConsumerEntry
from persistent_delta.trainer.caps import PublishCap


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
class GatheredRows:
    """One table's rows of a publish, gathered once on the training thread.

    Args:
        ids: the shard-local ids, ascending.
        values: their values at the publish (native dtype, ``[len(ids), dim]``): a view of
            ``record``'s states.
        record: the table's native snapshot record, encoded around ``values`` (checksum not yet
            computed): stored as it is when a format of the publish is stored as native.
        formats: the row formats to store, each once (:func:`persistent_delta.log.codec.stored_format`):
            the writer encodes each from ``values`` (a cast, or FBGEMM's int8 quantization).
        column_half: a column-wise shard's rows (an int8 record holds its float32 half).
    """

    ids: torch.Tensor
    values: torch.Tensor
    record: codec.Encoded
    formats: Tuple[str, ...] = (codec.NATIVE,)
    column_half: bool = False


@dataclass
class PublishRequest:
    """One ``tracker.publish(consumer)``, from the training thread to the writer: what is asked,
    then (filled in by :meth:`persistent_delta.trainer.publish.Publisher.capture`) the rows
    gathered. The writer writes it with :func:`persistent_delta.trainer.publish.write_publish`:
    the consumer's move, a record per table and row format, the open stamp and retention, in one
    transaction, without lingering (a caller may wait to read it).

    Args:
        consumer: the publishing consumer.
        end: the position it moves to (the batch after the one being recorded).
        stamp: the batch index its records are stored under.
        publish_time: wall-clock time of the call (header ``"t"``).
        asked: row formats passed to ``publish(formats=...)`` (checked names).
        cap: what this publish may carry (:mod:`persistent_delta.trainer.caps`).
        compact, delete_on_read, bound: TorchRec's consume rule, as every read of the tracker
            applies it (compact behind the read, retention on both channels, its bound).
        entry: the consumer as read at the capture (the writer refuses the publish if it moved).
        tables: fqn -> the rows gathered (tables with none are left out).
        deferred: fqn -> rows a capped publish defers to the next one.
        due_seq, had_due: the stored deferred rows read at the capture (their sequence number;
            whether there were any): the writer checks they did not change.
        moves: managed-collision tables: fqn -> (shard-local slots, (taken, given) raw ids) of the
            slot reassignments since the consumer's last read (snapshots side records).
        buffers: the writer's reusable buffers of converted records, (fqn, format) -> buffer,
            kept by the tracker from publish to publish.
    """

    consumer: str
    end: int
    stamp: int
    publish_time: float
    asked: Tuple[str, ...] = ()
    cap: Optional[PublishCap] = None
    compact: bool = True
    delete_on_read: bool = False
    bound: Optional[RetentionBound] = None
    entry: Optional[ConsumerEntry] = None
    tables: Dict[str, GatheredRows] = field(default_factory=dict)
    deferred: Dict[str, torch.Tensor] = field(default_factory=dict)
    due_seq: int = 0
    had_due: bool = False
    moves: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    buffers: Optional[Dict[Tuple[str, str], bytearray]] = None

    @property
    def rows(self) -> Dict[str, int]:
        """fqn -> rows gathered (what ``publish()`` returns)."""
        return {fqn: int(g.ids.numel()) for fqn, g in self.tables.items()}

    @property
    def deferred_rows(self) -> int:
        """Rows this publish defers to the next one (all tables)."""
        return int(sum(int(t.numel()) for t in self.deferred.values()))

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered records (held until the writer wrote them)."""
        return sum(len(g.record) for g in self.tables.values())


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
Operation = Union[StepWrite, PublishRequest, Compaction]

__all__ = ["Compaction", "GatheredRows", "Operation", "PublishRequest", "StepWrite"]
