"""Every consumer keeps the promises of the ``Consumer`` protocol alike: a local
``DeltaReader`` and ``DeltaConsumer`` and a ``RemoteConsumer`` fed by a ``Shipper`` from the same
log, on the same log content (two ranks of plain stores, one batch without records)."""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from nats_servers import nats_server  # noqa: F401 - fixture
from persistent_delta import DeltaConsumer, DeltaReader, LmdbDeltaStore
from persistent_delta.errors import InvalidInputError, LogClosedError
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.records import batch_bytes
from persistent_delta.log.schema import LOOKUPS
from persistent_delta.read.polling import CommittingConsumer, Consumer

RANKS = 2
BATCHES = 10
EMPTY = 4  # a batch without records on every rank
DIM = 4
KINDS = ["reader", "consumer", "remote"]
Opener = Callable[[str], Consumer]


def _rows(b: int) -> int:
    return 0 if b == EMPTY else 6 + 5 * (b % 3)


def _fill(root: str) -> None:
    for rank in range(RANKS):
        with LmdbDeltaStore(os.path.join(root, f"rank-{rank}"), updateMode=UpdateMode.LAST) as store:
            for b in range(BATCHES):
                n = _rows(b)
                if n:
                    ids = torch.arange(n) * RANKS + rank
                    store.append(b, "t", ids, torch.full((n, DIM), float(b)))


def _local_pieces(root: str) -> Dict[int, int]:
    """A local reader's pieces: batch end -> value bytes stored under the batch, over ranks."""
    out: Dict[int, int] = {}
    for rank in range(RANKS):
        with DeltaLog(os.path.join(root, f"rank-{rank}"), readonly=True, writer_lock=False) as log:
            for b, n in log.read(lambda r: batch_bytes(r, LOOKUPS, 0, None)).items():
                out[b + 1] = out.get(b + 1, 0) + n
    return out


def _remote_pieces() -> Dict[int, int]:
    """A remote consumer's pieces (one shipped range per batch): range end -> its rows' bytes
    (int64 ids and fp32 states), over ranks."""
    return {b + 1: RANKS * _rows(b) * (8 + 4 * DIM) for b in range(BATCHES) if _rows(b)}


@pytest.fixture(params=KINDS)
def kind(request, tmp_path) -> Tuple[str, Opener, Dict[int, int]]:
    """(kind, open(name) -> a consumer of the log, the kind's pieces for the byte cut)."""
    root = str(tmp_path / "log")
    _fill(root)
    if request.param == "reader":
        return request.param, lambda name: DeltaReader(root), _local_pieces(root)
    if request.param == "consumer":
        return request.param, lambda name: DeltaConsumer(root, name), _local_pieces(root)
    server = request.getfixturevalue("nats_server")
    with Shipper(root, server.url, "conf", channels=[LOOKUPS], max_batches=1) as shipper:
        shipper.run(idle_exit_s=0.3)
    return request.param, lambda name: RemoteConsumer(server.url, "conf", name, wait=10), _remote_pieces()


def _drain(c: Consumer, **kw: int) -> List[Tuple[int, int]]:
    """Poll until the end; every poll's range, checked half-open, contiguous and the same on
    every rank."""
    got: List[Tuple[int, int]] = []
    prev = c.position()
    for _ in range(4 * BATCHES):
        if c.position() == c.end_offsets():
            break
        ranges = c.poll(**kw).ranges
        assert set(ranges) == set(range(RANKS))
        for rank, (start, end) in ranges.items():
            assert start == prev[rank] <= end, (rank, start, end, prev)
        assert len(set(ranges.values())) == 1, ranges
        prev = {rank: end for rank, (_, end) in ranges.items()}
        assert c.position() == prev
        got.append(ranges[0])
    assert c.position() == c.end_offsets() == {rank: BATCHES for rank in range(RANKS)}
    return got


def _cut_oracle(pieces: Dict[int, int], max_bytes: int) -> List[Tuple[int, int]]:
    """The polls the byte cut gives from 0 to the end: the first piece with bytes always taken,
    each next one while the total stays within the budget, the poll ending at the last piece
    taken (every piece fits: the end)."""
    out, pos = [], 0
    while pos < BATCHES:
        taken, total, cut = None, 0, BATCHES
        for end in sorted(e for e in pieces if e > pos):
            if taken is not None and total + pieces[end] > max_bytes:
                cut = taken
                break
            taken, total = end, total + pieces[end]
        out.append((pos, cut))
        pos = cut
    return out


def test_every_consumer_is_a_consumer(kind):
    name, open_, _ = kind
    with open_("proto") as c:
        assert isinstance(c, Consumer)
        assert isinstance(c, CommittingConsumer) == (name != "reader")  # a reader keeps positions in memory only
        assert c.ranks == list(range(RANKS)) and c.missing_ranks() == []


def test_polls_are_half_open_and_contiguous(kind):
    _, open_, _ = kind
    with open_("all") as c:
        assert _drain(c) == [(0, BATCHES)]
        empty = c.poll(timeout=0.05)
        assert empty.empty and empty.ranges == {rank: (BATCHES, BATCHES) for rank in range(RANKS)}


def test_max_batches_bounds_every_poll_alike(kind):
    _, open_, _ = kind
    with open_("mb") as c:
        assert _drain(c, max_batches=3) == [(0, 3), (3, 6), (6, 9), (9, 10)]


@pytest.mark.parametrize("budget", ["one byte", "two pieces", "everything"])
def test_max_bytes_cuts_by_the_one_rule(kind, budget):
    """The same rule on every consumer, each with its own piece sizes: a one-byte budget reads
    one batch with records per poll (the batch without records rides with the next one)."""
    _, open_, pieces = kind
    max_bytes = {"one byte": 1, "two pieces": pieces[1] + pieces[2], "everything": sum(pieces.values())}[budget]
    with open_("bytes") as c:
        got = _drain(c, max_bytes=max_bytes)
    assert got == _cut_oracle(pieces, max_bytes)
    if budget == "one byte":
        assert got == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10)]
    if budget == "everything":
        assert got == [(0, BATCHES)]


BAD_POLLS = [
    (dict(max_batches=0), "max_batches must be a positive int or None, got 0"),
    (dict(max_batches=True), "max_batches must be a positive int or None, got True"),
    (dict(max_batches=1.5), "max_batches must be a positive int or None, got 1.5"),
    (dict(timeout=-1), "timeout must be a non-negative number of seconds or None, got -1"),
    (dict(timeout=False), "timeout must be a non-negative number of seconds or None, got False"),
    (dict(max_bytes=0), "max_bytes must be a positive int or None, got 0"),
    (dict(max_bytes="1"), "max_bytes must be a positive int or None, got '1'"),
]


def test_bad_poll_arguments_raise_the_same_error(kind):
    _, open_, _ = kind
    with open_("bad") as c:
        for args, message in BAD_POLLS:
            with pytest.raises(InvalidInputError) as got:
                c.poll(**args)
            assert str(got.value) == message
        assert c.position() == {rank: 0 for rank in range(RANKS)}  # a refused poll moves nothing


def test_positions_after_commit_and_seek(kind):
    name, open_, _ = kind
    with open_("pos") as c:
        c.poll(max_batches=3)
        assert c.position() == {rank: 3 for rank in range(RANKS)}
        if isinstance(c, CommittingConsumer):
            assert c.commit() == c.position() == c.committed()
        c.poll(max_batches=2)
        c.seek(1)
        assert c.position() == {rank: 1 for rank in range(RANKS)}
        assert c.poll(max_batches=1).ranges == {rank: (1, 2) for rank in range(RANKS)}
    with open_("pos") as again:  # uncommitted positions are dropped; committed ones stay
        want = 0 if name == "reader" else 3
        assert again.position() == {rank: want for rank in range(RANKS)}


def test_close_twice_and_use_after_close(kind):
    _, open_, _ = kind
    c = open_("closing")
    with c as entered:
        assert entered is c
    assert c.closed
    c.close()
    for call in (c.poll, c.position, c.end_offsets, lambda: c.seek(0)):
        with pytest.raises(LogClosedError):
            call()
