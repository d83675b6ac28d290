"""Coalescing a stream's items into chunks before they cross a process boundary.

Every item a model replica streams to the ingress is one Ray streaming-generator object, and every piece
the ingress writes is one ASGI message the Ray proxy relays: per-item costs that, measured under a 32-client
streaming load, took more CPU in the proxy and the ingress than the engine's own replica (docs/benchmarks.md,
"The HTTP path"). `coalesce` sends the first item at once (time to first token is untouched) and after that
at most one chunk per `interval_s`, holding what arrived in between; the final item goes out the moment it
arrives. The API's events stay one per token: a chunk of N tokens is N SSE events in one write.

Does not own: what the items are (serving/server/service.py), how a chunk is rendered (stream.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _End:
    """Marks the end of the source (with the exception that ended it, if any)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class _Pump(Generic[T]):
    """Reads the source into a queue in its own task, so the consumer can wait for time and items alike."""

    def __init__(self, source: AsyncIterator[T]) -> None:
        self.queue: asyncio.Queue[T | _End] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run(source))

    async def _run(self, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                self.queue.put_nowait(item)
        except Exception as e:  # handed to the consumer, which raises it where the source would have
            self.queue.put_nowait(_End(e))
        else:
            self.queue.put_nowait(_End())
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


async def coalesce(
    source: AsyncIterator[T], interval_s: float, is_final: Callable[[T], bool] = lambda item: False
) -> AsyncGenerator[list[T], None]:
    """The items of `source` in chunks: the first alone and at once, then at most one chunk per `interval_s`
    (what arrived meanwhile), a final item (`is_final`) without waiting. With `interval_s` 0 a chunk is what
    is ready when the consumer asks. An exception of the source is raised after the items before it.
    Closing this generator (the consumer went away) cancels the reading of `source` and closes it."""
    loop = asyncio.get_running_loop()
    pump: _Pump[T] = _Pump(source)
    last_sent = -float("inf")
    try:
        while True:
            first = await pump.queue.get()
            chunk, end = _take(first, [])
            if end is None and not is_final(chunk[-1]):
                wait = last_sent + interval_s - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                end = _drain(pump.queue, chunk)
            if chunk:
                yield chunk
                last_sent = loop.time()
            if end is not None:
                if end.error is not None:
                    raise end.error
                return
    finally:
        await pump.close()


def _take(item: T | _End, chunk: list[T]) -> tuple[list[T], _End | None]:
    if isinstance(item, _End):
        return chunk, item
    chunk.append(item)
    return chunk, None


def _drain(queue: asyncio.Queue, chunk: list[T]) -> _End | None:
    while not queue.empty():
        chunk, end = _take(queue.get_nowait(), chunk)
        if end is not None:
            return end
    return None
