"""The real HTTP API over real engines, in-process: for the fast API, fuzzing and security tests.

`InProcessServer` builds serving/server/api.py's app exactly as the ingress does, over `ModelService`s that wrap
real `Engine`s (ONNX Runtime sessions) of the tiny bundles of tests/engine_bundle.py, and runs it with its
engines on an event loop in a background thread, so that synchronous tests (hypothesis `@given`) can send
requests through httpx's ASGI transport with `request(...)`. No Ray: the Ray path is in the slow suites.

What a test may ask of it besides requests: the engines asked directly (`engine_output`, the reference an answer is
held to), each engine's finished requests' stats (`finished`), another app over the same engines with other limits,
key, drain gate or route prefix (`app_client`), and, with `faults=True`, faults the real engine cannot produce on
demand: a step that hangs or fails (tests/step_faults.py's `StepFaults`, in `faults[model]`) and a delay before
every step (`slow_steps`: a slow machine, for deadlines and disconnects in the middle of an answer).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from engine_bundle import cached_bundle
from export.bundle import load_bundle
from local_backend import LocalBackend  # serving.server.api.Backend over in-process ModelServices
from model.tokenizer import Tokenizer
from serving.engine.config import BatchingKnobs, ReplicaKnobs
from serving.engine.engine import Engine
from serving.engine.types import FinishReason, GenerationRequest, RequestStats, SamplingParams
from serving.server.api import create_app
from serving.server.config import Limits, ModelSpec, engine_config
from serving.server.drain import Drain
from serving.server.metrics import Recorder
from serving.server.service import ModelService
from step_faults import StepFaults

SLOTS = 4


class InProcessServer:
    def __init__(self, limits: Limits, api_key: str | None = None, metrics_require_key: bool = False,
                 bundles: dict[str, Any] | None = None, max_waiting: int = 8, max_slots: int = SLOTS,
                 faults: bool = False) -> None:
        """`bundles`: model name -> bundle directory (default: the tiny translate and generate bundles).
        `faults`: wrap each engine's step for fault injection (`faults`, `slow_steps`); a no-op until told."""
        self.limits, self.api_key, self.metrics_require_key = limits, api_key, metrics_require_key
        self.max_waiting, self.max_slots, self.with_faults = max_waiting, max_slots, faults
        self.bundles = bundles
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="inprocess-app", daemon=True)
        self._thread.start()
        self.engines: dict[str, Engine] = {}
        self.services: dict[str, ModelService] = {}
        self.tokenizers: dict[str, Tokenizer] = {}
        self.versions: dict[str, str] = {}  # model -> its bundle's content version
        self.finished: dict[str, list[RequestStats]] = {}  # model -> its engine's finished requests, in order
        self.faults: dict[str, StepFaults] = {}
        self.step_delay_s = 0.0
        self._clients: list[httpx.AsyncClient] = []
        self.call(self._start(), timeout=600.0)  # exports the tiny bundles on first use: minutes on a busy machine

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.recorder = Recorder("prometheus")
        bundles = self.bundles or {name: cached_bundle(name)[0] for name in ("translate", "generate")}
        for name, bundle in bundles.items():
            spec = ModelSpec(name=name, bundle=bundle,
                             engine=ReplicaKnobs(max_slots=self.max_slots, provider="cpu", intra_op_threads=1))
            engine = Engine.from_bundle(bundle, engine_config(spec, BatchingKnobs(max_waiting=self.max_waiting),
                                                              self.limits))
            if self.with_faults:
                engine.runtime.step = self._delayed(engine.runtime.step)
                self.faults[name] = StepFaults.install(engine.runtime)
            await engine.start()
            self.engines[name] = engine
            loaded = load_bundle(bundle)
            self.tokenizers[name] = Tokenizer.load(loaded.tokenizer_path)
            self.versions[name] = loaded.version
            self.services[name] = ModelService(name, engine, self.tokenizers[name], self.limits.max_prompt_tokens,
                                               self.recorder, version=loaded.version)
            self.finished[name] = []
            engine.add_observer(None, self.finished[name].append)  # after the service's: it has seen them
        self.backend = LocalBackend(self.services, self.recorder)
        self.app = create_app(self.backend, self.limits, self.recorder, self.api_key,
                              metrics_require_key=self.metrics_require_key)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test",
                                        timeout=60)

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self.call(self.client.request(method, url, **kwargs))

    def app_client(self, limits: Limits | None = None, api_key: str | None = None, drain: Drain | None = None,
                   root_path: str = "") -> httpx.AsyncClient:
        """A client of another app over these engines and services (and metrics), with its own limits, API key,
        drain gate or route prefix (Ray Serve's route_prefix arrives as the ASGI root_path). Use it on this
        server's loop: `server.call(client.post(...))`. The engines keep this server's limits."""
        app = create_app(self.backend, limits or self.limits, self.recorder, api_key, drain)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path=root_path),
                                   base_url="http://test" + root_path, timeout=60)
        self._clients.append(client)
        return client

    def engine_output(self, model: str, prompt_ids: list[int],
                      params: SamplingParams) -> tuple[list[int], FinishReason, tuple]:
        """What `model`'s engine answers to exactly these ids, asked directly (no API, no service):
        (the tokens it streams, its finish reason, the beam hypotheses)."""
        async def run() -> tuple[list[int], FinishReason, tuple]:
            handle = self.engines[model].submit(GenerationRequest(f"reference-{time.monotonic_ns()}",
                                                                  list(prompt_ids), params))
            events = [ev async for ev in handle]
            final = events[-1]
            assert final.finish_reason is not None and final.error is None, final
            return [ev.token_id for ev in events if ev.token_id is not None], final.finish_reason, final.hypotheses
        return self.call(run())

    def wait_finished(self, model: str, since: int, timeout_s: float = 10.0) -> RequestStats:
        """The first request `model`'s engine finished after the first `since` of `finished[model]` (a request
        cancelled by the API leaves the engine at its next step, after the answer may have gone)."""
        deadline = time.monotonic() + timeout_s
        while len(self.finished[model]) <= since:
            assert time.monotonic() < deadline, f"{model}: no request finished in {timeout_s}s"
            time.sleep(0.01)
        return self.finished[model][since]

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until no engine runs or holds a request (cancelled ones free their slots a step later)."""
        deadline = time.monotonic() + timeout_s
        while any(e.snapshot()["running"] or e.snapshot()["waiting"] for e in self.engines.values()):
            assert time.monotonic() < deadline, {n: e.snapshot() for n, e in self.engines.items()}
            time.sleep(0.01)

    @contextmanager
    def slow_steps(self, seconds: float) -> Iterator[None]:
        """Every engine step takes `seconds` longer meanwhile (needs `faults=True`)."""
        assert self.with_faults, "InProcessServer(faults=True) wraps the steps"
        self.step_delay_s = seconds
        try:
            yield
        finally:
            self.step_delay_s = 0.0

    def _delayed(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.step_delay_s:
                time.sleep(self.step_delay_s)  # on the step thread, as a slow ONNX Runtime call would be
            return step(*args, **kwargs)
        return run

    def slots_in_use(self) -> dict[str, int]:
        return {name: e.snapshot()["slots_used"] for name, e in self.engines.items()}

    def close(self) -> None:
        async def stop() -> None:
            for client in [self.client, *self._clients]:
                await client.aclose()
            for engine in self.engines.values():
                await engine.stop(drain_timeout_s=5)
        for faults in self.faults.values():
            faults.release()  # a step held by a test that failed before releasing it
        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
