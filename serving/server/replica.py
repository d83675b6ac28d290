"""A model replica: the Ray Serve deployment that owns one model's Engine and ModelService.

`ModelDeployment` is a thin shim: it builds the Engine (serving/engine/) from the bundle and a ModelService
(serving/server/service.py) around it, warms the engine up before the replica takes traffic, applies the
batching knobs live in `reconfigure(user_config)` (the engine's own batching modes: continuous, request-level
or none), polls engine gauges, reports the engine's load to Serve's autoscaler (`record_autoscaling_stats`,
read by serving/server/autoscale.py), fails its health check when the engine is dead (steps kept failing, or one hung
past the engine's `step_timeout_s` watchdog: Ray then replaces the replica), and drains in-flight requests
on shutdown. Errors the client caused come back as values (see `complete`).

Does not own: HTTP (serving/server/ingress.py, api.py), the engine, the text <-> token work (service.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from export.bundle import load_bundle
from serving.engine.config import BatchingKnobs
from serving.engine.engine import Engine
from serving.engine.types import GenerationRequest, SamplingParams
from serving.server.config import Limits, ModelSpec, engine_config
from serving.server.errors import ServiceError
from serving.server.metrics import Recorder
from serving.server.chunks import coalesce
from serving.server.service import ModelService, StreamPiece, TextRequest, TextResult, is_result

log = logging.getLogger("ray.serve")
ENGINE_LOAD_KEYS = ("running", "waiting", "slots_total")  # the engine snapshot's keys the autoscaler reads
GAUGE_PERIOD_S = 0.25  # an idle engine's gauges (slots in use) reach /metrics within one export period


@serve.deployment
class ModelDeployment:
    async def __init__(self, spec: dict, bundle_dir: str, limits: dict) -> None:
        self.spec, self.limits = ModelSpec.model_validate(spec), Limits.model_validate(limits)
        self.live = BatchingKnobs()
        bundle = load_bundle(bundle_dir)
        self.version, self.created = bundle.version, bundle.created
        config = engine_config(self.spec, self.live, self.limits)
        self.engine = await asyncio.to_thread(Engine.from_bundle, bundle_dir, config)
        await self.engine.start()
        tokenizer = bundle.load_tokenizer()
        self.service = ModelService(self.spec.name, self.engine, tokenizer, self.limits.max_prompt_tokens,
                                    Recorder("ray"), version=self.version)
        await self._warm_up(tokenizer)
        self._gauges = asyncio.get_running_loop().create_task(self._poll_gauges())
        log.info("model %s version %s ready: bundle %s, task %s, %s", self.spec.name, self.version, bundle_dir,
                 bundle.task, self.engine.snapshot())

    async def _warm_up(self, tokenizer: Any) -> None:
        """One short request through every graph, so the first user request does not pay for it."""
        ids = tokenizer.encode("warm up") or [tokenizer.unk_id]
        if not self.engine.is_encoder_decoder:
            ids = [tokenizer.bos_id] + ids
        req = GenerationRequest("warmup", ids, SamplingParams(max_new_tokens=2))
        async for _ in self.engine.submit(req):
            pass

    async def reconfigure(self, user_config: dict) -> None:
        self.live = BatchingKnobs.model_validate(user_config or {})
        self.engine.reconfigure(engine_config(self.spec, self.live, self.limits))
        log.info("model %s reconfigured: %s", self.spec.name, self.live.model_dump(mode="json"))

    # -- called by the ingress --------------------------------------------------------------------------
    # A ServiceError (the client's fault, or overload) is returned as a value, not raised: Ray would log
    # every 4xx as a failed request with a traceback. RayBackend raises it again on the ingress side.
    async def complete(self, req: TextRequest) -> TextResult | ServiceError:
        try:
            return await self.service.complete(req)
        except ServiceError as e:
            return e

    async def stream(self, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult] | ServiceError]:
        """The request's pieces in chunks (serving/server/chunks.py): one Ray item per chunk, not per token."""
        try:
            async for chunk in coalesce(self.service.stream(req), self.spec.stream_interval_s, is_final=is_result):
                yield chunk
        except ServiceError as e:
            yield e

    async def ready(self) -> bool:
        snap = self.engine.snapshot()
        return not snap.get("dead") and snap.get("accepting", True)

    async def info(self) -> dict:
        return {"name": self.spec.name, "task": self.service.task, "pid": os.getpid(),
                "version": self.version, "created": self.created,
                "live": self.live.model_dump(mode="json"),
                "provider": getattr(getattr(self.engine, "runtime", None), "provider", None),  # its ONNX Runtime EP
                "engine": self.engine.snapshot()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's load, for Serve's autoscaler (a custom policy reads it: serving/server/autoscale.py)."""
        snap = self.engine.snapshot()
        return {key: float(snap.get(key, 0)) for key in ENGINE_LOAD_KEYS}

    # -- lifecycle ------------------------------------------------------------------------------------
    async def _poll_gauges(self) -> None:
        while True:  # steps update the gauges while busy; this keeps them true while idle
            self.service.record_gauges()
            await asyncio.sleep(GAUGE_PERIOD_S)

    async def check_health(self) -> None:
        snap = self.engine.snapshot()
        if snap.get("dead"):
            raise RuntimeError(f"model {self.spec.name}: the engine is dead ({snap.get('dead_reason')}); "
                               f"Serve replaces this replica")

    async def __del__(self) -> None:
        """Serve waits (graceful_shutdown_*) for ongoing requests first; then the engine drains and stops."""
        if hasattr(self, "_gauges"):
            self._gauges.cancel()
        if hasattr(self, "engine"):
            await self.engine.stop(drain_timeout_s=30.0)
