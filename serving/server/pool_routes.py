"""How the ingress reaches the models of a repository: through the pool deployment, by model name.

Owns: which names the pool serves (every model the repository holds, beside the Serve config's own models, which
win on a name clash), their tasks and versions for the API's listing and checks, the handle of a request (the pool's,
with `multiplexed_model_id` set to the model's name, so Serve routes it to a replica that holds the model), and the
operators' load / unload of a model (the admin routes: serving/server/repository_routes.py).

Does not own: the repository's folders (serving/server/repository.py), what a pool replica holds
(serving/server/model_pool.py, pool_deployment.py).
"""

from __future__ import annotations

from typing import Any

from ray.serve.handle import DeploymentHandle

from serving.server.errors import ErrorKind, ServiceError
from serving.server.placement import POOL_DEPLOYMENT
from serving.server.repository import Repository
from serving.server.versions import ServedVersion

__all__ = ["POOL_DEPLOYMENT", "PoolRoutes"]


class PoolRoutes:
    def __init__(self, repository: Repository, handle: DeploymentHandle, fixed: set[str], replicas: int) -> None:
        """`fixed`: the Serve config's own model names; `replicas`: how many pool replicas an unload asks at most."""
        self.repository, self.handle, self.fixed, self.replicas = repository, handle, fixed, replicas

    def tasks(self) -> dict[str, str]:
        return {e.name: e.task for e in self.repository.entries() if e.name not in self.fixed and e.task}

    def serves(self, model: str) -> bool:
        return model not in self.fixed and model in self.tasks()

    def versions(self) -> list[ServedVersion]:
        return [
            ServedVersion(e.name, POOL_DEPLOYMENT, e.version, int(e.path.stat().st_mtime), 100.0)
            for e in self.repository.entries()
            if e.name not in self.fixed and e.version
        ]

    def check_version(self, model: str, version: str | None) -> None:
        entry = self.repository.get(model)
        if version is not None and version != entry.version:
            raise ServiceError(
                ErrorKind.NOT_FOUND,
                f"model {model}@{version[:40]} is not in the repository; its version there is {entry.version}",
                field="model",
            )

    def handle_for(self, model: str) -> Any:
        return self.handle.options(multiplexed_model_id=model)

    def index(self) -> list[dict[str, object]]:
        """Triton's repository index: every model with its task, version, size (and why it cannot load)."""
        return [e.listing() for e in self.repository.entries() if e.name not in self.fixed]

    async def load(self, model: str) -> dict[str, Any]:
        """Loads `model` on a pool replica (the one Serve routes it to) and says what that replica holds."""
        return {"model": model, "loaded": True, "replica_holds": await self._on_one("load", model)}

    async def pin(self, model: str) -> dict[str, Any]:
        """Loads `model` on a pool replica (the one Serve routes it to) and pins it there: never evicted."""
        return {"model": model, "pinned": True, "replica_holds": await self._on_one("pin", model)}

    async def unpin(self, model: str) -> dict[str, Any]:
        """Makes `model` evictable again on the pool replicas that pinned it."""
        return {"model": model, "unpinned_on_replicas": await self._on_holders("unpin", model)}

    async def unload(self, model: str) -> dict[str, Any]:
        """Evicts `model` from the pool replicas that hold it (Serve routes each call to one that does)."""
        return {"model": model, "unloaded_from_replicas": await self._on_holders("unload", model)}

    async def _on_one(self, method: str, model: str) -> Any:
        """PoolDeployment.<method>() on the replica Serve routes `model` to: what that replica holds."""
        self.repository.get(model)
        held = await getattr(self.handle_for(model), method).remote()
        if isinstance(held, ServiceError):
            raise held
        return held

    async def _on_holders(self, method: str, model: str) -> int:
        """PoolDeployment.<method>(model) on each replica the router knows to hold `model`, until one says it did
        nothing; how many did it."""
        self.repository.get(model)
        done = 0
        for _ in range(self.replicas):
            if not await getattr(self.handle_for(model), method).remote(model):
                break
            done += 1
        return done
