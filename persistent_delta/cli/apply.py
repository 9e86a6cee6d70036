"""``persistent-delta apply``: build or continue a replica from a base and increments, in order.

Owns: reading apply's inputs (shard-file directories, replay outputs) into
:class:`persistent_delta.read.ordered.Piece` s. The order rule and the replica are
:mod:`persistent_delta.read.ordered`'s.

``apply INPUT... --out REPLICA [--replica PREV] [--dry-run]``: every INPUT is a shard-files directory
directory (a base, first only) or a replay output directory (an increment); they are checked in
the order given -- a gap, an overlap or an input out of order is refused, naming the input, the
rank and the ranges, and nothing is written -- then applied, and the replica is written to
``--out`` (one safetensors file: full tables, raw-id maps, and the batch each rank must continue
from). ``--replica`` continues a replica written before: the first input must start where it
ended.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from persistent_delta.cli.replay import REPLAY_FORMAT, load_export
from persistent_delta.errors import InvalidInputError
from persistent_delta.log.layout import PathLike
from persistent_delta.read.ordered import Piece, Replica, apply_pieces, base_piece, check_order


def increment_piece(out_dir: PathLike) -> Piece:
    """A replay output directory as an increment (its manifest's ranges; span files in order).

    Raises:
        InvalidInputError: no manifest of a replay output, or a manifest naming missing files.
    """
    path = os.fspath(out_dir)
    manifest_path = os.path.join(path, "manifest.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("format") != REPLAY_FORMAT:
            raise InvalidInputError(f"{manifest_path}: not a replay manifest (format {manifest.get('format')!r})")
        ranges = {int(r): (int(a), int(b)) for r, (a, b) in manifest["ranges"].items()}
        files = manifest["files"]
    except InvalidInputError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidInputError(f"{path}: not a replay output ({type(exc).__name__}: {exc})") from exc
    piece = Piece(path, "increment", ranges)
    for f in sorted((f for f in files if f.get("path")), key=lambda f: (f["kind"] != "delta", f["start_idx"], f["fqn"])):
        tensors, _ = load_export(os.path.join(path, f["path"]))
        if f["kind"] == "delta":
            piece.spans.append((int(f["start_idx"]), f["fqn"], tensors))
        elif f["kind"] == "snapshot":
            piece.snapshots.append((f["fqn"], tensors))
    return piece


def read_piece(path: PathLike) -> Piece:
    """A base (a directory of ``rank-<r>.safetensors``) or an increment (a replay output)."""
    p = os.fspath(path)
    if os.path.exists(os.path.join(p, "manifest.json")):
        return increment_piece(p)
    return base_piece(p)


@dataclass
class ApplyReport:
    """What ``apply`` checked and did."""

    inputs: List[Tuple[str, str, Dict[int, Tuple[int, int]]]]  # (path, kind, ranges)
    next_batch: Dict[int, int]
    out: Optional[str]
    dry_run: bool


def apply_inputs(inputs: Sequence[PathLike], out: Optional[PathLike] = None, replica: Optional[PathLike] = None,
                 dry_run: bool = False) -> ApplyReport:
    """Check ``inputs`` in order and (unless ``dry_run``) apply them to a new replica, or to
    the one at ``replica``, and write it to ``out`` (default: ``replica``).

    Raises:
        OrderError: a gap, an overlap or an input out of order (nothing is written).
        InvalidInputError: an unreadable input, or no ``out``.
    """
    if not inputs:
        raise InvalidInputError("give at least one input (a shard-files directory or a replay output)")
    dest = os.fspath(out) if out is not None else (os.fspath(replica) if replica is not None else None)
    if dest is None and not dry_run:
        raise InvalidInputError("--out REPLICA is required (or --dry-run)")
    pieces = [read_piece(p) for p in inputs]
    prev = Replica.load(replica) if replica is not None else None
    if dry_run:
        nxt = check_order(pieces, prev.next_batch if prev is not None else None)
    else:
        rep = apply_pieces(pieces, prev)
        rep.save(dest)  # type: ignore[arg-type]
        nxt = rep.next_batch
    return ApplyReport([(p.path, p.kind, p.ranges) for p in pieces], nxt, dest, dry_run)
