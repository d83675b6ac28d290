"""Unit tests of the HTTP API's refusals: every error a route, the middleware (API key, drain, body limit,
Ray's proxy guard) or the engine produces comes back with the status of serving/server/errors.py's table,
the one body shape and the field at fault.

Same app and fakes as tests/test_api.py (FakeEngine under real ModelServices, in-process); the real engines'
refusals are in tests/test_api_engine.py, the table itself in tests/test_errors.py.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from fake_engine import FakeEngine
from serving.engine.types import SamplingParams
from serving.server.config import Limits
from serving.server.drain import Drain
from serving.server.errors import ErrorKind, ServiceError
from serving.server.proxy_guard import RayHeaderGuard
from serving.server.service import ModelService, TextRequest
from test_api import REPLY, assert_error, make_client, tok  # noqa: F401  (tok: the shared tokenizer fixture)


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
async def test_translate_errors(tok, body, field, status):
    client, _ = make_client(tok)
    err = assert_error(await client.post("/v1/translate", json=body), status, field)
    if body.get("beam_size") == 9:
        assert "8" in err["message"] and "9" in err["message"]  # names the value and the limit


async def test_configured_beam_limits(tok):
    client, _ = make_client(tok, limits=Limits(max_prompt_tokens=40, max_tokens=48, max_beam_size=2, max_n_best=1))
    err = assert_error(await client.post("/v1/translate", json={"text": "x", "beam_size": 3}), 422, "beam_size")
    assert "limit 2" in err["message"]
    assert_error(await client.post("/v1/translate", json={"text": "x", "beam_size": 2, "n_best": 2}), 422, "n_best")


async def test_malformed_json_is_422_not_500(tok):
    client, _ = make_client(tok)
    r = await client.post("/v1/translate", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 422)


async def test_body_over_limit_is_413(tok):
    client, _ = make_client(tok, limits=Limits(max_body_bytes=256))
    r = await client.post("/v1/generate", json={"prompt": "x" * 1000})
    err = assert_error(r, 413, "body")
    assert "256" in err["message"]


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
async def test_generate_validation(tok, body, field):
    client, _ = make_client(tok)
    assert_error(await client.post("/v1/generate", json=body), 422, field)


async def test_prompt_over_token_limit_is_413(tok):
    client, _ = make_client(tok)
    for stream in (False, True):
        r = await client.post("/v1/generate", json={"prompt": "word " * 60, "stream": stream})
        err = assert_error(r, 413, "prompt")
        assert "40" in err["message"]


async def test_engine_invalid_request_too_large_is_413(tok):
    client, _ = make_client(tok)  # FakeEngine max_len 64: 1 bos + 21 tokens + 48 new > 64 (prompt limit: 40)
    err = assert_error(await client.post("/v1/generate", json={"prompt": "word " * 10, "max_tokens": 48}), 413,
                       "max_tokens")  # the engine's max_new_tokens, by the API's name
    assert "KV cache" in err["message"]


async def test_the_service_names_the_field_an_engine_refuses(tok):
    engine = FakeEngine(tok, REPLY)  # decoder-only: no beam search
    service = ModelService("generate", engine, tok, 40)
    with pytest.raises(ServiceError) as e:
        await service.complete(TextRequest("hi", SamplingParams(beam_size=2), deadline_wall=9e18))
    assert e.value.kind == ErrorKind.INVALID and e.value.field == "beam_size"
    engine.capacity = 0
    with pytest.raises(ServiceError) as e:
        await service.complete(TextRequest("hi", SamplingParams(), deadline_wall=9e18))
    assert e.value.kind == ErrorKind.OVERLOADED and e.value.retry_after_s == 2.0


async def test_overload_is_429_with_retry_after(tok):
    client, _ = make_client(tok, capacity=0)
    for path, body in (("/v1/generate", {"prompt": "x"}), ("/v1/generate", {"prompt": "x", "stream": True}),
                       ("/v1/translate", {"text": "x"})):
        r = await client.post(path, json=body)
        assert_error(r, 429)
        assert r.headers["retry-after"] == "2"
    text = (await client.get("/metrics")).text
    assert 'kvserve_rejections_total{model="generate",reason="queue_full"} 2.0' in text
    assert 'kvserve_rejections_total{model="translate",reason="queue_full"} 1.0' in text


async def test_deadline_is_504(tok):
    limits = Limits(max_prompt_tokens=40, max_tokens=48, default_max_tokens=32, request_timeout_s=0.05)
    client, _ = make_client(tok, limits=limits, delay_s=0.02)
    assert_error(await client.post("/v1/generate", json={"prompt": "x"}), 504)
    assert_error(await client.post("/v1/translate", json={"text": "x"}), 504)


@pytest.mark.parametrize("body,field", [
    ({"stop_token_ids": [1.5]}, "stop_token_ids.0"), ({"stop_token_ids": [None]}, "stop_token_ids.0"),
    ({"stop_token_ids": [7] * 17}, "stop_token_ids"),
])
async def test_completions_stop_token_ids_validation(tok, body, field):
    client, _ = make_client(tok)
    r = await client.post("/v1/completions", json={"model": "generate", "prompt": "x", **body})
    assert_error(r, 422, field)


# -- middleware: API key, drain ---------------------------------------------------------------------------
async def test_api_key(tok):
    client, _ = make_client(tok, api_key="s3cret")
    assert_error(await client.post("/v1/generate", json={"prompt": "x"}), 401)
    r = await client.post("/v1/generate", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 200  # probes need no key


async def test_draining_is_503_with_retry_after(tok):
    drain = Drain()
    client, _ = make_client(tok, drain=drain)
    drain.set_draining(True)
    r = await client.post("/v1/generate", json={"prompt": "x"})
    err = assert_error(r, 503)
    assert err["type"] == "unavailable" and err["field"] is None and "draining" in err["message"]
    assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
    assert (await client.get("/v2/health/live")).status_code == 200  # liveness still answers
    drain.set_draining(False)
    assert (await client.post("/v1/generate", json={"prompt": "x"})).status_code == 200


# -- Ray's proxy -----------------------------------------------------------------------------------------
def test_ray_proxy_guard_refuses_headers_ray_would_choke_on():
    """Ray's proxy decodes x-request-id & co. as UTF-8 (a bare 500 otherwise): serving/server/proxy_guard.py says 400."""
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
