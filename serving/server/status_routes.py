"""The routes that describe the server rather than run a model: GET /v1/models (OpenAI's list, with versions),
GET /v2/health/live and /v2/health/ready (the server), GET /v2/models/{name}/ready and GET /v2/models/{name}
(KServe v2: one model's readiness and metadata), and GET /metrics (the backend's exposition, gzipped on request).

serving/server/api.py builds the app and registers these next to the inference routes. Does not own: the
readiness of each model (the backend's `models_ready`, serving/server/readiness.py in production), the
exposition itself (serving/server/metrics.py), errors (a route raises `ServiceError`; serving/server/errors.py
answers it).
"""

from __future__ import annotations

import gzip

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from serving.server.backend import Backend
from serving.server.drain import DRAINING_MESSAGE, RETRY_AFTER_S, Drain
from serving.server.errors import ErrorKind, ServiceError

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# /metrics open to anyone: a shared cache (the HAProxy in front, serving/server/haproxy.py) may answer it for 1 s,
# as fresh as the backend's own scrape cache, so a flood of scrapers never reaches the ingress more than once a
# second. Behind the key: no cache keeps or hands out an answer.
METRICS_CACHE_CONTROL = {False: "public, max-age=1", True: "private, no-store"}


# A model's inputs and outputs in KServe v2 metadata: texts, one per row (the JSON API's fields).
V2_TENSORS = {
    "translate": {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "translations", "datatype": "BYTES", "shape": [-1]}],
    },
    "generate": {
        "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
    },
}


class StatusRoutes:
    def __init__(self, backend: Backend, drain: Drain, metrics_cache_control: str) -> None:
        self.backend, self.drain = backend, drain
        self._metrics_headers = {"Vary": "Accept-Encoding", "Cache-Control": metrics_cache_control}
        self._gzipped: tuple[str | None, bytes] = (None, b"")  # (exposition, its gzip)

    async def models(self) -> dict:
        """One entry per model (its stable version; `versions` lists every bundle served with its share of the
        traffic), then one per served version, `model@version`, which a request may name to pin it."""
        served = await self.backend.model_versions()
        data = []
        for name, task in self.backend.model_tasks().items():
            mine = sorted((s for s in served if s.model == name), key=lambda s: -s.weight)
            entry = {
                "id": name,
                "object": "model",
                "created": mine[0].created if mine else 0,
                "owned_by": "kvserve",
                "task": task,
                "version": mine[0].version if mine else None,
                "versions": [{"version": s.version, "created": s.created, "weight": s.weight} for s in mine],
            }
            data.append(entry)
            data += [
                {
                    "id": f"{name}@{s.version}",
                    "object": "model",
                    "created": s.created,
                    "owned_by": "kvserve",
                    "task": task,
                    "version": s.version,
                    "parent": name,
                }
                for s in mine
            ]
        return {"object": "list", "data": data}

    async def live(self) -> dict:
        return {"status": "live"}

    async def ready(self) -> JSONResponse:
        """200 while some model has a replica that can serve ("ready" when every one has, else "degraded", naming
        those that cannot): a pod whose probe this is stays in the Service while it can serve any model, so one
        failing model (or canary) does not take the healthy ones down with it. 503 when none can, or draining.
        Each model's own readiness: /v2/models/{name}/ready."""
        if self.drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        ready = await self.backend.models_ready()
        not_ready = sorted(name for name, ok in ready.items() if not ok)
        if ready and len(not_ready) == len(ready):
            return JSONResponse({"status": "not_ready", "not_ready": not_ready}, status_code=503)
        if not_ready:
            return JSONResponse({"status": "degraded", "not_ready": not_ready})
        return JSONResponse({"status": "ready"})

    async def model_metadata(self, name: str) -> dict:
        """KServe v2 model metadata: the versions served (the most traffic first), the platform, the task and
        the request's and answer's text fields as v2 tensors (BYTES). Behind the API key (it names versions)."""
        tasks = self.backend.model_tasks()
        _require_served(name, tasks)
        served = sorted((s for s in await self.backend.model_versions() if s.model == name), key=lambda s: -s.weight)
        return {
            "name": name,
            "versions": [s.version for s in served],
            "platform": "onnxruntime",
            "task": tasks[name],
            **V2_TENSORS[tasks[name]],
        }

    async def model_ready(self, name: str) -> dict:
        """KServe v2 model readiness: 200 while at least one replica of the model can serve, else 503."""
        tasks = self.backend.model_tasks()
        # open without the API key (a probe): the answer names no model; GET /v1/models lists them, behind it
        _require_served(name, tasks)
        if self.drain.draining:
            raise ServiceError(ErrorKind.UNAVAILABLE, DRAINING_MESSAGE, retry_after_s=RETRY_AFTER_S)
        if not (await self.backend.models_ready()).get(name, False):
            raise ServiceError(
                ErrorKind.UNAVAILABLE,
                f"model {name!r} has no replica that can serve now (starting, being replaced or failed); retry later",
                retry_after_s=1.0,
            )
        return {"name": name, "ready": True}

    async def metrics(self, request: Request) -> Response:
        """The backend's exposition (it caches it), gzipped when the client accepts it, as Prometheus does:
        ~20x fewer bytes through Ray's proxy. The gzip is made once per exposition the backend hands out."""
        text = await self.backend.metrics_text()
        headers = self._metrics_headers
        if "gzip" not in request.headers.get("accept-encoding", ""):
            return Response(text, media_type=METRICS_TYPE, headers=headers)
        if self._gzipped[0] is not text:
            self._gzipped = (text, gzip.compress(text.encode(), 6))
        return Response(self._gzipped[1], media_type=METRICS_TYPE, headers={**headers, "Content-Encoding": "gzip"})


def _require_served(name: str, tasks: dict[str, str]) -> None:
    """404 for a model this server does not serve; the answer names no other model."""
    if name not in tasks:
        raise ServiceError(
            ErrorKind.NOT_FOUND,
            f"model {name[:120]!r} is not served; GET /v1/models lists the models served",
            field="name",
        )
