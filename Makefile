# kvserve: `make serve` serves the published models; `make train` rebuilds them from nothing; `make test` tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ART ?= artifacts

.PHONY: venv test test-cluster test-slow test-retrain serve train bench soak data clean deploy-check gpu-check gpu-check-cpu lock

$(BIN)/kvserve-installed.stamp: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/kvserve-installed.stamp

test: venv
	$(BIN)/python -m pytest

# The cluster suite CI runs after `make test`: the production Serve config, `kvserve serve`, HAProxy, real Ray Serve
# clusters (a replica killed under load, disconnects, drain, live reconfigure, a rollout under load): ~9 min on 2 cores.
test-cluster: venv
	$(BIN)/python -m pytest -m "cluster and not gpu" -o addopts="-q"

test-slow: venv
	$(BIN)/python -m pytest -m "slow and not retrain" -o addopts="-q"

# `make train` from nothing in a temporary folder, checked against published/ (hours on 2 cores).
test-retrain: venv
	$(BIN)/python -m pytest -m retrain -o addopts="-q"

data: venv
	$(BIN)/kvserve data --task translate --out $(ART)/data
	$(BIN)/kvserve data --task generate --out $(ART)/data

# Binds 127.0.0.1 (this machine only); `make serve HOST=0.0.0.0` serves beyond it (set an API key first).
serve: venv
	$(BIN)/kvserve up --artifacts $(ART) $(if $(HOST),--host $(HOST))

# Data and both models from nothing (hours on 2 cores; resumes), published into $(ART)/published and compared
# with published/: fails when a metric is outside the published tolerance. `make train TIME_BUDGET=600` caps each run.
train: venv
	$(BIN)/kvserve up --train --no-serve --artifacts $(ART) $(if $(TIME_BUDGET),--time-budget $(TIME_BUDGET))

# Every benchmark side by side (bench/cli.py): docs/benchmarks.md, the figures README.md shows, docs/img/autoscaling.png.
bench: venv
	$(BIN)/kvserve bench --artifacts $(ART) --out docs/benchmarks.md

# The server for SOAK_MINUTES at ~70% of its capacity: RSS per process and p99 over time (bench/soak.py).
SOAK_MINUTES ?= 30
soak: venv
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES) --artifacts $(ART) --out docs/img

# The prepared GPU check (bench/gpu_check): any python that has the deps (no venv needed; PY=...), offline.
# gpu-check-cpu runs the same steps on the CPU EP. OUT/gpu_check.json says what passed, failed or was skipped.
OUT ?= artifacts/gpu-check
gpu-check:
	$(PY) -m bench.gpu_check --device cuda --out $(OUT) --artifacts $(ART)

gpu-check-cpu:
	$(PY) -m bench.gpu_check --device cpu --out $(OUT) --artifacts $(ART)

clean:
	rm -rf $(VENV) build *.egg-info

deploy-check: venv
	$(BIN)/python deploy/gen_rayservice.py --check
	$(BIN)/python deploy/validate.py

# The images' locked dependencies (deploy/docker/*.lock: every package pinned and hashed), resolved from PyPI
# by uv, which lives in a venv of its own (never in the images or in .venv's runtime dependencies).
LOCK_VENV := build/lock-venv
UV_VERSION ?= 0.13.9
lock:
	test -x $(LOCK_VENV)/bin/uv || ($(PY) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install -q 'uv==$(UV_VERSION)')
	$(PY) deploy/docker/lock.py --uv $(LOCK_VENV)/bin/uv
