"""The HTTP API (FastAPI): the app, its inference routes, the server's limits on a request, and its middleware.

Routes: POST /v1/translate, POST /v1/translate/score, POST /v1/generate (SSE with "stream": true), POST /v1/completions
(OpenAI-compatible), POST /tokenize and POST /detokenize (vLLM's); the routes that describe the server (GET /v1/models,
the KServe v2 health and model routes, GET /metrics) are serving/server/status_routes.py's, registered here.

Owns: building `SamplingParams` and `TextRequest`s from the bodies (a body's `model` may pin a version:
`generate@3f2a9c0d1e2b`), the X-Model-Version header of every answer (the version of the replica that answered), the
limits from the server's config (max_tokens, texts per request, beam size, stop strings; `BodyLimit` for the body's
bytes), the response shapes, and per-request metrics (`RequestMetrics`). The app talks to models through a `Backend`
(serving/server/backend.py: serving/server/ingress.py's Ray handles in production, in-process `ModelService`s in
tests), so this module knows nothing about Ray.

Does not own: errors -- a route raises `ServiceError`, and serving/server/errors.py, the one place where
errors become statuses, answers it (and validation errors, 404/405 and unexpected exceptions). Bodies are in
serving/server/schemas.py; text handling (stop strings, usage, timings) in serving/server/service.py; the API
key check in serving/server/auth.py; refusing new requests while shutting down in serving/server/drain.py.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from serving.engine.types import SamplingParams
from serving.server import completions, tracing, translation
from serving.server.answer_front import PATHS as FRONT_PATHS
from serving.server.answer_front import AnswerFront, mark_storable
from serving.server.auth import BearerAuth, key_sha256, open_paths
from serving.server.backend import Backend
from serving.server.config import Limits
from serving.server.drain import Drain, DrainGate
from serving.server.errors import ErrorKind, ServiceError, install_error_handlers
from serving.server.metrics import Recorder
from serving.server.middleware import BodyLimit, RequestMetrics
from serving.server.repository_routes import add_repository_routes
from serving.server.response_cache import ResponseCache
from serving.server.schemas import (
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    GenerateResponse,
    ScoreRequest,
    TokenizeRequest,
    TranslateRequest,
    TranslateResponse,
)
from serving.server.status_routes import METRICS_CACHE_CONTROL, StatusRoutes
from serving.server.stream import DEADLINE_GRACE_S, generate_events, start_stream
from serving.server.text_types import TextRequest, TextResult, answering_version
from serving.server.versions import split_model_name

TIMEOUT_HEADER = "x-request-timeout-seconds"  # a client's deadline, when shorter than the server's
VERSION_HEADER = "X-Model-Version"  # the version(s) of the model that answered, on every /v1 answer


def create_app(
    backend: Backend,
    limits: Limits,
    recorder: Recorder,
    api_key: str | None = None,
    drain: Drain | None = None,
    metrics_require_key: bool = False,
) -> FastAPI:
    """The API. Middleware, outermost first: the request's trace span (serving/server/tracing.py; nothing when
    tracing is off), metrics (sees every /v1 answer, 401 and 503 included), drain gate, API key (checked before
    the body is read; /metrics too if `metrics_require_key`), body limit."""
    app = FastAPI(
        title="kvserve",
        version="0.1.0",
        description="Transformer translation and generation on ONNX Runtime behind Ray Serve.",
    )
    drain = drain if drain is not None else Drain()
    kept = getattr(backend, "answer_cache", lambda _: None)  # the cache a model's whole answers go to, if any
    caches: list[ResponseCache] = [c for c in map(kept, backend.model_tasks()) if c is not None]
    front_routes: dict[str, Any] = {}  # filled below, once the routes exist (the stack is built on the first call)
    app.add_middleware(AnswerFront, caches=caches, routes=front_routes)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(BearerAuth, key_sha256=key_sha256(api_key), open_paths=open_paths(metrics_require_key))
    app.add_middleware(DrainGate, drain=drain)
    app.add_middleware(RequestMetrics, recorder=recorder)
    app.add_middleware(tracing.TraceRequests)  # outermost: a request's span covers the whole of it
    install_error_handlers(app, recorder)
    routes = _Routes(backend, limits)
    status = StatusRoutes(backend, drain, METRICS_CACHE_CONTROL[metrics_require_key])
    app.post("/v1/translate", response_model=TranslateResponse)(routes.translate)
    app.post("/v1/translate/score")(routes.score)
    app.post("/v1/generate", response_model=GenerateResponse)(routes.generate)
    app.post("/v1/completions")(routes.completions)
    app.get("/v1/models")(status.models)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.get("/v2/health/live")(status.live)
    app.get("/v2/health/ready")(status.ready)
    app.get("/v2/models/{name}/ready")(status.model_ready)
    app.get("/v2/models/{name}")(status.model_metadata)
    app.get("/metrics", response_class=PlainTextResponse)(status.metrics)
    add_repository_routes(app, backend)  # with a model repository: its admin routes
    front_routes.update((path, r) for r in app.routes if (path := getattr(r, "path", None)) in FRONT_PATHS)
    return app


class _Routes:
    def __init__(self, backend: Backend, limits: Limits) -> None:
        self.backend, self.limits = backend, limits

    async def translate(self, body: TranslateRequest, request: Request, response: Response) -> dict:
        model, version = self._resolve(body.model, "translate", request)
        texts = [body.text] if isinstance(body.text, str) else body.text
        if len(texts) > self.limits.max_texts:
            raise ServiceError(
                ErrorKind.TOO_LARGE,
                f"text has {len(texts)} entries; the limit is {self.limits.max_texts} per request. Split the list.",
                field="text",
            )
        for name, value, limit in (
            ("beam_size", body.beam_size, self.limits.max_beam_size),
            ("n_best", body.n_best or 1, self.limits.max_n_best),
        ):
            if value > limit:
                raise ServiceError(ErrorKind.INVALID, f"{name}={value} exceeds this server's limit {limit}", field=name)
        params = SamplingParams(
            max_new_tokens=self._max_tokens(body.max_tokens),
            beam_size=body.beam_size,
            n_best=body.n_best or 1,
            length_penalty=body.length_penalty,
        )
        deadline, started, carried = self._deadline(request), time.monotonic(), _carried(body, request)

        def make(text: str, p: SamplingParams, field: str, prefix: str, score: bool = False) -> TextRequest:
            return TextRequest(text, p, deadline, field=field, version=version, prefix=prefix, score=score, **carried)

        reqs, layout = translation.translate_requests(body, texts, params, self.limits.max_texts, make)
        results, head = await self._answers(model, reqs, request, response, started)
        mark_storable(request.scope, self.backend, model, reqs, results)
        return {**head, "translations": translation.translations(body, results, layout)}

    async def score(self, body: ScoreRequest, request: Request, response: Response) -> dict:
        """Each given translation's log-probability under the model (CTranslate2's score_batch)."""
        model, version = self._resolve(body.model, "translate", request)
        deadline, started, carried = self._deadline(request), time.monotonic(), _carried(body, request)

        def make(text: str, p: SamplingParams, field: str, target: str) -> TextRequest:
            return TextRequest(text, p, deadline, field=field, version=version, prefix=target, score=True, **carried)

        reqs = translation.score_requests(body, self.limits.max_texts, self.limits.max_tokens, make)
        results, head = await self._answers(model, reqs, request, response, started)
        return {**head, "scores": translation.scores(results)}

    async def _answers(
        self, model: str, reqs: list[TextRequest], request: Request, response: Response, started: float
    ) -> tuple[list[TextResult], dict[str, Any]]:
        """Every request's answer (the first error cancels the others), the versions header set, and the
        answer's common fields: model, usage, timings."""
        results = await _gather([self._complete(model, r) for r in reqs])
        _name_versions(request, response, results)
        return results, {"model": model, "usage": _usage(results), "timings": _timings(results, started)}

    async def generate(self, body: GenerateRequest, request: Request, response: Response) -> Any:
        model, version = self._resolve(body.model, "generate", request)
        stops = _stops(body.stop, self.limits)
        params = SamplingParams(
            max_new_tokens=self._max_tokens(body.max_tokens),
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            stop_strings=stops,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
        treq = TextRequest(body.prompt, params, self._deadline(request), version=version, **_carried(body, request))
        started = time.monotonic()
        if body.stream:
            first, rest = await start_stream(self.backend.stream(model, treq), treq.deadline_wall)
            return _sse(generate_events(first, rest, started, treq.deadline_wall), _stream_version(request, first))
        r = await self._complete(model, treq)
        _name_versions(request, response, [r])
        mark_storable(request.scope, self.backend, model, [treq], [r])
        return {
            "model": model,
            "text": r.text,
            "finish_reason": r.finish_reason,
            "usage": _usage([r]),
            "timings": _timings([r], started),
        }

    async def completions(self, body: CompletionRequest, request: Request, response: Response) -> Any:
        """OpenAI's completions; `n`, `best_of`, `echo` and `logprobs` in serving/server/completions.py."""
        model, version = self._resolve(body.model, None, request)
        params = completions.params_of(body, self._max_tokens(body.max_tokens), _stops(body.stop, self.limits))
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) > self.limits.max_texts:
            raise ServiceError(
                ErrorKind.TOO_LARGE,
                f"prompt has {len(prompts)} entries; the limit is {self.limits.max_texts}",
                field="prompt",
            )
        deadline, cid, created = self._deadline(request), f"cmpl-{secrets.token_hex(12)}", int(time.time())
        carried = _carried(body, request)

        def make(text: str, p: SamplingParams, echo: bool) -> TextRequest:
            return TextRequest(text, p, deadline, version=version, echo=echo, **carried)

        cands = completions.candidates(body, prompts, make, params, self.limits.max_texts)
        head = {"id": cid, "object": "text_completion", "created": created, "model": model}
        if body.stream:
            streams = await completions.start_all(
                [start_stream(self.backend.stream(model, c.request), deadline) for c in cands]
            )
            return _sse(
                completions.stream_choices(body, prompts[0], streams, head, deadline),
                _stream_version(request, streams[0][0]),
            )
        results = await _gather([self._complete(model, c.request) for c in cands])
        _name_versions(request, response, results)
        return {
            **head,
            "choices": completions.choices(body, prompts, cands, results),
            "usage": completions.usage(cands, results),
        }

    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        """vLLM's /tokenize: {"tokens", "count", "max_model_len"} of the model's tokenizer."""
        model, _ = self._resolve(body.model, None, request)
        return await self.backend.tokenize(model, body.prompt, body.add_special_tokens)

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        """vLLM's /detokenize: {"prompt": the text of the ids}."""
        model, _ = self._resolve(body.model, None, request)
        return {"prompt": await self.backend.detokenize(model, body.tokens)}

    # -- helpers --------------------------------------------------------------------------------------
    def _resolve(self, name: str | None, task: str | None, request: Request) -> tuple[str, str | None]:
        """(model, version or None) a request names: 'generate', 'generate@3f2a9c0d1e2b' or nothing (the task's
        first model)."""
        tasks, version = self.backend.model_tasks(), None
        if name is not None:
            name, version = split_model_name(name)
            if version == "":
                raise ServiceError(
                    ErrorKind.INVALID,
                    f"model {name + '@'!r} names no version; use 'model' or "
                    f"'model@VERSION' (GET /v1/models lists them)",
                    field="model",
                )
        if name is None:
            names = [n for n, t in tasks.items() if t == task]
            if not names:
                raise ServiceError(ErrorKind.NOT_FOUND, f"no {task} model is served", field="model")
            name = names[0]
        if name not in tasks:
            hint = getattr(self.backend, "not_found_hint", lambda: "")()
            raise ServiceError(
                ErrorKind.NOT_FOUND, f"model {name!r} is not served; models: {sorted(tasks)}{hint}", field="model"
            )
        if task is not None and tasks[name] != task:
            raise ServiceError(
                ErrorKind.INVALID,
                f"model {name!r} is a {tasks[name]} model; this endpoint needs a {task} model",
                field="model",
            )
        request.state.model = name
        return name, version

    def _max_tokens(self, asked: int | None) -> int:
        if asked is None:
            return self.limits.default_tokens
        if asked > self.limits.max_tokens:
            raise ServiceError(
                ErrorKind.INVALID,
                f"max_tokens={asked} exceeds the limit {self.limits.max_tokens}; ask for fewer",
                field="max_tokens",
            )
        return asked

    def _deadline(self, request: Request) -> float:
        """The request's deadline (wall clock): the server's request_timeout_s, or sooner where the client asks for
        less in the X-Request-Timeout-Seconds header (the header Ray Serve reads for its own backstop)."""
        limit = self.limits.request_timeout_s
        asked = request.headers.get(TIMEOUT_HEADER)
        if asked is not None:
            try:
                seconds = float(asked)
            except ValueError:
                seconds = float("nan")
            if not seconds > 0:
                raise ServiceError(
                    ErrorKind.INVALID,
                    f"{TIMEOUT_HEADER}={asked[:40]!r}: expected a number of seconds "
                    f"above 0 (the server's limit is {limit:g})",
                    field=TIMEOUT_HEADER,
                )
            limit = min(limit, seconds)
        return time.time() + limit

    async def _complete(self, model: str, req: TextRequest) -> TextResult:
        timeout = req.deadline_wall - time.time() + DEADLINE_GRACE_S
        try:
            return await asyncio.wait_for(self.backend.complete(model, req), timeout)
        except asyncio.TimeoutError:
            raise ServiceError(
                ErrorKind.DEADLINE,
                f"request passed its deadline (the server's request_timeout_s or the client's {TIMEOUT_HEADER})",
            ) from None


def _carried(body: Any, request: Request) -> dict[str, Any]:
    """What each TextRequest of a request carries besides its text: the body's priority, and for tracing the
    request's trace context ("" when tracing is off) and its id."""
    return {
        "priority": body.priority,
        "traceparent": tracing.current_traceparent(),
        "client_request_id": request.headers.get("x-request-id", ""),
        "cache": "no-cache" not in request.headers.get("cache-control", "").lower(),
        "arrival_wall": getattr(request.state, "arrival", None),
    }


def _name_versions(request: Request, response: Response, results: list[TextResult]) -> None:
    """X-Model-Version: the version that answered (several, comma-separated, if a rollout split the texts)."""
    versions = ",".join(sorted({r.version for r in results if r.version}))
    if any(r.cached for r in results):  # every answer, or some of several texts, from the response cache
        response.headers["X-Cache"] = "hit" if all(r.cached for r in results) else "partial"
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
        raise ServiceError(
            ErrorKind.INVALID, f"stop has {len(stops)} strings; the limit is {limits.max_stop_strings}", field="stop"
        )
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
    server = [r.server_ttft_s for r in results if r.server_ttft_s is not None]
    return {
        "queue_s": max(queue) if queue else None,
        "ttft_s": max(ttft) if ttft else None,
        "server_ttft_s": max(server) if server else None,
        "total_s": time.monotonic() - started,
    }


def _sse(events: AsyncIterator[Sequence[dict | str]], headers: dict[str, str] | None = None) -> StreamingResponse:
    """One write per list of events (a chunk of the model's stream), each event its own `data:` line."""

    async def lines() -> AsyncIterator[str]:
        async for chunk in events:
            yield "".join(
                f"data: {ev if isinstance(ev, str) else json.dumps(ev, ensure_ascii=False)}\n\n" for ev in chunk
            )

    return StreamingResponse(
        lines(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )
