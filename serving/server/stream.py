"""Server-Sent Event payloads for the streaming routes of serving/server/api.py.

Owns the event shapes: kvserve's `/v1/generate` stream (`{"token", "index"}` per token, then one final
`{"finish_reason", "usage", "timings", "text"}`), and OpenAI's `/v1/completions` stream's pieces
(serving/server/completions.py). The model streams its items in chunks (serving/server/chunks.py); the events of one
chunk are written together, still one event per token. Errors before the first token never reach here: the route awaits
the first chunk (`start_stream`) so they still become an HTTP status; an error after it becomes an `{"error": ...}`
event, the body of an HTTP error (serving/server/errors.py's `error_body`). Closing the stream (client gone) closes the
model's stream, which cancels the engine request. The engine ends a request at its deadline; as a backstop (a model
replica that stopped answering), waiting for any item ends `DEADLINE_GRACE_S` after the deadline: before the first item
as a 504, after it as a `deadline_exceeded` error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from serving.server.errors import ErrorKind, ServiceError, error_body
from serving.server.text_types import StreamPiece, TextResult

log = logging.getLogger(__name__)
Item = StreamPiece | TextResult
Chunk = list[Item]  # what the model sends at once: pieces, and last the TextResult
DEADLINE_GRACE_S = 2.0  # the engine enforces the deadline; this backstop only catches a stuck call


async def next_chunk(stream: AsyncIterator[Chunk], deadline_wall: float | None) -> Chunk:
    """The stream's next chunk; a ServiceError(DEADLINE) if it has not come DEADLINE_GRACE_S past the deadline."""
    if deadline_wall is None:
        return await stream.__anext__()
    timeout = max(0.001, deadline_wall - time.time() + DEADLINE_GRACE_S)
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout)
    except asyncio.TimeoutError:
        raise ServiceError(ErrorKind.DEADLINE, "the model did not answer within the request's deadline") from None


async def start_stream(
    stream: AsyncIterator[Chunk], deadline_wall: float | None = None
) -> tuple[Chunk | None, AsyncIterator[Chunk]]:
    """Await the first chunk, so that a refusal (429, 413, ...) is still an HTTP status, not an event."""
    try:
        return await next_chunk(stream, deadline_wall), stream
    except StopAsyncIteration:
        return None, stream
    except BaseException:
        await close_stream(stream)
        raise


async def chunks_of(
    first: Chunk | None, rest: AsyncIterator[Chunk], deadline_wall: float | None
) -> AsyncIterator[Chunk]:
    item = first
    try:
        while item is not None:
            yield item
            try:
                item = await next_chunk(rest, deadline_wall)
            except StopAsyncIteration:
                item = None
    finally:
        await close_stream(rest)


async def close_stream(stream: AsyncIterator[Chunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # already failed or finished; nothing left to release
            log.debug("closing a finished stream", exc_info=True)


def error_event(e: BaseException) -> dict:
    if isinstance(e, ServiceError):
        return error_body(e.kind, e.message, e.field)
    log.exception("stream failed", exc_info=e)
    return error_body(ErrorKind.INTERNAL, f"stream failed: {type(e).__name__}")


def openai_finish(reason: str) -> str:
    """OpenAI knows 'stop' and 'length'; a deadline or cancellation cut the text short, like 'length'."""
    return reason if reason in ("stop", "length") else "length"


def usage_of(r: TextResult) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


async def generate_events(
    first: Chunk | None, rest: AsyncIterator[Chunk], started: float, deadline_wall: float | None = None
) -> AsyncIterator[list[dict]]:
    """The events of each chunk, as one list per chunk."""

    def event(item: Item) -> dict | None:
        if isinstance(item, StreamPiece):
            return {"token": item.text, "index": item.index} if item.text else None
        return {
            "finish_reason": item.finish_reason,
            "usage": usage_of(item),
            "text": item.text,
            "timings": {
                "queue_s": item.queue_s,
                "ttft_s": item.ttft_s,
                "server_ttft_s": item.server_ttft_s,
                "total_s": time.monotonic() - started,
            },
        }

    try:
        async for chunk in chunks_of(first, rest, deadline_wall):
            events = [ev for ev in map(event, chunk) if ev is not None]
            if events:
                yield events
    except Exception as e:
        yield [error_event(e)]
