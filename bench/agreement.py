"""Does `kvserve loadtest` measure what a load generator nobody here wrote measures? Locust against it.

    python -m bench.agreement [--bundle artifacts/bundles/generate] [--seconds 30] [--rounds 2]

Starts the bench's Ray Serve app (bench/http.py: the shipped config reduced to the generate model, placed as
`kvserve serve` places it, 32 KV slots, 1 ORT thread) and drives it in turns with `kvserve loadtest`
(loadtest/runner.py) and Locust headless (loadtest/locustfile.py, its own process: `locust --headless`),
both with 32 closed-loop clients sending the same non-streaming /v1/completions requests (64 sampled tokens
each, test-split prompts), for the same time; the order alternates each round. Output tokens/s: the load
tester's over its measured window; Locust's is the total the locustfile counts over the run (it logs it when
the test stops). The two should agree within 15% (docs/benchmarks.md).

Does not measure: streaming (Locust's row times then are whole streams) or open-loop arrivals.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.http import BenchServer, HttpPlan
from loadtest.config import LoadConfig, Workload
from loadtest.runner import run_load

ROOT = Path(__file__).resolve().parents[1]
CLIENTS, TOKENS = 32, 64
LOCUST_TOTAL = re.compile(r"kvserve locust: output tokens (\d+) in ([\d.]+) s = ([\d.]+) tokens/s")


def kvserve_loadtest(url: str, data_dir: Path, seconds: float, tokens: int = TOKENS) -> float:
    cfg = LoadConfig(url, workload=Workload.COMPLETIONS, concurrency=CLIENTS, duration_s=seconds, warmup_s=0.0,
                     seed=0, max_tokens=tokens, min_tokens=tokens, stream=False, temperature=1.0,
                     data_dir=data_dir, timeout_s=60, scrape_metrics=False)
    return float(asyncio.run(run_load(cfg)).throughput["output_tokens_per_s"])


def locust(url: str, data_dir: Path, seconds: float, work: Path, tokens: int = TOKENS) -> float:
    exe = shutil.which("locust") or str(Path(sys.executable).with_name("locust"))
    cmd = [exe, "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "--host", url,
           "--users", str(CLIENTS), "--spawn-rate", str(CLIENTS), "--run-time", f"{seconds:g}s", "--stop-timeout",
           "30", "--workload", "completions", "--max-tokens", str(tokens), "--stream", "no", "--data-dir",
           str(data_dir), "--json-file", str(work / "locust"), "--only-summary"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=seconds + 120)
    found = LOCUST_TOTAL.search(out.stderr + out.stdout)
    if not found:
        raise RuntimeError(f"Locust printed no token total (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return float(found.group(3))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "artifacts" / "bundles" / "generate")
    p.add_argument("--data-dir", type=Path, default=ROOT / "artifacts" / "data")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("artifacts/bench/agreement.json"))
    args = p.parse_args(argv)
    result = compare(args.bundle, args.data_dir, args.seconds, args.rounds, args.out.parent / "agreement_work")
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


def compare(bundle: Path, data_dir: Path, seconds: float, rounds: int, work: Path,
            tokens: int = TOKENS) -> dict[str, Any]:
    """Both load generators in turns against one bench server; their output tokens/s and the ratio."""
    work.mkdir(parents=True, exist_ok=True)
    plan = HttpPlan(concurrency=CLIENTS, slots=CLIENTS, threads=1)
    rows: list[dict[str, Any]] = []
    with BenchServer(ROOT / "deploy" / "serve_config.yaml", bundle, plan, work) as server:
        kvserve_loadtest(server.url, data_dir, 5.0)  # warm-up
        for rnd in range(rounds):
            order = ["kvserve loadtest", "locust"] if rnd % 2 == 0 else ["locust", "kvserve loadtest"]
            for tool in order:
                t0 = time.monotonic()
                tps = (kvserve_loadtest(server.url, data_dir, seconds, tokens) if tool == "kvserve loadtest"
                       else locust(server.url, data_dir, seconds, work, tokens))
                rows.append({"round": rnd, "tool": tool, "output_tokens_per_s": tps,
                             "wall_s": round(time.monotonic() - t0, 1)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    mean = {tool: sum(r["output_tokens_per_s"] for r in rows if r["tool"] == tool) / rounds
            for tool in ("kvserve loadtest", "locust")}
    if not all(mean.values()):
        raise RuntimeError(f"a load generator counted no output tokens ({mean}): the requests failed")
    return {"clients": CLIENTS, "tokens": tokens, "seconds": seconds, "placement": plan.placement,
            "rows": rows, "mean": mean, "locust_over_kvserve": mean["locust"] / mean["kvserve loadtest"]}


def markdown(result: dict[str, Any]) -> str:
    ratio = result["locust_over_kvserve"]
    lines = ["| round | load generator | output tok/s |", "| ---: | --- | ---: |"]
    lines += [f"| {r['round']} | {r['tool']} | {r['output_tokens_per_s']:.0f} |" for r in result["rows"]]
    lines += ["", f"Locust / `kvserve loadtest`: **{ratio:.3f}** ({'within' if abs(ratio - 1) <= 0.15 else 'beyond'} "
              f"15%): Locust {result['mean']['locust']:.0f}, `kvserve loadtest` {result['mean']['kvserve loadtest']:.0f} tok/s "
              f"(means over rounds)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
