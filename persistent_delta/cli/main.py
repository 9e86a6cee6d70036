"""The ``persistent-delta`` command line: offsets, verify, replay, apply, vacuum, upgrade, consolidate,
report, ship, keygen, exporter, top.

Owns: argument parsing and rendering; no tool logic.

Each subcommand calls a data function of its module (``offsets``: :mod:`.offsets` and, with
``--server``, :mod:`.remote`; replay and apply: :mod:`persistent_delta.serve.replay` and
:mod:`persistent_delta.serve.apply_files`, which own their file formats; the others: the module
of their name, listed in :mod:`persistent_delta.cli`; consolidate:
:mod:`persistent_delta.checkpoint.consolidate`) and turns its result into a :class:`Output`: the JSON form and
the text tables. One renderer prints either (``--format text|json``). Errors go to stderr as
``persistent-delta: error: ...`` with exit status 1 (2 for usage errors). The long-running
commands (ship, exporter, top) exit 0 within a second of SIGTERM/SIGINT (:mod:`.stopping`).
Inspection opens logs read-only and never creates one; offset changes are dry runs unless
``--execute`` is given.
Long work (replay, verify, vacuum, upgrade) shows a tqdm progress bar when stderr is a terminal,
and nothing when it is piped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Union

from persistent_delta.log.position_rules import behind_note
from persistent_delta.serve.apply_files import apply_inputs
from persistent_delta.cli.exporter import run_exporter
from persistent_delta.cli.offsets import ResetTarget, delete_consumer, describe, register_consumer, reset_offsets
from persistent_delta.cli.remote import behind_note as remote_behind_note, change_remote, describe_remote, rejected_note
from persistent_delta.serve.replay import ReplayFile, replay
from persistent_delta.cli.report import write_report
from persistent_delta.cli.keygen import run_keygen
from persistent_delta.cli.ship import add_connect_arguments, connect_options, niceness, run_ship
from persistent_delta.cli.stopping import bounded, exit_now, stopped_by
from persistent_delta.cli.top import printable, run_top
from persistent_delta.cli.upgrade import upgrade
from persistent_delta.checkpoint.consolidate import consolidate, remove_old_bases
from persistent_delta.cli.vacuum import vacuum
from persistent_delta.cli.verify import verify
from persistent_delta.errors import CommandStoppedError, PersistentDeltaError

PROG = "persistent-delta"
JSONValue = Union[None, bool, int, float, str, List["JSONValue"], Dict[str, "JSONValue"]]
logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ rendering


@dataclass
class Table:
    """A text table: a title line, headers and rows."""

    title: str
    headers: Sequence[str]
    rows: Sequence[Sequence[object]]


@dataclass
class Output:
    """What a subcommand returns: its data (JSON form), text tables and notes, exit status."""

    data: JSONValue
    tables: List[Table] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    exit_code: int = 0


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return printable(v)  # fqns, names, hosts, error texts come from data: control characters escaped


class EscapingFormatter(logging.Formatter):
    """Log lines on the terminal with control characters escaped (they quote names and errors)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def render(out: Output, fmt: str, stream: TextIO) -> None:
    """Print ``out`` as JSON or as aligned text tables followed by the notes."""
    if fmt == "json":
        json.dump(out.data, stream, indent=2, sort_keys=True)
        stream.write("\n")
        return
    for i, t in enumerate(out.tables):
        if i:
            stream.write("\n")
        if t.title:
            stream.write(printable(t.title) + "\n")
        cells = [[_cell(v) for v in row] for row in t.rows]
        widths = [max([len(h)] + [len(r[j]) for r in cells]) for j, h in enumerate(t.headers)]
        lines = [t.headers] + cells
        for row in lines:
            stream.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
        if not cells:
            stream.write("(none)\n")
    for note in out.notes:
        stream.write(printable(note) + "\n")


def _states_cell(f: ReplayFile) -> str:
    """The STATES cell of a replay file: the states' shape, or each column shard's
    (``col<c> RxW``) when a column-split table's states do not tile a row."""
    if f.states_shape:
        return "x".join(map(str, f.states_shape))
    if f.column_states:
        return " ".join(f"col{c} " + "x".join(map(str, shape)) for c, shape in sorted(f.column_states.items()))
    return "-"


def _jsonable(obj: object) -> JSONValue:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _when(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


class _Progress:
    """A tqdm bar on stderr when it is a terminal; a no-op otherwise."""

    def __init__(self, desc: str, unit: str) -> None:
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit=unit, file=sys.stderr, leave=False)

    def total(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()

    def add(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------ offsets


def _cmd_offsets(args: argparse.Namespace) -> Output:
    if args.server:
        return _remote_offsets(args)
    if not args.root:
        raise PersistentDeltaError("offsets needs ROOT (a log root) or --server URL --job NAME")
    if args.reset or args.register or args.delete:
        return _offsets_change(args)
    if args.execute or _reset_target(args) is not None:
        raise PersistentDeltaError("--execute and --to-* go with --reset, --register or --delete")
    ranks = describe(args.root, tables=args.tables)
    rows = [
        [r.rank, c.name, c.channel, c.offset, c.log_start, c.log_end, c.lag, "-" if c.lag_s is None else f"{c.lag_s:.3f}",
         c.pending_rows, c.pending_bytes, _when(c.commit_time), c.registered_by or "-", c.status, c.health]
        for r in ranks for c in r.consumers
    ]
    headers = ["RANK", "CONSUMER", "CHANNEL", "OFFSET", "LOG-START", "LOG-END", "LAG", "LAG-S", "PENDING-ROWS",
               "PENDING-BYTES", "LAST-COMMIT", "REGISTERED-BY", "STATUS", "HEALTH"]
    logs = [[r.rank, r.log_start, r.log_end, r.snapshot_end, "-" if r.snapshots_behind is None else
             f"missed {r.snapshots_behind}", r.path] for r in ranks]
    out = Output(data={"ranks": _jsonable(ranks)},
                 tables=[Table("", headers, rows),
                         Table("", ["RANK", "LOG-START", "LOG-END", "SNAPSHOT-END", "SNAPSHOTS-BEHIND", "PATH"], logs)])
    behind = {r.rank: r.snapshots_behind for r in ranks if r.snapshots_behind is not None}
    if behind:
        out.notes.append(behind_note(behind))
    if args.tables:
        trows = [[r.rank, t.fqn, t.sharding_type or "-", t.records, t.rows, t.bytes, t.first_batch, t.last_batch_idx,
                  t.snapshot_records, t.snapshot_bytes, t.managed_collision or "-", t.zch_records, t.zch_bytes]
                 for r in ranks for t in (r.tables or [])]
        out.tables.append(Table("", ["RANK", "TABLE", "SHARDING", "RECORDS", "ROWS", "BYTES", "FIRST-BATCH",
                                     "LAST-BATCH", "SNAPSHOTS", "SNAPSHOT-BYTES", "ZCH", "ZCH-RECORDS", "ZCH-BYTES"],
                                trows))
    return out


def _reset_target(args: argparse.Namespace) -> Optional[ResetTarget]:
    given = [(k, v) for k, v in (("earliest", args.to_earliest), ("latest", args.to_latest),
                                 ("batch", args.to_batch), ("shift", args.shift_by))
             if v is not None and v is not False]  # (0 is a batch and a shift: not "missing")
    if len(given) > 1:
        raise PersistentDeltaError("give at most one of --to-earliest, --to-latest, --to-batch, --shift-by")
    if not given:
        return None
    kind, value = given[0]
    return ResetTarget(kind, 0 if isinstance(value, bool) else int(value))


def _offsets_change(args: argparse.Namespace) -> Output:
    if sum(bool(x) for x in (args.reset, args.register, args.delete)) != 1:
        raise PersistentDeltaError("give one of --reset, --register, --delete")
    target = _reset_target(args)
    if args.reset:
        if target is None:
            raise PersistentDeltaError("--reset needs one of --to-earliest, --to-latest, --to-batch N, --shift-by N")
        changes = reset_offsets(args.root, args.reset, target, execute=args.execute)
    elif args.register:
        changes = register_consumer(args.root, args.register, target or ResetTarget("earliest"),
                                            channel=args.channel, execute=args.execute)
    else:
        if target is not None:
            raise PersistentDeltaError("--delete takes no --to-* option")
        changes = delete_consumer(args.root, args.delete, execute=args.execute)
    rows = [[c.rank, c.consumer, c.action, c.old, c.new, c.log_start, c.log_end, c.note or ""] for c in changes]
    title = "APPLIED" if args.execute else "DRY RUN: nothing changed; add --execute to apply"
    return Output(
        data={"execute": bool(args.execute), "changes": _jsonable(changes)},
        tables=[Table(title, ["RANK", "CONSUMER", "ACTION", "OLD", "NEW", "LOG-START", "LOG-END", "NOTE"], rows)],
    )


def _remote_offsets(args: argparse.Namespace) -> Output:
    if not args.job:
        raise PersistentDeltaError("offsets --server needs --job NAME")
    opts = connect_options(args)
    if args.reset or args.delete:
        if args.register:
            raise PersistentDeltaError("--register is for local logs (remote consumers register themselves)")
        target = _reset_target(args)
        if args.reset:
            if target is None or target.kind == "shift":
                raise PersistentDeltaError("remote --reset needs --to-earliest, --to-latest or --to-batch N")
            changes = change_remote(args.server, args.job, args.reset, "reset", target.kind, target.value,
                                    execute=args.execute, options=opts, key=args.key_file, insecure=args.insecure)
        else:
            changes = change_remote(args.server, args.job, args.delete, "delete", execute=args.execute, options=opts)
        title = "APPLIED" if args.execute else "DRY RUN: nothing changed; add --execute to apply"
        rows = [[c.rank, c.consumer, c.channel, c.action, c.old, c.new] for c in changes]
        return Output(data={"execute": bool(args.execute), "changes": _jsonable(changes)},
                      tables=[Table(title, ["RANK", "CONSUMER", "CHANNEL", "ACTION", "OLD", "NEW"], rows)])
    if args.register:
        raise PersistentDeltaError("--register is for local logs (remote consumers register themselves)")
    found = describe_remote(args.server, args.job, opts, key=args.key_file, insecure=args.insecure)
    crow = [[c.rank, c.consumer, c.channel, c.offset if c.offset is not None else "earliest", c.stream_end, c.lag,
             _when(c.commit_time), "yes" if c.active else "no", c.health,
             "-" if c.snapshots_behind is None else f"missed {c.snapshots_behind}"] for c in found["consumers"]]
    srow = [[s.rank, s.channel, s.position, s.log_end, s.lag_batches, s.row_bytes, s.retries, _when(s.last_shipped),
             f"{s.host}:{s.pid}", s.last_error or "-"] for s in found["shippers"]]
    strow = [[st.stream, ",".join(str(r) for r in st.ranks) or "-", st.layout] for st in found["streams"]]
    notes = [n for n in (remote_behind_note(found), rejected_note(found)) if n]
    return Output(data=_jsonable(found), notes=notes, tables=[
        Table("STREAMS", ["STREAM", "RANKS", "LAYOUT"], strow),
        Table("REMOTE CONSUMERS", ["RANK", "CONSUMER", "CHANNEL", "OFFSET", "STREAM-END", "LAG", "LAST-COMMIT", "ACTIVE",
                                   "HEALTH", "SNAPSHOTS-BEHIND"], crow),
        Table("SHIPPERS", ["RANK", "CHANNEL", "POSITION", "LOG-END", "LAG", "ROW-BYTES", "RETRIES", "LAST-SHIPPED",
                           "HOST:PID", "LAST-ERROR"], srow)])


# ------------------------------------------------------------------------------ ship


def _cmd_ship(args: argparse.Namespace) -> Output:
    stats = run_ship(args)
    rows = [[s["rank"], s["channel"], s["position"], s["log_end"], s["lag_batches"], s["ranges"], s["row_bytes"],
             s["retries"]] for s in stats]
    return Output(data={"shippers": _jsonable(stats)}, tables=[
        Table("SHIPPED", ["RANK", "CHANNEL", "POSITION", "LOG-END", "LAG", "RANGES", "ROW-BYTES", "RETRIES"], rows)])


def _cmd_keygen(args: argparse.Namespace) -> Output:
    key = run_keygen(args)
    return Output(data={"path": args.path, "key_id": key.key_id},
                  notes=[f"keygen: wrote stream key {key.key_id} to {args.path} (mode 0600); give it to the shipper "
                         "and every consumer of the job (--key-file / key= / PERSISTENT_DELTA_STREAM_KEY_FILE)"])


# ------------------------------------------------------------------------------ exporter


def _cmd_exporter(args: argparse.Namespace) -> Output:
    served = run_exporter(args)
    return Output(data=_jsonable(served), notes=[f"exporter: stopped serving {served['addr']}:{served['port']}"])


def _cmd_report(args: argparse.Namespace) -> Output:
    done = write_report(args.root, args.out)
    return Output(data=_jsonable(done), tables=[Table("", ["PICTURE"], [[f] for f in done.files])])


def _cmd_top(args: argparse.Namespace) -> Output:
    return Output(data=_jsonable(run_top(args)))


# ------------------------------------------------------------------------------ replay


def _cmd_replay(args: argparse.Namespace) -> Output:
    bar = _Progress("replay", "span")
    try:
        report = replay(
            args.root, args.out, from_batch=args.from_batch, to_batch=args.to_batch, consumer=args.consumer,
            commit=args.commit, tables=args.tables, span=args.span, shard_files=args.shard_files,
            dry_run=args.dry_run, progress=bar.total,
        )
    finally:
        bar.close()
    rows = [[f.kind, f"[{f.start_idx}, {f.end_idx})", f.fqn, f.rows,
             _states_cell(f), "yes" if f.column_split else "no",
             f.path or "-"] for f in report.files]
    ranges = ", ".join(f"rank {r}: [{a}, {b})" for r, (a, b) in sorted(report.ranges.items()))
    title = ("DRY RUN: nothing written. " if report.dry_run else "") + f"{len(report.spans)} span(s); {ranges}"
    notes = list(report.notes)
    if report.committed is not None:
        notes.append(f"committed {report.consumer!r}: {report.committed}")
    return Output(data=_jsonable(report), notes=notes,
                  tables=[Table(title, ["KIND", "BATCHES", "TABLE", "ROWS", "STATES", "COL-SPLIT", "FILE"], rows)])


# ------------------------------------------------------------------------------ verify, vacuum


def _cmd_verify(args: argparse.Namespace) -> Output:
    bar = _Progress("verify", "record")
    try:
        report = verify(args.root, progress=bar.add)
    finally:
        bar.close()
    summary = [[rc.rank, rc.records, rc.snapshots, rc.side_records, rc.bytes, rc.tables, rc.consumers,
                sum(p.severity == "error" for p in rc.problems), rc.path] for rc in report.ranks]
    problems = [[p.rank, p.severity, p.where, p.message] for p in report.problems]
    status = "OK" if report.ok else f"DAMAGED: {len(report.errors)} error(s)"
    out = Output(
        data={"root": report.root, "ok": report.ok, "ranks": _jsonable(report.ranks)},
        tables=[Table("", ["RANK", "RECORDS", "SNAPSHOTS", "ZCH-RECORDS", "BYTES", "TABLES", "CONSUMERS", "ERRORS",
                           "PATH"], summary)],
        notes=[f"verify: {status}"],
        exit_code=0 if report.ok else 1,
    )
    if problems:
        out.tables.append(Table("", ["RANK", "SEVERITY", "WHERE", "PROBLEM"], problems))
    return out


def _cmd_apply(args: argparse.Namespace) -> Output:
    report = apply_inputs(args.inputs, out=args.out, replica=args.replica, dry_run=args.dry_run)
    rows = [[path, kind, r, a, b] for path, kind, ranges in report.inputs for r, (a, b) in sorted(ranges.items())]
    nxt = ", ".join(f"rank {r}: {b}" for r, b in sorted(report.next_batch.items()))
    notes = [f"next input starts at: {nxt}"]
    notes.append("DRY RUN: order checked, nothing applied or written" if report.dry_run else f"replica: {report.out}")
    return Output(data=_jsonable(report), tables=[Table("", ["INPUT", "KIND", "RANK", "FROM", "TO"], rows)], notes=notes)


def _cmd_vacuum(args: argparse.Namespace) -> Output:
    bar = _Progress("vacuum", "rank")
    try:
        results = vacuum(args.root, progress=bar.total, execute=args.execute)
    finally:
        bar.close()
    rows = [[r.rank, r.bytes_before, "-" if r.bytes_after is None else r.bytes_after,
             "-" if r.bytes_after is None else r.bytes_before - r.bytes_after, r.path] for r in results]
    notes = [] if args.execute else ["DRY RUN: no process has the log open; nothing changed; add --execute to compact"]
    return Output(data={"ranks": _jsonable(results), "dry_run": not args.execute},
                  tables=[Table("", ["RANK", "BYTES-BEFORE", "BYTES-AFTER", "RECLAIMED", "PATH"], rows)], notes=notes)


def _cmd_upgrade(args: argparse.Namespace) -> Output:
    bar = _Progress("upgrade", "record")
    try:
        results = upgrade(args.root, execute=args.execute, progress=bar.add)
    finally:
        bar.close()
    rows = [[r.rank, r.from_version, r.to_version, r.records, "yes" if r.applied else "no", r.path] for r in results]
    notes = [] if args.execute else ["DRY RUN: nothing changed; add --execute to apply"]
    return Output(data={"ranks": _jsonable(results), "dry_run": not args.execute},
                  tables=[Table("", ["RANK", "FROM", "TO", "RECORDS", "APPLIED", "PATH"], rows)], notes=notes)


def _cmd_consolidate(args: argparse.Namespace) -> Output:
    done = consolidate(args.root, out=args.out)
    rows = [[done.source, done.increments, done.path, done.step, done.bytes_written]]
    out = Output(data={"consolidated": _jsonable(done)},
                 tables=[Table("", ["SOURCE", "INCREMENTS", "BASE", "STEP", "BYTES"], rows)])
    if not done.increments:
        out.notes.append("nothing to fold: the newest complete base has no complete increment")
    if args.remove_older:
        removed = remove_old_bases(args.out or args.root, keep=args.keep, execute=args.execute)
        out.data.update(removed=removed, dry_run=not args.execute)
        out.tables.append(Table("", ["OLDER BASE (WITH ITS INCREMENTS)"], [[path] for path in removed]))
        if not args.execute:
            out.notes.append("DRY RUN: no base removed; add --execute to remove the older bases listed")
    return out


# ------------------------------------------------------------------------------ parser, main


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands offsets, replay, apply, verify, vacuum, upgrade)."""
    fmt = argparse.ArgumentParser(add_help=False)
    fmt.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    p = argparse.ArgumentParser(prog=PROG, description="Inspect and maintain persistent_delta logs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    o = sub.add_parser("offsets", parents=[fmt], help="describe consumers; reset, register or delete offsets",
                       description="Without --reset/--register/--delete: per rank and consumer, the committed offset, "
                                   "log start and end, lag, pending rows and bytes, last commit time.")
    o.add_argument("root", nargs="?", help="log root (holding rank-<r>/); omit with --server")
    o.add_argument("--tables", action="store_true", help="also per-table record counts and sizes")
    o.add_argument("--reset", metavar="CONSUMER", help="move a consumer's offset (dry run unless --execute)")
    o.add_argument("--register", metavar="CONSUMER", help="register an external consumer (default at the log start)")
    o.add_argument("--delete", metavar="CONSUMER", help="unregister a consumer (it stops holding back retention)")
    o.add_argument("--channel", choices=("lookups", "snapshots"), default="lookups", help="channel for --register")
    o.add_argument("--to-earliest", action="store_true", help="to the log start")
    o.add_argument("--to-latest", action="store_true", help="to the log end")
    o.add_argument("--to-batch", type=int, metavar="N", help="to batch N (clamped to [start, end])")
    o.add_argument("--shift-by", type=int, metavar="N", help="by N batches (negative: back)")
    o.add_argument("--execute", action="store_true", help="apply the change (default: dry run)")
    add_connect_arguments(o)
    o.set_defaults(func=_cmd_offsets)

    s = sub.add_parser("ship", parents=[fmt], help="ship this host's rank logs to a NATS JetStream stream",
                       description="One per host, beside the trainer: a registered consumer of each local rank log; "
                                   "sends complete batches and commits locally only after the stream acknowledged "
                                   "them. Runs until SIGTERM/SIGINT.")
    s.add_argument("root", help="log root on this host (holding its rank-<r>/)")
    add_connect_arguments(s)
    s.add_argument("--channels", default="lookups,snapshots", help="channels to ship (default lookups,snapshots)")
    s.add_argument("--ranks", help="only these local ranks (comma-separated; default all found)")
    s.add_argument("--max-batches", type=int, default=16, help="batches per shipped range at most (default 16)")
    s.add_argument("--replicas", type=int, default=1, help="stream replicas when creating it (default 1)")
    s.add_argument("--max-bytes", type=int, default=-1, help="stream byte limit when creating it (default none)")
    s.add_argument("--max-age", type=float, default=0.0, help="stream age limit in seconds when creating it")
    s.add_argument("--ranks-per-stream", type=int, default=None, metavar="G",
                   help="ship ranks [g*G, (g+1)*G) into a stream of their own per group g (PDG_<job>_<g>) instead "
                        "of one stream for the job (PD_<job>); fixed by the job's first shipper (default: the "
                        "job's layout, one stream for a new job)")
    s.add_argument("--checkpoints", metavar="DIR", default=None,
                   help="the trainer's checkpoint root (Checkpoints(root=)): whenever its newest chain moves, upload "
                        "each local rank's base from it, so a remote replica's bootstrap() (or a Follower without "
                        "checkpoints) starts from the newest increment (default: bases only from upload_base)")
    s.add_argument("--nice", type=niceness, default=0, metavar="N",
                   help="lower this process's CPU priority by N (0-19; default 0): where the trainer needs every "
                        "core, the shipper then runs on what it leaves (freshness pays)")
    s.set_defaults(func=_cmd_ship)

    k = sub.add_parser("keygen", parents=[fmt], help="create a job's stream key file (mode 0600)",
                       description="The key authenticates everything the shipper writes to the stream; the shipper "
                                   "and every remote consumer of the job need the same file.")
    k.add_argument("path", help="the key file to create (never overwritten)")
    k.add_argument("--key-id", metavar="ID", help="the key's id, [A-Za-z0-9_-]{1,32} (default random)")
    k.set_defaults(func=_cmd_keygen)

    e = sub.add_parser("exporter", parents=[fmt], help="serve a job's metrics to Prometheus (logs, consumers, stream)",
                       description="Serves /metrics in Prometheus' format, read at each scrape from the log root "
                                   "(read-only) and, with --server, the job's stream and buckets. Runs until "
                                   "SIGTERM/SIGINT. The trainer's own counters are served by serve_metrics(tracker=).")
    e.add_argument("root", nargs="?", help="log root (holding rank-<r>/); optional with --server")
    add_connect_arguments(e)
    e.add_argument("--port", type=int, default=9464, help="TCP port (default 9464; 0: a free one, printed)")
    e.add_argument("--addr", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    e.add_argument("--tables", action="store_true", help="also per-table series (a table label)")
    e.add_argument("--stall-after", type=float, metavar="S",
                   help="health: least seconds without a commit, while data arrives, before 'stalled' "
                        "(default $PERSISTENT_DELTA_STALL_AFTER_S or 30)")
    e.set_defaults(func=_cmd_exporter)

    t = sub.add_parser("top", parents=[fmt], help="a live view of ranks, consumers and shippers (refreshed)",
                       description="Redraws every second: per rank the batch index and log start; per consumer the "
                                   "offset, lag, last commit and health; with --server remote consumers and "
                                   "shippers; with --metrics a trainer's writer queue. Ctrl-C ends it.")
    t.add_argument("root", nargs="?", help="log root (holding rank-<r>/); optional with --server")
    add_connect_arguments(t)
    t.add_argument("--metrics", action="append", metavar="URL",
                   help="a trainer's metrics endpoint (serve_metrics(tracker=)), for its writer queue; repeatable")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    t.add_argument("--iterations", type=int, default=0, help="stop after N draws (default: run until Ctrl-C)")
    t.add_argument("--stall-after", type=float, metavar="S", help="health: least silence before 'stalled'")
    t.set_defaults(func=_cmd_top)

    g = sub.add_parser("report", parents=[fmt], help="PNG plots of a job computed from its log",
                       description="Writes rows_per_batch.png (rows changed per batch per table), "
                                   "bytes_per_batch.png (record bytes per batch per rank) and consumer_lag.png (each "
                                   "consumer's lag at its remembered commits and now), over the range the log holds.")
    g.add_argument("root", help="log root")
    g.add_argument("--out", required=True, metavar="DIR", help="directory for the pictures (created when missing)")
    g.set_defaults(func=_cmd_report)

    r = sub.add_parser("replay", parents=[fmt], help="export a batch range (all ranks merged) as safetensors")
    r.add_argument("root", help="log root")
    r.add_argument("--from-batch", type=int, metavar="A", help="first batch (inclusive)")
    r.add_argument("--to-batch", type=int, metavar="B", help="end batch (exclusive)")
    r.add_argument("--consumer", metavar="C", help="replay the consumer's pending range instead")
    r.add_argument("--commit", action="store_true", help="with --consumer: commit the range end after writing")
    r.add_argument("--tables", nargs="+", metavar="FQN", help="only these tables")
    r.add_argument("--span", type=int, metavar="N", help="batches per exported span (default: one span)")
    r.add_argument("--out", metavar="DIR", help="output directory")
    r.add_argument("--shard-files", metavar="DIR", help="shard-files dir (save_local_shards): also write the changed rows' values")
    r.add_argument("--dry-run", action="store_true", help="print the summary; write and commit nothing")
    r.set_defaults(func=_cmd_replay)

    a = sub.add_parser("apply", parents=[fmt], help="apply a base and replay outputs to a replica, in order",
                       description="Inputs: a shard-files directory (a base, first) and replay output directories, in "
                                   "batch order; a gap, an overlap or an input out of order is refused.")
    a.add_argument("inputs", nargs="+", metavar="INPUT", help="shard-files dir or replay output dir")
    a.add_argument("--out", metavar="REPLICA", help="replica file to write (default: --replica)")
    a.add_argument("--replica", metavar="PREV", help="continue this replica (inputs start where it ended)")
    a.add_argument("--dry-run", action="store_true", help="check the order only")
    a.set_defaults(func=_cmd_apply)

    v = sub.add_parser("verify", parents=[fmt], help="check every record, key, offset and meta value")
    v.add_argument("root", help="log root")
    v.set_defaults(func=_cmd_verify)

    c = sub.add_parser("vacuum", parents=[fmt], help="reclaim disk space (only while no process has the log open)")
    c.add_argument("root", help="log root")
    c.add_argument("--execute", action="store_true", help="compact (default: dry run, the same checks)")
    c.set_defaults(func=_cmd_vacuum)

    n = sub.add_parser("consolidate", parents=[fmt], help="fold a base and its increments into a new base (offline)",
                       description="Fold the newest complete base under ROOT and its complete increments into a new "
                                   "DCP base (base-<step>, at the last increment's step) that plain TorchRec loads "
                                   "with dcp.load; one chunk in memory at a time, no trainer, no process group. Run "
                                   "it while no trainer writes increments under ROOT.")
    n.add_argument("root", help="checkpoint root (the directory of the base-<step> directories)")
    n.add_argument("--out", default=None, help="write the new base under this root instead of ROOT")
    n.add_argument("--remove-older", action="store_true",
                   help="then list the bases (with their increments) older than the newest complete one(s)")
    n.add_argument("--keep", type=int, default=1, help="with --remove-older: complete bases to keep (default 1)")
    n.add_argument("--execute", action="store_true", help="with --remove-older: remove them (default: dry run)")
    n.set_defaults(func=_cmd_consolidate)

    u = sub.add_parser("upgrade", parents=[fmt], help="rewrite logs of an older format version in place",
                       description="Format 1 -> 2: every record re-checked and sealed with a checksum that covers "
                                   "its key; one transaction per rank. Stop the trainer first.")
    u.add_argument("root", help="log root")
    u.add_argument("--execute", action="store_true", help="apply (default: dry run)")
    u.set_defaults(func=_cmd_upgrade)
    return p


def main(argv: Optional[Sequence[str]] = None, stdout: Optional[TextIO] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error or damage, 2 usage).

    Run as the program (``argv`` None), a long-running command that SIGTERM/SIGINT stopped
    does not return: once it closed what it opened and its output is flushed, the process
    exits at once (:func:`.stopping.exit_now`), within a second of the signal.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        stdout: where results go (default ``sys.stdout``); errors always go to stderr.
    """
    code = _main(argv, stdout)
    if argv is None and stopped_by():
        exit_now(code)
    return code


def _main(argv: Optional[Sequence[str]], stdout: Optional[TextIO]) -> int:
    stream = stdout if stdout is not None else sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        if getattr(args, "func", None) is _cmd_offsets and not args.root and not args.server:
            parser.error("offsets needs ROOT (a log root) or --server URL --job NAME")
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return int(exc.code) if isinstance(exc.code, int) else 2
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(EscapingFormatter(f"{PROG}: %(levelname)s: %(message)s"))
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    func: Callable[[argparse.Namespace], Output] = args.func
    try:
        out = func(args)
    except CommandStoppedError as exc:  # SIGTERM/SIGINT while blocked: the stop was asked for
        msg = f"{PROG}: {printable(exc)}"
        bounded(lambda: print(msg, file=sys.stderr, flush=True))  # (stderr may be what it was blocked on)
        return 0
    except (PersistentDeltaError, OSError) as exc:
        print(f"{PROG}: error: {printable(exc)}", file=sys.stderr)
        return 1
    try:
        render(out, args.format, stream)
        stream.flush()
    except BrokenPipeError:  # `persistent-delta offsets ROOT | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
        return out.exit_code
    if out.exit_code:
        msg = out.notes[-1] if out.notes else "failed"
        msg = printable(msg)
        print(f"{PROG}: {msg}" if msg.startswith(f"{args.command}:") else f"{PROG}: {args.command}: {msg}",
              file=sys.stderr)
    return out.exit_code


def run_subcommand(command: str, argv: Optional[Sequence[str]] = None) -> int:
    """``main([command, *argv])`` with ``argv`` defaulting to ``sys.argv[1:]`` (tools/ scripts)."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])
