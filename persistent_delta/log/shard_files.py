"""Shard files: each rank's table shards as safetensors, the starting tables of a replica.

Owns: the shard-file format and reading it (:mod:`persistent_delta.trainer.save_shards` writes it). (A *shard file* is not a model checkpoint: it holds embedding
weights only, to assemble the current values of changed rows; the tracker's part of a model
checkpoint is :mod:`persistent_delta.trainer.restore`'s.)

``save_local_shards(tracker, shard_dir)`` writes ``<shard_dir>/rank-<r>.safetensors``: every
tracked table's local shard (``tracker.local_tables[fqn].weights()``) keyed by fqn, with the
shard placement (row/column offsets and sizes), a managed-collision table's raw id -> slot map
(``zch.raw:<fqn>``, ``zch.slot:<fqn>``) and the batch index it was taken at
(``batch_idx``: the tracker's ``curr_batch_idx``; the weights hold every batch up to it, so an
increment applied on top must start at ``batch_idx + 1``: :func:`shard_batches`), and the first
stamp a publish after the save can carry (``next_stamp``: a snapshots poll applied onto the
tables must start at or before it, :func:`shard_positions`) in the file's metadata, with the
identity of the rank's log they belong to (``log_id``, ``log_stamp``: :func:`shard_identities`). Every rank calls it with
the same directory. ``replay`` reads the files of all ranks to assemble the current values of
changed rows as full rows in global row ids (an incremental snapshot).

Files are written atomically (:func:`persistent_delta.log.layout.atomic_write_bytes`).
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from persistent_delta.errors import InvalidInputError, NotALogError
from persistent_delta.log.layout import PathLike
from persistent_delta.log.schema import LogIdentity, ShardInfo

SHARD_FILES_FORMAT = "persistent_delta.shards/1"
# a managed-collision table's (admitted raw id -> global slot) map of the rank, as two tensors
ZCH_PREFIX, ZCH_RAW, ZCH_SLOT = "zch.", "zch.raw:", "zch.slot:"
_RANK_FILE = re.compile(r"^rank-(\d+)\.safetensors$")


def _rank_files(ckpt_dir: str) -> List[str]:
    names = sorted(n for n in os.listdir(ckpt_dir) if _RANK_FILE.match(n)) if os.path.isdir(ckpt_dir) else []
    if not names:
        raise NotALogError(
            f"{ckpt_dir} holds no shard files (rank-<r>.safetensors written by "
            "persistent_delta.trainer.save_shards.save_local_shards)"
        )
    return names


def shard_batches(ckpt_dir: PathLike) -> Dict[int, Optional[int]]:
    """rank -> the batch index each rank file was taken at (None: written before files
    recorded it).

    Raises:
        NotALogError: no shard files in ``ckpt_dir``.
        InvalidInputError: a malformed file.
    """
    return _recorded(ckpt_dir, ("batch_idx",))


def shard_positions(ckpt_dir: PathLike) -> Dict[int, Optional[int]]:
    """rank -> the snapshots position a replica starting from each rank file continues from:
    the first stamp a publish made after the save can carry (``next_stamp``: the file's batch,
    or the next one when a publish was stamped with it before the save), the file's
    ``batch_idx`` for files written before ``next_stamp`` was recorded, None when neither is
    (:mod:`persistent_delta.read.base` says why a replica's first poll must start at or before it).

    Raises:
        NotALogError: no shard files in ``ckpt_dir``.
        InvalidInputError: a malformed file.
    """
    return _recorded(ckpt_dir, ("next_stamp", "batch_idx"))


def shard_identities(ckpt_dir: PathLike) -> Dict[int, Optional[LogIdentity]]:
    """rank -> the identity of the rank's log each rank file was taken from (None: written
    before files recorded it), to tell the files of a run before a start afresh.

    Raises:
        NotALogError: no shard files in ``ckpt_dir``.
        InvalidInputError: a malformed file.
    """
    out: Dict[int, Optional[LogIdentity]] = {}
    for rank, path, meta in _metas(os.fspath(ckpt_dir)):
        try:
            stamp = meta.get("log_stamp")
            out[rank] = LogIdentity.from_value({"log_id": meta.get("log_id"),
                                                "log_stamp": None if stamp is None else int(stamp)})
        except ValueError as exc:
            raise InvalidInputError(f"{path}: malformed log identity ({exc})") from exc
    return out


def _metas(ckpt_dir: str) -> List[Tuple[int, str, Dict[str, str]]]:
    """(rank, path, metadata) of each rank file.

    Raises:
        NotALogError: no shard files, or a file of another format.
        InvalidInputError: a malformed file.
    """
    out = []
    for name in _rank_files(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own types on a bad file
            raise InvalidInputError(f"{path}: malformed shard file ({type(exc).__name__}: {exc})") from exc
        if meta.get("format") != SHARD_FILES_FORMAT:
            raise NotALogError(f"{path} is not a shard file (format {meta.get('format')!r})")
        out.append((int(_RANK_FILE.match(name).group(1)), path, meta))  # type: ignore[union-attr]
    return out


def _recorded(ckpt_dir: PathLike, keys: Tuple[str, ...]) -> Dict[int, Optional[int]]:
    """rank -> the first of the metadata ``keys`` each rank file records, as an int (None: none)."""
    out: Dict[int, Optional[int]] = {}
    for rank, path, meta in _metas(os.fspath(ckpt_dir)):
        key = next((k for k in keys if meta.get(k) is not None), keys[0])
        b = meta.get(key)
        try:
            out[rank] = None if b is None else int(b)
        except ValueError as exc:
            raise InvalidInputError(f"{path}: malformed {key} {b!r}") from exc
    return out


def load_raw_id_maps(ckpt_dir: PathLike) -> Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]]:
    """fqn -> [(raw ids, global slots)] per rank file: the managed-collision maps at the
    checkpoint (empty for a model without managed-collision tables)."""
    ckpt_dir = os.fspath(ckpt_dir)
    out: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for name in _rank_files(ckpt_dir):
        with safe_open(os.path.join(ckpt_dir, name), "pt") as f:
            for key in f.keys():
                if key.startswith(ZCH_RAW):
                    fqn = key[len(ZCH_RAW):]
                    out.setdefault(fqn, []).append((f.get_tensor(key), f.get_tensor(ZCH_SLOT + fqn)))
    return out


def load_shards(ckpt_dir: PathLike) -> Dict[str, List[Tuple[ShardInfo, torch.Tensor]]]:
    """fqn -> [(shard placement, local weights)] over every rank file in ``ckpt_dir``.

    Every shard of a table is checked against its weights and against the table size the
    table's other shards claim (``global_rows`` x ``global_cols``); a partial set of rank files
    is returned as it is (:func:`whole_tables` refuses it).

    Raises:
        NotALogError: ``ckpt_dir`` holds no ``rank-<r>.safetensors`` written by
            :func:`save_local_shards`.
        InvalidInputError: a malformed file, a placement that does not fit its weights, or
            shards of one table that claim different table sizes.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    out: Dict[str, List[Tuple[ShardInfo, torch.Tensor]]] = {}
    claims: Dict[str, Tuple[str, Tuple[Optional[int], Optional[int]]]] = {}  # fqn -> (file, size) of its first shard
    for name in _rank_files(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != SHARD_FILES_FORMAT:
                    raise NotALogError(f"{path} is not a shard file (format {meta.get('format')!r})")
                shards = json.loads(meta["shards"])
                for fqn in f.keys():
                    if fqn.startswith(ZCH_PREFIX):
                        continue
                    weights = f.get_tensor(fqn)
                    info = _checked(path, fqn, ShardInfo.from_dict(shards[fqn]), weights)
                    first, size = claims.setdefault(fqn, (path, (info.global_rows, info.global_cols)))
                    if (info.global_rows, info.global_cols) != size:
                        raise InvalidInputError(
                            f"{path}: {fqn}: the shard claims a table of {info.global_rows} x {info.global_cols} "
                            f"(global_rows x global_cols), {first} claims {size[0]} x {size[1]}: refused")
                    out.setdefault(fqn, []).append((info, weights))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:  # malformed metadata or file
            raise InvalidInputError(f"{path}: malformed shard file ({type(exc).__name__}: {exc})") from exc
    return out


def _checked(path: str, fqn: str, info: ShardInfo, weights: torch.Tensor) -> ShardInfo:
    """The placement of a shard, checked against its weights (a forged size must not drive a
    huge allocation)."""
    if weights.dim() != 2:
        raise InvalidInputError(f"{path}: {fqn}: weights of shape {tuple(weights.shape)}, expected 2-D")
    rows, cols = int(weights.shape[0]), int(weights.shape[1])
    ok = (
        info.local_rows in (None, rows) and info.local_cols in (None, cols)
        and info.global_rows is not None and info.global_cols is not None
        and 0 <= info.row_offset and info.row_offset + rows <= info.global_rows
        and 0 <= info.col_offset and info.col_offset + cols <= info.global_cols
    )
    if not ok:
        raise InvalidInputError(f"{path}: {fqn}: placement {info} does not fit weights of shape {(rows, cols)}")
    return info


def whole_tables(ckpt_dir: PathLike, shards: Dict[str, List[Tuple[ShardInfo, torch.Tensor]]]) -> Dict[str, torch.Tensor]:
    """fqn -> the full table, ``(global_rows, global_cols)``, assembled from ``shards`` (what
    :func:`load_shards` read from ``ckpt_dir``).

    The size each table claims is bounded before anything is allocated for it: its shards must
    hold at least ``global_rows * global_cols`` values between them (a file cannot make a few
    bytes claim a table of any size); :func:`full_rows` then checks that they cover every cell.

    Raises:
        InvalidInputError: a table without its size, or whose shards hold fewer values than the
            table claims (a rank file is missing, or a forged size).
    """
    where = os.fspath(ckpt_dir)
    tables: Dict[str, torch.Tensor] = {}
    for fqn, parts in shards.items():
        rows, cols = parts[0][0].global_rows, parts[0][0].global_cols
        if rows is None or cols is None:
            raise InvalidInputError(f"{where}: {fqn}: the shard files lack the table's size")
        held = sum(int(w.shape[0]) * int(w.shape[1]) for _, w in parts)
        if held < rows * cols:
            raise InvalidInputError(
                f"{where}: {fqn}: the shard files ({_names(_rank_files(where))}) claim a table of "
                f"{rows} x {cols} (global_rows x global_cols) but hold {held} of its {rows * cols} values: "
                "refused before allocating it (is a rank file missing, or the file damaged?)")
        tables[fqn] = full_rows(fqn, parts, torch.arange(rows))
    return tables


def _names(names: List[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def full_rows(fqn: str, shards: List[Tuple[ShardInfo, torch.Tensor]], global_ids: torch.Tensor) -> torch.Tensor:
    """The full rows ``global_ids`` of table ``fqn`` assembled from its shards.

    Raises:
        InvalidInputError: some requested (row, column) is held by no shard.
    """
    info0 = shards[0][0]
    if info0.global_cols is None:
        raise InvalidInputError(f"{fqn}: the checkpoint lacks the table's width")
    n, cols = int(global_ids.numel()), int(info0.global_cols)
    covered_cols = max(info.col_offset + int(w.shape[1]) for info, w in shards)
    if covered_cols != cols:
        raise InvalidInputError(f"{fqn}: the checkpoint's shards cover {covered_cols} columns, the table claims {cols}")
    values = torch.zeros(n, cols, dtype=shards[0][1].dtype)
    covered = torch.zeros(n, cols, dtype=torch.bool)
    ids = global_ids.to(torch.int64)
    for info, weights in shards:
        rows = int(info.local_rows if info.local_rows is not None else weights.shape[0])
        width = int(info.local_cols if info.local_cols is not None else weights.shape[1])
        mine = (ids >= info.row_offset) & (ids < info.row_offset + rows)
        c0 = info.col_offset
        values[mine, c0:c0 + width] = weights[ids[mine] - info.row_offset]
        covered[mine, c0:c0 + width] = True
    if not bool(covered.all()):
        missing = ids[~covered.all(dim=1)][:5].tolist()
        raise InvalidInputError(
            f"{fqn}: the checkpoint has no shard for rows {missing}... (is a rank file missing from it?)"
        )
    return values
