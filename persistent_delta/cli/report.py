"""``persistent-delta report``: PNG plots of a job computed from its log.

Owns: the report's series (:func:`series`, read from the logs, read-only) and its pictures
(:func:`write_report`, matplotlib's Agg backend: no display needed).

Three pictures, over the range each rank's log holds now:

* ``rows_per_batch.png`` -- rows recorded per batch, one line per table (summed over ranks; rows
  as stored, before de-duplication across records). A compacted range is stored under its
  first batch, so it shows as one tall point. In a FIRST or NONE log (EMBEDDING, ID_ONLY) the
  writer's window filter records a row once per read window
  (:class:`persistent_delta.trainer.window.WindowFilter`), so the line counts the rows *first
  recorded since the last read*, not every row a batch changed; the picture's title says which.
* ``bytes_per_batch.png`` -- record bytes stored per batch, one line per rank.
* ``consumer_lag.png`` -- each consumer's lag in batches at each of its remembered commits
  (:attr:`persistent_delta.log.schema.ConsumerEntry.history`) and now, against time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from persistent_delta.cli.top import printable
from persistent_delta.errors import PersistentDeltaError
from persistent_delta.log import position_rules
from persistent_delta.log.deltalog import DeltaLog, ReadTxn
from persistent_delta.log.layout import PathLike, rank_paths
from persistent_delta.log.schema import LOOKUPS, META_UPDATE_MODE

# (consumer, rank) -> [(time, lag in batches)], oldest first
LagSeries = Dict[Tuple[str, int], List[Tuple[float, int]]]


@dataclass
class ReportSeries:
    """What the pictures plot."""

    rows: Dict[str, Dict[int, int]] = field(default_factory=dict)  # table fqn -> batch -> rows
    bytes: Dict[int, Dict[int, int]] = field(default_factory=dict)  # rank -> batch -> bytes
    lag: LagSeries = field(default_factory=dict)
    ranges: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # rank -> [log start, log end)
    when: float = 0.0
    update_mode: str = ""  # the lookups channel's UpdateMode value ("" when the log does not say)


def _rank_series(r: ReadTxn, rank: int, out: ReportSeries) -> None:
    start, end = position_rules.bounds(r, LOOKUPS)
    out.ranges[rank] = (start, end)
    out.update_mode = out.update_mode or str(r.meta(META_UPDATE_MODE) or "")
    per_batch = out.bytes.setdefault(rank, {})
    for fqn, entry in sorted(r.tables().items()):
        rows = out.rows.setdefault(fqn, {})
        for rec in r.iter_records(entry.table_id, start, end, verify=False):
            rows[rec.batch_idx] = rows.get(rec.batch_idx, 0) + int(rec.ids.numel())
            per_batch[rec.batch_idx] = per_batch.get(rec.batch_idx, 0) + rec.nbytes
    for name, c in sorted(r.consumers().items()):
        if c.channel != LOOKUPS:
            continue
        points = [(p.time, p.lag) for p in c.history if p.lag is not None]
        points.append((out.when, max(0, end - c.offset)))
        out.lag[(name, rank)] = [(t, int(v)) for t, v in points]


def series(root: PathLike) -> ReportSeries:
    """Read the report's series from every rank's log (read-only).

    Args:
        root: the log root.

    Raises:
        NotALogError: ``root`` holds no log.
    """
    out = ReportSeries(when=time.time())
    for rank, path in rank_paths(root).items():
        with DeltaLog(path, readonly=True) as log:
            log.read(lambda r, rank=rank: _rank_series(r, rank, out))
    return out


@dataclass
class ReportWritten:
    """The pictures written and the batch range of each rank they cover (``[start, end)``)."""

    files: List[str]
    ranges: Dict[int, Tuple[int, int]]


def write_report(root: PathLike, out_dir: str) -> ReportWritten:
    """Write the report's PNGs into ``out_dir`` (created when missing).

    Args:
        root: the log root.
        out_dir: where the pictures go.

    Returns:
        The pictures written and the range covered.

    Raises:
        PersistentDeltaError: matplotlib is missing (the ``ops`` extra).
        NotALogError: ``root`` holds no log.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PersistentDeltaError("report needs the 'ops' extra: pip install 'persistent_delta[ops]'") from exc
    data = series(root)
    os.makedirs(out_dir, exist_ok=True)
    span = ", ".join(f"rank {r}: [{a}, {b})" for r, (a, b) in sorted(data.ranges.items()))
    files: List[str] = []

    def save(fig: object, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()  # type: ignore[attr-defined]
        fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        files.append(path)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for fqn, rows in sorted(data.rows.items()):
        xs = sorted(rows)
        ax.plot(xs, [rows[x] for x in xs], marker=".", linewidth=1, label=printable(fqn))
    ax.set(title=f"{rows_title(data.update_mode)}, per table (all ranks)\n{span}", xlabel="batch", ylabel="rows")
    _finish(ax, bool(data.rows), integer_x=True)
    save(fig, "rows_per_batch.png")

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for rank, per in sorted(data.bytes.items()):
        xs = sorted(per)
        ax.plot(xs, [per[x] / 1024 for x in xs], marker=".", linewidth=1, label=f"rank {rank}")
    ax.set(title=f"Record bytes per batch, per rank\n{span}", xlabel="batch", ylabel="KiB")
    _finish(ax, any(data.bytes.values()), integer_x=True)
    save(fig, "bytes_per_batch.png")

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for (name, rank), points in sorted(data.lag.items()):
        xs, ys = [t - data.when for t, _ in points], [v for _, v in points]
        line, = ax.plot(xs[:-1], ys[:-1], marker="o", linewidth=1, label=f"{printable(name)} (rank {rank})")
        # now: a hollow point, joined by a dashed line (nothing is known between the last commit and now)
        ax.plot(xs[-2:], ys[-2:], linestyle="--", linewidth=1, color=line.get_color())
        ax.plot(xs[-1:], ys[-1:], marker="o", markerfacecolor="white", color=line.get_color())
    ax.set(title="Consumer lag at its remembered commits (filled) and now (hollow)", xlabel="seconds before now",
           ylabel="lag (batches)")
    _finish(ax, bool(data.lag))
    save(fig, "consumer_lag.png")
    return ReportWritten(files, dict(sorted(data.ranges.items())))


def rows_title(update_mode: str) -> str:
    """What ``rows_per_batch.png`` counts, by the log's update mode (see the module note)."""
    if update_mode in ("first", "none"):
        return "Rows first recorded per batch since the last read (window filter)"
    return "Rows recorded per batch"


def _finish(ax: object, has_data: bool, integer_x: bool = False) -> None:
    if integer_x:  # batch numbers: whole ticks, never 2.5
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # type: ignore[attr-defined]
    ax.grid(True, alpha=0.3)  # type: ignore[attr-defined]
    if has_data:
        ax.legend(loc="best", fontsize="small")  # type: ignore[attr-defined]
    else:
        ax.text(0.5, 0.5, "nothing stored", ha="center", va="center", transform=ax.transAxes)  # type: ignore
