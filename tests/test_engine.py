"""serving/engine/engine.py on tiny exported models (real ONNX Runtime sessions through serving/engine/runtime.py).

The acceptance: requests batched continuously produce exactly the tokens they produce alone (greedy and
seeded sampling); cancellation frees slots within one step; admission beyond the bound is rejected at once
while accepted requests finish; deadlines finish with DEADLINE; the batching modes behave as specified.
"""
import asyncio
import time

import pytest

from bench.gpu_check.engine import mixed_requests as gpu_check_requests
from engine_bundle import cached_bundle
from engine_util import collect, outcome, run_all, run_alone, slow_steps, tokens
from model.decode import greedy_translate_ids
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.engine.types import (AdmissionRejected, BatchingMode, EngineDead, FinishReason, GenerationRequest,
                           InvalidRequest, SamplingParams)

V = 300


def engine(task="generate", **kw) -> Engine:
    bundle, _ = cached_bundle(task)
    return Engine.from_bundle(bundle, EngineConfig(**{"max_slots": 32, "max_tokens_per_step": 256, **kw}))


def mixed_requests(n: int, seed: int, sampled: bool, lm: bool = True, max_len: int = 64) -> list[GenerationRequest]:
    """The GPU check's mixed workload (bench/gpu_check/engine.py) on the tiny bundles: up to 24 new tokens."""
    return gpu_check_requests(n, V, max_len, lm, sampled, max_new=24, seed=seed)


async def started(eng: Engine) -> Engine:
    await eng.start()
    return eng


@pytest.mark.parametrize("task,sampled", [("generate", False), ("generate", True),
                                          ("translate", False), ("translate", True)])
async def test_32_concurrent_requests_produce_the_tokens_each_produces_alone(task, sampled):
    eng = await started(engine(task))
    reqs = mixed_requests(32, seed=1, sampled=sampled, lm=task == "generate")
    batched = await run_all(eng, reqs)
    alone = await run_alone(eng, reqs)
    await eng.stop()
    assert [outcome(e) for e in batched] == [outcome(e) for e in alone]
    assert sum(len(tokens(e)) for e in batched) > 150  # the test really generated something


async def test_chunked_prefill_under_a_small_budget_gives_the_same_tokens():
    eng = await started(engine(max_tokens_per_step=16))
    reqs = mixed_requests(12, seed=2, sampled=False)
    steps = []
    eng.add_observer(lambda s: steps.append(s), None)
    batched = await run_all(eng, reqs)
    eng.reconfigure(eng.config.model_copy(update={"max_tokens_per_step": 4096}))
    alone = await run_alone(eng, reqs)
    await eng.stop()
    assert [outcome(e) for e in batched] == [outcome(e) for e in alone]
    assert any(0 < s.prefill_tokens < 30 and s.decode_tokens > 0 for s in steps)  # prefill shared steps


async def test_greedy_translation_equals_the_pytorch_reference():
    bundle, model = cached_bundle("translate")
    eng = await started(engine("translate"))
    reqs = mixed_requests(8, seed=3, sampled=False, lm=False)
    got = [tokens(e) for e in await run_all(eng, reqs)]
    await eng.stop()
    for r, toks in zip(reqs, got):
        want = greedy_translate_ids(model, [r.prompt_ids], 1, 2, r.params.max_new_tokens)[0]
        assert toks == want


async def test_cancelling_16_of_32_running_requests_frees_their_slots_within_one_step():
    eng = await started(engine())
    reqs = [GenerationRequest(f"c{i}", [1, 5 + i, 7], SamplingParams(max_new_tokens=40, ignore_eos=True))
            for i in range(32)]
    steps, cancelled_at = [], []

    def on_step(s):
        steps.append(s)
        if not cancelled_at and s.slots_used == 32 and s.prefill_tokens == 0:
            cancelled_at.append(len(steps))
            for r in reqs[::2]:
                eng.cancel(r.request_id)
    eng.add_observer(on_step, None)
    events = await run_all(eng, reqs)
    survivors = await run_alone(eng, reqs[1::2])
    await eng.stop()
    nxt = steps[cancelled_at[0]]
    assert nxt.slots_used == 16 and nxt.batch_size == 16
    assert all(outcome(e)[1] == FinishReason.CANCELLED for e in events[::2])
    assert [outcome(e) for e in events[1::2]] == [outcome(e) for e in survivors]
    assert all(len(tokens(e)) == 40 for e in events[1::2])


async def test_admission_beyond_the_bound_is_rejected_at_once_and_accepted_requests_finish():
    eng = await started(engine(max_slots=4, max_waiting=2))
    reqs = [GenerationRequest(f"a{i}", [1, 9, i + 4], SamplingParams(max_new_tokens=10)) for i in range(6)]
    handles = [eng.submit(r) for r in reqs]  # 4 free slots + 2 waiting places
    with pytest.raises(AdmissionRejected) as e:
        eng.submit(GenerationRequest("over", [1, 4], SamplingParams(max_new_tokens=10)))
    assert e.value.reason == "queue_full" and e.value.retry_after_s > 0
    done = await asyncio.gather(*(collect(h) for h in handles))
    alone = await run_alone(eng, reqs)
    await eng.stop()
    assert [outcome(d) for d in done] == [outcome(a) for a in alone]


async def test_deadlines_finish_with_deadline_after_the_tokens_so_far():
    eng = await started(slow_steps(engine(), 0.02))
    now = time.monotonic()
    late = GenerationRequest("late", [1, 5], SamplingParams(max_new_tokens=60, ignore_eos=True), deadline=now + 0.3)
    past = GenerationRequest("past", [1, 5], SamplingParams(max_new_tokens=5), deadline=now - 1)
    ok = GenerationRequest("ok", [1, 6], SamplingParams(max_new_tokens=5))
    ev_late, ev_past, ev_ok = await run_all(eng, [late, past, ok])
    await eng.stop()
    toks, reason = outcome(ev_late)
    assert reason == FinishReason.DEADLINE and 0 < len(toks) < 60
    assert outcome(ev_past) == ([], FinishReason.DEADLINE)
    assert outcome(ev_ok)[1] in (FinishReason.LENGTH, FinishReason.STOP)


async def test_tokens_stream_while_the_request_runs_and_a_dropped_stream_cancels():
    eng = await started(slow_steps(engine(), 0.005))  # else 50 tiny steps could end before the consumer first runs
    stats = []
    eng.add_observer(None, stats.append)
    h = eng.submit(GenerationRequest("s", [1, 8], SamplingParams(max_new_tokens=50, ignore_eos=True)))
    it = h.__aiter__()
    first = await it.__anext__()
    assert first.token_id is not None and eng.snapshot()["running"] == 1
    await it.aclose()  # the consumer goes away (client disconnect)
    for _ in range(100):
        if stats:
            break
        await asyncio.sleep(0.01)
    await eng.stop()
    assert stats[0].finish_reason == FinishReason.CANCELLED and stats[0].generated_tokens < 50


async def test_request_stats_are_consistent():
    eng = await started(engine())
    stats = []
    eng.add_observer(None, stats.append)
    await run_all(eng, mixed_requests(6, seed=4, sampled=False))
    await eng.stop()
    assert len(stats) == 6
    for s in stats:
        assert s.generated_tokens >= 1 and len(s.inter_token) == s.generated_tokens - 1
        assert 0 <= s.queue_wait <= s.time_to_first_token <= s.e2e


async def test_request_level_batch_runs_to_its_end_before_anything_joins():
    eng = await started(engine(batching=BatchingMode.REQUEST, max_batch_size=4, batch_wait_timeout_s=0.2))
    steps = []
    eng.add_observer(steps.append, None)
    batch = [GenerationRequest(f"b{i}", [1, 4 + i], SamplingParams(max_new_tokens=5 * (i + 1), ignore_eos=True))
             for i in range(4)]
    handles = [eng.submit(r) for r in batch]  # max_batch_size requests: the batch starts at the next step
    late = eng.submit(GenerationRequest("late", [1, 4], SamplingParams(max_new_tokens=3)))
    events = await asyncio.gather(*(collect(h) for h in handles))
    late_events = await asyncio.wait_for(collect(late), 10)  # alone: starts after the 0.2 s gather timeout
    await eng.stop()
    assert [len(tokens(e)) for e in events] == [5, 10, 15, 20]
    assert [s.batch_size for s in steps[:20]] == [4] * 20  # finished rows stay in the static batch
    assert steps[20].batch_size == 1 and steps[20].prefill_tokens == 2  # the late one runs after it
    assert outcome(late_events)[1] is not None


async def test_request_level_batch_refuses_a_bad_request_alone_and_starts_at_the_timeout():
    eng = await started(engine(batching=BatchingMode.REQUEST, max_batch_size=8, batch_wait_timeout_s=0.1,
                               max_waiting=2))
    steps = []
    eng.add_observer(steps.append, None)
    good = [GenerationRequest(f"g{i}", [1, 5 + i], SamplingParams(max_new_tokens=4, ignore_eos=True))
            for i in range(2)]
    bad = GenerationRequest("bad", [1, 5], SamplingParams(max_new_tokens=4, beam_size=2, n_best=1))
    handles = [eng.submit(good[0])]
    with pytest.raises(InvalidRequest) as e:  # beam search on a decoder-only model: refused before it waits
        eng.submit(bad)
    assert e.value.field == "beam_size"
    handles.append(eng.submit(good[1]))
    started_at = time.monotonic()
    events = await asyncio.gather(*(collect(h) for h in handles))
    await eng.stop()
    assert [len(tokens(ev)) for ev in events] == [4, 4]
    assert steps[0].batch_size == 2  # two of eight: the batch started when the oldest had waited 0.1 s
    assert time.monotonic() - started_at >= 0.05


async def test_request_level_queue_is_bounded():
    eng = await started(engine(batching=BatchingMode.REQUEST, max_slots=2, max_batch_size=2,
                               batch_wait_timeout_s=5.0, max_waiting=1))
    p = SamplingParams(max_new_tokens=2)
    held = [eng.submit(GenerationRequest(f"w{i}", [1, 5], p)) for i in range(3)]  # 2 free slots + 1 waiting
    with pytest.raises(AdmissionRejected) as e:
        eng.submit(GenerationRequest("over", [1, 5], p))
    assert e.value.reason == "queue_full" and e.value.retry_after_s > 0
    for h in held:
        h.cancel()
    await eng.stop()


async def test_no_batching_runs_one_request_per_step():
    eng = await started(engine(batching=BatchingMode.NONE))
    steps = []
    eng.add_observer(steps.append, None)
    reqs = mixed_requests(5, seed=5, sampled=False)
    got = await run_all(eng, reqs)
    eng.reconfigure(eng.config.model_copy(update={"batching": BatchingMode.CONTINUOUS}))
    alone = await run_alone(eng, reqs)
    await eng.stop()
    assert {s.batch_size for s in steps} == {1}
    assert [outcome(e) for e in got] == [outcome(e) for e in alone]


async def test_reconfigure_changes_batching_live_but_not_buffer_sizes():
    eng = engine()
    eng.reconfigure(eng.config.model_copy(update={"batching": BatchingMode.REQUEST, "max_batch_size": 2}))
    assert eng.snapshot()["mode"] == "request"
    with pytest.raises(ValueError, match="max_slots"):
        eng.reconfigure(eng.config.model_copy(update={"max_slots": 8}))


@pytest.mark.parametrize("task,prompt,params,match", [
    ("generate", [1, 5], SamplingParams(beam_size=2), "beam search is for translation"),
    ("generate", [1] * 60, SamplingParams(max_new_tokens=10), "exceeds the model's KV cache of 64"),
    ("generate", [1, V], SamplingParams(), r"token ids in \[0, 300\)"),
    ("generate", [], SamplingParams(), "non-empty"),
    ("generate", [1, 5], SamplingParams(max_new_tokens=0), "max_new_tokens=0"),
    ("generate", [1, 5], SamplingParams(top_p=0.0), "top_p=0.0"),
    ("generate", [1, 5], SamplingParams(temperature=-1.0), "temperature=-1.0"),
    ("translate", [5] * 65, SamplingParams(), "at most 64"),
    ("translate", [5, 6], SamplingParams(beam_size=4, n_best=5), "n_best=5"),
    ("translate", [5, 6], SamplingParams(beam_size=9), "beam_size=9"),
    ("translate", [5, 6], SamplingParams(beam_size=2, temperature=0.5), "deterministic"),
])
def test_invalid_requests_are_refused_at_submit_naming_the_field(task, prompt, params, match):
    eng = engine(task)
    with pytest.raises(InvalidRequest, match=match):
        eng.submit(GenerationRequest("x", prompt, params))
    assert eng.snapshot()["waiting"] == 0


def test_duplicate_request_ids_are_refused():
    eng = engine()
    eng.submit(GenerationRequest("dup", [1, 5], SamplingParams(max_new_tokens=5)))
    with pytest.raises(InvalidRequest, match="already in flight"):
        eng.submit(GenerationRequest("dup", [1, 6], SamplingParams(max_new_tokens=5)))


async def test_stop_drains_in_flight_requests_then_refuses_new_ones():
    eng = await started(engine())
    handles = [eng.submit(r) for r in mixed_requests(4, seed=6, sampled=False)]
    await eng.stop(drain_timeout_s=10)
    for h in handles:
        assert outcome(await collect(h))[1] in (FinishReason.LENGTH, FinishReason.STOP)
    with pytest.raises(AdmissionRejected, match="shutting_down"):
        eng.submit(GenerationRequest("after", [1, 5], SamplingParams(max_new_tokens=5)))


async def test_a_failing_runtime_fails_its_requests_then_the_engine_dies():
    eng = await started(engine())

    def broken(*a, **kw):
        raise RuntimeError("device lost")
    eng.runtime.step = broken
    reqs = [GenerationRequest(f"e{i}", [1, 5], SamplingParams(max_new_tokens=5)) for i in range(3)]
    events = await run_all(eng, reqs)
    assert all(e[-1].finish_reason == FinishReason.ERROR and "device lost" in e[-1].error for e in events)
    for i in range(2):
        await run_all(eng, [GenerationRequest(f"f{i}", [1, 5], SamplingParams(max_new_tokens=5))])
    with pytest.raises(EngineDead):
        eng.submit(GenerationRequest("g", [1, 5], SamplingParams(max_new_tokens=5)))
    await eng.stop()


def test_engine_needs_no_torch_at_import():
    import subprocess
    import sys
    code = "import sys, serving.engine.engine, serving.engine.runtime; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


async def test_steps_run_while_the_event_loop_is_busy_and_the_tokens_arrive_in_order_after():
    """The step loop is its own thread: a busy event loop (HTTP work, here a blocking sleep) does not hold the
    next step back; the tokens computed meanwhile reach the stream, in order, once the loop is free."""
    eng = await started(engine())
    steps = []
    eng.add_observer(steps.append, None)
    req = GenerationRequest("busy", [1, 5, 7], SamplingParams(max_new_tokens=40, ignore_eos=True))
    handle = eng.submit(req)
    time.sleep(0.5)  # the event loop is blocked: nothing on it runs
    during = len(steps)
    events = await collect(handle)
    alone = await run_alone(eng, [req])
    await eng.stop()
    assert during >= 20, during  # the engine kept stepping (a tiny model's step is well under a millisecond)
    assert outcome(events) == outcome(alone[0]) and len(tokens(events)) == 40
