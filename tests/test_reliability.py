"""Reliability under faults against a real local Ray Serve cluster (slow): a replica killed under load,
clients that drop their streams; and one fast test: the API's deadline backstop when a model stops answering
mid-stream. Overload and graceful drain (what is refused, and how) are in tests/test_reliability_admission.py.
The application and its models are described in tests/reliability_cluster.py; figures are printed as
`RELIABILITY {...}` lines (run with -s) and quoted in docs/reliability.md.

    .venv/bin/python -m pytest -m slow tests/test_reliability.py tests/test_reliability_admission.py -o addopts='-q' -s
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from reliability_client import CLIENT_TIMEOUT_S, GEN, GRACE_S, LONG, Outcome, counts, post, stream
from reliability_cluster import DEADLINE_S, engine_snapshot, metric, percentile, replica_infos, report, wait_for


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
            yield [StreamPiece("tok ", i)]
        await asyncio.Event().wait()

    async def models_ready(self) -> dict[str, bool]:
        return {"generate": True}

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
    """kill -9 one of two `generate` replicas while 240 requests (a quarter streamed) run: none is lost. Every
    request gets a 200: the ingress sends a request whose replica died before answering once more, to the live
    replica; only a stream that was already answering may end with an `unavailable` error event (retryable).
    None outlives its deadline, no stream repeats a token; Serve replaces the replica, which serves."""
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
    assert victim_running or stream_errors, f"the kill hit no request in flight: the scenario did not happen ({before})"
    assert all(o.status is not None for o in outcomes), [o.failure for o in outcomes if o.status is None][:5]
    assert set(c) == {"200"}, [(o.status, o.error) for o in outcomes if o.status != 200][:5]
    assert not [o.failure for o in outcomes if o.failure], [o.failure for o in outcomes if o.failure][:3]
    for o in outcomes:
        if o.error is not None:  # a stream that was answering when its replica died
            assert o.error["type"] == "unavailable" and "retry" in o.error["message"], o.error
    assert max(latencies) <= DEADLINE_S + GRACE_S + 1, f"a request hung past its deadline: {max(latencies):.1f}s"
    assert recovered_s is not None, "Serve did not bring a second replica back within 90 s"
    assert after == [200] * 20 and victim not in served_by and len(served_by) == 2


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
