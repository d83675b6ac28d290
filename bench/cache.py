"""`python -m bench.cache`: what the response cache gains when half of the requests repeat an earlier one.

`kvserve serve`'s production config (deploy/serve_config.yaml through `prepare_config`, as bench/soak.py runs it) on
a free port, with the translate model's response cache on (`response_cache_entries`), is driven by wrk
(bench/wrk.py: a load generator in C, so the two cores go to the server rather than to a Python client) with
closed-loop clients sending `/v1/translate` requests over the test split's sentences, half of them repeating an
earlier request (loadtest/workloads.py, `--repeat-fraction 0.5`). Each round runs the load twice, the order
alternating: every request with `Cache-Control: no-cache` (the cache bypassed: what the server does without one)
and without (the cache used). Each run has keys of its own (its own `max_tokens`), so no run finds answers an
earlier run stored, and the request list is longer than a run gets through (no wrap-around repeats). Greedy and
beam 4. The gain is the cached run's requests/s over the bypassed run's, median over the rounds.

Does not measure: a load generator on another machine, or the answers' equality (tests/test_response_cache.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.compute import machine
from bench.http import GENERATED, STEPS, scrape_now
from bench.soak import free_port, soak_config
from bench.wrk import run_wrk
from loadtest.config import LoadConfig, Workload
from loadtest.promscrape import Snapshot
from loadtest.workloads import Inputs, load_inputs, request_body, source_index

MODEL = "translate"
BYPASS = {"Cache-Control": "no-cache"}
DECODES = {"greedy": 1, "beam 4": 4}  # name -> beam_size
STEP_SECONDS = "kvserve_engine_step_duration_seconds_sum"  # the engine steps' own time


def cache_config(artifacts: Path, port: int, entries: int) -> dict[str, Any]:
    """The production Serve config with the translate model's response cache holding up to `entries` answers."""
    cfg = soak_config(artifacts, port)
    spec = next(m for m in cfg["applications"][0]["args"]["models"] if m["name"] == MODEL)
    spec["response_cache_entries"] = entries
    return cfg


def inputs(data_dir: Path) -> Inputs:
    """The English side of every split (test first, then valid and train; each sentence once): the test split
    alone (817 sentences) holds fewer distinct inputs than a run sends. Without prepared data, the load tester's
    built-in sentences (enough for `--quick` only: a run that wraps around is marked so)."""
    texts: dict[str, None] = {}
    for split in ("test", "valid", "train"):
        path = data_dir / "translate" / f"{split}.tsv"
        if not path.is_file():
            return load_inputs(Workload.TRANSLATE, data_dir)
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.setdefault(line.split("\t", 1)[0], None)
    return Inputs(tuple(texts), f"{len(texts)} English sentences of {data_dir}/translate", False)


def bodies(url: str, texts: Inputs, beam_size: int, max_tokens: int, n: int, seed: int) -> list[dict[str, Any]]:
    """Up to `n` translate bodies, half of them repeating an earlier one (the load tester's `--repeat-fraction
    0.5`), the others each with an input of its own (fewer bodies when `texts` runs out of inputs)."""
    cfg = LoadConfig(url=url, workload=Workload.TRANSLATE, concurrency=1, requests=n, max_tokens=max_tokens,
                     beam_size=beam_size, seed=seed, repeat_fraction=0.5)
    out, fresh = [], 0
    for i in range(n):
        fresh += source_index(cfg, i) == i
        if fresh > len(texts.texts):
            break
        out.append(request_body(cfg, texts, i))
    return out


def measure(url: str, texts: Inputs, rounds: int, seconds: float, connections: int, n: int,
            seed: int) -> dict[str, Any]:
    """{decode: {"bypassed": [req/s per round], "cached": [...], "gain": median ratio, "all_hits": req/s, ...}}."""
    out: dict[str, Any] = {}
    run_no, wrapped = 0, False
    for name, beam in DECODES.items():
        runs: dict[str, list[dict[str, Any]]] = {"bypassed": [], "cached": []}
        warm = bodies(url, texts, beam, 64, n, seed + 1)  # warm-up, not measured: keys no measured run uses
        run_wrk(url, "/v1/translate", warm, connections, 3, offset=0, headers=BYPASS)
        for rnd in range(rounds):
            for kind in ("bypassed", "cached") if rnd % 2 == 0 else ("cached", "bypassed"):
                run_no += 1
                load = bodies(url, texts, beam, 64 - run_no, n, seed)  # keys of its own: its own max_tokens
                before = scrape_now(url)
                r = run_wrk(url, "/v1/translate", load, connections, seconds, offset=0,
                            headers=BYPASS if kind == "bypassed" else None)
                r["engine"] = engine_rates(before, scrape_now(url), r["seconds"])
                wrapped |= r["answers"] >= len(load)  # then more than half of the requests repeated
                runs[kind].append(r)
                if kind == "cached":  # its first answers - connections requests were all answered, so stored
                    stored = load[: max(0, r["answers"] - connections)]
                print(f"bench cache {name:7s} r{rnd} {kind:8s} {r['requests_per_s']:7.1f} req/s  p99 "
                      f"{r['e2e_p99_s']:.3f} s  errors {r['errors']}  wrk cpu {r['load_generator_cpu']:.3f}",
                      file=sys.stderr, flush=True)
        # every request a hit: the answers the last cached run stored, sent again (the hit path's ceiling)
        unique = list({json.dumps(b, sort_keys=True): b for b in stored}.values())
        hits = run_wrk(url, "/v1/translate", unique, connections, seconds, offset=0)
        print(f"bench cache {name:7s} all hits {hits['requests_per_s']:7.1f} req/s", file=sys.stderr, flush=True)
        rates = {k: [r["requests_per_s"] for r in v] for k, v in runs.items()}
        gains = [c / b for c, b in zip(rates["cached"], rates["bypassed"], strict=True)]
        out[name] = {**{k: [round(x, 1) for x in v] for k, v in rates.items()},
                     "gain": round(statistics.median(gains), 2),
                     "all_hits": round(hits["requests_per_s"], 1),
                     "wrapped": wrapped,
                     "errors": sum(r["errors"] for v in runs.values() for r in v) + hits["errors"],
                     "e2e_p99_s": {k: round(statistics.median(r["e2e_p99_s"] for r in v), 4) for k, v in runs.items()},
                     "engine": {k: _median_rates([r["engine"] for r in v]) for k, v in runs.items()}}
    return out


def engine_rates(before: Snapshot, after: Snapshot, seconds: float) -> dict[str, float] | None:
    """The translator's engine over one run, from the server's exact counters: steps per second (the engine steps
    all the time under this load, so fewer steps mean slower ones), tokens per step (how full the steps were) and
    the mean step's own duration in ms (ONNX Runtime and the step's Python; what is left of 1/steps_per_s is the
    time between steps: scheduling, hand-overs, the engine lock)."""
    if before.error or after.error:
        return None
    steps = (after.total(STEPS, model=MODEL) or 0.0) - (before.total(STEPS, model=MODEL) or 0.0)
    tokens = (after.total(GENERATED, model=MODEL) or 0.0) - (before.total(GENERATED, model=MODEL) or 0.0)
    spent = (after.total(STEP_SECONDS, model=MODEL) or 0.0) - (before.total(STEP_SECONDS, model=MODEL) or 0.0)
    if steps <= 0:
        return None
    return {"steps_per_s": steps / seconds, "tokens_per_step": tokens / steps, "step_ms": 1000 * spent / steps}


def _median_rates(rates: list[dict[str, float] | None]) -> dict[str, float] | None:
    got = [r for r in rates if r]
    return {k: round(statistics.median(r[k] for r in got), 2) for k in got[0]} if got else None


def markdown(result: dict[str, Any]) -> list[str]:
    """The figures as a table (the bench doc's section 7 and `python -m bench.cache`)."""
    lines = ["| requests | bypassed, req/s | cached, req/s | gain (median) | every request a hit, req/s | engine "
             "steps/s, bypassed / cached | ms per step, bypassed / cached | tokens per step, bypassed / cached |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["decodes"].items():
        eng = r.get("engine") or {}
        by, ca = eng.get("bypassed") or {}, eng.get("cached") or {}
        steps = f"{by['steps_per_s']:.0f} / {ca['steps_per_s']:.0f}" if by and ca else "n/a"
        fill = f"{by['tokens_per_step']:.1f} / {ca['tokens_per_step']:.1f}" if by and ca else "n/a"
        own = f"{by['step_ms']:.2f} / {ca['step_ms']:.2f}" if by.get("step_ms") and ca.get("step_ms") else "n/a"
        lines.append(f"| {name} | {', '.join(map(str, r['bypassed']))} | {', '.join(map(str, r['cached']))} | "
                     f"{r['gain']:.2f}x | {r['all_hits']} | {steps} | {own} | {fill} |")
    if any(r["wrapped"] for r in result["decodes"].values()):
        lines += ["", f"A run sent every prepared request and started over ({result['inputs']}): more than half of "
                      "its requests repeated an earlier one."]
    return lines + [""]


def run(artifacts: Path, rounds: int, seconds: float, connections: int, n: int = 12000, entries: int = 16384,
        seed: int = 561) -> dict[str, Any]:
    """The production config with the translator's cache on, `measure`d; the figures without the machine."""
    from serving.server.config import validate_serve_config
    from serving.server.launch import cpus_needed, start, stop

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = validate_serve_config(cache_config(artifacts, port, entries))
    texts = inputs(artifacts / "data")
    start(cfg, num_cpus=cpus_needed(cfg), timeout_s=600)
    try:
        decodes = measure(url, texts, rounds, seconds, connections, n, seed)
    finally:
        stop()
    return {"rounds": rounds, "seconds": seconds, "connections": connections, "entries": entries,
            "inputs": texts.source, "decodes": decodes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="holds bundles/ and data/")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0, help="each run")
    p.add_argument("--connections", type=int, default=32, help="wrk connections (32: the 16 KV slots stay full)")
    p.add_argument("--bodies", type=int, default=12000, help="requests prepared per run (more than a run sends)")
    p.add_argument("--entries", type=int, default=16384, help="the cache's response_cache_entries")
    p.add_argument("--seed", type=int, default=561)
    p.add_argument("--out", type=Path, default=None, help="the figures' JSON (default: ARTIFACTS/bench/cache.json)")
    args = p.parse_args(argv)
    result = {"machine": machine(), **run(args.artifacts, args.rounds, args.seconds, args.connections, args.bodies,
                                          args.entries, args.seed)}
    out = args.out or args.artifacts / "bench" / "cache.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"Measured {result['machine']['date_utc']} at commit {result['machine']['git']} on "
          f"{result['machine']['cpu']} ({', '.join(result['machine']['cpu_flags'])})\n")
    print("\n".join(markdown(result)))
    return 1 if any(r["errors"] for r in result["decodes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
