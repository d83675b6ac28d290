"""`kvserve loadtest`: the command line of the load tester.

`register(subparsers)` adds the subcommand to the project's `kvserve` CLI (its handler is
`args.func(args) -> exit status`); `python -m loadtest ...` runs the same command on its own.
Exit status: 0 done and every SLO met, 1 an SLO missed, 2 bad arguments, 3 no measured request succeeded,
130 interrupted. Owns argument parsing and the console summary only; the run is loadtest/runner.py's.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loadtest.config import Arrival, LoadConfig, Workload
from loadtest.report import Report
from loadtest.runner import run_load
from loadtest.slo import parse_slos

EXIT_OK, EXIT_SLO_MISSED, EXIT_USAGE, EXIT_NOTHING_SUCCEEDED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DESCRIPTION = ("Load-test a kvserve server: open-loop arrivals at --rate or closed-loop --concurrency, "
               "latency percentiles from the stream, goodput under --slo, the server's /metrics deltas; "
               "writes report.json, report.md, requests.jsonl and PNG plots to --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="base URL of the server, e.g. http://127.0.0.1:8000 (the only host contacted)")
    p.add_argument("--workload", choices=[w.value for w in Workload], default=Workload.GENERATE.value)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="open loop: mean arrivals per second")
    load.add_argument("--concurrency", type=int, help="closed loop: clients each with one request in flight")
    p.add_argument("--duration", type=float, help="measured phase in seconds (default 60 unless --requests)")
    p.add_argument("--requests", type=int, help="stop after this many measured requests")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds at the start left out of the stats")
    p.add_argument("--arrival", choices=[a.value for a in Arrival], default=Arrival.POISSON.value)
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma arrivals: coefficient of variation of the gaps (1 = Poisson, >1 = bursty)")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, input choice and sampling seeds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int,
                   help="vary output lengths: request i asks for a max_tokens drawn uniformly (seeded) in "
                        "[--min-tokens, --max-tokens]")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="stream answers (default: yes for generate and completions; translate never streams)")
    p.add_argument("--temperature", type=float, default=1.0, help="generate/completions sampling temperature")
    p.add_argument("--beam-size", type=int, help="translate: beam size (default: the server's)")
    p.add_argument("--model", default="generate", help="completions: the OpenAI `model` field")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request deadline in seconds")
    p.add_argument("--max-inflight", type=int, default=1024,
                   help="open loop: arrivals beyond this many outstanding requests are dropped and counted")
    p.add_argument("--slo", help="comma-separated METRIC_STAT=SECONDS, e.g. ttft_p99=0.5,e2e_p99=2 "
                                 "(metrics ttft, itl, tpot, e2e; stats p50, p90, p99, pNN, mean); "
                                 "a missed SLO makes the exit status 1")
    p.add_argument("--out", type=Path, default=Path("artifacts/loadtest"), help="report directory")
    p.add_argument("--data-dir", type=Path, default=Path("artifacts/data"),
                   help="prepared data (test split); a built-in sentence list is used if it is missing")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape URL/metrics before and after")
    p.add_argument("--api-key-env", dest="api_key_env", metavar="NAME",
                   help="environment variable holding the server's API key, sent as 'Authorization: Bearer'")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.add_argument("--repeat-fraction", type=float, dest="repeat_fraction",
                   help="share of requests that repeat an earlier request's input and seed (a response cache's "
                        "workload), e.g. 0.5")
    p.add_argument("--no-cache", action="store_true", dest="no_cache",
                   help="send Cache-Control: no-cache, so that the server's response cache is bypassed")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `loadtest` to a CLI's subparsers; the handler is stored as `func` (returns the exit status)."""
    p = subparsers.add_parser("loadtest", help="load-test a running server", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run_cli)
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Raises ValueError with a message naming the bad option."""
    return LoadConfig(
        url=args.url, workload=Workload(args.workload), rate=args.rate, concurrency=args.concurrency,
        duration_s=args.duration, requests=args.requests, warmup_s=args.warmup, arrival=Arrival(args.arrival),
        burstiness=args.burstiness, seed=args.seed, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stream=args.stream,
        temperature=args.temperature, beam_size=args.beam_size, model=args.model, timeout_s=args.timeout,
        max_inflight=args.max_inflight, data_dir=args.data_dir, scrape_metrics=not args.no_metrics,
        api_key_env=args.api_key_env, repeat_fraction=args.repeat_fraction, no_cache=args.no_cache,
        progress=not args.quiet, slos=parse_slos(args.slo))


def exit_status(report: Report) -> int:
    if report.totals["succeeded"] == 0:
        return EXIT_NOTHING_SUCCEEDED
    return EXIT_OK if report.slo_met else EXIT_SLO_MISSED


def run_cli(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"kvserve loadtest: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = asyncio.run(run_load(config))
    except KeyboardInterrupt:
        print("kvserve loadtest: interrupted; no report written", file=sys.stderr)
        return EXIT_INTERRUPTED
    paths = report.write(args.out)
    print(summary_lines(report, paths["markdown"]))
    return exit_status(report)


def summary_lines(report: Report, markdown: Path) -> str:
    t, th, lat = report.totals, report.throughput, report.latency
    ms = lambda v: "n/a" if v is None else f"{v * 1000:.1f} ms"  # noqa: E731
    lines = [
        f"{t['succeeded']}/{t['measured']} measured requests succeeded ({t['rejected_429']} x 429) in "
        f"{th['window_s']:.1f} s: {th['requests_per_s']:.2f} req/s, {th['output_tokens_per_s']:.1f} output tok/s, "
        f"goodput {th['goodput_requests_per_s']:.2f} req/s",
        f"TTFT p50/p99 {ms(lat['ttft']['p50'])}/{ms(lat['ttft']['p99'])} · "
        f"ITL p50/p99 {ms(lat['itl']['p50'])}/{ms(lat['itl']['p99'])} · "
        f"e2e p50/p99 {ms(lat['e2e']['p50'])}/{ms(lat['e2e']['p99'])}",
    ]
    if report.inputs_fallback:
        lines.append(f"inputs: {report.inputs}")
    for r in report.slo_results:
        lines.append(f"SLO {r.slo.name} <= {ms(r.slo.threshold_s)}: observed {ms(r.observed)} -> "
                     f"{'met' if r.met else 'MISSED'}")
    if report.totals["succeeded"] == 0:
        lines.append(f"no measured request succeeded; errors: {report.errors}")
    lines.append(f"report: {markdown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=DESCRIPTION)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))
