"""Forwards in eval mode: tracked by default (TorchRec's behaviour: a validation pass adds its
rows to every read and publish), not tracked with ``track_eval=False``."""

import pytest

from eval_cases import eval_forward_case
from harness import run_spawn

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("mode", ["ID_ONLY", "EMBEDDING"])
def test_eval_forwards_are_skipped_only_when_asked(tmp_path, mode):
    tracked = run_spawn(eval_forward_case, 1, str(tmp_path / "on"), mode, True)[0]
    skipped = run_spawn(eval_forward_case, 1, str(tmp_path / "off"), mode, False)[0]
    assert tracked["batch"] == skipped["batch"]  # every forward advances the batch index either way
    grew = False
    for table, ids in skipped["ids"].items():
        assert set(ids) <= set(tracked["ids"][table])
        grew |= len(tracked["ids"][table]) > len(ids)
    assert grew, "the eval batches looked up no id that training did not: the test checks nothing"
