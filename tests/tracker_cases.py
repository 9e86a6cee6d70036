"""Per-rank bodies of the tracker tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
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
