"""`kvserve up` (what `make serve` runs): whatever is missing is made, then both models are served.

    data      artifacts/data/{translate,generate}      kvserve data
    train     artifacts/ckpt/{translate,generate}      kvserve train   (one after the other, two cores each, the
                                                                       recipes' steps or --time-budget)
    export    artifacts/bundles/{translate,generate}   kvserve export
    serve     Ray Serve on http://127.0.0.1:8000       kvserve serve   (--host to bind beyond loopback)

Each stage is the same subcommand a user would run by hand (so its progress display is what they see),
and a stage whose output exists is skipped: later runs go straight to serving.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TASKS = ("translate", "generate")
PACE_STEPS = (5, 30)  # as model/train.py (which needs torch; this module does not)


def _kvserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


def _run(cmd: list[str], what: str) -> None:
    print(f"==> {what}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"==> {what}: done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


def _train_missing(art: Path, tasks: list[str], preset: str, time_budget_s: float | None = None) -> None:
    """Train the missing models one after the other, each on both cores for its recipe's optimizer steps
    (`model/train_config.py` RECIPES), or until `time_budget_s` of training each. Measured (bf16): a run alone on
    two cores made 3.1 steps/s, each of two runs at once on one core 2.2, so one at a time trains each model more."""
    from model.train_config import RECIPES  # torch-free

    plan = ", then ".join(f"{t} ({RECIPES[t]['steps']:,} steps)" for t in tasks)
    budget = f", at most {time_budget_s / 60:.0f} min each" if time_budget_s else ""
    print(f"==> training {plan}{budget}: the same weights on every machine for the same steps. Each run prints its "
          f"speed on this machine and its wait after its first {PACE_STEPS[1]} steps; `kvserve up --time-budget "
          f"SECONDS` (make serve TIME_BUDGET=SECONDS) caps each run's training, at a lower quality.",
          file=sys.stderr, flush=True)
    for task in tasks:
        out = art / "ckpt" / task
        cmd = _kvserve("train", "--task", task, "--preset", preset, "--out", str(out),
                       "--data-dir", str(art / "data"), "--threads", "2")
        if time_budget_s:
            cmd += ["--time-budget", str(time_budget_s)]
        if (out / "train_state.pt").is_file() and not (out / "metrics.json").is_file():
            cmd.append("--resume")  # an interrupted run continues where it stopped
        try:
            _run(cmd, f"train {task}")
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"training failed for {task} (exit {e.returncode}); see the output above") from e


def up(art: Path, config: str = "deploy/serve_config.yaml", preset: str = "small", host: str | None = None,
       time_budget_s: float | None = None) -> int:
    from model.data import is_prepared  # torch-free

    t0 = time.time()
    if not all(is_prepared(art / "data", t) for t in TASKS):
        _run(_kvserve("data", "--task", "all", "--out", str(art / "data")), "data")
    need_bundle = [t for t in TASKS if not (art / "bundles" / t / "manifest.json").is_file()]
    need_train = [t for t in need_bundle if not (art / "ckpt" / t / "metrics.json").is_file()]
    if need_train:
        _train_missing(art, need_train, preset, time_budget_s)
    for task in need_bundle:
        _run(_kvserve("export", str(art / "ckpt" / task), "--out", str(art / "bundles" / task), "--force"),
             f"export {task}")
    print(f"==> artifacts ready in {time.time() - t0:.0f}s; starting the server", file=sys.stderr, flush=True)
    os.execv(sys.executable, _kvserve("serve", "--config", config, "--artifacts", str(art),
                                      *(("--host", host) if host else ())))
    return 0  # not reached
