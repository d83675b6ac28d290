"""The HTTP API (FastAPI): the app, its routes, the server's limits on a request, and its middleware.

Routes: POST /v1/translate, POST /v1/generate (SSE with "stream": true), POST /v1/completions and
GET /v1/models (OpenAI-compatible), GET /v2/health/live, GET /v2/health/ready (every model can serve),
GET /v2/models/{name}/ready (KServe v2: that model can serve), GET /metrics.

Owns: building `SamplingParams` and `TextRequest`s from the bodies (a body's `model` may pin a version:
`generate@3f2a9c0d1e2b`), the X-Model-Version header of every answer (the version of the replica that
answered), the limits from the server's config
(max_tokens, texts per request, beam size, stop strings; `BodyLimit` for the body's bytes), the response
shapes, and per-request metrics (`RequestMetrics`). The app talks to models through a `Backend`
(serving/server/ingress.py's Ray handles in production, in-process `ModelService`s in tests), so this
module knows nothing about Ray.

Does not own: errors -- a route raises `ServiceError`, and serving/server/errors.py, the one place where
errors become statuses, answers it (and validation errors, 404/405 and unexpected exceptions). Bodies are in
serving/server/schemas.py; text handling (stop strings, usage, timings) in serving/server/service.py; the API
key check in serving/server/auth.py; refusing new requests while shutting down in serving/server/drain.py.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from serving.server.stream import DEADLINE_GRACE_S, completion_events, generate_events, openai_finish, start_stream
from serving.server.asgi import is_api_request
from serving.server.auth import BearerAuth, key_sha256, open_paths
from serving.server.config import Limits
from serving.server.drain import DRAINING_MESSAGE, RETRY_AFTER_S, Drain, DrainGate
from serving.server.errors import ErrorKind, ServiceError, error_response, install_error_handlers
from serving.server.metrics import Recorder
from serving.server.schemas import (CompletionRequest, GenerateRequest, GenerateResponse, TranslateRequest,
                             TranslateResponse)
from serving.server.service import StreamPiece, TextRequest, TextResult, answering_version
from serving.server.versions import ServedVersion, split_model_name
from serving.engine.types import SamplingParams


METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
VERSION_HEADER = "X-Model-Version"  # the version(s) of the model that answered, on every /v1 answer


class Backend(Protocol):
    def model_tasks(self) -> dict[str, str]: ...  # model name -> "translate" | "generate"
    async def model_versions(self) -> list[ServedVersion]: ...  # every bundle served now, by model
    # `complete` and `stream` pick the deployment by weight, or the one serving `req.version` (404 if none).
    async def complete(self, model: str, req: TextRequest) -> TextResult: ...
    # Pieces in chunks (serving/server/chunks.py), the TextResult last.
    def stream(self, model: str, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult]]: ...
    async def models_ready(self) -> dict[str, bool]: ...  # model name -> at least one replica can serve it
    async def metrics_text(self) -> str: ...  # may hand out the same str object while it is fresh


def create_app(backend: Backend, limits: Limits, recorder: Recorder, api_key: str | None = None,
               drain: Drain | None = None, metrics_require_key: bool = False) -> FastAPI:
    """The API. Middleware, outermost first: metrics (sees every /v1 answer, 401 and 503 included), drain
    gate, API key (checked before the body is read; /metrics too if `metrics_require_key`), body limit."""
    app = FastAPI(title="kvserve", version="0.1.0",
                  description="Transformer translation and generation on ONNX Runtime behind Ray Serve.")
    drain = drain if drain is not None else Drain()
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(BearerAuth, key_sha256=key_sha256(api_key), open_paths=open_paths(metrics_require_key))
    app.add_middleware(DrainGate, drain=drain)
    app.add_middleware(RequestMetrics, recorder=recorder)
    install_error_handlers(app, recorder)
    routes = _Routes(backend, limits, drain, METRICS_CACHE_CONTROL[metrics_require_key])
    app.post("/v1/translate", response_model=TranslateResponse)(routes.translate)
    app.post("/v1/generate", response_model=GenerateResponse)(routes.generate)
    app.post("/v1/completions")(routes.completions)
    app.get("/v1/models")(routes.models)
    app.get("/v2/health/live")(routes.live)
    app.get("/v2/health/ready")(routes.ready)
    app.get("/v2/models/{name}/ready")(routes.model_ready)
    app.get("/metrics", response_class=PlainTextResponse)(routes.metrics)
    return app


# /metrics open to anyone: a shared cache (the HAProxy in front, serving/server/haproxy.py) may answer it for 1 s,
# as fresh as the backend's own scrape cache, so a flood of scrapers never reaches the ingress more than once a
# second. Behind the key: no cache keeps or hands out an answer.
METRICS_CACHE_CONTROL = {False: "public, max-age=1", True: "private, no-store"}


class _Routes:
    def __init__(self, backend: Backend, limits: Limits, drain: Drain, metrics_cache_control: str) -> None:
        self.backend, self.limits, self.drain = backend, limits, drain
        self._metrics_headers = {"Vary": "Accept-Encoding", "Cache-Control": metrics_cache_control}
        self._gzipped: tuple[str | None, bytes] = (None, b"")  # (exposition, its gzip)

    async def translate(self, body: TranslateRequest, request: Request, response: Response) -> dict:
        model, version = self._resolve(body.model, "translate", request)
        texts = [body.text] if isinstance(body.text, str) else body.text
        if len(texts) > self.limits.max_texts:
            raise ServiceError(ErrorKind.TOO_LARGE, f"text has {len(texts)} entries; the limit is "
                               f"{self.limits.max_texts} per request. Split the list.", field="text")
        for name, value, limit in (("beam_size", body.beam_size, self.limits.max_beam_size),
                                   ("n_best", body.n_best or 1, self.limits.max_n_best)):
            if value > limit:
                raise ServiceError(ErrorKind.INVALID, f"{name}={value} exceeds this server's limit {limit}",
                                   field=name)
        params = SamplingParams(max_new_tokens=self._max_tokens(body.max_tokens), beam_size=body.beam_size,
                                n_best=body.n_best or 1, length_penalty=body.length_penalty)
        deadline, started = self._deadline(), time.monotonic()
        reqs = [TextRequest(t, params, deadline, field="text" if isinstance(body.text, str) else f"text[{i}]",
                            version=version) for i, t in enumerate(texts)]
        results = await _gather([self._complete(model, r) for r in reqs])
        _name_versions(request, response, results)
        return {"model": model, "usage": _usage(results), "timings": _timings(results, started),
                "translations": [_translation(r, body.n_best is not None) for r in results]}

    async def generate(self, body: GenerateRequest, request: Request, response: Response) -> Any:
        model, version = self._resolve(body.model, "generate", request)
        stops = _stops(body.stop, self.limits)
        params = SamplingParams(max_new_tokens=self._max_tokens(body.max_tokens), temperature=body.temperature,
                                top_k=body.top_k, top_p=body.top_p, repetition_penalty=body.repetition_penalty,
                                seed=body.seed, stop_strings=stops, stop_token_ids=tuple(body.stop_token_ids or ()),
                                ignore_eos=body.ignore_eos)
        treq = TextRequest(body.prompt, params, self._deadline(), version=version)
        started = time.monotonic()
        if body.stream:
            first, rest = await start_stream(self.backend.stream(model, treq), treq.deadline_wall)
            return _sse(generate_events(first, rest, started, treq.deadline_wall), _stream_version(request, first))
        r = await self._complete(model, treq)
        _name_versions(request, response, [r])
        return {"model": model, "text": r.text, "finish_reason": r.finish_reason,
                "usage": _usage([r]), "timings": _timings([r], started)}

    async def completions(self, body: CompletionRequest, request: Request, response: Response) -> Any:
        model, version = self._resolve(body.model, None, request)
        params = SamplingParams(max_new_tokens=self._max_tokens(body.max_tokens), temperature=body.temperature,
                                top_p=body.top_p, seed=body.seed, stop_strings=_stops(body.stop, self.limits),
                                stop_token_ids=tuple(body.stop_token_ids or ()))
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) > self.limits.max_texts:
            raise ServiceError(ErrorKind.TOO_LARGE, f"prompt has {len(prompts)} entries; the limit is "
                               f"{self.limits.max_texts}", field="prompt")
        deadline, cid, created = self._deadline(), f"cmpl-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            treq = TextRequest(prompts[0], params, deadline, version=version)
            first, rest = await start_stream(self.backend.stream(model, treq), deadline)
            usage = bool((body.stream_options or {}).get("include_usage"))
            return _sse(completion_events(first, rest, cid, created, model, usage, deadline),
                        _stream_version(request, first))
        results = await _gather([self._complete(model, TextRequest(p, params, deadline, version=version))
                                 for p in prompts])
        _name_versions(request, response, results)
        choices = [{"text": r.text, "index": i, "logprobs": None, "finish_reason": openai_finish(r.finish_reason)}
                   for i, r in enumerate(results)]
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(results)}

    async def models(self) -> dict:
        """One entry per model (its stable version; `versions` lists every bundle served with its share of the
        traffic), then one per served version, `model@version`, which a request may name to pin it."""
        served = await self.backend.model_versions()
        data = []
        for name, task in self.backend.model_tasks().items():
            mine = sorted((s for s in served if s.model == name), key=lambda s: -s.weight)
            entry = {"id": name, "object": "model", "created": mine[0].created if mine else 0, "owned_by": "kvserve",
                     "task": task, "version": mine[0].version if mine else None,
                     "versions": [{"version": s.version, "created": s.created, "weight": s.weight} for s in mine]}
            data.append(entry)
            data += [{"id": f"{name}@{s.version}", "object": "model", "created": s.created, "owned_by": "kvserve",
                      "task": task, "version": s.version, "parent": name} for s in mine]
        return {"object": "list", "data": data}

    async def live(self) -> dict:
        return {"status": "live"}

    async def ready(self) -> JSONResponse:
        """200 while every model has a replica that can serve (one dead replica of two does not count)."""
        if self.drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        not_ready = sorted(name for name, ok in (await self.backend.models_ready()).items() if not ok)
        if not_ready:
            return JSONResponse({"status": "not_ready", "not_ready": not_ready}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def model_ready(self, name: str) -> dict:
        """KServe v2 model readiness: 200 while at least one replica of the model can serve, else 503."""
        tasks = self.backend.model_tasks()
        if name not in tasks:
            raise ServiceError(ErrorKind.NOT_FOUND, f"model {name[:120]!r} is not served; models: {sorted(tasks)}",
                               field="name")
        if self.drain.draining:
            raise ServiceError(ErrorKind.UNAVAILABLE, DRAINING_MESSAGE, retry_after_s=RETRY_AFTER_S)
        if not (await self.backend.models_ready()).get(name, False):
            raise ServiceError(ErrorKind.UNAVAILABLE, f"model {name!r} has no replica that can serve now (starting, "
                               f"being replaced or failed); retry later", retry_after_s=1.0)
        return {"name": name, "ready": True}

    async def metrics(self, request: Request) -> Response:
        """The backend's exposition (it caches it), gzipped when the client accepts it, as Prometheus does:
        ~20x fewer bytes through Ray's proxy. The gzip is made once per exposition the backend hands out."""
        text = await self.backend.metrics_text()
        headers = self._metrics_headers
        if "gzip" not in request.headers.get("accept-encoding", ""):
            return Response(text, media_type=METRICS_TYPE, headers=headers)
        if self._gzipped[0] is not text:
            self._gzipped = (text, gzip.compress(text.encode(), 6))
        return Response(self._gzipped[1], media_type=METRICS_TYPE, headers={**headers, "Content-Encoding": "gzip"})

    # -- helpers --------------------------------------------------------------------------------------
    def _resolve(self, name: str | None, task: str | None, request: Request) -> tuple[str, str | None]:
        """(model, version or None) a request names: 'generate', 'generate@3f2a9c0d1e2b' or nothing (the task's
        first model)."""
        tasks, version = self.backend.model_tasks(), None
        if name is not None:
            name, version = split_model_name(name)
            if version == "":
                raise ServiceError(ErrorKind.INVALID, f"model {name + '@'!r} names no version; use 'model' or "
                                   f"'model@VERSION' (GET /v1/models lists them)", field="model")
        if name is None:
            names = [n for n, t in tasks.items() if t == task]
            if not names:
                raise ServiceError(ErrorKind.NOT_FOUND, f"no {task} model is served", field="model")
            name = names[0]
        if name not in tasks:
            raise ServiceError(ErrorKind.NOT_FOUND, f"model {name!r} is not served; models: {sorted(tasks)}",
                               field="model")
        if task is not None and tasks[name] != task:
            raise ServiceError(ErrorKind.INVALID, f"model {name!r} is a {tasks[name]} model; this endpoint "
                               f"needs a {task} model", field="model")
        request.state.model = name
        return name, version

    def _max_tokens(self, asked: int | None) -> int:
        if asked is None:
            return self.limits.default_tokens
        if asked > self.limits.max_tokens:
            raise ServiceError(ErrorKind.INVALID, f"max_tokens={asked} exceeds the limit "
                               f"{self.limits.max_tokens}; ask for fewer", field="max_tokens")
        return asked

    def _deadline(self) -> float:
        return time.time() + self.limits.request_timeout_s

    async def _complete(self, model: str, req: TextRequest) -> TextResult:
        timeout = req.deadline_wall - time.time() + DEADLINE_GRACE_S
        try:
            return await asyncio.wait_for(self.backend.complete(model, req), timeout)
        except asyncio.TimeoutError:
            raise ServiceError(ErrorKind.DEADLINE, f"request passed its deadline of "
                               f"{self.limits.request_timeout_s:.0f}s") from None


def _name_versions(request: Request, response: Response, results: list[TextResult]) -> None:
    """X-Model-Version: the version that answered (several, comma-separated, if a rollout split the texts)."""
    versions = ",".join(sorted({r.version for r in results if r.version}))
    if versions:
        response.headers[VERSION_HEADER] = request.state.version = versions


def _stream_version(request: Request, first: list | None) -> dict[str, str]:
    """The headers of a stream: the version its first chunk names."""
    version = next((v for v in map(answering_version, first or []) if v), "")
    if version:
        request.state.version = version
    return {VERSION_HEADER: version} if version else {}


def _stops(stop: str | list[str] | None, limits: Limits) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > limits.max_stop_strings:
        raise ServiceError(ErrorKind.INVALID, f"stop has {len(stops)} strings; the limit is "
                           f"{limits.max_stop_strings}", field="stop")
    if any(not s for s in stops):
        raise ServiceError(ErrorKind.INVALID, "stop strings must not be empty", field="stop")
    return stops


async def _gather(coros: list) -> list:
    """All results, or the first error with the other calls cancelled (py3.10: no TaskGroup)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _usage(results: list[TextResult]) -> dict:
    p, c = sum(r.prompt_tokens for r in results), sum(r.completion_tokens for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _timings(results: list[TextResult], started: float) -> dict:
    queue = [r.queue_s for r in results if r.queue_s is not None]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    return {"queue_s": max(queue) if queue else None, "ttft_s": max(ttft) if ttft else None,
            "total_s": time.monotonic() - started}


def _translation(r: TextResult, with_n_best: bool) -> dict:
    out: dict[str, Any] = {"text": r.text, "finish_reason": r.finish_reason}
    if with_n_best:
        out["n_best"] = [{"text": t, "score": s} for t, s in r.n_best] or [{"text": r.text, "score": 0.0}]
    return out


def _sse(events: AsyncIterator[list[dict | str]], headers: dict[str, str] | None = None) -> StreamingResponse:
    """One write per list of events (a chunk of the model's stream), each event its own `data:` line."""
    async def lines() -> AsyncIterator[str]:
        async for chunk in events:
            yield "".join(f"data: {ev if isinstance(ev, str) else json.dumps(ev, ensure_ascii=False)}\n\n"
                          for ev in chunk)
    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


# -- ASGI middleware ----------------------------------------------------------------------------------
class BodyLimit:
    """413 for a body over `max_bytes`, by Content-Length or while reading a chunked body."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = error_response(ErrorKind.TOO_LARGE, self._message(int(length)), "body")
            return await response(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # FastAPI lets an HTTPException from body reading through as is
                raise HTTPException(413, self._message(seen))
            return message
        await self.app(scope, limited, send)

    def _message(self, size: int) -> str:
        return f"request body has {size} bytes or more; the limit is {self.max_bytes} bytes"


class RequestMetrics:
    """kvserve_requests_total and kvserve_request_duration_seconds for /v1 routes (499: client went away)."""

    def __init__(self, app: Callable, recorder: Recorder) -> None:
        self.app, self.recorder = app, recorder

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not is_api_request(scope):
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), "499"

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)
        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            status = "500"
            raise
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", "other")
            state = scope.get("state", {})
            labels = {"model": state.get("model", "none"), "version": state.get("version", "none"),
                      "endpoint": endpoint}
            self.recorder.inc("kvserve_requests_total", {**labels, "status": status})
            self.recorder.observe("kvserve_request_duration_seconds", labels, time.monotonic() - started)
