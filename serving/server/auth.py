"""API-key authentication of the HTTP API: an ASGI middleware that fails closed.

Owns: deciding whether a request may pass. With an API key configured (serving/server/config.py `AppArgs.api_key`
or `api_key_env`), every path needs `Authorization: Bearer <key>` except the open ones: the health probes
(`HEALTH_PATHS`, and `/v2/models/{name}/ready`), which Kubernetes and load balancers call without
credentials, and /metrics, which Prometheus scrapes, unless `AppArgs.metrics_require_key` puts it behind the
key too (`open_paths`). Everything else --
the /v1 routes, /docs, /openapi.json, and paths that do not exist -- answers 401 with
`WWW-Authenticate: Bearer` before the body is read, so an unauthenticated client learns nothing about the
routes and cannot make the server read a large body.

The middleware gets and keeps only the key's SHA-256 digest (`key_sha256`; so the key is not in the app's
middleware list either), and compares the digest of the presented token with `hmac.compare_digest`
(constant time; fixed-length digests do not leak the key's length). Neither the key nor the presented
token is ever logged or put in a response.

Does not own: where the key comes from (serving/server/config.py), the 401 answer itself (its status, body and
`WWW-Authenticate: Bearer` challenge: serving/server/errors.py).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterable

from serving.server.asgi import app_path
from serving.server.errors import ErrorKind, error_response

HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
MODEL_READY = re.compile(r"^/v2/models/[^/]+/ready$")  # KServe v2 per-model readiness: a health probe too
METRICS_PATH = "/metrics"
OPEN_PATHS = HEALTH_PATHS | {METRICS_PATH}  # the default: Prometheus scrapes without credentials


def open_paths(metrics_require_key: bool) -> frozenset[str]:
    """The exact paths that need no key: the health probes, and /metrics unless it is put behind the key."""
    return HEALTH_PATHS if metrics_require_key else OPEN_PATHS


UNAUTHORIZED = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def key_sha256(api_key: str | None) -> bytes | None:
    """What `BearerAuth` is given: the key's digest, or None for no authentication."""
    return _digest(api_key.encode()) if api_key else None


class BearerAuth:
    """401 for every request without the right bearer token, except the open paths; a no-op without a key."""

    def __init__(self, app: Callable, key_sha256: bytes | None, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self._want = key_sha256
        self._open = frozenset(open_paths)

    def is_open(self, path: str) -> bool:
        return path in self._open or MODEL_READY.match(path) is not None

    def __repr__(self) -> str:  # never show the digest either
        return f"BearerAuth(enabled={self._want is not None})"

    def allows(self, authorization: bytes | None) -> bool:
        if self._want is None:
            return True
        scheme, _, token = (authorization or b"").strip().partition(b" ")
        # Always run the comparison, even for a wrong scheme, so the time taken does not depend on the input.
        same = hmac.compare_digest(_digest(token.strip()), self._want)
        return same and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or self._want is None or self.is_open(app_path(scope)):
            return await self.app(scope, receive, send)
        authorization = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), None)
        if self.allows(authorization):
            return await self.app(scope, receive, send)
        await error_response(ErrorKind.UNAUTHORIZED, UNAUTHORIZED, "authorization")(scope, receive, send)
