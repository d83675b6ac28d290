"""Errors of the HTTP API: the ONE place where an error becomes an HTTP status and a JSON error body.

Owns:
- `ErrorKind` and `ServiceError`, what the service (serving/server/service.py) and the routes raise, and what
  crosses Ray from a model replica to the ingress (it pickles with its fields);
- `STATUS`, the table from every kind to its status, and which kinds carry Retry-After (429 and 503: they
  can be retried) or a WWW-Authenticate challenge (401);
- `error_body`, the body of every error, `{"error": {"type", "message", "field"}}`, and `error_response`,
  the ASGI response that the middleware (auth 401, drain 503, body limit 413, Ray proxy guard 400) answers;
- `from_engine`: an engine error (serving/engine/types.py) as a ServiceError, the engine's field name
  translated to the API's (`api_field`: max_new_tokens -> max_tokens, prompt_ids -> the request's text field);
- `install_error_handlers`: FastAPI's handlers for ServiceError, validation errors (422 naming the field),
  Starlette's HTTP errors (404/405/400/413 made to say what was asked) and any other exception (the only 500).

Does not own: deciding that a request is wrong -- the schemas (serving/server/schemas.py), the routes' limits
(serving/server/api.py), the API key (auth.py), draining (drain.py), Ray's header guard (proxy_guard.py) and
the engine's checks (serving/engine/checks.py) decide, and raise or call into this module. Streamed error
events (serving/server/stream.py) use `error_body` too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from serving.engine.types import AdmissionRejected, EngineDead, EngineError, InvalidRequest
from serving.server.asgi import app_path

if TYPE_CHECKING:
    from serving.server.metrics import Recorder

log = logging.getLogger(__name__)
ECHO_CHARS = 120  # an invalid value is quoted in the error message up to this many characters


class ErrorKind(str, Enum):
    """The error body's `type`; `STATUS` gives its HTTP status."""

    INVALID = "invalid_request"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    DEADLINE = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    NOT_FOUND = "not_found"
    UNAUTHORIZED = "unauthorized"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INTERNAL = "internal_error"


STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID: 422,  # 400 where the request could not even be read (`UNREADABLE`)
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.DEADLINE: 504,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.METHOD_NOT_ALLOWED: 405,
    ErrorKind.INTERNAL: 500,
}
UNREADABLE = 400  # an INVALID request whose body is not JSON or whose header is not UTF-8
# 429 and 503 can be retried: Retry-After says when (RFC 9110 sections 15.5.21 and 15.6.4).
RETRY_AFTER = frozenset({ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE})


class ServiceError(Exception):
    """A request that cannot be answered normally; `kind` decides the HTTP status (`STATUS`)."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        field: str | None = None,
        retry_after_s: float | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.message, self.field = kind, message, field
        self.retry_after_s, self.reason = retry_after_s, reason

    def __reduce__(self) -> tuple:  # pickles across Ray (Exception's default would lose the fields)
        return ServiceError, (self.kind, self.message, self.field, self.retry_after_s, self.reason)


# -- the body and the response ---------------------------------------------------------------------------
def _utf8_safe(text: str) -> str:
    """A lone surrogate sent by a client (JSON allows "\\ud800") cannot be encoded; show it escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(kind: ErrorKind | str, message: str, field: str | None = None) -> dict:
    kind = kind.value if isinstance(kind, ErrorKind) else kind
    return {
        "error": {
            "type": kind,
            "message": _utf8_safe(message),
            "field": _utf8_safe(field) if field is not None else None,
        }
    }


def error_response(
    kind: ErrorKind,
    message: str,
    field: str | None = None,
    *,
    status: int | None = None,
    retry_after_s: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The answer to an error of `kind` (an ASGI app: middleware awaits it with (scope, receive, send)).
    `status` overrides the table only for Starlette's own HTTP errors and `UNREADABLE`."""
    headers = dict(headers or {})
    if kind in RETRY_AFTER:
        headers["Retry-After"] = str(max(1, round(retry_after_s or 1)))
    if kind == ErrorKind.UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"  # RFC 9110 section 11.6.1: a 401 names the scheme
    return JSONResponse(error_body(kind, message, field), status_code=status or STATUS[kind], headers=headers or None)


def service_error_response(e: ServiceError) -> JSONResponse:
    return error_response(e.kind, e.message, e.field, retry_after_s=e.retry_after_s)


# -- engine errors ---------------------------------------------------------------------------------------------
# The engine names GenerationRequest fields; the API names its own. Unlisted names are the same in both.
_API_FIELDS: dict[str, str | None] = {
    "max_new_tokens": "max_tokens",
    "request_id": None,
}  # set by the service, not by the client


def api_field(engine_field: str | None, text_field: str) -> str | None:
    """The API field an engine InvalidRequest is about; `text_field` holds the prompt ("prompt", "text[1]")."""
    if engine_field is None:
        return None
    if engine_field == "prompt_ids":
        return text_field
    return _API_FIELDS.get(engine_field, engine_field)


def from_engine(e: EngineError, model: str, text_field: str) -> ServiceError:
    """An engine error as a ServiceError. Overload is counted in kvserve_rejections_total by the handler
    below, together with Ray's own."""
    if isinstance(e, AdmissionRejected):
        return ServiceError(ErrorKind.OVERLOADED, str(e), retry_after_s=e.retry_after_s, reason=e.reason)
    if isinstance(e, InvalidRequest):
        kind = ErrorKind.TOO_LARGE if e.too_large else ErrorKind.INVALID
        return ServiceError(kind, str(e), field=api_field(e.field, text_field))
    if isinstance(e, EngineDead):
        return ServiceError(ErrorKind.UNAVAILABLE, f"model {model!r} is unavailable: {e}")
    return ServiceError(ErrorKind.UNAVAILABLE, f"model {model!r} failed: {e}")


# -- FastAPI's handlers --------------------------------------------------------------------------------------
_HTTP_KINDS = {
    400: ErrorKind.INVALID,
    401: ErrorKind.UNAUTHORIZED,
    404: ErrorKind.NOT_FOUND,
    405: ErrorKind.METHOD_NOT_ALLOWED,
    413: ErrorKind.TOO_LARGE,
}


def install_error_handlers(app: FastAPI, recorder: Recorder) -> None:
    @app.exception_handler(ServiceError)
    async def _service(request: Request, e: ServiceError) -> JSONResponse:
        if e.kind == ErrorKind.OVERLOADED:  # the engine's refusals and Ray's backpressure alike
            model = getattr(request.state, "model", "none")
            recorder.inc("kvserve_rejections_total", {"model": model, "reason": e.reason or "overloaded"})
        return service_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        field, message = _validation_message(e)
        return error_response(ErrorKind.INVALID, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = _HTTP_KINDS.get(e.status_code)
        field = "body" if e.status_code in (400, 413) else None
        message = _http_message(request, e)
        if kind is None:  # a status this API does not produce itself
            return JSONResponse(error_body("http_error", message), status_code=e.status_code, headers=e.headers)
        return error_response(kind, message, field, status=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(ErrorKind.INTERNAL, f"internal error: {type(e).__name__}")


ROUTES_HINT = (
    "POST /v1/translate, POST /v1/generate, POST /v1/completions, GET /v1/models, "
    "GET /v2/health/live, GET /v2/health/ready, GET /v2/models/{name}/ready, GET /metrics"
)


def _http_message(request: Request, e: StarletteHTTPException) -> str:
    """Starlette's terse details ("Not Found") made to say what was asked and what exists."""
    path = _clip(app_path(request.scope), ECHO_CHARS)
    if e.status_code == 404 and e.detail == "Not Found":
        return f"no route {request.method} {path}; this server has {ROUTES_HINT}"
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return f"method {request.method} is not allowed on {path}; use {allowed or 'another method'}"
    if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not parse the body at all
        cause = e.__cause__
        return _clip(f"the request body could not be parsed as JSON: {type(cause).__name__}: {cause}", 300)
    return str(e.detail)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# pydantic names the member of a union (`str | list[str]`) it tried in the error location; users never see it
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list|dict|function-[a-z-]+)(\[.*\])?$")


def _validation_message(e: RequestValidationError) -> tuple[str | None, str]:
    """(field, message) of the most telling validation error: the field path, what is wrong, the value
    (clipped). Of a union's errors, one about the value beats "should be a valid <type>"."""
    errors = e.errors()
    err: dict[str, Any] = (
        next((x for x in errors if not str(x.get("type", "")).endswith("_type")), errors[0])
        if errors
        else {"loc": (), "msg": "invalid request"}
    )
    if err.get("type") == "json_invalid":  # loc is ("body", character offset)
        where = err.get("loc", ("body", "?"))[-1]
        detail = (err.get("ctx") or {}).get("error", "invalid JSON")
        return "body", f"the request body is not valid JSON: {detail} at character {where}"
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_MEMBER.match(str(p))]
    field = _clip(".".join(loc), ECHO_CHARS) or None
    got = ""
    if "input" in err and not isinstance(err["input"], dict):
        got = f" (got {_clip(repr(err['input']), ECHO_CHARS)})"
    return field, f"{field or 'body'}: {err.get('msg', 'invalid')}{got}"
