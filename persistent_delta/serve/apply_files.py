"""``persistent-delta apply``: build or continue a replica from a base and increments, in order.

Owns: reading apply's inputs (shard-file directories, replay outputs) into
:class:`persistent_delta.serve.ordered.Piece` s. The order rule and the replica are
:mod:`persistent_delta.serve.ordered`'s.

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
import stat
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from persistent_delta.serve.replay import REPLAY_FORMAT, load_export
from persistent_delta.errors import InvalidInputError
from persistent_delta.log.layout import PathLike
from persistent_delta.serve.ordered import Piece, Replica, apply_pieces, base_piece, check_order

# Bounds on what an input may declare, checked before anything is read or allocated by it.
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 1 << 20
MAX_RANK = 1 << 20
MAX_BATCH = 1 << 62
_KINDS = ("delta", "snapshot")
_ZCH = ("zch.slots", "zch.taken", "zch.given")


def regular_file(path: str, what: str) -> os.stat_result:
    """Refuse anything but a regular file at ``path`` (not following a symbolic link).

    Raises:
        InvalidInputError: missing, a symbolic link, a FIFO, a device, a socket or a directory.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise InvalidInputError(f"{path}: {what} cannot be read ({exc.strerror})") from exc
    if stat.S_ISLNK(st.st_mode):
        raise InvalidInputError(f"{path}: {what} is a symbolic link; apply reads regular files inside its inputs only")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInputError(f"{path}: {what} is not a regular file (a FIFO, device, socket or directory): refused")
    return st


def inside(root: str, rel: Any, what: str) -> str:
    """``rel`` joined to ``root``, refused unless it names a regular file inside ``root`` (no
    absolute path, no ``..``, no symbolic link on the way).

    Raises:
        InvalidInputError: it does not.
    """
    if not isinstance(rel, str) or not rel or "\x00" in rel or len(rel) > 4096:
        raise InvalidInputError(f"{root}: {what}: path {str(rel)[:200]!r} is not a relative file name")
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm.split(os.sep)[0] == os.pardir or os.pardir in rel.split("/"):
        raise InvalidInputError(f"{root}: {what}: path {rel[:200]!r} leaves the input directory: refused")
    path = os.path.join(root, norm)
    if os.path.realpath(path) != os.path.join(os.path.realpath(root), norm):
        raise InvalidInputError(f"{root}: {what}: path {rel[:200]!r} goes through a symbolic link: refused")
    regular_file(path, what)
    return path


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidInputError(f"{what}: {str(v)[:100]!r} is not an integer in [{lo}, {hi}]")
    return v


def read_manifest(path: str) -> Dict[str, Any]:
    """A replay output's manifest, read with its size bounded (never following a link, never
    waiting on a FIFO).

    Raises:
        InvalidInputError: not a regular file, too large, not JSON, not a replay manifest.
    """
    manifest_path = os.path.join(path, "manifest.json")
    st = regular_file(manifest_path, "the manifest")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise InvalidInputError(f"{manifest_path}: {st.st_size} bytes, over the {MAX_MANIFEST_BYTES} a manifest may hold")
    try:
        fd = os.open(manifest_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InvalidInputError(f"{manifest_path}: not a regular file: refused")
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        manifest = json.loads(raw)
    except InvalidInputError:
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{path}: not a replay output ({type(exc).__name__}: {exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != REPLAY_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InvalidInputError(f"{manifest_path}: not a replay manifest (format {str(got)[:100]!r})")
    return manifest


def _ranges(manifest: Dict[str, Any], where: str) -> Dict[int, Tuple[int, int]]:
    got = manifest.get("ranges")
    if not isinstance(got, dict) or not got or len(got) > MAX_RANK:
        raise InvalidInputError(f"{where}: 'ranges' must map each rank to [start, end)")
    out: Dict[int, Tuple[int, int]] = {}
    for r, v in got.items():
        if not isinstance(r, str) or not r.isdigit() or len(r) > 8:
            raise InvalidInputError(f"{where}: rank {str(r)[:100]!r} is not a rank (0, 1, ...)")
        rank = _int(int(r), 0, MAX_RANK, f"{where}: rank")
        if not isinstance(v, list) or len(v) != 2:
            raise InvalidInputError(f"{where}: rank {rank}: range {str(v)[:100]!r} is not [start, end]")
        a = _int(v[0], 0, MAX_BATCH, f"{where}: rank {rank} start")
        b = _int(v[1], 0, MAX_BATCH, f"{where}: rank {rank} end")
        if b < a:
            raise InvalidInputError(f"{where}: rank {rank}: range [{a}, {b}) ends before it starts")
        out[rank] = (a, b)
    return out


def _check_tensors(tensors: Dict[str, torch.Tensor], kind: str, where: str) -> None:
    """The tensors ``apply`` uses, checked: integer 1-D ids (not negative), float 2-D values of
    one row per id, the managed-collision triple whole."""
    def ids_ok(key: str) -> torch.Tensor:
        t = tensors.get(key)
        if t is None or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise InvalidInputError(f"{where}: {key!r} must be a 1-D integer tensor")
        if t.numel() and int(t.min()) < 0:
            raise InvalidInputError(f"{where}: {key!r} holds negative ids")
        return t

    if kind == "snapshot":
        ids, values = ids_ok("ids"), tensors.get("values")
        if values is None or values.dim() != 2 or not values.dtype.is_floating_point or values.shape[0] != ids.numel():
            raise InvalidInputError(f"{where}: 'values' must be a 2-D float tensor with one row per id")
    zch = [k for k in _ZCH if k in tensors]
    if zch:
        if len(zch) != len(_ZCH):
            raise InvalidInputError(f"{where}: managed-collision tensors {zch} without {sorted(set(_ZCH) - set(zch))}")
        n = {ids_ok(k).numel() for k in ("zch.slots", "zch.given")}
        taken = tensors["zch.taken"]
        if len(n) != 1 or taken.dim() != 1 or taken.dtype.is_floating_point or taken.numel() != n.pop():
            raise InvalidInputError(f"{where}: managed-collision tensors of different lengths or types")


def increment_piece(out_dir: PathLike) -> Piece:
    """A replay output directory as an increment (its manifest's ranges; span files in order).
    Everything is checked before it is used: the manifest (a regular file of bounded size),
    every field (ranks, ranges, kinds, batch indices), every file it names (a regular file
    inside the directory, no link) and the tensors apply uses.

    Raises:
        InvalidInputError: no manifest of a replay output, a malformed field, a file outside the
            directory, a link, a FIFO or device, or a malformed file.
    """
    path = os.fspath(out_dir)
    manifest = read_manifest(path)
    where = os.path.join(path, "manifest.json")
    ranges = _ranges(manifest, where)
    files = manifest.get("files")
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise InvalidInputError(f"{where}: 'files' must be a list (at most {MAX_FILES})")
    lo, hi = min(a for a, _ in ranges.values()), max(b for _, b in ranges.values())
    checked: List[Tuple[str, int, str, str]] = []  # (kind, start, fqn, path)
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise InvalidInputError(f"{where}: file entry {i} is not an object")
        if not f.get("path"):
            continue  # a dry-run entry: nothing written
        kind, fqn = f.get("kind"), f.get("fqn")
        if kind not in _KINDS or not isinstance(fqn, str) or not fqn:
            raise InvalidInputError(f"{where}: file entry {i}: kind {str(kind)[:50]!r} / fqn {str(fqn)[:100]!r} invalid")
        start = _int(f.get("start_idx"), lo, hi, f"{where}: file entry {i} start_idx")
        checked.append((kind, start, fqn, inside(path, f["path"], f"file entry {i}")))
    piece = Piece(path, "increment", ranges)
    for kind, start, fqn, file in sorted(checked, key=lambda c: (c[0] != "delta", c[1], c[2])):
        try:
            tensors, meta = load_export(file)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own types on a malformed file
            raise InvalidInputError(f"{file}: malformed export ({type(exc).__name__}: {str(exc)[:200]})") from exc
        if meta.get("format") != REPLAY_FORMAT or meta.get("kind") != kind or meta.get("fqn") != fqn:
            raise InvalidInputError(f"{file}: not the {kind} export of {fqn[:200]!r} the manifest names")
        _check_tensors(tensors, kind, file)
        if kind == "delta":
            piece.spans.append((start, fqn, tensors))
        else:
            piece.snapshots.append((fqn, tensors))
    return piece


def _base_files(path: str) -> None:
    """Every shard file of a base directory is a regular file (no link, FIFO or device)."""
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise InvalidInputError(f"{path}: cannot be read ({exc.strerror})") from exc
    for name in names:
        if name.startswith("rank-") and name.endswith(".safetensors"):
            regular_file(os.path.join(path, name), "a shard file")


def read_piece(path: PathLike) -> Piece:
    """A base (a directory of ``rank-<r>.safetensors``) or an increment (a replay output).

    Raises:
        InvalidInputError: not a directory, or a malformed input (see :func:`increment_piece`).
    """
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise InvalidInputError(f"{p}: not a directory (a shard-files directory or a replay output)")
    if os.path.lexists(os.path.join(p, "manifest.json")):
        return increment_piece(p)
    _base_files(p)
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
    if replica is not None:
        regular_file(os.fspath(replica), "the replica")
    prev = Replica.load(replica) if replica is not None else None
    if dry_run:
        nxt = check_order(pieces, prev.next_batch if prev is not None else None)
    else:
        rep = apply_pieces(pieces, prev)
        rep.save(dest)  # type: ignore[arg-type]
        nxt = rep.next_batch
    return ApplyReport([(p.path, p.kind, p.ranges) for p in pieces], nxt, dest, dry_run)
