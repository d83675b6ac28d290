"""The Ray Serve application: one deployment per model bundle plus the HTTP ingress; `build_app(args)`.

- `ModelDeployment` is a thin shim: it owns an Engine (serving/engine/engine.py) and a ModelService
  (serving/server/service.py), warms the engine up before the replica takes traffic, applies batching knobs live in
  `reconfigure(user_config)`, runs request-level batching through `@serve.batch` -> `Engine.run_batch`, polls
  engine gauges, fails its health check when the engine is dead, and drains in-flight requests on shutdown.
- `Ingress` serves the FastAPI app of serving/server/api.py with `RayBackend`, which calls the model deployments
  through handles (streaming ones for SSE), turns Ray's overload errors into 429s and a replica that died
  or is gone into a 503 that can be retried, and cancels the model's request when the HTTP client goes
  away. Its `reconfigure` (user_config `IngressKnobs`) drains the replica for a graceful shutdown.
- `build_app(args)` is the Serve config's `import_path` (serving.server.app:build_app): it parses `AppArgs`, checks
  every bundle exists, and binds the graph. Deployment options (replicas, autoscaling, queue limits, actor
  options, user_config) come from the Serve config file, not from code.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.server.config import INGRESS_DEPLOYMENT, AppArgs, IngressKnobs, Limits, LiveKnobs, ModelSpec, engine_config
from serving.server.service import ErrorKind, ServiceError, StreamPiece, TextRequest, TextResult
from serving.engine.types import (AdmissionRejected, BatchingMode, EngineError, GenerationRequest, InvalidRequest,
                           TokenEvent)

log = logging.getLogger("ray.serve")
READY_TIMEOUT_S = 2.0
GAUGE_PERIOD_S = 0.25  # an idle engine's gauges (slots in use) reach /metrics within one export period


@serve.deployment
class ModelDeployment:
    async def __init__(self, spec: dict, bundle_dir: str, limits: dict) -> None:
        from model.tokenizer import Tokenizer
        from export.bundle import load_bundle
        from serving.engine.engine import Engine
        from serving.server.metrics import Recorder
        from serving.server.service import ModelService

        self.spec, self.limits = ModelSpec.model_validate(spec), Limits.model_validate(limits)
        self.live = LiveKnobs()
        bundle = load_bundle(bundle_dir)
        config = engine_config(self.spec, self.live, self.limits)
        self.engine = await asyncio.to_thread(Engine.from_bundle, bundle_dir, config)
        await self.engine.start()
        tokenizer = Tokenizer.load(bundle.tokenizer_path)
        self.service = ModelService(self.spec.name, self.engine, tokenizer, self.limits.max_prompt_tokens,
                                    Recorder("ray"))
        await self._warm_up(tokenizer)
        self._gauges = asyncio.get_running_loop().create_task(self._poll_gauges())
        log.info("model %s ready: bundle %s, task %s, %s", self.spec.name, bundle_dir, bundle.task,
                 self.engine.snapshot())

    async def _warm_up(self, tokenizer: Any) -> None:
        """One short request through every graph, so the first user request does not pay for it."""
        from serving.engine.types import SamplingParams
        ids = tokenizer.encode("warm up") or [tokenizer.unk_id]
        if not self.engine.is_encoder_decoder:
            ids = [tokenizer.bos_id] + ids
        req = GenerationRequest("warmup", ids, SamplingParams(max_new_tokens=2))
        async for _ in self.engine.submit(req):
            pass

    async def reconfigure(self, user_config: dict) -> None:
        self.live = LiveKnobs.model_validate(user_config or {})
        self.engine.reconfigure(engine_config(self.spec, self.live, self.limits))
        self._batched.set_max_batch_size(min(self.live.max_batch_size, self.spec.engine.max_slots))
        self._batched.set_batch_wait_timeout_s(self.live.batch_wait_timeout_s)
        request_level = self.live.batching == BatchingMode.REQUEST
        self.service.batch_runner = self._run_in_batch if request_level else None
        log.info("model %s reconfigured: %s", self.spec.name, self.live.model_dump(mode="json"))

    # -- called by the ingress --------------------------------------------------------------------------
    # A ServiceError (the client's fault, or overload) is returned as a value, not raised: Ray would log
    # every 4xx as a failed request with a traceback. RayBackend raises it again on the ingress side.
    async def complete(self, req: TextRequest) -> TextResult | ServiceError:
        try:
            return await self.service.complete(req)
        except ServiceError as e:
            return e

    async def stream(self, req: TextRequest) -> AsyncIterator[StreamPiece | TextResult | ServiceError]:
        try:
            async for item in self.service.stream(req):
                yield item
        except ServiceError as e:
            yield e

    async def ready(self) -> bool:
        snap = self.engine.snapshot()
        return not snap.get("dead") and snap.get("accepting", True)

    async def info(self) -> dict:
        return {"name": self.spec.name, "task": self.service.task, "pid": os.getpid(),
                "live": self.live.model_dump(mode="json"),
                "engine": self.engine.snapshot()}

    # -- request-level batching ---------------------------------------------------------------------------
    async def _run_in_batch(self, req: GenerationRequest) -> list[TokenEvent]:
        result = await self._batched(req)
        if isinstance(result, BaseException):
            raise result
        return result

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _batched(self, reqs: list[GenerationRequest]) -> list[list[TokenEvent] | BaseException]:
        return await run_batch_isolated(self.engine, reqs)

    # -- lifecycle ------------------------------------------------------------------------------------
    async def _poll_gauges(self) -> None:
        while True:  # steps update the gauges while busy; this keeps them true while idle
            self.service.record_gauges()
            await asyncio.sleep(GAUGE_PERIOD_S)

    async def check_health(self) -> None:
        if self.engine.snapshot().get("dead"):
            raise RuntimeError(f"model {self.spec.name}: the engine's step loop died; restart the replica")

    async def __del__(self) -> None:
        """Serve waits (graceful_shutdown_*) for ongoing requests first; then the engine drains and stops."""
        if hasattr(self, "_gauges"):
            self._gauges.cancel()
        if hasattr(self, "engine"):
            await self.engine.stop(drain_timeout_s=30.0)


async def run_batch_isolated(engine: Any, reqs: list[GenerationRequest]) -> list[list[TokenEvent] | BaseException]:
    """Run gathered requests as one static batch (Engine.run_batch admits all or none); if the engine refuses
    the batch as invalid (one bad member, or more KV slots than the pool), run each alone so that one bad
    request fails alone. Errors come back per request, as values (what @serve.batch hands to each caller)."""
    try:
        return await engine.run_batch(reqs)
    except InvalidRequest as e:
        if len(reqs) == 1:
            return [e]
    except EngineError as e:  # overload or a dead engine applies to every member alike
        return [e] * len(reqs)
    results = await asyncio.gather(*(engine.run_batch([r]) for r in reqs), return_exceptions=True)
    return [r[0] if isinstance(r, list) else r for r in results]


class RayBackend:
    """serving.server.api.Backend over Serve deployment handles."""

    def __init__(self, handles: dict[str, DeploymentHandle], tasks: dict[str, str]) -> None:
        self.handles, self.tasks = handles, tasks

    def model_tasks(self) -> dict[str, str]:
        return self.tasks

    async def complete(self, model: str, req: TextRequest) -> TextResult:
        response = None
        try:
            response = self.handles[model].complete.remote(req)
            result = await response
        except asyncio.CancelledError:
            if response is not None:
                _cancel_quietly(response)
            raise
        except Exception as e:
            raise _as_service_error(e) from None
        if isinstance(result, ServiceError):
            raise result
        return result

    async def stream(self, model: str, req: TextRequest) -> AsyncIterator[StreamPiece | TextResult]:
        gen, finished = None, False
        try:
            gen = self.handles[model].options(stream=True).stream.remote(req)
            async for item in gen:
                if isinstance(item, ServiceError):
                    raise item
                finished = finished or isinstance(item, TextResult)  # the last item: nothing to cancel after
                yield item
            finished = True
        except ServiceError:
            raise
        except Exception as e:
            raise _as_service_error(e) from None
        finally:
            if gen is not None and not finished:  # client gone or error: cancel the model's request
                _cancel_quietly(gen)

    async def ready(self) -> bool:
        async def one(h: DeploymentHandle) -> bool:
            try:
                return bool(await asyncio.wait_for(h.ready.remote(), READY_TIMEOUT_S))
            except Exception:
                return False
        return all(await asyncio.gather(*(one(h) for h in self.handles.values())))

    async def metrics_text(self) -> str:
        from serving.server.metrics import aggregate_exposition, scrape_ray_nodes
        return aggregate_exposition(await scrape_ray_nodes())


def _cancel_quietly(response: Any) -> None:
    """Cancel a handle call; Ray's cancel() re-raises the call's own error if it already failed."""
    try:
        response.cancel()
    except Exception:  # already failed or finished: nothing left to cancel
        pass


def _as_service_error(e: BaseException) -> BaseException:
    """The ServiceError inside a Ray error, or Ray's overload / unavailability as one; else `e` itself."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(e, (RayActorError, ReplicaUnavailableError)):  # the replica died (or is unreachable)
        return ServiceError(ErrorKind.UNAVAILABLE, "the model replica serving this request failed and is being "
                            "restarted; retry the request", retry_after_s=1.0, reason="replica_failed")
    inner = getattr(e, "cause", None) or e  # Ray wraps a replica's exception in a RayTaskError
    if isinstance(inner, ServiceError):
        return inner
    if isinstance(inner, BackPressureError):
        return ServiceError(ErrorKind.OVERLOADED, f"server overloaded (deployment queue full): {inner.message}",
                            retry_after_s=inner.retry_after_s or 1.0, reason="deployment_queue_full")
    if isinstance(inner, DeploymentUnavailableError):
        return ServiceError(ErrorKind.UNAVAILABLE, f"model unavailable: {inner.message}")
    if isinstance(inner, AdmissionRejected):  # not expected: the service converts it
        return ServiceError(ErrorKind.OVERLOADED, str(inner), retry_after_s=inner.retry_after_s)
    return e


@serve.deployment
@serve.ingress()
class Ingress:
    def __init__(self, args: dict, tasks: dict[str, str], **handles: DeploymentHandle) -> None:
        from serving.server.drain import Drain

        self.args, self.tasks, self.handles = AppArgs.model_validate(args), tasks, handles
        self.drain = Drain()

    def __serve_build_asgi_app__(self) -> Any:
        from serving.server.api import create_app
        from serving.server.metrics import Recorder

        return create_app(RayBackend(self.handles, self.tasks), self.args.limits, Recorder("ray"),
                          self.args.resolved_api_key(), self.drain)

    async def reconfigure(self, user_config: dict) -> None:
        """`draining: true` refuses new API requests from now on (serving/server/drain.py); false resumes."""
        knobs = IngressKnobs.model_validate(user_config or {})
        self.drain.set_draining(knobs.draining)
        log.info("ingress %s", "draining: new requests get 503" if knobs.draining else "serving")

    async def drain_status(self) -> dict:
        """This replica's phase and requests in flight (serving/server/launch.py `drain` polls every replica)."""
        return {"replica": serve.get_replica_context().replica_id.unique_id, **self.drain.status()}


def bundle_task(bundle_dir: Path) -> str:
    """The task in a bundle's manifest (full verification happens when a replica loads it)."""
    manifest = bundle_dir / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"model bundle {bundle_dir} has no manifest.json; export one with "
                                f"`kvserve export` or point args.artifacts_dir / models[].bundle at it")
    return str(json.loads(manifest.read_text())["task"])


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for the Serve config's `args` (see serving/server/config.py AppArgs)."""
    parsed = AppArgs.model_validate(args)
    tasks, handles = {}, {}
    limits = parsed.limits.model_dump(mode="json")
    for spec in parsed.models:
        bundle_dir = parsed.bundle_dir(spec)
        tasks[spec.name] = bundle_task(bundle_dir)
        handles[spec.name] = ModelDeployment.options(name=spec.name).bind(
            spec.model_dump(mode="json"), str(bundle_dir), limits)
    resolved = parsed.model_dump(mode="json")
    resolved["artifacts_dir"] = str(parsed.artifacts_dir.resolve())
    if parsed.api_key is not None:
        resolved["api_key"] = parsed.api_key.get_secret_value()
    return Ingress.options(name=INGRESS_DEPLOYMENT).bind(resolved, tasks, **handles)
