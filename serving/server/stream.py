"""Server-Sent Event payloads for the streaming routes of serving/server/api.py.

Owns the event shapes: kvserve's `/v1/generate` stream (`{"token", "index"}` per token, then one final
`{"finish_reason", "usage", "timings", "text"}`), and OpenAI's `/v1/completions` stream (text_completion
chunks, an optional usage chunk, then `[DONE]`). Errors before the first token never reach here: the
route awaits the first item (`start_stream`) so they still become an HTTP status; an error after it
becomes an `{"error": ...}` event, the body of an HTTP error (serving/server/errors.py's `error_body`).
Closing the stream (client gone) closes the model's stream, which cancels the engine request. The engine
ends a request at its deadline; as a backstop (a model replica that stopped answering), waiting for any
item ends `DEADLINE_GRACE_S` after the deadline: before the first item as a 504, after it as a
`deadline_exceeded` error event.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from serving.server.errors import ErrorKind, ServiceError, error_body
from serving.server.service import StreamPiece, TextResult

log = logging.getLogger(__name__)
Item = StreamPiece | TextResult
DEADLINE_GRACE_S = 2.0  # the engine enforces the deadline; this backstop only catches a stuck call


async def next_item(stream: AsyncIterator[Item], deadline_wall: float | None) -> Item:
    """The stream's next item; a ServiceError(DEADLINE) if it has not come DEADLINE_GRACE_S past the deadline."""
    if deadline_wall is None:
        return await stream.__anext__()
    timeout = max(0.001, deadline_wall - time.time() + DEADLINE_GRACE_S)
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout)
    except asyncio.TimeoutError:
        raise ServiceError(ErrorKind.DEADLINE, "the model did not answer within the request's deadline") from None


async def start_stream(stream: AsyncIterator[Item], deadline_wall: float | None = None
                       ) -> tuple[Item | None, AsyncIterator[Item]]:
    """Await the first item, so that a refusal (429, 413, ...) is still an HTTP status, not an event."""
    try:
        return await next_item(stream, deadline_wall), stream
    except StopAsyncIteration:
        return None, stream
    except BaseException:
        await _close(stream)
        raise


async def _items(first: Item | None, rest: AsyncIterator[Item], deadline_wall: float | None
                 ) -> AsyncIterator[Item]:
    item = first
    try:
        while item is not None:
            yield item
            try:
                item = await next_item(rest, deadline_wall)
            except StopAsyncIteration:
                item = None
    finally:
        await _close(rest)


async def _close(stream: AsyncIterator[Item]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # already failed or finished; nothing left to release
            log.debug("closing a finished stream", exc_info=True)


def _error_event(e: BaseException) -> dict:
    if isinstance(e, ServiceError):
        return error_body(e.kind, e.message, e.field)
    log.exception("stream failed", exc_info=e)
    return error_body(ErrorKind.INTERNAL, f"stream failed: {type(e).__name__}")


def openai_finish(reason: str) -> str:
    """OpenAI knows 'stop' and 'length'; a deadline or cancellation cut the text short, like 'length'."""
    return reason if reason in ("stop", "length") else "length"


def usage_of(r: TextResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


async def generate_events(first: Item | None, rest: AsyncIterator[Item], started: float,
                          deadline_wall: float | None = None) -> AsyncIterator[dict]:
    try:
        async for item in _items(first, rest, deadline_wall):
            if isinstance(item, StreamPiece):
                if item.text:
                    yield {"token": item.text, "index": item.index}
                continue
            yield {"finish_reason": item.finish_reason, "usage": usage_of(item), "text": item.text,
                   "timings": {"queue_s": item.queue_s, "ttft_s": item.ttft_s,
                               "total_s": time.monotonic() - started}}
    except Exception as e:
        yield _error_event(e)


async def completion_events(first: Item | None, rest: AsyncIterator[Item], cid: str, created: int, model: str,
                            include_usage: bool, deadline_wall: float | None = None) -> AsyncIterator[dict | str]:
    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
    try:
        async for item in _items(first, rest, deadline_wall):
            if isinstance(item, StreamPiece):
                if item.text:
                    yield chunk(item.text, None)
                continue
            yield chunk("", openai_finish(item.finish_reason))
            if include_usage:
                yield {"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage_of(item)}
    except Exception as e:
        yield _error_event(e)
    yield "[DONE]"
