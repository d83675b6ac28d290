"""One model served in this process: its Engine and the ModelService around it, with their lifecycle.

`LocalModel.load` builds the Engine (serving/engine/) from the bundle and a ModelService (service.py) around
it and warms the engine up, so the first user request does not pay for the graphs' first run. It then keeps
the engine's gauges true while idle, applies new batching knobs live (`reconfigure`), reports the engine's
load (`load`, read by Serve's autoscaler through serving/server/autoscale.py), says whether it can serve
(`ready`) and why not (`check_health` raises once the engine is dead: steps kept failing, or one hung past
`step_timeout_s`), and drains on `stop`.

Two places hold one: a model deployment's replica (replica.py, one model per process, reached through a
handle) and the ingress replica for a `colocated` model (ingress.py: the API and the engine in one process,
so a request and each streamed token cross no process boundary between them).

Does not own: HTTP, Ray, the text <-> token work (service.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any

from export.bundle import load_bundle
from serving.engine.config import BatchingKnobs
from serving.engine.engine import Engine
from serving.engine.types import GenerationRequest, SamplingParams
from serving.server.chunks import coalesce
from serving.server.config import Limits, ModelSpec, engine_config
from serving.server.metrics import Recorder
from serving.server.response_cache import ResponseCache
from serving.server.service import ModelService
from serving.server.text_types import StreamPiece, TextRequest, TextResult, is_result

log = logging.getLogger("ray.serve")
ENGINE_LOAD_KEYS = ("running", "waiting", "slots_total")  # the engine snapshot's keys the autoscaler reads
GAUGE_PERIOD_S = 0.25  # an idle engine's gauges (slots in use) reach /metrics within one export period


class LocalModel:
    """A model's engine and service in this process; build it with `await LocalModel.load(...)`."""

    def __init__(
        self,
        spec: ModelSpec,
        limits: Limits,
        live: BatchingKnobs,
        engine: Engine,
        service: ModelService,
        version: str,
        created: int,
    ) -> None:
        self.spec, self.limits, self.live = spec, limits, live
        self.engine, self.service, self.version, self.created = engine, service, version, created
        self.cache = (
            ResponseCache(spec.response_cache_entries, spec.response_cache_bytes, service.recorder, service.labels)
            if spec.response_cache_entries
            else None
        )
        self._gauges = asyncio.get_running_loop().create_task(self._poll_gauges())

    @classmethod
    async def load(
        cls,
        spec: ModelSpec,
        bundle_dir: str,
        limits: Limits,
        live: BatchingKnobs,
        recorder: Recorder | None,
        deployment: str | None = None,
    ) -> LocalModel:
        """`deployment`: whose bundle this is (the model's, or its canary's), for the config's pinned hash."""
        bundle = load_bundle(bundle_dir, spec.bundle_pin(deployment or spec.name))
        engine = await asyncio.to_thread(Engine.from_bundle, bundle_dir, engine_config(spec, live, limits))
        await engine.start()
        tokenizer = bundle.load_tokenizer()
        service = ModelService(spec.name, engine, tokenizer, limits.max_prompt_tokens, recorder, version=bundle.version)
        await _warm_up(engine, tokenizer)
        model = cls(spec, limits, live, engine, service, bundle.version, bundle.created)
        log.info(
            "model %s version %s ready: bundle %s, task %s, %s",
            spec.name,
            bundle.version,
            bundle_dir,
            bundle.task,
            engine.snapshot(),
        )
        return model

    # -- requests -------------------------------------------------------------------------------------
    async def complete(self, req: TextRequest) -> TextResult:
        if self.cache is not None:
            return await self.cache.complete(req, self.service.complete)
        return await self.service.complete(req)

    def stream(
        self, req: TextRequest, across_processes: bool = True
    ) -> AsyncGenerator[list[StreamPiece | TextResult], None]:
        """The request's pieces in chunks, the TextResult last. Across a process boundary (a model deployment's
        replica) a chunk is what is ready, or what `stream_interval_s` gathered (serving/server/chunks.py);
        in the same process as the API (colocated, interval 0) each piece goes on as it comes: no queue and no
        task in between."""
        if across_processes or self.spec.stream_interval_s > 0:
            return coalesce(self.service.stream(req), self.spec.stream_interval_s, is_final=is_result)
        return _one_by_one(self.service.stream(req))

    # -- state ----------------------------------------------------------------------------------------
    def reconfigure(self, live: BatchingKnobs) -> None:
        self.live = live
        self.engine.reconfigure(engine_config(self.spec, live, self.limits))
        log.info("model %s reconfigured: %s", self.spec.name, live.model_dump(mode="json"))

    def ready(self) -> bool:
        snap = self.engine.snapshot()
        return not snap.get("dead") and snap.get("accepting", True)

    def info(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "task": self.service.task,
            "pid": os.getpid(),
            "version": self.version,
            "created": self.created,
            "live": self.live.model_dump(mode="json"),
            "provider": getattr(getattr(self.engine, "runtime", None), "provider", None),  # its ORT EP
            "engine": self.engine.snapshot(),
        }

    def load_stats(self) -> dict[str, float]:
        """The engine's load, for Serve's autoscaler (a custom policy reads it: serving/server/autoscale.py)."""
        snap = self.engine.snapshot()
        return {key: float(snap.get(key, 0)) for key in ENGINE_LOAD_KEYS}

    def check_health(self) -> None:
        snap = self.engine.snapshot()
        if snap.get("dead"):
            raise RuntimeError(
                f"model {self.spec.name}: the engine is dead ({snap.get('dead_reason')}); Serve replaces this replica"
            )

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Requests in flight finish (up to `drain_timeout_s`), then the engine stops."""
        self._gauges.cancel()
        await self.engine.stop(drain_timeout_s=drain_timeout_s)

    async def _poll_gauges(self) -> None:
        while True:  # steps update the gauges while busy; this keeps them true while idle
            self.service.record_gauges()
            await asyncio.sleep(GAUGE_PERIOD_S)


async def _one_by_one(
    items: AsyncGenerator[StreamPiece | TextResult, None],
) -> AsyncGenerator[list[StreamPiece | TextResult], None]:
    """Each item as a chunk of one; closing this closes `items` (the engine request is cancelled)."""
    try:
        async for item in items:
            yield [item]
    finally:
        await items.aclose()


async def _warm_up(engine: Engine, tokenizer: Any) -> None:
    """One short request through every graph, so the first user request does not pay for it."""
    ids = tokenizer.encode("warm up") or [tokenizer.unk_id]
    if not engine.is_encoder_decoder:
        ids = [tokenizer.bos_id] + ids
    req = GenerationRequest("warmup", ids, SamplingParams(max_new_tokens=2))
    async for _ in engine.submit(req):
        pass
