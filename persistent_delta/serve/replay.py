"""Offline replay and export: a batch range of every rank, merged, in global row ids.

Owns: the replay export format (spans, files, manifest) and its commit step.

Design note
-----------
The range is either explicit (``[from_batch, to_batch)``, half-open, the same on every rank) or a
consumer's pending range (per rank, from where its poll would start reading to the log end:
``[read_start(offset), log end)``, reported as such). It is cut into spans of ``span``
batches aligned on batch_idx (the same spans on every rank). For each span, each rank's log
is read in one read transaction (``fetch.read_range``: unique rows per table with the log's
update mode), the ranks are merged per table (``results.merge_table``: row-wise shards
concatenated, column-wise shards assembled into full rows when they can be), and the span's
delta of each table that has rows is written as one safetensors file:

    <out>/span-<start:012d>-<end:012d>/<fqn>.safetensors
        ids      int64 global row ids, ascending
        states   rows aligned with ids (when the log tracks states and they assemble)
        ids.col<c>, states.col<c>   per column shard, when a column-split table's
                                    slices cannot be assembled into full rows
        zch.raw_ids, zch.slot_ids, zch.unadmitted_raw_ids, zch.slots, zch.taken, zch.given,
        zch.evicted_raw_ids         a managed-collision table's raw-id side of the span
                                    (:class:`persistent_delta.log.zch_records.ZchDelta`; global slots)

Exactness: on a log written without an out-of-process consumer the trainer stored each row
once per read window (:mod:`persistent_delta.log.position_rules`), so a span starting inside such a
read window cannot be answered exactly; replay refuses it (:class:`InexactRangeError`, naming
the batch to start from) instead of labelling rows of earlier batches with the asked range.

With a shard-files directory (:func:`persistent_delta.trainer.save_shards.save_local_shards`), the current
values of every changed row (union over the spans) are written as an incremental snapshot,
``<out>/snapshot/<fqn>.safetensors`` (``ids``, ``values``: full rows). ``<out>/manifest.json``
lists everything, with the range read per rank (``ranges``) and overall (``from_batch``,
``to_batch``): ``persistent-delta apply`` (:mod:`persistent_delta.serve.ordered`) checks them. Files are written atomically (temp, fsync, rename). With ``commit`` (consumer
mode) the consumer's offsets move to the end of the range only after every file is written.

Reading is read-only and works while the trainer runs; batches at or past a rank's log end may
still be incomplete then (a note says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from persistent_delta.log import position_rules
from persistent_delta.read.consumer import DeltaConsumer
from persistent_delta.errors import InvalidInputError, OffsetOutOfRangeError, UnknownConsumerError
from persistent_delta.log.layout import PathLike, atomic_write_bytes, rank_paths
from persistent_delta.log.deltalog import DeltaLog, ReadTxn
from persistent_delta.read.fetch import read_range
from persistent_delta.read.results import MergedDelta, RankDelta, TableDelta, merge_table
from persistent_delta.log.schema import LOOKUPS, ShardInfo, check_table_filter
from persistent_delta.log.shard_files import full_rows, load_shards
from persistent_delta.log.zch_records import ZchDelta, merge_side

logger = logging.getLogger(__name__)

REPLAY_FORMAT = "persistent_delta.replay/2"  # /2: exports are cut into spans (was windows)
# a managed-collision table's span file also holds these, as ``zch.<name>`` (see zch_records.ZchDelta)
ZCH_TENSORS = ("raw_ids", "slot_ids", "unadmitted_raw_ids", "slots", "taken", "given", "evicted_raw_ids")
ProgressFn = Callable[[int, int], None]  # (spans done, spans in all)


@dataclass
class ReplayFile:
    """One table's export for one span (or the snapshot, ``kind == "snapshot"``)."""

    kind: str
    start_idx: int
    end_idx: int
    fqn: str
    rows: int
    states_shape: Optional[List[int]]
    column_split: bool
    path: Optional[str]
    bytes: int = 0
    # a column-split table whose shards' states do not tile a row (e.g. a row-wise optimizer
    # state per shard): col_offset -> the shape of ``states.col<c>`` (ids in ``ids.col<c>``)
    column_states: Dict[int, List[int]] = field(default_factory=dict)


@dataclass
class ReplayReport:
    """What ``replay`` read and wrote (``files`` empty of paths on a dry run)."""

    root: str
    out_dir: Optional[str]
    consumer: Optional[str]
    ranges: Dict[int, Tuple[int, int]]
    span: Optional[int]
    spans: List[Tuple[int, int]]
    files: List[ReplayFile] = field(default_factory=list)
    dry_run: bool = False
    committed: Optional[Dict[int, int]] = None
    notes: List[str] = field(default_factory=list)


def _check_idx(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{what} must be a non-negative int, got {value!r}")
    return value


def plan_ranges(
    logs: Dict[int, DeltaLog], from_batch: Optional[int], to_batch: Optional[int], consumer: Optional[str]
) -> Tuple[Dict[int, Tuple[int, int]], List[str]]:
    """Per rank ``[start, end)`` to replay (the range that will actually be read), and notes.

    Raises:
        InvalidInputError: neither or both of a range and a consumer, or a bad range.
        OffsetOutOfRangeError: part of the range was deleted.
        InexactRangeError: an explicit range starts inside a filtered read window.
        UnknownConsumerError: the consumer is missing on a rank.
    """
    explicit = from_batch is not None or to_batch is not None
    if (consumer is not None and explicit) or (consumer is None and (from_batch is None or to_batch is None)):
        raise InvalidInputError("give either --from-batch A --to-batch B, or --consumer NAME")
    ranges: Dict[int, Tuple[int, int]] = {}
    notes: List[str] = []
    for rank, log in logs.items():
        if consumer is None:
            a, b = _check_idx(from_batch, "--from-batch"), _check_idx(to_batch, "--to-batch")
            if a > b:
                raise InvalidInputError(f"--from-batch {a} is after --to-batch {b} (the range is [from, to))")

            def explicit_range(r: ReadTxn, a: int = a, b: int = b) -> Tuple[int, int]:
                start, end = position_rules.bounds(r, LOOKUPS)
                if a < start:
                    raise OffsetOutOfRangeError(
                        f"rank {rank}: batches [{a}, {start}) were deleted from {log.path} (log start {start}); "
                        f"replay from --from-batch {start} or later"
                    )
                if a < b:
                    position_rules.check_exact(r, a, f"a replay of [{a}, {b})")
                return start, end

            _, end = log.read(explicit_range)
            if b > end:
                notes.append(f"rank {rank}: batches from the log end {end} on may be incomplete while the trainer runs")
            ranges[rank] = (a, b)
            continue

        def pending(r: ReadTxn) -> Tuple[int, int]:
            entry = r.consumer(consumer)  # type: ignore[arg-type]
            if entry is None:
                raise UnknownConsumerError(f"consumer {consumer!r} is not registered in {log.path}")
            if entry.channel != LOOKUPS:
                raise InvalidInputError(f"consumer {consumer!r} reads snapshots; replay exports lookups consumers only")
            start, end = position_rules.bounds(r, LOOKUPS)
            if entry.offset < start:
                raise OffsetOutOfRangeError(
                    f"consumer {consumer!r} is at batch {entry.offset} on rank {rank}, below the log start {start}: "
                    f"reset it (persistent-delta offsets {os.path.dirname(log.path)} --reset {consumer} --to-earliest --execute)"
                )
            begin = entry.offset
            while position_rules.read_start(r, begin) < begin:  # a fixed point: reading there is exact
                begin = position_rules.read_start(r, begin)
            if begin < entry.offset:
                notes.append(f"rank {rank}: consumer {consumer!r} is at batch {entry.offset}, inside a read window that "
                             f"the trainer filtered from batch {begin}: replaying from {begin} (at-least-once)")
            return begin, max(entry.offset, end)

        ranges[rank] = log.read(pending)
    return ranges, notes


def plan_spans(ranges: Dict[int, Tuple[int, int]], span: Optional[int]) -> List[Tuple[int, int]]:
    """Spans ``[ws, we)`` of ``span`` batches covering every rank's range (aligned on the
    lowest start; one span when ``span`` is None); empty ones skipped."""
    spans = [(a, b) for a, b in ranges.values() if b > a]
    if not spans:
        return []
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    step = hi - lo if span is None else span
    out = []
    for ws in range(lo, hi, step):
        we = min(ws + step, hi)
        if any(a < we and ws < b for a, b in spans):
            out.append((ws, we))
    return out


def _span_tensors(m: MergedDelta) -> Dict[str, torch.Tensor]:
    tensors = {"ids": m.global_ids.contiguous()}
    if m.states is not None:
        tensors["states"] = m.states.contiguous()
    elif m.column_split:
        for off, part in m.column_parts.items():
            if part.states is not None:
                tensors[f"ids.col{off}"] = part.ids.contiguous()
                tensors[f"states.col{off}"] = part.states.contiguous()
    return tensors


def _write(path: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, str]) -> int:
    data = safetensors_save({k: v.clone() for k, v in tensors.items()}, metadata=meta)
    atomic_write_bytes(path, data)
    return len(data)


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")


def file_name(fqn: str) -> str:
    """The file name (without extension) of a table's export: the fqn itself when it is a
    plain name (letters, digits, ``._-``, up to 100 chars, not starting with a dot); else its
    plain characters (up to 60) plus ``~`` and a hash of the whole fqn. ``~`` never occurs in a
    plain name, so names are unique for every fqn the log accepts, and always safe (no ``/``,
    no NUL, short). The manifest maps each fqn to its file."""
    if _PLAIN_NAME.match(fqn):
        return fqn
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", fqn)[:60].lstrip(".")
    return f"{plain}~{hashlib.sha1(fqn.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def replay(
    root: PathLike,
    out_dir: Optional[PathLike] = None,
    *,
    from_batch: Optional[int] = None,
    to_batch: Optional[int] = None,
    consumer: Optional[str] = None,
    commit: bool = False,
    tables: Optional[Sequence[str]] = None,
    span: Optional[int] = None,
    shard_files: Optional[PathLike] = None,
    dry_run: bool = False,
    progress: Optional[ProgressFn] = None,
) -> ReplayReport:
    """Replay a batch range of every rank and export it (see the module docs).

    Args:
        root: the log root.
        out_dir: where files go (required unless ``dry_run``).
        from_batch: the range's first batch (with ``to_batch``; or give ``consumer``).
        to_batch: the range's end, ``[from_batch, to_batch)``.
        consumer: replay the consumer's pending range ``[offset, log end)`` per rank.
        commit: with ``consumer``, move its offsets to the range end after writing.
        tables: only these table fqns.
        span: batches per span (default: one span).
        shard_files: a :func:`save_local_shards` directory: also write the changed rows' values.
        dry_run: read and merge, write nothing, commit nothing.
        progress: called with (spans done, spans in all).

    Returns:
        A :class:`ReplayReport`.

    Raises:
        InvalidInputError, OffsetOutOfRangeError, UnknownConsumerError: see :func:`plan_ranges`.
        NotALogError: ``root`` (or ``shard_files``) holds nothing usable.
    """
    if span is not None and (isinstance(span, bool) or not isinstance(span, int) or span < 1):
        raise InvalidInputError(f"--span must be a positive int, got {span!r}")
    if out_dir is None and not dry_run:
        raise InvalidInputError("--out DIR is required (or --dry-run)")
    if commit and consumer is None:
        raise InvalidInputError("--commit needs --consumer")
    root = os.fspath(root)
    final = os.fspath(out_dir) if out_dir is not None else None
    shards = load_shards(shard_files) if shard_files is not None else None
    if final is None or dry_run:
        return _replay(root, final, final, from_batch, to_batch, consumer, commit, tables, span, shards, dry_run,
                       progress)
    # Files are staged and moved into place only when everything was written: a failed replay
    # leaves no partial output (and removes an output directory it created).
    created = not os.path.exists(final)
    os.makedirs(final, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".replay-", dir=final)
    try:
        report = _replay(root, stage, final, from_batch, to_batch, consumer, commit, tables, span, shards, False,
                         progress, publish=lambda rep: _publish(stage, final, rep))
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            shutil.rmtree(final, ignore_errors=True)
        raise
    return report


def _publish(stage: str, final: str, report: "ReplayReport") -> None:
    """Move the staged files into ``final`` and write the manifest last."""
    for f in report.files:
        if f.path is None:
            continue
        dest = os.path.join(final, os.path.relpath(f.path, stage))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(f.path, dest)
        f.path = dest
    shutil.rmtree(stage, ignore_errors=True)
    report.out_dir = final
    atomic_write_bytes(os.path.join(final, "manifest.json"), json.dumps(_manifest(report), indent=1).encode())


def _replay(root: str, out: Optional[str], final: Optional[str], from_batch: Optional[int], to_batch: Optional[int],
            consumer: Optional[str], commit: bool, tables: Optional[Sequence[str]], span: Optional[int],
            shards: Optional[Dict[str, List[Tuple[ShardInfo, torch.Tensor]]]], dry_run: bool,
            progress: Optional[ProgressFn], publish: Optional[Callable[["ReplayReport"], None]] = None) -> "ReplayReport":
    logs = {rank: DeltaLog(path, readonly=True) for rank, path in rank_paths(root).items()}
    try:
        check_table_filter(tables, sorted({fqn for log in logs.values() for fqn in log.tables()}))
        ranges, notes = plan_ranges(logs, from_batch, to_batch, consumer)
        report = ReplayReport(root=root, out_dir=final, consumer=consumer, ranges=ranges, span=span,
                              spans=plan_spans(ranges, span), dry_run=dry_run, notes=notes)
        mode = next(iter(logs.values())).read(lambda r: position_rules.update_mode(r)).value
        touched: Dict[str, List[torch.Tensor]] = {}
        for i, (ws, we) in enumerate(report.spans):
            parts: Dict[str, List[TableDelta]] = {}
            for rank, log in logs.items():
                a, b = max(ws, ranges[rank][0]), min(we, ranges[rank][1])
                if a >= b:
                    continue
                delta = log.read(lambda r: _read_span(r, rank, log.path, a, b, tables))
                for fqn, t in delta.tables.items():
                    parts.setdefault(fqn, []).append(t)
            for fqn, ps in sorted(parts.items()):
                m = merge_table(fqn, ps)
                sides = [(p.rank, p.zch) for p in ps if p.zch is not None]
                z = merge_side(fqn, sides) if sides else None
                if m.global_ids.numel() == 0 and (z is None or not (z.slots.numel() or z.raw_ids.numel()
                                                                    or z.unadmitted_raw_ids.numel())):
                    continue
                touched.setdefault(fqn, []).append(m.global_ids)
                if z is not None:  # reassigned slots were re-initialised, looked up or not
                    touched[fqn].append(z.slots)
                report.files.append(_export_span(m, ws, we, mode, out, dry_run, z))
                if report.files[-1].column_states and not any(f"{fqn}: column shards" in n for n in report.notes):
                    report.notes.append(
                        f"{fqn}: column shards exported side by side (ids.col<c>, states.col<c> per column offset c): "
                        "their states do not tile a full row (each shard keeps its own per-row state)")
            if progress is not None:
                progress(i + 1, len(report.spans))
    finally:
        for log in logs.values():
            log.close()
    if shards is not None:
        lo = min((w[0] for w in report.spans), default=0)
        hi = max((w[1] for w in report.spans), default=0)
        for fqn, ids_list in sorted(touched.items()):
            if fqn not in shards:
                report.notes.append(f"{fqn}: not in the shard files; no snapshot written")
                continue
            ids = torch.unique(torch.cat(ids_list), sorted=True)
            report.files.append(_export_snapshot(fqn, ids, full_rows(fqn, shards[fqn], ids), lo, hi, out, dry_run))
    if publish is not None:
        publish(report)
    if commit and not dry_run and consumer is not None:
        with DeltaConsumer(root, consumer, register=False) as c:
            for rank, (_, end) in ranges.items():
                c.seek(end, rank=rank)
            report.committed = c.commit()
    return report


def _read_span(r: ReadTxn, rank: int, path: str, a: int, b: int, tables: Optional[Sequence[str]]) -> RankDelta:
    """One rank's part of one span, exactly ``[a, b)``: a span may not move back into an
    earlier one (it would export rows twice, labelled with the wrong range)."""
    position_rules.check_exact(r, a, f"the span [{a}, {b}) (replay without --span, or from a read-window start)")
    return read_range(r, rank, path, a, b, LOOKUPS, tables)


def _export_span(m: MergedDelta, ws: int, we: int, mode: str, out: Optional[str], dry_run: bool,
                   z: Optional[ZchDelta] = None) -> ReplayFile:
    tensors = _span_tensors(m)
    if z is not None:  # a managed-collision table: its raw ids, reassignments and evictions
        tensors.update({f"zch.{k}": getattr(z, k).contiguous() for k in ZCH_TENSORS})
    states = tensors.get("states")
    f = ReplayFile(kind="delta", start_idx=ws, end_idx=we, fqn=m.fqn, rows=int(m.global_ids.numel()),
                   states_shape=list(states.shape) if states is not None else None,
                   column_split=m.column_split, path=None,
                   column_states={int(k[len("states.col"):]): list(v.shape) for k, v in tensors.items()
                                  if k.startswith("states.col")})
    if not dry_run and out is not None:
        f.path = os.path.join(out, f"span-{ws:012d}-{we:012d}", f"{file_name(m.fqn)}.safetensors")
        meta = {
            "format": REPLAY_FORMAT, "kind": "delta", "fqn": m.fqn, "start_idx": str(ws), "end_idx": str(we),
            "update_mode": mode, "global_rows": str(m.global_rows), "global_cols": str(m.global_cols),
            "column_split": str(m.column_split), "ranks": json.dumps(m.ranks),
        }
        f.bytes = _write(f.path, tensors, meta)
    return f


def _export_snapshot(fqn: str, ids: torch.Tensor, values: torch.Tensor, lo: int, hi: int,
                     out: Optional[str], dry_run: bool) -> ReplayFile:
    f = ReplayFile(kind="snapshot", start_idx=lo, end_idx=hi, fqn=fqn, rows=int(ids.numel()),
                   states_shape=list(values.shape), column_split=False, path=None)
    if not dry_run and out is not None:
        f.path = os.path.join(out, "snapshot", f"{file_name(fqn)}.safetensors")
        meta = {"format": REPLAY_FORMAT, "kind": "snapshot", "fqn": fqn, "start_idx": str(lo), "end_idx": str(hi)}
        f.bytes = _write(f.path, {"ids": ids, "values": values}, meta)
    return f


def _manifest(report: ReplayReport) -> Dict[str, object]:
    d = asdict(report)
    d["format"] = REPLAY_FORMAT
    d["ranges"] = {str(k): list(v) for k, v in report.ranges.items()}
    # the [from, to) this output covers (per rank in "ranges"; ordered apply checks them)
    d["from_batch"] = min((a for a, _ in report.ranges.values()), default=None)
    d["to_batch"] = max((b for _, b in report.ranges.values()), default=None)
    if out := report.out_dir:
        for f in d["files"]:
            if f["path"]:
                f["path"] = os.path.relpath(f["path"], out)
    return d


def load_export(path: PathLike) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Read one exported file back: (tensors by key, metadata)."""
    with safe_open(os.fspath(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
