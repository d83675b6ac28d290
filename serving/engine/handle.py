"""A submitted request as its submitter sees it: `RequestHandle`, the async iterator of its TokenEvents.

Owns: the request's event queue (the engine puts, on the event loop; the consumer iterates) and cancelling the
request when its consumer goes away before the final event. Does not own: producing the events or what a
cancellation does (serving/engine/engine.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from serving.engine.types import TokenEvent


class RequestHandle:
    """A submitted request: iterate it for its TokenEvents (the last one carries finish_reason)."""

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel  # the engine's `cancel`
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = False

    def put(self, event: TokenEvent) -> None:
        """The engine's side: the next event, on the event loop."""
        self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncGenerator[TokenEvent, None]:
        return self._events()

    async def _events(self) -> AsyncGenerator[TokenEvent, None]:
        done = False
        try:
            while not done:
                event = await self._queue.get()
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:  # the consumer went away (client disconnect): free the slot
                self.cancel()

    def cancel(self) -> None:
        self._cancel(self.request_id)
