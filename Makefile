# Two commands: `make demo` and `make test` (`make test-unit`: the in-process tests only; `make docs`:
# the docs site into site/). Each bootstraps .venv/ when it is missing or stale (requirements*.txt or
# pyproject.toml changed) and installs nothing on a second run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCHREC := torchrec==1.8.0
PYTEST_ARGS ?=
# make test / test-all: test files spread over this many pytest-xdist workers (a file stays on one worker:
# its module fixtures and servers are started once). 1 runs them in this process, one after the other.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: venv test test-unit test-all demo demo-fleet bench gpu-check gpu-check-dry docs clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-docs.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip "setuptools>=64"
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-docs.txt
	$(PY) -m pip install --quiet --no-deps $(TORCHREC)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# Every kind (tests/unit, tests/process, tests/fleet, tests/fuzz) except the tests marked slow.
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# In-process tests only (no child process, gloo rank or server): the quick loop while editing.
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(XDIST) $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/demo.py

# The same job across hosts: a local NATS JetStream server, a shipper, a replica reading only the stream.
demo-fleet: $(STAMP)
	$(PY) examples/demo.py --fleet --out demo-fleet-out

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

# The tracker's CUDA path on a GPU (docs/gpu-check.md: needs the CUDA builds of torch and fbgemm-gpu,
# which this venv does not install; exit 2 and a message without them). gpu-check-dry: the same
# harness on CPU.
gpu-check:
	$(PY) -m benchmarks.gpu_check --device cuda

gpu-check-dry: $(STAMP)
	$(PY) -m benchmarks.gpu_check --device cpu

# The docs site (MkDocs, Material theme; the API from docstrings) into site/; strict: warnings fail.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) demo-out demo-fleet-out bench-out site
