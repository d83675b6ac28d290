"""The response cache (serving/server/response_cache.py): unit rules, then through the HTTP API on a real engine.

The acceptance: an identical deterministic request (greedy, beam, seeded) is answered from the cache without the
engine and with the same answer; unseeded sampling and `Cache-Control: no-cache` never are; the cache is bounded
(least recently used out first, by entries and by bytes); hits, misses, evictions and entries are metrics.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from engine_bundle import cached_bundle
from local_backend import LocalBackend
from serving.engine.config import BatchingKnobs, ReplicaKnobs
from serving.engine.types import SamplingParams
from serving.server.api import create_app
from serving.server.config import Limits, ModelSpec
from serving.server.local_model import LocalModel
from serving.server.metrics import Recorder
from serving.server.response_cache import ResponseCache, cache_key
from serving.server.service import TextRequest, TextResult


def result(text: str, finish: str = "stop") -> TextResult:
    return TextResult(text=text, finish_reason=finish, prompt_tokens=1, completion_tokens=1, queue_s=0.1,
                      ttft_s=0.1, total_s=0.2)


def test_only_deterministic_wanted_answers_have_a_key():
    greedy, seeded = SamplingParams(), SamplingParams(temperature=0.8, seed=3)
    assert cache_key(TextRequest("a", greedy, 0.0)) is not None
    assert cache_key(TextRequest("a", seeded, 0.0)) is not None
    assert cache_key(TextRequest("a", SamplingParams(temperature=0.8), 0.0)) is None  # unseeded sampling
    assert cache_key(TextRequest("a", greedy, 0.0, cache=False)) is None  # Cache-Control: no-cache
    assert cache_key(TextRequest("a", greedy, 0.0)) != cache_key(TextRequest("a", SamplingParams(beam_size=2), 0.0))
    assert cache_key(TextRequest("a", greedy, 0.0)) == cache_key(TextRequest("a", greedy, 99.0, request_id="x"))


def test_least_recently_used_goes_first_by_entries_and_by_bytes():
    recorder = Recorder("prometheus")
    cache = ResponseCache(max_entries=2, max_bytes=10_000, recorder=recorder, labels={"model": "m", "version": "v"})
    for k in "abc":
        cache.put((k,), result(k))
        if k == "b":
            assert cache.get(("a",)) is not None  # a is now more recent than b
    assert cache.get(("b",)) is None and cache.get(("a",)) is not None and len(cache) == 2
    cache.put(("late",), result("x", finish="deadline"))  # cut short: not kept
    assert cache.get(("late",)) is None
    big = ResponseCache(max_entries=100, max_bytes=3 * 1100, recorder=None, labels={})
    for i in range(5):
        big.put((i,), result("y" * 1000))
    assert len(big) < 5 and big.bytes <= 3 * 1100 and big.get((4,)) is not None
    text = recorder.exposition()
    assert 'kvserve_response_cache_evictions_total{model="m",version="v"} 1.0' in text
    assert 'kvserve_response_cache_requests_total{model="m",reason="hit",version="v"} 2.0' in text


class CachedBackend(LocalBackend):
    """LocalBackend whose answers go through LocalModel.complete, as a replica's (the cache sits there)."""

    def __init__(self, model: LocalModel, recorder: Recorder) -> None:
        super().__init__({"translate": model.service}, recorder)
        self.model = model

    async def complete(self, model: str, req: TextRequest) -> TextResult:
        return await self.model.complete(req)

    def answer_cache(self, model: str) -> ResponseCache | None:
        return self.model.cache


LIMITS = Limits(max_prompt_tokens=40, max_tokens=16)


def cached_translator(loop: asyncio.AbstractEventLoop, recorder: Recorder) -> LocalModel:
    """The tiny translator as a replica loads it, with a response cache of 64 answers."""
    bundle = cached_bundle("translate")[0]
    spec = ModelSpec(name="translate", bundle=bundle, response_cache_entries=64,
                     engine=ReplicaKnobs(max_slots=4, provider="cpu", intra_op_threads=1))
    return loop.run_until_complete(LocalModel.load(spec, str(bundle), LIMITS, BatchingKnobs(), recorder))


@pytest.fixture(scope="module")
def served():
    loop = asyncio.new_event_loop()
    recorder = Recorder("prometheus")
    model = cached_translator(loop, recorder)
    app = create_app(CachedBackend(model, recorder), LIMITS, recorder)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    yield loop, client, model
    loop.run_until_complete(client.aclose())
    loop.run_until_complete(model.engine.stop())
    loop.close()


def test_a_repeated_request_is_answered_from_the_cache_without_the_engine(served):
    loop, client, model = served

    def post(body: dict, **headers: str) -> httpx.Response:
        return loop.run_until_complete(client.post("/v1/translate", json=body, headers=headers))

    def engine_tokens() -> float:
        from prometheus_client.parser import text_string_to_metric_families

        families = text_string_to_metric_families(model.service.recorder.exposition())
        return sum(s.value for f in families for s in f.samples if s.name == "kvserve_generated_tokens_total")

    body = {"text": "the quick brown fox", "max_tokens": 8}
    first = post(body)
    before = engine_tokens()
    again = post(body)
    assert again.status_code == 200 and again.json()["translations"] == first.json()["translations"]
    assert again.headers["x-cache"] == "hit" and "x-cache" not in first.headers
    assert engine_tokens() == before  # the engine did not run
    assert "x-cache" not in post(body, **{"Cache-Control": "no-cache"}).headers
    assert engine_tokens() > before
    beam = {**body, "beam_size": 2, "n_best": 2}
    assert "x-cache" not in post(beam).headers  # other parameters, another answer
    assert post(beam).headers["x-cache"] == "hit"
    mixed = post({"text": ["the quick brown fox", "over the dog"], "max_tokens": 8})
    assert mixed.headers["x-cache"] == "partial"


async def test_identical_requests_in_flight_share_one_computation():
    cache = ResponseCache(max_entries=8, max_bytes=2**20, recorder=None, labels={})
    calls = []
    release = asyncio.Event()

    async def compute(req: TextRequest) -> TextResult:
        calls.append(req.text)
        await release.wait()
        if req.text == "fails":
            raise RuntimeError("refused")
        return result(req.text.upper())

    req = TextRequest("same", SamplingParams(), 0.0)
    waiting = [asyncio.ensure_future(cache.complete(req, compute)) for _ in range(5)]
    failing = [asyncio.ensure_future(cache.complete(TextRequest("fails", SamplingParams(), 0.0), compute))
               for _ in range(2)]
    await asyncio.sleep(0.01)
    release.set()
    answers = await asyncio.gather(*waiting)
    assert calls.count("same") == 1 and [a.text for a in answers] == ["SAME"] * 5
    assert sum(a.cached for a in answers) == 4
    outcomes = await asyncio.gather(*failing, return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes) and calls.count("fails") == 2  # each its own try


async def test_a_new_version_never_answers_from_an_old_versions_cache(tmp_path):
    """A rollout's new replica loads the new bundle with a cache of its own: the old version's answers stay behind."""
    import json
    import shutil

    from export.bundle import write_manifest

    old = cached_bundle("translate")[0]
    new = tmp_path / "translate-v2"
    shutil.copytree(old, new)
    manifest = json.loads((new / "manifest.json").read_text())
    manifest["generation"] = {"banned_ids": [7]}
    write_manifest(new, {k: v for k, v in manifest.items() if k not in ("files", "version", "created")})
    limits = Limits(max_prompt_tokens=40, max_tokens=16)
    req = TextRequest("the quick brown fox", SamplingParams(max_new_tokens=8), 1e12)
    models = []
    for bundle in (old, new):
        spec = ModelSpec(name="translate", bundle=bundle, response_cache_entries=8,
                         engine=ReplicaKnobs(max_slots=2, provider="cpu", intra_op_threads=1))
        models.append(await LocalModel.load(spec, str(bundle), limits, BatchingKnobs(), Recorder("prometheus")))
    first = await models[0].complete(req)
    assert (await models[0].complete(req)).cached
    answered = await models[1].complete(req)
    assert not answered.cached and answered.version != first.version
    for m in models:
        await m.stop()
