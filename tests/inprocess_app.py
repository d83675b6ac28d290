"""The real HTTP API over real engines, in-process: for the fast fuzzing and security tests.

`InProcessServer` builds serving/server/api.py's app exactly as the ingress does, over `ModelService`s that wrap
real `Engine`s (ONNX Runtime sessions) of the tiny bundles of tests/engine_bundle.py, and runs it with its
engines on an event loop in a background thread, so that synchronous tests (hypothesis `@given`) can send
requests through httpx's ASGI transport with `request(...)`. No Ray: the Ray path is in the slow suites.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx

from engine_bundle import cached_bundle
from export.bundle import load_bundle
from model.tokenizer import Tokenizer
from serving.server.api import create_app
from serving.engine.config import BatchingKnobs, ReplicaKnobs
from serving.server.config import Limits, ModelSpec, engine_config
from serving.engine.engine import Engine
from serving.server.metrics import Recorder
from serving.server.service import ModelService
from test_api import LocalBackend  # serving.server.api.Backend over in-process ModelServices

SLOTS = 4


class InProcessServer:
    def __init__(self, limits: Limits, api_key: str | None = None, metrics_require_key: bool = False,
                 bundles: dict[str, Any] | None = None) -> None:
        """`bundles`: model name -> bundle directory (default: the tiny translate and generate bundles)."""
        self.limits, self.api_key, self.metrics_require_key = limits, api_key, metrics_require_key
        self.bundles = bundles
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="inprocess-app", daemon=True)
        self._thread.start()
        self.engines: dict[str, Engine] = {}
        self.call(self._start(), timeout=600.0)  # exports the tiny bundles on first use: minutes on a busy machine

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        recorder = Recorder("prometheus")
        services = {}
        bundles = self.bundles or {name: cached_bundle(name)[0] for name in ("translate", "generate")}
        for name, bundle in bundles.items():
            spec = ModelSpec(name=name, bundle=bundle,
                             engine=ReplicaKnobs(max_slots=SLOTS, provider="cpu", intra_op_threads=1))
            engine = Engine.from_bundle(bundle, engine_config(spec, BatchingKnobs(max_waiting=8), self.limits))
            await engine.start()
            self.engines[name] = engine
            loaded = load_bundle(bundle)
            tok = Tokenizer.load(loaded.tokenizer_path)
            services[name] = ModelService(name, engine, tok, self.limits.max_prompt_tokens, recorder,
                                          version=loaded.version)
        self.app = create_app(LocalBackend(services, recorder), self.limits, recorder, self.api_key,
                              metrics_require_key=self.metrics_require_key)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test",
                                        timeout=60)

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self.call(self.client.request(method, url, **kwargs))

    def slots_in_use(self) -> dict[str, int]:
        return {name: e.snapshot()["slots_used"] for name, e in self.engines.items()}

    def close(self) -> None:
        async def stop() -> None:
            await self.client.aclose()
            for engine in self.engines.values():
                await engine.stop(drain_timeout_s=5)
        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
