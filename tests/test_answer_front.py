"""Whole answers kept by the response cache (serving/server/answer_front.py), through the HTTP API on a real engine.

A request whose bytes equal an earlier deterministic request's is answered before the routes (the backend is never
called), with the answer the routes computed (fresh timings, `X-Cache: hit`), behind the API key, counted in the
request metrics; other bytes, `Cache-Control: no-cache`, a canary's model and sampling without a seed go to the
routes; the kept answers stay within the cache's byte bound.
"""
from __future__ import annotations

import asyncio
import json
import random
import tracemalloc

import httpx
import pytest

from serving.server.answer_front import STORE_KEY, AnswerFront, AnswerKey
from serving.server.api import create_app
from serving.server.local_model import LocalModel
from serving.server.metrics import Recorder
from serving.server.response_cache import ResponseCache
from serving.server.service import TextRequest, TextResult
from test_response_cache import LIMITS, CachedBackend, cached_translator

KEY = "s3cret-key"


class CountingBackend(CachedBackend):
    def __init__(self, model: LocalModel, recorder: Recorder) -> None:
        super().__init__(model, recorder)
        self.calls = 0

    async def complete(self, model: str, req: TextRequest) -> TextResult:
        self.calls += 1
        return await super().complete(model, req)


@pytest.fixture(scope="module")
def served():
    loop = asyncio.new_event_loop()
    recorder = Recorder("prometheus")
    model = cached_translator(loop, recorder)
    backend = CountingBackend(model, recorder)
    app = create_app(backend, LIMITS, recorder, api_key=KEY)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                               headers={"Authorization": f"Bearer {KEY}"})

    def post(content: bytes | str, **headers: str) -> httpx.Response:
        headers.setdefault("Content-Type", "application/json")
        return loop.run_until_complete(client.post("/v1/translate", content=content, headers=headers))

    yield post, backend, recorder
    loop.run_until_complete(client.aclose())
    loop.run_until_complete(model.engine.stop())
    loop.close()


def _sample(recorder: Recorder, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(recorder.exposition()) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_repeated_request_gets_the_computed_answer_without_the_routes(served):
    post, backend, recorder = served
    body = json.dumps({"text": ["the quick brown fox", "a small house"], "max_tokens": 8, "beam_size": 2})
    first = post(body)
    assert first.status_code == 200 and "x-cache" not in first.headers
    calls, hits = backend.calls, _sample(recorder, "kvserve_response_cache_requests_total", reason="hit")
    requests = _sample(recorder, "kvserve_requests_total", endpoint="/v1/translate", status="200")
    again = post(body)
    assert backend.calls == calls  # answered before the routes: the backend was never asked
    assert again.status_code == 200 and again.headers["x-cache"] == "hit"
    assert again.headers["x-model-version"] == first.headers["x-model-version"]
    assert again.headers["content-type"] == first.headers["content-type"]
    computed, kept = first.json(), again.json()
    assert set(kept["timings"]) == set(computed["timings"]) and kept["timings"]["queue_s"] == 0.0
    assert {k: v for k, v in kept.items() if k != "timings"} == {k: v for k, v in computed.items() if k != "timings"}
    # counted like any answer: the request metrics by route, the cache's hits by text
    assert _sample(recorder, "kvserve_requests_total", endpoint="/v1/translate", status="200") == requests + 1
    assert _sample(recorder, "kvserve_response_cache_requests_total", reason="hit") == hits + 2


def test_other_bytes_no_cache_and_no_key_are_not_answered_from_kept_answers(served):
    post, backend, _ = served
    body = {"text": "over the lazy dog", "max_tokens": 8}
    post(json.dumps(body))
    calls = backend.calls
    spaced = post(json.dumps(body, indent=1))  # the same request in other bytes: the routes answer (a text hit)
    assert backend.calls == calls + 1 and spaced.headers["x-cache"] == "hit"
    fresh = post(json.dumps(body), **{"Cache-Control": "no-cache"})
    assert backend.calls == calls + 2 and "x-cache" not in fresh.headers
    assert post(json.dumps(body), Authorization="Bearer wrong").status_code == 401  # the key is checked first
    timeout = post(json.dumps(body), **{"X-Request-Timeout-Seconds": "soon"})  # other headers that matter: routes
    assert timeout.status_code == 422 and "x-request-timeout-seconds" in timeout.text and backend.calls == calls + 2


def test_only_the_only_route_of_a_colocated_model_keeps_answers():
    from serving.server.ingress import RayBackend

    class Local:
        cache = ResponseCache(8, 2**20, None, {})

    stable, canary = Local(), Local()
    backend = RayBackend({}, {"a": "translate", "b": "translate"}, {"a": [("a", 100.0)], "b": [("b", 90.0),
                         ("b-canary", 10.0)]}, "app", local={"a": stable, "b": stable, "b-canary": canary})
    assert backend.answer_cache("a") is stable.cache and backend.answer_cache("b") is None


async def _front_answer(front: AnswerFront, body: bytes) -> tuple[int, bytes]:
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/translate", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    await front(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def test_kept_answers_stay_within_the_byte_bound():
    """10,000 distinct answers of ~230 characters through the front: the cache holds what its bound allows, and
    the memory they take stays within 1.25x of it (tracemalloc)."""
    bound = 2 * 2**20
    cache = ResponseCache(max_entries=1_000_000, max_bytes=bound, recorder=None, labels={})
    rng = random.Random(2)

    async def route(scope: dict, receive, send) -> None:  # a translate route's answer, storable
        text = json.loads((await receive())["body"])["text"]
        scope.setdefault("state", {})[STORE_KEY] = (cache, 1)  # as mark_storable marks a storable answer
        body = json.dumps({"model": "translate", "usage": {"prompt_tokens": 40, "completion_tokens": 40,
                           "total_tokens": 80}, "timings": {"total_s": 0.01},
                           "translations": [{"text": text[::-1], "finish_reason": "stop"}]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"x-model-version", b"v1")]})
        await send({"type": "http.response.body", "body": body})

    front = AnswerFront(route, [cache], {})
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(10_000):
        text = " ".join(str(rng.random()) for _ in range(12))
        status, _ = await _front_answer(front, json.dumps({"text": text}).encode())
        assert status == 200
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert cache.bytes <= bound and 0 < len(cache) < 10_000
    assert held <= 1.25 * bound, (held, bound, len(cache))
    last = json.dumps({"text": text}).encode()
    assert cache.get_answer(AnswerKey("/v1/translate", b"application/json", b"", last)) is not None
    status, again = await _front_answer(front, last)
    assert status == 200 and json.loads(again)["translations"][0]["text"] == text[::-1]

