"""kvserve's load tester: open/closed-loop HTTP load, streaming-aware latency, goodput, SLO gate, reports.

Library entry point for benchmarks: `report = await run_load(LoadConfig(url, ...))`, then
`report.to_json()`, `report.to_markdown()` or `report.write(out_dir)`. Torch-free: it needs only httpx,
numpy, matplotlib, tqdm and prometheus-client. It talks only to the URL it is given (and its /metrics).
"""
from loadtest.config import SLO, Arrival, LoadConfig, LoadMode, Workload
from loadtest.report import Report
from loadtest.runner import run_load
from loadtest.slo import parse_slos

__all__ = ["SLO", "Arrival", "LoadConfig", "LoadMode", "Report", "Workload", "parse_slos", "run_load"]
