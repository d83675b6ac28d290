"""kvserve's Prometheus metrics: one definition of names, units, labels and buckets, two ways to record
them, and the aggregation behind the ingress's `/metrics`.

- `METRICS` declares every metric once (prefix kvserve_, base units, counters end in _total, labels only
  from the bounded set model/version/endpoint/status/reason; `version` is the served bundle's version, so a
  canary's figures stand apart from the stable version's).
- `Recorder` records through `ray.serve.metrics` inside Ray Serve replicas (each node's metrics agent
  then exports every replica of that node, as `ray_kvserve_*` with replica/worker labels), or through a
  prometheus_client registry outside Ray (unit tests, a single process).
- `aggregate_exposition` turns the Ray nodes' expositions into one exposition for the whole app: the
  `ray_` prefix dropped and samples summed over replicas, workers and nodes, keeping only bounded labels.
  With 2 replicas and N requests, `kvserve_requests_total` sums to N, whichever replica the scrape hits.
- `RayNodeScraper` fetches every alive node's metrics endpoint (from inside the cluster) without blocking
  the event loop; the ingress caches the aggregate for about a second, single flight (serving/server/ingress.py,
  serving/server/cached.py).

Not here: what to record when (serving/server/service.py, serving/server/api.py) or the HTTP route
(serving/server/api.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

PREFIX = "kvserve_"
RAY_PREFIX = "ray_"
ALLOWED_LABELS = ("model", "version", "endpoint", "status", "reason")


class Kind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricDef:
    name: str  # full Prometheus name, counters included their _total
    kind: Kind
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()


# vLLM's TTFT / inter-token buckets, extended downwards for small CPU models.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

_M, _ME, _MR = ("model", "version"), ("model", "version", "endpoint"), ("model", "reason")
METRICS: dict[str, MetricDef] = {
    d.name: d
    for d in (
        MetricDef(
            "kvserve_requests_total",
            Kind.COUNTER,
            "HTTP requests answered, by model, version, endpoint and "
            "status code (version 'none' when no model answered).",
            ("model", "version", "endpoint", "status"),
        ),
        MetricDef(
            "kvserve_request_duration_seconds", Kind.HISTOGRAM, "End-to-end HTTP request latency.", _ME, E2E_BUCKETS
        ),
        MetricDef(
            "kvserve_time_to_first_token_seconds", Kind.HISTOGRAM, "Engine submit to first token.", _M, TTFT_BUCKETS
        ),
        MetricDef(
            "kvserve_inter_token_latency_seconds",
            Kind.HISTOGRAM,
            "Gap between consecutive tokens of a request.",
            _M,
            ITL_BUCKETS,
        ),
        MetricDef(
            "kvserve_server_time_to_first_token_seconds",
            Kind.HISTOGRAM,
            "The ingress's arrival of a request to "
            "its first token: the hop to the model replica and every queue included.",
            _M,
            TTFT_BUCKETS,
        ),
        MetricDef("kvserve_model_loads_total", Kind.COUNTER, "Models a pool replica loaded from the repository.", _M),
        MetricDef("kvserve_model_evictions_total", Kind.COUNTER, "Models a pool replica evicted to make room.", _M),
        MetricDef(
            "kvserve_model_load_seconds",
            Kind.HISTOGRAM,
            "Time to load a model: bundle checked, engine started and warmed up.",
            _M,
            E2E_BUCKETS,
        ),
        MetricDef(
            "kvserve_model_bytes", Kind.GAUGE, "Bundle bytes of each model a pool replica holds (0 once evicted).", _M
        ),
        MetricDef(
            "kvserve_response_cache_requests_total",
            Kind.COUNTER,
            "Cacheable requests, by reason: hit or miss.",
            ("model", "version", "reason"),
        ),
        MetricDef(
            "kvserve_response_cache_evictions_total", Kind.COUNTER, "Answers dropped from the response cache.", _M
        ),
        MetricDef("kvserve_response_cache_entries", Kind.GAUGE, "Answers held in the response cache.", _M),
        MetricDef(
            "kvserve_queue_wait_seconds", Kind.HISTOGRAM, "Engine submit to first scheduled step.", _M, TTFT_BUCKETS
        ),
        MetricDef(
            "kvserve_engine_step_duration_seconds", Kind.HISTOGRAM, "Duration of one engine step.", _M, STEP_BUCKETS
        ),
        MetricDef(
            "kvserve_engine_batch_size", Kind.HISTOGRAM, "Rows (KV slots) run in one engine step.", _M, BATCH_BUCKETS
        ),
        MetricDef("kvserve_prompt_tokens_total", Kind.COUNTER, "Prompt (source) tokens of finished requests.", _M),
        MetricDef("kvserve_generated_tokens_total", Kind.COUNTER, "Tokens generated by finished requests.", _M),
        MetricDef("kvserve_running_requests", Kind.GAUGE, "Requests holding a KV slot.", _M),
        MetricDef("kvserve_waiting_requests", Kind.GAUGE, "Requests admitted but waiting for a KV slot.", _M),
        MetricDef("kvserve_kv_slots_used", Kind.GAUGE, "KV-cache slots in use.", _M),
        MetricDef("kvserve_kv_slots_capacity", Kind.GAUGE, "KV-cache slots in the pools.", _M),
        MetricDef("kvserve_rejections_total", Kind.COUNTER, "Requests refused for overload, by reason.", _MR),
        MetricDef(
            "kvserve_cancellations_total",
            Kind.COUNTER,
            "Requests cancelled before their end (client gone, stop string, deadline), by reason.",
            ("model", "version", "reason"),
        ),
    )
}


class Recorder:
    """Records kvserve metrics through Ray (`backend="ray"`, in replicas) or prometheus_client."""

    def __init__(self, backend: str = "ray", registry: CollectorRegistry | None = None) -> None:
        if backend not in ("ray", "prometheus"):
            raise ValueError(f"backend must be 'ray' or 'prometheus', got {backend!r}")
        self.backend = backend
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics: dict[str, Any] = {d.name: self._make(d) for d in METRICS.values()}

    def _make(self, d: MetricDef) -> Any:
        if self.backend == "ray":
            from ray.serve import metrics as rm

            # Ray annotates tag_keys as Tuple[str] (one key) but takes any number: hence the ignores
            if d.kind is Kind.COUNTER:
                return rm.Counter(d.name, description=d.doc, tag_keys=d.labels)  # type: ignore[arg-type]
            if d.kind is Kind.GAUGE:
                return rm.Gauge(d.name, description=d.doc, tag_keys=d.labels)  # type: ignore[arg-type]
            return rm.Histogram(d.name, description=d.doc, boundaries=list(d.buckets), tag_keys=d.labels)  # type: ignore[arg-type]
        if d.kind is Kind.COUNTER:  # prometheus_client appends _total itself
            return PromCounter(d.name.removesuffix("_total"), d.doc, d.labels, registry=self.registry)
        if d.kind is Kind.GAUGE:
            return PromGauge(d.name, d.doc, d.labels, registry=self.registry)
        return PromHistogram(d.name, d.doc, d.labels, buckets=d.buckets, registry=self.registry)

    def _check(self, name: str, labels: dict[str, str], kind: Kind) -> Any:
        d = METRICS[name]
        if d.kind is not kind or set(labels) != set(d.labels):
            raise ValueError(f"{name} is a {d.kind.value} with labels {d.labels}; got {kind.value} {sorted(labels)}")
        return self._metrics[name]

    def inc(self, name: str, labels: dict[str, str], value: float = 1.0) -> None:
        m = self._check(name, labels, Kind.COUNTER)
        if value <= 0:
            return
        m.inc(value, tags=labels) if self.backend == "ray" else m.labels(**labels).inc(value)

    def observe(self, name: str, labels: dict[str, str], value: float) -> None:
        m = self._check(name, labels, Kind.HISTOGRAM)
        m.observe(value, tags=labels) if self.backend == "ray" else m.labels(**labels).observe(value)

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        m = self._check(name, labels, Kind.GAUGE)
        m.set(value, tags=labels) if self.backend == "ray" else m.labels(**labels).set(value)

    def exposition(self) -> str:
        """This process's metrics (prometheus backend only; Ray's are read from the node endpoints)."""
        if self.backend != "prometheus":
            raise RuntimeError("the ray backend exports through the Ray nodes' metrics endpoints")
        return generate_latest(self.registry).decode()


# A sample line of the text format: name, optional {labels}, value (a timestamp may follow).
_SAMPLE = re.compile(r"^(?:ray_)?(kvserve_[A-Za-z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)", re.M)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_LINE_PREFIXES = (RAY_PREFIX + PREFIX, PREFIX)


def _sample_families() -> dict[str, str]:
    """Sample name -> the declared metric it belongs to (a histogram's _bucket/_sum/_count included)."""
    out = {}
    for d in METRICS.values():
        for suffix in _HISTOGRAM_SUFFIXES if d.kind is Kind.HISTOGRAM else ("",):
            out[d.name + suffix] = d.name
    return out


_FAMILY_OF = _sample_families()


def _label_value(raw: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], raw) if "\\" in raw else raw


def aggregate_exposition(texts: Iterable[str]) -> str:
    """One exposition of the kvserve metrics found in `texts`, summed over everything but bounded labels.

    Counters, histogram buckets/sums/counts and gauges (running requests, slots in use) are all additive
    across replicas, so a sum is the whole app's value. Declared metrics are always present (with HELP and
    TYPE) even before the first sample, so dashboards and promtool see a stable set of names. A Ray node
    exports megabytes of its own metrics: only lines naming a declared kvserve sample are parsed, by regular
    expressions (prometheus_client's parser is pure Python and spent ~0.1 s of the GIL per scrape).
    """
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = defaultdict(lambda: defaultdict(float))
    for text in texts:
        lines = "\n".join(line for line in text.split("\n") if line.startswith(_LINE_PREFIXES))
        for name, labels, value in _SAMPLE.findall(lines):
            family = _FAMILY_OF.get(name)
            if family is None:  # _created, or a metric this version does not declare
                continue
            keep = tuple(
                sorted(
                    (k, floatToGoString(float(v)) if k == "le" else _label_value(v))
                    for k, v in _LABEL.findall(labels)
                    if k in ALLOWED_LABELS or k == "le"
                )
            )
            sums[family][(name, keep)] += float(value)
    registry = CollectorRegistry()
    registry.register(_StaticCollector(_families(sums)))
    return generate_latest(registry).decode()


def _families(sums: dict[str, dict[tuple[str, tuple], float]]) -> list[Metric]:
    families = []
    for d in METRICS.values():
        # prometheus_client names a counter's family without _total (and writes it back on the samples).
        metric = Metric(d.name.removesuffix("_total") if d.kind is Kind.COUNTER else d.name, d.doc, d.kind.value)
        for (name, labels), value in sorted(sums.get(d.name, {}).items(), key=_sample_order):
            metric.add_sample(name, dict(labels), value)
        families.append(metric)
    return families


def _sample_order(item: tuple[tuple[str, tuple], float]) -> tuple:
    (name, labels), _ = item
    rest = tuple((k, v) for k, v in labels if k != "le")
    le = dict(labels).get("le")
    return rest, name, float(le) if le is not None else 0.0


class _StaticCollector:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class RayNodeScraper:
    """`await texts()`: the metrics text of every alive Ray node (each node's agent exports all of its workers),
    with nothing on the event loop: Ray's node table and each node's exposition (megabytes of Ray's own
    metrics, which parsing HTTP in pure Python would spend the loop's time on) are read in worker threads."""

    def __init__(self, timeout_s: float = 3.0) -> None:
        self.timeout_s = timeout_s
        # No proxy from the environment: the nodes are reached directly, inside the cluster.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _get(self, url: str) -> str:
        with self._opener.open(url, timeout=self.timeout_s) as r:  # raises for a status other than 2xx
            return r.read().decode("utf-8", "replace")

    async def texts(self) -> list[str]:
        import ray

        nodes = await asyncio.to_thread(ray.nodes)  # a blocking call to the GCS
        targets = [
            f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in nodes
            if n.get("Alive") and n.get("MetricsExportPort")
        ]
        results = await asyncio.gather(*(asyncio.to_thread(self._get, url) for url in targets), return_exceptions=True)
        texts = []
        for url, r in zip(targets, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("metrics scrape of %s failed: %r", url, r)
                continue
            texts.append(r)
        return texts
