"""A value fetched by an async call, shared for a short time by every caller: `Cached`.

What the ingress asks the rest of the cluster for on behalf of anonymous callers -- the cross-node metrics
scrape behind /metrics, Serve's replica states behind readiness -- goes through one: within `ttl_s` of the
last fetch, callers get that value; past it, the first caller starts one fetch and every caller that
arrives meanwhile waits for the same fetch (single flight), so N concurrent probes cost one call, not N.
A caller that goes away (client disconnect) does not cancel the fetch the others wait for. A failed fetch
is not cached: each waiter gets the error, and the next call fetches again. With `stale_s` > `ttl_s`,
a caller past `ttl_s` but within `stale_s` gets the last value at once while one fetch refreshes it in the
background (stale-while-revalidate): what /metrics wants under a flood of scrapers, where a slow cross-node
scrape must not hold them all each second; a value older than `stale_s` (after a quiet spell) is never
served, the caller waits for the fresh one.

Does not own: what is fetched, or keeping blocking work off the event loop (the fetch itself does that,
e.g. with asyncio.to_thread).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class Cached(Generic[T]):
    """`await get()`: the value of `fetch()`, at most `ttl_s` old (up to `stale_s` old while a fresher one is
    being fetched), one fetch in flight at a time."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[T]],
        ttl_s: float,
        stale_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s={ttl_s} must be >= 0")
        self._fetch, self.ttl_s, self.stale_s, self._clock = fetch, ttl_s, stale_s, clock
        self._held: tuple[float, T] | None = None  # (when it was fetched, the value); None: none to serve
        self._inflight: asyncio.Future[T] | None = None
        self.fetches = 0  # how many fetches started (for tests and logs)

    async def get(self) -> T:
        held = self._held
        age = math.inf if held is None else self._clock() - held[0]
        if held is not None and age < self.ttl_s:
            return held[1]
        if self._inflight is None:
            self.fetches += 1
            self._inflight = asyncio.ensure_future(self._refresh())
            self._inflight.add_done_callback(_retrieve)
        if held is not None and age < self.stale_s:
            return held[1]
        return await asyncio.shield(self._inflight)

    def invalidate(self) -> None:
        """The next `get` fetches anew (a caller that knows the value changed)."""
        self._held = None

    async def _refresh(self) -> T:
        try:
            value = await self._fetch()
            self._held = (self._clock(), value)
            return value
        finally:
            self._inflight = None


def _retrieve(fut: asyncio.Future) -> None:
    """Take a failed fetch's error (asyncio would report it as never retrieved when nobody waited for it) and
    log it: a background refresh (within `stale_s`) has nobody else to tell."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("refreshing a cached value failed: %r", fut.exception())
