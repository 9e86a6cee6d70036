"""The GPU check: the tracker's CUDA path end to end, in one script (``make gpu-check``).

Owns: the checks that must pass on a GPU before the CUDA path is called supported, and their
CPU dry run (``--device cpu``: the same harness on gloo ranks, ``make gpu-check-dry``).

What the CUDA path adds to the CPU one, and which check runs it:

* pinned device-to-host copies (``trainer.capture``: each record is copied non-blocking into
  pinned host memory and the writer waits on a CUDA event before reading it): ``copies`` and
  ``streams`` inspect the writer's queue (pinned tensors and their events) and delay the copies
  behind a sleeping stream so that a writer reading before its event would store garbage;
  ``differential`` and ``sigkill_restart`` run the whole path;
* the fused optimizer states of fbgemm-gpu's CUDA TBEs (``momentum1_dev``; TorchRec's own
  tracker reads it, so on a GPU it runs MOMENTUM_LAST too): ``differential``, every mode;
* streams and events: ``streams`` trains and reads on a side stream;
* NCCL ranks: every rank check runs on an NCCL group, one rank per GPU (NCCL refuses two
  ranks on one device); one GPU gives one rank;
* publish on device tables (``trainer.publish`` gathers rows of the CUDA shards) and apply:
  ``publish_apply``;
* top-k and restore read device rows (``trainer/topk.py``, ``trainer/restore.py``):
  ``topk_restore``;
* the step benchmark on the device (``benchmarks/step_overhead.py --device cuda``):
  ``step_overhead``.

Checks (one ``PASS``/``FAIL`` line each, then one JSON summary line on stdout; exit 0 when all
pass, 1 when one fails, 2 when the CUDA stack is missing):

1. ``differential``: for each of the five tracking modes, our tracker and TorchRec's fed the
   same batches on identical models agree at every ``get_unique`` of two consumers reading at
   different rhythms, across a close and re-attach midway. The reference is TorchRec's tracker
   (for the optimizer-state modes with a per-table state capture, as ``tests/process``), and
   stock TorchRec too where it runs (on a GPU every state mode; on CPU not MOMENTUM_LAST,
   whose ``momentum1_dev`` is empty there), compared on the first table of each TBE group (it
   indexes the group's concatenated state with table-local ids).
2. ``streams``: EMBEDDING mode trained and read on a side stream whose copies are delayed; the
   writer's queue holds pinned tensors and events; rows agree with TorchRec's tracker.
3. ``publish_apply``: ``tracker.publish`` every other step, training after the last one;
   a ``DeltaConsumer`` on the snapshots channel + ``apply_poll`` into the initial tables equals
   the trainer's tables at the last publish, bit for bit.
4. ``topk_restore``: EMBEDDING mode; ``get_unique(top_percentage=0.5)`` keeps the rows that moved
   most (a brute force on CPU says which), and a restore from a model checkpoint older than the
   log end re-delivers the rows touched since with the restored device rows as states (on
   several NCCL ranks the restore agrees on a batch index with a collective).
5. ``sigkill_restart``: a trainer process (EMBEDDING mode) killed with SIGKILL twice and
   restarted: every record decodes, nothing a returned ``flush()`` covered is lost, offsets
   never move back, and the batch index continues.
6. ``step_overhead``: ``benchmarks.step_overhead`` runs on the device and reports its ratios
   (a run, not a target: the figures go to benchmarks/README.md).
7. ``copies``: the device-to-host copies alone: models sharded on CPU carry both trackers,
   lookups are made on the device by plain torch and handed to ``record_lookup``; runs where
   only torch has CUDA kernels (``--checks copies`` needs no ``fbgemm-gpu`` CUDA build). It
   passed on an H200 (docs/gpu-check.md).

Prerequisites for ``--device cuda`` (docs/gpu-check.md): an NVIDIA GPU; torch 2.13.0 built with
CUDA; ``fbgemm-gpu==1.8.0`` (the CUDA build) in place of ``fbgemm-gpu-cpu``; ``torchrec==1.8.0``
installed with ``--no-deps``; this package installed (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import pickle
import queue as queue_mod
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("ID_ONLY", "EMBEDDING", "MOMENTUM_LAST", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD")
STATE_MODES = ("MOMENTUM_LAST", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD")
CHECKS = ("differential", "streams", "publish_apply", "topk_restore", "sigkill_restart", "step_overhead", "copies")
RANK_CHECKS = ("differential", "streams", "publish_apply", "topk_restore")
# checks whose models stay on CPU (gloo, one rank): on a GPU they need torch's CUDA build only,
# not fbgemm-gpu's CUDA kernels, so they also run where only fbgemm-gpu-cpu is installed
HOST_MODEL_CHECKS = ("copies",)
EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
PREREQUISITES = """prerequisites for --device cuda (docs/gpu-check.md):
  - an NVIDIA GPU (one rank per GPU: NCCL refuses two ranks on one device)
  - torch==2.13.0 built with CUDA
  - fbgemm-gpu==1.8.0 (the CUDA build) instead of fbgemm-gpu-cpu: pip uninstall fbgemm-gpu-cpu
  - torchrec==1.8.0 installed with --no-deps
  - this package: pip install --no-deps -e .
--device cpu runs the same harness on gloo ranks (the dry run: make gpu-check-dry)."""


@dataclass(frozen=True)
class Sizes:
    """How big each check runs (``--quick``: the smallest that still checks something)."""

    tables: int
    rows: int
    dim: int
    batch: int
    pooling: int
    steps: int
    crash_flushes: int  # FLUSHED lines a trainer prints before it is killed
    bench: Tuple[str, ...]  # arguments of benchmarks.step_overhead


SIZES = {
    "cuda": Sizes(3, 20_000, 64, 512, 8, 12, 3, ("--modes", "ID_ONLY,EMBEDDING,ROWWISE_ADAGRAD", "--steps", "100",
                                                 "--warmup", "20")),
    "cpu": Sizes(2, 2_000, 16, 64, 4, 10, 2, ("--modes", "ID_ONLY,EMBEDDING", "--steps", "20", "--warmup", "4",
                                             "--rows", "20000", "--batch", "256")),
    "quick": Sizes(2, 500, 8, 16, 2, 6, 1, ("--modes", "EMBEDDING", "--steps", "10", "--warmup", "2",
                                           "--read-every", "5", "--rows", "5000", "--batch", "64")),
}


# ----------------------------------------------------------------------------- prerequisites


def missing_cuda_stack(tbe_kernels: bool = True) -> List[str]:
    """What the CUDA path needs and this environment lacks (empty: all there). ``tbe_kernels``
    False: only what :data:`HOST_MODEL_CHECKS` need (torch with CUDA, a GPU, torchrec)."""
    from importlib import metadata

    missing: List[str] = []
    try:
        import torch
    except ImportError as exc:
        return [f"torch does not import ({exc})"]
    if not torch.version.cuda:
        missing.append(f"torch {torch.__version__} is not a CUDA build (install torch==2.13.0 with CUDA)")
    elif not torch.cuda.is_available():
        missing.append("torch.cuda.is_available() is False: no GPU visible (driver, CUDA_VISIBLE_DEVICES?)")
    dists = {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions() if d.metadata["Name"]}
    if tbe_kernels and "fbgemm-gpu" not in dists:
        have = "fbgemm-gpu-cpu is" if "fbgemm-gpu-cpu" in dists else "no fbgemm-gpu is"
        missing.append(f"fbgemm-gpu==1.8.0 (the CUDA build) is not installed ({have})")
    try:
        import torchrec  # noqa: F401
    except ImportError as exc:
        missing.append(f"torchrec does not import ({exc}): pip install --no-deps torchrec==1.8.0")
    if not missing and tbe_kernels:
        try:
            import fbgemm_gpu  # noqa: F401

            torch.ops.fbgemm.asynchronous_complete_cumsum(torch.ones(2, dtype=torch.int64, device="cuda"))
        except Exception as exc:  # noqa: BLE001 - any failure of the probe means no CUDA kernels
            missing.append(f"fbgemm-gpu has no working CUDA kernels ({type(exc).__name__}: {exc})")
    return missing


# ----------------------------------------------------------------------------- device helpers


def _stream(device: str) -> Any:
    """A side stream's context on a GPU (the checks then train and read on it); nothing on CPU."""
    import torch

    if device != "cuda":
        return contextlib.nullcontext()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the models' weights and batches were made on the current one
    return torch.cuda.stream(side)


def _delay(device: str, cycles: int) -> None:
    """Hold the current stream ``cycles`` GPU cycles, so the copies queued next land late."""
    import torch

    if device == "cuda":
        torch.cuda._sleep(cycles)


def _workload(s: Sizes, sharding: str = "row_wise") -> Any:
    from benchmarks._model import Workload

    return Workload(num_tables=s.tables, rows=s.rows, dim=s.dim, batch=s.batch, pooling=s.pooling, zipf_s=1.05,
                    sharding=sharding)


def _check_init(dmp: Any, seed: int) -> None:
    """The seed's weights reached the TBEs (``split_embedding_weights`` returned views); else two
    models of one seed differ and every comparison would fail for the wrong reason."""
    import torch

    from benchmarks._model import _local_weights

    for i, (fqn, t) in enumerate(sorted(_local_weights(dmp).items())):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        want = torch.rand(t.shape, generator=g) * 0.02 - 0.01
        if not torch.equal(t.detach().cpu(), want):
            raise AssertionError(f"{fqn}: the seeded weights did not reach the TBE (split_embedding_weights copied?)")


def _model(w: Any, device: str, optimizer: str, seed: int = 0) -> Any:
    from benchmarks._model import build_dmp

    dmp = build_dmp(w, seed=seed, device=device, optimizer=optimizer)
    _check_init(dmp, seed)
    return dmp


def _cpu(t: Any) -> Any:
    return None if t is None else t.detach().cpu()


def _compare(ref: Dict[str, Any], got: Dict[str, Any], mode: str, tables: Optional[Dict[str, bool]], where: str) -> int:
    """``got`` (ours) equals ``ref`` (TorchRec's) on every table; states only on the tables
    ``tables`` marks (None: all). Returns the rows compared."""
    import torch

    if set(got) != set(ref):
        raise AssertionError(f"{where}: tables {sorted(got)} != TorchRec's {sorted(ref)}")
    n = 0
    for fqn, r in ref.items():
        rid, rst = _cpu(r.ids), _cpu(r.states)
        order = torch.argsort(rid)
        rid, rst = rid[order], None if rst is None else rst[order]
        gid, gst = _cpu(got[fqn].ids), _cpu(got[fqn].states)
        if not torch.equal(gid, rid):
            raise AssertionError(f"{where} {fqn}: ids differ ({gid.numel()} ours, {rid.numel()} TorchRec's)")
        if mode == "ID_ONLY":
            if gst is not None:
                raise AssertionError(f"{where} {fqn}: ID_ONLY returned states")
        elif tables is None or tables.get(fqn, False):
            if gst is None or rst is None:
                raise AssertionError(f"{where} {fqn}: states missing (ours {gst is not None}, TorchRec {rst is not None})")
            want = rst.float().view(gst.shape)
            # relative to the table's scale: states of optimizer modes are ~1e-6, an absolute
            # tolerance of that size would pass a sign flip
            if not torch.allclose(gst.float(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) if want.numel() else 0):
                worst = float((gst.float() - want).abs().max())
                raise AssertionError(f"{where} {fqn}: states differ (largest difference {worst:g})")
        n += rid.numel()
    return n


def _fixed_trec() -> type:
    """TorchRec's tracker with a per-table optimizer-state capture (its rules otherwise): stock
    TorchRec indexes a TBE group's concatenated state with table-local ids, right for the
    group's first table only. The reference for the optimizer-state modes."""
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec

    class FixedTrec(ModelDeltaTrackerTrec):
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

    return FixedTrec


# ----------------------------------------------------------------------------- rank checks


def differential(rank: int, world: int, device: str, root: str, s: Sizes) -> Dict[str, Any]:
    """Check 1 on this rank: every mode against TorchRec's tracker. Returns rows compared per
    mode (and per stock comparison). On one rank a failed mode does not stop the next ones (on
    several, a rank that stops mid-mode would leave the others in a collective)."""
    from benchmarks._model import make_batches

    w = _workload(s)
    batches = make_batches(w, s.steps + 1, seed=3, rank=rank, device=device)
    out: Dict[str, Any] = {}
    errors: Dict[str, str] = {}
    for mode_name in MODES:
        try:
            out.update(_differential_mode(device, root, w, batches, mode_name, s.steps // 2))
        except Exception:  # noqa: BLE001 - reported below, with the modes that passed
            if world > 1:
                raise
            errors[mode_name] = traceback.format_exc()
        gc.collect()
    if errors:
        raise AssertionError(f"failed modes {sorted(errors)} (passed: {out})\n" + "\n".join(
            f"--- {m} ---\n{tb}" for m, tb in errors.items()))
    return out


def _differential_mode(device: str, root: str, w: Any, batches: List[Any], mode_name: str,
                       rebuild_at: int) -> Dict[str, int]:
    """One mode of check 1: rows compared against the reference (and stock TorchRec)."""
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    from benchmarks._model import train_step
    from persistent_delta import PersistentTrackerConfig, attach

    consumers = ["a", "b"]
    mode = TrackingMode[mode_name]
    optimizer = "adagrad" if mode_name == "MOMENTUM_LAST" else "rowwise_adagrad"
    trec_cfg = DeltaTrackerConfig(tracking_mode=mode, consumers=consumers, delete_on_read=True)
    ref_dmp, dmp = _model(w, device, optimizer), _model(w, device, optimizer)
    if mode_name in STATE_MODES:
        ref = _fixed_trec()(ref_dmp._dmp_wrapped_module, consumers=consumers, delete_on_read=True, mode=mode)
        ref_dmp.model_trackers["DELTA_TRACKER"] = ref
    else:
        ref = ref_dmp.init_torchrec_delta_tracker(trec_cfg)
    stock_dmp = stock = None
    if mode_name in STATE_MODES and (device == "cuda" or mode_name != "MOMENTUM_LAST"):
        stock_dmp = _model(w, device, optimizer)
        stock = stock_dmp.init_torchrec_delta_tracker(trec_cfg)
    cfg = PersistentTrackerConfig(tracking_mode=mode, consumers=consumers, delete_on_read=True,
                                  path=os.path.join(root, f"differential-{mode_name}"))
    ours = attach(dmp, cfg)
    try:
        first = {fqn: t.index == 0 for fqn, t in ours.local_tables.items()}
        models = [m for m in (ref_dmp, dmp, stock_dmp) if m is not None]
        n = n_stock = 0

        def read(c: str, where: str) -> None:
            nonlocal n, n_stock
            got = ours.get_unique(c)
            n += _compare(ref.get_unique(c), got, mode_name, None, where)
            if stock is not None:
                n_stock += _compare(stock.get_unique(c), got, mode_name, first, where + " (stock TorchRec)")

        for step, batch in enumerate(batches[:-1]):
            if step == rebuild_at:
                ours.close()  # and re-attach: the batch index and offsets come back from the log
                ours = attach(dmp, cfg)
            for m in models:
                train_step(m, batch)
            if ours.curr_batch_idx != ref.curr_batch_idx:
                raise AssertionError(f"{mode_name} step {step}: batch index {ours.curr_batch_idx} != {ref.curr_batch_idx}")
            for i, c in enumerate(consumers):
                if (step + i) % (2 + i) == 1:
                    read(c, f"{mode_name} step {step} consumer {c}")
        for m in models:  # one more batch, so that every consumer has something (TorchRec raises otherwise)
            train_step(m, batches[-1])
        for c in consumers:
            read(c, f"{mode_name} end consumer {c}")
    finally:
        ours.close()
    if n == 0:
        raise AssertionError(f"{mode_name}: no row compared")
    return {mode_name: n, **({f"{mode_name} (stock)": n_stock} if stock is not None else {})}


def _queued_copies(tracker: Any) -> Tuple[int, int, int]:
    """(records, pinned host tensors, events) the tracker's writer holds queued (inspection only)."""
    ops = tracker._writer.queued() if tracker._writer is not None else []
    recs = [r for op in ops for r in getattr(op, "records", [])]
    tensors = [t for r in recs for t in (r.ids, r.states) if t is not None]
    return (len(recs), sum(bool(t.is_pinned()) for t in tensors if t.device.type == "cpu"),
            sum(len(getattr(op, "events", [])) for op in ops))


def _check_queued(queued: List[Tuple[int, int, int]], device: str, tensors_per_record: int, where: str) -> Dict[str, int]:
    """The inspections of :func:`_queued_copies` held steps, and on a GPU their tensors were
    pinned host copies with events (on CPU: the tensors themselves, no event)."""
    records = sum(q[0] for q in queued)
    pinned, events = sum(q[1] for q in queued), sum(q[2] for q in queued)
    if records == 0:
        raise AssertionError(f"{where}: the writer's queue held no step: the linger did not hold them (nothing inspected)")
    if device == "cuda" and (pinned != tensors_per_record * records or events == 0):
        raise AssertionError(f"{where}: {records} queued records: {pinned} pinned tensors "
                             f"(want {tensors_per_record * records}), {events} events")
    if device != "cuda" and events:
        raise AssertionError(f"{where}: CPU records carried {events} device events")
    return {"queued_records": records, "pinned_tensors": pinned, "events": events}


def streams(rank: int, world: int, device: str, root: str, s: Sizes, delay_cycles: int) -> Dict[str, Any]:
    """Check 2 on this rank: EMBEDDING mode trained and read on a side stream, each step's
    copies delayed behind a sleep on it. While steps wait in the writer's queue (a long linger)
    their tensors must be pinned host copies with one event each (CPU: the tensors themselves,
    no event); every read must equal TorchRec's tracker's."""
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    from benchmarks._model import make_batches, train_step
    from persistent_delta import PersistentTrackerConfig, attach

    w = _workload(s)
    batches = make_batches(w, s.steps, seed=11, rank=rank, device=device)
    ref_dmp, dmp = _model(w, device, "rowwise_adagrad"), _model(w, device, "rowwise_adagrad")
    ref = ref_dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.EMBEDDING,
                                                                 consumers=["c"], delete_on_read=True))
    ours = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, consumers=["c"],
                                               path=os.path.join(root, "streams"), linger_steps=1000, linger_s=600.0))
    queued: List[Tuple[int, int, int]] = []  # (records, pinned tensors, events) of what the writer held
    n = 0
    capture_lookup = ours._capture.lookup

    def delayed_lookup(*args: Any) -> None:
        """The stream sleeps right before each lookup's copies are queued: the forward's own host
        syncs (the KJT's lengths, the input dist) come before it, so the copies land late unless
        a later sync in the step waits the sleep out."""
        _delay(device, delay_cycles)
        capture_lookup(*args)

    ours._capture.lookup = delayed_lookup  # type: ignore[method-assign]  (the check's instrument)
    with _stream(device):
        for step, batch in enumerate(batches):
            train_step(ref_dmp, batch)
            train_step(dmp, batch)
            if step % 3 == 2:
                queued.append(_queued_copies(ours))
                got = ours.get_unique("c")  # first: TorchRec's read waits for the stream
                n += _compare(ref.get_unique("c"), got, "EMBEDDING", None, f"streams step {step}")
    ours.close()
    return {"rows": n, **_check_queued(queued, device, 2, "streams")}


def copies(rank: int, world: int, device: str, root: str, s: Sizes, delay_cycles: int) -> Dict[str, Any]:
    """Check 7 on this rank: the device-to-host copies with lookups made on the device by plain
    torch, so that it runs where only torch has CUDA kernels (fbgemm-gpu-cpu's TBEs on CPU).

    Two CPU-sharded models carry the trackers (TorchRec's and ours, identical tables); each step
    a side stream sleeps, then an ``nn.Embedding`` on the device (one per table, the DMP's
    initial weights, updated in place after every lookup) looks up the batch's ids, and both
    trackers' ``record_lookup`` get the device KJT and rows, as TorchRec's post-lookup hook
    hands them on a GPU. Ours copies them non-blocking into pinned host memory and the writer
    waits on each step's event; every ``get_unique`` (ID_ONLY and EMBEDDING) must equal
    TorchRec's tracker's, which keeps the device tensors. On CPU (the dry run) the same runs
    with host tensors: no copy, no event."""
    import torch
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from benchmarks._model import _local_weights, make_batches
    from persistent_delta import PersistentTrackerConfig, attach

    w = _workload(s)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    batches = make_batches(w, s.steps, seed=17, rank=rank, device=device)
    out: Dict[str, Any] = {}
    for mode_name in ("ID_ONLY", "EMBEDDING"):
        mode = TrackingMode[mode_name]
        ref_dmp, dmp = _model(w, "cpu", "rowwise_adagrad"), _model(w, "cpu", "rowwise_adagrad")
        features = dmp._bench_features
        tables = [_local_weights(dmp)[k] for k in sorted(_local_weights(dmp))]
        if world > 1 or any(t.shape[0] != w.rows for t in tables):
            raise AssertionError("copies runs on one rank (its lookups use global ids as the shard's local ids)")
        embs = [torch.nn.Embedding.from_pretrained(t.detach().clone(), freeze=True).to(dev) for t in tables]
        ref = ref_dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=mode, consumers=["c"],
                                                                     delete_on_read=True))
        ours = attach(dmp, PersistentTrackerConfig(tracking_mode=mode, consumers=["c"], linger_steps=1000,
                                                   linger_s=600.0, path=os.path.join(root, f"copies-{mode_name}")))
        queued: List[Tuple[int, int, int]] = []
        n = 0
        hook_s = [0.0, 0.0]  # the training thread's time in record_lookup: TorchRec's, ours
        warm = min(3, len(batches) // 2)
        with _stream(device):
            for step, b in enumerate(batches):
                ref.step()
                ours.step()
                # the KJT's lengths are read on the host (a sync) before the sleep: nothing after
                # it waits for the stream until ours reads, so its copies land late
                kjt = KeyedJaggedTensor.from_lengths_sync(keys=features, values=b.values, lengths=b.lengths)
                per = kjt.values().split(kjt.length_per_key())
                _delay(device, delay_cycles)  # the lookup, and the copies after it, run late
                rows = torch.cat([e(ids) for e, ids in zip(embs, per)])
                t0 = time.perf_counter()
                ref.record_lookup(kjt, rows)
                t1 = time.perf_counter()
                ours.record_lookup(kjt, rows)
                if step >= warm:  # the first steps allocate (pinned blocks, the writer's buffers)
                    hook_s[0] += t1 - t0
                    hook_s[1] += time.perf_counter() - t1
                with torch.no_grad():  # the tables move on: a late or early read would see other rows
                    for e, ids in zip(embs, per):
                        e.weight.index_add_(0, ids, torch.full((ids.numel(), w.dim), 1e-3, device=dev))
                del rows
                if step % 3 == 2:
                    queued.append(_queued_copies(ours))
                    got = ours.get_unique("c")  # first: TorchRec's read waits for the stream
                    n += _compare(ref.get_unique("c"), got, mode_name, None, f"copies {mode_name} step {step}")
        ours.close()
        if n == 0:
            raise AssertionError(f"copies {mode_name}: no row compared")
        out[mode_name] = {"rows": n, **_check_queued(queued, device, 1 if mode_name == "ID_ONLY" else 2,
                                                     f"copies {mode_name}"),
                          "record_lookup_us": {"torchrec": round(hook_s[0] / (len(batches) - warm) * 1e6, 1),
                                               "persistent": round(hook_s[1] / (len(batches) - warm) * 1e6, 1)},
                          "bytes_per_step": int(sum(b.values.numel() for b in batches) / len(batches)
                                                * (batches[0].values.element_size()
                                                   + (embs[0].weight.element_size() * w.dim if mode_name == "EMBEDDING" else 0)))}
        del ref, ours, ref_dmp, dmp
        gc.collect()
    return out


def publish_apply(rank: int, world: int, device: str, root: str, s: Sizes) -> Dict[str, Any]:
    """Check 3, the trainer's half on this rank: publish every other step (ID_ONLY, consumer
    ``serving``), train two more steps; returns this rank's shards at attach and at the last
    publish (on CPU) with their placement."""
    from torchrec.distributed.model_tracker.types import TrackingMode

    from benchmarks._model import make_batches, train_step
    from persistent_delta import PersistentTrackerConfig, attach

    w = _workload(s)
    dmp = _model(w, device, "rowwise_adagrad")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"],
                                            path=os.path.join(root, "publish")))

    def shards() -> Dict[str, Any]:
        return {fqn: lt.weights().detach().cpu().clone() for fqn, lt in t.local_tables.items()}

    place = {fqn: (lt.row_offset, lt.col_offset, lt.global_rows, lt.global_cols) for fqn, lt in t.local_tables.items()}
    initial, last, publishes = shards(), None, 0
    for i, batch in enumerate(make_batches(w, s.steps + 2, seed=5, rank=rank, device=device)):
        train_step(dmp, batch)
        if i < s.steps and i % 2 == 1:
            t.publish("serving")
            last, publishes = shards(), publishes + 1
    changed = any(not bool((v.cpu() == last[f]).all()) for f, v in shards().items()) if last else False
    t.close()
    return {"initial": initial, "last": last, "place": place, "publishes": publishes, "changed_after": changed}


def topk_restore(rank: int, world: int, device: str, root: str, s: Sizes) -> Dict[str, Any]:
    """Check 4 on this rank, EMBEDDING mode: ``get_unique(top_percentage=0.5)`` keeps the rows
    whose device row moved most from its tracked first value (a brute force on CPU says which);
    then a restore from a model checkpoint older than the log end re-delivers the rows touched
    since, with the restored device rows as states (``trainer/topk.py``, ``trainer/restore.py``)."""
    import io
    import math

    import torch
    from torchrec.distributed.model_tracker.types import TrackingMode

    from benchmarks._model import make_batches, train_step
    from persistent_delta import PersistentTrackerConfig, attach

    w = _workload(s)
    dmp = _model(w, device, "rowwise_adagrad")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, consumers=["all", "top", "c"],
                                            path=os.path.join(root, "topk-restore")))
    batches = make_batches(w, s.steps, seed=13, rank=rank, device=device)
    half = s.steps // 2
    for b in batches[:half]:
        train_step(dmp, b)
    kept, topk_error = 0, None
    try:  # (on one rank a top-k failure does not hide the restore's result)
        full, top = t.get_unique("all"), t.get_unique("top", top_percentage=0.5)
        for fqn, r in full.items():
            current = t.local_tables[fqn].weights().detach().cpu()[r.ids.long()]
            score = (current.float() - r.states.float().view(current.shape)).norm(dim=1)
            chosen = torch.isin(r.ids, _cpu(top[fqn].ids))
            if int(chosen.sum()) != max(1, math.ceil(0.5 * r.ids.numel())) or not torch.equal(
                    _cpu(top[fqn].states), r.states[chosen]):
                raise AssertionError(f"top-k {fqn}: kept {int(chosen.sum())} of {r.ids.numel()} rows, or other states")
            if chosen.all() or score[chosen].min() < score[~chosen].max():
                raise AssertionError(f"top-k {fqn}: a row left out moved more than a row kept")
            kept += int(chosen.sum())
    except Exception:  # noqa: BLE001 - raised after the restore half ran
        if world > 1:
            raise
        topk_error = traceback.format_exc()
    t.get_unique("c")
    ckpt = io.BytesIO()
    torch.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, ckpt)
    state = t.state_dict()
    for b in batches[half:]:
        train_step(dmp, b)
    t.get_unique("c")  # c read the steps the restore takes back
    ckpt.seek(0)
    saved = torch.load(ckpt, weights_only=False)
    dmp.load_state_dict(saved["model"])
    dmp.fused_optimizer.load_state_dict(saved["optim"])
    redelivered = t.load_state_dict(state)
    if not redelivered or not all(redelivered.values()):
        raise AssertionError(f"the restore re-delivered {redelivered}")
    got = t.get_unique("c")
    for fqn, r in got.items():
        want = t.local_tables[fqn].weights().detach().cpu()[_cpu(r.ids).long()]
        if _cpu(r.ids).numel() != redelivered.get(fqn, 0) or not torch.equal(_cpu(r.states).view(want.shape), want):
            raise AssertionError(f"restore {fqn}: {_cpu(r.ids).numel()} rows back (re-delivered {redelivered.get(fqn)}), "
                                 "or their states are not the restored rows")
    t.close()
    if topk_error is not None:
        raise AssertionError(f"top-k failed (the restore passed: re-delivered {redelivered})\n{topk_error}")
    return {"topk_rows_kept": kept, "redelivered": redelivered}


def _rank_entry(rank: int, world: int, device: str, port: int, root: str, s: Sizes, checks: List[str],
                delay_cycles: int, results: Any, backend: str) -> None:
    """One rank: join the group (``backend``: NCCL on its own GPU, or gloo), run the rank checks,
    put each result on ``results`` as soon as it is known (a later hang keeps the earlier ones)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # fbgemm's CPU row-wise Adagrad slows down on denormals
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    runs: Dict[str, Callable[[], Any]] = {
        "differential": lambda: differential(rank, world, device, root, s),
        "streams": lambda: streams(rank, world, device, root, s, delay_cycles),
        "publish_apply": lambda: publish_apply(rank, world, device, root, s),
        "topk_restore": lambda: topk_restore(rank, world, device, root, s),
        "copies": lambda: copies(rank, world, device, root, s, delay_cycles),
    }
    try:
        for name in checks:
            t0 = time.monotonic()
            try:
                payload = pickle.dumps(runs[name]())
                results.put((rank, name, True, time.monotonic() - t0, payload))
            except Exception as exc:  # noqa: BLE001 - reported as the check's failure
                results.put((rank, name, False, time.monotonic() - t0, _failure(exc)))
                if world > 1:
                    # the other ranks may wait in a collective this rank will never join: stop
                    # here; the driver ends them and reports the checks left as not run
                    results.close()
                    results.join_thread()
                    os._exit(EXIT_FAILED)
    finally:
        dist.destroy_process_group()
        gc.collect()  # the group's threads joined while the interpreter is whole (tests/support/harness.py)


def run_ranks(device: str, world: int, root: str, s: Sizes, checks: List[str], delay_cycles: int,
              timeout: float, backend: Optional[str] = None) -> Dict[str, List[Tuple[bool, float, Any]]]:
    """Spawn ``world`` ranks running ``checks`` in a ``backend`` group (default: NCCL on a GPU,
    gloo on CPU); returns check -> per-rank (ok, seconds, result or traceback). A rank still
    running after ``timeout`` seconds is killed; checks it had not reported fail with that."""
    import multiprocessing as mp

    from persistent_delta.testing import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    procs = [ctx.Process(target=_rank_entry,
                         args=(r, world, device, port, root, s, checks, delay_cycles, results, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    out: Dict[str, List[Tuple[bool, float, Any]]] = {c: [(False, 0.0, "not reported")] * world for c in checks}
    got, deadline = 0, time.monotonic() + timeout
    while got < world * len(checks):
        try:
            rank, name, ok, secs, payload = results.get(timeout=1.0)
        except queue_mod.Empty:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if time.monotonic() > deadline or failed or all(not p.is_alive() for p in procs):
                why = (f"timed out after {timeout:.0f}s" if time.monotonic() > deadline
                       else f"rank {failed[0]} stopped after a failure" if failed else "a rank exited")
                for c in checks:
                    out[c] = [x if x[2] != "not reported" else (False, 0.0, f"not reported ({why})") for x in out[c]]
                break
            continue
        out[name][rank] = (ok, secs, pickle.loads(payload) if ok else payload)
        got += 1
    for p in procs:
        p.join(30 if got == world * len(checks) else 0.1)
        if p.is_alive():
            p.kill()
            p.join(5)
    return out


def apply_published(root: str, per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Check 3, the replica's half: poll the snapshots channel and apply it into the initial
    tables; must equal the tables at the last publish, bit for bit."""
    import torch

    from persistent_delta import DeltaConsumer, apply_poll

    def assemble(key: str) -> Dict[str, Any]:
        tables: Dict[str, Any] = {}
        for res in per_rank:
            for fqn, w in res[key].items():
                r0, c0, rows, cols = res["place"][fqn]
                table = tables.setdefault(fqn, torch.full((rows, cols), float("nan"), dtype=w.dtype))
                table[r0:r0 + w.shape[0], c0:c0 + w.shape[1]] = w
        return tables

    if any(res["last"] is None or res["publishes"] == 0 for res in per_rank):
        raise AssertionError("a rank published nothing")
    if not any(res["changed_after"] for res in per_rank):
        raise AssertionError("training after the last publish changed nothing: the check would prove nothing")
    replica, want = assemble("initial"), assemble("last")
    with DeltaConsumer(os.path.join(root, "publish"), "replica", channel="snapshots") as consumer:
        poll = consumer.poll()
        if not poll.complete:
            raise AssertionError(f"the poll is not complete: {poll.ranges}")
        applied = apply_poll(replica, poll, complete_only=True)
        consumer.commit()
    bad = {fqn: int((replica[fqn] != want[fqn]).any(1).sum()) for fqn in want}
    if any(bad.values()):
        raise AssertionError(f"rows that differ from the trainer's at the last publish: {bad}")
    return {"rows_applied": applied.rows, "publishes": len(applied.publishes), "tables": len(want)}


# ----------------------------------------------------------------------------- sigkill / restart


def crash_trainer(root: str, steps: int, device: str, size: str) -> int:
    """The trainer the SIGKILL check kills: one rank (NCCL on GPU 0, or gloo), EMBEDDING mode,
    consumers ``a`` (reads every 3 steps) and ``b`` (never reads: retention keeps every batch).
    It feeds batch ``(batch_idx - 1) % 50`` at ``batch_idx``, so a restarted trainer feeds the same
    data; every 4 steps it flushes and prints ``FLUSHED <curr_batch_idx> <offset of a>``."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_tracker.types import TrackingMode

    from benchmarks._common import init_single_rank_pg
    from benchmarks._model import make_batches, train_step
    from persistent_delta import PersistentTrackerConfig, attach

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.set_flush_denormal(True)
    init_single_rank_pg("nccl" if device == "cuda" else "gloo")
    w = _workload(SIZES[size])
    dmp = _model(w, device, "rowwise_adagrad")
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, consumers=["a", "b"], path=root))
    print("START", tracker.curr_batch_idx, flush=True)
    batches = make_batches(w, 50, seed=7, device=device)
    for step in range(steps):
        train_step(dmp, batches[tracker.curr_batch_idx % 50])
        if step % 3 == 2:
            tracker.get_unique("a")
        if step % 4 == 3:
            tracker.flush()
            print("FLUSHED", tracker.curr_batch_idx, tracker.per_consumer_batch_idx["a"], flush=True)
    tracker.close()
    print("DONE", flush=True)
    dist.destroy_process_group()
    return 0


def _start_trainer(root: str, steps: int, device: str, size: str) -> "subprocess.Popen[str]":
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check", "--role", "trainer", "--device", device,
                             "--trainer-root", root, "--trainer-steps", str(steps), "--trainer-size", size],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _expected_ids(s: Sizes, batch_idx: int, cache: Dict[int, Any]) -> Dict[str, Any]:
    """fqn -> ids the crash trainer looks up at ``batch_idx`` (computed here, on CPU)."""
    import torch

    from benchmarks._model import make_batches

    if not cache:
        cache.update(enumerate(make_batches(_workload(s), 50, seed=7)))
    b = cache[(batch_idx - 1) % 50]
    per = s.batch * s.pooling
    return {f"sparse.embeddings.t{t}": torch.unique(b.values[t * per:(t + 1) * per]) for t in range(s.tables)}


def _read_log(rank_dir: str) -> Tuple[Dict[int, Dict[str, List[Any]]], Dict[str, int], int]:
    """(batch -> fqn -> ids of each record; consumer -> offset; log end), decoding every record."""
    from persistent_delta.log import position_rules
    from persistent_delta.log.deltalog import DeltaLog

    with DeltaLog(rank_dir, readonly=True) as log:
        def read(r: Any) -> Any:
            batches: Dict[int, Dict[str, List[Any]]] = {}
            for fqn, e in r.tables().items():
                for rec in r.iter_records(e.table_id):  # decodes every record, checks its crc32c
                    batches.setdefault(rec.batch_idx, {}).setdefault(fqn, []).append(rec.ids.clone())
            return batches, {k: v.offset for k, v in r.consumers().items()}, position_rules.lookups_end(r)
        out: Tuple[Dict[int, Dict[str, List[Any]]], Dict[str, int], int] = log.read(read)
        return out


def sigkill_restart(device: str, root: str, s: Sizes, size: str, kills: int = 2, timeout: float = 240.0) -> Dict[str, Any]:
    """Check 5: kill the trainer with SIGKILL ``kills`` times, each after ``s.crash_flushes``
    flushes and mid-step; after each kill everything a returned flush covered is in the log and
    the offsets did not move back; a clean restart continues the batch index and completes."""
    import torch

    log_root, cache = os.path.join(root, "crash"), {}  # type: ignore[var-annotated]
    offsets: Dict[str, int] = {}
    last_start, last_flushed, trials = -1, 0, []
    trained: List[Tuple[int, int]] = []  # [first, last] batch indices a trainer ran and flushed
    deadline = time.monotonic() + timeout
    for trial in range(kills):
        proc = _start_trainer(log_root, 100_000, device, size)
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        if not first.startswith("START"):
            proc.kill()
            raise AssertionError(f"trial {trial}: the trainer did not start: {first!r}\n{proc.stderr.read()[-3000:]}")
        start = int(first.split()[1])
        if start < max(last_start, last_flushed):
            raise AssertionError(f"trial {trial}: restarted at batch {start}, before {max(last_start, last_flushed)}")
        flushed: List[Tuple[int, int]] = []
        while len(flushed) < s.crash_flushes and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("FLUSHED"):
                flushed.append((int(line.split()[1]), int(line.split()[2])))
        time.sleep(0.05 * (trial + 1))  # (the kill lands mid-step, with steps in the writer's queue)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.returncode != -signal.SIGKILL or not flushed:
            raise AssertionError(f"trial {trial}: the trainer ended with {proc.returncode} after {len(flushed)} flushes:"
                                 f"\n{proc.stderr.read()[-3000:]}")
        proc.stdout.close()
        proc.stderr.close()
        batches, now, end = _read_log(os.path.join(log_root, "rank-0"))
        for name, off in now.items():
            if off < offsets.get(name, 0) or off > end + 1:
                raise AssertionError(f"trial {trial}: consumer {name} at {off} (was {offsets.get(name, 0)}, log end {end})")
        curr, off_a = flushed[-1]
        trained.append((start + 1, curr))  # (a restart may skip indices: they are never reused)
        if now.get("a", 0) < off_a or end < curr:
            raise AssertionError(f"trial {trial}: flushed batch {curr} / offset {off_a}, the log has {end} / {now}")
        for fqn in _expected_ids(s, 1, cache):
            # every id of a flushed batch is there (records may be compacted, and the window filter
            # stores a row once per window: compare sets), and no id that no batch up to curr fed
            got = torch.unique(torch.cat([ids.long() for b, per in batches.items() if b <= curr
                                          for ids in per.get(fqn, [])] or [torch.empty(0, dtype=torch.long)]))
            want = torch.unique(torch.cat([_expected_ids(s, b, cache)[fqn] for lo, hi in trained
                                           for b in range(lo, hi + 1)]))
            fed = torch.unique(torch.cat([_expected_ids(s, b, cache)[fqn] for b in range(1, curr + 1)]))
            lost, foreign = want[~torch.isin(want, got)], got[~torch.isin(got, fed)]
            if lost.numel() or foreign.numel():
                raise AssertionError(f"trial {trial}: {fqn}: {lost.numel()} ids of flushed batches lost, "
                                     f"{foreign.numel()} ids no batch up to {curr} fed")
        offsets, last_start, last_flushed = now, start, curr
        trials.append({"start": start, "flushed": curr, "log_end": end})
    proc = _start_trainer(log_root, 8, device, size)
    out, err = proc.communicate(timeout=max(30.0, deadline - time.monotonic()))
    first_line = out.splitlines()[0] if out else ""
    if proc.returncode != 0 or "DONE" not in out or not first_line.startswith("START"):
        raise AssertionError(f"the clean restart failed ({proc.returncode}):\n{err[-3000:]}")
    resumed = int(first_line.split()[1])
    if resumed < max(last_start, last_flushed):
        raise AssertionError(f"the clean restart resumed at batch {resumed}, before {max(last_start, last_flushed)}")
    return {"trials": trials, "resumed": resumed}


# ----------------------------------------------------------------------------- step overhead


def step_overhead(device: str, s: Sizes, timeout: float) -> Dict[str, Any]:
    """Check 6: ``benchmarks.step_overhead`` on the device; passes when it ran every mode and
    reported a finite mean step for each model (its ratios are reported, not judged)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.step_overhead", "--device", device, "--wait-quiet", "0", *s.bench]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    modes = s.bench[s.bench.index("--modes") + 1].split(",")
    if sorted(r["mode"] for r in rows) != sorted(modes):
        raise AssertionError(f"expected one result per mode {modes}, got {[r.get('mode') for r in rows]}")
    out: Dict[str, Any] = {}
    for r in rows:
        means = r["mean_ms"]
        if r.get("device", "cpu") != device or not all(0 < float(v) < float("inf") for v in means.values()):
            raise AssertionError(f"{r['mode']}: device {r.get('device')}, mean_ms {means}")
        out[r["mode"]] = {"mean_ms": means, "ratios_by_mean": r["ratios_by_mean"]}
    return out


# ----------------------------------------------------------------------------- driver


@dataclass
class Result:
    name: str
    ok: bool
    seconds: float
    detail: Any


def _failure(exc: BaseException) -> str:
    """What failed (the exception's message) first, then where (its traceback)."""
    return f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"


def _timed(name: str, fn: Callable[[], Any]) -> Result:
    t0 = time.monotonic()
    try:
        detail = fn()
        return Result(name, True, time.monotonic() - t0, detail)
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure
        return Result(name, False, time.monotonic() - t0, _failure(exc))


def _environment(device: str, world: int, backend: str) -> Dict[str, Any]:
    from importlib import metadata

    import torch

    def version(name: str) -> Optional[str]:
        for spelling in (name, name.replace("-", "_"), name.replace("-", "_", 1)):
            try:
                return metadata.version(spelling)
            except metadata.PackageNotFoundError:
                continue
        return None

    env: Dict[str, Any] = {"device": device, "world_size": world, "backend": backend,
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "fbgemm_gpu": version("fbgemm-gpu"), "fbgemm_gpu_cpu": version("fbgemm-gpu-cpu"),
                           "torchrec": version("torchrec")}
    if device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def run(args: argparse.Namespace) -> int:
    """Run the selected checks; print PASS/FAIL lines and the JSON summary; the exit code."""
    t_start = time.monotonic()
    checks = [c.strip() for c in args.checks.split(",")] if args.checks else list(CHECKS)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown checks {unknown}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return EXIT_REFUSED
    if args.device == "cuda":
        missing = missing_cuda_stack(tbe_kernels=not set(checks) <= set(HOST_MODEL_CHECKS))
        if missing:
            print("gpu_check: refused: the CUDA path needs what this environment lacks:", file=sys.stderr)
            for m in missing:
                print(f"  - {m}", file=sys.stderr)
            print(PREREQUISITES, file=sys.stderr)
            return EXIT_REFUSED
    import torch

    size = "quick" if args.quick else args.device
    s = SIZES[size]
    if args.steps:
        import dataclasses

        s = dataclasses.replace(s, steps=args.steps)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    world = args.ranks or (min(gpus, 8) if args.device == "cuda" else (1 if args.quick else 2))
    if args.device == "cuda" and world > gpus:
        print(f"gpu_check: refused: --ranks {world} needs {world} GPUs (one rank per GPU: NCCL refuses two ranks on "
              f"one device); {gpus} visible", file=sys.stderr)
        return EXIT_REFUSED
    root = tempfile.mkdtemp(prefix="pd-gpu-check-", dir=args.workdir)
    results: List[Result] = []

    def report(r: Result) -> None:
        """One line per check as soon as it is known (its failure's message, then where)."""
        results.append(r)
        head = f"{'PASS' if r.ok else 'FAIL'} {r.name} ({r.seconds:.1f}s)"
        lines = str(r.detail).splitlines()
        shown = lines if len(lines) <= 30 else lines[:5] + ["..."] + lines[-24:]
        print(head if r.ok else head + "\n" + "\n".join("    " + ln for ln in shown), flush=True)

    rank_checks = [c for c in checks if c in RANK_CHECKS]
    if rank_checks:
        t0 = time.monotonic()
        per = run_ranks(args.device, world, root, s, rank_checks, args.delay_cycles, args.rank_timeout)
        for name in rank_checks:
            ok = all(r[0] for r in per[name])
            detail: Any = "\n".join(f"--- rank {i} ---\n{r[2]}" for i, r in enumerate(per[name]) if not r[0])
            secs = max(r[1] for r in per[name]) if ok else time.monotonic() - t0
            if ok and name == "publish_apply":
                applied = _timed(name, lambda: apply_published(root, [r[2] for r in per[name]]))
                applied.seconds += secs
                report(applied)
                continue
            if ok and name == "differential":
                detail = {"ranks": world, "rows_compared": {m: sum(r[2][m] for r in per[name]) for m in per[name][0][2]}}
            elif ok and name in ("streams", "topk_restore"):
                detail = per[name][0][2]
            report(Result(name, ok, secs, detail))
    if "copies" in checks:  # one rank in a gloo group: its models are on CPU, its lookups on the device
        per = run_ranks(args.device, 1, root, s, ["copies"], args.delay_cycles, args.rank_timeout, backend="gloo")
        ok, secs, detail = per["copies"][0]
        report(Result("copies", ok, secs, detail))
    if "sigkill_restart" in checks:
        report(_timed("sigkill_restart", lambda: sigkill_restart(args.device, root, s, size)))
    if "step_overhead" in checks:
        report(_timed("step_overhead", lambda: step_overhead(args.device, s, args.bench_timeout)))
    ok = all(r.ok for r in results)
    backend = "nccl" if args.device == "cuda" and rank_checks else "gloo"  # copies alone: one gloo rank
    summary = {"ok": ok, **_environment(args.device, world if rank_checks else 1, backend), "size": size,
               "steps": s.steps, "wall_s": round(time.monotonic() - t_start, 1),
               "workdir": root if args.keep else None,
               "checks": [asdict(r) if r.ok else {**asdict(r), "detail": str(r.detail)[:4000]} for r in results]}
    print(json.dumps(summary, default=str), flush=True)
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return EXIT_OK if ok else EXIT_FAILED


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The GPU check: the tracker's CUDA path (pinned device-to-host copies, the fused optimizer "
                    "states of fbgemm-gpu's CUDA TBEs, streams and events, NCCL ranks) against TorchRec's tracker, "
                    "a SIGKILL/restart, a publish/apply round trip and the step benchmark. One PASS/FAIL line per "
                    "check, then a JSON summary; exit 0 all passed, 1 a check failed, 2 refused (no CUDA stack).",
        epilog=PREREQUISITES)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (default): the real check; cpu: the dry run of the same harness on gloo ranks")
    ap.add_argument("--quick", action="store_true", help="the smallest sizes (the dry run's test uses it)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks of the rank checks (default: one per visible GPU, at most 8; cpu: 2, --quick: 1)")
    ap.add_argument("--checks", default=None, help=f"comma-separated subset of: {', '.join(CHECKS)} (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="training steps of each rank check (default: the size's)")
    ap.add_argument("--delay-cycles", type=int, default=50_000_000,
                    help="GPU cycles each step's copies are held back in the streams and copies checks "
                         "(torch.cuda._sleep)")
    ap.add_argument("--rank-timeout", type=float, default=360.0, help="seconds for the rank checks together")
    ap.add_argument("--bench-timeout", type=float, default=240.0, help="seconds for the step benchmark")
    ap.add_argument("--workdir", default=None, help="where the logs go (default: the temp dir); removed after")
    ap.add_argument("--keep", action="store_true", help="keep the logs (the summary's workdir says where)")
    # the SIGKILL check's trainer process (internal)
    ap.add_argument("--role", choices=["check", "trainer"], default="check", help=argparse.SUPPRESS)
    ap.add_argument("--trainer-root", help=argparse.SUPPRESS)
    ap.add_argument("--trainer-steps", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--trainer-size", default="cpu", help=argparse.SUPPRESS)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    import warnings

    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    if args.role == "trainer":
        return crash_trainer(args.trainer_root, args.trainer_steps, args.device, args.trainer_size)
    return run(args)


if __name__ == "__main__":
    # through the imported module, so spawned ranks unpickle its functions by their real name
    from benchmarks import gpu_check

    raise SystemExit(gpu_check.main())
