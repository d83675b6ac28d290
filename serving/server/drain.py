"""Graceful drain of one ingress replica: count in-flight API requests, refuse new ones while draining.

Owns: the replica's `Phase` (serving or draining), the count of /v1 requests in flight (a streamed response
counts until its last byte), and the `DrainGate` ASGI middleware that answers a new /v1 request with
503 + Retry-After while draining. Readiness (/v2/health/ready, serving/server/api.py) answers 503 while draining,
so a load balancer stops sending traffic; liveness and /metrics keep answering.

Who drains: `kvserve serve` on Ctrl-C/SIGTERM (serving/server/launch.py `stop` -> `drain`) redeploys the Serve
config with the ingress's `user_config: {draining: true}` (serving/server/config.py `IngressKnobs`); each ingress
replica's `reconfigure` (serving/server/app.py) switches to DRAINING at once, and `drain` polls every replica's
`drain_status` until all are draining with nothing in flight, then the applications are deleted. The wait
is not inside `reconfigure`: Serve takes a replica out of routing while it reconfigures, so new requests
would queue in the proxy instead of getting their 503. `draining: false` resumes serving.

Does not own: the engine's own drain (serving/engine/engine.py `Engine.stop`), the 503 answer itself (its body and
Retry-After: serving/server/errors.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from serving.server.asgi import is_api_request
from serving.server.errors import ErrorKind, error_response

RETRY_AFTER_S = 1
DRAINING_MESSAGE = "this server is shutting down (draining); retry the request, it will reach another replica"


class Phase(str, Enum):
    SERVING = "serving"
    DRAINING = "draining"


class Drain:
    """The drain state of one ingress replica (one event loop: plain attributes need no lock)."""

    def __init__(self) -> None:
        self.phase = Phase.SERVING
        self.in_flight = 0

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

    def set_draining(self, draining: bool) -> None:
        self.phase = Phase.DRAINING if draining else Phase.SERVING

    def status(self) -> dict:
        return {"phase": self.phase.value, "in_flight": self.in_flight}


class DrainGate:
    """Counts /v1 requests in flight; while draining, refuses new ones with 503 + Retry-After."""

    def __init__(self, app: Callable, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not is_api_request(scope):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            response = error_response(ErrorKind.UNAVAILABLE, DRAINING_MESSAGE, retry_after_s=RETRY_AFTER_S)
            return await response(scope, receive, send)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
