"""`kvserve bench`, HTTP: continuous vs request-level vs no batching (the engine's modes) through a real Ray Serve app.

The bench starts a local Ray Serve app from the shipped deploy/serve_config.yaml, reduced to the generate
model (the overrides are listed by `config_overrides` and written into the doc), and drives it with the load
tester (loadtest/runner.py `run_load`): streaming /v1/generate requests, prompts from the test split, output
lengths drawn per request in [min_tokens, max_tokens] (seeded: every mode gets the same requests).
The batching mode of the one replica is switched live through the deployment's `user_config` (Serve calls
`reconfigure`, the replica process stays the same) and checked through the deployment's `info()`.

Modes (`HttpMode`): continuous, request-level with the shipped batch wait, request-level with a longer wait
(so the baseline is not judged by one setting of its knob; closed loop only), and none.
Phase "closed": `concurrency` clients; the modes alternate, their order reversed every round.
Phases "open-a" and "open-b": Poisson arrivals at `rate_fraction` x the closed-loop request throughput of
request-level batching (a load both batching modes should carry) and of continuous batching (the capacity
of the server as shipped); same alternation. Figures per mode are medians over rounds.
Phase "completions": continuous batching, non-streaming /v1/completions. Phase "wrk": continuous batching
driven by wrk, a C load generator that leaves the server the cores the Python load tester takes
(bench/wrk.py), streaming and not.

Does not measure: more than one replica (the modes are compared on the one replica), translation, or the
engine without the HTTP path (bench/engine.py); the load generator shares the machine, and its own lag is
in each run's load report.
Owns the server's bench config, the mode switching and the phases. The load itself is loadtest/'s, the
doc is bench/report.py's.
"""
from __future__ import annotations

import asyncio
import copy
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.client import RequestRecord
from loadtest.config import LoadConfig, Workload
from loadtest.promscrape import GENERATED, Snapshot, parse_metrics
from loadtest.report import Report
from loadtest.runner import run_load
from serving.engine.types import BatchingMode
from serving.server.launch import colocate_models, driver_handle, split_models

MODEL = "generate"
APP = "kvserve"
MODE_SWITCH_TIMEOUT_S = 120.0
METRICS_FLUSH_S = 1.5  # the bench's Ray exports metrics every second (metrics_report_interval_ms)
STEPS = "kvserve_engine_batch_size_count"  # one observation per engine step
CONTINUOUS, REQUEST = "continuous", "request"  # the names the claim compares
COMPLETIONS = "continuous, non-streaming /v1/completions"
WRK_RUNS = {"streaming": ("/v1/generate", Workload.GENERATE, True),  # wrk phase: name -> (path, workload, stream)
            "non-streaming": ("/v1/completions", Workload.COMPLETIONS, False)}


@dataclass(frozen=True)
class HttpMode:
    name: str
    batching: BatchingMode
    batch_wait_timeout_s: float | None = None  # None: the shipped config's


@dataclass(frozen=True)
class HttpPlan:
    concurrency: int = 32
    duration_s: float = 12.0  # measured phase of each run
    warmup_s: float = 2.0  # requests started before this are left out of the figures
    closed_rounds: int = 3
    open_rounds: int = 2
    min_tokens: int = 8
    max_tokens: int = 128
    temperature: float = 1.0  # sampled with a per-request seed: the same text in every mode
    rate_fraction: float = 0.8  # open loop: this share of a mode's closed-loop req/s
    slots: int = 32  # KV slots of the replica = request-level max_batch_size
    threads: int = 1  # ORT intra-op threads of the replica (the shipped config's value)
    seed: int = 0
    timeout_s: float = 15.0  # a client gives up after this (an overloaded mode's backlog must not stall the run)
    long_wait_s: float = 0.25  # the request-level variant's batch_wait_timeout_s
    placement: str = "colocated"  # as `kvserve serve` runs the models (serving/server/launch.py PLACEMENTS)
    wrk: bool = True  # also drive continuous batching with wrk (bench/wrk.py), where it is installed

    def modes(self, closed: bool) -> list[HttpMode]:
        out = [HttpMode(CONTINUOUS, BatchingMode.CONTINUOUS), HttpMode(REQUEST, BatchingMode.REQUEST)]
        if closed and self.long_wait_s:
            out.append(HttpMode(f"request, wait {self.long_wait_s * 1e3:.0f} ms", BatchingMode.REQUEST,
                                self.long_wait_s))
        return out + [HttpMode("none", BatchingMode.NONE)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_overrides(plan: HttpPlan) -> list[str]:
    """What the bench changes in the shipped Serve config (shown in the doc)."""
    return [f"only the `{MODEL}` model and its deployment (plus the ingress)",
            f"`engine.max_slots: {plan.slots}`, `engine.intra_op_threads: {plan.threads}`",
            f"`user_config.max_batch_size: {plan.slots}`; `user_config.batching` switched per run",
            "`http_options`: 127.0.0.1 and a free port",
            f"placement `{plan.placement}` (`kvserve serve --placement`, its default: colocated)"]


def bench_serve_config(shipped: Path, bundle: Path, plan: HttpPlan, port: int) -> dict[str, Any]:
    """The shipped Serve config with `config_overrides` applied."""
    raw = yaml.safe_load(shipped.read_text())
    raw["http_options"].update(host="127.0.0.1", port=port)
    app = next(a for a in raw["applications"] if a.get("import_path") == "serving.server.app:build_app")
    app["args"]["artifacts_dir"] = str(bundle.resolve().parent)
    spec = next(m for m in app["args"]["models"] if m["name"] == MODEL)
    spec["bundle"] = str(bundle.resolve())
    spec.setdefault("engine", {}).update(max_slots=plan.slots, intra_op_threads=plan.threads)
    app["args"]["models"] = [spec]
    app["deployments"] = [d for d in app["deployments"] if d["name"] in ("ingress", MODEL)]
    ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
    if spec.get("colocated"):  # the shipped config: one CPU per engine, the knobs of this model only
        ingress.setdefault("ray_actor_options", {})["num_cpus"] = plan.threads
        models = ingress.setdefault("user_config", {}).setdefault("models", {})
        ingress["user_config"]["models"] = {MODEL: models.get(MODEL, {})}
    if plan.placement == "colocated":
        colocate_models(app)
    else:
        split_models(app)
    if spec.get("colocated"):  # the model's knobs and ongoing requests are the ingress's
        live, dep = ingress["user_config"]["models"][MODEL], ingress
    else:
        dep = next(d for d in app["deployments"] if d["name"] == MODEL)
        live = dep.setdefault("user_config", {})
    live.update(max_batch_size=plan.slots, batching=BatchingMode.CONTINUOUS.value)
    dep["max_ongoing_requests"] = max(dep.get("max_ongoing_requests", 0), plan.slots * 3)
    return raw


def live_knobs(raw: dict[str, Any]) -> dict[str, Any]:
    """The bench model's batching knobs in a bench config: its deployment's user_config, or the ingress's
    `models.<name>` when it is colocated."""
    app = raw["applications"][0]
    if _colocated(raw):
        ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
        return ingress["user_config"]["models"][MODEL]
    return next(d for d in app["deployments"] if d["name"] == MODEL)["user_config"]


def _colocated(raw: dict[str, Any]) -> bool:
    return bool(next(m for m in raw["applications"][0]["args"]["models"] if m["name"] == MODEL).get("colocated"))


def model_info(raw: dict[str, Any]) -> dict[str, Any]:
    """The bench model's `info()`: from the ingress replica it is colocated in, or from its own deployment."""
    if _colocated(raw):
        return driver_handle("ingress", APP).model_info.remote(MODEL).result()
    return driver_handle(MODEL, APP).info.remote().result()


class BenchServer:
    """A local Ray + Serve running the bench config; `set_mode` switches the generate deployment live."""

    def __init__(self, shipped: Path, bundle: Path, plan: HttpPlan, work: Path) -> None:
        self.plan, self.port = plan, _free_port()
        self.raw = bench_serve_config(shipped, bundle, plan, self.port)
        self.config_path = work / "serve_config.bench.yaml"
        self.config_path.write_text(yaml.safe_dump(self.raw, sort_keys=False))
        self.url = f"http://127.0.0.1:{self.port}"
        self.pids: set[int] = set()

    def __enter__(self) -> "BenchServer":
        from serving.server.launch import prepare_config, start
        from serving.server.ray_env import init_local_ray

        self.raw = prepare_config(self.config_path)
        # the local cluster `kvserve serve` runs (serving/server/ray_env.py)
        init_local_ray(max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False,
                       _system_config={"metrics_report_interval_ms": 1000})
        try:
            start(self.raw, timeout_s=600)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        from serving.server.launch import stop

        stop()

    def set_mode(self, mode: HttpMode) -> None:
        from serving.server.launch import start

        raw = copy.deepcopy(self.raw)
        live = live_knobs(raw)
        live["batching"] = mode.batching.value
        if mode.batch_wait_timeout_s is not None:
            live["batch_wait_timeout_s"] = mode.batch_wait_timeout_s
        start(raw, timeout_s=MODE_SWITCH_TIMEOUT_S)
        deadline = time.monotonic() + MODE_SWITCH_TIMEOUT_S
        while True:
            info = model_info(raw)
            if all(info["live"].get(k) == v for k, v in live.items()):
                self.pids.add(int(info["pid"]))
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {MODEL} deployment did not take user_config {live} within "
                                   f"{MODE_SWITCH_TIMEOUT_S:.0f}s (it reports {info['live']})")
            time.sleep(0.5)


def load_config(url: str, plan: HttpPlan, data_dir: Path, rate: float | None,
                workload: Workload = Workload.GENERATE, stream: bool = True) -> LoadConfig:
    return LoadConfig(url=url, workload=workload, rate=rate,
                      concurrency=None if rate else plan.concurrency, duration_s=plan.duration_s,
                      warmup_s=plan.warmup_s, seed=plan.seed, min_tokens=plan.min_tokens,
                      max_tokens=plan.max_tokens, temperature=plan.temperature, stream=stream, data_dir=data_dir,
                      timeout_s=plan.timeout_s, scrape_metrics=False)


def scrape_now(url: str) -> Snapshot:
    """The server's /metrics now, after waiting for Ray's metrics export to catch up."""
    time.sleep(METRICS_FLUSH_S)
    try:
        resp = httpx.get(url + "/metrics", timeout=10.0, trust_env=False)
    except httpx.HTTPError as e:
        return Snapshot(error=f"GET {url}/metrics failed: {e}")
    return parse_metrics(resp.text) if resp.status_code == 200 else Snapshot(error=f"/metrics: {resp.status_code}")


def tokens_per_step(before: Snapshot, after: Snapshot) -> float | None:
    """Generated tokens per engine step over a run, from two exact counters of the server. (Not the batch-size
    histogram's mean: Ray exports a histogram's _sum estimated from bucket midpoints.)"""
    if before.error or after.error:
        return None
    tokens = (after.total(GENERATED) or 0.0) - (before.total(GENERATED) or 0.0)
    steps = (after.total(STEPS) or 0.0) - (before.total(STEPS) or 0.0)
    return tokens / steps if steps > 0 else None


def window_throughput(records: list[RequestRecord], start: float, end: float) -> tuple[float, float]:
    """(requests/s, streamed tokens/s) completed inside [start, end): the steady state, without the warm-up
    or the drain after the last send (which would otherwise count against slow modes)."""
    done = sum(r.ok and start <= r.end < end for r in records)
    tokens = sum(start <= r.start + t < end for r in records for t in r.token_times)
    return done / (end - start), tokens / (end - start)


def figures(report: Report, per_step: float | None, plan: HttpPlan) -> dict[str, Any]:
    """The figures of one run the doc shows (seconds, per second)."""
    lat, th, t = report.latency, report.throughput, report.totals
    rps, tps = window_throughput(report.records, plan.warmup_s, plan.warmup_s + plan.duration_s)
    return {"requests_per_s": rps, "output_tokens_per_s": tps,
            "loadtest_requests_per_s": th["requests_per_s"], "loadtest_output_tokens_per_s": th["output_tokens_per_s"],
            "ttft_p50_s": lat["ttft"]["p50"], "ttft_p99_s": lat["ttft"]["p99"],
            "e2e_p50_s": lat["e2e"]["p50"], "e2e_p99_s": lat["e2e"]["p99"], "itl_p50_s": lat["itl"]["p50"],
            "measured": t["measured"], "succeeded": t["succeeded"], "failed": t["failed"],
            "rejected_429": t["rejected_429"], "errors": report.errors,
            "server_tokens_per_step": per_step, "inputs": report.inputs}


def _phase(server: BenchServer, plan: HttpPlan, data_dir: Path, phase: str, rate: float | None,
           work: Path) -> list[dict]:
    runs = []
    modes = plan.modes(closed=rate is None)
    before = scrape_now(server.url)
    for rnd in range(plan.closed_rounds if rate is None else plan.open_rounds):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            server.set_mode(mode)
            report = asyncio.run(run_load(load_config(server.url, plan, data_dir, rate)))
            after = scrape_now(server.url)
            (work / f"http-{phase}-{mode.batching.value}-{mode.batch_wait_timeout_s}-r{rnd}.json").write_text(
                report.to_json() + "\n")
            run = {"phase": phase, "mode": mode.name, "round": rnd, "rate": rate,
                   **figures(report, tokens_per_step(before, after), plan)}
            before = after
            runs.append(run)
            print(f"bench http {phase:7s} r{rnd} {mode.name:22s} {run['requests_per_s']:6.2f} req/s "
                  f"{run['output_tokens_per_s']:7.1f} tok/s  e2e p99 {run['e2e_p99_s'] or float('nan'):6.2f} s  "
                  f"failed {run['failed']}", file=sys.stderr, flush=True)
    return runs


def _completions_phase(server: BenchServer, plan: HttpPlan, data_dir: Path, work: Path) -> list[dict]:
    """Continuous batching, non-streaming /v1/completions (the OpenAI API) at `concurrency` clients, the same
    requests as the streaming runs: what a client that waits for the whole text gets."""
    server.set_mode(HttpMode(CONTINUOUS, BatchingMode.CONTINUOUS))
    runs, before = [], scrape_now(server.url)
    for rnd in range(plan.closed_rounds):
        report = asyncio.run(run_load(load_config(server.url, plan, data_dir, None, Workload.COMPLETIONS, False)))
        after = scrape_now(server.url)
        (work / f"http-completions-r{rnd}.json").write_text(report.to_json() + "\n")
        run = {"phase": "completions", "mode": COMPLETIONS, "round": rnd, "rate": None,
               **figures(report, tokens_per_step(before, after), plan)}
        # No token times without streaming: the steady-state window counts whole answers, tokens at the end.
        run["output_tokens_per_s"] = run["loadtest_output_tokens_per_s"]
        before = after
        runs.append(run)
        print(f"bench http completions r{rnd} {run['requests_per_s']:6.2f} req/s {run['output_tokens_per_s']:7.1f} "
              f"tok/s  e2e p99 {run['e2e_p99_s'] or float('nan'):6.2f} s  failed {run['failed']}",
              file=sys.stderr, flush=True)
    return runs


def _wrk_phase(server: BenchServer, plan: HttpPlan, data_dir: Path) -> list[dict]:
    """Continuous batching driven by wrk (a C load generator, bench/wrk.py) at `concurrency` clients, the
    TTFT probe being one of them: the same requests as the Python runs, streaming and not, alternated."""
    from bench.wrk import run_wrk, wrk_path
    from loadtest.workloads import load_inputs, request_body

    if not plan.wrk or wrk_path() is None:
        print("bench http: wrk not found (apt-get install wrk): no wrk runs", file=sys.stderr, flush=True)
        return []
    server.set_mode(HttpMode(CONTINUOUS, BatchingMode.CONTINUOUS))

    def bodies(workload: Workload, stream: bool) -> list[dict]:
        cfg = load_config(server.url, plan, data_dir, None, workload, stream)
        inputs = load_inputs(workload, data_dir)
        return [request_body(cfg, inputs, i) for i in range(1024)]
    per_run = {name: bodies(workload, stream) for name, (_, workload, stream) in WRK_RUNS.items()}
    probe = bodies(Workload.GENERATE, True)[512:]
    runs = []
    for rnd in range(plan.closed_rounds):
        for name in (list(WRK_RUNS) if rnd % 2 == 0 else list(WRK_RUNS)[::-1]):
            path = WRK_RUNS[name][0]
            run_wrk(server.url, path, per_run[name], plan.concurrency, plan.warmup_s)  # warm-up
            r = run_wrk(server.url, path, per_run[name], plan.concurrency, plan.duration_s, probe,
                        timeout_s=plan.timeout_s)
            runs.append({"phase": "wrk", "mode": name, "round": rnd, "rate": None, **r})
            print(f"bench http wrk {name:13s} r{rnd} {r['output_tokens_per_s']:7.1f} tok/s  ttft p99 "
                  f"{r['ttft_p99_s'] or float('nan'):6.3f} s  wrk cpu {r['load_generator_cpu']:.3f}  errors "
                  f"{r['errors']}", file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """{phase: {mode: medians over rounds}} of the numeric figures."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["phase"], {}).setdefault(r["mode"], {"runs": []})["runs"].append(r)
    for modes in out.values():
        for mode, m in modes.items():
            rs = m.pop("runs")
            for k, v in rs[0].items():
                vals = [r[k] for r in rs if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)]
                if len(vals) == len(rs) and k not in ("round",):
                    m[k] = statistics.median(vals)
            m["rounds"] = len(rs)
    return out


def _open_rate(closed: list[dict], mode: str, fraction: float) -> tuple[float, float]:
    capacity = statistics.median(r["requests_per_s"] for r in closed if r["mode"] == mode and r["phase"] == "closed")
    return capacity, round(max(fraction * capacity, 0.1), 2)


def run(shipped: Path, bundle: Path, data_dir: Path, plan: HttpPlan, work: Path) -> dict[str, Any]:
    """All phases against one server; returns the section's JSON."""
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with BenchServer(shipped, bundle, plan, work) as server:
        startup_s = time.perf_counter() - t0
        runs = _phase(server, plan, data_dir, "closed", None, work)
        runs += _completions_phase(server, plan, data_dir, work)
        runs += _wrk_phase(server, plan, data_dir)
        open_phases = {}
        for phase, basis in (("open-a", REQUEST), ("open-b", CONTINUOUS)):
            capacity, rate = _open_rate(runs, basis, plan.rate_fraction)
            open_phases[phase] = {"basis": basis, "capacity_req_per_s": capacity, "rate": rate}
            runs += _phase(server, plan, data_dir, phase, rate, work)
        pids = sorted(server.pids)
    return {"plan": asdict(plan), "config_overrides": config_overrides(plan),
            "config_file": str(server.config_path), "url": server.url, "startup_s": startup_s,
            "open_phases": open_phases, "replica_pids": pids, "runs": runs, "summary": summarize(runs)}
