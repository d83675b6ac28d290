"""Tests of the HTTP API's refusals on the real engines of the tiny bundles: every error a route, the middleware
(API key, drain, body limit, Ray's proxy guard) or the engine produces comes back with the status of
serving/server/errors.py's table, the one body shape and the field at fault.

Same app as tests/test_api.py (tests/inprocess_app.py: real ModelServices and Engines, in-process); other limits,
keys and drain gates are other apps over the same engines (`app_client`). Faults the engines cannot produce on
demand are injected into their steps: a step held (tests/step_faults.py) while the queue is full, and a delay per
step, so that an answer outlasts its deadline. The error table itself is in tests/test_errors.py.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from inprocess_app import InProcessServer
from model.tokenizer import Tokenizer
from serving.engine.types import SamplingParams
from serving.server.config import Limits
from serving.server.drain import Drain
from serving.server.errors import ErrorKind, ServiceError
from serving.server.proxy_guard import RayHeaderGuard
from serving.server.service import TextRequest
from test_api import LIMITS, assert_error, samples


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    s = InProcessServer(LIMITS, faults=True)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok(server: InProcessServer) -> Tokenizer:
    return server.tokenizers["generate"]


def post(server: InProcessServer, client: httpx.AsyncClient, path: str, **kwargs) -> httpx.Response:
    return server.call(client.post(path, **kwargs))


def _text_of(tok, n_tokens: int) -> str:
    text = " ".join(["fox"] * n_tokens)
    while len(tok.encode(text)) > n_tokens:
        text = text[:-4]
    assert len(tok.encode(text)) == n_tokens
    return text


# -- translate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,field,status", [
    ({"text": "x", "beam_size": 2, "n_best": 3}, None, 422),
    ({"text": "x", "beam_size": 9}, "beam_size", 422),
    ({"text": "x", "beam_size": "wide"}, "beam_size", 422),
    ({"text": []}, None, 422),
    ({"text": "x", "max_tokens": 49}, "max_tokens", 422),
    ({"text": "x", "max_tokens": 0}, "max_tokens", 422),
    ({"text": "x", "colour": "red"}, "colour", 422),
    ({"txt": "x"}, "text", 422),
    ({"text": "x", "model": "nope"}, "model", 404),
    ({"text": "x", "model": "generate"}, "model", 422),
    ({"text": ["x"] * 33}, "text", 413),
    ({"text": "word " * 60}, "text", 413),
    ({"text": "x", "beam_size": 2, "length_penalty": 2.5}, "length_penalty", 422),
    ({"text": "x", "length_penalty": -0.1}, "length_penalty", 422),
])
def test_translate_errors(server, body, field, status):
    err = assert_error(server.request("POST", "/v1/translate", json=body), status, field)
    if body.get("beam_size") == 9:
        assert "8" in err["message"] and "9" in err["message"]  # names the value and the limit


def test_configured_beam_limits(server):
    client = server.app_client(limits=Limits(max_prompt_tokens=40, max_tokens=48, max_beam_size=2, max_n_best=1))
    err = assert_error(post(server, client, "/v1/translate", json={"text": "x", "beam_size": 3}), 422, "beam_size")
    assert "2" in err["message"] and "3" in err["message"]  # the value and this server's limit
    assert_error(post(server, client, "/v1/translate", json={"text": "x", "beam_size": 2, "n_best": 2}), 422,
                 "n_best")
    r = post(server, client, "/v1/translate", json={"text": "x", "beam_size": 2, "max_tokens": 4})
    assert r.status_code == 200, r.text  # within both limits


def test_malformed_json_is_422_not_500(server):
    r = server.request("POST", "/v1/translate", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 422)


def test_body_over_limit_is_413(server):
    client = server.app_client(limits=Limits(max_body_bytes=256))
    err = assert_error(post(server, client, "/v1/generate", json={"prompt": "x" * 1000}), 413, "body")
    assert "256" in err["message"]
    assert post(server, client, "/v1/generate", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# -- generate -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"), ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "seed": -1}, "seed"), ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"), ({"prompt": 5}, "prompt"), ({}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"), ({"prompt": "x", "stop_token_ids": "5"},
                                                                     "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": list(range(17))}, "stop_token_ids"),
])
def test_generate_validation(server, body, field):
    assert_error(server.request("POST", "/v1/generate", json=body), 422, field)


def test_prompt_over_token_limit_is_413(server, tok):
    prompt = _text_of(tok, LIMITS.max_prompt_tokens + 1)
    for stream in (False, True):
        err = assert_error(server.request("POST", "/v1/generate", json={"prompt": prompt, "stream": stream}), 413,
                           "prompt")
        assert str(LIMITS.max_prompt_tokens) in err["message"] and str(LIMITS.max_prompt_tokens + 1) in err["message"]
    r = server.request("POST", "/v1/generate", json={"prompt": _text_of(tok, LIMITS.max_prompt_tokens),
                                                     "max_tokens": 2})
    assert r.status_code == 200, r.text  # at the limit: served


def test_engine_invalid_request_too_large_is_413(server, tok):
    """Within the API's limits, over the model's KV cache: the engine refuses, by the API's name of the field."""
    kv = server.engines["generate"].max_len
    prompt = _text_of(tok, kv - LIMITS.max_tokens + 1)  # with bos, + max_tokens - 1 fed back: one over
    assert len(tok.encode(prompt)) <= LIMITS.max_prompt_tokens
    err = assert_error(server.request("POST", "/v1/generate", json={"prompt": prompt,
                                                                    "max_tokens": LIMITS.max_tokens}),
                       413, "max_tokens")  # the engine's max_new_tokens, by the API's name
    assert str(LIMITS.max_tokens) in err["message"] and str(kv) in err["message"]
    r = server.request("POST", "/v1/generate", json={"prompt": prompt, "max_tokens": LIMITS.max_tokens - 1})
    assert r.status_code == 200, r.text  # one token fewer fits


def test_the_service_names_the_field_an_engine_refuses(server):
    service = server.services["generate"]  # decoder-only: no beam search
    with pytest.raises(ServiceError) as e:
        server.call(service.complete(TextRequest("hi", SamplingParams(beam_size=2, max_new_tokens=4),
                                                 deadline_wall=time.time() + 60)))
    assert e.value.kind == ErrorKind.INVALID and e.value.field == "beam_size"


@pytest.fixture
def full_server() -> Iterator[InProcessServer]:
    """One KV slot and no waiting places: a second request is refused while the first holds the slot."""
    s = InProcessServer(LIMITS, max_slots=1, max_waiting=0, faults=True)
    yield s
    s.close()


def _holding_the_slot(server: InProcessServer, model: str, path: str, body: dict) -> asyncio.Future:
    """Send a request to `model` whose first engine step is held (until `faults[model].release()`): it
    occupies the engine's only slot. Returns its response's future."""
    server.faults[model].hang_next()
    pending = asyncio.run_coroutine_threadsafe(server.client.post(path, json=body), server.loop)
    assert server.faults[model].hanging.wait(10), "the held step never started"
    return pending


def test_the_service_reports_a_full_engine_as_overloaded_with_its_retry_after(full_server):
    service = full_server.services["generate"]
    pending = _holding_the_slot(full_server, "generate", "/v1/generate", {"prompt": "x", "max_tokens": 2})
    try:
        with pytest.raises(ServiceError) as e:
            full_server.call(service.complete(TextRequest("hi", SamplingParams(max_new_tokens=4),
                                                          deadline_wall=time.time() + 60)))
    finally:
        full_server.faults["generate"].release()
    assert e.value.kind == ErrorKind.OVERLOADED and e.value.retry_after_s > 0
    assert pending.result(10).status_code == 200  # the request that held the slot is answered


def test_overload_is_429_with_retry_after(full_server):
    held = [_holding_the_slot(full_server, "generate", "/v1/generate", {"prompt": "x", "max_tokens": 2}),
            _holding_the_slot(full_server, "translate", "/v1/translate", {"text": "x", "max_tokens": 2})]
    try:
        for path, body in (("/v1/generate", {"prompt": "x"}), ("/v1/generate", {"prompt": "x", "stream": True}),
                           ("/v1/translate", {"text": "x"})):
            r = full_server.request("POST", path, json=body)
            assert assert_error(r, 429)["type"] == "overloaded"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        for faults in full_server.faults.values():
            faults.release()
    assert [p.result(10).status_code for p in held] == [200, 200]
    after = samples(full_server.request("GET", "/metrics").text)
    assert after[("kvserve_rejections_total", (("model", "generate"), ("reason", "queue_full")))] == 2
    assert after[("kvserve_rejections_total", (("model", "translate"), ("reason", "queue_full")))] == 1
    assert full_server.request("POST", "/v1/generate", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_deadline_is_504(server):
    client = server.app_client(limits=LIMITS.model_copy(update={"request_timeout_s": 0.05}))
    with server.slow_steps(0.1):  # the first token comes after the deadline
        assert assert_error(post(server, client, "/v1/generate", json={"prompt": "x"}), 504)["type"] == \
            "deadline_exceeded"
        assert_error(post(server, client, "/v1/translate", json={"text": "x"}), 504)
        server.wait_idle()


def test_a_client_may_ask_for_a_shorter_deadline_never_a_longer_one(server):
    """X-Request-Timeout-Seconds (the header Ray Serve reads for its own backstop) shortens the request's deadline
    below the server's request_timeout_s; a longer one changes nothing; a value that is not seconds above 0 is a
    422."""
    client = server.app_client(limits=LIMITS.model_copy(update={"request_timeout_s": 30}))
    with server.slow_steps(0.02):  # 32 tokens: ~0.7 s
        t0 = time.monotonic()
        err = assert_error(post(server, client, "/v1/generate", json={"prompt": "x"},
                                headers={"X-Request-Timeout-Seconds": "0.1"}), 504)
        assert time.monotonic() - t0 < 0.6 and err["type"] == "deadline_exceeded"  # not the server's 30 s
        r = post(server, client, "/v1/generate", json={"prompt": "x", "max_tokens": 4},
                 headers={"X-Request-Timeout-Seconds": "3600"})
        assert r.status_code == 200, r.text
        server.wait_idle()
    for bad in ("soon", "0", "-1", "nan"):
        r = post(server, client, "/v1/generate", json={"prompt": "x"}, headers={"X-Request-Timeout-Seconds": bad})
        assert assert_error(r, 422, "x-request-timeout-seconds")["type"] == "invalid_request", bad


@pytest.mark.parametrize("body,field", [
    ({"stop_token_ids": [1.5]}, "stop_token_ids.0"), ({"stop_token_ids": [None]}, "stop_token_ids.0"),
    ({"stop_token_ids": [7] * 17}, "stop_token_ids"),
])
def test_completions_stop_token_ids_validation(server, body, field):
    r = server.request("POST", "/v1/completions", json={"model": "generate", "prompt": "x", **body})
    assert_error(r, 422, field)


# -- middleware: API key, drain ---------------------------------------------------------------------------
def test_api_key(server):
    client = server.app_client(api_key="s3cret")
    assert_error(post(server, client, "/v1/generate", json={"prompt": "x"}), 401)
    r = post(server, client, "/v1/generate", json={"prompt": "x", "max_tokens": 2},
             headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200
    assert server.call(client.get("/v2/health/ready")).status_code == 200  # probes need no key


def test_draining_is_503_with_retry_after(server):
    drain = Drain()
    client = server.app_client(drain=drain)
    drain.set_draining(True)
    r = post(server, client, "/v1/generate", json={"prompt": "x"})
    err = assert_error(r, 503)
    assert err["type"] == "unavailable" and err["field"] is None
    assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
    assert server.call(client.get("/v2/health/live")).status_code == 200  # liveness still answers
    drain.set_draining(False)
    assert post(server, client, "/v1/generate", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# -- Ray's proxy -----------------------------------------------------------------------------------------
def test_ray_proxy_guard_refuses_headers_ray_would_choke_on():
    """Ray's proxy decodes x-request-id & co. as UTF-8 (a bare 500 otherwise): serving/server/proxy_guard.py says
    400."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(headers: list) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=RayHeaderGuard(app)), base_url="http://t") as c:
            return await c.get("/", headers=headers)
    for name in (b"x-request-id", b"X-Session-Id", b"serve-multiplexed-model-id"):
        r = asyncio.run(call([(name, b"\x80abc")]))
        assert r.status_code == 400 and r.json()["error"]["field"].lower() == name.decode().lower(), r.text
    assert asyncio.run(call([(b"x-request-id", "é-1".encode())])).status_code == 200
    assert asyncio.run(call([(b"user-agent", b"\x80")])).status_code == 200  # Ray does not decode it
