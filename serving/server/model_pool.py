"""The models one replica holds out of a repository: loaded on a model's first request, the least recently used
idle one evicted to make room.

Owns: loading a model (`LocalModel.load`: its bundle verified, its engine started and warmed up, its own continuous
batch) on its first request, one load at a time per model (the requests that arrive meanwhile wait for it, within
their deadline); the bound on what a replica holds (`max_models`, and `max_bytes` of bundles); eviction: the least
recently used model that has no request in flight and is not pinned goes first (its engine stopped); when every
model held is busy or pinned, a cold request waits for one to become idle within `load_timeout_s`, then gets a 503
with Retry-After instead of waiting without bound; pinned models (warm: loaded at start and never evicted; the
admin routes pin, unpin and unload at run time); and the metrics of all of it:
kvserve_model_loads_total, kvserve_model_evictions_total, kvserve_model_load_seconds, kvserve_model_bytes (per
model held, 0 once evicted).

Does not own: the repository's listing (serving/server/repository.py), routing a request to a replica that holds
its model (Ray Serve's model multiplexing, serving/server/pool_deployment.py), serving a loaded model (LocalModel).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.engine.config import BatchingKnobs, ReplicaKnobs
from serving.server.config import Limits, ModelSpec
from serving.server.errors import ErrorKind, ServiceError
from serving.server.local_model import LocalModel
from serving.server.metrics import Recorder
from serving.server.repository import Entry, Repository
from serving.server.service import StreamPiece, TextRequest, TextResult

log = logging.getLogger(__name__)
RETRY_AFTER_S = 2.0  # a cold model that cannot load now: how long a client waits before trying again


class ModelPool:
    def __init__(
        self,
        repository: Repository,
        limits: Limits,
        recorder: Recorder | None,
        max_models: int,
        max_bytes: int | None = None,
        pinned: tuple[str, ...] = (),
        load_timeout_s: float = 60.0,
        engine: ReplicaKnobs | None = None,
        live: BatchingKnobs | None = None,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        """`on_evict(name)` is called when a model is evicted or unloaded (the router must stop sending it here)."""
        if len(pinned) > max_models:
            raise ValueError(f"{len(pinned)} pinned models do not fit in max_models={max_models}")
        self.repository, self.limits, self.recorder = repository, limits, recorder
        self.max_models, self.max_bytes, self.pinned = max_models, max_bytes, frozenset(pinned)
        self.load_timeout_s = load_timeout_s
        self.engine_knobs, self.live = engine or ReplicaKnobs(), live or BatchingKnobs()
        self.models: OrderedDict[str, tuple[LocalModel, Entry]] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Task[LocalModel]] = {}
        self._busy: dict[str, int] = {}  # requests in flight per model
        self._lock = asyncio.Lock()  # one eviction decision at a time
        self._freed = asyncio.Event()  # set whenever a request ends: a model may have become evictable
        self._on_evict = on_evict

    # -- requests -------------------------------------------------------------------------------------
    async def complete(self, name: str, req: TextRequest) -> TextResult:
        model = await self.get(name)
        self._busy[name] = self._busy.get(name, 0) + 1
        try:
            return await model.complete(req)
        finally:
            self._done(name)

    async def stream(self, name: str, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult]]:
        model = await self.get(name)
        self._busy[name] = self._busy.get(name, 0) + 1
        try:
            async for chunk in model.stream(req):
                yield chunk
        finally:
            self._done(name)

    async def get(self, name: str) -> LocalModel:
        """The model, loaded if it is not (a 404 if the repository has none of that name)."""
        held = self.models.get(name)
        if held is not None:
            self.models.move_to_end(name)
            return held[0]
        entry = self.repository.get(name)
        task = self._loading.get(name)
        if task is None:
            task = self._loading[name] = asyncio.ensure_future(self._load(entry))
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        # shielded: a waiter that goes away (its deadline, a disconnect) does not cancel the load the others await;
        # the wait for room is bounded by load_timeout_s (_make_room), the request by its own deadline
        return await asyncio.shield(task)

    # -- operators ------------------------------------------------------------------------------------
    async def warm(self, names: list[str]) -> None:
        """Load `names` (the pinned models at start)."""
        for name in names:
            await self.get(name)

    async def pin(self, name: str) -> None:
        """Load `name` here if it is not, and never evict it (until `unpin`). At least one place stays evictable."""
        if name not in self.pinned and len(self.pinned) + 1 >= self.max_models:
            raise ServiceError(
                ErrorKind.INVALID,
                f"pinning {name!r} would leave no room for other models: this replica holds at most "
                f"{self.max_models} and pins {sorted(self.pinned)}; unpin one first",
                field="name",
            )
        await self.get(name)
        self.pinned = self.pinned | {name}

    def unpin(self, name: str) -> bool:
        """Make `name` evictable again; False if it was not pinned."""
        was = name in self.pinned
        self.pinned = self.pinned - {name}
        return was

    async def unload(self, name: str, drain_timeout_s: float = 30.0) -> bool:
        """Evict a model now (its requests in flight finish first, up to `drain_timeout_s`); False if not held."""
        async with self._lock:
            held = self.models.pop(name, None)
        if held is None:
            return False
        await self._stop(name, held, drain_timeout_s)
        return True

    def held(self) -> list[dict[str, Any]]:
        return [
            {
                "id": n,
                "version": e.version,
                "bytes": e.bytes,
                "pinned": n in self.pinned,
                "in_flight": self._busy.get(n, 0),
            }
            for n, (_, e) in self.models.items()
        ]

    async def close(self) -> None:
        for name in list(self.models):
            await self.unload(name)

    # -- internals ------------------------------------------------------------------------------------
    def _done(self, name: str) -> None:
        self._busy[name] -= 1
        self._freed.set()

    async def _load(self, entry: Entry) -> LocalModel:
        async with self._lock:  # room first: a load never overshoots the bounds
            await self._make_room(entry)
            spec = ModelSpec(name=entry.name, bundle=entry.path, engine=self.engine_knobs)
            t0 = time.monotonic()
            model = await LocalModel.load(spec, str(entry.path), self.limits, self.live, self.recorder)
            seconds = time.monotonic() - t0
            self.models[entry.name] = (model, entry)
        labels = {"model": entry.name, "version": entry.version or ""}
        if self.recorder:
            self.recorder.inc("kvserve_model_loads_total", labels)
            self.recorder.observe("kvserve_model_load_seconds", labels, seconds)
            self.recorder.set("kvserve_model_bytes", labels, float(entry.bytes))
        log.info(
            "pool: loaded %s (version %s, %.1f MB) in %.2fs; holds %s",
            entry.name,
            entry.version,
            entry.bytes / 1e6,
            seconds,
            list(self.models),
        )
        return model

    async def _make_room(self, entry: Entry) -> None:
        def over() -> bool:
            held = sum(e.bytes for _, e in self.models.values())
            return len(self.models) + 1 > self.max_models or (
                self.max_bytes is not None and held + entry.bytes > self.max_bytes
            )

        if self.max_bytes is not None and entry.bytes > self.max_bytes:
            raise ServiceError(
                ErrorKind.UNAVAILABLE,
                f"model {entry.name!r} ({entry.bytes / 1e6:.1f} MB) is larger "
                f"than a replica's max_bytes ({self.max_bytes / 1e6:.1f} MB)",
                field="model",
            )
        deadline = time.monotonic() + self.load_timeout_s
        while over():
            victim = next((n for n in self.models if n not in self.pinned and not self._busy.get(n)), None)
            if victim is None:  # every model held is busy or pinned: wait for a request to end, within the bound
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise ServiceError(
                        ErrorKind.UNAVAILABLE,
                        f"model {entry.name!r} is not loaded here and every "
                        f"model this replica holds ({', '.join(self.models)}) stayed busy or pinned "
                        f"for {self.load_timeout_s:g}s; retry shortly",
                        retry_after_s=RETRY_AFTER_S,
                    ) from None
                continue
            held = self.models.pop(victim)
            await self._stop(victim, held, 0.0)
            if self.recorder:
                self.recorder.inc("kvserve_model_evictions_total", {"model": victim, "version": held[1].version or ""})

    async def _stop(self, name: str, held: tuple[LocalModel, Entry], drain_timeout_s: float) -> None:
        model, entry = held
        if self._on_evict is not None:
            self._on_evict(name)
        await model.stop(drain_timeout_s=drain_timeout_s)
        if self.recorder:
            self.recorder.set("kvserve_model_bytes", {"model": name, "version": entry.version or ""}, 0.0)
        log.info("pool: evicted %s (version %s)", name, entry.version)
