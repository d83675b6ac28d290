"""The soak's load on copies of the server side by side, each ingress with environment variables of its own.

    python -m bench.soak_env --variants VARIANTS [--minutes 20] [--artifacts artifacts] [--raw FILE]
    VARIANTS='{"glibc": {}, "jemalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}}'

Deploys one copy of the soak's application (bench/soak.py, colocated: the model in the ingress replica, as
`kvserve serve`) per variant, routed at /NAME, the variant's variables in its ingress's runtime_env (an allocator,
its tunables, a Ray flag); measures each copy's capacity, then sends every copy the soak's mix at once, each at
`share` of the copies' mean capacity divided by their number, for `minutes`. The variants meet the same host at
the same time, which runs one after another cannot promise (a shared host's speed changes by tens of percent
within minutes). Reports each ingress's RSS growth per 10 minutes after warm-up (and over the second half alone),
its p50/p99 latency, CPU seconds and statuses, and each variant's variables as its ingress process holds them
(read from /proc); writes --raw.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.soak import _p99, app_copy, capacity, free_port, soak, soak_config, summary


def variants_config(cfg: dict[str, Any], variants: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The soak's config with one copy of its application per variant, each ingress with the variant's env."""
    apps = []
    for name, env in variants.items():
        app = app_copy(cfg["applications"][0], name)
        ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
        if env:
            opts = ingress.setdefault("ray_actor_options", {})
            opts["runtime_env"] = {**opts.get("runtime_env", {}), "env_vars": dict(env)}
        apps.append(app)
    return {**cfg, "applications": apps}


def ingress_processes(names: list[str], timeout_s: float = 60.0) -> dict[str, psutil.Process]:
    """name -> the process of the copy's ingress replica (Ray titles it ServeReplica:NAME:ingress)."""
    found: dict[str, psutil.Process] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(names) and time.monotonic() < deadline:
        for p in psutil.process_iter():
            try:
                text = " ".join(p.cmdline())
            except psutil.Error:
                continue
            found.update({n: p for n in names if f"ServeReplica:{n}:ingress" in text and n not in found})
        if len(found) < len(names):
            time.sleep(1.0)
    if len(found) < len(names):
        raise RuntimeError(f"no ingress process for {sorted(set(names) - set(found))}")
    return found


def sample_every(procs: dict[str, psutil.Process], period_s: float, stop: threading.Event,
                 out: list[dict[str, Any]]) -> None:
    """RSS (MB) and CPU seconds of each process every `period_s`, in bench.soak's sample format."""
    t0 = time.monotonic()
    while not stop.is_set():
        rss, cpu = {}, {}
        for name, p in procs.items():
            times = p.cpu_times()
            rss[name], cpu[name] = round(p.memory_info().rss / 2**20, 2), round(times.user + times.system, 2)
        out.append({"t": round(time.monotonic() - t0, 1), "rss_mb": rss, "cpu_s": cpu, "p99_s": None})
        stop.wait(period_s)


def report(variants: dict[str, dict[str, str]], caps: dict[str, float], rate: float, runs: dict[str, Any],
           samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    after = summary(samples, warmup_s)
    second_half = summary(samples, (warmup_s + samples[-1]["t"]) / 2) if samples else after
    out: dict[str, Any] = {"variants": variants, "rate_per_s_each": round(rate, 2), "warmup_s": warmup_s}
    for name in variants:
        lat = sorted(x for _, x in runs[name]["latencies"])
        out[name] = {"capacity_req_s": round(caps[name], 2), "statuses": runs[name]["statuses"],
                     "p50_s": lat[len(lat) // 2] if lat else None, "p99_s": _p99(lat),
                     "rss_growth_mb_per_10min": after["rss_growth_mb_per_10min"].get(name),
                     "rss_growth_second_half": second_half["rss_growth_mb_per_10min"].get(name),
                     "cpu_cores": after["cpu_cores"].get(name),
                     "rss_mb_start_end": [samples[0]["rss_mb"][name], samples[-1]["rss_mb"][name]]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak_env", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", required=True, help='JSON: {"name": {"VAR": "value", ...}, ...}')
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--warmup-minutes", type=float, default=3.0, help="left out of the growth fit")
    p.add_argument("--share", type=float, default=0.7, help="the total load as a share of the mean capacity")
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="holds bundles/generate")
    p.add_argument("--raw", type=Path, default=None, help="the figures' JSON (default: ARTIFACTS/bench/soak_env.json)")
    args = p.parse_args(argv)
    variants = json.loads(args.variants)
    if not variants or not all(isinstance(v, dict) for v in variants.values()):
        p.error("--variants: a JSON object of name -> {VAR: value}")
    from serving.server.config import validate_serve_config
    from serving.server.launch import start, stop

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    start(validate_serve_config(variants_config(soak_config(args.artifacts, port), variants)), timeout_s=600)
    samples: list[dict[str, Any]] = []
    halt = threading.Event()
    try:
        procs = ingress_processes(list(variants))
        applied = {name: {k: procs[name].environ().get(k) for k in env} for name, env in variants.items()}
        if applied != variants:
            raise RuntimeError(f"the ingress processes' environments differ from the variants: {applied}")
        caps = {name: asyncio.run(capacity(f"{base}/{name}", seconds=15)) for name in variants}
        rate = args.share * sum(caps.values()) / len(caps) / len(caps)
        print(f"capacities {caps}; {rate:.1f} req/s to each copy for {args.minutes:g} min", file=sys.stderr)
        threading.Thread(target=sample_every, args=(procs, 10.0, halt, samples), daemon=True).start()

        async def together() -> list[dict[str, Any]]:
            return await asyncio.gather(*(soak(f"{base}/{name}", rate, args.minutes * 60, progress=False)
                                          for name in variants))
        runs = dict(zip(variants, asyncio.run(together())))
    finally:
        halt.set()
        stop()
    result = {**report(variants, caps, rate, runs, samples, 60 * args.warmup_minutes), "env_applied": applied}
    raw = args.raw or args.artifacts / "bench" / "soak_env.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps({**result, "samples": samples}, indent=1))
    print(json.dumps(result, indent=1))
    return 1 if any(s.startswith("5") for name in variants for s in runs[name]["statuses"]) else 0


if __name__ == "__main__":
    sys.exit(main())
