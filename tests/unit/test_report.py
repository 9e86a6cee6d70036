"""``persistent-delta report``: the series it plots are the log's (rows per batch per table,
bytes per batch per rank, each consumer's lag at its commits and now) and it writes three PNGs."""

from __future__ import annotations

import io
import os

import pytest
import torch

pytest.importorskip("matplotlib")

from logs import fill_ranks  # noqa: E402
from persistent_delta import DeltaConsumer  # noqa: E402
from persistent_delta.cli import main  # noqa: E402
from persistent_delta.cli.report import series  # noqa: E402
from persistent_delta.ops.positions import describe  # noqa: E402


def _records(rank: int, b: int):
    return [("t0", torch.arange(b + 1), None), ("t1", torch.arange(2 * rank + 1), None)]


def test_report_series_and_pictures(tmp_path):
    root, out = str(tmp_path / "job"), str(tmp_path / "report")
    fill_ranks(root, _records, ranks=2, batches=8)
    with DeltaConsumer(root, "c") as c:
        for _ in range(3):
            c.poll(max_batches=2)
            c.commit()
    data = series(root)
    assert data.rows["t0"] == {b: 2 * (b + 1) for b in range(8)}  # both ranks
    assert data.rows["t1"] == {b: 1 + 3 for b in range(8)}
    ranks = {r.rank: r for r in describe(root)}
    for rank in (0, 1):
        assert sum(data.bytes[rank].values()) == ranks[rank].consumers[0].pending_bytes + sum(
            v for b, v in data.bytes[rank].items() if b < 6)
        assert [v for _, v in data.lag[("c", rank)]] == [6, 4, 2, 2]  # at its three commits, then now
    buf = io.StringIO()
    assert main(["report", root, "--out", out], stdout=buf) == 0
    for name in ("rows_per_batch.png", "bytes_per_batch.png", "consumer_lag.png"):
        with open(os.path.join(out, name), "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(os.path.join(out, name)) > 10_000, name
        assert name in buf.getvalue()


def test_the_rows_picture_says_what_it_counts_and_ticks_whole_batches(tmp_path):
    """A FIRST/NONE log's writer records a row once per read window, so the rows picture is
    titled as rows first recorded since the last read there; batch ticks are whole numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from persistent_delta.cli import report

    root = str(tmp_path / "job")
    fill_ranks(root, _records, ranks=1, batches=4)
    assert series(root).update_mode == "none"  # (fill_ranks writes UpdateMode.NONE logs)
    assert "first recorded" in report.rows_title("first") and "first recorded" in report.rows_title("none")
    assert "first recorded" not in report.rows_title("last")
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2, 3], [5, 1, 4, 2], label="t0")
    report._finish(ax, True, integer_x=True)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 3]
    plt.close(fig)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
