"""Data-parallel (replicated) tables on 2 CPU ranks: attach never crashes; ID_ONLY/EMBEDDING
track each rank's own lookups of the table (a consumer merges them into the union), the
optimizer-state modes leave it out with one log line (it has no fused optimizer state)."""

import pytest
import torch

from harness import run_spawn
from persistent_delta import DeltaConsumer
from tracker_cases import dp_table_case

pytestmark = pytest.mark.dist


def _poll(root: str):
    with DeltaConsumer(root, "x") as consumer:
        return consumer.poll().merged()


def test_dp_table_tracks_each_ranks_ids_and_merges_to_the_union(tmp_path):
    cases = [("ec", "ID_ONLY"), ("ec", "EMBEDDING"), ("ebc", "ID_ONLY")]
    results = run_spawn(dp_table_case, 2, str(tmp_path), cases)
    for kind, mode in cases:
        case = f"{kind}-{mode}"
        per_rank = [r[case] for r in results]
        dp_fqn, rw_fqn = per_rank[0]["dp_fqn"], per_rank[0]["rw_fqn"]
        assert all(r["skip_lines"] == [] for r in per_rank), case
        # the ranks looked up different ids of the replicated table (else the union proves nothing)
        assert set(per_rank[0]["dp_ids"]) != set(per_rank[1]["dp_ids"]), case
        union = sorted(set(per_rank[0]["dp_ids"]) | set(per_rank[1]["dp_ids"]))
        merged = _poll(str(tmp_path / case))
        assert merged[dp_fqn].global_ids.tolist() == union, case
        assert merged[rw_fqn].global_ids.tolist() == per_rank[0]["rw_all"], case
        if mode == "EMBEDDING":
            # duplicate ids keep the first part's (lowest rank's) row: results._cat_rows
            for pos, gid in enumerate(union):
                owner = 0 if gid in per_rank[0]["dp_ids"] else 1
                want = per_rank[owner]["dp_states"][per_rank[owner]["dp_ids"].index(gid)]
                assert torch.equal(merged[dp_fqn].states[pos], want), (case, gid)


def test_dp_table_skipped_in_optimizer_state_modes(tmp_path):
    cases = [("ec", "ROWWISE_ADAGRAD"), ("ec", "MOMENTUM_LAST"), ("ec", "MOMENTUM_DIFF"), ("ebc", "MOMENTUM_LAST")]
    results = run_spawn(dp_table_case, 2, str(tmp_path), cases)
    for kind, mode in cases:
        case = f"{kind}-{mode}"
        per_rank = [r[case] for r in results]
        dp_fqn, rw_fqn = per_rank[0]["dp_fqn"], per_rank[0]["rw_fqn"]
        for r in per_rank:
            assert len(r["skip_lines"]) == 1, (case, r["skip_lines"])
        merged = _poll(str(tmp_path / case))
        # the DP table never gets a record: at most an empty entry
        assert dp_fqn not in merged or merged[dp_fqn].global_ids.numel() == 0, case
        assert merged[rw_fqn].global_ids.tolist() == per_rank[0]["rw_all"], case
