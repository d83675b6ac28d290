"""Readiness, per model and for the whole server (serving/server/api.py, serving/server/readiness.py).

- The API: KServe v2 `GET /v2/models/{name}/ready` is 200 `{"name", "ready": true}` while the model can
  serve, 503 + Retry-After with the error body otherwise, 404 for a model that is not served;
  `/v2/health/ready` (the pods' readiness probe) is 200 while some model can serve, "degraded" naming those that
  cannot, and 503 only when none can. On the real engines of the tiny bundles (tests/inprocess_app.py); a model
  stops being ready when its engine dies, here of failing steps (tests/step_faults.py).
- `ModelReadiness` counts each model's RUNNING replicas in Serve's status: one dead or restarting replica
  beside a running one leaves the model ready; the status call is blocking, so it runs off the event loop,
  and concurrent probes share one call for a second. When Serve's status cannot be read, the replicas are
  asked, several times (a retry reaches another replica).
The slow test that kills a replica under 20 Hz readiness polling is in tests/test_reliability_faults.py.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from inprocess_app import InProcessServer
from serving.engine.engine import MAX_CONSECUTIVE_FAILURES
from serving.server.drain import Drain
from serving.server.readiness import ModelReadiness, probe_replicas
from test_api import LIMITS, assert_error


@pytest.fixture
def server() -> Iterator[InProcessServer]:
    """Real engines of the tiny bundles whose steps can be made to fail (each test may kill them)."""
    s = InProcessServer(LIMITS, faults=True)
    yield s
    s.close()


def kill(server: InProcessServer, model: str) -> None:
    """Make `model`'s engine dead the way a broken runtime does: its steps fail MAX_CONSECUTIVE_FAILURES times in
    a row (each request in them gets a retryable 503), after which it refuses everything."""
    server.faults[model].fail_next(MAX_CONSECUTIVE_FAILURES)
    path, body = ("/v1/translate", {"text": "x"}) if model == "translate" else ("/v1/generate", {"prompt": "x"})
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        assert_error(server.request("POST", path, json={**body, "max_tokens": 2}), 503)
    assert server.engines[model].snapshot()["dead"]


# -- the API ----------------------------------------------------------------------------------------------------
def test_model_readiness_follows_each_model(server):
    drain = Drain()
    client = server.app_client(drain=drain)

    def get(path: str):
        return server.call(client.get(path))
    r = get("/v2/models/generate/ready")
    assert r.status_code == 200 and r.json() == {"name": "generate", "ready": True}
    assert get("/v2/health/ready").json() == {"status": "ready"}
    err = assert_error(get("/v2/models/gpt-9/ready"), 404, "name")
    assert "gpt-9" in err["message"] and "/v1/models" in err["message"]
    assert "translate" not in err["message"] and "generate" not in err["message"]  # open route: no model names
    drain.set_draining(True)
    r = get("/v2/models/translate/ready")
    assert assert_error(r, 503)["type"] == "unavailable" and r.headers["retry-after"] == "1"
    drain.set_draining(False)
    assert get("/v2/models/translate/ready").status_code == 200
    kill(server, "generate")
    r = get("/v2/models/generate/ready")
    err = assert_error(r, 503)
    assert err["type"] == "unavailable" and "'generate'" in err["message"] and r.headers["retry-after"] == "1"
    assert get("/v2/models/translate/ready").status_code == 200  # the other model is fine
    r = get("/v2/health/ready")  # the pod keeps serving translate
    assert r.status_code == 200 and r.json() == {"status": "degraded", "not_ready": ["generate"]}
    assert server.request("POST", "/v1/translate", json={"text": "x", "max_tokens": 2}).status_code == 200
    kill(server, "translate")
    r = get("/v2/health/ready")
    assert r.status_code == 503 and r.json() == {"status": "not_ready", "not_ready": ["generate", "translate"]}


# -- ModelReadiness over Serve's replica states --------------------------------------------------------------------
class States:
    """A stand-in for serving.server.readiness.serve_replica_states: blocking, counted, scripted."""

    def __init__(self, states: dict | Exception, delay_s: float = 0.4) -> None:
        self.states, self.delay_s, self.calls = states, delay_s, 0

    def __call__(self) -> dict:
        self.calls += 1
        time.sleep(self.delay_s)  # a blocking controller call
        if isinstance(self.states, Exception):
            raise self.states
        return self.states


async def _max_loop_gap(coro) -> tuple[object, float]:
    """(coro's result, the longest the event loop went without running a 5 ms ticker meanwhile)."""
    gaps, done = [0.0], False

    async def tick() -> None:
        last = time.monotonic()
        while not done:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    ticker = asyncio.create_task(tick())
    try:
        result = await coro
    finally:
        done = True
        await ticker
    return result, max(gaps)


async def test_a_model_is_ready_while_one_replica_runs_and_probes_share_one_status_call():
    states = States({"generate": {"RUNNING": 1, "STOPPING": 1}, "translate": {"STARTING": 1},
                     "long": {"RUNNING": 2}, "ingress": {"RUNNING": 1}})
    probes = []

    async def probe(model: str) -> bool:
        probes.append(model)
        return True
    readiness = ModelReadiness(["generate", "translate", "long"], states, probe, ttl_s=0.5)
    results, gap = await _max_loop_gap(asyncio.gather(*(readiness.models_ready() for _ in range(50))))
    assert all(r == {"generate": True, "translate": False, "long": True} for r in results)
    assert states.calls == 1 and probes == [] and gap < 0.2, (states.calls, gap)
    await readiness.models_ready()
    assert states.calls == 1  # cached
    await asyncio.sleep(0.55)
    states.states = {"generate": {"RUNNING": 2}, "translate": {"RUNNING": 1}}
    assert await readiness.models_ready() == {"generate": True, "translate": True, "long": False}
    assert states.calls == 2


async def test_without_serve_status_the_replicas_are_asked():
    states = States(ConnectionError("controller restarting"), delay_s=0.0)
    readiness = ModelReadiness(["generate", "translate"], states, lambda m: _const(m == "generate"), ttl_s=0)
    assert await readiness.models_ready() == {"generate": True, "translate": False}


async def _const(value: bool) -> bool:
    return value


class Handle:
    """A deployment handle whose `ready` calls answer from a script (an exception: a dead replica)."""

    def __init__(self, answers: list) -> None:
        self.answers, self.ready = list(answers), self

    def remote(self):
        answer = self.answers.pop(0)

        async def call() -> bool:
            if isinstance(answer, Exception):
                raise answer
            if answer == "hang":
                await asyncio.sleep(10)
            return answer
        return call()


async def test_a_probe_retries_past_a_dead_or_silent_replica():
    assert await probe_replicas(Handle([RuntimeError("actor died"), True]))
    assert await probe_replicas(Handle(["hang", False, True]), timeout_s=0.05)
    assert not await probe_replicas(Handle([RuntimeError("died"), False, "hang", True]), timeout_s=0.05)


def test_kserve_v2_model_metadata_names_the_versions_and_the_text_tensors(server):
    r = server.request("GET", "/v2/models/translate")
    assert r.status_code == 200, r.text
    meta = r.json()
    assert meta["name"] == "translate" and meta["platform"] == "onnxruntime" and meta["task"] == "translate"
    assert meta["versions"] == [server.versions["translate"]]  # the bundle's content version
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    generate = server.request("GET", "/v2/models/generate").json()
    assert generate["task"] == "generate" and generate["outputs"][0]["name"] == "text"
    assert_error(server.request("GET", "/v2/models/gpt-9"), 404, "name")
