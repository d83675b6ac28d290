"""A middleware for Ray Serve's own HTTP proxy: headers that Ray interprets must be UTF-8, or the answer is 400.

Ray's proxy (ray 2.60, `ray/serve/_private/proxy.py`) decodes the values of `x-request-id`,
`serve_multiplexed_model_id` and the session-id header (`x-session-id`) as UTF-8 before any application code
runs, and answers a bare `500 Internal Server Error` when one is not (tests/test_fuzz.py found it with
`x-request-id: \\x80`). This middleware runs in the proxy, in front of that code, and refuses such a request
with kvserve's usual error body naming the header (status 400, built by serving/server/errors.py).

Installed through Ray's hook: the environment variable `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` set to
`PROXY_CALLBACK` in the environment Ray starts in (`serving/server/launch.py` sets it before `ray.init`; in
Kubernetes it belongs in the Ray containers' env). Owns nothing else: no auth, no limits (serving/server/api.py).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.middleware import Middleware

from serving.server.errors import UNREADABLE, ErrorKind, error_response

PROXY_CALLBACK = "serving.server.proxy_guard:middlewares"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


def _ray_headers() -> frozenset[str]:
    """Header names Ray's proxy decodes, normalized as Ray does (lower case, '-' -> '_')."""
    try:
        from ray.serve._private.constants import SERVE_SESSION_ID
    except ImportError:  # a Ray without session ids
        SERVE_SESSION_ID = "x-session-id"
    names = ("x-request-id", "serve_multiplexed_model_id", SERVE_SESSION_ID)
    return frozenset(n.lower().replace("-", "_") for n in names)


class RayHeaderGuard:
    def __init__(self, app: Callable) -> None:
        self.app = app
        self.names = _ray_headers()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            for key, value in scope.get("headers") or []:
                name = key.decode("latin-1").lower().replace("-", "_")
                if name in self.names and not _is_utf8(value):
                    return await _bad_header(key.decode("latin-1"))(scope, receive, send)
        await self.app(scope, receive, send)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _bad_header(name: str) -> Callable:
    return error_response(
        ErrorKind.INVALID,
        f"header {name} is not valid UTF-8; send ASCII or UTF-8 text, or leave it out",
        name,
        status=UNREADABLE,
    )


def middlewares() -> list[Middleware]:
    """The callback Ray's proxy calls (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(RayHeaderGuard)]
