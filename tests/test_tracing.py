"""OpenTelemetry traces of API requests (serving/server/tracing.py), on the real API over real engines (tiny
bundles, in-process: tests/inprocess_app.py), exported to OpenTelemetry's in-memory exporter.

- Off (no OTLP endpoint configured): nothing is traced and no trace context is made.
- On: one trace per request, continuing the client's `traceparent`: the request's span (method and path, the
  request id, the model, the status) and under it the engine's span with its queue wait, prefill and decode, which
  follow each other in time and carry the token counts; a translation of two texts has two engine spans in the
  same trace; a stream's trace ends with its last event.
"""
from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inprocess_app import InProcessServer
from serving.server import tracing
from serving.server.config import Limits

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def server():
    s = InProcessServer(Limits(max_tokens=16))
    yield s
    s.close()


@pytest.fixture
def spans(monkeypatch):
    """Tracing on, to an in-memory exporter, for this test only."""
    monkeypatch.setattr(tracing, "_tracer", None)
    exporter = InMemorySpanExporter()
    assert tracing.configure(exporter)
    yield exporter
    monkeypatch.setattr(tracing, "_tracer", None)


def test_tracing_is_off_without_an_endpoint(server, monkeypatch):
    for key in tracing.ENDPOINT_ENVS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(tracing, "_tracer", None)
    assert not tracing.configure() and not tracing.enabled()
    r = server.request("POST", "/v1/generate", json={"prompt": "the", "max_tokens": 3},
                       headers={"traceparent": CLIENT_TRACEPARENT})
    assert r.status_code == 200 and tracing.current_traceparent() == ""


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in exporter.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


def test_a_request_is_one_trace_from_the_ingress_through_the_engines_phases(server, spans):
    r = server.request("POST", "/v1/generate", json={"prompt": "the", "max_tokens": 5, "ignore_eos": True},
                       headers={"traceparent": CLIENT_TRACEPARENT, "x-request-id": "job-1"})
    assert r.status_code == 200, r.text
    named = _by_name(spans)
    assert set(named) == {"POST /v1/generate", "engine", "engine.queue", "engine.prefill", "engine.decode"}
    assert all(len(v) == 1 for v in named.values())
    assert {format(s.context.trace_id, "032x") for v in named.values() for s in v} == {TRACE_ID}  # the client's
    (request,), (engine,) = named["POST /v1/generate"], named["engine"]
    assert request.parent.span_id == int(CLIENT_TRACEPARENT.split("-")[2], 16)
    want = {"kvserve.request_id": "job-1", "kvserve.model": "generate", "http.response.status_code": 200}
    assert dict(request.attributes).items() >= want.items()
    assert engine.parent.span_id == request.context.span_id
    assert engine.attributes["kvserve.generated_tokens"] == 5 and engine.attributes["kvserve.request_id"] == "job-1"
    queue, prefill, decode = (named[n][0] for n in ("engine.queue", "engine.prefill", "engine.decode"))
    assert all(p.parent.span_id == engine.context.span_id for p in (queue, prefill, decode))
    assert engine.start_time == queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time == engine.end_time
    assert request.start_time <= engine.start_time and engine.end_time <= request.end_time


def test_each_text_and_each_stream_is_traced_under_its_own_request(server, spans):
    r = server.request("POST", "/v1/translate", json={"text": ["the dog", "a cat"], "max_tokens": 4})
    assert r.status_code == 200, r.text
    named = _by_name(spans)
    (request,) = named["POST /v1/translate"]
    assert len(named["engine"]) == 2
    assert all(e.context.trace_id == request.context.trace_id for e in named["engine"])
    spans.clear()
    r = server.request("POST", "/v1/completions", json={"model": "generate", "prompt": "the", "max_tokens": 4,
                                                       "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    named = _by_name(spans)
    (request,), (engine,) = named["POST /v1/completions"], named["engine"]
    assert engine.context.trace_id == request.context.trace_id and engine.end_time <= request.end_time
