"""Faults inside a real engine step (tests/step_faults.py wraps a real ModelRuntime of a tiny bundle).

- One transient step error fails only that step's rows: the requests still waiting run afterwards with the
  tokens they produce alone, the next 20 requests succeed, and every slot is free again.
- A step that hangs (an ONNX Runtime call that never returns, which nothing can interrupt) trips the
  watchdog, a task on the event loop, after `step_timeout_s`: every running and waiting request ends at
  once with a retryable error, new requests are refused with EngineDead, the snapshot says why, the
  replica's health check fails (so Ray replaces the replica), and `stop()` does not wait for the stuck thread.
  Over HTTP that is a 503 with Retry-After, or an `unavailable` error event for a stream already answering.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from engine_bundle import cached_bundle
from engine_util import collect, outcome, run_all, run_alone, slow_steps, tokens
from step_faults import StepFaults
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.engine.types import EngineDead, FinishReason, GenerationRequest, SamplingParams


def faulty_engine(**kw) -> tuple[Engine, StepFaults]:
    bundle, _ = cached_bundle("generate")
    eng = Engine.from_bundle(bundle, EngineConfig(**{"max_slots": 4, "provider": "cpu", "intra_op_threads": 1,
                                                     **kw}))
    return eng, StepFaults.install(eng.runtime)


def req(i: int, n: int = 12, prefix: str = "r") -> GenerationRequest:
    return GenerationRequest(f"{prefix}{i}", [1, 5 + i, 9], SamplingParams(max_new_tokens=n, ignore_eos=True))


def idle(eng: Engine) -> dict:
    snap = eng.snapshot()
    return {k: snap[k] for k in ("running", "waiting", "slots_used", "dead")}


async def test_one_failing_step_fails_only_its_rows_and_the_engine_goes_on():
    eng, faults = faulty_engine()
    await eng.start()
    reqs = [req(i) for i in range(8)]  # 4 slots: 4 run, 4 wait
    steps = []

    def on_step(s) -> None:
        steps.append(s)
        if len(steps) == 2:  # the 4 are decoding; the third step fails
            assert s.running == 4 and s.waiting == 4
            faults.fail_next()
    eng.add_observer(on_step, None)
    events = await run_all(eng, reqs)
    failed_at = faults.calls
    alone = await run_alone(eng, reqs[4:])
    later = await run_all(eng, [req(i, prefix="n") for i in range(20)])
    await eng.stop()
    for e in events[:4]:  # the failing step's rows: their tokens so far, then a retryable error
        assert e[-1].finish_reason == FinishReason.ERROR and "injected" in e[-1].error and "retry" in e[-1].error
        assert len(tokens(e)) == 2
    assert [outcome(e) for e in events[4:]] == [outcome(e) for e in alone]  # the waiting ones: untouched
    assert all(outcome(e) == (tokens(e), FinishReason.LENGTH) and len(tokens(e)) == 12 for e in later)
    assert failed_at > 3 and idle(eng) == {"running": 0, "waiting": 0, "slots_used": 0, "dead": False}


async def test_a_hung_step_fails_every_request_at_the_timeout_and_the_engine_reports_why():
    eng, faults = faulty_engine(max_slots=2, step_timeout_s=0.5)
    await eng.start()
    try:
        assert outcome((await run_all(eng, [req(0)]))[0])[1] == FinishReason.LENGTH  # healthy first
        faults.hang_next()
        t0 = time.monotonic()
        handles = [eng.submit(req(i, n=40, prefix="h")) for i in range(5)]  # 2 running, 3 waiting
        events = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 5)
        took = time.monotonic() - t0
        assert faults.hanging.is_set()  # the step really is stuck in its thread, and still is
        for e in events:
            assert e[-1].finish_reason == FinishReason.ERROR, e[-1]
            assert "step_timeout_s=0.5s" in e[-1].error and "retry the request" in e[-1].error
        assert 0.5 <= took < 1.5, took
        snap = eng.snapshot()
        assert snap["dead"] and "step_timeout_s=0.5s" in snap["dead_reason"]
        assert idle(eng) == {"running": 0, "waiting": 0, "slots_used": 0, "dead": True}
        with pytest.raises(EngineDead, match="retry the request"):
            eng.submit(req(9))
        t1 = time.monotonic()
        await asyncio.wait_for(eng.stop(), 3)  # does not wait for the stuck thread
        assert time.monotonic() - t1 < 1.0
    finally:
        faults.release()


async def test_stop_during_a_hung_step_returns_once_the_watchdog_gives_up_on_it():
    eng, faults = faulty_engine(max_slots=2, step_timeout_s=0.5)
    await eng.start()
    try:
        faults.hang_next()
        handles = [eng.submit(req(i, n=40, prefix="s")) for i in range(3)]
        while not faults.hanging.is_set():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await asyncio.wait_for(eng.stop(drain_timeout_s=0.1), 5)  # the drain gives up before the watchdog fires
        assert time.monotonic() - t0 < 2.0
        events = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 2)
        assert all(e[-1].finish_reason == FinishReason.ERROR and "step_timeout_s" in e[-1].error for e in events)
    finally:
        faults.release()


async def test_a_hung_engine_fails_the_replica_health_check():
    from serving.server.config import ModelSpec
    from serving.server.local_model import LocalModel
    from serving.server.replica import ModelDeployment

    eng, faults = faulty_engine(step_timeout_s=0.3)
    await eng.start()
    replica = ModelDeployment.func_or_class.__new__(ModelDeployment.func_or_class)  # the class Serve runs
    replica.model = LocalModel.__new__(LocalModel)  # its model, around this engine
    replica.model.engine, replica.model.spec = eng, ModelSpec(name="generate", bundle="unused")
    try:
        await replica.check_health()  # healthy: no error
        faults.hang_next()
        await run_all(eng, [req(0)])
        with pytest.raises(RuntimeError, match="generate: the engine is dead .*step_timeout_s=0.3s"):
            await replica.check_health()
        assert not await replica.ready()
    finally:
        faults.release()
        await eng.stop()


async def test_a_hung_step_reaches_http_clients_as_retryable_503s_and_error_events():
    from model.tokenizer import Tokenizer
    from export.bundle import load_bundle
    from serving.server.api import create_app
    from serving.server.config import Limits
    from serving.server.metrics import Recorder
    from serving.server.service import ModelService
    from local_backend import LocalBackend

    eng, faults = faulty_engine(step_timeout_s=0.3)
    slow_steps(eng, 0.005)  # a tiny model's whole request takes ~15 ms: both requests must overlap
    await eng.start()
    steps = []

    def on_step(s) -> None:  # both requests are decoding (each has a token): the next step hangs
        if not steps and s.running == 2 and s.prefill_tokens == 0:
            steps.append(s)
            faults.hang_next()
    eng.add_observer(on_step, None)
    tok = Tokenizer.load(load_bundle(cached_bundle("generate")[0]).tokenizer_path)
    recorder, limits = Recorder("prometheus"), Limits(max_prompt_tokens=16, max_tokens=40)
    app = create_app(LocalBackend({"generate": ModelService("generate", eng, tok, 16, recorder)}, recorder),
                     limits, recorder)
    body = {"prompt": "the quick", "max_tokens": 40, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=10) as c:
            streamed, plain = await asyncio.gather(c.post("/v1/generate", json={**body, "stream": True}),
                                                   c.post("/v1/generate", json=body))
            after = await c.post("/v1/generate", json=body)
            model_ready = await c.get("/v2/models/generate/ready")
            ready = await c.get("/v2/health/ready")
        events = [json.loads(x[6:]) for x in streamed.text.split("\n\n") if x.startswith("data: ")]
        assert streamed.status_code == 200 and len(events) > 1 and "token" in events[0]
        assert events[-1]["error"]["type"] == "unavailable" and "retry" in events[-1]["error"]["message"]
        for r in (plain, after, model_ready):  # in flight at the hang; submitted after it; the probe
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["type"] == "unavailable"
        assert "step_timeout_s" in plain.json()["error"]["message"] and "retry" in after.json()["error"]["message"]
        # its only model cannot serve: the server as a whole is not ready
        assert ready.status_code == 503 and ready.json() == {"status": "not_ready", "not_ready": ["generate"]}
    finally:
        faults.release()
        await eng.stop()


def test_the_watchdog_knob_is_a_replica_knob_with_a_sane_default():
    from serving.engine.config import ReplicaKnobs

    assert ReplicaKnobs().step_timeout_s == 30.0
    with pytest.raises(ValueError, match="step_timeout_s"):
        ReplicaKnobs(step_timeout_s=0)
