"""Reliability scenarios against a real local Ray Serve cluster (slow): replica failure under load, overload,
clients that drop their streams, graceful drain. The application and its models are described in
tests/reliability_cluster.py; figures are printed as `RELIABILITY {...}` lines (run with -s) and quoted in
docs/reliability.md. One fast test: the API's deadline backstop when a model stops answering mid-stream.

    .venv/bin/python -m pytest -m slow tests/test_reliability.py -o addopts='-q' -s
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import json
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from serving.server.stream import DEADLINE_GRACE_S

from reliability_cluster import (DEADLINE_S, engine_snapshot, metric, percentile, replica_infos, report,
                                 rss_mb, wait_for)

GRACE_S = DEADLINE_GRACE_S  # the backstop past the engine's own deadline
CLIENT_TIMEOUT_S = DEADLINE_S + GRACE_S + 10  # a response later than this counts as a hang
GEN = {"model": "generate", "prompt": "the quick", "max_tokens": 60, "ignore_eos": True}  # KV cache: 64
BUSY = {"model": "busy", "prompt": "the", "max_tokens": 100, "ignore_eos": True}
LONG = {"model": "long", "prompt": "the", "max_tokens": 250, "ignore_eos": True}  # KV cache: 256


@dataclass
class Outcome:
    status: int | None  # None: no HTTP response at all (connection error or client timeout)
    latency: float
    retry_after: str | None = None
    error: dict | None = None
    failure: str | None = None
    finished_at: float = 0.0


async def post(client: httpx.AsyncClient, body: dict, path: str = "/v1/generate") -> Outcome:
    t0 = time.monotonic()
    try:
        r = await client.post(path, json=body)
    except httpx.HTTPError as e:
        return Outcome(None, time.monotonic() - t0, failure=f"{type(e).__name__}: {e}")
    error = None
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        error = r.json().get("error")
    return Outcome(r.status_code, time.monotonic() - t0, r.headers.get("retry-after"), error,
                   finished_at=time.monotonic())


async def stream(client: httpx.AsyncClient, body: dict) -> Outcome:
    """A streamed /v1/generate: a 200 ends with the final event, or with an error event after a failure."""
    t0 = time.monotonic()
    try:
        async with client.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(r.status_code, time.monotonic() - t0, r.headers.get("retry-after"),
                               r.json().get("error"), finished_at=time.monotonic())
            events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        return Outcome(None, time.monotonic() - t0, failure=f"{type(e).__name__}: {e}")
    final = events[-1] if events else {}
    outcome = Outcome(200, time.monotonic() - t0, error=final.get("error"), finished_at=time.monotonic())
    if outcome.error is None:  # a complete stream: every token once, in order (a replayed stream would not be)
        tokens = [e["token"] for e in events[:-1]]
        if "".join(tokens) != final.get("text") or len(tokens) > final["usage"]["completion_tokens"]:
            outcome.failure = f"stream text differs from its final event: {tokens!r} vs {final!r}"
    return outcome


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(sorted(collections.Counter(str(o.status) for o in outcomes).items()))


# -- fast: a model that stops answering ------------------------------------------------------------------------
class SilentModel:
    """serving.server.api.Backend whose model answers `pieces` stream items and then never again (a replica that
    hangs), to show that the API's own deadline still ends every request."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces

    def model_tasks(self) -> dict[str, str]:
        return {"generate": "generate"}

    async def complete(self, model: str, req: Any) -> Any:
        await asyncio.Event().wait()

    async def stream(self, model: str, req: Any) -> AsyncIterator[Any]:
        from serving.server.service import StreamPiece
        for i in range(self.pieces):
            yield StreamPiece("tok ", i)
        await asyncio.Event().wait()

    async def ready(self) -> bool:
        return True

    async def metrics_text(self) -> str:
        return ""


@pytest.mark.parametrize("pieces,stream,status", [(0, False, 504), (0, True, 504), (2, True, 200)])
async def test_a_silent_model_cannot_hold_a_request_past_its_deadline(pieces, stream, status):
    from serving.server.api import create_app
    from serving.server.config import Limits
    from serving.server.metrics import Recorder

    app = create_app(SilentModel(pieces), Limits(request_timeout_s=0.2), Recorder("prometheus"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        t0 = time.monotonic()
        r = await client.post("/v1/generate", json={"prompt": "x", "stream": stream}, timeout=30)
        took = time.monotonic() - t0
    assert r.status_code == status and took < 0.2 + GRACE_S + 1.5, (r.status_code, took)
    if status == 504:
        assert r.json()["error"]["type"] == "deadline_exceeded"
    else:  # the stream had started: its last event says why it ended
        events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert [e.get("token") for e in events[:-1]] == ["tok ", "tok "]
        assert events[-1]["error"]["type"] == "deadline_exceeded"


# -- replica failure -----------------------------------------------------------------------------------------
def _two_replicas() -> dict[int, dict]:
    infos: dict[int, dict] = {}

    def both() -> bool:
        infos.update(replica_infos("generate", 6))
        return len(infos) == 2
    assert wait_for(both, 30), infos
    return infos


def _replaced(victim: int) -> bool:
    try:
        infos = replica_infos("generate", 6)
    except Exception:  # calls routed to the dead replica fail until Serve has replaced it
        return False
    return victim not in infos and len(infos) == 2


@pytest.mark.slow
def test_replica_failure_under_load(rel):
    """kill -9 one of two `generate` replicas while 240 requests (a quarter streamed) run: each request gets
    one response -- a 200 (Serve retries a plain request whose replica died on the other replica), or a 503
    that says to retry (with Retry-After), or for a stream already answering, an `unavailable` error event --
    none outlives its deadline, no stream repeats a token; Serve replaces the replica, which serves."""
    replicas = _two_replicas()
    n, concurrency = 240, 24

    async def run() -> tuple[list[Outcome], int, dict, float, int]:
        async with rel.async_client(timeout=CLIENT_TIMEOUT_S) as client:
            sem, done = asyncio.Semaphore(concurrency), 0

            async def one(i: int) -> Outcome:
                nonlocal done
                async with sem:
                    outcome = await (stream(client, GEN) if i % 4 == 0 else post(client, GEN))
                done += 1
                return outcome
            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            while done < n // 4:
                await asyncio.sleep(0.005)
            before = await asyncio.to_thread(replica_infos, "generate", 6)
            # the busier replica: Serve's router may have sent this moment's load to one of the two
            victim = max(replicas, key=lambda pid: before.get(pid, {}).get("engine", {}).get("running") or 0)
            os.kill(victim, signal.SIGKILL)
            done_at_kill, killed_at = done, time.monotonic()
            return list(await asyncio.gather(*tasks)), done_at_kill, before, killed_at, victim
    outcomes, done_at_kill, before, killed, victim = asyncio.run(run())
    served_s = time.monotonic() - killed
    recovered = wait_for(lambda: _replaced(victim), 90, 0.5)
    recovered_s = None if recovered is None else time.monotonic() - killed
    with rel.client() as client:
        after = [client.post("/v1/generate", json=GEN).status_code for _ in range(20)]
    served_by = set(replica_infos("generate", 8))

    c = counts(outcomes)
    latencies = [o.latency for o in outcomes]
    victim_running = before.get(victim, {}).get("engine", {}).get("running")
    stream_errors = sum(o.status == 200 and o.error is not None for o in outcomes)
    report("replica_failure", requests=n, concurrency=concurrency, done_before_kill=done_at_kill, statuses=c,
           running_on_victim_before_kill=victim_running, streams_ended_by_error_event=stream_errors,
           p50_s=round(percentile(latencies, 0.5), 3), max_s=round(max(latencies), 3),
           rest_served_in_s=round(served_s, 1),
           recovered_s=None if recovered_s is None else round(recovered_s, 1), after_recovery=counts(
               [Outcome(s, 0) for s in after]))
    hit = c.get("503", 0) + stream_errors
    assert victim_running or hit, f"the kill hit no request in flight: the scenario did not happen ({before})"
    assert all(o.status is not None for o in outcomes), [o.failure for o in outcomes if o.status is None][:5]
    assert set(c) <= {"200", "503"}, [(o.status, o.error) for o in outcomes if o.status not in (200, 503)][:5]
    assert not [o.failure for o in outcomes if o.failure], [o.failure for o in outcomes if o.failure][:3]
    for o in outcomes:
        if o.status == 503:
            assert o.retry_after and int(o.retry_after) >= 1, o
        if o.error is not None:  # a 503, or a stream that was answering when its replica died
            assert o.error["type"] == "unavailable" and "retry" in o.error["message"], o.error
    assert max(latencies) <= DEADLINE_S + GRACE_S + 1, f"a request hung past its deadline: {max(latencies):.1f}s"
    assert recovered_s is not None, "Serve did not bring a second replica back within 90 s"
    assert after == [200] * 20 and victim not in served_by and len(served_by) == 2


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


# -- clients that drop their streams ---------------------------------------------------------------------------
@pytest.mark.slow
def test_dropped_streams_free_their_kv_slots(rel):
    """100 streaming clients of `long` (104 KV slots, 250 tokens each) read a few tokens, then all hang up:
    the engine had all 100 in slots, and frees every slot within a second or two."""
    n = 100
    assert wait_for(lambda: engine_snapshot("long")["slots_used"] == 0, 30), engine_snapshot("long")
    with rel.client() as c:
        cancelled_before = metric(c.get("/metrics").text, "kvserve_cancellations_total", model="long",
                                  reason="disconnect")

    async def run() -> tuple[dict, float, list[int]]:
        ready, all_in, drop = 0, asyncio.Event(), asyncio.Event()
        read: list[int] = []

        async def one(i: int, client: httpx.AsyncClient) -> None:
            nonlocal ready
            async with client.stream("POST", "/v1/generate", json={**LONG, "stream": True}) as r:
                assert r.status_code == 200, await r.aread()
                # Not `async for ... break`: the abandoned line iterator, once collected, would close the
                # connection early. Holding it keeps the client connected, just not reading.
                lines, events = r.aiter_lines(), 0
                while events < 1 + i % 5:
                    events += (await lines.__anext__()).startswith("data: ")
                read.append(events)
                ready += 1
                if ready == n:
                    all_in.set()
                await drop.wait()
            # Leaving the block closes the connection with the response unfinished: the client is gone.
        async with rel.async_client(timeout=CLIENT_TIMEOUT_S, connections=n + 10) as client:
            t0 = time.monotonic()
            tasks = [asyncio.create_task(one(i, client)) for i in range(n)]
            await asyncio.wait_for(all_in.wait(), 60)
            figures["all_streaming_after_s"] = round(time.monotonic() - t0, 2)
            snapshot = await asyncio.to_thread(engine_snapshot, "long")
            drop.set()
            dropped = time.monotonic()
            await asyncio.gather(*tasks)
        return snapshot, dropped, read
    figures: dict = {}
    snapshot, dropped, read = asyncio.run(run())
    engine_free_s = wait_for(lambda: engine_snapshot("long")["slots_used"] == 0, 30, 0.02)
    engine_free_s = None if engine_free_s is None else time.monotonic() - dropped
    with rel.client() as c:
        gauge_free_s = wait_for(lambda: metric(c.get("/metrics").text, "kvserve_kv_slots_used", model="long") == 0,
                                30, 0.1)
        gauge_free_s = None if gauge_free_s is None else time.monotonic() - dropped
        wait_for(lambda: metric(c.get("/metrics").text, "kvserve_cancellations_total", model="long",
                                reason="disconnect") >= cancelled_before + n, 20, 0.5)
        cancelled = metric(c.get("/metrics").text, "kvserve_cancellations_total", model="long",
                           reason="disconnect") - cancelled_before
    report("disconnects", clients=n, events_read_min=min(read), events_read_max=max(read), **figures,
           slots_used_before_drop=snapshot["slots_used"], running_before_drop=snapshot["running"],
           engine_slots_free_s=engine_free_s and round(engine_free_s, 2),
           gauge_zero_s=gauge_free_s and round(gauge_free_s, 2), disconnect_cancellations=cancelled)
    assert snapshot["slots_used"] == n and snapshot["running"] == n, snapshot  # all were really generating
    assert engine_free_s is not None and engine_free_s < 2.0, engine_free_s
    assert gauge_free_s is not None and gauge_free_s < 5.0, gauge_free_s  # + Ray's 1 s metrics export period
    assert cancelled == n, cancelled


# -- graceful drain -----------------------------------------------------------------------------------------------
def _stream_to_end(base: str, headers: dict, body: dict) -> tuple[int, dict, float]:
    with httpx.stream("POST", base + "/v1/generate", json={**body, "stream": True}, headers=headers,
                      timeout=CLIENT_TIMEOUT_S) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    return r.status_code, events[-1] if events else {}, time.monotonic()


@pytest.mark.slow
def test_graceful_drain_finishes_in_flight_and_refuses_new(rel):
    """`serve_cli.drain` (what `kvserve serve` runs on Ctrl-C/SIGTERM before deleting the app): requests in
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
