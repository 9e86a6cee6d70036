"""Per-rank bodies of the tracker tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode, UniqueRows

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach

STATE_MODES = (TrackingMode.MOMENTUM_LAST, TrackingMode.MOMENTUM_DIFF, TrackingMode.ROWWISE_ADAGRAD)


class CpuFixedTrec(ModelDeltaTrackerTrec):
    """TorchRec's tracker with its optimizer-state capture fixed (a reference, not the thing
    under test): it reads ``momentum1_dev`` (empty on CPU) for MOMENTUM_LAST and indexes the
    concatenation of a TBE group's tables with table-local ids. Here each id indexes its own
    table's state; offsets, compaction and retention stay TorchRec's."""

    def _per_key_states(self, emb_module: Any, kjt: Any, norm: bool) -> None:
        opt_states = emb_module._emb_module.split_optimizer_states()
        index = {f: i for i, t in enumerate(emb_module._config.embedding_tables) for f in t.feature_names}
        for key in kjt.keys():
            ids = kjt[key].values()
            rows = opt_states[index[key]][0][ids]
            if norm:
                rows = rows.norm(dim=1) if rows.dim() > 1 else rows.abs()
            self.store.append(batch_idx=self.curr_batch_idx, fqn=self.feature_to_fqn[key], ids=ids, states=rows)

    def record_momentum(self, emb_module: Any, kjt: Any) -> None:
        self._per_key_states(emb_module, kjt, norm=True)

    def record_rowwise_optim_state(self, emb_module: Any, kjt: Any) -> None:
        self._per_key_states(emb_module, kjt, norm=False)


def _sorted(rows: UniqueRows) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    order = torch.argsort(rows.ids)
    return rows.ids[order], None if rows.states is None else rows.states[order]


def first_in_group(tracker: Any) -> Dict[str, bool]:
    """fqn -> whether the table is the first of its TBE group (TorchRec indexes optimizer
    state of the group's concatenation with local ids, right only for the first table)."""
    return {fqn: t.index == 0 for fqn, t in tracker.local_tables.items()}


def compare(ref: Dict[str, UniqueRows], got: Dict[str, UniqueRows], mode: TrackingMode,
            states_ok: Dict[str, bool], where: str) -> int:
    """Assert ``got`` equals TorchRec's ``ref``; returns the number of rows compared."""
    assert set(got) == set(ref), f"{where}: tables {sorted(got)} != {sorted(ref)}"
    n = 0
    for fqn, r in ref.items():
        rid, rst = _sorted(r)
        g = got[fqn]
        assert torch.all(g.ids[1:] > g.ids[:-1]), f"{where} {fqn}: ids not ascending"
        assert torch.equal(g.ids, rid), f"{where} {fqn}: ids differ\n{g.ids}\n{rid}"
        if mode == TrackingMode.ID_ONLY:
            assert g.states is None
        elif mode not in STATE_MODES or states_ok[fqn]:
            assert g.states is not None and rst is not None
            assert torch.allclose(g.states.float(), rst.float().view(g.states.shape), atol=1e-6), \
                f"{where} {fqn}: states differ"
        n += rid.numel()
    return n


def differential(rank: int, world_size: int, kind: str, sharding: str, root: str,
                 modes: List[str], settings: List[Tuple[List[str], bool, bool]], steps: int = 12,
                 rebuild_at: int = 6) -> Dict[str, int]:
    """Two identical DMPs fed the same batches, one with TorchRec's tracker, one with ours;
    ours is closed and rebuilt from the same path at ``rebuild_at``. Every get_unique must
    agree. Returns rows compared per case."""
    compared: Dict[str, int] = {}
    batches = make_batches(kind, steps, 8, seed=3, world_size=world_size, rank=rank)
    for mode_name in modes:
        mode = TrackingMode[mode_name]
        optimizer = "EXACT_ADAGRAD" if mode == TrackingMode.MOMENTUM_LAST else "EXACT_ROWWISE_ADAGRAD"
        for consumers, delete_on_read, auto_compact in settings:
            case = f"{kind}-{sharding}-{mode_name}-{'+'.join(consumers)}-dor{int(delete_on_read)}-ac{int(auto_compact)}"
            path = os.path.join(root, case)
            ref_dmp = build_sharded_model(rank, world_size, kind, sharding, optimizer)
            dmp = build_sharded_model(rank, world_size, kind, sharding, optimizer)
            trec_cfg = DeltaTrackerConfig(tracking_mode=mode, consumers=consumers,
                                          delete_on_read=delete_on_read, auto_compact=auto_compact)
            if mode in STATE_MODES:
                # reference: TorchRec's rules with a correct per-table state capture (all tables)
                ref = CpuFixedTrec(ref_dmp._dmp_wrapped_module, consumers=consumers, delete_on_read=delete_on_read,
                                   auto_compact=auto_compact, mode=mode)
                ref_dmp.model_trackers["DELTA_TRACKER"] = ref
            else:
                ref = ref_dmp.init_torchrec_delta_tracker(trec_cfg)
            # stock TorchRec too, where it runs on CPU: its states are right for the first
            # table of each TBE group only
            stock_dmp = stock = None
            if mode in (TrackingMode.MOMENTUM_DIFF, TrackingMode.ROWWISE_ADAGRAD):
                stock_dmp = build_sharded_model(rank, world_size, kind, sharding, optimizer)
                stock = stock_dmp.init_torchrec_delta_tracker(trec_cfg)
            cfg = PersistentTrackerConfig(tracking_mode=mode, consumers=consumers,
                                          delete_on_read=delete_on_read, auto_compact=auto_compact, path=path)
            ours = attach(dmp, cfg)
            assert dmp.get_delta_tracker() is ours
            all_ok = {fqn: True for fqn in ours.local_tables}
            first_ok = first_in_group(ours)
            n = 0
            for step, batch in enumerate(batches):
                if step == rebuild_at:
                    ours.close()
                    assert dmp.get_delta_tracker() is None
                    ours = attach(dmp, cfg)
                assert ours.curr_batch_idx == ref.curr_batch_idx, (case, step)
                train_step(ref_dmp, batch)
                train_step(dmp, batch)
                if stock_dmp is not None:
                    train_step(stock_dmp, batch)
                assert ours.curr_batch_idx == ref.curr_batch_idx, (case, step)
                # consumers read at different rhythms
                for i, c in enumerate(consumers):
                    if (step + i) % (2 + i) == 1:
                        got = ours.get_unique(c)
                        n += compare(ref.get_unique(c), got, mode, all_ok, f"{case} step {step} {c}")
                        if stock is not None:
                            compare(stock.get_unique(c), got, mode, first_ok, f"{case} step {step} {c} (stock)")
            # one more batch, so every consumer has something new (TorchRec raises otherwise)
            for m in (ref_dmp, dmp, stock_dmp):
                if m is not None:
                    train_step(m, batches[0])
            for c in consumers:
                got = ours.get_unique(c)
                n += compare(ref.get_unique(c), got, mode, all_ok, f"{case} end {c}")
                if stock is not None:
                    compare(stock.get_unique(c), got, mode, first_ok, f"{case} end {c} (stock)")
            ours.close()
            compared[case] = n
    return compared


# ----------------------------------------------------------------- restart in a new process

READ_A_AT = 3  # consumer "a" reads after this step in the first process


def restart_first_half(rank: int, world_size: int, root: str, mode_name: str, steps: int, ckpt: str) -> int:
    """Train the first half with our tracker; consumer "a" reads once; save the model and
    fused optimizer state; close. Returns the batch index reached."""
    mode = TrackingMode[mode_name]
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=mode, consumers=["a", "b"], path=root))
    batches = make_batches("ec", steps, 8, seed=5, world_size=world_size, rank=rank)
    for step, batch in enumerate(batches[: steps // 2]):
        train_step(dmp, batch)
        if step == READ_A_AT:
            tracker.get_unique("a")
    tracker.flush()
    torch.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, f"{ckpt}.{rank}")
    reached = tracker.curr_batch_idx
    tracker.close()
    return reached


def restart_second_half(rank: int, world_size: int, root: str, mode_name: str, steps: int, ckpt: str) -> Dict[str, Any]:
    """A new process: restore the model, attach to the same path and finish training. Every
    consumer's next get_unique must equal an uninterrupted TorchRec tracker's."""
    mode = TrackingMode[mode_name]
    batches = make_batches("ec", steps, 8, seed=5, world_size=world_size, rank=rank)
    ref_dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    ref = ref_dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=mode, consumers=["a", "b"]))
    for step, batch in enumerate(batches[: steps // 2]):
        train_step(ref_dmp, batch)
        if step == READ_A_AT:
            ref.get_unique("a")

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    saved = torch.load(f"{ckpt}.{rank}", weights_only=False)
    dmp.load_state_dict(saved["model"])
    dmp.fused_optimizer.load_state_dict(saved["optim"])
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=mode, consumers=["a", "b"], path=root))
    resumed_at = tracker.curr_batch_idx
    offsets = dict(tracker.per_consumer_batch_idx)
    assert resumed_at == ref.curr_batch_idx, (resumed_at, ref.curr_batch_idx)
    for batch in batches[steps // 2:]:
        train_step(ref_dmp, batch)
        train_step(dmp, batch)
    ok = {fqn: True for fqn in tracker.local_tables}
    n = 0
    for c in ("a", "b"):
        n += compare(ref.get_unique(c), tracker.get_unique(c), mode, ok, f"restart {c}")
    tracker.close()
    return {"resumed_at": resumed_at, "offsets": offsets, "rows": n}


# ----------------------------------------------------------------- config, top-k, metadata


def config_checks(rank: int, world_size: int, root: str) -> List[str]:
    """Refusals on mismatch, fresh=True, attach twice, bad modes; returns what was checked."""
    import pytest

    from persistent_delta.errors import ConfigMismatchError, InvalidInputError, UnknownConsumerError

    done = []
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    batches = make_batches("ec", 4, 8, seed=1, world_size=world_size, rank=rank)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root))
    with pytest.raises(InvalidInputError, match="already has a delta tracker"):
        attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root))
    for b in batches:
        train_step(dmp, b)
    with pytest.raises(UnknownConsumerError):
        t.get_unique("nobody")
    with pytest.raises(AssertionError, match="not present"):  # TorchRec's type and text
        t.get_unique("nobody")
    with pytest.raises(AssertionError, match="not found"):
        t.clear("nobody")
    old_log = t.log.read(lambda r: r.identity())
    t.close()
    done.append("attach twice refused; unknown consumer refused")

    # another tracking mode on the same log
    with pytest.raises(ConfigMismatchError, match="tracking mode"):
        attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root))
    assert dmp.get_delta_tracker() is None
    # another table set on the same log
    dmp3 = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD", num_tables=3)
    with pytest.raises(ConfigMismatchError, match="tables"):
        attach(dmp3, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root))
    done.append("mode and table-set mismatch refused")
    # the explicit option starts a fresh log
    t = attach(dmp3, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root, fresh=True))
    assert t.curr_batch_idx == 0 and t.get_unique() == {}
    new_log = t.log.read(lambda r: r.identity())  # a new log: the old run's shipped data reads as older
    assert new_log.log_id != old_log.log_id and old_log.older_than(new_log)
    t.close()
    done.append("fresh=True starts over")

    ebc = build_sharded_model(rank, world_size, "ebc", "row_wise", "EXACT_SGD")
    with pytest.raises(InvalidInputError, match="EmbeddingBagCollection"):
        attach(ebc, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root + "-ebc"))
    with pytest.raises(AssertionError, match="EBC's lookup returns pooled embeddings"):  # TorchRec's refusal
        attach(ebc, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root + "-ebc"))
    with pytest.raises(InvalidInputError, match="optimizer with state"):
        attach(ebc, PersistentTrackerConfig(tracking_mode=TrackingMode.ROWWISE_ADAGRAD, path=root + "-sgd"))
    with pytest.raises(InvalidInputError, match="path"):
        attach(ebc, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY))
    with pytest.raises(InvalidInputError, match="consumer name"):
        attach(ebc, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root + "-x", consumers=["bad name"]))
    done.append("EBC+EMBEDDING, SGD+state mode, no path, bad consumer name refused")
    return done


def consumers_while_training(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Consumers added and removed while training; removal releases retention."""
    dmp = build_sharded_model(rank, world_size, "ec", "table_wise", "EXACT_SGD")
    batches = make_batches("ec", 10, 8, seed=2, world_size=world_size, rank=rank)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["a"], path=root))
    for b in batches[:3]:
        train_step(dmp, b)
    t.add_consumer("late")
    t.add_consumer("tail", from_latest=True)
    assert set(t.per_consumer_batch_idx) == {"a", "late", "tail"}
    t.get_unique("a")
    # "late" holds back retention: it still sees batches 1..3
    late = t.get_unique("late")
    a_all = {fqn: r.ids for fqn, r in late.items()}
    for b in batches[3:6]:
        train_step(dmp, b)
    tail = t.get_unique("tail")  # only batches 4..6
    t.remove_consumer("late")
    t.get_unique("a")
    records_left = sum(len(v) for v in t.log.read(lambda r: {
        f: list(r.iter_record_keys(e.table_id)) for f, e in r.tables().items()}).values())
    t.close()
    return {"late": {k: v.tolist() for k, v in a_all.items()}, "tail": {k: v.ids.tolist() for k, v in tail.items()},
            "records_left": records_left}


def topk_case(rank: int, world_size: int, root: str, mode_name: str, fraction: float) -> int:
    """get_unique(top_percentage) keeps exactly the rows a brute force picks."""
    import math

    import pytest

    from persistent_delta.errors import InvalidInputError

    mode = TrackingMode[mode_name]
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=mode, consumers=["full", "top"], path=root))
    for b in make_batches("ec", 6, 16, seed=9, world_size=world_size, rank=rank):
        train_step(dmp, b)
    if mode == TrackingMode.ID_ONLY:
        with pytest.raises(InvalidInputError, match="ID_ONLY"):
            t.get_unique("top", top_percentage=fraction)
        t.close()
        return 0
    with pytest.raises(InvalidInputError):
        t.get_unique("top", top_percentage=1.5)
    full = t.get_unique("full")
    top = t.get_unique("top", top_percentage=fraction)
    checked = 0
    for fqn, rows in full.items():
        if mode == TrackingMode.EMBEDDING:
            current = t.local_tables[fqn].weights()[rows.ids]
            scores = (current - rows.states).norm(dim=1)
        else:
            scores = rows.states.float().abs()
        k = max(1, math.ceil(fraction * rows.ids.numel())) if rows.ids.numel() else 0
        want = set(rows.ids[torch.topk(scores, k).indices].tolist()) if k else set()
        got = top[fqn].ids
        assert set(got.tolist()) == want, (fqn, sorted(got.tolist()), sorted(want))
        assert torch.all(got[1:] > got[:-1])
        pos = torch.searchsorted(rows.ids, got)
        assert torch.equal(top[fqn].states, rows.states[pos])
        checked += k
    t.close()
    return checked


def metadata_case(rank: int, world_size: int, root: str, kind: str, sharding: str) -> Dict[str, Any]:
    """The log holds each table's shard metadata; returns it with TorchRec's view and the
    global ids (local + row_offset) this rank recorded."""
    from harness import table_shard_info

    from persistent_delta.log.deltalog import DeltaLog

    dmp = build_sharded_model(rank, world_size, kind, sharding, "EXACT_SGD", rows=60)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root))
    batches = make_batches(kind, 3, 8, seed=4, world_size=world_size, rank=rank, rows=60)
    for b in batches:
        train_step(dmp, b)
    rows = t.get_unique()
    path = t.path
    t.close()
    with DeltaLog(path, readonly=True) as log:
        stored = {fqn: e.meta["shard"] for fqn, e in log.tables().items()}
    global_ids = {fqn: (r.ids + stored[fqn]["row_offset"]).tolist() for fqn, r in rows.items()}
    all_input = {}
    for r in range(world_size):
        for b in make_batches(kind, 3, 8, seed=4, world_size=world_size, rank=r, rows=60):
            for key in b.sparse.keys():
                all_input.setdefault(key, set()).update(b.sparse[key].values().tolist())
    return {"stored": stored, "torchrec": table_shard_info(dmp), "global_ids": global_ids,
            "input": {k: sorted(v) for k, v in all_input.items()}}


# ----------------------------------------------------------------- publish and restore


def apply_snapshots(path: str, replica: Dict[str, torch.Tensor], start: int) -> int:
    """Apply every snapshot record with stamp >= ``start`` to ``replica`` (fqn -> local rows),
    in stamp order; returns the next stamp to read."""
    from persistent_delta.log.deltalog import DeltaLog
    from persistent_delta.log.schema import SNAPSHOTS

    with DeltaLog(path, readonly=True) as log:
        def read(r: Any) -> int:
            end = int(r.meta("snapshot_end", 0))
            for fqn, e in r.tables().items():
                for rec in r.iter_records(e.table_id, start, end, channel=SNAPSHOTS):
                    replica[fqn][rec.ids.long()] = rec.states.clone()
            return max(end, start)
        return log.read(read)


def publish_restore_case(rank: int, world_size: int, root: str, mode_name: str, redeliver: bool = True) -> Dict[str, Any]:
    """A replica fed only by publish() equals the trainer's tables; after a restore from an
    older checkpoint it converges to the restored model (rows touched after the checkpoint
    are re-delivered)."""
    mode = TrackingMode[mode_name]
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    cfg = PersistentTrackerConfig(tracking_mode=mode, consumers=["serving"], path=root)
    t = attach(dmp, cfg)
    replica = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
    batches = make_batches("ec", 14, 8, seed=11, world_size=world_size, rank=rank)
    pos = 0
    published = 0
    for b in batches[:4]:
        train_step(dmp, b)
    published += sum(t.publish("serving").values())
    # checkpoint: model shards + fused optimizer state + the tracker's state
    ckpt = {fqn: (lt.weights().detach().clone(), lt.optimizer_state().detach().clone()) for fqn, lt in t.local_tables.items()}
    tstate = t.state_dict()
    for i, b in enumerate(batches[4:9]):
        train_step(dmp, b)
        if i == 2:
            published += sum(t.publish("serving").values())
            t.flush()  # publish() returns once the values are captured; the writer commits them
            pos = apply_snapshots(t.path, replica, pos)  # the replica sees lost-timeline values
    # crash: restore the model from the checkpoint, rebuild the tracker, restore its state
    t.close()
    t = attach(dmp, cfg)
    with torch.no_grad():
        for fqn, (w, s) in ckpt.items():
            t.local_tables[fqn].weights().copy_(w)
            t.local_tables[fqn].optimizer_state().copy_(s)
    redelivered = t.load_state_dict(tstate) if redeliver else {}
    resumed = t.curr_batch_idx
    for b in batches[9:11]:
        train_step(dmp, b)
    published += sum(t.publish("serving").values())
    t.flush()
    pos = apply_snapshots(t.path, replica, pos)
    mismatched = {fqn: int((replica[fqn] != lt.weights()).any(dim=1).sum()) for fqn, lt in t.local_tables.items()}
    t.close()
    return {"redelivered": redelivered, "mismatched": mismatched, "published": published, "resumed": resumed}


def compaction_and_settings_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """The public compact() never changes what a registered consumer or a restore of the latest
    checkpoint reads (the range is split at their positions); settings resolve from the
    environment for trackers as for stores."""
    from persistent_delta import Durability
    from persistent_delta.log import position_rules
    from persistent_delta.log.records import read_unique

    os.environ["PERSISTENT_DELTA_DURABILITY"] = "sync"
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    batches = make_batches("ec", 9, 16, seed=5, world_size=world_size, rank=rank)
    # ROWWISE needs optimizer state: EMBEDDING (FIRST) also exercises the window filter.
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, consumers=["a", "b"], path=root))
    env_durability = t.log.options.durability
    del os.environ["PERSISTENT_DELTA_DURABILITY"]
    for b in batches[:3]:
        train_step(dmp, b)
    t.get_unique("a")  # a at 4
    for b in batches[3:5]:
        train_step(dmp, b)
    sd = t.state_dict()  # checkpoint at batch 5: floor 6
    for b in batches[5:]:
        train_step(dmp, b)
    t.flush()

    def peek() -> Dict[str, Any]:
        def read(r: Any) -> Dict[str, Any]:
            mode = position_rules.update_mode(r)
            out = {}
            for name, entry in r.consumers().items():
                rows = read_unique(r, mode, position_rules.read_start(r, entry.offset))
                out[name] = {f: (u.ids.tolist(), u.states.tolist()) for f, u in rows.items()}
            floor = position_rules.checkpoint_floor(r)
            out["restore"] = {f: u.ids.tolist() for f, u in read_unique(r, mode, floor).items()}
            return out
        return t.log.read(read)

    def records() -> int:
        return sum(len(list(t.log.read(lambda r: list(r.iter_record_keys(e.table_id))))) for e in t.log.tables().values())

    before, n_before = peek(), records()
    t.compact(0, t.curr_batch_idx + 1)
    after, n_after = peek(), records()
    t.close()
    return {"env_durability": env_durability == Durability.SYNC, "same": before == after,
            "compacted": n_after < n_before, "sd_batch": sd["curr_batch_idx"]}


def empty_shapes_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Empty results keep the row shape and dtype of their table, on both channels."""
    from persistent_delta import DeltaConsumer

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    batches = make_batches("ec", 3, 8, seed=3, world_size=world_size, rank=rank)
    # ID_ONLY: the snapshots channel's values are the only rows with a shape (they were (0,)/None)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["pub"], path=root))
    dims = {fqn: tuple(lt.weights().shape[1:]) for fqn, lt in t.local_tables.items()}
    for b in batches:
        train_step(dmp, b)
    t.publish("pub")
    t.flush()
    out: Dict[str, Any] = {"dims": dims}
    for channel in ("snapshots", "lookups"):
        with DeltaConsumer(root, "c-" + channel, channel=channel) as c:
            c.poll()
            empty = c.poll()  # nothing new: every table empty
            out[channel] = {d.fqn: None if d.states is None else (tuple(d.states.shape), str(d.states.dtype))
                            for d in empty}
            if channel == "snapshots":
                merged = empty.merged()
                replica = {fqn: torch.zeros(10, *dims[fqn]) for fqn in merged}
                for fqn, m in merged.items():
                    replica[fqn][m.global_ids] = m.states  # the natural apply works on an empty poll
    t.close()
    return out


# ----------------------------------------------------------------- data-parallel tables


def _fed_ids(kind: str, steps: int, seed: int, world_size: int, rank: int, table: str) -> List[int]:
    """Sorted unique (global) ids that ``rank``'s batches feed to ``table``."""
    from harness import feature_names

    ids: set = set()
    for b in make_batches(kind, steps, 8, seed=seed, world_size=world_size, rank=rank):
        for f in feature_names(2)[table]:
            ids.update(b.sparse[f].values().tolist())
    return sorted(ids)


def dp_table_case(rank: int, world_size: int, root: str, cases: List[Tuple[str, str]], steps: int = 4) -> Dict[str, Any]:
    """A model with table_0 data-parallel and table_1 row-wise (row-wise Adagrad fused), per
    (kind, mode): attach, train, get_unique. ID_ONLY/EMBEDDING track the DP table with the ids
    this rank looked up (EMBEDDING: their values at the first lookup); optimizer-state modes
    leave it out, with one log line. Returns per case what the parent checks across ranks."""
    import logging

    from harness import get_local_weights

    class _LogLines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.lines: List[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    seed = 13
    out: Dict[str, Any] = {}
    for kind, mode_name in cases:
        mode = TrackingMode[mode_name]
        attr = "embeddings" if kind == "ec" else "embedding_bags"
        dp_fqn, rw_fqn = f"sparse.{attr}.table_0", f"sparse.{attr}.table_1"
        case = f"{kind}-{mode_name}"
        batches = make_batches(kind, steps, 8, seed=seed, world_size=world_size, rank=rank)
        dmp = build_sharded_model(rank, world_size, kind, "row_wise", "EXACT_ROWWISE_ADAGRAD", dp_tables=(0,))
        lines = _LogLines()
        capture_logger = logging.getLogger("persistent_delta.trainer.capture")
        old_level = capture_logger.level
        capture_logger.setLevel(logging.INFO)
        capture_logger.addHandler(lines)
        try:
            t = attach(dmp, PersistentTrackerConfig(path=os.path.join(root, case), tracking_mode=mode,
                                                    delete_on_read=False))
        finally:
            capture_logger.removeHandler(lines)
            capture_logger.setLevel(old_level)
        # the DP table is replicated: the whole table on every rank, no optimizer state
        dp = t.local_tables[dp_fqn]
        assert (dp.sharding_type, dp.row_offset, dp.col_offset) == ("data_parallel", 0, 0), (case, dp)
        assert (dp.local_rows, dp.local_cols) == (dp.global_rows, dp.global_cols) == (100, 8), (case, dp)
        assert torch.equal(dp.weights(), get_local_weights(dmp, dp_fqn)), case
        assert dp.optimizer_state() is None, case
        first: Dict[int, torch.Tensor] = {}
        for b in batches:
            w = dp.weights().detach().clone()
            for f in ("feature_0", "feature_1"):
                for i in b.sparse[f].values().tolist():
                    first.setdefault(i, w[i])
            train_step(dmp, b)
        rows = t.get_unique()
        rw = t.local_tables[rw_fqn]
        rw_all = sorted({i for r in range(world_size) for i in _fed_ids(kind, steps, seed, world_size, r, "table_1")})
        rw_want = [i - rw.row_offset for i in rw_all if rw.row_offset <= i < rw.row_offset + rw.local_rows]
        assert rows[rw_fqn].ids.tolist() == rw_want, case
        dp_ids = _fed_ids(kind, steps, seed, world_size, rank, "table_0")
        if mode in STATE_MODES:
            assert dp_fqn not in rows, (case, sorted(rows))
            assert rows[rw_fqn].states is not None and rows[rw_fqn].states.shape[0] == len(rw_want), case
        else:
            assert rows[dp_fqn].ids.tolist() == dp_ids, (case, rows[dp_fqn].ids.tolist(), dp_ids)
            if mode == TrackingMode.EMBEDDING:
                want = torch.stack([first[i] for i in dp_ids])
                assert torch.equal(rows[dp_fqn].states, want), case
            else:
                assert rows[dp_fqn].states is None, case
        t.close()
        out[case] = {"dp_fqn": dp_fqn, "rw_fqn": rw_fqn, "dp_ids": dp_ids, "rw_all": rw_all,
                     "dp_states": rows[dp_fqn].states if dp_fqn in rows else None,
                     "skip_lines": [ln for ln in lines.lines if dp_fqn in ln]}
    return out


def rank_agreement_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Ranks that persisted different batch indices (a kill leaves them a step or two apart)
    continue from the largest one; a batch a rank never committed reads as empty there, and a
    consumer's poll has the same range on every rank."""
    import torch.distributed as dist

    from persistent_delta import DeltaReader
    from persistent_delta.log.deltalog import DeltaLog
    from persistent_delta.log.schema import META_CLOSED_END, META_CURR_BATCH

    dmp = build_sharded_model(rank, world_size, "ec", "column_wise", "EXACT_SGD")
    batches = make_batches("ec", 10, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root))
    for b in batches[:6]:
        train_step(dmp, b)
    t.close()
    if rank == 1:  # as if rank 1 had been killed before committing batches 5 and 6
        with DeltaLog(os.path.join(root, "rank-1")) as log:
            def rewind(w: Any) -> None:
                for e in w.tables().values():
                    w.delete_records(e.table_id, 5, None)
                    e2 = e.copy()
                    e2.last_batch_idx = min(e2.last_batch_idx, 4)
                    w.stage_table(e2)
                w.set_meta(META_CURR_BATCH, 4)
                w.set_meta(META_CLOSED_END, 0)
            log.write(rewind)
    dist.barrier()
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root))
    resumed = t.curr_batch_idx
    for b in batches[6:]:
        train_step(dmp, b)
    t.flush()
    dist.barrier()
    out: Dict[str, Any] = {"resumed": resumed}
    if rank == 0:
        with DeltaReader(root) as reader:
            poll = reader.poll()
            out["ranges"] = poll.ranges
        def records(path: str) -> int:
            with DeltaLog(path, readonly=True) as log:
                return log.read(lambda r: sum(len(list(r.iter_record_keys(e.table_id, 5, 7)))
                                              for e in r.tables().values()))
        out["lost_records"] = {r: records(os.path.join(root, f"rank-{r}")) for r in (0, 1)}
    dist.barrier()
    t.close()
    return out


def disk_full_resume_case(rank: int, world_size: int, root: str, fs: str) -> Dict[str, Any]:
    """A tracker on a filesystem that fills up: WriterError (LogFullError cause) at the next
    commit, nothing dropped; once space is back, resume() commits the kept steps and training
    continues with every batch in the log."""
    from procs import fill_filesystem

    from persistent_delta.errors import LogFullError, WriterError

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    batches = make_batches("ec", 60, 512, seed=4, world_size=world_size, rank=rank)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root, map_size=1 << 20,
                                            linger_steps=1))
    for b in batches[:3]:
        train_step(dmp, b)
    t.flush()
    filler = fill_filesystem(fs)
    failed_at, cause = None, None
    for i, b in enumerate(batches[3:50]):
        try:
            train_step(dmp, b)
            t.flush()
        except WriterError as exc:
            failed_at, cause = 3 + i, exc.__cause__
            break
    os.unlink(filler)
    t.resume()
    for b in batches[(failed_at or 50) + 1:(failed_at or 50) + 5]:
        train_step(dmp, b)
    t.flush()
    stored = t.log.read(lambda r: sorted({rec.batch_idx for e in r.tables().values()
                                          for rec in r.iter_records(e.table_id)}))
    out = {"failed_at": failed_at, "cause": type(cause).__name__ if cause else None,
           "full": isinstance(cause, LogFullError), "stored": stored, "curr": t.curr_batch_idx}
    t.close()
    return out


def publish_apply_case(rank: int, world_size: int, root: str, sharding: str, dp_tables: Tuple[int, ...],
                       after: int = 2) -> Dict[str, Any]:
    """Train and publish every other step (ID_ONLY, consumer ``serving``), then train ``after``
    more steps without publishing: a replica fed by the publishes must hold the tables of the
    last ``publish()`` call, not the final ones. Returns this rank's shards at the last publish
    (with their placement), whether training changed them after it, and the wall-clock window
    of each publish call."""
    from harness import table_shard_info

    dmp = build_sharded_model(rank, world_size, "ec", sharding, "EXACT_ROWWISE_ADAGRAD", dp_tables=dp_tables)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    batches = make_batches("ec", 8 + after, 8, seed=5, world_size=world_size, rank=rank)
    windows: Dict[int, Tuple[float, float]] = {}
    shards: Dict[str, Any] = {}
    at_publish: Dict[int, Dict[str, torch.Tensor]] = {}  # stamp -> this rank's shards at that call
    for i, b in enumerate(batches):
        train_step(dmp, b)
        if i < 8 and i % 2 == 1:
            t0, stamp = time.time(), t.curr_batch_idx
            t.publish("serving")  # no flush: the next publish reuses the record buffers (publish.capture)
            windows[stamp] = (t0, time.time())
            info = table_shard_info(dmp)
            shards = {fqn: (lt.weights().detach().clone(), info[fqn]) for fqn, lt in t.local_tables.items()}
            at_publish[stamp] = {fqn: w for fqn, (w, _) in shards.items()}
    changed = {fqn: bool((t.local_tables[fqn].weights() != w).any()) for fqn, (w, _) in shards.items()}
    t.close()
    return {"shards": shards, "windows": windows, "changed_after": changed, "at_publish": at_publish}


def snapshot_bound_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Publish every step with a retention bound of 4 batches: a snapshots consumer that keeps
    up is never expired; one that stopped at the start is expired, the publishes it held are
    deleted, and its next poll is told (out of range), or reset by its policy."""
    from persistent_delta import DeltaConsumer, OffsetOutOfRangeError, RetentionBound
    from persistent_delta.cli.offsets import describe

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                            retention=RetentionBound(max_batches=4)))
    stale = DeltaConsumer(root, "stale", channel="snapshots")
    stale.commit()
    live = DeltaConsumer(root, "live", channel="snapshots")
    live_ranges = []
    for b in make_batches("ec", 12, 8, seed=3, world_size=world_size, rank=rank):
        train_step(dmp, b)
        t.publish("serving")
        t.flush()
        p = live.poll()
        live_ranges.append(p.ranges[rank])
        live.commit()
    out: Dict[str, Any] = {"live_ranges": live_ranges, "stale_start": stale.position()[rank]}
    statuses = {c.name: c.status for c in describe(root)[rank].consumers}
    out["statuses"] = statuses
    try:
        stale.poll()
        out["stale_poll"] = "served"
    except OffsetOutOfRangeError as exc:
        out["stale_poll"] = str(exc)
    stale.close()
    with DeltaConsumer(root, "stale", channel="snapshots", register=False, reset="earliest") as again:
        p = again.poll()
        out["reset_range"] = p.ranges[rank]
        out["reset_rows"] = sum(d.ids.numel() for d in p)
    live.close()
    t.close()
    return out


def negative_id_publish_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """A negative id recorded while the writer lingers: ``publish()`` reads the queued steps'
    ids instead of waiting for the writer; the capture finds the negative one before gathering,
    the tracker then waits, and the writer's typed error (the codec's InvalidInputError as
    cause) comes back, not an index error from the gather."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from persistent_delta.errors import WriterError

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                            linger_steps=100, linger_s=60.0))
    for b in make_batches("ec", 3, 8, seed=5, world_size=world_size, rank=rank):
        train_step(dmp, b)
    feature = next(iter(t.fqn_to_feature_names().values()))[0]
    t.record_lookup(KeyedJaggedTensor.from_lengths_sync(keys=[feature], values=torch.tensor([3, -1]),
                                                        lengths=torch.tensor([2])), torch.empty(0))
    out: Dict[str, Any] = {"queued": len(t._writer.pending_records() or [])}
    try:
        t.publish("serving")
        out["publish"] = "returned"
    except WriterError as exc:
        out["publish"] = f"WriterError: {type(exc.__cause__).__name__}: {exc.__cause__}"
    except Exception as exc:  # noqa: BLE001 - the test reports what came back
        out["publish"] = f"{type(exc).__name__}: {exc}"
    try:
        t.close()
    except WriterError:
        pass
    return out


FORMAT_CONSUMERS = {f"replica-{f}": f for f in ("native", "float32", "float16", "bfloat16", "int8")}


def publish_formats_case(rank: int, world_size: int, root: str, sharding: str, dp_tables: Tuple[int, ...]
                         ) -> Dict[str, Any]:
    """Register one snapshots consumer per row format (rank 0, after attach: they hold the
    formats each publish writes), train and publish three times, and return this rank's
    shards at the last publish (with their placement), for the formats' round trips."""
    import torch.distributed as dist

    from harness import table_shard_info
    from persistent_delta.read.consumer import DeltaConsumer

    dmp = build_sharded_model(rank, world_size, "ec", sharding, "EXACT_ROWWISE_ADAGRAD", dp_tables=dp_tables)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    dist.barrier()
    if rank == 0:
        for name, fmt in FORMAT_CONSUMERS.items():
            DeltaConsumer(root, name, channel="snapshots", format=fmt, wait=30).close()
    dist.barrier()
    shards: Dict[str, Any] = {}
    for i, b in enumerate(make_batches("ec", 6, 8, seed=5, world_size=world_size, rank=rank)):
        train_step(dmp, b)
        if i % 2 == 1:
            t.publish("serving")
            info = table_shard_info(dmp)
            shards = {fqn: (lt.weights().detach().clone(), info[fqn]) for fqn, lt in t.local_tables.items()}
    t.close()
    return {"shards": shards}


# ----------------------------------------------------------------- memory the tracker reuses


def reused_memory_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """EMBEDDING on CPU: what the capture keeps of a lookup is a copy of the rows the model was
    given, never autograd's output itself (kept until the writer encodes it, that memory would
    live past the next step's forward); the copies' blocks are reused from step to step.
    ``get_unique`` gives its rows in memory handed out again once the caller dropped an earlier
    result, and never while a result is kept. Returns what the test checks."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    batches = make_batches("ec", 8, 8, seed=3, world_size=world_size, rank=rank)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, consumers=["c"], path=root))
    outputs: List[torch.Tensor] = []
    module = next(iter(t.tracked_modules.values()))
    hook = module.post_lookup_tracker_fn

    def seen(kjt: Any, states: torch.Tensor, *rest: Any) -> None:
        outputs.append(states)
        hook(kjt, states, *rest)

    module.post_lookup_tracker_fn = seen
    out: Dict[str, Any] = {}
    train_step(dmp, batches[0])  # the batch's records stay captured until the next step
    pending = [r for r in t._capture.pending if r.states is not None and r.states.numel()]
    given = {o.untyped_storage().data_ptr() for o in outputs}
    out["records"] = len(pending)
    out["aliased"] = sum(r.states.untyped_storage().data_ptr() in given for r in pending)
    rows = torch.cat([o.detach().reshape(-1, pending[0].states.shape[1]) for o in outputs])
    out["copies_equal"] = torch.equal(torch.cat([r.states for r in pending]), rows)
    for b in batches[1:5]:
        train_step(dmp, b)
        t.flush()
    blocks = getattr(t._capture, "blocks", None)
    out["blocks"] = blocks.stats() if blocks is not None else (0, 0)  # (allocated, reused)
    module.post_lookup_tracker_fn = hook

    first = t.get_unique("c")
    ptr = next(r.states.untyped_storage().data_ptr() for r in first.values() if r.states.numel())
    del first
    train_step(dmp, batches[5])
    second = t.get_unique("c")  # the first result was dropped: its memory again
    out["reused_after_drop"] = next(r.states.untyped_storage().data_ptr() for r in second.values()
                                    if r.states.numel()) == ptr
    results = getattr(t, "_results", None)
    out["results_reused"] = results.reused if results is not None else 0  # (the same address may be chance)
    kept = {fqn: r.states.clone() for fqn, r in second.items()}
    train_step(dmp, batches[6])
    third = t.get_unique("c")  # the second is still held: other memory
    out["kept_intact"] = all(torch.equal(second[fqn].states, s) for fqn, s in kept.items())
    out["kept_shared"] = any(r.states.numel() and r.states.untyped_storage().data_ptr() == ptr
                             for r in third.values())
    t.close()
    return out
