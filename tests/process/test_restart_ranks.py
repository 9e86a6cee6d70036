"""Issue 12 item 1: the ranks agree on the batch index after a restart."""

import pytest

from harness import run_spawn
from tracker_cases import rank_agreement_case

pytestmark = pytest.mark.dist


def test_ranks_continue_from_the_largest_persisted_batch_index(tmp_path):
    r0, r1 = run_spawn(rank_agreement_case, 2, str(tmp_path / "log"))
    assert r0["resumed"] == r1["resumed"] == 6, (r0["resumed"], r1["resumed"])  # was 6 vs 4
    # both ranks' positions cover the same batches
    assert r0["ranges"] == {0: (0, 10), 1: (0, 10)}, r0["ranges"]
    # batches 5 and 6 were lost on rank 1, so not committed on every rank: dropped on rank 0 too
    # (no merged table misses a column half), and no index is reused for new steps
    assert r0["lost_records"] == {0: 0, 1: 0}, r0["lost_records"]
