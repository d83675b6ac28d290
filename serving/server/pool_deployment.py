"""The model pool's Ray Serve deployment: replicas that each hold up to `max_models` models of the repository.

Each replica is a `ModelPool` (serving/server/model_pool.py: load on a model's first request, evict the least
recently used idle one). Requests reach it through the ingress's handle with `multiplexed_model_id` set to the
model's name: Ray Serve's model multiplexing routes a request to a replica that already holds (or is loading) that
model when there is one, else to the least loaded replica, which loads it. The replica reports what it holds through
`@serve.multiplexed`; its own limit is off (`-1`) because the pool decides what to evict (never a pinned model or one
with requests in flight, which Serve's LRU would), and tells Serve's router when it has (`_forget`).

Like a model's own deployment (serving/server/replica.py), errors the client caused come back as values, the
engines' load feeds Serve's autoscaler (summed over the models held), and shutdown drains.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from serving.server import tracing
from serving.server.config import AppArgs
from serving.server.errors import ServiceError
from serving.server.local_model import ENGINE_LOAD_KEYS
from serving.server.metrics import Recorder
from serving.server.model_pool import ModelPool
from serving.server.ray_env import bind_replica_grpc_to_node
from serving.server.repository import Repository
from serving.server.service import StreamPiece, TextRequest, TextResult

log = logging.getLogger(__name__)
MULTIPLEX_ATTR = "__serve_multiplex_wrapper"  # where @serve.multiplexed keeps its wrapper on the instance


@serve.deployment
class PoolDeployment:
    # Serve awaits an async constructor; to mypy an `async def __init__` returns a coroutine, not None
    async def __init__(self, args: dict[str, Any]) -> None:  # type: ignore[misc]
        bind_replica_grpc_to_node()
        tracing.configure()
        parsed = AppArgs.model_validate(args)
        repo = parsed.repository
        assert repo is not None, "the pool deployment needs args.repository"
        self.pool = ModelPool(
            Repository(repo.paths, repo.rescan_s),
            parsed.limits,
            Recorder("ray"),
            max_models=repo.max_models_per_replica,
            max_bytes=repo.max_bytes_per_replica,
            pinned=tuple(repo.pinned),
            load_timeout_s=repo.load_timeout_s,
            engine=repo.engine,
            on_evict=self._forget,
        )
        for name in repo.pinned:  # warm at start on every replica, never evicted
            await self._routed(name)

    @serve.multiplexed(max_num_models_per_replica=-1)
    async def _routed(self, name: str) -> str:
        """Loads the model (the pool's own bound applies) and registers it with Serve's router."""
        await self.pool.get(name)
        return name

    def _forget(self, name: str) -> None:
        """The pool evicted `name`: Serve's router must stop sending its requests here first."""
        wrapper = getattr(self, MULTIPLEX_ATTR, None)
        if wrapper is not None:
            wrapper.models.pop(name, None)
            wrapper._push_multiplexed_replica_info = True

    async def _model_name(self) -> str:
        name = serve.get_multiplexed_model_id()
        await self._routed(name)
        return name

    # -- called by the ingress ------------------------------------------------------------------------
    async def complete(self, req: TextRequest) -> TextResult | ServiceError:
        try:
            return await self.pool.complete(await self._model_name(), req)
        except ServiceError as e:
            return e

    async def stream(self, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult] | ServiceError]:
        try:
            async for chunk in self.pool.stream(await self._model_name(), req):
                yield chunk
        except ServiceError as e:
            yield e

    async def tokenize(self, text: str, add_special_tokens: bool) -> dict | ServiceError:
        try:
            return (await self.pool.get(await self._model_name())).service.tokenize(text, add_special_tokens)
        except ServiceError as e:
            return e

    async def detokenize(self, ids: list[int]) -> str | ServiceError:
        try:
            return (await self.pool.get(await self._model_name())).service.detokenize(ids)
        except ServiceError as e:
            return e

    async def held(self) -> list[dict[str, Any]]:
        return self.pool.held()

    async def load(self) -> list[dict[str, Any]] | ServiceError:
        """Loads the request's model (an operator's load) and says what this replica holds."""
        try:
            await self._model_name()
        except ServiceError as e:
            return e
        return self.pool.held()

    async def ready(self) -> bool:
        """Whether this replica can serve: it has started (it loads its models on demand)."""
        return all(model.ready() for model, _ in self.pool.models.values())

    async def unload(self, name: str) -> bool:
        self.pool.unpin(name)
        return await self.pool.unload(name)

    async def pin(self) -> list[dict[str, Any]] | ServiceError:
        """Pins the request's model on this replica (loaded if it is not) and says what this replica holds."""
        try:
            await self.pool.pin(await self._model_name())
        except ServiceError as e:
            return e
        return self.pool.held()

    async def unpin(self, name: str) -> bool:
        return self.pool.unpin(name)

    def record_autoscaling_stats(self) -> dict[str, float]:
        totals = dict.fromkeys(ENGINE_LOAD_KEYS, 0.0)
        for model, _ in self.pool.models.values():
            for key, value in model.load_stats().items():
                totals[key] += value
        return totals

    # -- lifecycle ------------------------------------------------------------------------------------
    async def check_health(self) -> None:
        for model, _ in list(self.pool.models.values()):
            model.check_health()

    async def __del__(self) -> None:
        if hasattr(self, "pool"):
            await self.pool.close()
