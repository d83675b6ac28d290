"""Repeated requests answered before the API's framework: `AnswerFront`, the HTTP side of the response cache.

A cache hit through the routes costs the replica's event loop about 0.65 ms, most of it FastAPI's routing, the
body's validation, the route and the response model's serialization (py-spy of the ingress replica at 1,500
hits/s), and in a colocated replica that is time the engine's step thread waits for the GIL: the misses beside the
hits ran 14% fewer engine steps per second. So the whole answer of a request whose every text came from (or went
into) a model's response cache is kept too, keyed by the request's exact bytes (path, Content-Type, the client's
timeout header, body), in the same model's `ResponseCache` (its bounds, LRU and metrics; a replica holds one
version, so a new version never sees an old answer). The next request with the same bytes gets that answer with
fresh timings and `X-Cache: hit`, without the routes; everything else, and every first request, goes on to them.

Sits inside the API key check, the drain gate, the request metrics and the request's span (api.py `create_app`
stacks it innermost), so a hit is authenticated, counted and traced like any answer. Only what the route marked
storable is kept (`mark_storable`: every text answered deterministically and to its end, by a model colocated in
this replica that has the only route to it, so a canary's weight or a pinned version is never bypassed); a
chunked body, a body over MAX_KEY_BYTES or a `Cache-Control: no-cache` request never reaches the cache here.

Does not own: which answers are deterministic (serving/server/response_cache.py), the answers' shapes (api.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from serving.server.asgi import app_path
from serving.server.response_cache import ResponseCache, cacheable
from serving.server.text_types import TextRequest, TextResult

PATHS = ("/v1/translate", "/v1/generate")  # answers whose bodies carry nothing per request but their timings
MAX_KEY_BYTES = 16384  # longer bodies go to the routes: their key would cost more than it saves
KEPT_HEADERS = (b"content-type", b"x-model-version")  # an answer's own headers; the rest are per request or added
STORE_KEY = "answer_cache"  # scope["state"] key: the ResponseCache the route's answer may be kept in, and its texts


@dataclass(frozen=True)
class AnswerKey:
    """A request's exact bytes (its own type: never equal to a text entry's key in the same cache)."""

    path: str
    content_type: bytes
    timeout: bytes
    body: bytes


@dataclass(frozen=True)
class Answer:
    """A kept answer: its JSON without the timings, its headers, and the texts it answers (counted as hits)."""

    payload: dict[str, Any]
    headers: tuple[tuple[bytes, bytes], ...]
    texts: int
    version: str
    size: int


def mark_storable(
    scope: MutableMapping[str, Any], backend: Any, model: str, reqs: list[TextRequest], results: list[TextResult]
) -> None:
    """Called by a route with its texts' answers: the whole answer may be kept when each text is one the model's
    response cache keeps (deterministic, not bypassed, run to its end) and the backend names the cache for it."""
    if all(cacheable(q, r) for q, r in zip(reqs, results, strict=True)):
        cache = getattr(backend, "answer_cache", lambda _: None)(model)  # a Backend may keep no answers
        if cache is not None:
            scope.setdefault("state", {})[STORE_KEY] = (cache, len(reqs))


class AnswerFront:
    """ASGI middleware: a repeated request's kept answer, else the app (whose storable answer it then keeps)."""

    def __init__(self, app: Callable, caches: list[ResponseCache], routes: dict[str, Any]) -> None:
        """`caches`: the response caches of this replica's models; `routes`: path -> the app's route object (the
        request metrics label a hit by its route, as the router would have set it)."""
        self.app, self.caches, self.routes = app, caches, routes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        key = _key_of(scope) if self.caches and scope["type"] == "http" and scope.get("method") == "POST" else None
        if key is None:
            return await self.app(scope, receive, send)
        started = time.monotonic()
        body, messages = await _read_body(receive)
        if body is None:  # the client went away, or a chunked body: the routes answer it as they would
            return await self.app(scope, _replay(messages, receive), send)
        key = AnswerKey(key.path, key.content_type, key.timeout, body)
        for cache in self.caches:
            hit = cache.get_answer(key)
            if isinstance(hit, Answer):
                return await self._answer(scope, send, hit, started)
        await self._pass_on(scope, _replay(messages, receive), send, key)

    async def _answer(self, scope: dict, send: Callable, hit: Answer, started: float) -> None:
        state = scope.setdefault("state", {})
        state["model"], state["version"] = hit.payload.get("model", "none"), hit.version
        scope["route"] = self.routes.get(app_path(scope))
        arrival = state.get("arrival")
        timings = {
            "queue_s": 0.0,
            "ttft_s": 0.0,
            "server_ttft_s": time.time() - arrival if arrival is not None else None,
            "total_s": time.monotonic() - started,
        }
        body = _dumps({**hit.payload, "timings": timings})
        headers = [(b"content-length", str(len(body)).encode()), *hit.headers, (b"x-cache", b"hit")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _pass_on(self, scope: dict, receive: Callable, send: Callable, key: AnswerKey) -> None:
        """The app's answer; kept when the route marked it storable and it is a 200 with a JSON body."""
        start: dict | None = None
        chunks: list[bytes] = []

        async def keep(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] == 200:
                if STORE_KEY in scope.get("state", {}):
                    start = message
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    _store(scope, key, start, b"".join(chunks))
            await send(message)

        await self.app(scope, receive, keep)


def _key_of(scope: dict) -> AnswerKey | None:
    """The request's key without its body, or None when it never uses the kept answers."""
    path = app_path(scope)
    if path not in PATHS:
        return None
    content_type = timeout = b""
    length = None
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            length = value
        elif name == b"content-type":
            content_type = value
        elif name == b"x-request-timeout-seconds":
            timeout = value
        elif name == b"cache-control" and b"no-cache" in value.lower():
            return None
    if length is None or not length.isdigit() or int(length) > MAX_KEY_BYTES:
        return None
    return AnswerKey(path, content_type, timeout, b"")


async def _read_body(receive: Callable) -> tuple[bytes | None, list[dict]]:
    """The whole body (None if the client disconnected first) and the messages read, to hand on."""
    messages, parts = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return None, messages
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), messages


def _replay(messages: list[dict], receive: Callable) -> Callable:
    """A receive that gives `messages` again, then the client's own."""
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed


def _store(scope: dict, key: AnswerKey, start: dict, body: bytes) -> None:
    cache, texts = scope["state"][STORE_KEY]
    headers = tuple((k, v) for k, v in start.get("headers") or () if k in KEPT_HEADERS)
    try:
        payload = json.loads(body)
    except ValueError:
        return
    if not isinstance(payload, dict) or "timings" not in payload:
        return
    payload.pop("timings")
    version = scope["state"].get("version", "none")
    size = len(key.body) + 2 * len(body) + sum(len(k) + len(v) for k, v in headers)
    cache.put_answer(key, Answer(payload, headers, texts, version, size))


def _dumps(payload: dict) -> bytes:
    """As FastAPI's JSONResponse renders a route's answer."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")
