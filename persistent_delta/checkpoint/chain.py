"""Which base and increments a restore uses: complete bases, and the chain of increments after one.

Owns: the rules of a valid chain, offline (no process group, no model). A base counts only when
its DCP ``.metadata`` (written last by DCP's save) and its ``persistent_delta_base.json`` exist.
Its increments are numbered 1, 2, ...; each is complete when every rank's header is there and
all agree (:meth:`~.format.PartHeader.agrees_with`), name the base, the ranks' log identities
the base recorded and the base's shard layout, and follow the previous one (``prev_step``).
Trailing incomplete increments (a crash while one was written) are left out: the previous one
is the latest. Anything else -- a gap, a duplicate step, another base's or job's part -- is an
:class:`~persistent_delta.errors.IncrementChainError`, never skipped.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from persistent_delta.checkpoint.format import (BASE_INFO, DCP_METADATA, FORMAT_VERSION, INCREMENTS, BaseInfo, Layout,
                                                PartHeader, part_paths)
from persistent_delta.errors import FormatMismatchError, IncompleteBaseError, IncrementChainError, ShardLayoutError

logger = logging.getLogger(__name__)

_BASE_NAME = re.compile(r"^base-(\d{12})$")
_SEQ_NAME = re.compile(r"^(\d{8})$")


@dataclass
class Increment:
    """A complete increment: its number, directory and every rank's header (index = rank)."""

    seq: int
    path: str
    headers: List[PartHeader]

    @property
    def step(self) -> int:
        return self.headers[0].step


@dataclass
class Chain:
    """A base and its complete increments in order; ``leftovers``: the directories of trailing
    incomplete increments (a crash while one was written), which a restore removes."""

    base: str
    info: BaseInfo
    increments: List[Increment] = field(default_factory=list)
    leftovers: List[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        """The training step the chain restores to."""
        return self.increments[-1].step if self.increments else self.info.step


def open_base(path: str) -> BaseInfo:
    """The :class:`~.format.BaseInfo` of a complete base.

    Raises:
        IncompleteBaseError: no such directory, no DCP ``.metadata`` (a save that did not
            finish), or no ``persistent_delta_base.json``.
        FormatMismatchError: written with another format version.
    """
    if not os.path.isdir(path):
        raise IncompleteBaseError(f"{path}: no such base directory")
    if not os.path.exists(os.path.join(path, DCP_METADATA)):
        raise IncompleteBaseError(
            f"{path}: no {DCP_METADATA}: torch.distributed.checkpoint writes it last, so this save did not finish (a "
            "crash inside dcp.save). Restore from an older base, or take a new one")
    try:
        with open(os.path.join(path, BASE_INFO), "rb") as f:
            info = BaseInfo.from_json(f.read())
    except FileNotFoundError:
        raise IncompleteBaseError(
            f"{path}: a DCP checkpoint without {BASE_INFO}: the save finished but was never adopted as a base (the "
            "process died right after dcp.save, or it was taken without Checkpoints.save_base/adopt_base)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise IncompleteBaseError(f"{path}/{BASE_INFO} is malformed: {exc}") from exc
    if info.version != FORMAT_VERSION:
        raise FormatMismatchError(f"{path}: base format version {info.version}, this library reads {FORMAT_VERSION}: "
                                  "restore it with the version that wrote it, or take a new base")
    return info


def list_bases(root: str) -> List[Tuple[int, str]]:
    """(step, directory) of every ``base-<step>`` directory under ``root``, complete or not,
    oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
             if (m := _BASE_NAME.match(name)) and os.path.isdir(os.path.join(root, name))]
    return sorted(found)


def latest_chain(root: str) -> Chain:
    """The chain under ``root`` that reaches the furthest step (ties: the newer base's): a
    trainer that went on writing increments after its base was consolidated has the newer
    state in the older base's chain. Incomplete bases (saves that did not finish) are logged
    and passed over, and so is an older base whose increments are not one chain.

    Raises:
        IncompleteBaseError: no complete base under ``root``.
        IncrementChainError: the newest complete base's increments are not one chain.
    """
    best: Optional[Chain] = None
    for _step, path in reversed(list_bases(root)):
        try:
            info = open_base(path)
        except IncompleteBaseError as exc:
            logger.warning("passing over an incomplete base: %s", exc)
            continue
        if best is None:
            best = chain_of(path, info)  # the newest complete base: its errors are the caller's
            continue
        try:
            chain = chain_of(path, info)
        except IncrementChainError as exc:
            logger.warning("passing over an older base whose increments are not one chain: %s", exc)
            continue
        if chain.step > best.step:
            best = chain
    if best is not None:
        return best
    raise IncompleteBaseError(f"{root}: no complete base (a base-<step> directory with DCP's {DCP_METADATA} and "
                              f"{BASE_INFO}); take one with Checkpoints.save_base()")


def chain_of(base: str, info: BaseInfo) -> Chain:
    """The complete increments of the base in ``base`` in order, and trailing incomplete ones.

    Raises:
        IncrementChainError: a gap, a duplicate step, a part of another base, job or run, a
            malformed header.
    """
    chain = Chain(base, info)
    root = os.path.join(base, INCREMENTS)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    prev_step, expect = info.step, 1
    for name in names:
        m = _SEQ_NAME.match(name)
        if m is None:
            continue  # a temp file of an atomic write
        path, seq = os.path.join(root, name), int(m.group(1))
        if seq != expect:
            raise IncrementChainError(f"{path}: increment {seq} follows increment {expect - 1} (increment {expect} is "
                                      "missing): a gap in the chain")
        headers = _headers(path, info)
        if headers is None:
            chain.leftovers.append(path)
        elif chain.leftovers:
            raise IncrementChainError(f"{path}: a complete increment after the incomplete {chain.leftovers[0]}: a gap "
                                      "in the chain")
        else:
            _check_follows(path, headers[0], info, seq, prev_step)
            chain.increments.append(Increment(seq, path, headers))
            prev_step = headers[0].step
        expect += 1
    return chain


def _headers(path: str, info: BaseInfo) -> Optional[List[PartHeader]]:
    """Every rank's header of an increment, checked against the base and each other; None when
    a rank's is missing (not complete)."""
    headers: List[PartHeader] = []
    for rank in range(info.world_size):
        part, head = part_paths(path, rank)
        try:
            with open(head, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            h = PartHeader.from_json(data, head)  # FormatMismatchError for another version
        except (ValueError, KeyError, TypeError) as exc:
            raise IncrementChainError(f"{head}: a malformed header ({exc})") from exc
        if h.base_id != info.base_id:
            raise IncrementChainError(f"{head}: a part of base {h.base_id}, not of this directory's base {info.base_id}")
        mine = info.ranks[rank]
        if h.rank != rank or (h.log_id, h.log_stamp) != (mine.log_id, mine.log_stamp):
            raise IncrementChainError(
                f"{head}: a part of rank {h.rank}'s log {h.log_id} (another job, or a log started afresh), not of rank "
                f"{rank}'s log {mine.log_id} that the base recorded")
        if h.world_size != info.world_size or h.layout != mine.layout:
            raise ShardLayoutError(f"{head}: written with world size {h.world_size} and shards {h.layout}; the base "
                                   f"has world size {info.world_size} and shards {mine.layout}")
        if headers and not h.agrees_with(headers[0]):
            raise IncrementChainError(
                f"{head}: rank {rank}'s part (step {h.step}, run {h.run_id}) and rank 0's (step {headers[0].step}, run "
                f"{headers[0].run_id}) are of different increments")
        if not os.path.exists(part):
            raise IncrementChainError(f"{part}: missing, and its header is there")
        headers.append(h)
    return headers


def _check_follows(path: str, h: PartHeader, info: BaseInfo, seq: int, prev_step: int) -> None:
    if h.seq != seq:
        raise IncrementChainError(f"{path}: its parts say increment {h.seq}, its directory {seq}")
    if h.step == prev_step:
        raise IncrementChainError(f"{path}: a duplicate: step {h.step} again (the increment before it, or the base, "
                                  "was taken at the same step)")
    if h.prev_step != prev_step or h.step < prev_step:
        raise IncrementChainError(f"{path}: follows step {h.prev_step} and is at step {h.step}, but the chain is at step "
                                  f"{prev_step} there: it is of another timeline")


def check_layout(info: BaseInfo, rank: int, world_size: int, layout: Layout) -> None:
    """Check that this rank (of ``world_size``) holds the shards the base was saved with.

    Raises:
        ShardLayoutError: another world size, or another shard of some table on this rank
            (another plan, another column split).
    """
    if world_size != info.world_size:
        raise ShardLayoutError(f"the base was saved by {info.world_size} ranks and this job runs {world_size}: its "
                               "shards (and their optimizer states) cannot be resharded. Restore with the world size "
                               "it was saved with")
    saved = info.ranks[rank].layout
    if saved != layout:
        diff: Dict[str, Tuple[Optional[List[int]], Optional[List[int]]]] = {
            f: (saved.get(f), layout.get(f)) for f in sorted(set(saved) | set(layout)) if saved.get(f) != layout.get(f)}
        raise ShardLayoutError(
            f"rank {rank} holds other shards than when the base was saved (fqn: ([row_offset, col_offset, rows, cols] "
            f"saved, now)): {diff}. Restore with the sharding plan it was saved with (a column-wise table's "
            "row-wise Adagrad momentum cannot be resharded)")


__all__ = ["Chain", "Increment", "chain_of", "check_layout", "latest_chain", "list_bases", "open_base"]
