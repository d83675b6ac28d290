"""Where an engine step's time goes: inside ONNX Runtime per graph vs the Python around it, per batch size.

    python -m bench.breakdown artifacts/bundles/generate artifacts/bundles/translate --concurrency 1 8 32

One continuous-batching Engine per bundle, in-process, C clients in a closed loop (bench/engine.py's workload:
prompts of 4-24 tokens, outputs spread over --min-new..--max-new, eos ignored), greedy. The engine is timed
from outside, the way a profiler would: a clock around every ONNX Runtime call of its runtime's sessions
(`run_with_iobinding`) and around its step runner's `execute` (the runner's whole step); the run's wall
time divided by its steps is the time per step. The clocks are read when the last request has been handed out:
the figures are those of the C clients all in flight (the run's tail, with fewer and fewer clients and smaller
steps, is not C clients). Per step, in milliseconds:
- `ort decoder`, `ort encoder`, `ort helpers` (the slot-copy and cross-KV placement graphs): inside ORT;
- `runner python`: the runner outside ORT (slot copies in numpy, building and binding inputs, reading
  logits, argmax / sampling / beam bookkeeping);
- `engine loop`: the rest of the wall time (scheduling, turning tokens into events, finishing requests, the
  hand-off of the events to the event loop).

Each round measures in a fresh process; each model and concurrency keeps its fastest round (noise only ever
slows a run down).

Does not measure: HTTP (bench/http_path.py), output quality. Owns this breakdown only.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.markdown import rel_path

CATEGORIES = ("ort decoder", "ort encoder", "ort helpers", "runner python", "engine loop")
GRAPHS = {"_decoder": "ort decoder", "_encoder": "ort encoder", "_place": "ort helpers", "_copy": "ort helpers"}
ROOT = Path(__file__).resolve().parents[1]


def _timed(fn: Callable, clock: dict[str, float], key: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[key] += time.perf_counter() - t0
    return wrapper


def instrument(engine: Any) -> dict[str, float]:
    """Clocks around the engine's ORT calls (per graph category) and its runner's execute; returns the dict
    they add to (seconds). Instance attributes only: the classes stay untouched."""
    clock = dict.fromkeys((*CATEGORIES, "run"), 0.0)
    rt = engine.runtime
    for attr, key in GRAPHS.items():
        sess = getattr(rt, attr, None)
        if sess is not None:  # the CPU's encoder calls `run`, the rest `run_with_iobinding`
            sess.run_with_iobinding = _timed(sess.run_with_iobinding, clock, key)
            sess.run = _timed(sess.run, clock, key)
    engine._runner.execute = _timed(engine._runner.execute, clock, "run")
    return clock


async def _closed_loop(engine: Any, work: list[tuple[list[int], int]], concurrency: int, tag: str,
                       on_last: Callable[[float, int], None] | None = None) -> float:
    """The wall time of the whole run; `on_last(seconds since the start, tokens received)` is called when the last
    request has been handed to a client (until then all `concurrency` clients are in flight)."""
    from serving.engine.types import GenerationRequest, SamplingParams

    queue = list(reversed(work))
    received = [0]

    async def client() -> None:
        while queue:
            prompt, n = queue.pop()
            if not queue and on_last is not None:
                on_last(time.perf_counter() - t0, received[0])
            handle = engine.submit(GenerationRequest(f"{tag}-{len(queue)}", prompt,
                                                     SamplingParams(max_new_tokens=n, ignore_eos=True)))
            async for event in handle:
                received[0] += event.token_id is not None

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0


def _row(concurrency: int, wall: float, tokens: int, steps: list[Any], clock: dict[str, float]) -> dict[str, Any]:
    n = max(len(steps), 1)
    ort = sum(clock[k] for k in CATEGORIES[:3])
    seconds = {**{k: clock[k] for k in CATEGORIES[:3]}, "runner python": clock["run"] - ort,
               "engine loop": wall - clock["run"]}
    return {"concurrency": concurrency, "steps": len(steps), "wall_s": round(wall, 3),
            "step_ms": round(1e3 * wall / n, 4), "per_step_ms": {k: round(1e3 * v / n, 4) for k, v in seconds.items()},
            "share": {k: round(v / wall, 4) for k, v in seconds.items()},
            "rows_per_step": round(sum(s.batch_size for s in steps) / n, 2), "tokens_per_s": round(tokens / wall, 1)}


async def _measure(bundle: Path, concurrency: list[int], threads: int, requests_per_client: int, min_new: int,
                   max_new: int, seed: int, provider: str = "cpu") -> list[dict[str, Any]]:
    from bench.engine import workload
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    slots = max(concurrency)
    engine = Engine.from_bundle(bundle, EngineConfig(max_slots=slots, max_waiting=4 * slots, provider=provider,
                                                     intra_op_threads=threads, max_new_tokens=max_new))
    steps: list[Any] = []
    engine.add_observer(steps.append, None)
    await engine.start()
    rows = []
    try:
        await _closed_loop(engine, workload(8, engine, min_new, max_new), min(8, slots), "warm")
        clock = instrument(engine)
        for c in concurrency:
            work = workload(c * requests_per_client, engine, min_new, max_new, seed=seed)
            steps.clear()
            clock.update(dict.fromkeys(clock, 0.0))
            full: list[tuple[float, int, list[Any], dict[str, float]]] = []  # the clocks while all c clients run

            def on_last(wall: float, tokens: int, full: list = full) -> None:
                full.append((wall, tokens, list(steps), dict(clock)))

            wall = await _closed_loop(engine, work, c, f"c{c}s{seed}", on_last)
            if full and full[0][2]:
                rows.append(_row(c, *full[0]))
            else:  # one request per client: no step ran with all of them in flight yet, the whole run it is
                rows.append(_row(c, wall, sum(n for _, n in work), steps, clock))
    finally:
        await engine.stop()
    return rows


def measure(bundles: list[Path], concurrency: list[int], threads: int = 1, requests_per_client: int = 4,
            min_new: int = 8, max_new: int = 64, seed: int = 0, provider: str = "cpu") -> dict[str, Any]:
    """One pass: every bundle at every concurrency, in this process (with whichever engine it imports), on
    `provider` (the gpu check's engine step runs it on the CUDA EP)."""
    return {str(b): asyncio.run(_measure(b, concurrency, threads, requests_per_client, min_new, max_new, seed,
                                         provider)) for b in bundles}


def _pass(bundles: list[Path], args: list[str]) -> dict[str, Any]:
    """One measuring pass in a fresh process (an engine that has run before carries its warm state)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "bench.breakdown", *map(str, bundles), *args, "--one-pass"]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout)


def run(bundles: list[Path], concurrency: list[int], threads: int = 1, rounds: int = 2, requests_per_client: int = 4,
        min_new: int = 8, max_new: int = 64, progress: bool = True) -> dict[str, Any]:
    """`rounds` passes; per bundle and concurrency the fastest pass. Returns the section's JSON."""
    bundles = [b.resolve() for b in bundles]
    passes: list[dict[str, Any]] = []
    for r in range(rounds):
        args = ["--concurrency", *map(str, concurrency), "--threads", str(threads), "--requests-per-client",
                str(requests_per_client), "--min-new", str(min_new), "--max-new", str(max_new), "--seed", str(r)]
        passes.append(_pass(bundles, args))
        if progress:
            print(f"  breakdown round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    models = [{"bundle": rel_path(b), "rows": [max((p[str(b)][i] for p in passes), key=lambda row: row["tokens_per_s"])
                                              for i in range(len(concurrency))]} for b in bundles]
    return {"concurrency": concurrency, "threads": threads, "rounds": rounds,
            "requests_per_client": requests_per_client, "min_new": min_new, "max_new": max_new,
            "categories": list(CATEGORIES), "models": models}


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per model and concurrency; ms per step by category (share of the step)."""
    head = ["model", "clients", "rows/step", "ms/step", *CATEGORIES, "tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    for m in result["models"]:
        for r in m["rows"]:
            cells = [f"{r['per_step_ms'][k]:.3f} ({100 * r['share'][k]:.0f}%)" for k in CATEGORIES]
            lines.append(f"| {Path(m['bundle']).name} | {r['concurrency']} | {r['rows_per_step']:.1f} | "
                         f"{r['step_ms']:.3f} | " + " | ".join(cells) + f" | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("bundles", nargs="+", type=Path)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)  # a subprocess of run()
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    if args.one_pass:
        print(json.dumps(measure(args.bundles, args.concurrency, args.threads, args.requests_per_client,
                                 args.min_new, args.max_new, args.seed)))
        return 0
    result = run(args.bundles, args.concurrency, args.threads, args.rounds, args.requests_per_client, args.min_new,
                 args.max_new)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
