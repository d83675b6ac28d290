"""Admission under pressure against a real local Ray Serve cluster (slow): what is refused and how, while
what was accepted finishes. Overload: the excess gets 429 + Retry-After at once, queues and memory stay
bounded. Graceful drain (what `kvserve serve` does on Ctrl-C/SIGTERM): new requests get 503 + Retry-After,
requests in flight complete. Faults (a replica killed, clients that hang up, a silent model) are in
tests/test_reliability.py; the application in tests/reliability_cluster.py. Figures are printed as
`RELIABILITY {...}` lines (run with -s) and quoted in docs/reliability.md.

    .venv/bin/python -m pytest -m slow tests/test_reliability_admission.py -o addopts='-q' -s
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import json
import random
import time

import httpx
import pytest

from reliability_client import BUSY, CLIENT_TIMEOUT_S, GEN, LONG, Outcome, counts, post
from reliability_cluster import DEADLINE_S, engine_snapshot, metric, percentile, replica_infos, report, rss_mb, wait_for


# -- overload ------------------------------------------------------------------------------------------------
def _single_pid(model: str) -> int:
    (pid,) = replica_infos(model, 2)
    return pid


async def _closed_loop(client: httpx.AsyncClient, body: dict, users: int, seconds: float) -> float:
    """Requests per second that `users` back-to-back clients complete (the capacity at this concurrency)."""
    stop, done = time.monotonic() + seconds, 0

    async def user() -> None:
        nonlocal done
        while time.monotonic() < stop:
            o = await post(client, body)
            assert o.status == 200, o
            done += 1
    t0 = time.monotonic()
    await asyncio.gather(*(user() for _ in range(users)))
    return done / (time.monotonic() - t0)


async def _open_loop(client: httpx.AsyncClient, body: dict, rate: float, seconds: float) -> list[Outcome]:
    """Poisson arrivals at `rate`/s for `seconds`, each request sent at its arrival whatever is in flight."""
    rng, tasks, t = random.Random(0), [], 0.0
    t0 = time.monotonic()
    while t < seconds:
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
        tasks.append(asyncio.create_task(post(client, body)))
    return list(await asyncio.gather(*tasks))


async def _gauge_peaks(client: httpx.AsyncClient, model: str, until: asyncio.Event) -> dict[str, float]:
    """Peaks of the waiting and running gauges, and of their sum in one scrape ("admitted")."""
    names = ("kvserve_waiting_requests", "kvserve_running_requests")
    peaks = dict.fromkeys((*names, "admitted"), 0.0)
    while not until.is_set():
        text = (await client.get("/metrics")).text
        now = {name: metric(text, name, model=model) for name in names}
        for name, value in (*now.items(), ("admitted", sum(now.values()))):
            peaks[name] = max(peaks[name], value)
        await asyncio.sleep(0.5)
    return peaks


@pytest.mark.slow
def test_overload_is_refused_with_429_promptly(rel):
    """At 4x the measured capacity of `busy` (2 KV slots, 2 waiting, Ray queue 6) the excess gets 429 +
    Retry-After at once; accepted requests finish within the deadline; queues and memory stay bounded;
    readiness is green afterwards."""
    pid = _single_pid("busy")

    async def run() -> tuple[float, list[Outcome], dict]:
        async with rel.async_client(timeout=CLIENT_TIMEOUT_S, connections=400) as client:
            await _closed_loop(client, BUSY, 4, 1.0)  # warm up
            capacity = await _closed_loop(client, BUSY, 4, 3.0)
            rss["before"] = rss_mb(pid)
            stop = asyncio.Event()
            peaks = asyncio.create_task(_gauge_peaks(client, "busy", stop))
            outcomes = await _open_loop(client, BUSY, 4 * capacity, 6.0)
            stop.set()
            return capacity, outcomes, await peaks
    rss: dict[str, float] = {}
    capacity, outcomes, peaks = asyncio.run(run())
    rss["after"] = rss_mb(pid)
    with rel.client() as client:
        ready_s = wait_for(lambda: client.get("/v2/health/ready").status_code == 200, 10, 0.1)

    c = counts(outcomes)
    ok = [o.latency for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    reasons = collections.Counter(o.error["message"].split(":")[0][:40] for o in refused)
    report("overload", capacity_rps=round(capacity, 1), offered_rps=round(4 * capacity, 1), requests=len(outcomes),
           statuses=c, accepted_p50_s=round(percentile(ok, 0.5), 3), accepted_max_s=round(max(ok), 3),
           refused_p50_s=round(percentile([o.latency for o in refused], 0.5), 3),
           refused_p99_s=round(percentile([o.latency for o in refused], 0.99), 3),
           refusal_kinds=dict(reasons), gauge_peaks=peaks, rss_mb={k: round(v, 1) for k, v in rss.items()},
           ready_after_s=ready_s)
    assert set(c) <= {"200", "429"}, [(o.status, o.error, o.failure) for o in outcomes if o.status not in (200, 429)][:5]
    assert len(refused) >= len(outcomes) // 3, c  # 4x capacity: most of the excess is refused
    assert all(o.retry_after and int(o.retry_after) >= 1 and o.error["type"] == "overloaded" for o in refused)
    assert percentile([o.latency for o in refused], 0.99) < 2.0, "429s were not prompt"
    assert max(ok) < DEADLINE_S, "an accepted request took longer than its deadline"
    # the engine admits up to max_waiting (2) beyond its busy slots: a request admitted while a slot is free
    # waits for the next step to take it, so the waiting gauge alone may read 3 or 4, never the sum above 4
    assert peaks["admitted"] <= 2 + 2 and peaks["kvserve_running_requests"] <= 2, peaks
    assert rss["after"] - rss["before"] < 64, rss
    assert ready_s is not None


# -- graceful drain -----------------------------------------------------------------------------------------------
def _stream_to_end(base: str, headers: dict, body: dict) -> tuple[int, dict, float]:
    with httpx.stream("POST", base + "/v1/generate", json={**body, "stream": True}, headers=headers,
                      timeout=CLIENT_TIMEOUT_S) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    return r.status_code, events[-1] if events else {}, time.monotonic()


@pytest.mark.slow
def test_graceful_drain_finishes_in_flight_and_refuses_new(rel):
    """`serving.server.launch.drain` (what `kvserve serve` runs on Ctrl-C/SIGTERM before deleting the app): requests in
    flight (plain and streamed) complete in full; new ones get 503 + Retry-After at once; readiness turns
    503 while liveness stays 200; `draining: false` resumes."""
    from serving.server.launch import drain, start, with_draining

    body = LONG
    sync = rel.client(timeout=CLIENT_TIMEOUT_S)
    pool = cf.ThreadPoolExecutor(12)
    try:
        def plain() -> tuple[int, dict, float]:  # its own connection: one client per thread
            r = httpx.post(rel.base + "/v1/generate", json=body, headers=rel.auth, timeout=CLIENT_TIMEOUT_S)
            return r.status_code, r.json(), time.monotonic()
        in_flight = [pool.submit(plain) for _ in range(6)] + [
            pool.submit(_stream_to_end, rel.base, rel.auth, body) for _ in range(2)]
        assert wait_for(lambda: engine_snapshot("long")["running"] == 8, 30), engine_snapshot("long")
        t0 = time.monotonic()
        drained = pool.submit(drain, rel.raw, 60)
        draining_s = wait_for(lambda: sync.get("/v2/health/ready").status_code == 503, 30, 0.05)
        refused_at = time.monotonic()
        refused = [sync.post("/v1/generate", json=GEN) for _ in range(10)]
        live = sync.get("/v2/health/live").status_code
        assert drained.result(timeout=90) is True
        drain_s = time.monotonic() - t0
        results = [f.result(timeout=60) for f in in_flight]
    finally:
        start(with_draining(rel.raw, False), timeout_s=120)
        pool.shutdown(wait=False)
    resumed = sync.post("/v1/generate", json=GEN).status_code
    ready = sync.get("/v2/health/ready").status_code
    sync.close()

    finished_after_refusals = sum(done > refused_at for _, _, done in results)
    report("graceful_drain", in_flight=len(results), draining_after_s=draining_s and round(draining_s, 2),
           refused=counts([Outcome(r.status_code, 0) for r in refused]), drain_s=round(drain_s, 2),
           in_flight_finished_after_refusals=finished_after_refusals,
           in_flight_statuses=counts([Outcome(s, 0) for s, _, _ in results]))
    assert draining_s is not None and live == 200
    assert all(r.status_code == 503 and r.headers.get("retry-after") == "1" for r in refused), refused[0].text
    assert all(r.json()["error"]["type"] == "unavailable" and "retry" in r.json()["error"]["message"]
               for r in refused)
    assert finished_after_refusals >= 1, "in-flight requests ended before draining began: the test proved nothing"
    for status, final, _ in results:
        assert status == 200, final
        tokens = final["usage"]["completion_tokens"]
        assert tokens == body["max_tokens"] and final["finish_reason"] == "length", final
    assert resumed == 200 and ready == 200
