"""The HTTP API over real engines of tiny bundles: fields that only the engine acts on, and its refusals.

`length_penalty` (/v1/translate) and `stop_token_ids` (/v1/generate, /v1/completions) pass through the API
to the engine's beam search and stop check; what the engine refuses (a stop id outside the vocabulary, a
prompt longer than the model, a prompt plus max_tokens over the KV cache) comes back with the status of
serving/server/errors.py's table and the API's name of the field (max_new_tokens -> max_tokens,
prompt_ids -> prompt, text or text[i]). The app, in-process, is tests/inprocess_app.py's.
"""
from __future__ import annotations

import time

import pytest

from engine_bundle import cached_bundle
from export.bundle import load_bundle
from inprocess_app import SLOTS, InProcessServer
from model.tokenizer import Tokenizer
from serving.engine.types import GenerationRequest, SamplingParams
from serving.server.config import Limits

# max_prompt_tokens above the tiny models' 64 positions, so that the engine, not the service, refuses long prompts
LIMITS = Limits(max_prompt_tokens=100, max_tokens=16, default_max_tokens=4, max_beam_size=4, max_n_best=4)
MODEL_POSITIONS = 64  # tests/engine_bundle.py's tiny preset (max_len)


@pytest.fixture(scope="module")
def server():
    s = InProcessServer(LIMITS)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(load_bundle(cached_bundle("generate")[0]).tokenizer_path)


def _text_of(tok: Tokenizer, n_tokens: int) -> str:
    text = " ".join(["fox"] * n_tokens)
    while len(tok.encode(text)) > n_tokens:
        text = text[:-4]
    assert len(tok.encode(text)) == n_tokens
    return text


def _engine_ids(server: InProcessServer, tok: Tokenizer, prompt: str, params: SamplingParams) -> list[int]:
    """The tokens the generate engine samples for `prompt`, asked directly (no API, no stop ids)."""
    async def run() -> list[int]:
        handle = server.engines["generate"].submit(
            GenerationRequest("reference", [tok.bos_id] + tok.encode(prompt), params))
        return [ev.token_id async for ev in handle if ev.token_id is not None]
    return server.call(run())


SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 12}  # seeded sampling: varied tokens, same every time


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions"])
def test_stop_token_ids_end_the_text_before_that_token(server, tok, path):
    ids = _engine_ids(server, tok, "the quick brown", SamplingParams(max_new_tokens=12, temperature=1.0, seed=7))
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # the first token not seen before it
    body = {"prompt": "the quick brown", **SAMPLED, "stop_token_ids": [ids[k]]}
    if path == "/v1/completions":
        body["model"] = "generate"
    r = server.request("POST", path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    answer = out["choices"][0] if path == "/v1/completions" else out
    assert answer["text"] == tok.decode(ids[:k]) and answer["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == k < len(ids)  # the stop token is neither counted nor shown
    plain = server.request("POST", path, json={k_: v for k_, v in body.items() if k_ != "stop_token_ids"})
    assert plain.json()["usage"]["completion_tokens"] == len(ids)  # without the stop id the text runs on


def test_length_penalty_rescales_the_beam_scores(server):
    """score = log-probability / length ** length_penalty: 0 gives the plain sum, 2 divides it by length**2."""
    def n_best(lp: float) -> list[float]:
        r = server.request("POST", "/v1/translate", json={"text": "the quick brown fox", "beam_size": 4,
                                                          "n_best": 2, "max_tokens": 6, "length_penalty": lp})
        assert r.status_code == 200, r.text
        return [h["score"] for h in r.json()["translations"][0]["n_best"]]
    plain, per_token, squared = n_best(0.0), n_best(1.0), n_best(2.0)
    length = plain[0] / per_token[0]  # the best hypothesis' length in tokens
    assert length == pytest.approx(round(length)) and 2 <= round(length) <= 7
    assert squared[0] == pytest.approx(plain[0] / round(length) ** 2)
    assert plain[0] < per_token[0] < squared[0] < 0  # a log-probability, divided by more and more


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions"])
def test_a_stop_token_outside_the_vocabulary_is_422_naming_the_field(server, path):
    vocab = server.engines["generate"].vocab_size
    body = {"prompt": "x", "stop_token_ids": [1, vocab], "model": "generate"}
    if path == "/v1/generate":
        body.pop("model")
    r = server.request("POST", path, json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "stop_token_ids" and str(vocab) in err["message"], err


def test_engine_refusals_name_the_api_field(server, tok):
    """The engine's names (prompt_ids, max_new_tokens) come back as the API's (prompt, text[i], max_tokens).
    (A decoder-only prompt over the model's positions is refused as prompt + max_new_tokens over the KV cache.)"""
    too_long = _text_of(tok, MODEL_POSITIONS + 6)  # under LIMITS.max_prompt_tokens: the engine refuses it
    cases = [("/v1/translate", {"text": too_long}, "text"),
             ("/v1/translate", {"text": ["the fox", too_long]}, "text[1]"),
             ("/v1/completions", {"model": "translate", "prompt": too_long}, "prompt"),
             ("/v1/generate", {"prompt": _text_of(tok, MODEL_POSITIONS - 8), "max_tokens": 16}, "max_tokens")]
    for path, body, field in cases:
        r = server.request("POST", path, json=body)
        assert r.status_code == 413, (path, field, r.text)
        assert r.json()["error"]["field"] == field, (path, r.json())
    deadline = time.monotonic() + 5  # the list's other text was cancelled: its KV slot frees a moment later
    while any(server.slots_in_use().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.slots_in_use() == {"translate": 0, "generate": 0}


def test_tokenize_and_detokenize_round_trip_on_the_real_tokenizers(server):
    """vLLM's /tokenize and /detokenize shapes, on the real engines' tokenizers (the key is required like any
    other route but the probes)."""
    r = server.request("POST", "/tokenize", json={"model": "generate", "prompt": "the quick fox"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    plain = server.request("POST", "/tokenize", json={"model": "generate", "prompt": "the quick fox",
                                                      "add_special_tokens": False}).json()
    assert plain["tokens"] == body["tokens"][1:]  # a language model's prompt starts with bos
    text = server.request("POST", "/detokenize", json={"model": "generate", "tokens": plain["tokens"]}).json()
    assert text == {"prompt": "the quick fox"}
    translate = server.request("POST", "/tokenize", json={"model": "translate", "prompt": "the dog"}).json()
    assert translate["count"] == len(translate["tokens"]) > 0  # a translator adds no token of its own
    r = server.request("POST", "/detokenize", json={"model": "generate", "tokens": [10**9]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "tokens"
    assert server.request("POST", "/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404


@pytest.mark.slow  # timing: the busy requests must outlast the others' submission (the logic: test_scheduler.py)
def test_an_urgent_request_overtakes_the_waiting_bulk_ones_on_the_real_engine():
    """Every KV slot busy with long requests, bulk requests (priority 5) waiting: a request of priority -1 sent after
    them is admitted first, so it ends before every one of them; the bulk ones keep their order among themselves.
    The busy requests end 8 steps apart, so one slot frees at a time and each waiting request (4 tokens) ends before
    the next one is admitted: the order of the answers is the order of admission."""
    import asyncio

    server = InProcessServer(Limits(max_tokens=60), faults=True)

    async def scenario() -> list[str]:
        done: list[str] = []

        async def send(name: str, priority: int, tokens: int) -> None:
            r = await server.client.post("/v1/generate", json={"prompt": "the", "max_tokens": tokens,
                                                               "ignore_eos": True, "priority": priority})
            assert r.status_code == 200, r.text
            done.append(name)

        tasks = [asyncio.create_task(send(f"busy{i}", 0, 60 - 8 * i)) for i in range(SLOTS)]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(send(f"bulk{i}", 5, 4)) for i in range(3)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(send("urgent", -1, 4)))
        await asyncio.gather(*tasks)
        return done

    try:
        with server.slow_steps(0.005):  # 36+ busy steps take 0.18 s: bulk and urgent arrive long before a slot frees
            done = server.call(scenario())
    finally:
        server.close()
    assert [n for n in done if n.startswith("busy")] == [f"busy{i}" for i in reversed(range(SLOTS))], done
    bulk = [n for n in done if n.startswith("bulk")]
    assert done.index("urgent") < min(done.index(b) for b in bulk), done
    assert bulk == ["bulk0", "bulk1", "bulk2"], done
