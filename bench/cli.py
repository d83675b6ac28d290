"""`kvserve bench` (what `make bench` runs): every side-by-side benchmark in one run, written to docs/benchmarks.md.

    kvserve bench [--artifacts artifacts] [--out docs/benchmarks.md] [--quick] [--sections S ...]

Sections, each measured side by side (alternated, medians, ratios) on this machine:
    compute    peak float32 matmul FLOP/s (numpy, ONNX Runtime) and the runtime's decode step per batch size
    inprocess  ORT fp32 / int8 vs PyTorch eager with KV cache (bench/decode_step.py, a subprocess: torch
               stays out of this process), and the engine's batching modes (bench/engine.py)
    translate  our engine vs CTranslate2 on the same converted weights (bench/translate.py)
    http       continuous vs request-level vs no batching through a real Ray Serve app (bench/http.py)
    http_path  tokens/s through HTTP vs in-process and every process's CPU, per data plane and placement
               (bench/http_path.py): Ray's Python proxy with a model deployment, then kvserve's defaults
    breakdown  an engine step's time inside ONNX Runtime vs the Python around it, per batch size, for both
               models (bench/breakdown.py)
    autoscale  replicas of the generate model under a ramp of clients, autoscaled on the engines' load
               (bench/autoscale.py; its plot goes to img/ beside the doc)
The report's "At a glance" lines and the published models' table are copied into README.md (bench/readme.py).
Raw results go to ARTIFACTS/bench/ (one JSON per section, the load reports, the Serve config used, the
CTranslate2 model); `--sections` re-runs some sections and renders the doc with the saved others (their
dates are in the doc); a failed section is reported in the doc and makes the exit status 1.

Measures nothing itself: each section's module does, and the doc's text is bench/report.py's. Does not
measure training speed (`kvserve train` prints its own) or model quality (`kvserve evaluate`).
Owns the plan (the default run takes ~30 minutes on 2 cores; `--quick` is for tests), the subprocess commands
and the CLI; where it finds the artifacts it measures is bench/artifacts.py, the ledger of CPU kinds
bench/cpu_kinds.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from bench.artifacts import Artifacts
from bench.autoscale import DEFAULT_PHASES as AUTOSCALE_PHASES
from bench.http import HttpPlan
from bench.markdown import DATE_UTC
from bench.markdown import rel_path as _rel

SECTIONS = ("compute", "inprocess", "translate", "breakdown", "http", "http_path", "autoscale", "cache")
# http_path: Ray's default data plane and placement (what kvserve ran before choosing), then kvserve serve's
HTTP_PATH_SERVERS = (("python", "split"), ("haproxy", "split"), ("haproxy", "colocated"))
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BenchPlan:
    threads: int = 1  # intra-op threads of every in-process backend (as the serve config gives a replica)
    http: HttpPlan = field(default_factory=HttpPlan)
    http_path_seconds: float = 10.0
    path_tokens: int = 64  # output tokens per request of the http_path section
    step_batches: tuple[int, ...] = (1, 16)
    step_context: int = 32
    step_iters: int = 200
    engine_concurrency: tuple[int, ...] = (1, 8, 32, 64)  # 32: the HTTP section's load; 64: the best batch
    engine_rounds: int = 3
    engine_requests_per_client: int = 6
    engine_min_new: int = 8
    engine_temperature: float = 1.0  # sampled, seeded, as the HTTP section's requests (HttpPlan.temperature)
    engine_max_new: int = 128
    engine_all_cores: bool = True  # the engine benchmark once more with every core as ORT threads
    translate_sentences: int = 160
    translate_concurrency: tuple[int, ...] = (1, 8, 32)
    translate_rounds: int = 3
    translate_max_new: int = 128
    translate_precisions: tuple[str, ...] = ("fp32", "int8")  # ours vs CTranslate2, each pair on its own weights
    breakdown_concurrency: tuple[int, ...] = (1, 8, 32)
    breakdown_rounds: int = 5  # this machine drifts: the fastest of more rounds
    breakdown_requests_per_client: int = 4
    breakdown_max_new: int = 64
    autoscale_phases: tuple[tuple[int, float], ...] = AUTOSCALE_PHASES  # (clients, seconds) per phase
    autoscale_slots: int = 8  # KV slots per replica: 32 clients need more than one replica
    cache_rounds: int = 3  # the response cache at 50% repeats, bypassed vs used (bench/cache.py)
    cache_seconds: float = 20.0
    cache_connections: int = 32
    gemm_n: int = 2048
    gemm_reps: int = 5
    sweep_batches: tuple[int, ...] = (1, 8, 32, 64)
    sweep_context: int = 64
    scaling_rows: tuple[int, ...] = (1, 32)  # the decode step by cached length: what bounds batching's gain
    scaling_contexts: tuple[int, ...] = (16, 64, 128, 192)


QUICK = BenchPlan(
    threads=1, http=HttpPlan(concurrency=4, duration_s=2.0, warmup_s=0.5, closed_rounds=1, open_rounds=1, min_tokens=2,
                             max_tokens=8, slots=4, timeout_s=10.0, long_wait_s=0.05),
    step_iters=5, step_context=8, step_batches=(1, 4), engine_concurrency=(1, 4), engine_rounds=1,
    engine_requests_per_client=1, engine_min_new=2, engine_max_new=8, translate_sentences=8,
    translate_concurrency=(1, 4), translate_rounds=1, translate_max_new=16, gemm_n=256, gemm_reps=2,
    sweep_batches=(1, 4), sweep_context=8, scaling_rows=(1, 4), scaling_contexts=(4, 16), http_path_seconds=2.0,
    path_tokens=4, breakdown_concurrency=(1, 4), breakdown_rounds=1,
    breakdown_requests_per_client=1, breakdown_max_new=8, autoscale_phases=((1, 3.0), (4, 20.0), (1, 20.0)),
    autoscale_slots=2, cache_rounds=1, cache_seconds=2.0, cache_connections=4)


def _run(cmd: list[str], shown: list[str], commands: list[str]) -> str:
    """Run a subprocess (its stderr passes through), record the command as a user would type it."""
    commands.append(shlex.join(shown))
    print(f"==> {shlex.join(shown)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=Path.cwd())
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(shown)}` failed with exit status {proc.returncode}")
    return proc.stdout


def section_compute(art: Artifacts, plan: BenchPlan, commands: list[str]) -> dict[str, Any]:
    from bench.compute import peak_gemm, step_scaling_of, step_sweep

    gen = art.require_bundle("generate")
    peak = peak_gemm(plan.gemm_n, plan.gemm_reps)  # 1 thread and every core, whatever plan.threads is
    sweep = step_sweep(gen, list(plan.sweep_batches), plan.sweep_context, plan.threads)
    scaling = step_scaling_of(gen, list(plan.scaling_rows), list(plan.scaling_contexts), plan.threads)
    commands.append(shlex.join(["python", "-m", "bench.engine", _rel(gen), "--step-scaling", "--rows",
                                *map(str, plan.scaling_rows), "--contexts", *map(str, plan.scaling_contexts),
                                "--provider", "cpu", "--threads", str(plan.threads)]))
    model = json.loads((gen / "manifest.json").read_text())["model_config"]
    return {"peak": peak, "sweep": sweep, "sweep_context": plan.sweep_context, "scaling": scaling,
            "bundle": _rel(gen), "model_config": model, "threads": plan.threads}


def section_inprocess(art: Artifacts, plan: BenchPlan, commands: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": {}}
    for task in ("generate", "translate"):
        fp32 = art.require_bundle(task)
        int8 = _variant_bundle(art, task, "int8", commands)
        args = ["--checkpoint", _rel(art.checkpoint_of(fp32)), "--fp32", _rel(fp32), "--int8", _rel(int8),
                "--batches", *map(str, plan.step_batches), "--context", str(plan.step_context),
                "--iters", str(plan.step_iters), "--threads", str(plan.threads)]
        text = _run([sys.executable, "-m", "bench.decode_step", *args], ["python", "-m", "bench.decode_step", *args],
                    commands)
        out["step"][task] = json.loads(text)
    # The engine at the replica's thread count, and again with every core (all modes alike): how the modes
    # compare depends on the cores a replica gets, since a big batch uses a second core better than one row.
    cpus = os.cpu_count() or 1
    runs = [("engine", plan.threads)] + ([("engine_all_cores", cpus)] if plan.engine_all_cores and cpus > plan.threads
                                          else [])
    for key, threads in runs:
        engine_json = art.work / f"{key}.json"
        args = [_rel(art.require_bundle("generate")), "--out", _rel(engine_json), "--concurrency",
                *map(str, plan.engine_concurrency), "--rounds", str(plan.engine_rounds), "--requests-per-client",
                str(plan.engine_requests_per_client), "--min-new", str(plan.engine_min_new), "--max-new",
                str(plan.engine_max_new), "--provider", "cpu", "--threads", str(threads),
                "--temperature", f"{plan.engine_temperature:g}", "--data-dir", _rel(art.data)]
        _run([sys.executable, "-m", "bench.engine", *args], ["python", "-m", "bench.engine", *args],
             commands)
        out[key] = json.loads(engine_json.read_text())
    out["cpus"], out["threads"] = cpus, plan.threads
    return out


def section_translate(art: Artifacts, plan: BenchPlan, commands: list[str]) -> dict[str, Any]:
    """fp32 vs fp32, then int8 vs int8: our batch-invariant int8 bundle (exported from the same checkpoint when
    missing) against CTranslate2's int8 conversion of the same weights."""
    from bench.translate import compare, load_sentences

    bundle = art.require_bundle("translate")
    ckpt = art.checkpoint_of(bundle)
    sentences = load_sentences(art.data, plan.translate_sentences)
    out: dict[str, Any] = {}
    for precision in plan.translate_precisions:
        ours = bundle if precision == "fp32" else _variant_bundle(art, "translate", precision, commands)
        ct2_dir = art.work / ("ct2-translate" if precision == "fp32" else f"ct2-translate-{precision}")
        args = ["export", _rel(ckpt), "--format", "ctranslate2", "--out", _rel(ct2_dir), "--force",
                *(["--ct2-quantization", precision] if precision != "fp32" else [])]
        convert = json.loads(_run([sys.executable, "-m", "kvserve.cli", *args], ["kvserve", *args], commands))
        result = compare(ours, ct2_dir, sentences, list(plan.translate_concurrency), plan.translate_rounds,
                         plan.threads, plan.translate_max_new, ct2_compute_type=precision)
        body = {**result, "precision": precision, "bundle": _rel(ours), "checkpoint": _rel(ckpt),
                "ct2_model": _rel(ct2_dir), "conversion": convert}
        if precision == "fp32":
            out.update(body)
        else:
            out.setdefault("variants", {})[precision] = body
    return out


def _variant_bundle(art: Artifacts, task: str, variant: str, commands: list[str]) -> Path:
    """ARTIFACTS/bundles/<task>-<variant>, exported from the checkpoint of the task's fp32 bundle when it is missing
    or holds other weights (the quality gate is the export's own business: `kvserve export` runs it)."""
    ckpt = art.checkpoint_of(art.require_bundle(task))
    bundle = art.bundle(f"{task}-{variant}")
    if not art.exported_from(bundle, ckpt):
        args = ["export", _rel(ckpt), "--variant", variant, "--out", _rel(bundle), "--force", "--check-sentences", "0"]
        _run([sys.executable, "-m", "kvserve.cli", *args], ["kvserve", *args], commands)
    return bundle


def section_breakdown(art: Artifacts, plan: BenchPlan, commands: list[str]) -> dict[str, Any]:
    from bench.breakdown import run

    # the int8 translator too: its steps are the shortest, so the Python around them weighs the most
    bundles = [art.require_bundle("generate"), art.require_bundle("translate"), art.require_bundle("translate-int8")]
    p = plan
    result = run(bundles, list(p.breakdown_concurrency), p.threads, p.breakdown_rounds, p.breakdown_requests_per_client,
                 max_new=p.breakdown_max_new)
    commands.append(shlex.join(["python", "-m", "bench.breakdown", *map(_rel, bundles), "--concurrency",
                                *map(str, p.breakdown_concurrency), "--threads", str(p.threads), "--rounds",
                                str(p.breakdown_rounds), "--requests-per-client", str(p.breakdown_requests_per_client),
                                "--max-new", str(p.breakdown_max_new)]))
    return result


def section_http(art: Artifacts, plan: BenchPlan, commands: list[str], shipped: Path) -> dict[str, Any]:
    from bench.http import run

    result = run(shipped, art.require_bundle("generate"), art.data, plan.http, art.work / "http")
    p = plan.http
    commands.append(f"kvserve serve --config {_rel(result['config_file'])}   # then, per run, user_config.batching "
                    f"= continuous | request | none (`serve deploy` of the edited file reconfigures live)")
    loads = [("closed", f"--concurrency {p.concurrency}")] + [
        (phase, f"--rate {o['rate']}") for phase, o in result["open_phases"].items()]
    for phase, load in loads:
        commands.append(f"kvserve loadtest {result['url']} --workload generate {load} --duration {p.duration_s:g} --warmup "
                        f"{p.warmup_s:g} --min-tokens {p.min_tokens} --max-tokens {p.max_tokens} --temperature "
                        f"{p.temperature:g} --seed {p.seed} --timeout {p.timeout_s:g}   # {phase}, per mode and round")
    result["config_file"] = _rel(result["config_file"])
    return result


def section_http_path(art: Artifacts, plan: BenchPlan, commands: list[str]) -> dict[str, Any]:
    from bench.http_path import run

    servers = list(HTTP_PATH_SERVERS)
    result = run(art.require_bundle("generate"), art.data, plan.http_path_seconds, servers, art.work / "http_path",
                 tokens=plan.path_tokens)
    commands.append(f"python -m bench.http_path --data-plane python,haproxy --placement split,colocated --seconds "
                    f"{plan.http_path_seconds:g}   # the bench runs {servers}")
    return result


def section_autoscale(art: Artifacts, plan: BenchPlan, commands: list[str], img: Path) -> dict[str, Any]:
    from bench.autoscale import measure, phases_arg, plot

    art.require_bundle("generate")
    doc = measure(art.root, plan.autoscale_phases, plan.autoscale_slots)
    plot(doc, img / "autoscaling.png")
    commands.append(shlex.join(["python", "-m", "bench.autoscale", "--artifacts", _rel(art.root), "--out", _rel(img),
                                "--phases", phases_arg(plan.autoscale_phases), "--slots", str(plan.autoscale_slots)]))
    (art.work / "autoscaling_requests.json").write_text(json.dumps(doc.pop("requests")) + "\n")
    return {**doc, "plot": "img/autoscaling.png"}


def section_cache(art: Artifacts, plan: BenchPlan, commands: list[str]) -> dict[str, Any]:
    from bench.cache import run

    art.require_bundle("translate")
    commands.append(shlex.join(["python", "-m", "bench.cache", "--artifacts", _rel(art.root), "--rounds",
                                str(plan.cache_rounds), "--seconds", f"{plan.cache_seconds:g}", "--connections",
                                str(plan.cache_connections)]))
    return run(art.root, plan.cache_rounds, plan.cache_seconds, plan.cache_connections)


def run_sections(art: Artifacts, plan: BenchPlan, sections: list[str], shipped: Path, img: Path,
                 commit: str) -> dict[str, dict[str, Any]]:
    """Run the given sections in order; each one's JSON (or its error), with the commit it measured, is saved to
    the work dir."""
    runners: dict[str, Callable[..., dict[str, Any]]] = {
        "compute": section_compute, "inprocess": section_inprocess, "translate": section_translate,
        "breakdown": section_breakdown, "http": lambda a, p, c: section_http(a, p, c, shipped),
        "http_path": section_http_path, "autoscale": lambda a, p, c: section_autoscale(a, p, c, img),
        "cache": section_cache}
    results = {}
    for name in sections:
        commands: list[str] = []
        t0 = time.perf_counter()
        print(f"==> bench section {name}", file=sys.stderr, flush=True)
        try:
            body = {"ok": True, **runners[name](art, plan, commands)}
        except Exception as e:  # reported in the doc; the other sections still run
            traceback.print_exc()
            body = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        body.update(section=name, commands=commands, elapsed_s=round(time.perf_counter() - t0, 1),
                    date_utc=time.strftime(DATE_UTC, time.gmtime()), git=commit)
        (art.work / f"{name}.json").write_text(json.dumps(body, indent=2, default=str) + "\n")
        results[name] = body
    return results


def saved_sections(art: Artifacts, skip: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in SECTIONS:
        path = art.work / f"{name}.json"
        if name not in skip and path.is_file():
            out[name] = json.loads(path.read_text())
    return out


def bench(artifacts: Path, out: Path, quick: bool = False, sections: list[str] | None = None,
          work: Path | None = None, shipped: Path = ROOT / "deploy" / "serve_config.yaml",
          threads: int | None = None, render_only: bool = False, readme: Path | None = None) -> int:
    """Run `sections` (default all), write the doc and, given `readme`, the README's figures from it (and its
    models table from published/: bench/readme.py); 0 when every section in the doc succeeded."""
    from bench import cpu_kinds
    from bench.compute import machine
    from bench.report import render

    if readme is not None and not readme.is_file():  # before measuring: the sections overwrite their saved results
        raise FileNotFoundError(f"--readme {readme} does not exist; nothing was measured")
    plan = QUICK if quick else BenchPlan()
    plan = replace(plan, threads=threads) if threads else plan
    art = Artifacts(artifacts, work or artifacts / "bench")
    art.work.mkdir(parents=True, exist_ok=True)
    todo = [] if render_only else list(sections or SECTIONS)
    # the commit measured, read before the sections write their outputs (docs/img) into the tree
    measured_on = machine(ROOT)
    t0 = time.perf_counter()
    results = {**saved_sections(art, todo),
               **run_sections(art, plan, todo, shipped, out.parent / "img", measured_on["git"])}
    elapsed = time.perf_counter() - t0
    invocation = ["kvserve", "bench", "--artifacts", _rel(artifacts), "--out", _rel(out)] + (["--quick"] if quick else [])
    measured_on["date_utc"] = machine(ROOT)["date_utc"]
    if render_only:  # the doc carries the date and duration of its measurements, not of this rendering
        measured_on["date_utc"] = max([r["date_utc"] for r in results.values() if r.get("date_utc")] or ["?"])
        elapsed = sum(r.get("elapsed_s", 0.0) for r in results.values())
    # the doc names the commits its sections measured (saved ones may be older than this checkout)
    measured_on["git"] = ", ".join(sorted({r["git"] for r in results.values() if r.get("git")})) or measured_on["git"]
    # this machine's kind gets the figures measured now; the ledger keeps every other kind's (bench/cpu_kinds.py)
    kinds = cpu_kinds.record(out.parent / cpu_kinds.LEDGER, measured_on, {n: results[n] for n in todo if n in results})
    doc = render({name: results[name] for name in SECTIONS if name in results}, measured_on, asdict(plan),
                 shlex.join(invocation), elapsed, kinds)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    print(f"==> wrote {out} ({elapsed / 60:.1f} min)", file=sys.stderr, flush=True)
    if readme is not None:
        from bench.readme import update

        changed = update(readme, out, ROOT / "published")
        print(f"==> {readme}: {', '.join(changed) or 'no'} block(s) rewritten", file=sys.stderr, flush=True)
    return 0 if results and all(r.get("ok") for r in results.values()) else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    # this checkout's README shows the figures of this checkout's report, not of a report written elsewhere
    readme = Path(args.readme) if args.readme else (
        ROOT / "README.md" if out.resolve() == ROOT / "docs" / "benchmarks.md" else None)
    return bench(Path(args.artifacts), out, quick=args.quick, sections=args.sections,
                 work=Path(args.work) if args.work else None, shipped=Path(args.config), threads=args.threads,
                 render_only=args.render_only, readme=readme)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="side-by-side benchmarks -> docs/benchmarks.md (what `make bench` runs)",
        description="Measure, side by side on this machine: batching modes through a real Ray Serve app, ONNX "
                    "Runtime fp32/int8 vs PyTorch eager, our engine vs CTranslate2 on the same weights, and the "
                    "share of peak matmul FLOP/s; write the markdown report. Needs trained bundles (make serve).")
    p.add_argument("--artifacts", default="artifacts", help="holds bundles/, ckpt/ and data/ (default: %(default)s)")
    p.add_argument("--out", default="docs/benchmarks.md", help="markdown report to write (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="seconds-long runs of every section (tests, smoke checks)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS,
                   help="run only these; the doc reuses the saved results of the others")
    p.add_argument("--render-only", action="store_true", help="run nothing: write the doc from saved results")
    p.add_argument("--work", help="raw results directory (default: ARTIFACTS/bench)")
    p.add_argument("--config", default=str(ROOT / "deploy" / "serve_config.yaml"),
                   help="the shipped Serve config the HTTP section starts from")
    p.add_argument("--threads", type=int, help="intra-op threads of the in-process backends (default: 1)")
    p.add_argument("--readme", help="README.md whose figures to rewrite from the report (default: this checkout's, "
                                    "when --out is its docs/benchmarks.md)")
    p.set_defaults(func=_cmd_bench)
