"""A soak test: the server for many minutes at ~70% of its capacity, memory and latency over time, as a plot.

    python -m bench.soak [--minutes 30] [--artifacts artifacts] [--out docs/img] [--share 0.7]
    make soak [SOAK_MINUTES=30]

Deploys the production configuration on a local Ray Serve cluster: deploy/serve_config.yaml as `kvserve serve`
runs it (serving/server/launch.py `prepare_config`; the images' and the RayService's configs are generated from
the same file, deploy/gen_rayservice.py), with ARTIFACTS' bundles. Measures its capacity with 32 closed-loop
clients, then sends an open-loop Poisson load at `share` of that rate for `minutes`: a mix of streamed and plain
`/v1/generate`, streams the client drops after a few tokens (disconnects), clients that give up after 0.3 s
(deadlines on the client's side) and every 30 s a burst of 128 requests at once, past the 16 KV slots and the
waiting room of 64 (429s). Every 10 s it samples the RSS of Serve's proxy actor, HAProxy, the ingress and (with
`--placement split`) the model replica, by Ray's process titles, and the latency of the window. At the
end: growth of each process's RSS per 10 minutes after warm-up (a least-squares slope), p99 drift (first vs last
third), the statuses (any 5xx is a failure) and whether slots and waiting requests are back to 0.
Also the mean CPU of each process after warm-up, and at the end the soaked server against a fresh copy deployed
beside it, measured alternately (`aging`: p99 at the soak's load, capacity): whether a drift is the server's
or the host's. Writes ARTIFACTS/bench/soak.json (or --raw) and OUT/soak.png; prints the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]


ROLES = (("ServeReplica:kvserve:ingress", "ingress"), ("ServeReplica:kvserve:generate", "replica"),
         ("ProxyActor", "proxy"))
SAMPLE_S, BURST_EVERY_S, BURST = 10.0, 30.0, 128
KINDS = ("plain",) * 5 + ("stream",) * 3 + ("drop", "giveup")  # the soak's mix of requests
BODY = {"prompt": "the quick brown fox", "max_tokens": 32, "temperature": 1.0}


def processes() -> dict[str, psutil.Process]:
    """role -> the Ray process playing it (proxy, ingress, replica), and HAProxy where Serve runs it."""
    out = {}
    for p in psutil.process_iter():
        try:
            name = p.name()
            text = name + " " + " ".join(p.cmdline())
        except psutil.Error:
            continue
        role = "haproxy" if name == "haproxy" else next((r for key, r in ROLES if key in text), None)
        if role and role not in out:
            out[role] = p
    return out


async def _one(client: httpx.AsyncClient, kind: str) -> tuple[str, float]:
    """(outcome, seconds) of one request of `kind`: plain, stream, drop (a stream dropped after 3 events) or
    giveup (a client that waits at most 0.3 s)."""
    t0 = time.monotonic()
    try:
        if kind == "plain":
            r = await client.post("/v1/generate", json=BODY)
            return str(r.status_code), time.monotonic() - t0
        if kind == "giveup":
            r = await asyncio.wait_for(client.post("/v1/generate", json={**BODY, "max_tokens": 64}), 0.3)
            return str(r.status_code), time.monotonic() - t0
        async with client.stream("POST", "/v1/generate", json={**BODY, "stream": True}) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if kind == "drop" and n >= 3:
                    return "dropped", time.monotonic() - t0
            return str(r.status_code), time.monotonic() - t0
    except asyncio.TimeoutError:
        return "gave_up", time.monotonic() - t0
    except httpx.HTTPError as e:
        return type(e).__name__, time.monotonic() - t0


async def soak(base: str, rate: float, seconds: float, progress: bool = True) -> dict[str, Any]:
    """Open-loop Poisson arrivals at `rate`/s for `seconds`, bursts every BURST_EVERY_S; samples every SAMPLE_S."""
    rng, procs, samples, window = random.Random(0), processes(), [], []
    done: list[tuple[float, float]] = []  # (seconds since the start, latency) of every 200
    statuses: Counter = Counter()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        tasks: set[asyncio.Task] = set()

        def finished(task: asyncio.Task) -> None:
            tasks.discard(task)
            outcome, latency = task.result()
            statuses.update([outcome])
            if outcome == "200":
                window.append(latency)
                done.append((round(time.monotonic() - t0, 2), round(latency, 4)))

        def launch(kind: str) -> None:
            task = asyncio.create_task(_one(client, kind))
            tasks.add(task)
            task.add_done_callback(finished)
        t0 = next_sample = next_burst = time.monotonic()
        while (now := time.monotonic()) - t0 < seconds:
            launch(rng.choice(KINDS))
            if now >= next_burst:
                for _ in range(BURST):
                    launch("plain")
                next_burst += BURST_EVERY_S
            if now >= next_sample:
                samples.append(_sample(procs, now - t0, window, statuses))
                window, next_sample = [], next_sample + SAMPLE_S
                if progress:
                    print(f"\r {samples[-1]['t']:6.0f}s {samples[-1]['rss_mb']} p99={samples[-1]['p99_s']} "
                          f"{dict(statuses)}", end="", file=sys.stderr, flush=True)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"samples": samples, "statuses": dict(statuses), "latencies": done}


def _sample(procs: dict[str, psutil.Process], t: float, window: list[float], statuses: Counter) -> dict[str, Any]:
    """RSS (MB) and CPU seconds so far of each role, the window's p99."""
    rss, cpu = {}, {}
    for role, p in procs.items():
        try:
            rss[role] = round(p.memory_info().rss / 2**20, 1)
            times = p.cpu_times()
            cpu[role] = round(times.user + times.system, 2)
        except psutil.Error:
            rss[role] = cpu[role] = None
    lat = sorted(window)
    p99 = round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None
    return {"t": round(t, 1), "rss_mb": rss, "cpu_s": cpu, "p99_s": p99, "done": sum(statuses.values())}


def summary(samples: list[dict[str, Any]], warmup_s: float,
            latencies: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """RSS growth per 10 minutes after warm-up (least squares), and from a third and from two thirds of the way
    through the time after warm-up to the end (`rss_growth_later`: a growth that slows down shows there); p99 of
    the first and the last third of the time after warm-up, over every request answered in it (`latencies`:
    (time, latency) pairs; a 10 s window holds a burst or not, so its own p99 swings with the burst's phase), or
    without them the median window p99."""
    after = [s for s in samples if s["t"] >= warmup_s]
    growth = _growth(after)
    end = samples[-1]["t"] if samples else 0.0
    later = {f"from_{round(t / 60)}min": _growth([s for s in samples if s["t"] >= t])  # slowing or steady?
             for t in (warmup_s + (end - warmup_s) / 3, warmup_s + 2 * (end - warmup_s) / 3)}
    third = max(1, len(after) // 3)
    p99s = [s["p99_s"] for s in after if s["p99_s"] is not None]
    first, last = (sorted(p99s[:third]), sorted(p99s[-third:])) if p99s else ([], [])
    p99_first, p99_last = _mid(first), _mid(last)
    if latencies and after:
        end = max(t for t, _ in latencies)
        span = (end - warmup_s) / 3
        p99_first = _p99([x for t, x in latencies if warmup_s <= t < warmup_s + span])
        p99_last = _p99([x for t, x in latencies if t >= end - span])
    cores = {}  # each role's mean CPU after warm-up, in cores: a process spinning shows here, not in RSS
    for role in (after[0].get("cpu_s", {}) if len(after) >= 2 else {}):
        a, b = after[0]["cpu_s"].get(role), after[-1]["cpu_s"].get(role)
        if a is not None and b is not None:
            cores[role] = round((b - a) / max(1e-9, after[-1]["t"] - after[0]["t"]), 2)
    drift = round(p99_last / p99_first - 1, 3) if p99_first and p99_last else None
    return {"rss_growth_mb_per_10min": growth, "rss_growth_later": later, "p99_first_third_s": p99_first,
            "p99_last_third_s": p99_last, "p99_drift": drift, "cpu_cores": cores}


def _growth(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Each role's RSS growth in MB per 10 minutes over `samples` (a least-squares slope)."""
    growth = {}
    for role in (samples[0]["rss_mb"] if samples else {}):
        per_s = slope([(s["t"], s["rss_mb"][role]) for s in samples if s["rss_mb"].get(role) is not None])
        if per_s is not None:
            growth[role] = round(per_s * 600, 2)
    return growth


def slope(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (x, y) points; None for fewer than two distinct x."""
    if len(points) < 2:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


def _mid(xs: list[float]) -> float | None:
    return xs[len(xs) // 2] if xs else None


def _p99(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 4) if xs else None


async def capacity(base: str, seconds: float = 20.0, clients: int = 32) -> float:
    """Requests per second that `clients` closed-loop clients get through, each drawing its requests from the
    soak's own mix (KINDS): the capacity of the load the soak then sends a share of."""
    done, t0, rng = 0, time.monotonic(), random.Random(1)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def loop() -> None:
            nonlocal done
            while time.monotonic() - t0 < seconds:
                await _one(client, rng.choice(KINDS))
                done += 1
        await asyncio.gather(*(loop() for _ in range(clients)))
    return done / (time.monotonic() - t0)


FRESH_APP = "fresh"  # the fresh copy of the application that `aging` deploys beside the soaked one


def with_fresh_copy(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config plus a copy of its (first) application under FRESH_APP, routed at /FRESH_APP: deploying it
    leaves the soaked application's replicas as they are (unchanged in the config) and starts new ones."""
    return {**cfg, "applications": [cfg["applications"][0], app_copy(cfg["applications"][0], FRESH_APP)]}


def app_copy(app: dict[str, Any], name: str) -> dict[str, Any]:
    """A deep copy of an application's config under `name`, routed at /name (its replicas are processes of
    their own, titled ServeReplica:name:...)."""
    return {**json.loads(json.dumps(app)), "name": name, "route_prefix": f"/{name}"}


def soak_config(artifacts: Path, port: int, placement: str | None = None) -> dict[str, Any]:
    """The soak's Serve config: the production one (deploy/serve_config.yaml through `prepare_config`, exactly
    what `kvserve serve` deploys) on 127.0.0.1:`port` with `artifacts`' bundles, Serve's access log off (the
    soak's millions of lines are not what it measures). `placement` "split" gives each model a deployment."""
    from serving.server.launch import prepare_config

    cfg = prepare_config(ROOT / "deploy" / "serve_config.yaml", artifacts, host="127.0.0.1", port=port,
                         placement=placement)
    cfg["logging_config"] = {**cfg.get("logging_config", {}), "log_level": "WARNING", "enable_access_log": False}
    return cfg


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aging(cfg: dict[str, Any], base: str, first: float, rate: float, window_s: float = 60.0,
          rounds: int = 2) -> dict[str, Any]:
    """The soaked server against a fresh copy of it (new replica processes) deployed beside it, on the same host
    at the same time, the two measured alternately (soaked, fresh, fresh, soaked, ...): the p99 of the soak's own
    load at `rate` over `rounds` windows of `window_s` each, and the capacity. soaked / fresh above 1 means the
    server itself aged; fresh capacity / `first` is the host's own drift over the soak (a shared host's speed
    changes by tens of percent within minutes, which a first-vs-last comparison cannot tell from aging)."""
    from serving.server.launch import start

    start(with_fresh_copy(cfg), timeout_s=600)
    bases = {"soaked": base, "fresh": f"{base}/{FRESH_APP}"}
    asyncio.run(soak(bases["fresh"], rate, min(30.0, window_s), progress=False))  # the fresh copy's warm-up
    latencies: dict[str, list[float]] = {"soaked": [], "fresh": []}
    statuses: dict[str, Counter] = {"soaked": Counter(), "fresh": Counter()}
    for r in range(rounds):
        for side in ("soaked", "fresh")[:: 1 if r % 2 == 0 else -1]:
            run = asyncio.run(soak(bases[side], rate, window_s, progress=False))
            latencies[side] += [x for _, x in run["latencies"]]
            statuses[side].update(run["statuses"])
    caps: dict[str, list[float]] = {"soaked": [], "fresh": []}
    for side in ("soaked", "fresh", "fresh", "soaked"):
        caps[side].append(asyncio.run(capacity(bases[side])))
    cap = {side: sum(xs) / len(xs) for side, xs in caps.items()}
    p99 = {side: _p99(xs) for side, xs in latencies.items()}
    return {"capacity_req_s": {"start": round(first, 2), "soaked": round(cap["soaked"], 2),
                               "fresh": round(cap["fresh"], 2),
                               "soaked_over_fresh": round(cap["soaked"] / cap["fresh"], 3),
                               "fresh_over_start": round(cap["fresh"] / first, 3)},
            "side_by_side": {"rate_per_s": round(rate, 2), "window_s": window_s, "rounds": rounds, "p99_s": p99,
                             "p99_soaked_over_fresh": round(p99["soaked"] / p99["fresh"], 3)
                             if p99["soaked"] and p99["fresh"] else None,
                             "statuses": {side: dict(c) for side, c in statuses.items()}}}


def gauges(base: str) -> dict[str, float]:
    """The server's KV slots in use and waiting requests (its /metrics, summed over replicas)."""
    text, out = httpx.get(base + "/metrics", timeout=30).text, {}
    for name in ("kvserve_kv_slots_used", "kvserve_waiting_requests", "kvserve_running_requests"):
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(name + "{") or line.startswith(name + " "))
    return out


def idle_after(base: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The gauges once they read 0 (or after `timeout_s`): Ray exports them every second or two."""
    t0 = time.monotonic()
    while True:
        g = gauges(base)
        if not any(g.values()) or time.monotonic() - t0 > timeout_s:
            return g
        time.sleep(1.0)


def plot(samples: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = [s["t"] / 60 for s in samples]
    for role in samples[0]["rss_mb"]:
        ax.plot(t, [s["rss_mb"].get(role) for s in samples], label=role)
    ax.set_ylabel("RSS (MB)")
    ax.legend(loc="center right", fontsize=8)
    ax.set_title("Soak: memory and latency over time at ~70% of capacity")
    ax2.plot(t, [s["p99_s"] for s in samples], color="tab:red")
    ax2.set_ylabel("p99 latency per 10 s (s)")
    ax2.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=None, help="left out of the growth fit (default: 1/6)")
    p.add_argument("--share", type=float, default=0.7, help="the load as a share of the measured capacity")
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="holds bundles/generate")
    p.add_argument("--out", type=Path, default=Path("docs/img"), help="where soak.png goes")
    p.add_argument("--raw", type=Path, default=None, help="the figures' JSON (default: ARTIFACTS/bench/soak.json)")
    p.add_argument("--compare-seconds", type=float, default=60.0,
                   help="each window of the soaked-vs-fresh comparison at the end (4 windows)")
    p.add_argument("--placement", choices=("colocated", "split"), default=None,
                   help="default: as deploy/serve_config.yaml says (the models in the ingress replica); split: "
                        "each model in a deployment of its own")
    args = p.parse_args(argv)
    from serving.server.config import validate_serve_config
    from serving.server.launch import cpus_needed, start, stop
    from serving.server.ray_env import MALLOC_ENV

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg = validate_serve_config(soak_config(args.artifacts, port, args.placement))
    start(cfg, num_cpus=cpus_needed(with_fresh_copy(cfg)), timeout_s=600)  # room for the fresh copy at the end
    try:
        first = asyncio.run(capacity(base))
        rate = args.share * first
        print(f"capacity measured; soaking at {rate:.1f} req/s for {args.minutes:g} min", file=sys.stderr)
        run = asyncio.run(soak(base, rate, args.minutes * 60))
        env = processes()["ingress"].environ()  # what the server's processes run with (ray_env.MALLOC_ENV)
        idle = idle_after(base)
        aged = aging(cfg, base, first, rate, args.compare_seconds)
    finally:
        stop()
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None else args.minutes / 6)
    placement = "split" if args.placement == "split" else "colocated"
    result = {"minutes": args.minutes, "placement": placement, "rate_per_s": round(rate, 2),
              "statuses": run["statuses"], "idle_after": idle,
              "ingress_malloc_env": {k: env.get(k) for k in MALLOC_ENV},
              **summary(run["samples"], warmup_s, run["latencies"]), **aged, "samples": run["samples"]}
    raw = args.raw or args.artifacts / "bench" / "soak.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(run["samples"], args.out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    fivexx = sum(n for s, n in run["statuses"].items() if s.startswith("5"))
    return 1 if fivexx or any(idle.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
