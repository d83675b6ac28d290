"""A small real HTTP server speaking kvserve's API, for testing the load tester without a model.

A FastAPI app served by uvicorn in a background thread on a free loopback port. It implements
/v1/translate, /v1/generate (JSON or SSE), /v1/completions (OpenAI, JSON or SSE, include_usage) and a
real Prometheus /metrics (prometheus_client, its own registry) with the kvserve_* names the real server
exports. Its "model" echoes prompt words with a fixed delay per token, so latencies are predictable; it
answers 429 with Retry-After beyond `max_concurrent` requests in flight.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel


class TranslateBody(BaseModel):
    text: str
    beam_size: int = 1
    max_tokens: int = 64


class GenerateBody(BaseModel):
    prompt: str
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int | None = None
    stream: bool = False


class CompletionsBody(GenerateBody):
    model: str
    stream_options: dict | None = None


class EchoModel:
    """Output token i is word i of the prompt (cycled); the length depends on the seed and max_tokens."""

    def __init__(self, prefill_s: float, token_s: float) -> None:
        self.prefill_s, self.token_s = prefill_s, token_s

    @staticmethod
    def length(text: str, max_tokens: int, seed: int | None) -> int:
        return max(1, min(max_tokens, 3 + ((seed or len(text)) % 9)))

    async def tokens(self, text: str, n: int) -> AsyncIterator[str]:
        words = text.split() or ["x"]
        await asyncio.sleep(self.prefill_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.token_s)
            yield (" " if i else "") + words[i % len(words)]


class EchoServer:
    """The endpoints and their Prometheus metrics (one registry per server, so servers do not mix)."""

    def __init__(self, max_concurrent: int, prefill_s: float, token_s: float) -> None:
        self.max_concurrent, self.inflight = max_concurrent, 0
        self.model = EchoModel(prefill_s, token_s)
        self.reg = reg = CollectorRegistry()
        self.requests = Counter("kvserve_requests_total", "requests", ["model", "endpoint", "status"], registry=reg)
        self.generated = Counter("kvserve_generated_tokens_total", "generated tokens", ["model"], registry=reg)
        self.prompt_tokens = Counter("kvserve_prompt_tokens_total", "prompt tokens", ["model"], registry=reg)
        self.batch = Histogram("kvserve_batch_size", "requests per step", buckets=(1, 2, 4, 8, 16, 32, 64),
                               registry=reg)
        self.queue = Histogram("kvserve_queue_wait_seconds", "queue wait", registry=reg)
        Gauge("kvserve_waiting_requests", "waiting", registry=reg).set(0)

    def admit(self, name: str, endpoint: str) -> JSONResponse | None:
        if self.inflight >= self.max_concurrent:
            self.requests.labels(name, endpoint, "429").inc()
            return JSONResponse({"error": f"over {self.max_concurrent} in flight"}, status_code=429,
                                headers={"Retry-After": "0.05"})
        self.inflight += 1
        self.queue.observe(0.0005)
        return None

    def done(self, name: str, endpoint: str, n_prompt: int, n_out: int) -> None:
        self.inflight -= 1
        self.requests.labels(name, endpoint, "200").inc()
        self.generated.labels(name).inc(n_out)
        self.prompt_tokens.labels(name).inc(n_prompt)

    async def run(self, text: str, n: int) -> AsyncIterator[str]:
        async for tok in self.model.tokens(text, n):
            self.batch.observe(self.inflight)
            yield tok

    async def translate(self, body: TranslateBody) -> Response:
        if rejected := self.admit("translate", "translate"):
            return rejected
        n, p = EchoModel.length(body.text, body.max_tokens, None), len(body.text.split())
        text = "".join([t async for t in self.run(body.text[::-1], n)])
        self.done("translate", "translate", p, n)
        return JSONResponse({"translations": [{"text": text, "finish_reason": "length"}], "usage": _usage(p, n)})

    async def generate(self, body: GenerateBody) -> Response:
        if rejected := self.admit("generate", "generate"):
            return rejected
        n, p = EchoModel.length(body.prompt, body.max_tokens, body.seed), len(body.prompt.split())
        if not body.stream:
            text = "".join([t async for t in self.run(body.prompt, n)])
            self.done("generate", "generate", p, n)
            return JSONResponse({"text": text, "finish_reason": "length", "usage": _usage(p, n)})

        async def events() -> AsyncIterator[str]:
            parts = []
            async for tok in self.run(body.prompt, n):
                yield _sse({"token": tok, "index": len(parts)})
                parts.append(tok)
            self.done("generate", "generate", p, n)
            yield _sse({"finish_reason": "length", "usage": _usage(p, n), "text": "".join(parts)})
        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(self, body: CompletionsBody) -> Response:
        if rejected := self.admit("generate", "completions"):
            return rejected
        n, p = EchoModel.length(body.prompt, body.max_tokens, body.seed), len(body.prompt.split())
        base = {"id": "cmpl-test", "object": "text_completion", "created": int(time.time()), "model": body.model}
        if not body.stream:
            text = "".join([t async for t in self.run(body.prompt, n)])
            self.done("generate", "completions", p, n)
            return JSONResponse({**base, "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                 "usage": _usage(p, n)})

        async def chunks() -> AsyncIterator[str]:
            async for tok in self.run(body.prompt, n):
                yield _sse({**base, "choices": [{"index": 0, "text": tok, "finish_reason": None}]})
            yield _sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            self.done("generate", "completions", p, n)
            if (body.stream_options or {}).get("include_usage"):
                yield _sse({**base, "choices": [], "usage": _usage(p, n)})
            yield "data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def metrics(self) -> Response:
        return Response(generate_latest(self.reg), media_type=CONTENT_TYPE_LATEST)


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(max_concurrent: int = 64, prefill_s: float = 0.01, token_s: float = 0.003) -> FastAPI:
    server, app = EchoServer(max_concurrent, prefill_s, token_s), FastAPI()
    app.post("/v1/translate")(server.translate)
    app.post("/v1/generate")(server.generate)
    app.post("/v1/completions")(server.completions)
    app.get("/metrics")(server.metrics)
    return app


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread; use as a context manager."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
