"""The gpu check's server step: a local Ray Serve app on the device, load-tested with `kvserve loadtest`.

The Serve config is the shipped deploy/serve_config.yaml reduced to the generate model as bench/http.py
reduces it (`bench_serve_config`), with `engine.provider` set to the device and, on CUDA, the model
deployment's `ray_actor_options.num_gpus: 1` (Ray is started with one GPU). Once the app runs, the
replica's `info()` must report the device's EP; then `kvserve loadtest` (a subprocess: the real command)
runs closed loop at each of the plan's client counts, streaming /v1/generate. A run passes when every
measured request succeeded. Each run's report directory is kept under OUT/server/.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.gpu_check.bundles import Bundles
from bench.gpu_check.plan import Plan, Step

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deploy" / "serve_config.yaml"
EXPECTED_EP = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


def serve_config(bundle: Path, device: str, plan: Plan, port: int) -> dict[str, Any]:
    from bench.http import MODEL, HttpPlan, bench_serve_config

    slots = max(plan.server_clients)
    # split: the model is a deployment of its own, the one that asks Ray for the GPU
    raw = bench_serve_config(SHIPPED, bundle, HttpPlan(slots=slots, threads=1, placement="split"), port)
    app = raw["applications"][0]
    next(m for m in app["args"]["models"] if m["name"] == MODEL)["engine"]["provider"] = device
    dep = next(d for d in app["deployments"] if d["name"] == MODEL)
    dep["ray_actor_options"] = {"num_cpus": 1, **({"num_gpus": 1} if device == "cuda" else {})}
    dep["user_config"]["max_waiting"] = 2 * slots
    return raw


def loadtest(url: str, clients: int, plan: Plan, out: Path, data_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvserve", "loadtest", url, "--concurrency", str(clients),
           "--duration", str(plan.server_duration_s), "--warmup", str(plan.server_warmup_s),
           "--min-tokens", "8", "--max-tokens", str(plan.server_max_tokens), "--timeout", "60",
           "--data-dir", str(data_dir), "--out", str(out), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=plan.server_duration_s + 180)
    result: dict[str, Any] = {"command": " ".join(cmd[1:]), "exit_status": proc.returncode,
                              "summary": proc.stdout.strip().splitlines()[-4:]}
    report = out / "report.json"
    if not report.is_file():
        result["error"] = proc.stderr.strip()[-2000:]
        return result
    r = json.loads(report.read_text())
    lat, th, totals = r["latency_s"], r["throughput"], r["totals"]
    result.update(requests_per_s=th["requests_per_s"], output_tokens_per_s=th["output_tokens_per_s"],
                  ttft_p50_s=lat["ttft"]["p50"], ttft_p99_s=lat["ttft"]["p99"], itl_p50_s=lat["itl"]["p50"],
                  e2e_p50_s=lat["e2e"]["p50"], e2e_p99_s=lat["e2e"]["p99"], measured=totals["measured"],
                  succeeded=totals["succeeded"], failed=totals["failed"], errors=r["errors_by_status"])
    return result


def replica_info() -> dict[str, Any]:
    from bench.http import APP, MODEL
    from serving.server.launch import driver_handle

    return driver_handle(MODEL, APP).info.remote().result()


def run(step: Step, plan: Plan, bundles: Bundles, device: str, work: Path, data_dir: Path) -> None:
    from bench.http import _free_port
    from serving.server.launch import prepare_config, start, stop
    from serving.server.ray_env import init_local_ray

    bundle = bundles.get("generate", plan.server_variant) or bundles.get("generate", "fp32")
    if bundle is None:
        step.reason = "no generate bundle to serve"
        return
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    path = work / "serve_config.yaml"
    path.write_text(yaml.safe_dump(serve_config(bundle, device, plan, port), sort_keys=False))
    step.data.update(config=str(path), bundle=str(bundle))
    # Ray's workers (the Serve controller imports serving.server.app) find this checkout without an install
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    # the local cluster `kvserve serve` runs (serving/server/ray_env.py)
    init_local_ray(max(os.cpu_count() or 1, 2), num_gpus=1 if device == "cuda" else 0, include_dashboard=False,
                   log_to_driver=False, _system_config={"metrics_report_interval_ms": 1000})
    try:
        start(prepare_config(path), timeout_s=300)
        step.data["startup_s"] = round(time.perf_counter() - t0, 1)
        info = replica_info()
        step.data["replica_provider"] = info.get("provider")
        step.check("server/replica_on_device", info.get("provider") == EXPECTED_EP[device])
        for clients in plan.server_clients:
            name = f"server/loadtest/{clients}"
            step.data[name] = loadtest(f"http://127.0.0.1:{port}", clients, plan, work / f"loadtest-{clients}",
                                       data_dir)
            r = step.data[name]
            step.check(name, r.get("measured", 0) > 0 and r.get("failed", 1) == 0 and r["exit_status"] == 0)
    finally:
        stop()
