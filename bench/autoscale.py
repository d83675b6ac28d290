"""Autoscaling under a load ramp: replicas of the generate model over time, next to the load, as a plot.

    python -m bench.autoscale [--artifacts artifacts] [--out docs/img] [--phases 2:30,32:90,2:90]
    kvserve bench --sections autoscale        # the same, into docs/benchmarks.md (section 6) and docs/img

Deploys the generate model alone on a local Ray Serve cluster (serving.server.launch.start, as `kvserve serve`
does) with an autoscaling_config on the engine's load (serving/server/autoscale.py `EngineLoadPolicy`,
`AUTOSCALING` below), then runs closed-loop clients (bench/clients.py) in phases of CLIENTS:SECONDS. Every
half second it samples Serve's view of the deployment (RUNNING replicas) and the clients. Writes
OUT/autoscaling.png (clients and replicas over time, p99 TTFT per phase), ARTIFACTS/bench/autoscaling.json (the
samples and every request) and prints a markdown table per phase.

`single_model_config` is also the Serve config of the model-lifecycle tests (tests/test_lifecycle.py).
Does not own: the policy (serving/server/autoscale.py), the clients (bench/clients.py).
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.clients import Load, Outcome

ROOT = Path(__file__).resolve().parents[1]
AUTOSCALING: dict[str, Any] = {  # measured with this bench (docs/lifecycle.md)
    "min_replicas": 1, "max_replicas": 3, "initial_replicas": 1,
    "metrics_interval_s": 1.0, "look_back_period_s": 5.0, "upscale_delay_s": 3.0, "downscale_delay_s": 15.0,
    "policy": {"policy_function": "serving.server.autoscale:EngineLoadPolicy",
               "policy_kwargs": {"target_utilization": 0.75}},
}
DEFAULT_PHASES = ((2, 30.0), (32, 90.0), (2, 90.0))


def single_model_config(art: Path, port: int, bundle: str = "bundles/generate", canary: dict | None = None,
                        autoscaling: dict | None = None, slots: int = 8) -> dict:
    """deploy/serve_config.yaml reduced to one `generate` model (with a canary or an autoscaling_config if given),
    every deployment with `max_surge_percent: 100` as shipped: a rollout starts new replicas before it stops old
    ones."""
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["http_options"].update(port=port, host="127.0.0.1")
    app = cfg["applications"][0]
    app["args"]["artifacts_dir"] = str(art)
    app["args"]["limits"].update(max_prompt_tokens=24, max_tokens=64, request_timeout_s=60)
    model = {"name": "generate", "bundle": bundle, "engine": {"max_slots": slots, "intra_op_threads": 1}}
    if canary:
        model["canary"] = canary
    app["args"]["models"] = [model]
    small = {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 60, "max_surge_percent": 100}
    gen = {"name": "generate", "max_ongoing_requests": 64, **small,
           "user_config": {"batching": "continuous", "max_waiting": 64}}
    if autoscaling:
        gen["autoscaling_config"] = autoscaling
    app["deployments"] = [{"name": "ingress", "max_ongoing_requests": 512, **small}, gen]
    if canary:
        app["deployments"].append({**gen, "name": "generate-canary"})
    return cfg


def replicas_now(app: str = "kvserve", deployment: str = "generate") -> int:
    """RUNNING replicas of a deployment, from Serve's status."""
    from ray import serve

    status = serve.status().applications.get(app)
    d = status.deployments.get(deployment) if status else None
    if d is None:
        return 0
    return sum(n for s, n in d.replica_states.items() if getattr(s, "value", str(s)) == "RUNNING")


def run_ramp(base: str, phases: tuple[tuple[int, float], ...], max_tokens: int = 32,
             progress: bool = True) -> dict[str, Any]:
    """Drive the phases; sample clients and replicas every 0.5 s. Returns the samples and the outcomes."""
    load = Load(base, clients=phases[0][0], max_tokens=max_tokens).start(max(c for c, _ in phases))
    t0, samples, bounds = time.monotonic(), [], []
    for clients, seconds in phases:
        load.set_clients(clients)
        start = time.monotonic() - t0
        while time.monotonic() - t0 < start + seconds:
            running = replicas_now()
            samples.append({"t": round(time.monotonic() - t0, 2), "clients": clients, "replicas": running,
                            "done": len(load.outcomes)})
            if progress:
                print(f"\r t={samples[-1]['t']:6.1f}s clients={clients:3d} replicas={running} "
                      f"requests={len(load.outcomes)}", end="", file=sys.stderr, flush=True)
            time.sleep(0.5)
        bounds.append((clients, start, time.monotonic() - t0))
    outcomes = load.stop()
    if progress:
        print(file=sys.stderr)
    return {"samples": samples, "phases": bounds, "t0": t0, "outcomes": outcomes}


def phase_table(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase: clients, seconds, requests, failures, replicas (min/max), p50/p99 TTFT of streams."""
    rows = []
    for clients, start, end in run["phases"]:
        mine = [o for o in run["outcomes"] if start <= o.started - run["t0"] < end]
        ttft = sorted(o.ttft_s for o in mine if o.ttft_s is not None)
        reps = [s["replicas"] for s in run["samples"] if start <= s["t"] < end]
        rows.append({"clients": clients, "seconds": round(end - start), "requests": len(mine),
                     "failed": sum(o.status != 200 for o in mine), "replicas_min": min(reps, default=0),
                     "replicas_max": max(reps, default=0), "ttft_p50_s": _q(ttft, 0.5), "ttft_p99_s": _q(ttft, 0.99)})
    return rows


def _q(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def measure(artifacts: Path, phases: tuple[tuple[int, float], ...], slots: int = 8,
            progress: bool = True) -> dict[str, Any]:
    """Deploy the generate model of `artifacts` with `AUTOSCALING` on a local Ray Serve cluster, drive the ramp,
    stop the cluster. Returns the run's JSON: the config, one row per phase, the samples and every request."""
    from serving.server.config import validate_serve_config
    from serving.server.launch import start, stop

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = single_model_config(artifacts.resolve(), port, autoscaling=AUTOSCALING, slots=slots)
    cfg["logging_config"] = {**cfg.get("logging_config", {}), "log_level": "WARNING", "enable_access_log": False}
    start(validate_serve_config(cfg), timeout_s=600)
    try:
        run = run_ramp(f"http://127.0.0.1:{port}", phases, progress=progress)
    finally:
        stop()
    return {"autoscaling_config": AUTOSCALING, "slots": slots, "phases": phase_table(run),
            "phase_bounds_s": [[c, round(a, 2), round(b, 2)] for c, a, b in run["phases"]],
            "samples": run["samples"], "requests": [_outcome_dict(o, run["t0"]) for o in run["outcomes"]]}


def replicas_path(doc: dict[str, Any]) -> list[int]:
    """Replicas along the ramp: the most in each phase but the last, then the number at the end."""
    return [r["replicas_max"] for r in doc["phases"][:-1]] + [doc["samples"][-1]["replicas"] if doc["samples"] else 0]


def ramp_reading(doc: dict[str, Any]) -> str:
    """The ramp in words: clients and replicas along it, requests and failures."""
    rows = doc["phases"]
    return (f"{' -> '.join(str(r['clients']) for r in rows)} clients: "
            f"{' -> '.join(map(str, replicas_path(doc)))} replicas, {sum(r['failed'] for r in rows):,} of "
            f"{sum(r['requests'] for r in rows):,} requests failed")


def plot(doc: dict[str, Any], path: Path) -> None:
    """OUT/autoscaling.png: clients and RUNNING replicas over time, p99 TTFT per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, rows = doc["samples"], doc["phases"]
    t = [s["t"] for s in samples]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.step(t, [s["clients"] for s in samples], where="post", label="clients (load)", color="tab:gray")
    ax.set_xlabel("seconds")
    ax.set_ylabel("clients")
    ax2 = ax.twinx()
    ax2.step(t, [s["replicas"] for s in samples], where="post", label="generate replicas (RUNNING)",
             color="tab:blue", linewidth=2)
    ax2.set_ylabel("replicas")
    ax2.set_ylim(0, max(s["replicas"] for s in samples) + 1)
    for row, (_, start, _) in zip(rows, doc["phase_bounds_s"]):
        ax.annotate(f"p99 TTFT {row['ttft_p99_s']}s", (start + 1, row["clients"]), fontsize=8, va="bottom")
    lines = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="center right", fontsize=8)
    ax.set_title("Autoscaling on engine load (EngineLoadPolicy): replicas follow the clients")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| clients | seconds | requests | failed | replicas (min-max) | TTFT p50 | TTFT p99 |\n|---|---|---|---|---|---|---|\n"
    return head + "".join(f"| {r['clients']} | {r['seconds']} | {r['requests']} | {r['failed']} | "
                          f"{r['replicas_min']}-{r['replicas_max']} | {r['ttft_p50_s']} s | {r['ttft_p99_s']} s |\n"
                          for r in rows)


def _outcome_dict(o: Outcome, t0: float) -> dict[str, Any]:
    return {"start_s": round(o.started - t0, 3), "end_s": round(o.ended - t0, 3), "endpoint": o.endpoint,
            "status": o.status, "ttft_s": o.ttft_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="holds bundles/generate")
    p.add_argument("--out", type=Path, default=Path("docs/img"), help="where autoscaling.png goes")
    p.add_argument("--phases", default=phases_arg(DEFAULT_PHASES),
                   help="CLIENTS:SECONDS,... e.g. 2:30,32:90,2:90")
    p.add_argument("--slots", type=int, default=8, help="KV slots per replica")
    args = p.parse_args(argv)
    doc = measure(args.artifacts, parse_phases(args.phases), args.slots)
    plot(doc, args.out / "autoscaling.png")
    raw = args.artifacts / "bench" / "autoscaling.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(doc, indent=1))
    print(markdown(doc["phases"]))
    print(f"wrote {args.out / 'autoscaling.png'} and {raw}", file=sys.stderr)
    return 0


def parse_phases(text: str) -> tuple[tuple[int, float], ...]:
    """`2:30,32:90` -> ((2, 30.0), (32, 90.0))."""
    return tuple((int(c), float(s)) for c, s in (x.split(":") for x in text.split(",")))


def phases_arg(phases: tuple[tuple[int, float], ...]) -> str:
    return ",".join(f"{c}:{s:g}" for c, s in phases)


if __name__ == "__main__":
    sys.exit(main())
