"""The model repository's admin routes (Triton's repository API), on a server with `args.repository`.

GET /v2/repository/index lists every model of the repository (task, version, size; why one cannot load); POST
/v2/repository/models/{name}/load loads a model on a pool replica (the one Serve routes it to) and POST
/v2/repository/models/{name}/unload evicts it from the pool replicas that hold it; .../pin loads it on a replica
and never evicts it there, .../unpin makes it evictable again. Behind the API key like every
route but the health probes. Does not own: the pool (serving/server/pool_routes.py, model_pool.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI


def add_repository_routes(app: FastAPI, backend: Any) -> None:
    """Registers the routes when the backend serves a repository (`backend.pool`); otherwise nothing."""
    pool = getattr(backend, "pool", None)
    if pool is None:
        return

    async def index() -> dict[str, Any]:
        return {"models": pool.index()}

    async def load(name: str) -> dict[str, Any]:
        return await pool.load(name)

    async def unload(name: str) -> dict[str, Any]:
        return await pool.unload(name)

    async def pin(name: str) -> dict[str, Any]:
        return await pool.pin(name)

    async def unpin(name: str) -> dict[str, Any]:
        return await pool.unpin(name)

    app.get("/v2/repository/index")(index)
    app.post("/v2/repository/models/{name}/load")(load)
    app.post("/v2/repository/models/{name}/unload")(unload)
    app.post("/v2/repository/models/{name}/pin")(pin)
    app.post("/v2/repository/models/{name}/unpin")(unpin)
