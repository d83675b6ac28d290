"""The API's own ASGI middleware (serving/server/api.py `create_app` stacks them with auth and the drain gate):
`BodyLimit` (413 for a body over the configured bytes, before it is all read) and `RequestMetrics` (the request
counter and duration of every /v1 answer, 401 and 503 included)."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import HTTPException

from serving.server.asgi import is_api_request
from serving.server.errors import ErrorKind, error_response
from serving.server.metrics import Recorder


class BodyLimit:
    """413 for a body over `max_bytes`, by Content-Length or while reading a chunked body."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = error_response(ErrorKind.TOO_LARGE, self._message(int(length)), "body")
            return await response(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # FastAPI lets an HTTPException from body reading through as is
                raise HTTPException(413, self._message(seen))
            return message

        await self.app(scope, limited, send)

    def _message(self, size: int) -> str:
        return f"request body has {size} bytes or more; the limit is {self.max_bytes} bytes"


class RequestMetrics:
    """kvserve_requests_total and kvserve_request_duration_seconds for /v1 routes (499: client went away)."""

    def __init__(self, app: Callable, recorder: Recorder) -> None:
        self.app, self.recorder = app, recorder

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not is_api_request(scope):
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), "499"
        scope.setdefault("state", {})["arrival"] = time.time()  # the server-side TTFT's start (api.py)

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            status = "500"
            raise
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", "other")
            state = scope.get("state", {})
            labels = {
                "model": state.get("model", "none"),
                "version": state.get("version", "none"),
                "endpoint": endpoint,
            }
            self.recorder.inc("kvserve_requests_total", {**labels, "status": status})
            self.recorder.observe("kvserve_request_duration_seconds", labels, time.monotonic() - started)
