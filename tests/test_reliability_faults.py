"""Health under replica faults against a real local Ray Serve cluster (slow): readiness while replicas die,
and a replica whose engine step hangs. The application is tests/reliability_cluster.py's; the hang runs in a
second, test-only application beside it (tests/fault_app.py). Figures are printed as `RELIABILITY {...}`
lines (run with -s) and quoted in docs/reliability.md.

    .venv/bin/python -m pytest -m slow tests/test_reliability_faults.py -o addopts='-q' -s

- Readiness: kill -9 one of the two `generate` replicas while `/v2/health/ready` and
  `/v2/models/generate/ready` are polled at 20 Hz for 30 s: never a 503, the survivor serves. Kill the only
  `translate` replica: `/v2/models/translate/ready` goes 503 (with Retry-After) until Serve has replaced it,
  while `/v2/models/generate/ready` stays 200.
- Watchdog: one replica's engine step hangs under load: the requests in flight end with a retryable 503 (or
  an error event) after `step_timeout_s`, Serve replaces the replica within 30 s, no request outlives its
  deadline by more than 2 s, and the model serves again.
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import signal
import time

import httpx
import pytest

from reliability_client import CLIENT_TIMEOUT_S, GEN, LONG, Outcome, counts, post, stream
from reliability_cluster import DEADLINE_S, LIMITS, percentile, replica_infos, report, wait_for
from test_reliability import _replaced, _two_replicas

pytestmark = pytest.mark.slow
POLL_HZ, POLL_S = 20, 30.0


async def _poll(base: str, paths: list[str], until: float, hz: float = POLL_HZ,
                stop: asyncio.Event | None = None) -> dict[str, list[tuple[float, int | None]]]:
    """(seconds since start, status or None) of each path, polled together `hz` times a second, anonymously."""
    out: dict[str, list[tuple[float, int | None]]] = {p: [] for p in paths}
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        t0, k = time.monotonic(), 0
        while time.monotonic() - t0 < until and not (stop and stop.is_set()):
            now = time.monotonic() - t0
            answers = await asyncio.gather(*(client.get(p) for p in paths), return_exceptions=True)
            for p, r in zip(paths, answers):
                out[p].append((now, None if isinstance(r, BaseException) else r.status_code))
            k += 1
            await asyncio.sleep(max(0.0, t0 + k / hz - time.monotonic()))
    return out


def _statuses(polls: list[tuple[float, int | None]]) -> dict[str, int]:
    return counts([Outcome(s, 0) for _, s in polls])


def test_readiness_stays_green_while_one_of_two_replicas_dies(rel):
    victim = random.choice(sorted(_two_replicas()))
    paths = ["/v2/health/ready", "/v2/models/generate/ready"]

    async def run() -> tuple[dict, list[int], float | None]:
        served: list[int] = []

        async def kill_then_serve() -> float | None:
            await asyncio.sleep(3)
            os.kill(victim, signal.SIGKILL)
            killed, replaced = time.monotonic(), None
            async with rel.async_client(timeout=CLIENT_TIMEOUT_S) as client:
                while time.monotonic() - killed < POLL_S - 4:
                    served.append((await post(client, {**GEN, "max_tokens": 8})).status)
                    if replaced is None and await asyncio.to_thread(_replaced, victim):
                        replaced = time.monotonic() - killed
                    await asyncio.sleep(0.25)
            return replaced
        polls, replaced = await asyncio.gather(_poll(rel.base, paths, POLL_S), kill_then_serve())
        return polls, served, replaced
    polls, served, replaced = asyncio.run(run())
    back = replaced is not None or wait_for(lambda: _replaced(victim), 60, 0.5) is not None
    report("readiness_replica_kill", hz=POLL_HZ, seconds=POLL_S, polls={p: len(v) for p, v in polls.items()},
           statuses={p: _statuses(v) for p, v in polls.items()}, generate_during=counts([Outcome(s, 0) for s in served]),
           replaced_s=None if replaced is None else round(replaced, 1))
    for path, results in polls.items():
        assert len(results) >= 0.8 * POLL_HZ * POLL_S, (path, len(results))
        bad = [(round(t, 2), s) for t, s in results if s != 200]
        assert bad == [], f"{path} was not ready while a healthy replica served: {bad[:10]}"
    assert served.count(200) >= 0.9 * len(served) and served[-1] == 200, served  # the survivor served
    assert back, "Serve did not replace the killed replica within 90 s"


def test_readiness_is_503_only_for_the_model_without_a_replica(rel):
    (victim,) = replica_infos("translate", 2)
    paths = ["/v2/models/translate/ready", "/v2/models/generate/ready", "/v2/health/ready"]

    async def run() -> dict:
        stop = asyncio.Event()

        async def kill_and_wait() -> None:
            await asyncio.sleep(1)
            os.kill(victim, signal.SIGKILL)
            give_up = time.monotonic() + 80
            async with httpx.AsyncClient(base_url=rel.base, timeout=5) as client:
                for ready in (True, False):  # until Serve noticed the death; then until the new replica runs
                    while ((await client.get(paths[0])).status_code == 200) == ready and time.monotonic() < give_up:
                        await asyncio.sleep(0.05)
            await asyncio.sleep(1)
            stop.set()
        polls, _ = await asyncio.gather(_poll(rel.base, paths, 90, stop=stop), kill_and_wait())
        return polls
    polls = asyncio.run(run())
    down = [t for t, s in polls[paths[0]] if s == 503]
    report("readiness_only_replica_kill", statuses={p: _statuses(v) for p, v in polls.items()},
           translate_503_from_s=down and round(down[0] - 1, 2), translate_503_until_s=down and round(down[-1] - 1, 2))
    assert down, "translate's readiness never went 503 although its only replica was killed"
    assert [s for _, s in polls[paths[1]]] == [200] * len(polls[paths[1]])  # generate: unaffected
    # the server as a whole stays ready (the pods stay in the Service): generate is served
    assert {s for t, s in polls[paths[2]]} == {200}
    with httpx.Client(base_url=rel.base, timeout=5) as client:
        r = client.get(paths[0])
        assert r.status_code == 200 and r.json() == {"name": "translate", "ready": True}


# -- watchdog --------------------------------------------------------------------------------------------------
FAULT_APP, HANG_MODEL, STEP_TIMEOUT_S = "faults", "hangs", 3.0
HANG = {**LONG, "model": HANG_MODEL}  # the `long` bundle: a request runs for seconds, so streams are mid-way


def _with_fault_app(rel) -> dict:
    """The reliability config plus the test-only application `faults` at /faults (1 replica of `hangs`, the
    `long` bundle with 16 slots)."""
    raw = copy.deepcopy(rel.raw)
    key_env = raw["applications"][0]["args"]["api_key_env"]
    engine = {"max_slots": 16, "provider": "cpu", "intra_op_threads": 1, "step_timeout_s": STEP_TIMEOUT_S}
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    raw["applications"].append({
        "name": FAULT_APP, "route_prefix": f"/{FAULT_APP}", "import_path": "tests.fault_app:build_app",
        "args": {"artifacts_dir": str(rel.art), "api_key_env": key_env, "limits": LIMITS,
                 "models": [{"name": HANG_MODEL, "bundle": "bundles/long", "engine": engine}]},
        "deployments": [
            {"name": "ingress", "num_replicas": 1, **small},
            # Serve notices the failed health check within a second; the stuck replica gets 3 s to go.
            {"name": HANG_MODEL, "num_replicas": 1, "max_ongoing_requests": 24, "health_check_period_s": 1,
             "health_check_timeout_s": 10, "graceful_shutdown_timeout_s": 3, "graceful_shutdown_wait_loop_s": 0.5,
             **small, "user_config": {"batching": "continuous", "max_waiting": 16}}]})
    return raw


async def _pid(h, timeout_s: float = 60) -> int | None:
    """The replica's pid, through the handle on the running event loop (with Serve's throughput-optimized data
    plane, a handle's router runs on the caller's loop: it cannot be used from a thread without one)."""
    try:
        return (await asyncio.wait_for(h.info.remote(), timeout_s))["pid"]
    except Exception:  # the replica died under the call, or none is there yet
        return None


async def _load(rel, stop: asyncio.Event, users: int = 12) -> list[Outcome]:
    """`users` clients sending `hangs` requests back to back (every third streamed) until `stop`."""
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(base_url=f"{rel.base}/{FAULT_APP}", headers=rel.auth,
                                 timeout=CLIENT_TIMEOUT_S) as client:
        async def user(i: int) -> None:
            k = 0
            while not stop.is_set():
                outcomes.append(await (stream(client, HANG) if (i + k) % 3 == 0 else post(client, HANG)))
                k += 1
        await asyncio.gather(*(user(i) for i in range(users)))
    return outcomes


async def _watched_stream(rel, under_way: asyncio.Event) -> Outcome:
    """One stream that sets `under_way` at its first token event and reads on to its end."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=f"{rel.base}/{FAULT_APP}", headers=rel.auth,
                                 timeout=CLIENT_TIMEOUT_S) as client:
        async with client.stream("POST", "/v1/generate", json={**HANG, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    under_way.set()
    return Outcome(200, time.monotonic() - t0, error=events[-1].get("error"), finished_at=time.monotonic())


def test_a_hung_step_gets_its_replica_replaced(rel):
    from ray import serve
    from serving.server.launch import start

    start(_with_fault_app(rel), timeout_s=300)
    try:
        h = serve.get_deployment_handle(HANG_MODEL, app_name=FAULT_APP)

        async def run() -> tuple[list[Outcome], float, float | None, int | None, int | None]:
            first = await _pid(h)
            stop, under_way = asyncio.Event(), asyncio.Event()
            load = asyncio.create_task(_load(rel, stop))
            await asyncio.sleep(2)
            watched = asyncio.create_task(_watched_stream(rel, under_way))
            await asyncio.wait_for(under_way.wait(), 30)  # a stream has tokens out when the step hangs
            assert await asyncio.wait_for(h.inject_hang.remote(), 30) == first
            hung = time.monotonic()
            replaced = None
            while time.monotonic() - hung < 60:
                pid = await _pid(h, 5)
                if pid is not None and pid != first:
                    replaced = time.monotonic() - hung
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(3)  # the load goes on against the new replica
            stop.set()
            result = await load + [await watched], hung, replaced, first, await _pid(h)
            from ray.serve.context import _get_global_client
            await _get_global_client().shutdown_cached_handles_async()  # their routers live on this loop
            return result
        outcomes, hung, replaced, first, now_serving = asyncio.run(run())
        with httpx.Client(base_url=f"{rel.base}/{FAULT_APP}", headers=rel.auth, timeout=CLIENT_TIMEOUT_S) as c:
            after = [c.post("/v1/generate", json={**HANG, "max_tokens": 8}).status_code for _ in range(20)]
        _check_hang(outcomes, hung, replaced, after, first, now_serving)
    finally:
        start(rel.raw, timeout_s=300)  # the reliability application alone again


def _check_hang(outcomes: list[Outcome], hung: float, replaced: float | None, after: list[int], first: int,
                now_serving: int | None) -> None:
    ended_by_hang = [o for o in outcomes if o.error and "step_timeout_s" in o.error.get("message", "")]
    latencies = [o.latency for o in outcomes]
    report("watchdog_hang", step_timeout_s=STEP_TIMEOUT_S, requests=len(outcomes), statuses=counts(outcomes),
           ended_by_watchdog=len(ended_by_hang), stream_error_events=sum(o.status == 200 and o.error is not None
                                                                         for o in outcomes),
           error_types=counts([Outcome(o.error["type"], 0) for o in outcomes if o.error]),
           max_latency_s=round(max(latencies), 2), p50_s=round(percentile(latencies, 0.5), 3),
           replaced_s=replaced and round(replaced, 1), after=counts([Outcome(s, 0) for s in after]))
    assert ended_by_hang, "no request was ended by the watchdog: the hang did not happen"
    watched = outcomes[-1]  # a stream with tokens out when the step hung: it ends with a retryable error event
    assert watched.error and watched.error["type"] == "unavailable" and "retry" in watched.error["message"], watched
    assert all(o.status is not None for o in outcomes), [o.failure for o in outcomes if o.status is None][:3]
    assert set(counts(outcomes)) <= {"200", "503", "504"}, counts(outcomes)
    for o in outcomes:
        if o.status == 503:
            assert o.retry_after == "1" and o.error["type"] == "unavailable", o
    assert max(latencies) <= DEADLINE_S + 2.0 + 0.3, f"a request outlived its deadline: {max(latencies):.2f}s"
    assert replaced is not None and replaced < 30, f"the hung replica was not replaced within 30 s ({replaced})"
    assert after == [200] * 20 and now_serving not in (None, first)
