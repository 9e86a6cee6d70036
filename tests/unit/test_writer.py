"""The background writer: group commit, backpressure, per-batch dedup and the window filter."""

import threading
import time

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.log import position_rules
from persistent_delta.trainer import consume
from persistent_delta.config import WriterOptions
from persistent_delta.log.schema import ConsumerEntry, Delivery
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.rows import compute_unique_rows
from persistent_delta.log.records import AppendRecord, materialized, read_unique
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.errors import InvalidInputError
from persistent_delta.trainer.operations import Compaction, StepWrite
from persistent_delta.trainer.writer import BackgroundWriter, commit_operations


def batches(n, seed=0, rows=40, size=30):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(1, n + 1):
        ids = torch.randint(0, rows, (size,), generator=g)
        out.append((b, ids, torch.full((size, 2), float(b)) + torch.arange(size).unsqueeze(1) / 100))
    return out


def truth(raw, mode, start, end):
    sel = [(ids, st) for b, ids, st in raw if start <= b < end]
    return compute_unique_rows([i for i, _ in sel], None if mode == UpdateMode.NONE else [s for _, s in sel], mode)


def assert_reads_truth(log, mode, raw, start):
    """A read from ``start`` equals TorchRec's rule over every raw batch from ``start`` on."""
    got = log.read(lambda r: read_unique(r, mode, start)["t"])
    want = truth(raw, mode, start, 10**9)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.states, want.states)


def log_with_consumer(path, mode, delivery_=Delivery.IN_TRANSACTION):
    log = DeltaLog(path, update_mode=mode.value)
    log.write(lambda w: w.set_consumer("a", ConsumerEntry.new(0, "lookups", delivery_)))
    return log


class HeldCopy:
    """A device copy the writer waits for (it calls ``synchronize()`` before its transaction,
    in its own thread): ``run`` runs there."""

    def __init__(self, run):
        self.run = run

    def synchronize(self):
        self.run()


def write_all(log, mode, raw, window):
    for b, ids, st in raw:
        commit_operations(log, mode, [StepWrite(records=[AppendRecord(b, "t", ids, None if mode == UpdateMode.NONE else st)])], window)


@pytest.mark.parametrize("slot_rows", [1 << 22, 8])  # direct-address dedup, and the sort fallback
def test_window_filter_writes_less_and_answers_stay_exact(tmp_path, slot_rows):
    for mode in (UpdateMode.FIRST, UpdateMode.NONE):
        raw = batches(12, seed=1)
        log = log_with_consumer(str(tmp_path / mode.value), mode)
        window = WindowFilter(mode)
        window._SLOT_ROWS = slot_rows
        write_all(log, mode, raw, window)
        assert window.rows_dropped > 0
        stored = log.read(lambda r: torch.cat([rec.ids.clone() for rec in r.iter_records(r.table("t").table_id)]))
        assert stored.numel() < sum(ids.unique().numel() for _, ids, _ in raw)  # fewer than per-batch dedup alone
        assert stored.unique().numel() == stored.numel()  # one window (offset 0): every id written once
        got = log.read(lambda r: read_unique(r, mode, 0)["t"])
        want = truth(raw, mode, 0, 100)
        assert torch.equal(got.ids, want.ids)
        if mode == UpdateMode.FIRST:
            assert torch.equal(got.states, want.states)
        log.close()


def test_a_position_inside_a_window_is_redelivered_never_lost(tmp_path):
    mode = UpdateMode.FIRST
    raw = batches(12, seed=2)
    log = log_with_consumer(str(tmp_path / "log"), mode)
    write_all(log, mode, raw, WindowFilter(mode))
    for pos in range(1, 13):
        start = log.read(lambda r: position_rules.read_start(r, pos))
        assert start <= pos
        got = log.read(lambda r: read_unique(r, mode, position_rules.read_start(r, pos))["t"])
        want = truth(raw, mode, pos, 100)
        assert set(want.ids.tolist()) <= set(got.ids.tolist()), pos  # nothing missed
        assert torch.equal(truth(raw, mode, start, 100).ids, got.ids)  # exactly the window's rows
    log.close()


def test_no_window_filter_for_last_mode_or_external_consumers(tmp_path):
    raw = batches(6, seed=3)
    for mode, by in ((UpdateMode.LAST, Delivery.IN_TRANSACTION), (UpdateMode.FIRST, Delivery.POLL_COMMIT)):
        log = log_with_consumer(str(tmp_path / f"{mode.value}-{by.value}"), mode, delivery_=by)
        window = WindowFilter(mode)
        write_all(log, mode, raw, window)
        assert window.rows_dropped == 0
        starts = log.read(lambda r: {rec.window_start for rec in r.iter_records(r.table("t").table_id)})
        assert starts == {None}
        assert log.read(lambda r: position_rules.read_start(r, 4)) == 4
        log.close()


def test_window_restarts_when_the_largest_offset_moves(tmp_path):
    mode = UpdateMode.FIRST
    raw = batches(10, seed=4, rows=10)
    log = log_with_consumer(str(tmp_path / "log"), mode)
    window = WindowFilter(mode)
    write_all(log, mode, raw[:5], window)
    log.write(lambda w: w.set_consumer("a", ConsumerEntry.new(6, "lookups", Delivery.IN_TRANSACTION)))
    write_all(log, mode, raw[5:], window)
    # a consumer at the new offset gets every row touched from batch 6 on, with first values
    assert_reads_truth(log, mode, raw, 6)
    log.close()


def test_backpressure_bounds_the_queue_and_drops_nothing(tmp_path):
    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE, WriterOptions(max_pending_bytes=1 << 20, max_pending_steps=2))
    depths = []
    for b in range(40):
        writer.submit(StepWrite(records=[AppendRecord(b, "t", torch.arange(50_000) + b)], dedup=False))
        depths.append(writer.stats()["queue_depth"])
    writer.barrier()
    stats = writer.stats()
    writer.close()
    assert max(depths) <= 2
    assert stats["total_wait_s"] > 0 and stats["max_wait_s"] > 0
    assert stats["bytes_written"] >= 40 * 50_000 * 8
    batches_stored = log.read(lambda r: [b for b, _, _ in r.iter_record_keys(r.table("t").table_id)])
    assert batches_stored == list(range(40))
    log.close()


def test_group_commit_and_stats(tmp_path):
    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE)
    gate = threading.Event()
    # hold the writer inside a commit so that later steps queue up and go in one transaction
    writer.submit(StepWrite(events=[HeldCopy(lambda: gate.wait(10))]))
    time.sleep(0.1)
    for b in range(10):
        writer.submit(StepWrite(records=[AppendRecord(b, "t", torch.tensor([b, b]))], curr_batch_idx=b))
    gate.set()
    writer.barrier()
    stats = writer.stats()
    writer.close()
    assert stats["operations"] == 11 and stats["commits"] <= 3
    assert log.read(lambda r: r.meta("curr_batch_idx")) == 9
    assert log.read(lambda r: [rec.ids.tolist() for rec in r.iter_records(r.table("t").table_id)]) == [[b] for b in range(10)]
    log.close()


def test_a_retried_or_failed_commit_does_not_leave_rows_in_the_window(tmp_path):
    """Map growth aborts and retries the transaction; a failed one is not committed: either way
    the window must be as if the attempt never ran, or rows would be filtered and never written."""
    from persistent_delta.config import LogOptions

    mode = UpdateMode.FIRST
    g = torch.Generator().manual_seed(3)
    raw = [(b, torch.randint(0, 5000, (3000,), generator=g), None) for b in range(1, 9)]
    raw = [(b, ids, torch.randn(ids.numel(), 64, generator=g)) for b, ids, _ in raw]
    log = DeltaLog(str(tmp_path / "l"), update_mode=mode.value, options=LogOptions(map_size=256 << 10))
    log.write(lambda w: w.set_consumer("a", ConsumerEntry.new(0, "lookups", Delivery.IN_TRANSACTION)))
    window = WindowFilter(mode)
    size0 = log.stat()["map_size"]
    write_all(log, mode, raw[:4], window)  # ~3 MB into a 256 KiB map: grows (and retries) on the way
    assert log.stat()["map_size"] > size0

    # a record the codec refuses fails the transaction after the window filter saw the first one
    bad = AppendRecord(5, "u", torch.tensor([-1]), torch.zeros(1, 64))
    with pytest.raises(InvalidInputError):
        commit_operations(log, mode, [StepWrite(records=[AppendRecord(5, "t", raw[4][1], raw[4][2]), bad])], window)
    write_all(log, mode, raw[4:], window)
    assert_reads_truth(log, mode, raw, 0)
    log.close()


def _committed(log):
    return log.read(lambda r: [b for b, _, _ in r.iter_record_keys(r.table("t").table_id)] if r.table("t") else [])


def test_linger_groups_steps_until_enough_are_queued(tmp_path):
    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE, WriterOptions(linger_steps=4, linger_s=30.0))
    for b in range(3):
        writer.submit(StepWrite(records=[AppendRecord(b, "t", torch.tensor([b]))]))
    time.sleep(0.3)
    assert _committed(log) == [] and writer.stats()["commits"] == 0  # still gathering
    writer.submit(StepWrite(records=[AppendRecord(3, "t", torch.tensor([3]))]))
    deadline = time.monotonic() + 10
    while writer.stats()["commits"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _committed(log) == [0, 1, 2, 3] and writer.stats()["commits"] == 1  # one transaction
    writer.close()


def test_large_steps_do_not_linger(tmp_path):
    """Steps above linger_bytes are processed at once (overlapping training), not deferred."""
    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE, WriterOptions(linger_steps=100, linger_s=60.0, linger_bytes=4096))
    writer.submit(StepWrite(records=[AppendRecord(0, "t", torch.arange(1000))]))  # 8 KB
    deadline = time.monotonic() + 10
    while not _committed(log) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _committed(log) == [0]
    writer.close()


def test_a_backlog_commits_at_most_linger_bytes_a_transaction(tmp_path):
    """A writer that fell behind takes its backlog in transactions that stop gathering once
    they hold ``linger_bytes`` of captured bytes, in order, every step whole: not the whole
    queue in one transaction holding every page of it."""
    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE, WriterOptions(linger_bytes=20_000, linger_s=0.0))
    gate = threading.Event()
    writer.submit(StepWrite(events=[HeldCopy(lambda: gate.wait(10))]))  # the writer is busy: a backlog
    time.sleep(0.1)
    sizes = [1000, 1000, 1000, 5000, 500, 5000, 0, 500]  # ids a step, 8 bytes each; 0: an empty step
    for b, n in enumerate(sizes):
        writer.submit(StepWrite(records=[AppendRecord(b, "t", torch.arange(n) + 10 * b)] if n else [],
                                curr_batch_idx=b))
    gate.set()
    writer.barrier()
    stats = writer.stats()
    writer.close()
    # (the held step) + [1000, 1000, 1000: reaches the limit] + [5000] + [500, 5000: a large step joins
    # a small one, as a publish joins its step] + [0, 500]
    assert stats["commits"] == 5 and stats["operations"] == 9
    stored = log.read(lambda r: [(b, rec.ids.tolist()) for (b, _, _), rec in
                                 zip(r.iter_record_keys(r.table("t").table_id), r.iter_records(r.table("t").table_id))])
    assert stored == [(b, (torch.arange(n) + 10 * b).tolist()) for b, n in enumerate(sizes) if n]
    assert log.read(lambda r: r.meta("curr_batch_idx")) == len(sizes) - 1
    log.close()


def test_linger_is_bounded_in_time_and_a_barrier_does_not_wait_for_it(tmp_path):
    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE, WriterOptions(linger_steps=100, linger_s=0.2))
    writer.submit(StepWrite(records=[AppendRecord(0, "t", torch.tensor([0]))]))
    deadline = time.monotonic() + 10
    while not _committed(log) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _committed(log) == [0]  # committed after ~linger_s although far fewer than 100 steps
    writer.close()

    log2 = DeltaLog(str(tmp_path / "log2"), update_mode="none")
    writer = BackgroundWriter(log2, UpdateMode.NONE, WriterOptions(linger_steps=100, linger_s=60.0))
    writer.submit(StepWrite(records=[AppendRecord(0, "t", torch.tensor([0]))]))
    t0 = time.monotonic()
    writer.barrier()
    assert time.monotonic() - t0 < 5 and _committed(log2) == [0]  # flush commits at once
    writer.close()


def test_an_inline_commit_runs_on_the_calling_thread_after_what_was_queued(tmp_path, monkeypatch):
    """``commit_inline`` commits on the caller's thread, in one transaction, after the steps
    queued before it (which it does not leave lingering); the writer thread takes nothing
    meanwhile, and what is submitted after it is committed after it."""
    from persistent_delta.log.schema import META_CURR_BATCH
    from persistent_delta.trainer import writer as writer_mod

    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE, WriterOptions(linger_steps=100, linger_s=60.0))
    threads = []
    real = writer_mod.commit_operations

    def spy(*args, **kw):
        threads.append((threading.get_ident(), [op.curr_batch_idx for op in args[2]]))
        return real(*args, **kw)

    monkeypatch.setattr(writer_mod, "commit_operations", spy)
    writer.submit(StepWrite(records=[AppendRecord(0, "t", torch.tensor([0]))], curr_batch_idx=1))
    writer.commit_inline([StepWrite(records=[AppendRecord(1, "t", torch.tensor([1]))], curr_batch_idx=2),
                          StepWrite(records=[AppendRecord(1, "t", torch.tensor([2]))], curr_batch_idx=2)])
    assert _committed(log) == [0, 1] and log.read(lambda r: r.meta(META_CURR_BATCH)) == 2
    writer.submit(StepWrite(records=[AppendRecord(2, "t", torch.tensor([3]))], curr_batch_idx=3))
    writer.barrier()
    assert _committed(log) == [0, 1, 2] and log.read(lambda r: r.meta(META_CURR_BATCH)) == 3
    me = threading.get_ident()
    assert [(t == me, batches) for t, batches in threads] == [(False, [1]), (True, [2, 2]), (False, [3])]
    writer.close()


def test_a_failed_inline_commit_stops_the_writer_as_its_own_commit_does(tmp_path):
    """A failed ``commit_inline`` keeps its operations at the head of the queue and stops the
    writer: the next call raises WriterError, and ``resume`` retries them."""
    from persistent_delta.errors import WriterError

    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE)
    bad = StepWrite(records=[AppendRecord(0, "t", torch.tensor([-1]))], curr_batch_idx=1)
    writer.commit_inline([bad])  # the error is the writer's, raised by the next call
    assert writer.queued() == [bad] and writer.stats()["failed"]
    with pytest.raises(WriterError):
        writer.submit(StepWrite(records=[AppendRecord(1, "t", torch.tensor([1]))]))
    bad.records[0] = AppendRecord(0, "t", torch.tensor([5]))  # the cause fixed
    writer.resume()
    assert _committed(log) == [0] and writer.queued() == []
    writer.close()


def test_writer_options_are_checked():
    for bad in (dict(linger_steps=0), dict(linger_s=-1.0), dict(linger_bytes=-1), dict(max_pending_steps=0),
                dict(torch_threads=-1)):
        with pytest.raises(ValueError):
            WriterOptions(**bad)


@pytest.mark.parametrize("linger_steps", [1, 8])
def test_the_file_stays_near_peak_live_data_with_read_and_delete_every_10_steps(tmp_path, linger_steps):
    """A read that deletes in its own transaction frees pages the next transaction cannot reuse
    (LMDB): a large grouped transaction right after it would grow the file by its whole size."""
    import os

    from persistent_delta.log.records import delete_below

    log = DeltaLog(str(tmp_path / "log"), update_mode="first")
    opts = WriterOptions(linger_steps=linger_steps, linger_s=30.0, linger_bytes=1 << 30)
    writer = BackgroundWriter(log, UpdateMode.FIRST, opts)
    g = torch.Generator().manual_seed(0)
    peak_live = max_file = 0
    step = 0
    for window in range(30):
        for _ in range(10):
            step += 1
            recs = [AppendRecord(step, f"t{t}", torch.randperm(4000, generator=g)[:1000], torch.randn(1000, 32, generator=g))
                    for t in range(4)]
            writer.submit(StepWrite(records=recs))
            time.sleep(0.002)
        writer.barrier()
        live = log.read(lambda r: sum(len(v) for _, v in r.iter_raw()))
        peak_live = max(peak_live, live)
        log.write(lambda w: delete_below(w, step + 1))
        max_file = max(max_file, os.path.getsize(os.path.join(log.path, "data.mdb")))
    writer.close()
    log.close()
    assert max_file <= 1.5 * peak_live, (max_file, peak_live)


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="the count is per thread with OpenMP only")
@pytest.mark.parametrize("torch_threads", [1, 3])
def test_the_writer_thread_keeps_its_own_torch_threads_and_leaves_the_others(tmp_path, torch_threads):
    """``WriterOptions.torch_threads`` is the writer thread's count for its life; the thread
    that started it, and threads started afterwards, keep the process's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        log = log_with_consumer(str(tmp_path), UpdateMode.FIRST)
        writer = BackgroundWriter(log, UpdateMode.FIRST, WriterOptions(torch_threads=torch_threads))
        seen = []
        writer.submit(StepWrite(events=[HeldCopy(lambda: seen.append(torch.get_num_threads()))]))
        writer.barrier()
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [torch_threads]
        assert torch.get_num_threads() == 2 and later == [2]
        writer.close()
        log.close()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("slot_rows", [1 << 22, 8])  # direct-address dedup, and the sort fallback
def test_window_first_new_keeps_each_unseen_ids_first_position(slot_rows):
    """Against a plain reference: ascending positions of each id's first occurrence, ids
    already in the window left out, the scratch table left all unset for the next call."""
    import numpy as np

    g = np.random.default_rng(7)
    window = WindowFilter(UpdateMode.FIRST)
    window._SLOT_ROWS = slot_rows
    for rows, n in ((50, 400), (1000, 300), (100_000, 8192), (7, 1), (7, 0)):
        ids = g.zipf(1.3, n).astype(np.int64) % rows
        bitmap = g.random(rows) < 0.3
        pos, cand = window._first_new(ids, bitmap)
        want_pos, seen = [], set()
        for i, x in enumerate(ids.tolist()):
            if not bitmap[x] and x not in seen:
                seen.add(x)
                want_pos.append(i)
        assert pos.tolist() == want_pos, (rows, n)
        assert cand.tolist() == [int(ids[i]) for i in want_pos]
        if window._slot.size:
            assert (window._slot == WindowFilter._UNSET).all()


def test_window_never_filters_a_negative_id_away(tmp_path):
    """A negative id is invalid input: the record reaches the codec's check whole (a typed
    error), instead of being read as another row of the window's table (-1 as the last) and
    dropped as already recorded."""
    mode = UpdateMode.NONE
    log = log_with_consumer(str(tmp_path / "log"), mode)
    window = WindowFilter(mode)
    commit_operations(log, mode, [StepWrite(records=[AppendRecord(1, "t", torch.tensor([9, 3]))])], window)
    with pytest.raises(InvalidInputError, match="non-negative"):
        commit_operations(log, mode, [StepWrite(records=[AppendRecord(2, "t", torch.tensor([4, -1]))], dedup=False)], window)
    commit_operations(log, mode, [StepWrite(records=[AppendRecord(3, "t", torch.tensor([4, 9]))])], window)
    got = log.read(lambda r: [rec.ids.tolist() for rec in r.iter_records(r.table("t").table_id)])
    assert got == [[9, 3], [4]]  # the failed batch left nothing in the window
    log.close()


def test_pending_records_are_the_uncommitted_ones_until_an_op_is_queued(tmp_path):
    """What a publish reads instead of waiting: the records submitted and not committed, in
    order; None once a log operation is queued (it may move a consumer or merge records)."""
    log = DeltaLog(str(tmp_path / "log"), update_mode="none")
    writer = BackgroundWriter(log, UpdateMode.NONE, WriterOptions(linger_steps=100, linger_s=60.0))
    recs = [AppendRecord(b, "t", torch.tensor([b, b + 1])) for b in range(3)]
    for r in recs:
        writer.submit(StepWrite(records=[r]))
    time.sleep(0.2)
    assert _committed(log) == []  # lingering: nothing in the log yet
    assert writer.pending_records() == recs
    writer.submit(StepWrite(records=[AppendRecord(3, "t", torch.tensor([9]))]))
    assert writer.pending_records() == recs + [writer.queued()[-1].records[0]]
    writer.submit(Compaction(end=3))
    assert writer.pending_records() is None
    writer.barrier()
    assert _committed(log) == [0, 3] and writer.pending_records() == []  # [0, 3) compacted after the appends
    writer.close()


def test_the_queue_holds_the_named_operations_and_runs_each_by_its_type(tmp_path):
    """What the writer runs is what was submitted, by name: a step's records, a publish (its
    consumer moves, the snapshot end follows) and a compaction, written in order in one group;
    anything else is refused at submit."""
    from persistent_delta.log.schema import META_SNAPSHOT_END
    from persistent_delta.trainer.operations import PublishRequest

    log = log_with_consumer(str(tmp_path / "log"), UpdateMode.NONE)
    writer = BackgroundWriter(log, UpdateMode.NONE)
    gate = threading.Event()
    writer.submit(StepWrite(events=[HeldCopy(lambda: gate.wait(10))]))  # holds the writer
    step = StepWrite(records=[AppendRecord(b, "t", torch.tensor([b])) for b in range(3)], curr_batch_idx=3)
    entry = log.read(lambda r: r.consumer("a"))
    published = PublishRequest("a", end=3, stamp=2, publish_time=0.0, compact=False, delete_on_read=False,
                               entry=entry)
    compaction = Compaction(end=3)
    for op in (step, published, compaction):
        writer.submit(op)
    with pytest.raises(InvalidInputError, match="StepWrite, PublishRequest or Compaction"):
        writer.submit(lambda w: None)
    assert writer.queued()[1:] == [step, published, compaction]
    assert writer.pending_records() is None  # a publish is queued: a reader waits for it
    gate.set()
    writer.barrier()
    assert writer.queued() == [] and writer.pending_records() == []
    assert log.read(lambda r: (r.consumer("a").offset, r.meta(META_SNAPSHOT_END))) == (3, 3)
    # in order: the compaction ran after the publish moved "a" to 3, so [3, 3) had nothing to merge
    assert log.read(lambda r: [rec.ids.tolist() for rec in r.iter_records(r.table("t").table_id)]) == [[0], [1], [2]]
    writer.close()
    log.close()


def test_consume_read_ids_adds_the_pending_records_to_the_log(tmp_path):
    from persistent_delta.log.codec import KIND_RAW_IDS

    log = log_with_consumer(str(tmp_path / "log"), UpdateMode.NONE)
    log.write(lambda w: w.set_consumer("a", ConsumerEntry.new(2, "lookups", Delivery.IN_TRANSACTION)))
    for b, ids in ((1, [50, 51]), (2, [5, 7]), (3, [7, 3])):
        commit_operations(log, UpdateMode.NONE, [StepWrite(records=[AppendRecord(b, "t", torch.tensor(ids))])])
    pending = [
        AppendRecord(1, "t", torch.tensor([60])),  # below where its read starts (read_start: 2): read already
        AppendRecord(3, "t", torch.tensor([3, 5])),  # also in the log (a commit in flight): once
        AppendRecord(4, "t", torch.tensor([11, 2, 11])),
        AppendRecord(4, "u", torch.tensor([4])),  # a table the log does not hold yet
        AppendRecord(4, "t", torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.int64), kind=KIND_RAW_IDS),
    ]
    entry, ids = log.read(lambda r: consume.consume_read_ids(r, "a", pending))
    assert entry.offset == 2
    assert ids["t"].tolist() == [2, 3, 5, 7, 11] and ids["u"].tolist() == [4]
    _, alone = log.read(lambda r: consume.consume_read_ids(r, "a"))
    assert alone["t"].tolist() == [3, 5, 7] and "u" not in alone
    log.close()


def test_consume_read_ids_reads_pending_records_of_a_table_no_longer_listed(tmp_path):
    """After delete(None) a table is unlisted until its next append: a pending record is that
    append, so its ids are unread rows."""
    from persistent_delta.log.records import delete_below

    log = log_with_consumer(str(tmp_path / "log"), UpdateMode.NONE)
    commit_operations(log, UpdateMode.NONE, [StepWrite(records=[AppendRecord(1, "t", torch.tensor([1, 2]))])])
    log.write(lambda w: delete_below(w, None))
    assert not log.read(lambda r: r.table("t").listed)
    _, ids = log.read(lambda r: consume.consume_read_ids(r, "a", [AppendRecord(2, "t", torch.tensor([9, 4]))]))
    assert ids["t"].tolist() == [4, 9]
    log.close()


def test_a_read_with_nothing_new_inside_a_window_reads_nothing(tmp_path):
    """A read whose position lies inside a filtered window and that stops there (nothing new:
    another rank has not completed the next batch, or the batch is still open) reads nothing:
    it reaches back to the window start only when there is something new to read. (It read
    the window's rows again, so a poll with a timeout returned them at once, again and again:
    a busy loop until the next batch.)"""
    from persistent_delta.read import fetch

    mode = UpdateMode.FIRST
    log = log_with_consumer(str(tmp_path / "log"), mode)
    write_all(log, mode, batches(12, seed=2), WindowFilter(mode))
    begin = log.read(lambda r: position_rules.read_start(r, 9))
    assert begin < 9  # batch 9 lies inside a window
    nothing = fetch.fetch_ranks({0: log}, {0: 9}, {0: 9})[0]
    assert (nothing.start_idx, nothing.end_idx) == (9, 9) and not any(t.ids.numel() for t in nothing.tables.values())
    more = fetch.fetch_ranks({0: log}, {0: 9}, {0: 10})[0]
    assert (more.start_idx, more.end_idx) == (begin, 10)  # the read reaches back to the window start
    log.close()


def test_rows_gathered_into_reused_encode_buffers_store_the_same_bytes(tmp_path):
    """The writer keeps the window filter's rows as rows of the captured block and gathers them
    straight into reused encode buffers (one copy); the stored log is byte for byte the one the
    filter-gather-then-encode path writes, also when two records of one (table, batch) merge and
    records grow and shrink between commits."""
    from persistent_delta.log.records import EncodeBuffers, encode_records, write_records
    from persistent_delta.log.schema import META_CURR_BATCH
    from persistent_delta.trainer.writer import dedup_records

    mode = UpdateMode.FIRST
    g = torch.Generator().manual_seed(3)
    steps = []
    for b in range(1, 9):
        recs = []
        for fqn in ("t", "u"):
            for _ in range(2 if (b % 3 == 0 and fqn == "t") else 1):  # two records of ("t", b): merged
                n = int(torch.randint(5, 60 if b % 2 else 12, (1,), generator=g))
                ids = torch.randint(0, 80, (n,), generator=g)
                recs.append(AppendRecord(b, fqn, ids, torch.randn(n, 3, generator=g)))
        steps.append(StepWrite(records=recs, curr_batch_idx=b))

    new = log_with_consumer(str(tmp_path / "new"), mode)
    window, buffers = WindowFilter(mode), EncodeBuffers(max_bytes=4096, max_slots=3)
    for i in range(0, len(steps), 2):  # two steps a commit
        commit_operations(new, mode, steps[i:i + 2], window, buffers)
    assert 0 < buffers.nbytes <= 4096

    old = log_with_consumer(str(tmp_path / "old"), mode)
    window = WindowFilter(mode)
    for i in range(0, len(steps), 2):
        def write_group(w, ops=steps[i:i + 2]):
            kept, _ = window.filter(w, [r for op in ops for r in op.records])  # gathered copies
            write_records(w, encode_records(dedup_records(kept, mode), mode))
            w.set_meta(META_CURR_BATCH, ops[-1].curr_batch_idx)
        old.write(write_group)
    assert window.rows_dropped > 0

    def stored(log):
        return log.read(lambda r: [(bytes(k), bytes(v)) for k, v in r.iter_raw()])

    assert stored(new) == stored(old) and len(stored(new)) >= 16


@pytest.mark.parametrize("mode", [UpdateMode.FIRST, UpdateMode.LAST])
def test_a_deduplicated_record_gathered_on_encode_stores_the_same_bytes(tmp_path, mode):
    """Without the window filter (LAST, a poll-commit reader, no window), the one record of a
    (table, batch) keeps its deduplicated rows as rows of its block, gathered once on encode:
    the stored log is byte for byte the one that gathering the unique rows first writes. Cases:
    repeated ids, ids already ascending and unique (nothing picked), no ids, int32 ids, a record
    that already holds its states as rows of a larger block, two records of one batch, and ids
    too sparse for a direct-address table."""
    from persistent_delta.log.records import encode_records, write_records
    from persistent_delta.trainer.writer import dedup_records

    g = torch.Generator().manual_seed(5)
    block = torch.randn(50, 4, generator=g)
    cases = [
        AppendRecord(1, "t", torch.randint(0, 30, (40,), generator=g), torch.randn(40, 4, generator=g)),
        AppendRecord(1, "u", torch.arange(0, 60, 3), torch.randn(20, 4, generator=g)),
        AppendRecord(2, "t", torch.empty(0, dtype=torch.int64), torch.empty(0, 4)),
        AppendRecord(2, "u", torch.randint(0, 30, (40,), generator=g, dtype=torch.int32), torch.randn(40, 4, generator=g)),
        AppendRecord(3, "t", torch.randint(0, 30, (25,), generator=g), block, rows=torch.randint(0, 50, (25,), generator=g)),
        AppendRecord(3, "u", torch.randint(0, 30, (10,), generator=g), torch.randn(10, 4, generator=g)),
        AppendRecord(3, "u", torch.randint(0, 30, (10,), generator=g), torch.randn(10, 4, generator=g)),
        # ids too sparse for a direct-address table: the rule's sort path
        AppendRecord(4, "t", torch.randint(0, 30, (40,), generator=g) * 10**9, torch.randn(40, 4, generator=g)),
    ]
    lazy = dedup_records(cases, mode)
    assert sum(r.rows is not None for r in lazy) >= 4  # the path under test was taken

    def materialize_first(w):  # each batch's unique rows gathered into a tensor of their own, then encoded
        groups = {}
        for r in cases:
            groups.setdefault((r.fqn, r.batch_idx), []).append(materialized(r))
        out = []
        for (fqn, b), recs in groups.items():
            rows = compute_unique_rows([r.ids for r in recs], [r.states for r in recs], mode)
            out.append(AppendRecord(b, fqn, rows.ids, rows.states))
        write_records(w, encode_records(out, mode))

    logs = {}
    for name, fn in (("lazy", lambda w: write_records(w, encode_records(lazy, mode))), ("old", materialize_first)):
        logs[name] = DeltaLog(str(tmp_path / name), update_mode=mode.value)
        logs[name].write(fn)

    def stored(log):
        return log.read(lambda r: [(bytes(k), bytes(v)) for k, v in r.iter_raw()])

    assert stored(logs["lazy"]) == stored(logs["old"]) and len(stored(logs["old"])) >= 6
    for log in logs.values():
        log.close()
