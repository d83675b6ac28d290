"""The HTTP ingress: the FastAPI app of serving/server/api.py served by a Ray Serve deployment.

`Ingress` serves the app with `RayBackend`, which calls the model deployments through handles (streaming
ones for SSE), turns Ray's overload errors into 429s and a replica that died or is gone into a 503 that can
be retried, and cancels the model's request when the HTTP client goes away. Its `reconfigure` (user_config
`IngressKnobs`) drains the replica for a graceful shutdown.

Does not own: the routes (api.py), the model replicas (replica.py), the app graph (app.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.engine.types import AdmissionRejected
from serving.server.config import AppArgs, IngressKnobs
from serving.server.errors import ErrorKind, ServiceError
from serving.server.api import create_app
from serving.server.drain import Drain
from serving.server.metrics import Recorder, aggregate_exposition, scrape_ray_nodes
from serving.server.service import StreamPiece, TextRequest, TextResult

log = logging.getLogger("ray.serve")
READY_TIMEOUT_S = 2.0


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
        self.args, self.tasks, self.handles = AppArgs.model_validate(args), tasks, handles
        self.drain = Drain()

    def __serve_build_asgi_app__(self) -> Any:
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
