"""The HTTP ingress: the FastAPI app of serving/server/api.py served by a Ray Serve deployment.

`Ingress` serves the app with `RayBackend`, which serves the models colocated in this replica in-process
(their `LocalModel`s: local_model.py, no hop) and calls the other model deployments through handles (streaming
ones for SSE): a model's stable deployment or its canary, by weight or by the version a request names
(versions.py; the versions the replicas serve are asked for and cached for VERSIONS_TTL_S). A request whose
replica died before it answered is sent once more; otherwise Ray's overload errors become 429s and a replica
that died or is gone a 503 that can be retried, and the model's request is cancelled when the HTTP client goes
away. Readiness counts each model's RUNNING replicas in Serve's status (readiness.py); /metrics is the
cross-node scrape (metrics.py), both off the event loop and cached for about a second, single flight
(cached.py; /metrics answers from the last scrape while the next one runs), so anonymous probes and scrapes
at any rate cost the cluster one call per second. Its `reconfigure` (user_config `IngressKnobs`) drains the
replica for a graceful shutdown.

Does not own: the routes (api.py), the model replicas (replica.py), the app graph (app.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serving.engine.config import BatchingKnobs
from serving.engine.types import AdmissionRejected
from serving.server import tracing
from serving.server.api import create_app
from serving.server.cached import Cached
from serving.server.config import AppArgs, IngressKnobs, ModelSpec
from serving.server.drain import Drain
from serving.server.errors import ErrorKind, ServiceError
from serving.server.local_model import LocalModel
from serving.server.metrics import RayNodeScraper, Recorder, aggregate_exposition
from serving.server.pool_routes import POOL_DEPLOYMENT, PoolRoutes
from serving.server.ray_env import bind_replica_grpc_to_node
from serving.server.readiness import ModelReadiness, probe_replicas, serve_replica_states
from serving.server.repository import Repository
from serving.server.response_cache import ResponseCache
from serving.server.text_types import StreamPiece, TextRequest, TextResult, is_result
from serving.server.versions import Router, ServedVersion

log = logging.getLogger("ray.serve")
# /metrics answers from a scrape at most METRICS_TTL_S old (Ray's nodes export every 1-2 s anyway), or up to
# METRICS_STALE_S older while the next scrape runs, so that a flood of scrapers never waits for one. A node's own
# exposition grows to megabytes (2.4 MB, 0.6 s to fetch and filter, measured here on a loaded machine), so a slow
# scrape is repeated less often: at most SCRAPE_SHARE of the time goes to scraping.
METRICS_TTL_S, METRICS_STALE_S, SCRAPE_SHARE = 1.0, 3.0, 0.2
REPLICA_DEATH_RETRIES = 1  # a request whose replica died before answering is sent once more
VERSIONS_TTL_S = 2.0  # a rolled-out version is listed (and can be named) within this long
FAILED_RETRY_AFTER_S = 10.0  # a colocated model that could not be loaded here: until the replica is replaced
MAX_POOL_REPLICAS = 64  # an unload asks at most this many pool replicas (it stops at the first that holds none)


class RayBackend:
    """serving.server.backend.Backend over Serve deployment handles (one per deployment: models and canaries) and
    the models colocated in this replica (`local`, by the deployment name their routes use)."""

    def __init__(
        self,
        handles: dict[str, DeploymentHandle],
        tasks: dict[str, str],
        routes: dict[str, list[tuple[str, float]]],
        app_name: str,
        local: dict[str, LocalModel] | None = None,
        failed: dict[str, str] | None = None,
        pool: PoolRoutes | None = None,
    ) -> None:
        """`failed`: deployment -> why a colocated model could not be loaded in this replica (it answers 503);
        `pool`: the repository's models, served by the pool deployment (serving/server/pool_routes.py)."""
        self.handles, self.tasks, self.router, self.local = handles, tasks, Router(routes), dict(local or {})
        self.failed, self.pool = dict(failed or {}), pool
        self.readiness = ModelReadiness(
            list(handles),
            functools.partial(serve_replica_states, app_name),
            lambda deployment: probe_replicas(self.handles[deployment]),
        )
        self._scraper = RayNodeScraper()
        self._metrics: Cached[str] = Cached(self._scrape, METRICS_TTL_S, METRICS_STALE_S)
        self._versions: Cached[list[ServedVersion]] = Cached(self._ask_versions, VERSIONS_TTL_S)

    def model_tasks(self) -> dict[str, str]:
        return {**self.tasks, **self.pool.tasks()} if self.pool else self.tasks

    def answer_cache(self, model: str) -> ResponseCache | None:
        """The response cache that may keep whole answers for `model` (serving/server/answer_front.py): its
        colocated model's, when that is the model's only route (a canary's weight is never bypassed)."""
        routes = self.router.routes.get(model, [])
        local = self.local.get(routes[0][0]) if len(routes) == 1 else None
        return local.cache if local is not None else None

    def not_found_hint(self) -> str:
        """What a 404 for an unknown model adds: where the repository looks for bundles."""
        return f" (the model repository reads {', '.join(map(str, self.pool.repository.roots))})" if self.pool else ""

    async def model_versions(self) -> list[ServedVersion]:
        return await self._versions.get()

    async def _ask_versions(self) -> list[ServedVersion]:
        """Each deployment's version, from one of its replicas (during a rollout: whichever answers)."""
        asked = [(m, d, w) for m, choices in self.router.routes.items() for d, w in choices]
        infos = await asyncio.gather(*(self._info(d) for _, d, _ in asked), return_exceptions=True)
        return [
            ServedVersion(m, d, info["version"], info["created"], w)
            for (m, d, w), info in zip(asked, infos, strict=True)
            if isinstance(info, dict)
        ] + (self.pool.versions() if self.pool else [])

    async def _info(self, deployment: str) -> dict:
        if deployment in self.local:
            return self.local[deployment].info()
        return await self.handles[deployment].info.remote()

    async def _deployment(self, model: str, version: str | None) -> str:
        """The deployment to send a request for `model` (pinned to `version` if not None) to."""
        if self.pool is not None and self.pool.serves(model):
            self.pool.check_version(model, version)
            return POOL_DEPLOYMENT
        deployment = await self._route(model, version)
        if deployment in self.failed:
            raise ServiceError(
                ErrorKind.UNAVAILABLE,
                f"model {model!r} could not be loaded "
                f"({self.failed[deployment]}); the server's other models are served",
                retry_after_s=FAILED_RETRY_AFTER_S,
            )
        return deployment

    async def _route(self, model: str, version: str | None) -> str:
        if version is None:
            return self.router.pick(model)
        deployment = self.router.serving(model, version, await self.model_versions())
        if deployment is None:  # maybe just rolled out: ask again once
            self._versions.invalidate()
            deployment = self.router.serving(model, version, await self.model_versions())
        if deployment is None:
            served = sorted(s.version for s in await self.model_versions() if s.model == model)
            raise ServiceError(
                ErrorKind.NOT_FOUND,
                f"model {model}@{version[:40]} is not served; versions of {model} served now: {served}",
                field="model",
            )
        return deployment

    async def complete(self, model: str, req: TextRequest) -> TextResult:
        """The model's answer. A replica that dies before answering costs nothing but time: the request is sent
        once more (Serve's router no longer picks a dead replica), with the same seed, so the same output."""
        deployment = await self._deployment(model, req.version)
        if deployment in self.local:
            return await self.local[deployment].complete(req)
        with tracing.span(f"replica {deployment}"):  # the hop to the model's replica, its retry included
            return await self._complete_remote(model, tracing.carried(req), deployment)

    async def _complete_remote(self, model: str, req: TextRequest, deployment: str) -> TextResult:
        for attempt in range(1 + REPLICA_DEATH_RETRIES):
            response, handle = None, self._handle(deployment, model)
            try:
                response = handle.complete.remote(req)
                result = await response
            except asyncio.CancelledError:
                if response is not None:
                    _cancel_quietly(response)
                raise
            except Exception as e:
                if attempt < REPLICA_DEATH_RETRIES and _replica_died(e):
                    log.warning("model %s: the replica died before answering; sending the request again", model)
                    deployment = await self._deployment(model, req.version)  # a canary may be gone for good
                    if deployment in self.local:
                        return await self.local[deployment].complete(req)
                    continue
                raise _as_service_error(e) from None
            if isinstance(result, ServiceError):
                raise result
            return result
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def stream(self, model: str, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult]]:
        """The model's stream in chunks. A replica that dies before the first chunk is retried like `complete`;
        after it, the client has text already, and the stream ends with a retryable error."""
        deployment = await self._deployment(model, req.version)
        if deployment in self.local:
            async with contextlib.aclosing(self.local[deployment].stream(req, across_processes=False)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        for attempt in range(1 + REPLICA_DEATH_RETRIES):
            gen, started, finished, handle = None, False, False, self._handle(deployment, model)
            try:
                # with stream=True the call answers a generator of chunks
                gen = cast(DeploymentResponseGenerator, handle.options(stream=True).stream.remote(req))
                async for chunk in gen:
                    if isinstance(chunk, ServiceError):
                        raise chunk
                    started, finished = True, finished or is_result(chunk[-1])  # after the last: nothing to cancel
                    yield chunk
                finished = True
                return
            except ServiceError:
                raise
            except Exception as e:
                if not started and attempt < REPLICA_DEATH_RETRIES and _replica_died(e):
                    log.warning("model %s: the replica died before streaming; sending the request again", model)
                    continue
                raise _as_service_error(e) from None
            finally:
                if gen is not None and not finished:  # client gone or error: cancel the model's request
                    _cancel_quietly(gen)

    def _handle(self, deployment: str, model: str) -> Any:
        """The deployment's handle; the pool's names the model (Serve routes to a replica that holds it)."""
        if deployment == POOL_DEPLOYMENT and self.pool is not None:
            return self.pool.handle_for(model)
        return self.handles[deployment]

    async def tokenize(self, model: str, text: str, add_special_tokens: bool) -> dict:
        return await self._tokenizer_call(model, "tokenize", text, add_special_tokens)

    async def detokenize(self, model: str, ids: list[int]) -> str:
        return await self._tokenizer_call(model, "detokenize", ids)

    async def _tokenizer_call(self, model: str, method: str, *args: Any) -> Any:
        """ModelService.<method>(*args) of the model, here (colocated) or on one of its replicas."""
        deployment = await self._deployment(model, None)
        if deployment in self.local:
            return getattr(self.local[deployment].service, method)(*args)
        result = await getattr(self._handle(deployment, model), method).remote(*args)
        if isinstance(result, ServiceError):
            raise result
        return result

    async def models_ready(self) -> dict[str, bool]:
        """A model is ready while each of its deployments (stable and canary) has a replica that can serve."""
        ready = {
            **await self.readiness.models_ready(),
            **{d: m.ready() for d, m in self.local.items()},
            **{d: False for d in self.failed},
        }
        pooled = dict.fromkeys(self.pool.tasks(), ready.get(POOL_DEPLOYMENT, False)) if self.pool else {}
        return {**pooled, **{m: all(ready.get(d, False) for d in self.router.deployments(m)) for m in self.tasks}}

    async def metrics_text(self) -> str:
        return await self._metrics.get()

    async def _scrape(self) -> str:
        t0 = time.monotonic()
        texts = await self._scraper.texts()
        text = await asyncio.to_thread(aggregate_exposition, texts)  # filtering megabytes of text: CPU
        self._metrics.ttl_s = max(METRICS_TTL_S, (time.monotonic() - t0) / SCRAPE_SHARE)
        self._metrics.stale_s = self._metrics.ttl_s + METRICS_STALE_S
        return text


def _cancel_quietly(response: Any) -> None:
    """Cancel a handle call; Ray's cancel() re-raises the call's own error if it already failed."""
    try:
        response.cancel()
    except Exception:  # already failed or finished: nothing left to cancel
        pass


def _replica_died(e: BaseException) -> bool:
    """Whether a handle call failed because its replica died or became unreachable (not the request's fault)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(e, (RayActorError, ReplicaUnavailableError))


def _as_service_error(e: BaseException) -> BaseException:
    """The ServiceError inside a Ray error, or Ray's overload / unavailability as one; else `e` itself."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if _replica_died(e):
        return ServiceError(
            ErrorKind.UNAVAILABLE,
            "the model replica serving this request failed and is being restarted; retry the request",
            retry_after_s=1.0,
            reason="replica_failed",
        )
    inner = getattr(e, "cause", None) or e  # Ray wraps a replica's exception in a RayTaskError
    if isinstance(inner, ServiceError):
        return inner
    if isinstance(inner, BackPressureError):
        return ServiceError(
            ErrorKind.OVERLOADED,
            f"server overloaded (deployment queue full): {inner.message}",
            retry_after_s=inner.retry_after_s or 1.0,
            reason="deployment_queue_full",
        )
    if isinstance(inner, DeploymentUnavailableError):
        return ServiceError(ErrorKind.UNAVAILABLE, f"model unavailable: {inner.message}")
    if isinstance(inner, AdmissionRejected):  # not expected: the service converts it
        return ServiceError(ErrorKind.OVERLOADED, str(inner), retry_after_s=inner.retry_after_s)
    return e


def _utilization(stats: dict[str, float]) -> float:
    return (stats.get("running", 0.0) + stats.get("waiting", 0.0)) / max(stats.get("slots_total", 0.0), 1.0)


@serve.deployment
@serve.ingress()
class Ingress:
    # Serve awaits an async constructor; to mypy an `async def __init__` returns a coroutine, not None
    async def __init__(  # type: ignore[misc]
        self,
        args: dict,
        tasks: dict[str, str],
        routes: dict[str, list[tuple[str, float]]],
        local: dict[str, tuple[dict, str]],
        **handles: DeploymentHandle,
    ) -> None:
        """`local`: deployment name -> (ModelSpec, bundle dir) of each colocated model, loaded here."""
        bind_replica_grpc_to_node()
        tracing.configure()  # on when an OTLP endpoint is configured (serving/server/tracing.py)
        self.args, self.tasks, self.routes, self.handles = AppArgs.model_validate(args), tasks, routes, handles
        self.drain = Drain()
        self.app_name = serve.get_replica_context().app_name  # whose replicas readiness counts
        self.recorder = Recorder("ray")
        self.local: dict[str, LocalModel] = {}
        self.failed: dict[str, str] = {}
        for deployment, (spec, bundle_dir) in local.items():
            try:
                self.local[deployment] = await LocalModel.load(
                    ModelSpec.model_validate(spec),
                    bundle_dir,
                    self.args.limits,
                    BatchingKnobs(),
                    self.recorder,
                    deployment=deployment,
                )
            except Exception as e:  # one model that cannot load (a damaged bundle, no memory) must not take the
                if not handles and len(self.failed) + 1 == len(local):  # others down; with none left, fail
                    raise
                log.error(
                    "model deployment %s could not be loaded from %s; serving the others: %r", deployment, bundle_dir, e
                )
                self.failed[deployment] = f"{type(e).__name__}: {e}"[:300]

    def __serve_build_asgi_app__(self) -> Any:
        repo, pool = self.args.repository, None
        if repo is not None and POOL_DEPLOYMENT in self.handles:
            pool = PoolRoutes(
                Repository(repo.paths, repo.rescan_s),
                self.handles[POOL_DEPLOYMENT],
                set(self.tasks),
                replicas=MAX_POOL_REPLICAS,
            )
        backend = RayBackend(self.handles, self.tasks, self.routes, self.app_name, self.local, self.failed, pool)
        return create_app(
            backend,
            self.args.limits,
            self.recorder,
            self.args.resolved_api_key(),
            self.drain,
            self.args.metrics_require_key,
        )

    async def reconfigure(self, user_config: dict) -> None:
        """`draining: true` refuses new API requests from now on (serving/server/drain.py); false resumes.
        `models.<name>`: the batching knobs of a colocated model, applied live."""
        knobs = IngressKnobs.model_validate(user_config or {})
        self.drain.set_draining(knobs.draining)
        for model in self.local.values():
            model.reconfigure(knobs.models.get(model.spec.name, BatchingKnobs()))
        log.info("ingress %s", "draining: new requests get 503" if knobs.draining else "serving")

    # -- the colocated models' engines (none: these do nothing) -----------------------------------------
    async def model_info(self, model: str) -> dict:
        """A colocated model's `LocalModel.info()` (what a model deployment's `info` says), from this replica."""
        return self.local[model].info()

    async def check_health(self) -> None:
        for model in self.local.values():
            model.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The load of the busiest colocated engine, (running + waiting) over its KV slots (serving/server/
        autoscale.py): the replicas scale for the model that needs them; empty when there are none."""
        loads = [model.load_stats() for model in self.local.values()]
        return max(loads, key=_utilization, default={})

    async def __del__(self) -> None:
        """Serve waits (graceful_shutdown_*) for ongoing requests first; then the colocated engines stop."""
        for model in getattr(self, "local", {}).values():
            await model.stop(drain_timeout_s=30.0)

    async def drain_status(self) -> dict:
        """This replica's phase, requests in flight and process id (serving/server/launch.py `drain` polls every
        replica)."""
        return {"replica": serve.get_replica_context().replica_id.unique_id, "pid": os.getpid(), **self.drain.status()}
