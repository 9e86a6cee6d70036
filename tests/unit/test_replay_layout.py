"""Replay of a column-wise table whose shards' states do not tile a row (a per-row state per
shard, e.g. row-wise Adagrad): the export keeps each column shard (``ids.col<c>``,
``states.col<c>``), and the report shows that layout (STATES per column shard, and a note)."""

import importlib

import torch
from safetensors.torch import load_file
from torchrec.distributed.model_tracker.types import UniqueRows

from persistent_delta.serve.replay import _export_span
from persistent_delta.log.schema import ShardInfo
from persistent_delta.read.results import TableDelta, merge_table


def _half(rank: int, col: int) -> TableDelta:
    ids = torch.tensor([1, 4, 7])
    shard = ShardInfo(col_offset=col, local_cols=4, global_rows=10, global_cols=8)
    return TableDelta("t", rank, 0, 3, UniqueRows(ids, torch.rand(3)), ids, shard)  # one state per row


def test_column_shards_with_per_row_states_are_exported_side_by_side_and_shown(tmp_path):
    m = merge_table("t", [_half(0, 0), _half(1, 4)])
    assert m.states is None and m.column_split
    f = _export_span(m, 0, 3, "none", str(tmp_path), dry_run=False)
    assert f.states_shape is None and f.column_states == {0: [3], 4: [3]}
    tensors = load_file(f.path)
    assert sorted(tensors) == ["ids", "ids.col0", "ids.col4", "states.col0", "states.col4"]
    cli_main = importlib.import_module("persistent_delta.cli.main")  # the module (the package exports main())
    assert cli_main._states_cell(f) == "col0 3 col4 3"
