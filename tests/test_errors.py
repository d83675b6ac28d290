"""serving/server/errors.py: the status table, the error body, engine errors as ServiceErrors, and that no
other module of serving/server builds an error answer itself."""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from serving.engine.types import AdmissionRejected, EngineDead, EngineError, InvalidRequest
from serving.server.errors import (STATUS, ErrorKind, ServiceError, api_field, error_body, error_response,
                                   from_engine)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_has_a_status_and_the_one_body_shape(kind):
    r = error_response(kind, "what was given, what is allowed", "max_tokens", retry_after_s=2.6)
    assert r.status_code == STATUS[kind] and 400 <= r.status_code < 600
    assert json.loads(r.body) == {"error": {"type": kind.value, "message": "what was given, what is allowed",
                                            "field": "max_tokens"}}
    retry = r.headers.get("retry-after")
    assert retry == ("3" if r.status_code in (429, 503) else None)  # retryable answers say when, rounded
    assert r.headers.get("www-authenticate") == ("Bearer" if r.status_code == 401 else None)


def test_the_table_is_the_documented_one():
    assert {k.value: s for k, s in STATUS.items()} == {
        "invalid_request": 422, "too_large": 413, "overloaded": 429, "deadline_exceeded": 504, "unavailable": 503,
        "not_found": 404, "unauthorized": 401, "method_not_allowed": 405, "internal_error": 500}


def test_retry_after_is_at_least_one_second():
    assert error_response(ErrorKind.OVERLOADED, "busy", retry_after_s=0.2).headers["retry-after"] == "1"
    assert error_response(ErrorKind.UNAVAILABLE, "draining").headers["retry-after"] == "1"


def test_error_body_escapes_lone_surrogates():
    body = error_body(ErrorKind.INVALID, "bad \ud800 text", "text.\udfff")
    json.dumps(body, ensure_ascii=False).encode("utf-8")  # would raise on a lone surrogate
    assert body["error"]["message"] == "bad \\ud800 text" and body["error"]["field"] == "text.\\udfff"


@pytest.mark.parametrize("engine_field,text_field,expected", [
    ("max_new_tokens", "prompt", "max_tokens"),
    ("prompt_ids", "prompt", "prompt"),
    ("prompt_ids", "text", "text"),
    ("prompt_ids", "text[2]", "text[2]"),
    ("beam_size", "text", "beam_size"),
    ("stop_token_ids", "prompt", "stop_token_ids"),
    ("length_penalty", "text", "length_penalty"),
    ("request_id", "prompt", None),  # the service sets it, the client does not
    (None, "prompt", None),
])
def test_engine_field_names_become_api_field_names(engine_field, text_field, expected):
    assert api_field(engine_field, text_field) == expected


def test_engine_errors_become_service_errors():
    e = from_engine(InvalidRequest("source too long", field="prompt_ids", too_large=True), "m", "text[1]")
    assert (e.kind, e.field, e.message) == (ErrorKind.TOO_LARGE, "text[1]", "source too long")
    e = from_engine(InvalidRequest("max_new_tokens=99 must be ...", field="max_new_tokens"), "m", "prompt")
    assert (e.kind, e.field) == (ErrorKind.INVALID, "max_tokens")
    e = from_engine(AdmissionRejected("queue_full", 2.0), "m", "prompt")
    assert (e.kind, e.retry_after_s, e.reason) == (ErrorKind.OVERLOADED, 2.0, "queue_full")
    assert from_engine(EngineDead("runtime crashed"), "m", "prompt").kind == ErrorKind.UNAVAILABLE
    e = from_engine(EngineError("boom"), "m", "prompt")
    assert e.kind == ErrorKind.UNAVAILABLE and "'m'" in e.message and "boom" in e.message


def test_service_error_pickles_with_its_fields():
    """It crosses Ray from a model replica to the ingress."""
    e = pickle.loads(pickle.dumps(ServiceError(ErrorKind.OVERLOADED, "busy", "model", 3.0, "queue_full")))
    assert isinstance(e, ServiceError)
    assert (e.kind, e.message, e.field, e.retry_after_s, e.reason) == (ErrorKind.OVERLOADED, "busy", "model", 3.0,
                                                                       "queue_full")


def test_no_other_server_module_builds_an_error_answer():
    """Exceptions become HTTP statuses in exactly one place: only errors.py writes an error body, or an ASGI
    error status by hand (the readiness probe's 503 is an answer, not an error)."""
    hand_made = re.compile(r"""["']error["']\s*:\s*\{|["']status["']\s*:\s*[45]\d\d""")
    for path in sorted((ROOT / "serving" / "server").glob("*.py")):
        if path.name == "errors.py":
            continue
        hits = [line.strip() for line in path.read_text().splitlines() if hand_made.search(line)]
        assert not hits, f"{path.relative_to(ROOT)} builds an error answer itself: {hits}"
