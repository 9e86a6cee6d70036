"""PersistentDeltaTracker on real 2-rank sharded CPU models (gloo, spawn)."""

import pytest

from harness import feature_names, run_spawn
from unread_cases import publish_vs_log_case
from tracker_cases import (
    snapshot_bound_case,
    compaction_and_settings_case,
    config_checks,
    empty_shapes_case,
    consumers_while_training,
    differential,
    metadata_case,
    negative_id_publish_case,
    publish_restore_case,
    restart_first_half,
    restart_second_half,
    reused_memory_case,
    topk_case,
)

pytestmark = pytest.mark.dist

SETTINGS = [(["a", "b"], True, False), (["a"], False, True), (["a", "b", "c"], True, True), (["a", "b"], False, False)]
ALL_MODES = ["ID_ONLY", "EMBEDDING", "MOMENTUM_LAST", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD"]
EBC_MODES = ["ID_ONLY", "MOMENTUM_LAST", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD"]


@pytest.mark.parametrize(
    "kind,sharding,modes",
    [
        ("ec", "row_wise", ALL_MODES),
        pytest.param("ec", "table_wise", ALL_MODES, marks=pytest.mark.slow),  # slow: table-wise is also in the table_column_wise case
        ("ec", "column_wise", ALL_MODES),
        pytest.param("ebc", "row_wise", EBC_MODES, marks=pytest.mark.slow),  # slow: EBC stays covered by column_wise and table_column_wise
        pytest.param("ebc", "table_wise", EBC_MODES, marks=pytest.mark.slow),
        pytest.param("ebc", "column_wise", EBC_MODES, marks=pytest.mark.slow),
        ("ebc", "table_column_wise", EBC_MODES),
    ],
)
def test_agrees_with_torchrec_tracker(tmp_path, kind, sharding, modes):
    """Every get_unique agrees with TorchRec's tracker fed the same batches, for every mode and
    consumer setting, across a close + rebuild from the same path midway."""
    results = run_spawn(differential, 2, kind, sharding, str(tmp_path), modes, SETTINGS, timeout=600)
    for rank, compared in enumerate(results):
        assert len(compared) == len(modes) * len(SETTINGS)
        assert all(n > 0 for n in compared.values()), (rank, compared)


@pytest.mark.parametrize("mode", [pytest.param("ID_ONLY", marks=pytest.mark.slow), "EMBEDDING"])
def test_restart_in_a_new_process(tmp_path, mode):
    """A restarted trainer (new processes, restored model) continues the batch index and every
    consumer resumes from its committed offset, batches from before the restart included."""
    root, ckpt = str(tmp_path / "log"), str(tmp_path / "ckpt")
    reached = run_spawn(restart_first_half, 2, root, mode, 12, ckpt)
    assert reached == [6, 6]
    results = run_spawn(restart_second_half, 2, root, mode, 12, ckpt)
    for r in results:
        assert r["resumed_at"] == 6
        assert r["offsets"] == {"a": 5, "b": 0}
        assert r["rows"] > 0


def test_config_refusals_and_fresh(tmp_path):
    done = run_spawn(config_checks, 2, str(tmp_path / "log"))
    assert all(len(d) == 4 for d in done)


def test_consumers_added_and_removed_while_training(tmp_path):
    results = run_spawn(consumers_while_training, 2, str(tmp_path / "log"))
    for r in results:
        assert r["late"] and all(ids for ids in r["late"].values())
        assert r["tail"] and all(ids for ids in r["tail"].values())
        # once "late" is gone, retention deletes everything "a" has read
        assert r["records_left"] == 0


@pytest.mark.parametrize("mode,fraction", [("EMBEDDING", 0.3), pytest.param("ROWWISE_ADAGRAD", 0.5, marks=pytest.mark.slow), pytest.param("MOMENTUM_LAST", 0.25, marks=pytest.mark.slow),
                                           pytest.param("ID_ONLY", 0.5, marks=pytest.mark.slow)])
def test_top_percentage_matches_brute_force(tmp_path, mode, fraction):
    checked = run_spawn(topk_case, 2, str(tmp_path / "log"), mode, fraction)
    if mode == "ID_ONLY":
        assert checked == [0, 0]
    else:
        assert all(c > 0 for c in checked)


@pytest.mark.parametrize("kind,sharding", [pytest.param("ec", "row_wise", marks=pytest.mark.slow), pytest.param("ec", "table_wise", marks=pytest.mark.slow),
                                           ("ec", "column_wise"), pytest.param("ebc", "table_column_wise", marks=pytest.mark.slow)])
def test_shard_metadata_maps_to_global_ids(tmp_path, kind, sharding):
    results = run_spawn(metadata_case, 2, str(tmp_path / "log"), kind, sharding)
    feats = feature_names(2)
    seen = {}
    for rank, r in enumerate(results):
        assert set(r["stored"]) == set(r["torchrec"])
        for fqn, md in r["stored"].items():
            tr = r["torchrec"][fqn]
            for k in ("sharding_type", "row_offset", "col_offset", "local_rows", "local_cols", "global_rows", "global_cols"):
                assert md[k] == tr[k], (rank, fqn, k)
            assert md["module_kind"] == kind
            assert all(md["row_offset"] <= g < md["row_offset"] + md["local_rows"] for g in r["global_ids"][fqn])
            seen.setdefault(fqn, set()).update(r["global_ids"][fqn])
    # across ranks, the global ids are exactly the ids fed to each table
    for fqn, ids in seen.items():
        table = fqn.rsplit(".", 1)[1]
        want = set()
        for f in feats[table]:
            want.update(results[0]["input"].get(f, []))
        assert ids == want, fqn


@pytest.mark.parametrize("mode", [pytest.param("ID_ONLY", marks=pytest.mark.slow), "EMBEDDING",
                                  pytest.param("ROWWISE_ADAGRAD", marks=pytest.mark.slow)])
def test_publish_and_restore_converge(tmp_path, mode):
    """publish() + apply equals the trainer's rows, across a restore from an older checkpoint."""
    results = run_spawn(publish_restore_case, 2, str(tmp_path / "log"), mode)
    for r in results:
        assert r["published"] > 0
        assert r["redelivered"] and all(n > 0 for n in r["redelivered"].values())
        assert r["resumed"] == 10  # batches 1..9 recorded, re-delivery stamped 10: indices never reused
        assert r["mismatched"] == {fqn: 0 for fqn in r["mismatched"]}, r["mismatched"]


def test_restore_without_redelivery_diverges(tmp_path):
    """The check above can fail: skipping load_state_dict leaves lost-timeline values behind."""
    results = run_spawn(publish_restore_case, 2, str(tmp_path / "log"), "ID_ONLY", False)
    assert any(n > 0 for r in results for n in r["mismatched"].values())


def test_public_compact_splits_at_positions_and_settings_resolve_from_the_environment(tmp_path):
    (r,) = run_spawn(compaction_and_settings_case, 1, str(tmp_path / "log"))
    assert r["env_durability"], "PERSISTENT_DELTA_DURABILITY must reach a tracker as it reaches a store"
    assert r["compacted"], "the compaction did nothing: the test would prove nothing"
    assert r["same"], "compact() changed what a consumer or a restore reads"
    assert r["sd_batch"] == 5


def test_empty_results_keep_their_row_shape(tmp_path):
    (r,) = run_spawn(empty_shapes_case, 1, str(tmp_path / "log"))
    assert r["snapshots"] and set(r["snapshots"]) == set(r["dims"]), r
    for fqn, (shape, dtype) in r["snapshots"].items():
        assert shape == (0, *r["dims"][fqn]) and dtype == "torch.float32", (fqn, shape, dtype)
    assert r["lookups"] and all(v is None for v in r["lookups"].values()), r  # ID_ONLY: ids only


def test_the_retention_bound_expires_a_snapshots_consumer_too(tmp_path):
    """Issue 15: a shipper or replica on the snapshots channel that stops (a long outage) must not
    hold snapshot retention without bound; once expired and its publishes deleted, its next poll
    is told, never served the later publishes as if nothing was missing."""
    (out,) = run_spawn(snapshot_bound_case, 1, str(tmp_path / "log"))
    assert out["statuses"]["stale"] == "expired" and out["statuses"]["live"] != "expired", out["statuses"]
    assert "below the log start" in out["stale_poll"], out["stale_poll"]
    start, end = out["reset_range"]
    assert out["stale_start"] < start < end and out["reset_rows"] > 0, out
    # the consumer that kept up read every publish, contiguously, and was never expired
    ranges = out["live_ranges"]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(a < b for a, b in ranges), ranges


def test_publish_of_a_negative_id_raises_the_writers_typed_error(tmp_path):
    (r,) = run_spawn(negative_id_publish_case, 1, str(tmp_path / "log"))
    assert r["queued"] > 0, "the steps were committed already: the test would prove nothing"
    assert r["publish"].startswith("WriterError: InvalidInputError") and "non-negative" in r["publish"], r


def test_embedding_capture_and_reads_reuse_their_memory(tmp_path):
    """EMBEDDING keeps a copy of each lookup's rows in a reused block, not autograd's output
    (kept until the writer encodes it, that would outlive the next step's forward); get_unique
    reuses a dropped result's memory and never a kept one's (benchmarks/README.md, "The step
    by CPU time": both were page faults on the training thread every step)."""
    (r,) = run_spawn(reused_memory_case, 1, str(tmp_path / "log"))
    assert r["records"] > 0 and r["aliased"] == 0 and r["copies_equal"], r
    allocated, reused = r["blocks"]
    assert reused >= 2 and allocated <= 3, r
    assert r["reused_after_drop"] and r["results_reused"] == 1 and r["kept_intact"] and not r["kept_shared"], r


def test_a_publish_carries_exactly_what_the_log_holds_for_its_consumer(tmp_path):
    """A publish takes its consumer's unread ids from the writer's unread set instead of the
    log: they equal a twin consumer's get_unique at every publish (row- and column-wise
    tables), across steps still queued, retention, a restart, a later consumer and a restore;
    the log is read only at a consumer's first publish in a process and after anything else
    moved it or wrote to the log."""
    for r in run_spawn(publish_vs_log_case, 2, str(tmp_path / "log"), "ID_ONLY"):
        assert r["publishes"] == 18 and r["rows"] > 0, r
        assert r["differ"] == [], r["differ"][:2]
        assert r["log_reads"] == [2, 3, 6], r["log_reads"]
