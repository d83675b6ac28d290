"""Readiness of the models behind an ingress, from Ray Serve's own view of their replicas.

A model is ready while at least one of its replicas is RUNNING in Serve's status: started and warmed up,
passing its health checks (serving/server/replica.py `check_health` fails once the engine is dead: steps that
keep failing, or one that runs past `step_timeout_s`), and not shutting down. Replicas are counted rather
than asked through the deployment handle: asking one replica picked by Serve's router lets one dead or
draining replica fail the probe of every pod at once, while one failed replica of two leaves the count at one.
The server as a whole (`/v2/health/ready`, serving/server/api.py) is ready while some model is.

Serve's status comes from its controller by a blocking call, so it runs in a worker thread, and the answer
is shared by every probe for `READY_TTL_S` (serving/server/cached.py): probes at any rate cost one controller
call per second per ingress replica. When the controller cannot answer (it is restarting, say), the replicas
are asked instead (`probe_replicas`), each model up to PROBE_TRIES times: a call that reaches a dead replica
fails, Serve's router drops that replica, and the next try reaches another one.

Does not own: the HTTP answers (serving/server/api.py), a replica's own health (replica.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from serving.server.cached import Cached

log = logging.getLogger(__name__)
READY_TTL_S = 1.0
PROBE_TRIES = 3
PROBE_TIMEOUT_S = 1.0
RUNNING = "RUNNING"  # Serve's ReplicaState of a replica that serves


def serve_replica_states(app: str) -> dict[str, dict[str, int]]:
    """deployment -> {replica state: count} of the Serve application `app`, from the controller (blocking)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        raise LookupError(f"Serve's status has no application {app!r}")
    return {
        name: {getattr(state, "value", str(state)): int(n) for state, n in d.replica_states.items()}
        for name, d in status.deployments.items()
    }


async def probe_replicas(handle: Any, tries: int = PROBE_TRIES, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True once one of up to `tries` calls of the model deployment's `ready` says so."""
    for _ in range(tries):
        try:
            if await asyncio.wait_for(handle.ready.remote(), timeout_s):
                return True
        except Exception:  # a dead replica, or one too busy to answer in time: ask again
            continue
    return False


class ModelReadiness:
    """`models_ready()`: model -> whether at least one replica can serve it, at most `ttl_s` old."""

    def __init__(
        self,
        models: list[str],
        states: Callable[[], dict[str, dict[str, int]]],
        probe: Callable[[str], Awaitable[bool]],
        ttl_s: float = READY_TTL_S,
    ) -> None:
        self.models = list(models)
        self._states, self._probe = states, probe
        self._cached: Cached[dict[str, bool]] = Cached(self._fetch, ttl_s)

    async def models_ready(self) -> dict[str, bool]:
        return await self._cached.get()

    async def _fetch(self) -> dict[str, bool]:
        try:
            states = await asyncio.to_thread(self._states)
        except Exception as e:
            log.warning("Serve's replica states are unavailable (%r); asking the replicas instead", e)
            return dict(zip(self.models, await asyncio.gather(*(self._probe(m) for m in self.models)), strict=True))
        return {m: states.get(m, {}).get(RUNNING, 0) > 0 for m in self.models}
