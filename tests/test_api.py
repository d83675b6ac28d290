"""Tests of the HTTP API's answers on the real engines of the tiny bundles (translate, generate, OpenAI
completions, streaming, stop strings, health) and of the service's freeing of engine work; stop matching. Also
the helpers the other API tests share.

The app is tests/inprocess_app.py's: serving/server/api.py over ModelServices and real Engines, in-process
through httpx's ASGI transport. Every expected text is the engine's own answer to the same ids, asked directly
(`InProcessServer.engine_output`); a stop string is picked from what the model actually wrote. The one fault
injected here is a delay per engine step (`slow_steps`), so that a cancellation lands before the answer ends.
Refusals (4xx/5xx) are in tests/test_api_errors.py, metrics in tests/test_api_metrics.py, the Serve config in
tests/test_api_config.py; the Ray path in tests/test_server_integration.py.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Mapping

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_bundle import cached_bundle
from export.bundle import load_bundle
from inprocess_app import InProcessServer
from model.tokenizer import Tokenizer
from serving.engine.types import FinishReason, SamplingParams
from serving.server.config import Limits
from serving.server.service import StreamPiece, TextRequest
from serving.server.stops import StopMatcher

LIMITS = Limits(max_prompt_tokens=40, max_tokens=48, default_max_tokens=32)
SAMPLED = {"temperature": 1.0, "seed": 5}  # seeded sampling: a varied text (greedy repeats one token), every time


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    s = InProcessServer(LIMITS, faults=True)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The tiny bundles' tokenizer (translate's is trained on the same text: the same)."""
    return Tokenizer.load(load_bundle(cached_bundle("generate")[0]).tokenizer_path)


def sse(text: str) -> list:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def assert_error(r: httpx.Response, status: int, field: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if field is not None:
        assert err["field"] == field, err
    return err


def engine_text(server: InProcessServer, model: str, prompt: str, **params) -> tuple[str, list[int], FinishReason]:
    """(text, ids, finish reason) of `model`'s engine for `prompt`, asked directly with the ids the API sends it
    (a language model's prompt after bos, a translator's source alone)."""
    tok = server.tokenizers[model]
    ids = tok.encode(prompt) if model == "translate" else [tok.bos_id] + tok.encode(prompt)
    out, finish, _ = server.engine_output(model, ids, SamplingParams(**params))
    return tok.decode(out), out, finish


def stop_in(text: str) -> tuple[str, int]:
    """A stop string the model's text holds after its start: (the first two ASCII letters in a row that occur
    there first, where they start)."""
    for i in range(1, len(text) - 1):
        piece = text[i:i + 2]
        if piece.isascii() and piece.isalpha() and text.find(piece) == i:
            return piece, i
    raise AssertionError(f"no two letters to stop at in {text!r}")


def samples(text: str) -> dict[tuple, float]:
    """An exposition's samples: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


# -- what tests/test_versions.py's async tests share (they run on pytest's event loop, the engines on their own) --
class _Versions(Mapping):
    """Model -> the content version of its tiny bundle (read when first asked: reading exports the bundle)."""

    def __getitem__(self, model: str) -> str:
        return load_bundle(cached_bundle(model)[0]).version

    def __iter__(self) -> Iterator[str]:
        return iter(("translate", "generate"))

    def __len__(self) -> int:
        return 2


VERSIONS = _Versions()


class _CrossLoopClient:
    """`post` / `get` of an httpx.AsyncClient for a coroutine on another event loop: each request runs on the
    server's loop, where its engines deliver their events."""

    def __init__(self, server: InProcessServer) -> None:
        self.server = server

    async def request(self, method: str, url: str, **kwargs) -> httpx.Response:
        call = self.server.client.request(method, url, **kwargs)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self.server.loop))

    async def post(self, url: str, **kwargs) -> httpx.Response:
        return await self.request("POST", url, **kwargs)

    async def get(self, url: str, **kwargs) -> httpx.Response:
        return await self.request("GET", url, **kwargs)


_SHARED: list[InProcessServer] = []


def make_client(tok: Tokenizer | None = None) -> tuple[_CrossLoopClient, dict]:
    """(a client of the real API over the tiny bundles' engines, those engines), for async tests; one server per
    test process, with LIMITS. `tok` is unused (the bundles carry their tokenizers)."""
    if not _SHARED:
        import atexit

        _SHARED.append(InProcessServer(LIMITS))
        atexit.register(_SHARED[0].close)
    return _CrossLoopClient(_SHARED[0]), _SHARED[0].engines


# -- translate ------------------------------------------------------------------------------------------
def test_translate_one_text(server, tok):
    source = "the quick brown fox"
    text, ids, finish = engine_text(server, "translate", source, max_new_tokens=LIMITS.default_tokens)
    before = len(server.finished["translate"])
    r = server.request("POST", "/v1/translate", json={"text": source})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "translate"
    assert body["translations"] == [{"text": text, "finish_reason": finish.value, "n_best": None, "score": None,
                                     "token_scores": None, "sentences": None}]
    stats = server.wait_finished("translate", before)
    assert stats.prompt_tokens == len(tok.encode(source))  # the source alone: no bos for an encoder-decoder
    assert body["usage"]["prompt_tokens"] == len(tok.encode(source))
    assert body["usage"]["completion_tokens"] == len(ids) == stats.generated_tokens
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    timings = body["timings"]
    assert timings["queue_s"] == pytest.approx(stats.queue_wait)  # the engine's own wait, passed on
    assert 0 <= timings["queue_s"] <= timings["ttft_s"] <= timings["total_s"]


def test_translate_list_with_beam_n_best(server, tok):
    r = server.request("POST", "/v1/translate", json={"text": ["a", "b", "c"], "beam_size": 4, "n_best": 3})
    assert r.status_code == 200, r.text
    ts = r.json()["translations"]
    assert len(ts) == 3 and all(len(t["n_best"]) == 3 for t in ts)
    for source, t in zip(["a", "b", "c"], ts, strict=True):
        _, _, hyps = server.engine_output("translate", tok.encode(source), SamplingParams(
            max_new_tokens=LIMITS.default_tokens, beam_size=4, n_best=3))
        assert [h["text"] for h in t["n_best"]] == [tok.decode(ids) for ids, _ in hyps]  # the engine's beam of 4
        assert [h["score"] for h in t["n_best"]] == pytest.approx([score for _, score in hyps])
        assert t["text"] == t["n_best"][0]["text"]
        scores = [h["score"] for h in t["n_best"]]
        assert scores == sorted(scores, reverse=True)
    assert len({t["text"] for t in ts}) > 1  # each text its own translation


def test_translate_length_penalty_reaches_the_beam_search(server, tok):
    def api(body: dict) -> list[float]:
        r = server.request("POST", "/v1/translate", json={"text": "a", "beam_size": 2, "n_best": 2, **body})
        assert r.status_code == 200, r.text
        return [h["score"] for h in r.json()["translations"][0]["n_best"]]

    def engine(lp: float) -> list[float]:
        _, _, hyps = server.engine_output("translate", tok.encode("a"), SamplingParams(
            max_new_tokens=LIMITS.default_tokens, beam_size=2, n_best=2, length_penalty=lp))
        return [score for _, score in hyps]
    assert api({"length_penalty": 0.6}) == pytest.approx(engine(0.6))
    assert api({}) == pytest.approx(engine(1.0))  # 1.0: the default
    assert engine(0.6) != pytest.approx(engine(1.0))


# -- generate ---------------------------------------------------------------------------------------------
def test_generate_json_prepends_bos(server, tok):
    text, ids, _ = engine_text(server, "generate", "hello", max_new_tokens=5, seed=3, temperature=0.7)
    before = len(server.finished["generate"])
    r = server.request("POST", "/v1/generate", json={"prompt": "hello", "max_tokens": 5, "seed": 3,
                                                     "temperature": 0.7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5
    assert body["text"] == text  # bos, the prompt, the seed and the temperature reached the engine
    assert server.wait_finished("generate", before).prompt_tokens == 1 + len(tok.encode("hello"))
    assert body["usage"]["prompt_tokens"] == len(tok.encode("hello"))  # the user's tokens: bos is not counted
    other, _, _ = engine_text(server, "generate", "hello", max_new_tokens=5, seed=4, temperature=0.7)
    assert other != text  # the seed decides the text


def test_generate_stop_string_trims_and_cancels(server):
    full, _, _ = engine_text(server, "generate", "hi", max_new_tokens=40, **SAMPLED)
    stop, at = stop_in(full)
    before = len(server.finished["generate"])
    with server.slow_steps(0.03):  # 40 steps take 1.2 s: the stop string is seen long before the last
        r = server.request("POST", "/v1/generate", json={"prompt": "hi", "max_tokens": 40, "stop": [stop],
                                                         **SAMPLED})
        assert r.status_code == 200, r.text
        assert r.json()["text"] == full[:at] and r.json()["finish_reason"] == "stop"
        stats = server.wait_finished("generate", before)
    assert stats.finish_reason == FinishReason.CANCELLED and stats.generated_tokens < 40  # the engine stopped too


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions"])
def test_stop_token_ids_reach_the_engine(server, path):
    _, ids, _ = engine_text(server, "generate", "hi", max_new_tokens=12, **SAMPLED)
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # the first token not seen before it
    body = {"prompt": "hi", "max_tokens": 12, **SAMPLED, **({"model": "generate"} if "completions" in path else {})}
    completion = []
    for stop_ids in ([ids[k]], None):  # null: no stop ids
        r = server.request("POST", path, json={**body, "stop_token_ids": stop_ids})
        assert r.status_code == 200, r.text
        completion.append(r.json()["usage"]["completion_tokens"])
    assert completion == [k, 12]


def test_generate_stream_sse(server):
    full, _, _ = engine_text(server, "generate", "hi", max_new_tokens=40, **SAMPLED)
    stop, at = stop_in(full)
    r = server.request("POST", "/v1/generate", json={"prompt": "hi", "stream": True, "stop": stop,
                                                     "max_tokens": 40, **SAMPLED})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse(r.text)]
    tokens, final = events[:-1], events[-1]
    assert all(set(e) == {"token", "index"} for e in tokens)
    streamed = "".join(e["token"] for e in tokens)
    assert streamed == final["text"] == full[:at]  # nothing of the stop string leaks
    assert final["finish_reason"] == "stop" and final["usage"]["completion_tokens"] >= len(tokens)
    assert set(final["timings"]) == {"queue_s", "ttft_s", "server_ttft_s", "total_s"}
    assert final["timings"]["server_ttft_s"] >= final["timings"]["ttft_s"] >= 0  # from the arrival, not the submit


# -- OpenAI compatibility ----------------------------------------------------------------------------------
def test_openai_client_completions_and_models(server, tok):
    import openai

    greedy, _, _ = engine_text(server, "generate", "hi", max_new_tokens=4)
    full, _, _ = engine_text(server, "generate", "hi", max_new_tokens=40, **SAMPLED)
    stop, at = stop_in(full)
    translation, _, _ = engine_text(server, "translate", "the fox", max_new_tokens=8, temperature=1.0, seed=5)

    async def scenario() -> None:
        oai = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=server.client)
        models = await oai.models.list()
        assert sorted(m.id for m in models.data) == sorted(
            [name for model, v in server.versions.items() for name in (model, f"{model}@{v}")])
        c = await oai.completions.create(model="generate", prompt="hi", max_tokens=4, temperature=0)
        assert c.choices[0].text == greedy and c.choices[0].finish_reason == "length"
        assert c.usage.completion_tokens == 4
        stream = await oai.completions.create(model="generate", prompt="hi", max_tokens=40, stream=True,
                                              stop=[stop], stream_options={"include_usage": True},
                                              temperature=SAMPLED["temperature"], seed=SAMPLED["seed"])
        chunks = [ch async for ch in stream]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full[:at]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(tok.encode("hi"))
        t = await oai.completions.create(model="translate", prompt="the fox", max_tokens=8, seed=5)
        assert t.choices[0].text == translation  # OpenAI's default temperature, 1, sampled with the seed
        with pytest.raises(openai.NotFoundError):
            await oai.completions.create(model="gpt-4", prompt="hi")
        with pytest.raises(openai.UnprocessableEntityError):
            await oai.completions.create(model="generate", prompt="hi", suffix="!")  # not supported
    server.call(scenario())


def test_completions_stream_ends_with_done(server):
    # greedy: OpenAI's default temperature 1 samples, and a sampled token may be the end of text (then "stop")
    r = server.request("POST", "/v1/completions", json={"model": "generate", "prompt": "hi", "stream": True,
                                                       "max_tokens": 3, "temperature": 0})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # greedy "hi" runs past 4 tokens


# -- health -------------------------------------------------------------------------------------
def test_health_routes(server):
    assert server.request("GET", "/v2/health/live").json() == {"status": "live"}
    assert server.request("GET", "/v2/health/ready").status_code == 200
    assert_error(server.request("GET", "/v1/nothing"), 404)


# -- service-level cancellation --------------------------------------------------------------------------
def _abandon_a_stream(server: InProcessServer, request_id: str) -> None:
    """Read the first piece of a 30-token stream of the generate service, then close it, as a client
    disconnect does to the route's generator."""
    async def run() -> None:
        stream = server.services["generate"].stream(TextRequest(
            "hi", SamplingParams(max_new_tokens=30), deadline_wall=time.time() + 60, request_id=request_id))
        assert isinstance(await stream.__anext__(), StreamPiece)
        await stream.aclose()
    with server.slow_steps(0.03):  # 30 steps take 0.9 s: the close lands long before the last
        server.call(run())


def test_closing_a_stream_cancels_the_engine_request(server):
    before = len(server.finished["generate"])
    _abandon_a_stream(server, "closed-stream")
    stats = server.wait_finished("generate", before)
    assert stats.request_id == "closed-stream"
    assert stats.finish_reason == FinishReason.CANCELLED and stats.generated_tokens < 30
    server.wait_idle()
    assert server.slots_in_use()["generate"] == 0


def test_stats_of_requests_nobody_collects_are_not_kept(server):
    # The engine reports a request's stats when it finishes, also after its client left: the service keeps
    # them only while a stream is open to read them (a dropped stream's stats are ~1 KB each, its gaps).
    service = server.services["generate"]
    before = len(server.finished["generate"])
    _abandon_a_stream(server, "abandoned")
    late = server.wait_finished("generate", before)  # the service saw them first
    assert late.request_id == "abandoned" and late.finish_reason == FinishReason.CANCELLED
    done = server.call(service.complete(TextRequest("hi", SamplingParams(max_new_tokens=5),
                                                    deadline_wall=time.time() + 60)))
    assert done.queue_s is not None  # a finished request still reads its own
    assert service._stats == {}  # neither the abandoned request's stats nor the finished one's


# -- stop strings -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pieces,stops,released,stopped", [
    (["hel", "lo wo", "rld"], ["lo w"], "hel", True),
    (["a", "b", "c"], [], "abc", False),
    (["ST", "O", "x"], ["STOP"], "STOx", False),
    (["xx S", "TOP yy"], ["STOP", "TO"], "xx ", True),
    (["ü", "ber", "!"], ["ber!"], "ü", True),
])
def test_stop_matcher(pieces, stops, released, stopped):
    m, out, hit = StopMatcher(tuple(stops)), "", False
    for p in pieces:
        text, hit = m.push(p)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (released, stopped)
