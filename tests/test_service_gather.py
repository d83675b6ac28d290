"""`ModelService.complete` takes a request's events at once when it finishes (serving/engine/handle.py `gathered`).

On real engines of the tiny bundles: the answers are those of the token-by-token stream (text, tokens, finish,
beam n-best, forced prefixes, log-probabilities), the consumer resumes once per request (every event is there when it gets the first),
the first token's timings are when it arrived (not when the answer was complete), and a consumer that goes away
frees the engine's slot.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from inprocess_app import InProcessServer
from serving.engine.types import FinishReason, GenerationRequest, SamplingParams
from serving.server.config import Limits
from serving.server.service import TextRequest, TextResult


@pytest.fixture(scope="module")
def server():
    s = InProcessServer(Limits(max_prompt_tokens=40, max_tokens=48), faults=True)
    yield s
    s.close()


REQUESTS = [
    ("translate", TextRequest("the quick brown fox", SamplingParams(max_new_tokens=12), 1e12)),
    ("translate", TextRequest("a dog", SamplingParams(max_new_tokens=10, beam_size=3, n_best=2), 1e12)),
    ("translate", TextRequest("the house", SamplingParams(max_new_tokens=8), 1e12, prefix="das")),
    ("generate", TextRequest("the dog", SamplingParams(max_new_tokens=16, temperature=0.9, seed=5, logprobs=2), 1e12)),
    ("generate", TextRequest("a cat", SamplingParams(max_new_tokens=6, logprobs=1), 1e12, echo=True)),
]


def _fields(r: TextResult) -> tuple:
    return r.text, r.finish_reason, r.completion_tokens, r.prompt_tokens, r.n_best, r.logprobs, r.forced


@pytest.mark.parametrize("model,req", REQUESTS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(REQUESTS)])
def test_a_gathered_answer_is_the_streamed_one(server, model, req):
    service = server.services[model]

    async def streamed() -> TextResult:
        return [x async for x in service.stream(req) if isinstance(x, TextResult)][-1]

    assert _fields(server.call(service.complete(req))) == _fields(server.call(streamed()))


def test_the_first_token_keeps_its_time(server):
    """A 40-token answer taken at once: its ttft is when the first token arrived, well before the end.

    Each step is held 5 ms longer, so the 39 steps after the first one outlast any scheduling jitter before it
    (the tiny model's own steps are tens of microseconds: a fast machine finishes the answer within the noise)."""
    req = TextRequest("the", SamplingParams(max_new_tokens=40, ignore_eos=True), 1e12, arrival_wall=time.time())
    with server.slow_steps(0.005):
        result = server.call(server.services["generate"].complete(req))
    assert result.completion_tokens == 40
    assert result.ttft_s is not None and result.ttft_s < 0.5 * result.total_s
    assert result.server_ttft_s is not None and result.server_ttft_s < 0.5 * result.total_s


def test_gathered_events_come_only_after_the_final_one(server):
    """The consumer resumes once: when it gets the first event, every event of the request is there."""
    engine, tok = server.engines["generate"], server.tokenizers["generate"]

    async def run() -> tuple[list, bool]:
        handle = engine.submit(GenerationRequest("gather-order", [tok.bos_id] + tok.encode("the"),
                                                 SamplingParams(max_new_tokens=20, ignore_eos=True)))
        got, finished_first = [], None
        async for ev in handle.gathered():
            if finished_first is None:  # at the first event handed to the consumer, the request has ended
                finished_first = handle._all is not None and handle._all.done()
            got.append(ev)
        return got, bool(finished_first)

    got, finished_first = server.call(run())
    assert finished_first and len(got) == 21 and got[-1].finish_reason is not None
    assert all(ev.token_id is not None for ev in got[:-1])


def test_a_gathered_request_whose_consumer_goes_away_frees_its_slot(server):
    service, engine = server.services["generate"], server.engines["generate"]
    req = TextRequest("the", SamplingParams(max_new_tokens=48, ignore_eos=True), 1e12)

    async def run() -> int:
        task = asyncio.ensure_future(service.complete(req))
        for _ in range(2000):
            if engine.snapshot().get("running", 0):
                break
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(2000):
            if engine.snapshot().get("running", 0) == 0:
                break
            await asyncio.sleep(0.005)
        return engine.snapshot().get("running", 0)

    before = len(server.finished["generate"])
    with server.slow_steps(0.005):  # 48 tiny steps could all finish inside one 1 ms poll: 5 ms each
        assert server.call(run()) == 0
    stats = server.wait_finished("generate", before)
    assert stats.finish_reason == FinishReason.CANCELLED and stats.generated_tokens < 48
