"""A wheel built from pyproject.toml holds every subpackage: installed (not editable) into a
fresh virtual environment, the ``persistent-delta`` console script runs, from that install."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd, cwd, env=None, timeout=300):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_the_wheel_installs_every_subpackage_and_the_console_script_runs(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(os.path.join(REPO, "persistent_delta"), src / "persistent_delta",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, f), src / f)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
          "-w", str(tmp_path / "dist"), str(src)], cwd=tmp_path)
    wheel = glob.glob(str(tmp_path / "dist" / "persistent_delta-*.whl"))[0]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    vpy = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", vpy, "install", "--quiet", "--no-deps", wheel], cwd=tmp_path)
    # the dependencies (torch, torchrec, lmdb, ...) come from this environment, after the venv's own
    site = _run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).strip()
    with open(os.path.join(site, "zz_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([vpy, "-c", "import persistent_delta.cli.main, persistent_delta.fleet.ship, "
                  "persistent_delta.trainer.tracker; print(persistent_delta.__file__)"], cwd=tmp_path, env=env)
    assert where.strip().startswith(str(venv)), f"imported from {where.strip()}, not the installed wheel"

    log = str(tmp_path / "log")
    _run([vpy, "-c", "import sys, torch; from persistent_delta import LmdbDeltaStore\n"
          "with LmdbDeltaStore(sys.argv[1]) as s: s.append(0, 't', torch.tensor([1, 2]), None)", log],
         cwd=tmp_path, env=env)
    script = str(venv / "bin" / "persistent-delta")
    assert "verify" in _run([script, "--help"], cwd=tmp_path, env=env)
    assert "OK" in _run([script, "verify", log], cwd=tmp_path, env=env)
