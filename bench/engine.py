"""In-process engine benchmark: continuous vs request-level vs no batching, side by side in one run.

    python -m bench.engine BUNDLE --out bench.json          # run, write JSON, print the table
    python -m bench.engine --table bench.json                # print the markdown table again
    python -m bench.engine BUNDLE --step-scaling --rows 1 27 --contexts 16 96 192   # the ceiling

Closed loop: C clients each send the next request of a fixed workload as soon as their previous one ends.
The workload (prompts and output lengths spread evenly over --min-new..--max-new, eos ignored so every
request generates exactly its length) is the same for every mode. One engine (one runtime, one set of
sessions and KV buffers) is reconfigured between runs, and the modes alternate within each round, so the
machine's noise hits all three alike; the summary takes the median over rounds. Reported per mode and
concurrency: generated tokens per second while all C clients have a request in (the steady state, before
the first client runs out of work) and over the whole run, p50/p99 time to first token (submit -> first
token), mean rows per engine step. Request-level mode gathers up to C requests (or waits --batch-wait-s)
and runs the batch to its end: the engine's request-level mode, the one the server runs.

--step-scaling measures what bounds those ratios: one decode step of the runtime alone (no engine) on R rows that
all hold C cached tokens (medians over repetitions; one block per row count, the contexts alternated within it),
and the gain per row of R rows over one. Decode attention
streams every row's cached keys and values, so the gain shrinks as contexts grow.

Does not measure: HTTP, Ray Serve's proxy and replicas (bench/http.py), streaming to clients, or output
quality (eos is ignored; the token ids are random).
Owns the benchmark only; the engine is serving/engine/engine.py. Absolute figures depend on the machine: compare
the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from serving.engine.config import EngineConfig

from serving.engine.engine import Engine
from serving.engine.types import BatchingMode, GenerationRequest, RequestStats, SamplingParams, StepStats

if TYPE_CHECKING:
    from serving.engine.runtime import ModelRuntime

MODES = (BatchingMode.CONTINUOUS, BatchingMode.REQUEST, BatchingMode.NONE)


def workload(n: int, engine: Engine, min_new: int, max_new: int, seed: int = 0,
             prompts: list[list[int]] | None = None) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length): output lengths evenly spread, shuffled; prompts drawn from `prompts`
    (token ids, e.g. `text_prompts`) or, without them, random ids, 4-24 tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(min_new, max_new, n).round().astype(int)
    rng.shuffle(lengths)
    out = []
    for length in lengths:
        if prompts:
            body = prompts[int(rng.integers(len(prompts)))]
        else:
            body = [int(x) for x in rng.integers(4, engine.vocab_size, size=int(rng.integers(4, 25)))]
        prompt = body if engine.is_encoder_decoder else [engine.runtime.bos_id] + body
        room = engine.max_len - (1 if engine.is_encoder_decoder else len(prompt)) + 1
        out.append((prompt, int(min(length, room))))
    return out


def text_prompts(bundle: Path, data_dir: Path) -> tuple[list[list[int]], str]:
    """The HTTP load's prompts (loadtest/workloads.py: test-split prompts for a generation bundle, source
    sentences for a translation one), as the bundle's tokenizer encodes them: the same requests in-process."""
    from export.bundle import load_bundle
    from loadtest.workloads import Workload, load_inputs

    b = load_bundle(bundle)
    tok = b.load_tokenizer()
    inputs = load_inputs(Workload.TRANSLATE if b.is_encoder_decoder else Workload.GENERATE, data_dir)
    return [ids for ids in (tok.encode(t) for t in inputs.texts) if ids], inputs.source


def _mean_prompt(engine: Engine, prompts: list[list[int]] | None) -> float:
    """The mean prompt length `workload` draws, bos included (decoder-only): what FLOPs per token count."""
    if not prompts:
        return 15.0 if not engine.is_encoder_decoder else 14.0  # bos + 4..24 random tokens (mean 14)
    return float(np.mean([len(p) for p in prompts])) + (0 if engine.is_encoder_decoder else 1)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


class Recorder:
    """The benchmark's engine observer; `reset` starts a new run's lists."""

    def __init__(self, engine: Engine) -> None:
        self.reset()
        engine.add_observer(lambda s: self.steps.append(s), lambda r: self.requests.append(r))

    def reset(self) -> None:
        self.steps: list[StepStats] = []
        self.requests: list[RequestStats] = []


async def run_once(engine: Engine, rec: Recorder, mode: BatchingMode, concurrency: int,
                   work: list[tuple[list[int], int]], batch_wait_s: float, tag: str, temperature: float = 0.0) -> dict:
    """One closed-loop run; temperature 0: greedy, else sampled with a seed per request (as the HTTP runs)."""
    engine.reconfigure(engine.config.model_copy(update={
        "batching": mode, "max_batch_size": concurrency, "batch_wait_timeout_s": batch_wait_s}))
    rec.reset()
    queue = list(reversed(work))

    token_times: list[float] = []
    exits: list[float] = []

    async def client() -> None:
        while queue:
            prompt, n = queue.pop()
            rid = f"{tag}-{len(queue)}"
            params = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature,
                                    seed=len(queue) if temperature > 0 else None)
            h = engine.submit(GenerationRequest(rid, prompt, params))
            async for event in h:
                if event.token_id is not None:
                    token_times.append(time.perf_counter())
        exits.append(time.perf_counter())

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    # Steady state: until the first client runs out of work, all `concurrency` clients have a request in.
    busy_end = min(exits)
    busy_tokens = sum(t <= busy_end for t in token_times)
    reqs, steps = rec.requests, rec.steps
    tokens = sum(r.generated_tokens for r in reqs)
    ttft = [r.time_to_first_token for r in reqs if r.time_to_first_token is not None]
    return {"mode": mode.value, "concurrency": concurrency, "requests": len(reqs), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "busy_s": busy_end - t0,
            "busy_tokens_per_s": busy_tokens / (busy_end - t0), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "e2e_p50_s": percentile([r.e2e for r in reqs], 50),
            "steps": len(steps), "mean_rows_per_step": float(np.mean([s.batch_size for s in steps])) if steps else 0.0}


def summarize(runs: list[dict]) -> list[dict]:
    """Median over rounds per (concurrency, mode), with continuous' ratios to the other modes."""
    rows = []
    for c in sorted({r["concurrency"] for r in runs}):
        med = {}
        for mode in MODES:
            rs = [r for r in runs if r["concurrency"] == c and r["mode"] == mode.value]
            if rs:
                med[mode.value] = {k: statistics.median(r[k] for r in rs)
                                   for k in ("busy_tokens_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                                             "mean_rows_per_step")}
        cont = med.get("continuous", {})
        for mode, m in med.items():
            other = mode != "continuous" and cont
            rows.append({"concurrency": c, "mode": mode, **m,
                         "continuous_speedup": cont["busy_tokens_per_s"] / m["busy_tokens_per_s"] if other else None,
                         "continuous_speedup_whole_run": cont["tokens_per_s"] / m["tokens_per_s"] if other else None})
    return rows


def markdown(doc: dict) -> str:
    lines = [f"Engine benchmark: {doc['bundle']} ({doc['model']}), provider {doc['provider']}, "
             f"graph {doc.get('decoder_graph', 'decoder')}.onnx, "
             f"{doc.get('threads') or 'default'} ORT thread(s), {doc.get('slots', '?')} KV slots, "
             f"{doc['rounds']} rounds, outputs {doc['min_new']}-{doc['max_new']} tokens, "
             f"{doc['requests_per_client']} requests per client", "",
             "tokens/s: while all clients have a request in (steady state); whole run: including the drain at "
             "the end. Speedup = continuous / this mode. Medians over rounds.", "",
             "| concurrency | mode | tokens/s | continuous speedup | tokens/s whole run | speedup whole run "
             "| TTFT p50 (ms) | TTFT p99 (ms) | rows/step |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def x(v: float | None) -> str:
        return f"{v:.2f}x" if v else "-"
    for r in doc["summary"]:
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['busy_tokens_per_s']:.0f} | "
                     f"{x(r['continuous_speedup'])} | {r['tokens_per_s']:.0f} | {x(r['continuous_speedup_whole_run'])} | "
                     f"{1e3 * r['ttft_p50_s']:.1f} | {1e3 * r['ttft_p99_s']:.1f} | {r['mean_rows_per_step']:.1f} |")
    return "\n".join(lines)


def step_scaling(runtime: ModelRuntime, rows: list[int], contexts: list[int], reps: int = 30, calls: int = 5,
                 src_tokens: int = 12) -> list[dict]:
    """Median ms of one decode step on r rows at c cached tokens each (a translation model's rows attend over
    `src_tokens` source tokens); `gain_per_row` = r x (1-row time at c) / (r-row time at c) when 1 is among `rows`."""
    if max(rows) > runtime.n_slots or max(contexts) + 1 > runtime.max_len or min(rows + contexts) < 1:
        raise ValueError(f"rows must be in [1, {runtime.n_slots}] and contexts in [1, {runtime.max_len - 1}]")
    rng = np.random.default_rng(0)
    ids = rng.integers(4, runtime.vocab_size, (max(rows), 1)).astype(np.int64)
    if runtime.is_encoder_decoder:
        runtime.encode(0, [[int(t) for t in rng.integers(4, runtime.vocab_size, src_tokens)] for _ in range(max(rows))])
    cases = [(r, c) for c in contexts for r in rows]
    times: dict[tuple[int, int], list[float]] = {k: [] for k in cases}
    # One block per row count, as the engine runs steps of one shape back to back (a one-row step right after
    # 27-row steps measured 0.41-0.50 ms instead of 0.33-0.40: caches and clocks take a while to settle);
    # the contexts alternate within each block.
    for r in rows:
        for rep in range(reps + 1):  # the first rep warms up
            for c in contexts:
                args = (ids[:r], np.ones(r, np.int64), np.full(r, c, np.int64))
                runtime.step(0, *args)
                t0 = time.perf_counter()
                for _ in range(calls):
                    runtime.step(0, *args)
                if rep:
                    times[(r, c)].append((time.perf_counter() - t0) / calls)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return [{"rows": r, "context": c, "step_ms": round(med[(r, c)], 3),
             "gain_per_row": round(r * med[(1, c)] / med[(r, c)], 2) if (1, c) in med else None} for r, c in cases]


def step_scaling_markdown(rows: list[dict]) -> str:
    lines = ["| cached tokens per row | rows | decode step (ms) | gain per row over one row |",
             "| ---: | ---: | ---: | ---: |"]
    for x in rows:
        gain = "-" if x["gain_per_row"] is None else f"{x['gain_per_row']:.2f}x"
        lines.append(f"| {x['context']} | {x['rows']} | {x['step_ms']:.3f} | {gain} |")
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> dict:
    slots = max(args.slots or 0, max(args.concurrency))
    cfg = EngineConfig(max_slots=slots, max_waiting=4 * slots, max_tokens_per_step=args.max_tokens_per_step,
                       provider=args.provider, intra_op_threads=args.threads, max_batch_size=slots)
    from export.bundle import load_bundle
    from serving.engine.runtime import ModelRuntime

    runtime = ModelRuntime(load_bundle(args.bundle), n_slots=slots, provider=args.provider,
                           intra_op_threads=args.threads, decoder_graph=args.decoder_graph)
    engine = Engine(runtime, cfg)
    prompts, prompt_source = text_prompts(args.bundle, args.data_dir) if args.data_dir else (None, None)
    await engine.start()
    rec = Recorder(engine)
    await run_once(engine, rec, BatchingMode.CONTINUOUS, slots, workload(slots, engine, 4, 8, seed=99), 0.0, "warm")
    runs = []
    for rnd in range(args.rounds):
        for c in args.concurrency:
            work = workload(c * args.requests_per_client, engine, args.min_new, args.max_new, seed=c, prompts=prompts)
            order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))
            for mode in order:
                if mode.value not in args.modes:
                    continue
                r = await run_once(engine, rec, mode, c, work, args.batch_wait_s, f"{mode.value}-{c}-{rnd}",
                                  args.temperature)
                r["round"] = rnd
                runs.append(r)
                print(f"round {rnd} c={c:3d} {mode.value:10s} {r['busy_tokens_per_s']:8.0f} tok/s  "
                      f"ttft p99 {1e3 * r['ttft_p99_s']:7.1f} ms", file=sys.stderr, flush=True)
    await engine.stop()
    bundle_cfg = engine.runtime.bundle.model_config if hasattr(engine.runtime, "bundle") else {}
    return {"bundle": str(args.bundle), "model": {k: bundle_cfg.get(k) for k in
                                                   ("arch", "d_model", "n_decoder_layers", "vocab_size", "max_len")},
            "provider": getattr(engine.runtime, "provider", "?"), "threads": args.threads, "slots": slots,
            "decoder_graph": getattr(engine.runtime, "decoder_graph", "decoder"),
            "rounds": args.rounds, "min_new": args.min_new, "max_new": args.max_new, "temperature": args.temperature,
            "prompts": prompt_source or "random ids, 4-24 tokens",
            "mean_prompt_tokens": _mean_prompt(engine, prompts),
            "requests_per_client": args.requests_per_client, "batch_wait_s": args.batch_wait_s,
            "max_tokens_per_step": args.max_tokens_per_step,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "runs": runs, "summary": summarize(runs)}


def bench_args(bundle: Path, **overrides: Any) -> argparse.Namespace:
    """The command line's arguments with its defaults, for callers that run `bench` themselves."""
    args = parser().parse_args([str(bundle)])
    unknown = set(overrides) - set(vars(args))
    if unknown:
        raise TypeError(f"bench.engine has no arguments {sorted(unknown)}")
    return argparse.Namespace(**{**vars(args), **overrides})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", nargs="?", type=Path, help="model bundle directory")
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    p.add_argument("--table", type=Path, help="print the markdown table of an earlier --out file and exit")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--modes", nargs="+", default=[m.value for m in MODES], choices=[m.value for m in MODES])
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--slots", type=int, help="KV slots in the pool (default: the largest concurrency)")
    p.add_argument("--batch-wait-s", type=float, default=0.01)
    p.add_argument("--data-dir", type=Path, default=None,
                   help="prompts from this prepared data (the HTTP load's own, loadtest/workloads.py) instead of "
                        "random ids of 4-24 tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; > 0: sampled at this temperature, a seed per request (the HTTP runs sample at 1)")
    p.add_argument("--max-tokens-per-step", type=int, default=2048)
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: the runtime's)")
    p.add_argument("--decoder-graph", choices=["decoder", "decoder_cpu"], default=None,
                   help="the bundle's decoder graph to run (default: the runtime's choice for the provider)")
    p.add_argument("--step-scaling", action="store_true",
                   help="instead of the engine benchmark: decode-step time of the runtime alone by rows and context")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 27], help="--step-scaling: batch sizes")
    p.add_argument("--contexts", type=int, nargs="+", default=[16, 48, 96, 144, 192],
                   help="--step-scaling: cached tokens per row")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return 0
    if args.bundle is None:
        p.error("BUNDLE is required (or --table FILE)")
    if args.step_scaling:
        from export.bundle import load_bundle
        from serving.engine.runtime import ModelRuntime

        runtime = ModelRuntime(load_bundle(args.bundle), n_slots=max(args.rows), provider=args.provider,
                               intra_op_threads=args.threads, decoder_graph=args.decoder_graph)
        try:
            rows = step_scaling(runtime, sorted(set(args.rows)), args.contexts)
        except ValueError as e:
            p.error(str(e))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"bundle": str(args.bundle), "threads": args.threads,
                                            "provider": runtime.provider, "step_scaling": rows}, indent=2) + "\n")
        print(step_scaling_markdown(rows))
        return 0
    doc = asyncio.run(bench(args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
