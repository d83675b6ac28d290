"""OpenTelemetry traces of API requests: off unless an OTLP endpoint is configured, and then one trace per request.

`configure()` turns tracing on in a process when the standard OpenTelemetry environment names an endpoint
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SERVICE_NAME`, default "kvserve"),
exporting over OTLP/HTTP in batches (the `tracing` extra); the ingress and the model replicas call it when they
start. Off, every function here returns at its first line: no span, no exporter, nothing on the engine's path.

A request's trace: the span of the request at the ingress (`TraceRequests`, continuing a client's W3C
`traceparent`; with the request id, the model, the status), the call to a model replica where the model runs in
a deployment of its own (`span`), and the engine's part (`record_engine`): its queue wait, prefill (to the first
token) and decode, with the token counts, made from the engine's own timings when the request ends, so the
engine's step loop never touches a tracer. The trace context crosses to a model replica in
`TextRequest.traceparent`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from serving.server.asgi import app_path, is_api_request

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_tracer: Any = None  # an opentelemetry Tracer once configured


def configure(exporter: Any = None) -> bool:
    """Tracing on in this process if an OTLP endpoint is configured, or to `exporter` (a SpanExporter, sent each
    span as it ends: tests); returns whether it is on. Once on, it stays on."""
    global _tracer
    if _tracer is not None:
        return True
    if exporter is None and not any(os.environ.get(k) for k in ENDPOINT_ENVS):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor: Any = BatchSpanProcessor(OTLPSpanExporter())
    else:
        processor = SimpleSpanProcessor(exporter)
    provider = TracerProvider(
        resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvserve")})
    )
    provider.add_span_processor(processor)
    _tracer = provider.get_tracer("kvserve")
    return True


def enabled() -> bool:
    return _tracer is not None


def _context(traceparent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent} if traceparent else {})


def current_traceparent() -> str:
    """The W3C traceparent of the current span ("" when tracing is off), for a request crossing processes."""
    if _tracer is None:
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


def carried(request: Any) -> Any:
    """`request` (a TextRequest) with the current span's trace context, to cross to another process; itself when
    tracing is off."""
    if _tracer is None:
        return request
    import dataclasses

    return dataclasses.replace(request, traceparent=current_traceparent() or request.traceparent)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A child span of the current one around a block (a call to a model replica); nothing when off."""
    if _tracer is None:
        yield
        return
    with _tracer.start_as_current_span(name, attributes={k: v for k, v in attributes.items() if v is not None}):
        yield


class TraceRequests:
    """ASGI middleware: the span of each /v1 request, from its arrival to its last byte (a stream's included)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if _tracer is None or not is_api_request(scope):
            return await self.app(scope, receive, send)
        from opentelemetry.trace import SpanKind

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
        path = app_path(scope)
        attributes = {
            "http.request.method": scope.get("method", ""),
            "url.path": path,
            "kvserve.request_id": headers.get("x-request-id", ""),
        }
        with _tracer.start_as_current_span(
            f"{scope.get('method', '')} {path}",
            kind=SpanKind.SERVER,
            context=_context(headers.get("traceparent", "")),
            attributes=attributes,
        ) as request_span:
            status = 500

            async def send_status(message: dict) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                request_span.set_attribute("http.response.status_code", status)
                model = (scope.get("state") or {}).get("model")
                if model:
                    request_span.set_attribute("kvserve.model", model)


def record_engine(traceparent: str, model: str, request_id: str, stats: Any) -> None:
    """The engine's part of a finished request as spans under `traceparent`: `engine` (submit to the end) with
    `engine.queue` (to its first step), `engine.prefill` (to its first token) and `engine.decode` (the rest).
    `stats`: the engine's RequestStats (serving/engine/types.py), its times relative to the submit."""
    if _tracer is None or stats is None or not traceparent:
        return
    end = time.time_ns()
    submit = end - int(stats.e2e * 1e9)
    scheduled = submit + int(stats.queue_wait * 1e9)
    first = submit + int(stats.time_to_first_token * 1e9) if stats.time_to_first_token is not None else end
    attributes = {
        "kvserve.model": model,
        "kvserve.request_id": request_id,
        "kvserve.prompt_tokens": stats.prompt_tokens,
        "kvserve.generated_tokens": stats.generated_tokens,
        "kvserve.finish_reason": getattr(stats.finish_reason, "value", str(stats.finish_reason)),
    }
    from opentelemetry import trace

    engine = _tracer.start_span("engine", context=_context(traceparent), start_time=submit, attributes=attributes)
    inside = trace.set_span_in_context(engine)
    for name, start, stop in (
        ("engine.queue", submit, scheduled),
        ("engine.prefill", scheduled, first),
        ("engine.decode", first, end),
    ):
        _tracer.start_span(name, context=inside, start_time=start).end(end_time=max(start, stop))
    engine.end(end_time=end)
