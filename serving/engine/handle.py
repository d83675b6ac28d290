"""A submitted request as its submitter sees it: `RequestHandle`, the async iterator of its TokenEvents.

Owns: the request's event queue (the engine puts, on the event loop; the consumer iterates), when its first event
arrived, and cancelling the request when its consumer goes away before the final event. A consumer that wants the
answer rather than a stream iterates `gathered()`: it wakes once, at the final event, instead of once per token
(each wake-up is a task step and a walk up the consumer's generators, time the event loop holds the GIL the
engine's step thread needs). Does not own: producing the events or what a
cancellation does (serving/engine/engine.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

from serving.engine.types import TokenEvent


class RequestHandle:
    """A submitted request: iterate it for its TokenEvents (the last one carries finish_reason)."""

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel  # the engine's `cancel`
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = False
        self.first_at: tuple[float, float] | None = None  # (monotonic, wall) clocks when the first event arrived
        self._held: list[TokenEvent] | None = None  # `gathered`: the events so far
        self._all: asyncio.Future[list[TokenEvent]] | None = None  # `gathered`: set at the final event

    def put(self, event: TokenEvent) -> None:
        """The engine's side: the next event, on the event loop."""
        if self.first_at is None:
            self.first_at = (time.monotonic(), time.time())
        if self._held is None:
            self._queue.put_nowait(event)
            return
        self._held.append(event)
        if event.finish_reason is not None and self._all is not None and not self._all.done():
            self._all.set_result(self._held)

    def put_token(self, token: int) -> None:
        """The engine's side: a token with nothing else to say, its event built here, on the event loop (which runs
        while the next step computes) rather than on the step thread."""
        self.put(TokenEvent(self.request_id, token))

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

    async def gathered(self) -> AsyncGenerator[TokenEvent, None]:
        """The events `__aiter__` gives, all at once when the final one has arrived."""
        held: list[TokenEvent] = []
        while not self._queue.empty():
            held.append(self._queue.get_nowait())
        done = bool(held) and held[-1].finish_reason is not None
        try:
            if not done:
                self._held, self._all = held, asyncio.get_running_loop().create_future()
                held = await self._all
                done = True
            for event in held:
                yield event
        finally:
            if not done:  # the consumer went away (client disconnect): free the slot
                self.cancel()

    def cancel(self) -> None:
        self._cancel(self.request_id)
