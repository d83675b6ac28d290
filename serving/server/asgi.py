"""ASGI scope helpers shared by the middlewares (auth, drain, body limit) and the error answers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def app_path(scope: Mapping[str, Any]) -> str:
    """The path inside the app (Ray Serve keeps the route_prefix in `path` and sets `root_path`)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def is_api_request(scope: Mapping[str, Any]) -> bool:
    """An HTTP request to the /v1 API (what the drain gate and the request metrics look at)."""
    return scope["type"] == "http" and app_path(scope).startswith("/v1/")
