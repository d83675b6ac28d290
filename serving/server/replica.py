"""A model replica: the Ray Serve deployment that owns one model's engine, reached by the ingress's handles.

`ModelDeployment` is a thin shim around a `LocalModel` (local_model.py: the Engine and its ModelService,
warm-up, gauges, health, load): it applies the batching knobs live in `reconfigure(user_config)`, reports the
engine's load to Serve's autoscaler (`record_autoscaling_stats`, read by serving/server/autoscale.py), fails
its health check when the engine is dead (Ray then replaces the replica), and drains in-flight requests on
shutdown. Errors the client caused come back as values (see `complete`).

A `colocated` model has no such deployment: the ingress replica holds its LocalModel (ingress.py).

Does not own: HTTP (serving/server/ingress.py, api.py), the engine, the text <-> token work (service.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from serving.engine.config import BatchingKnobs
from serving.server import tracing
from serving.server.config import Limits, ModelSpec
from serving.server.errors import ServiceError
from serving.server.local_model import LocalModel
from serving.server.metrics import Recorder
from serving.server.ray_env import bind_replica_grpc_to_node
from serving.server.text_types import StreamPiece, TextRequest, TextResult


@serve.deployment
class ModelDeployment:
    # Serve awaits an async constructor; to mypy an `async def __init__` returns a coroutine, not None
    async def __init__(self, spec: dict, bundle_dir: str, limits: dict) -> None:  # type: ignore[misc]
        bind_replica_grpc_to_node()
        tracing.configure()  # on when an OTLP endpoint is configured (serving/server/tracing.py)
        self.model = await LocalModel.load(
            ModelSpec.model_validate(spec),
            bundle_dir,
            Limits.model_validate(limits),
            BatchingKnobs(),
            Recorder("ray"),
            deployment=serve.get_replica_context().deployment,
        )
        self.engine = self.model.engine

    async def reconfigure(self, user_config: dict) -> None:
        self.model.reconfigure(BatchingKnobs.model_validate(user_config or {}))

    # -- called by the ingress --------------------------------------------------------------------------
    # A ServiceError (the client's fault, or overload) is returned as a value, not raised: Ray would log
    # every 4xx as a failed request with a traceback. RayBackend raises it again on the ingress side.
    async def complete(self, req: TextRequest) -> TextResult | ServiceError:
        try:
            return await self.model.complete(req)
        except ServiceError as e:
            return e

    async def stream(self, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult] | ServiceError]:
        """The request's pieces in chunks (serving/server/chunks.py): one Ray item per chunk, not per token."""
        try:
            async for chunk in self.model.stream(req):
                yield chunk
        except ServiceError as e:
            yield e

    async def tokenize(self, text: str, add_special_tokens: bool) -> dict | ServiceError:
        return self.model.service.tokenize(text, add_special_tokens)

    async def detokenize(self, ids: list[int]) -> str | ServiceError:
        try:
            return self.model.service.detokenize(ids)
        except ServiceError as e:
            return e

    async def ready(self) -> bool:
        return self.model.ready()

    async def info(self) -> dict:
        return self.model.info()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.model.load_stats()

    # -- lifecycle ------------------------------------------------------------------------------------
    async def check_health(self) -> None:
        self.model.check_health()

    async def __del__(self) -> None:
        """Serve waits (graceful_shutdown_*) for ongoing requests first; then the engine drains and stops."""
        if hasattr(self, "model"):
            await self.model.stop(drain_timeout_s=30.0)
