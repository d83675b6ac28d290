"""Bad input: property-based fuzzing (hypothesis) of every endpoint's body and headers, and the limits.

Whatever a client sends -- wrong types, huge and negative numbers, NaN and infinities, deep nesting, invalid
UTF-8, lone surrogates, control characters, empty and oversize prompts, bodies of several MB (declared or
chunked), wrong content types and methods, odd headers -- the answer is a 2xx or a 4xx whose JSON body says
what is wrong (`{"error": {"type", "message", "field"}}`), never a 5xx, and the server stays healthy with
no KV slot left in use.

- Fast: the real API (serving/server/api.py) over real ModelServices and Engines of tiny bundles, in-process
  (tests/inprocess_app.py). FUZZ_EXAMPLES (env KVSERVE_FUZZ_EXAMPLES) examples per endpoint.
- Slow: the same payloads over real HTTP against the reliability application on a real Ray Serve cluster
  (tests/reliability_cluster.py), plus malformed HTTP sent on a raw socket.
"""
from __future__ import annotations

import collections
import json
import os
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from inprocess_app import InProcessServer
from serving.engine.config import BatchingKnobs, ReplicaKnobs
from serving.server.config import Limits
from serving.server.schemas import CompletionRequest, GenerateRequest, TranslateRequest

ROOT = Path(__file__).resolve().parents[1]
FUZZ_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "60"))
FUZZ_DB = DirectoryBasedExampleDatabase(str(ROOT / ".hypothesis" / "examples"))
LIMITS = Limits(max_body_bytes=65_536, max_prompt_tokens=32, max_tokens=16, default_max_tokens=4, max_texts=4,
                max_beam_size=4, max_n_best=2, max_stop_strings=4, request_timeout_s=10)
ENDPOINTS = {"/v1/translate": TranslateRequest, "/v1/generate": GenerateRequest,
             "/v1/completions": CompletionRequest}
GET_PATHS = ("/v1/models", "/v2/health/live", "/v2/health/ready", "/metrics", "/docs", "/openapi.json",
             "/nothing", "/v1/", "/v1/generate/../models")

# -- strategies ---------------------------------------------------------------------------------------------
NASTY_NUMBERS = [0, -1, 1, 2, 4, 5, 8, 9, 10**6, -2**63, 2**63, 2**64 + 1, 10**40, -10**40, 0.5, -0.0, 1e-300,
                 5e-324, 1e308, float("nan"), float("inf"), float("-inf"), True, False]
NASTY_TEXT = ["", " ", "\x00", "\x00\x01\x1f\x7f", "\u202e\u200b", "\ud800", "a\udfffb", "🙂" * 10,
              "the quick brown fox", "fox " * 40, "x" * 3000, "\r\n\r\n", "\\u0000", '"}]}', "generate", "translate"]
chars = st.characters(exclude_categories=())  # every category, lone surrogates (Cs) included
texts = st.one_of(st.text(chars, max_size=40), st.sampled_from(NASTY_TEXT))
leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.sampled_from(NASTY_NUMBERS), texts)
anything = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(chars, max_size=6), inner, max_size=3), max_leaves=8)
small_ints = st.integers(-3, 12)
PLAUSIBLE = {
    "text": texts | st.lists(texts, max_size=6), "prompt": texts | st.lists(texts, max_size=6),
    "stop": texts | st.lists(texts, max_size=6), "model": st.sampled_from(["translate", "generate", "nope", ""]),
    "max_tokens": small_ints, "beam_size": small_ints, "n_best": small_ints, "n": small_ints,
    "best_of": small_ints, "top_k": st.integers(-2, 400), "seed": st.integers(-2, 2**64),
    "temperature": st.floats(-1, 6), "top_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.floats(-1, 11), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": anything}) | anything,
    "logit_bias": st.dictionaries(texts, leaves, max_size=2), "user": texts,
}


good_text = st.sampled_from(["the quick brown fox", "hello", "", "ünïcödé 🙂"]) | st.text(max_size=30)
VALID = {  # values the API accepts, so that fuzzed requests also get through to the engines
    "text": good_text | st.lists(good_text, min_size=1, max_size=3), "prompt": good_text,
    "stop": st.sampled_from(["x", ".", ["a", "b"]]), "model": st.sampled_from(["translate", "generate"]),
    "max_tokens": st.integers(1, 16), "beam_size": st.integers(1, 4), "n_best": st.integers(1, 2),
    "n": st.just(1), "best_of": st.just(1), "top_k": st.integers(0, 50), "seed": st.integers(0, 2**63 - 1),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "repetition_penalty": st.floats(0.5, 2),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}), "echo": st.just(False), "logprobs": st.none(), "suffix": st.none(),
    "presence_penalty": st.just(0.0), "frequency_penalty": st.just(0.0), "logit_bias": st.none(), "user": good_text,
}


def field_values(name: str) -> st.SearchStrategy:
    valid = VALID.get(name, anything)  # 10 : 3, so that a fair share of whole bodies is valid
    return st.one_of(*[valid] * 10, PLAUSIBLE.get(name, anything), st.sampled_from(NASTY_NUMBERS), anything)


def bodies(model: type) -> st.SearchStrategy:
    fields = model.model_fields
    required = {f: field_values(f) for f, info in fields.items() if info.is_required()}
    optional = {f: field_values(f) for f, info in fields.items() if not info.is_required()}
    typical = st.fixed_dictionaries(required, optional=optional)
    return st.one_of(typical, typical, st.fixed_dictionaries(required, optional={**optional, "bogus": anything}),
                     st.fixed_dictionaries({}, optional={**required, **optional}), anything)


CONTENT_TYPES = ["application/json"] * 8 + [None, "application/json; charset=utf-8", "application/json; charset=utf-16",
                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=xyz",
                 "application/xml", "application/vnd.api+json", "", "garbage/;;;="]
HEADER_NAMES = ["accept", "accept-encoding", "content-encoding", "user-agent", "x-request-id", "authorization",
                "x-forwarded-for", "cookie", "range", "expect"]
# h11 (the HTTP/1.1 client and server) refuses control characters and leading or trailing blanks itself.
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                        max_size=60).map(lambda v: v.strip(" \t"))


@st.composite
def payloads(draw: st.DrawFn, model: type) -> tuple[str, bytes | list[bytes]]:
    """(kind, body): JSON of a fuzzed body, or raw bytes, invalid UTF-8, deep nesting, a big or chunked body."""
    kind = draw(st.sampled_from(["json"] * 12 + ["bytes", "utf8", "deep", "big", "chunked"]))
    if kind == "json":
        text = json.dumps(draw(bodies(model)), allow_nan=True, ensure_ascii=draw(st.booleans()))
        return kind, text.encode("utf-8", "surrogatepass")  # a lone surrogate becomes invalid UTF-8 bytes
    if kind == "bytes":
        return kind, draw(st.binary(max_size=300))
    if kind == "utf8":
        text = json.dumps(draw(bodies(model)), allow_nan=True).encode()
        cut = draw(st.integers(0, len(text)))
        return kind, text[:cut] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + text[cut:]
    if kind == "deep":
        depth = draw(st.sampled_from([50, 900, 5_000, 30_000]))
        key = draw(st.sampled_from(list(model.model_fields)))
        return kind, f'{{"{key}": '.encode() + b"[" * depth + b"]" * depth + b"}"
    size = draw(st.sampled_from([LIMITS.max_body_bytes + 1, 2 * 2**20, 5 * 2**20]))
    body = b'{"prompt": "' + b"a" * size + b'", "text": "x", "model": "generate"}'
    if kind == "chunked":  # no Content-Length: the limit is enforced while reading
        return kind, [body[i:i + 65_536] for i in range(0, len(body), 65_536)]
    return kind, body


@st.composite
def requests(draw: st.DrawFn) -> dict:
    path = draw(st.sampled_from(list(ENDPOINTS)))
    kind, body = draw(payloads(ENDPOINTS[path]))
    headers = [(k.encode(), v.encode("latin-1")) for k, v in draw(st.dictionaries(
        st.sampled_from(HEADER_NAMES), header_values, max_size=3)).items()]
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    method = draw(st.sampled_from(["POST"] * 28 + ["GET", "PUT", "DELETE", "PATCH"]))
    return {"method": method, "path": path, "kind": kind, "body": body, "headers": headers}


# -- checks -------------------------------------------------------------------------------------------------
# Headers refused with a 400 before anything else is looked at (ours, and Ray's proxy, which cannot read them).
HEADER_FIELDS = ("x-request-id", "x-session-id", "serve_multiplexed_model_id")


def check_answer(r: httpx.Response, req: dict) -> None:
    """2xx, or a 4xx with a JSON error naming what is wrong; never a 5xx."""
    where = f"{req['method']} {req['path']} ({req['kind']}): {r.status_code} {r.text[:300]!r}"
    assert r.status_code < 500, where
    if req["kind"] in ("big", "chunked") and req["method"] == "POST":
        # too large, unless a header the request carried was refused first (before any of the body was read)
        sent = {name.decode("latin-1").lower() for name, _ in req["headers"]} & set(HEADER_FIELDS)
        assert r.status_code == 413 or (r.status_code == 400 and r.json()["error"].get("field") in sent), where
    if r.status_code < 400:
        kind = r.headers.get("content-type", "")
        if kind.startswith("text/event-stream"):
            assert r.text.rstrip().endswith("}") or r.text.rstrip().endswith("[DONE]"), where
        elif kind.startswith("application/json"):
            r.json()
        return
    assert r.headers.get("content-type", "").startswith("application/json"), where
    err = r.json()["error"]
    assert isinstance(err["type"], str) and err["type"], where
    assert isinstance(err["message"], str) and len(err["message"]) >= 10, where
    assert err["field"] is None or (isinstance(err["field"], str) and not err["field"].isdigit()), where
    if r.status_code in (429, 503):
        assert int(r.headers["retry-after"]) >= 1, where
    if r.status_code == 401:
        assert r.headers.get("www-authenticate") == "Bearer", where


def send(server: InProcessServer, req: dict) -> httpx.Response:
    body = req["body"]
    if isinstance(body, list):
        async def chunks():
            for c in body:
                yield c
        content = chunks()
    else:
        content = body
    return server.request(req["method"], req["path"], content=content, headers=req["headers"])


# -- fast: in-process ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    s = InProcessServer(LIMITS)
    yield s
    s.close()


def assert_healthy(server: InProcessServer) -> None:
    assert server.request("GET", "/v2/health/ready").status_code == 200
    r = server.request("POST", "/v1/generate", json={"prompt": "the quick", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    deadline = time.monotonic() + 5
    while any(server.slots_in_use().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.slots_in_use() == {"translate": 0, "generate": 0}


def _explicit(path: str, body: bytes, kind: str = "json") -> dict:  # tried first by `@example`: the reach check holds
    return {"method": "POST", "path": path, "kind": kind, "body": body, "headers": [(b"content-type", b"application/json")]}


def test_fuzz_every_endpoint_body_and_headers(server):
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=3 * FUZZ_EXAMPLES, deadline=None, database=FUZZ_DB,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(req=requests())
    @example(req=_explicit("/v1/generate", b'{"prompt": "hello", "max_tokens": 2}'))  # reaches the model: 200
    @example(req=_explicit("/v1/generate", b'{"prompt": "hi", "max_tokens": -1}'))  # a bad value: 422
    @example(req=_explicit("/v1/completions", b'{"prompt": "' + b"a" * 70_000 + b'"}', kind="big"))  # 413
    def run(req: dict) -> None:
        r = send(server, req)
        seen[r.status_code] += 1
        check_answer(r, req)
    run()
    print(f"FUZZ in-process statuses {dict(sorted(seen.items()))}")
    assert {200, 413, 422} <= set(seen), seen  # the fuzzer reached the models and both kinds of refusal
    assert_healthy(server)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=FUZZ_DB, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(GET_PATHS), method=st.sampled_from(["GET", "GET", "POST", "HEAD", "OPTIONS", "TRACE"]),
       headers=st.dictionaries(st.sampled_from(HEADER_NAMES), header_values, max_size=4),
       query=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40))
def test_fuzz_other_routes_methods_and_headers(server, path, method, headers, query):
    req = {"method": method, "path": path, "kind": "route", "body": b"",
           "headers": [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]}
    r = server.request(method, path, params={"q": query}, headers=req["headers"])
    if method == "HEAD":
        assert r.status_code < 500, (path, r.status_code)
        return
    check_answer(r, req)


@pytest.mark.parametrize("path,body,status,field", [
    ("/v1/generate", {"prompt": "a\ud800b"}, 422, "prompt"),  # a lone surrogate crashed the tokenizer (500)
    ("/v1/translate", {"text": ["ok", "\udfff"]}, 422, "text.1"),
    ("/v1/completions", {"model": "generate", "prompt": "x", "stop": ["\ud800"]}, 422, "stop.0"),
    ("/v1/generate", {"prompt": "x", "\ud800": 1}, 422, None),  # a key that cannot be UTF-8 encoded
    ("/v1/generate", {"prompt": "x", "temperature": float("nan")}, 422, "temperature"),
    ("/v1/generate", {"prompt": "x", "top_k": 10**40}, 422, "top_k"),
    ("/v1/generate", {"prompt": "x", "max_tokens": -(2**63)}, 422, "max_tokens"),
    ("/v1/generate", {"prompt": ["x"]}, 422, "prompt"),
    ("/v1/generate", {"prompt": None}, 422, "prompt"),
    ("/v1/generate", [], 422, None),
])
def test_known_bad_bodies(server, path, body, status, field):
    """Cases the fuzzer found or must keep finding; each answers a 4xx naming the field."""
    raw = json.dumps(body, allow_nan=True).encode()
    r = server.request("POST", path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if field is not None:
        assert err["field"] == field, err
    assert err["message"]


@pytest.mark.parametrize("raw,field,needle", [
    (b'{"prompt": "x",}', "body", "not valid JSON"),
    (b'{"prompt": "\xff"}', "body", "could not be parsed"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body", "could not be parsed"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "body", "could not be parsed"),
])
def test_unparseable_bodies_say_why(server, raw, field, needle):
    r = server.request("POST", "/v1/generate", content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["field"] == field and needle in err["message"], err


# -- limits: every one from config, enforced with a message naming the value and the limit ------------------------
def _prompt_of(server: InProcessServer, n_tokens: int) -> str:
    from model.tokenizer import Tokenizer
    from export.bundle import load_bundle
    from engine_bundle import cached_bundle

    tok = Tokenizer.load(load_bundle(cached_bundle("generate")[0]).tokenizer_path)
    text = " ".join(["fox"] * n_tokens)
    while len(tok.encode(text)) > n_tokens:
        text = text[:-4]
    assert len(tok.encode(text)) == n_tokens
    return text


@pytest.mark.parametrize("name,path,over,at,status,field", [
    ("max_tokens", "/v1/generate", {"prompt": "x", "max_tokens": 17}, {"prompt": "x", "max_tokens": 16}, 422,
     "max_tokens"),
    ("max_texts", "/v1/translate", {"text": ["a"] * 5}, {"text": ["a"] * 4}, 413, "text"),
    ("max_beam_size", "/v1/translate", {"text": "a", "beam_size": 5}, {"text": "a", "beam_size": 4}, 422,
     "beam_size"),
    ("max_n_best", "/v1/translate", {"text": "a", "beam_size": 4, "n_best": 3},
     {"text": "a", "beam_size": 4, "n_best": 2}, 422, "n_best"),
    ("max_stop_strings", "/v1/generate", {"prompt": "x", "stop": list("abcde")}, {"prompt": "x", "stop": list("abcd")},
     422, "stop"),
])
def test_limits_come_from_config(server, name, path, over, at, status, field):
    limit = getattr(LIMITS, name)
    r = server.request("POST", path, json=over)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and str(limit) in err["message"], err
    ok = server.request("POST", path, json={**at, "max_tokens": 2} if "max_tokens" not in at else at)
    assert ok.status_code == 200, ok.text


def test_prompt_token_and_body_limits(server):
    at = server.request("POST", "/v1/generate", json={"prompt": _prompt_of(server, 32), "max_tokens": 2})
    assert at.status_code == 200, at.text
    over = server.request("POST", "/v1/generate", json={"prompt": _prompt_of(server, 32) + " fox fox"})
    assert over.status_code == 413 and over.json()["error"]["field"] == "prompt"
    assert "limit is 32" in over.json()["error"]["message"]
    big = server.request("POST", "/v1/generate", content=b'{"prompt": "' + b"a" * 65_536 + b'"}',
                         headers={"content-type": "application/json"})
    assert big.status_code == 413 and "65536" in big.json()["error"]["message"]


def test_every_limit_is_documented_with_its_default():
    """docs/reliability.md's limits table lists every Limits field (and the engine/Ray bounds) with its default."""
    doc = (ROOT / "docs" / "reliability.md").read_text()
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+) \|", doc, re.M)}
    for model in (Limits, BatchingKnobs, ReplicaKnobs):
        for name, info in model.model_fields.items():
            if model is not Limits and name not in ("max_waiting", "max_slots", "max_tokens_per_step"):
                continue
            assert name in rows, f"docs/reliability.md has no row for `{name}`"
            default = info.default
            want = "None" if default is None else str(default)
            assert rows[name].replace(",", "").replace("`", "") == want, (name, rows[name], want)
    for ray_bound in ("max_ongoing_requests", "max_queued_requests"):
        assert ray_bound in rows


# -- slow: the real cluster ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fuzz_against_the_cluster(rel):
    """The same payloads over real HTTP (Ray's proxy, the ingress replica, model replicas)."""
    with httpx.Client(base_url=rel.base, timeout=30) as client:
        @settings(max_examples=max(60, FUZZ_EXAMPLES), deadline=None, database=FUZZ_DB,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(req=requests(), authorized=st.booleans())
        def run(req: dict, authorized: bool) -> None:
            headers = [h for h in req["headers"] if h[0] != b"authorization"]
            if authorized:
                headers.append((b"authorization", f"Bearer {rel.api_key}".encode()))
            body = req["body"]
            content = iter(body) if isinstance(body, list) else body
            try:
                r = client.request(req["method"], req["path"], content=content, headers=headers)
            except httpx.TransportError:
                # The server answered (413 or 401) without reading a body of megabytes and closed the
                # connection while the client was still sending it: a refusal, not a failure.
                assert req["kind"] in ("big", "chunked"), req["kind"]
                return
            if not authorized:  # refused: no key, or (in Ray's proxy, before the key) a header Ray cannot read
                assert r.status_code == 401 or (r.status_code == 400 and r.json()["error"]["field"] in HEADER_FIELDS), (
                    r.status_code, r.text[:200])
            check_answer(r, {**req, "kind": req["kind"] if authorized else "unauthorized"})
        run()
    _assert_cluster_healthy(rel)


MALFORMED_HTTP = [b"GARBAGE\r\n\r\n", b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
                  b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nContent-Length: 20\r\n\r\n{}",
                  b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                  b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
                  b"GET /\x00\xff HTTP/1.1\r\nHost: x\r\n\r\n"]


@pytest.mark.slow
@pytest.mark.parametrize("raw", MALFORMED_HTTP, ids=range(len(MALFORMED_HTTP)))
def test_malformed_http_is_refused_by_the_proxy(rel, raw):
    """Malformed HTTP never reaches the app; the proxy answers a 4xx or closes the connection, never a 5xx."""
    port = int(rel.base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        try:
            reply = s.recv(4096)
        except (ConnectionResetError, socket.timeout):
            reply = b""
    status = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
    assert status is None or int(status.group(1)) < 500, reply[:200]
    _assert_cluster_healthy(rel)


def _assert_cluster_healthy(rel) -> None:
    """Ready, serving, and no KV slot left in use on any replica of any model."""
    from reliability_cluster import replica_infos, wait_for

    with rel.client() as client:
        assert client.get("/v2/health/ready").status_code == 200
        assert client.post("/v1/generate", json={"prompt": "the", "max_tokens": 2}).status_code == 200
    for model in (m["name"] for m in rel.raw["applications"][0]["args"]["models"]):
        def idle() -> bool:
            return all(info["engine"]["slots_used"] == 0 for info in replica_infos(model, 6).values())
        assert wait_for(idle, 10, 0.2), (model, replica_infos(model, 6))
