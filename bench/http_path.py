"""Where the CPU of the HTTP path goes: tokens/s through HTTP vs the engine in-process, per process.

    python -m bench.http_path [--data-plane haproxy,python] [--placement colocated,split] [--seconds 12]
                              [--stream-interval 0,0.05] [--profile DIR]

For each server -- a data plane (Serve's HAProxy, kvserve's default, or Ray's Python proxy), a placement
(the model in the ingress replica, `kvserve serve`'s default, or in its own deployment) and a
`stream_interval_s` -- it starts the bench's Ray Serve app (bench/http.py: the shipped config reduced to the
generate model, continuous batching, 32 KV slots, 1 ORT thread), drives it with 32 closed-loop clients of the
load tester (64 sampled tokens per request): streaming /v1/generate, then non-streaming /v1/completions, and
samples the CPU time of each process while it runs: the proxy (HAProxy or Ray's), the ingress replica, the
model replica, Ray's own daemons and the load generator (this process). The same engine runs in-process
(bench/engine.py, 32 clients, same slots and threads) before and after: the ratio HTTP / in-process is what
the HTTP path keeps of the engine's speed. `--profile DIR` adds py-spy profiles of every process.

Does not measure: more than one replica or node, translation, or latency percentiles beyond TTFT p99 (the
load tester's report has them). Everything shares this machine's cores, the load generator included; its
own CPU is reported beside the server's.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import psutil

from bench.http import BenchServer, HttpPlan
from loadtest.config import LoadConfig, Workload
from loadtest.runner import run_load

ROOT = Path(__file__).resolve().parents[1]
CLIENTS, TOKENS = 32, 64
PROFILED = ("proxy", "ingress", "replica", "load generator")  # Python processes worth a py-spy profile
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))  # the venv's, if not on PATH
IDLE_LEAVES = ("select (", "epoll", "poll (", "sleep (", "acquire (", "wait (", "_wait_for_tstate_lock")
# Process roles by what Ray puts in the process title / command line.
ROLES = (("ServeReplica:kvserve:ingress", "ingress"), ("ServeReplica:kvserve:generate", "replica"),
         ("ProxyActor", "proxy"), ("haproxy", "proxy"), ("ServeController", "controller"), ("gcs_server", "gcs"),
         ("raylet", "raylet"))
RUNS = (("streaming /v1/generate", Workload.GENERATE, True), ("non-streaming /v1/completions", Workload.COMPLETIONS, False))


def _role(p: psutil.Process) -> str | None:
    try:
        text = p.name() + " " + " ".join(p.cmdline())
    except psutil.Error:
        return None
    return next((role for key, role in ROLES if key in text), None)


class CpuShares:
    """CPU seconds per second of wall time, per process role, between `start` and `stop`."""

    def __init__(self) -> None:
        self.procs: dict[str, list[psutil.Process]] = {}
        for p in psutil.process_iter():
            role = _role(p)
            if role:
                self.procs.setdefault(role, []).append(p)
        self.procs["load generator"] = [psutil.Process()]

    def _cpu(self) -> dict[str, float]:
        out = {}
        for role, procs in self.procs.items():
            total = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            out[role] = total
        return out

    def start(self) -> None:
        self.t0, self.c0 = time.monotonic(), self._cpu()

    def stop(self) -> dict[str, float]:
        dt, c1 = time.monotonic() - self.t0, self._cpu()
        return {role: round((c1[role] - self.c0[role]) / dt, 3) for role in c1}


class Profiles:
    """py-spy profiles (`record -f raw`: collapsed stacks) of each process role while a run is measured."""

    def __init__(self, out_dir: Path | None, shares: CpuShares, name: str, seconds: float) -> None:
        self.procs: list[tuple[Path, subprocess.Popen]] = []
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        for role, procs in shares.procs.items():
            if role not in PROFILED:
                continue
            for p in procs:
                path = out_dir / f"{name}.{role.replace(' ', '_')}.{p.pid}.txt"
                cmd = [PY_SPY, "record", "-r", "50", "-d", str(int(seconds)), "-f", "raw", "-o", str(path),
                       "-p", str(p.pid), "--nonblocking", "--threads"]
                self.procs.append((path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))

    def wait(self) -> list[Path]:
        for _, proc in self.procs:
            proc.wait(timeout=120)
        return [path for path, _ in self.procs if path.exists()]


def top_frames(path: Path, n: int = 12) -> list[tuple[str, float]]:
    """The `n` functions with the most samples on the stack (inclusive share) in a collapsed-stack profile,
    ignoring idle threads (the samples whose leaf is a wait: select/epoll/poll/sleep/acquire)."""
    total, inclusive = 0, {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or any(w in frames[-1] for w in IDLE_LEAVES):
            continue
        total += int(count)
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + int(count)
    return [(f, c / total) for f, c in sorted(inclusive.items(), key=lambda kv: -kv[1])[:n]] if total else []


def _load(url: str, workload: Workload, stream: bool, seconds: float, data_dir: Path, scrape: bool = False,
          tokens: int = TOKENS) -> Any:
    cfg = LoadConfig(url, workload=workload, concurrency=CLIENTS, duration_s=seconds, warmup_s=min(2.0, seconds / 4),
                     seed=0, max_tokens=tokens, min_tokens=tokens, stream=stream, temperature=1.0,
                     data_dir=data_dir, timeout_s=60, scrape_metrics=scrape)
    return asyncio.run(run_load(cfg))


DATA_PLANES = {"haproxy": "1", "python": "0"}  # Serve's HAProxy data plane (kvserve's default) or Ray's Python proxy


@contextlib.contextmanager
def data_plane(name: str) -> Iterator[None]:
    """Ray started inside this block gets `name`'s data plane (serving/server/ray_env.py DATA_PLANE_ENV)."""
    from serving.server.ray_env import DATA_PLANE_ENV

    saved = {k: os.environ.get(k) for k in DATA_PLANE_ENV}
    os.environ.update({k: DATA_PLANES[name] for k in DATA_PLANE_ENV})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def http_runs(bundle: Path, data_dir: Path, interval_s: float, seconds: float, work: Path,
              placement: str = "colocated", profile_dir: Path | None = None,
              plane: str = "haproxy", tokens: int = TOKENS) -> list[dict[str, Any]]:
    """Both runs against one server whose generate model streams with `interval_s`, in the ingress replica
    (`colocated`, as `kvserve serve` runs it) or in its own deployment (`split`), behind `plane`'s proxy."""
    import bench.http as bench_http

    shipped_config = bench_http.bench_serve_config

    def with_interval(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raw = shipped_config(*args, **kwargs)
        for spec in raw["applications"][0]["args"]["models"]:
            spec["stream_interval_s"] = interval_s
        return raw
    bench_http.bench_serve_config = with_interval
    plan = HttpPlan(concurrency=CLIENTS, slots=CLIENTS, threads=1, placement=placement)
    out = []
    try:
        with data_plane(plane), BenchServer(ROOT / "deploy" / "serve_config.yaml", bundle, plan, work) as server:
            for name, workload, stream in RUNS:
                _load(server.url, workload, stream, 3.0, data_dir, tokens=tokens)  # warm-up
                shares = CpuShares()
                shares.start()
                tag = f"{plane}-{placement}-{'stream' if stream else 'complete'}-{interval_s:g}"
                profiles = Profiles(profile_dir, shares, tag, seconds)
                report = _load(server.url, workload, stream, seconds, data_dir, scrape=True, tokens=tokens)
                cpu = shares.stop()
                batch = (report.server or {}).get("batch_size") or {}
                for path in profiles.wait():
                    print(f"profile {path}:", file=sys.stderr)
                    for frame, share in top_frames(path):
                        print(f"  {share:6.1%}  {frame}", file=sys.stderr)
                ttft = report.latency.get("ttft") or {}
                out.append({"run": name, "data_plane": plane, "placement": placement, "stream_interval_s": interval_s,
                            "tokens_per_s": report.throughput["output_tokens_per_s"],
                            "ttft_p99_s": ttft.get("p99") if isinstance(ttft, dict) else None,
                            "succeeded": report.totals["succeeded"], "errors": report.errors, "cpu": cpu,
                            "steps": batch.get("count"), "rows_per_step": batch.get("mean")})
                print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    finally:
        bench_http.bench_serve_config = shipped_config
    return out


def inprocess_tokens_per_s(bundle: Path, work: Path, data_dir: Path, tokens: int = TOKENS) -> float:
    """The engine alone, in this process (bench/engine.py): 32 clients, 32 slots, 1 thread, 64 tokens each, the
    HTTP runs' prompts, sampled at temperature 1 with a seed per request as they are."""
    import bench.engine as bench_engine

    out = work / "engine.json"
    bench_engine.main([str(bundle), "--concurrency", str(CLIENTS), "--modes", "continuous", "--rounds", "2",
                       "--min-new", str(tokens), "--max-new", str(tokens), "--slots", str(CLIENTS),
                       "--threads", "1", "--temperature", "1", "--data-dir", str(data_dir), "--out", str(out)])  # the HTTP runs' requests
    return float(json.loads(out.read_text())["summary"][0]["busy_tokens_per_s"])  # steady state, as bench.engine reports


def markdown(result: dict[str, Any]) -> str:
    roles = ["proxy", "ingress", "replica", "load generator", "controller", "gcs", "raylet"]
    before_after = result.get("inprocess_runs") or [result["inprocess_tokens_per_s"]]
    lines = [f"In-process engine (32 clients): **{result['inprocess_tokens_per_s']:.0f} tok/s** (mean of "
             + ", ".join(f"{v:.0f}" for v in before_after) + ": before and after the HTTP runs).", "",
             "| run | proxy | placement | stream_interval_s | tok/s | HTTP / in-process | TTFT p99 (s) | "
             + " | ".join(f"CPU {r}" for r in roles) + " |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in roles) + " |"]
    for r in result["runs"]:
        ttft = f"{r['ttft_p99_s']:.3f}" if r["ttft_p99_s"] is not None else "-"
        lines.append(f"| {r['run']} | {r.get('data_plane', 'python')} | {r.get('placement', 'split')} | "
                     f"{r['stream_interval_s']:g} | {r['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s'] / result['inprocess_tokens_per_s']:.2f} | {ttft} | "
                     + " | ".join(f"{r['cpu'].get(role, 0.0):.2f}" for role in roles) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "artifacts" / "bundles" / "generate")
    p.add_argument("--data-dir", type=Path, default=ROOT / "artifacts" / "data")
    p.add_argument("--seconds", type=float, default=12.0, help="measured phase of each run")
    p.add_argument("--stream-interval", default="0", help="comma-separated stream_interval_s values to compare")
    p.add_argument("--placement", default="colocated", help="comma-separated: colocated (the model in the ingress "
                   "replica, `kvserve serve`'s default), split (in its own deployment)")
    p.add_argument("--data-plane", default="haproxy", help="comma-separated: haproxy (Serve's HAProxy data plane, "
                   "kvserve's default), python (Ray's Python proxy)")
    p.add_argument("--out", type=Path, default=Path("artifacts/bench/http_path.json"))
    p.add_argument("--profile", type=Path, help="write py-spy profiles (collapsed stacks) of each process here "
                   "and print their top functions")
    args = p.parse_args(argv)
    servers = [(d, t) for d in args.data_plane.split(",") for t in args.placement.split(",")]
    result = run(args.bundle, args.data_dir, args.seconds, servers, args.out.parent / "http_path_work",
                 [float(x) for x in args.stream_interval.split(",")], args.profile)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


def run(bundle: Path, data_dir: Path, seconds: float, servers: list[tuple[str, str]], work: Path,
        intervals: list[float] = (0.0,), profile_dir: Path | None = None, tokens: int = TOKENS) -> dict[str, Any]:
    """Every (data plane, placement) server in turn, both APIs each; the engine in-process before and after."""
    work.mkdir(parents=True, exist_ok=True)
    inproc = [inprocess_tokens_per_s(bundle, work, data_dir, tokens)]
    runs = [r for plane, placement in servers for s in intervals
            for r in http_runs(bundle, data_dir, s, seconds, work, placement, profile_dir, plane, tokens)]
    inproc.append(inprocess_tokens_per_s(bundle, work, data_dir, tokens))
    failed = [f"{r['data_plane']}/{r['placement']} {r['run']}: {r['errors']}" for r in runs if not r["succeeded"]]
    if failed:
        raise RuntimeError("runs with no successful request: " + "; ".join(failed))
    return {"runs": runs, "inprocess_runs": inproc, "inprocess_tokens_per_s": sum(inproc) / len(inproc),
            "clients": CLIENTS, "tokens": tokens, "seconds": seconds}


if __name__ == "__main__":
    sys.exit(main())
