"""`kvserve up` (what `make serve` runs): the published models exported to bundles, then served.

    export    artifacts/bundles/{translate,generate}   kvserve export published/<task>   (~15 s each)
    serve     Ray Serve on http://127.0.0.1:8000       kvserve serve   (--host to bind beyond loopback)

`kvserve up --train` (`make train` adds --no-serve) rebuilds the models from nothing instead, each stage the
subcommand a user would run by hand:

    data      artifacts/data/{translate,generate}      kvserve data
    train     artifacts/ckpt/{translate,generate}      kvserve train   (both recipes side by side, one thread
                                                                       each, as the published models were trained;
                                                                       an interrupted run resumes)
    teacher   artifacts/published/translate-teacher    kvserve publish + export (the recipe's translator)
    distill   artifacts/data-kd/translate              kvserve distill (its beam-4 translations of the train
                                                                       sources: the new train split)
    fine-tune artifacts/ckpt/translate-distilled       kvserve train --init (the teacher on that data)
    publish   artifacts/published/{translate,...}      kvserve publish --compare published/<task>
    export, serve                                      as above, from artifacts/published

A bundle is exported again only when its weights are not the ones to serve (a new published model after a
pull, or a retrained one); otherwise later runs go straight to serving.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from model.published import PUBLISHED_DIR, TASKS, read_manifest

PROGRESS_EVERY_S = 60  # how often `up --train` prints where each training run is
TEACHER, DISTILLED = "translate-teacher", "translate-distilled"  # the translator's two runs under ckpt/, bundles/


def _kvserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


def _run(cmd: list[str], what: str, check: bool = True) -> int:
    print(f"==> {what}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd, check=check).returncode
    print(f"==> {what}: done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return rc


def _last_progress(log: Path) -> str:
    """The last progress-bar state of a training log (tqdm writes carriage returns, not newlines)."""
    try:
        tail = log.read_bytes()[-4000:].decode("utf-8", "replace")
    except OSError:
        return "starting"
    parts = [p.strip() for p in tail.replace("\r", "\n").split("\n") if p.strip()]
    return parts[-1][:160] if parts else "starting"


def train_all(art: Path, tasks: list[str], time_budget_s: float | None = None) -> None:
    """Train the recipes of `tasks` side by side, one thread each (as the published models were: two one-thread
    runs make more steps in all than one two-thread run after the other)."""
    train_runs({task: ["train", "--task", task, "--out", str(art / "ckpt" / task), "--data-dir", str(art / "data"),
                       "--threads", "1"] for task in tasks}, time_budget_s)


def train_runs(runs: dict[str, list[str]], time_budget_s: float | None = None) -> None:
    """Run the `kvserve train` argument lists of `runs` side by side, each logging to train.log in its --out
    directory; an interrupted run resumes from its last save."""
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    for name, args in runs.items():
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        cmd = _kvserve(*args)
        if time_budget_s:
            cmd += ["--time-budget", str(time_budget_s)]
        if (out / "train_state.pt").is_file() and not (out / "metrics.json").is_file():
            cmd.append("--resume")
        log = out / "train.log"
        print(f"==> train {name}: {' '.join(cmd[2:])} (log: {log})", file=sys.stderr, flush=True)
        procs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "ab")), log)
    while any(p.poll() is None for p, _ in procs.values()):
        time.sleep(PROGRESS_EVERY_S)
        for name, (p, log) in procs.items():
            state = "done" if p.poll() == 0 else _last_progress(log)
            print(f"==> {name}: {state}", file=sys.stderr, flush=True)
    failed = [n for n, (p, _) in procs.items() if p.returncode != 0]
    if failed:
        raise RuntimeError(f"training failed for {', '.join(failed)}; see train.log in its checkpoint directory")


def distill_translator(art: Path, time_budget_s: float | None = None) -> Path:
    """The translator's stages after its recipe (model/train_config.py DISTILLATION): the recipe's model published
    as the teacher (float16 weights, measured), its bundle's beam search over the train sources (`kvserve
    distill`), then the teacher fine-tuned on those distilled pairs. Returns the checkpoint to publish
    as the translator; a stage whose output is there is not run again."""
    from model.train_config import DISTILLATION

    recipe_run = art / "ckpt" / "translate"
    teacher, bundle = art / "published" / TEACHER, art / "bundles" / TEACHER
    data, out = art / "data-kd", art / "ckpt" / DISTILLED
    if (out / "metrics.json").is_file():
        return out
    if not (teacher / "manifest.json").is_file() or \
            (teacher / "manifest.json").stat().st_mtime < (recipe_run / "metrics.json").stat().st_mtime:
        _run(_kvserve("publish", str(recipe_run), "--out", str(teacher), "--force", "--data-dir", str(art / "data")),
             "publish the teacher")
    if not _bundle_is_current(bundle, teacher):
        _run(_kvserve("export", str(teacher), "--out", str(bundle), "--force", "--data-dir", str(art / "data")),
             "export the teacher")
    _run(_kvserve("distill", "--teacher", str(bundle), "--data-dir", str(art / "data"), "--out", str(data),
                  "--beam-size", str(DISTILLATION["beam_size"])), "distill")
    train_runs({DISTILLED: ["train", "--task", "translate", "--init", str(teacher), "--data-dir", str(data),
                            "--out", str(out), "--steps", str(DISTILLATION["steps"]), "--lr", str(DISTILLATION["lr"]),
                            "--warmup", str(DISTILLATION["warmup"]), "--threads", "1"]}, time_budget_s)
    return out


def _weights_sha(model_dir: Path) -> str:
    return read_manifest(model_dir)["weights"]["sha256"]


def _bundle_is_current(bundle: Path, model_dir: Path) -> bool:
    """The bundle exists, in the format this kvserve reads, and was exported from the weights of `model_dir`."""
    from export.contract import FORMAT_VERSION

    manifest = bundle / "manifest.json"
    if not manifest.is_file():
        return False
    doc = json.loads(manifest.read_text())
    current = doc.get("format_version") == FORMAT_VERSION
    return current and doc.get("source", {}).get("weights_sha256") == _weights_sha(model_dir)


def export_models(art: Path, models: Path) -> None:
    """Export each model of `models` (published/<task>) that has no current bundle under artifacts/bundles; the
    exports run side by side, one thread each."""
    need = [t for t in TASKS if not _bundle_is_current(art / "bundles" / t, models / t)]
    t0 = time.time()
    procs = {}
    for task in need:
        cmd = _kvserve("export", str(models / task), "--out", str(art / "bundles" / task), "--force", "--threads", "1")
        print(f"==> export {task}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        procs[task] = subprocess.Popen(cmd)
    failed = [t for t, p in procs.items() if p.wait() != 0]
    if failed:
        raise RuntimeError(f"export failed for {', '.join(failed)}; see the output above")
    for task in need:
        want = read_manifest(models / task)["version"]
        got = json.loads((art / "bundles" / task / "manifest.json").read_text())["version"]
        if want != got:
            print(f"==> note: the {task} bundle's version is {got}, the published manifest says {want}: the export "
                  f"ran with other library versions than the manifest's `bundle.export` (the weights are the same "
                  f"and passed the parity check)", file=sys.stderr, flush=True)
    if need:
        print(f"==> exported {', '.join(need)} in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


def retrain(art: Path, time_budget_s: float | None = None) -> bool:
    """Data, both recipes and their publication into artifacts/published, compared with the repository's
    published models; True when every metric is within the tolerance."""
    from model.data import is_prepared  # torch-free

    if not all(is_prepared(art / "data", t) for t in TASKS):
        _run(_kvserve("data", "--task", "all", "--out", str(art / "data")), "data")
    need = [t for t in TASKS if not (art / "ckpt" / t / "metrics.json").is_file()]
    if need:
        train_all(art, need, time_budget_s)
    final = {task: art / "ckpt" / task for task in TASKS}
    final["translate"] = distill_translator(art, time_budget_s)
    ok = True
    for task in TASKS:
        done, trained = art / "published" / task / "manifest.json", final[task] / "metrics.json"
        if done.is_file() and done.stat().st_mtime > trained.stat().st_mtime and not need:
            continue  # published after its training ended, and compared then
        cmd = _kvserve("publish", str(final[task]), "--out", str(art / "published" / task), "--force",
                       "--data-dir", str(art / "data"))
        if (PUBLISHED_DIR / task / "manifest.json").is_file():
            cmd += ["--compare", str(PUBLISHED_DIR / task)]
        ok &= _run(cmd, f"publish {task}", check=False) == 0
    return ok


def up(art: Path, config: str = "deploy/serve_config.yaml", host: str | None = None, train: bool = False,
       serve: bool = True, time_budget_s: float | None = None) -> int:
    t0 = time.time()
    models = PUBLISHED_DIR
    if train:
        reproduced = retrain(art, time_budget_s)
        print(f"==> retrained models {'reproduce' if reproduced else 'do NOT reproduce'} the published metrics "
              f"(artifacts/published/<task>/manifest.json)", file=sys.stderr, flush=True)
        models = art / "published"
        if not serve:
            return 0 if reproduced else 1
    export_models(art, models)
    print(f"==> bundles ready in {time.time() - t0:.0f}s; starting the server", file=sys.stderr, flush=True)
    if not serve:
        return 0
    os.execv(sys.executable, _kvserve("serve", "--config", config, "--artifacts", str(art),
                                      *(("--host", host) if host else ())))
    return 0  # not reached
