"""The GPU check's harness (``benchmarks/gpu_check.py``): its CPU dry run passes every check, and
without the CUDA stack the real run refuses with exit code 2 and says what is missing."""

import json
import os
import subprocess
import sys

import pytest
import torch

from procs import REPO


def _gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_the_dry_run_passes_every_check(tmp_path):
    """The quickest CPU dry run: each check passes and compared something (every tracking mode
    against TorchRec's tracker, stock TorchRec too where it runs on CPU). It is also the GPU
    check's smoke run (tests/process/test_bench_smoke.py): not marked slow."""
    proc = _gpu_check("--device", "cpu", "--quick", "--workdir", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    summary = json.loads(lines[-1])
    checks = {c["name"]: c for c in summary["checks"]}
    assert summary["ok"] and summary["device"] == "cpu" and summary["backend"] == "gloo"
    assert set(checks) == {"differential", "streams", "publish_apply", "topk_restore", "sigkill_restart",
                           "step_overhead", "copies"}
    assert [ln.split()[0] for ln in lines[:-1] if ln.split()[:1] in (["PASS"], ["FAIL"])] == ["PASS"] * len(checks)
    rows = checks["differential"]["detail"]["rows_compared"]
    assert all(rows[m] > 0 for m in ("ID_ONLY", "EMBEDDING", "MOMENTUM_LAST", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD"))
    assert rows["MOMENTUM_DIFF (stock)"] > 0 and rows["ROWWISE_ADAGRAD (stock)"] > 0
    streams = checks["streams"]["detail"]
    assert streams["rows"] > 0 and streams["queued_records"] > 0 and streams["events"] == 0  # CPU: no copies
    assert checks["publish_apply"]["detail"]["rows_applied"] > 0
    for mode in ("ID_ONLY", "EMBEDDING"):  # CPU lookups: kept as they are, no pinned copy, no event
        copies = checks["copies"]["detail"][mode]
        assert copies["rows"] > 0 and copies["queued_records"] > 0 and copies["events"] == 0, copies
    assert all(n > 0 for n in checks["topk_restore"]["detail"]["redelivered"].values())
    assert len(checks["sigkill_restart"]["detail"]["trials"]) == 2
    assert checks["step_overhead"]["detail"]
    assert not os.listdir(tmp_path), "the logs must be removed after the run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the CUDA path: nothing to refuse")
def test_without_the_cuda_stack_it_refuses_and_says_what_to_install():
    proc = _gpu_check("--device", "cuda", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refused" in proc.stderr and "fbgemm-gpu==1.8.0" in proc.stderr and "--device cpu" in proc.stderr
    assert "PASS" not in proc.stdout and "FAIL" not in proc.stdout
    helped = _gpu_check("--help", timeout=60)
    assert helped.returncode == 0
    for needed in ("fbgemm-gpu==1.8.0", "torchrec==1.8.0", "--no-deps", "CUDA", "docs/gpu-check.md"):
        assert needed in helped.stdout, needed
