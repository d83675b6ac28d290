"""What clients do to the server, against a real local Ray Serve cluster (slow): plain (non-streaming)
requests whose clients hang up, and anonymous /metrics scraped 200 times a second. The application is
tests/reliability_cluster.py's; figures are printed as `RELIABILITY {...}` lines (run with -s) and quoted in
docs/reliability.md.

    .venv/bin/python -m pytest -m slow tests/test_reliability_clients.py -o addopts='-q' -s

- 100 plain `/v1/generate` (250 tokens each, `long`) and 20 eight-text `/v1/translate` (250 tokens per
  text, `longtr`) requests, sent one every 10 ms, whose clients close the connection 0.5 s after sending:
  every KV slot is free within 2 s of the last hang-up and the engines generated less than 10% of the
  tokens asked for.
- 200 anonymous `/metrics` per second (from a separate process) do not raise the p99 latency of
  authenticated `/v1/generate` requests by more than 20%: HAProxy answers all but about one a second from
  its cache (serving/server/haproxy.py). The same rate of `/v2/health/live`, a cheap route
  that every time reaches the ingress, is measured in the same run (alternated) for comparison.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from reliability_client import CLIENT_TIMEOUT_S, LONG, post
from reliability_cluster import engine_snapshot, metric, percentile, report, wait_for

pytestmark = pytest.mark.slow
TEXTS = ["the quick brown fox", "jumps over the lazy dog", "the dog", "brown fox over the dog",
         "the lazy fox", "over the quick dog", "a dog and a fox", "the fox jumps"]
TRANSLATE = {"model": "longtr", "text": TEXTS, "max_tokens": 250}
HANG_UP_S, SEND_EVERY_S = 0.5, 0.01


async def _hang_up(port: int, key: str, path: str, body: dict, after_s: float) -> bytes:
    """Send one plain request on a raw connection and close it after `after_s`; returns what came back by then."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    try:
        early = await asyncio.wait_for(reader.read(64), after_s)
    except asyncio.TimeoutError:
        early = b""
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return early


def _tokens(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m: metric(text, "kvserve_generated_tokens_total", model=m) for m in ("long", "longtr")} | {
        "cancelled": sum(metric(text, "kvserve_cancellations_total", model=m, reason="disconnect")
                         for m in ("long", "longtr"))}


async def _peaks(models: tuple[str, ...], until: asyncio.Event) -> dict[str, int]:
    """The most requests each model's engine had running at once, sampled every 0.1 s until `until`."""
    peaks = dict.fromkeys(models, 0)
    while not until.is_set():
        for m in models:
            peaks[m] = max(peaks[m], (await asyncio.to_thread(engine_snapshot, m))["running"])
        await asyncio.sleep(0.1)
    return peaks


async def _staggered_hang_ups(rel, every_s: float = SEND_EVERY_S) -> tuple[list[bytes], dict[str, int], float]:
    """100 plain generate and 20 eight-text translate requests, one every `every_s` (a sixth of them
    translate), each closed by its client HANG_UP_S after it was sent."""
    port, done = rel.raw["http_options"]["port"], asyncio.Event()
    peaks = asyncio.create_task(_peaks(("long", "longtr"), done))
    tasks = []
    for i in range(120):
        path, body = ("/v1/translate", TRANSLATE) if i % 6 == 5 else ("/v1/generate", LONG)
        tasks.append(asyncio.create_task(_hang_up(port, rel.api_key, path, body, HANG_UP_S)))
        await asyncio.sleep(every_s)
    early = await asyncio.gather(*tasks)
    closed = time.monotonic()
    done.set()
    return early, await peaks, closed


def test_plain_requests_whose_clients_hang_up_free_their_slots(rel):
    models = ("long", "longtr")
    assert wait_for(lambda: all(engine_snapshot(m)["slots_used"] == 0 for m in models), 30)
    with rel.client() as c:
        before = _tokens(c)
    early, peaks, closed = asyncio.run(_staggered_hang_ups(rel))
    free_s = wait_for(lambda: all(engine_snapshot(m)["slots_used"] == 0 and engine_snapshot(m)["waiting"] == 0
                                  for m in models), 30, 0.02)
    free_s = None if free_s is None else time.monotonic() - closed
    with rel.client() as c:  # Ray exports each replica's counters every second; /metrics caches for one more
        wait_for(lambda: _tokens(c)["cancelled"] - before["cancelled"] >= 100 + 160, 15, 0.5)
        time.sleep(2.5)
        after = _tokens(c)
    asked = {"long": 100 * LONG["max_tokens"], "longtr": 160 * TRANSLATE["max_tokens"]}
    generated = {m: after[m] - before[m] for m in models}
    report("plain_disconnects", generate_requests=100, translate_requests=20, texts_per_translate=len(TEXTS),
           hang_up_after_s=HANG_UP_S, sent_every_s=SEND_EVERY_S, answered_before_hang_up=sum(bool(e) for e in early),
           peak_running=peaks, slots_free_after_last_hang_up_s=free_s and round(free_s, 2),
           generated_tokens=generated, asked_tokens=asked,
           generated_share={m: round(generated[m] / asked[m], 4) for m in models},
           disconnect_cancellations=after["cancelled"] - before["cancelled"])
    assert not any(early), [e for e in early if e][:3]  # every request was still running when its client left
    assert all(peaks[m] > 0 and generated[m] > 0 for m in models), (peaks, generated)  # ... in the engines
    assert free_s is not None and free_s < 2.0, free_s
    for m in models:
        assert generated[m] < 0.1 * asked[m], (m, generated[m], asked[m])


# -- /metrics under load ---------------------------------------------------------------------------------------
FLOOD = r"""
import asyncio, collections, json, resource, sys, time
from urllib.parse import urlsplit

async def main(base, path, rate, seconds):
    # A flood from a client as cheap as a real one on another machine: HTTP/1.1 keep-alive over plain asyncio
    # streams, the body read as bytes and never decompressed or decoded (httpx spends ~3 ms of CPU per
    # gzipped /metrics answer: on a few cores the client, not the server, would be measured).
    u = urlsplit(base)
    head = (f"GET {path} HTTP/1.1\r\nHost: {u.netloc}\r\nAccept-Encoding: gzip\r\n\r\n").encode()
    statuses, idle = collections.Counter(), []

    async def one():
        conn = idle.pop() if idle else await asyncio.open_connection(u.hostname, u.port)
        try:
            reader, writer = conn
            writer.write(head)
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                elif line.lower().startswith(b"age:"):  # answered from HAProxy's cache
                    statuses["cached"] += 1
            await reader.readexactly(length)
            statuses[str(status)] += 1
            idle.append(conn)
        except (OSError, asyncio.IncompleteReadError, IndexError, ValueError) as e:
            statuses[type(e).__name__] += 1
            conn[1].close()

    tasks, t0, k = [], time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        tasks.append(asyncio.create_task(one()))
        k += 1
        await asyncio.sleep(max(0.0, t0 + k / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"sent": k, "rate": k / (time.monotonic() - t0), "statuses": statuses,
                      "cpu_share": (cpu.ru_utime + cpu.ru_stime) / (time.monotonic() - t0)}))

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
"""
FLOOD_RATE, PHASE_S, ROUNDS, USERS = 200.0, 6.0, 3, 4
SHORT = {"model": "generate", "prompt": "the", "max_tokens": 8, "ignore_eos": True}


async def _latencies(rel, seconds: float) -> list[float]:
    """Latencies of authenticated /v1/generate requests sent back to back by USERS clients for `seconds`."""
    out: list[float] = []
    stop = time.monotonic() + seconds
    async with rel.async_client(timeout=CLIENT_TIMEOUT_S) as client:
        async def user() -> None:
            while time.monotonic() < stop:
                o = await post(client, SHORT)
                assert o.status == 200, o
                out.append(o.latency)
        await asyncio.gather(*(user() for _ in range(USERS)))
    return out


def _phase(rel, path: str | None) -> tuple[list[float], dict | None]:
    """One measuring phase, with a flood of `path` from a separate process (None: no flood)."""
    flood = None
    if path is not None:
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, rel.base, path, str(FLOOD_RATE), str(PHASE_S + 1)],
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the flood is running before the measurement starts
    latencies = asyncio.run(_latencies(rel, PHASE_S))
    if flood is None:
        return latencies, None
    out, _ = flood.communicate(timeout=60)
    return latencies, json.loads(out)


def _scrape_cost() -> dict:
    """What one cross-node scrape costs (the ingress does it at most once a second): bytes, seconds."""
    from serving.server.metrics import RayNodeScraper, aggregate_exposition

    t0 = time.perf_counter()
    texts = asyncio.run(RayNodeScraper().texts())
    t1 = time.perf_counter()
    out = aggregate_exposition(texts)
    return {"nodes": len(texts), "node_bytes": sum(map(len, texts)), "fetch_s": round(t1 - t0, 4),
            "aggregate_s": round(time.perf_counter() - t1, 4), "exposition_bytes": len(out)}


def test_a_metrics_flood_does_not_slow_the_api(rel):
    with rel.client() as c:
        assert c.get("/metrics").status_code == 200
    scrape = _scrape_cost()
    asyncio.run(_latencies(rel, 2))  # warm-up
    lat: dict[str, list[float]] = {"none": [], "/metrics": [], "/v2/health/live": []}
    floods: dict[str, list[dict]] = {"/metrics": [], "/v2/health/live": []}
    for _ in range(ROUNDS):  # alternated, so the machine's drift hits every kind alike
        for kind in lat:
            got, flood = _phase(rel, None if kind == "none" else kind)
            lat[kind] += got
            if flood is not None:
                floods[kind].append(flood)
    p99 = {k: percentile(v, 0.99) for k, v in lat.items()}
    p50 = {k: percentile(v, 0.5) for k, v in lat.items()}
    report("metrics_flood", scrape=scrape, flood_rate=FLOOD_RATE, phase_s=PHASE_S, rounds=ROUNDS, users=USERS,
           requests={k: len(v) for k, v in lat.items()}, p50_s={k: round(v, 4) for k, v in p50.items()},
           p99_s={k: round(v, 4) for k, v in p99.items()},
           p99_ratio={k: round(p99[k] / p99["none"], 3) for k in floods},
           flood_rates={k: [round(f["rate"], 1) for f in v] for k, v in floods.items()},
           flood_statuses={k: [f["statuses"] for f in v] for k, v in floods.items()},
           flood_client_cpu={k: [round(f["cpu_share"], 3) for f in v] for k, v in floods.items()})
    for f in floods["/metrics"]:  # answered by HAProxy's cache but for about one request a second
        assert f["rate"] >= 0.9 * FLOOD_RATE and set(f["statuses"]) == {"200", "cached"}, f
        assert f["statuses"]["cached"] >= 0.9 * f["statuses"]["200"], f
    # /metrics costs what any anonymous route costs: its scrape (one per TTL, shared) adds little to the flood.
    assert p99["/metrics"] <= 1.4 * p99["/v2/health/live"], p99
    assert p99["/metrics"] <= 1.2 * p99["none"], f"a /metrics flood raised p99 {p99['/metrics'] / p99['none']:.2f}x"
