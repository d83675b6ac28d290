"""The server's own view: scrape its Prometheus /metrics before and after a run and report the deltas.

Reads the kvserve_* series tolerantly: a metric the server does not export reads as None ("n/a" in the
report), a failed scrape records why, and series are summed over every label set (replicas, models), so
the figures hold for one replica or many. Ray's exporter prefixes names with `ray_`; both spellings are
accepted. It owns no statistics of the client's own measurements (loadtest/stats.py).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "kvserve_"
REQUESTS = "kvserve_requests_total"
GENERATED = "kvserve_generated_tokens_total"
PROMPT = "kvserve_prompt_tokens_total"
BATCH = ("kvserve_engine_batch_size", "kvserve_batch_size")  # the server's name, then the older spelling
QUEUE_WAIT = "kvserve_queue_wait_seconds"
WAITING = "kvserve_waiting_requests"
RUNNING = "kvserve_running_requests"
REJECTIONS = "kvserve_rejections_total"
SCRAPE_TIMEOUT_S = 10.0


@dataclass
class Snapshot:
    """One scrape: kvserve samples as {(name, sorted labels): value}, or why there are none."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    error: str | None = None

    def total(self, name: str, by: str | None = None, **match: str) -> dict[str, float] | float | None:
        """Sum of `name` over all label sets matching `match`; grouped by label `by` if given."""
        found, groups, total = False, defaultdict(float), 0.0
        for (sname, labels), value in self.samples.items():
            if sname != name:
                continue
            lab = dict(labels)
            if any(lab.get(k) != v for k, v in match.items()):
                continue
            found = True
            total += value
            if by is not None:
                groups[lab.get(by, "")] += value
        if not found:
            return None
        return dict(groups) if by is not None else total

    def histogram(self, name: str) -> dict[float, float] | None:
        """Cumulative bucket counts {upper bound: count} summed over label sets."""
        buckets = self.total(name + "_bucket", by="le")
        if not buckets:
            return None
        return {float(le): v for le, v in buckets.items()}


def parse_metrics(text: str) -> Snapshot:
    snap = Snapshot()
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name = s.name[4:] if s.name.startswith("ray_" + PREFIX) else s.name
                if name.startswith(PREFIX):
                    key = (name, tuple(sorted(s.labels.items())))
                    snap.samples[key] = snap.samples.get(key, 0.0) + float(s.value)
    except (ValueError, TypeError, IndexError) as e:
        return Snapshot(error=f"unparsable /metrics: {e}")
    return snap


async def scrape(client: httpx.AsyncClient, url: str) -> Snapshot:
    try:
        resp = await client.get(url, timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError as e:
        return Snapshot(error=f"GET {url} failed: {type(e).__name__}: {e}")
    if resp.status_code != 200:
        return Snapshot(error=f"GET {url} answered {resp.status_code}")
    return parse_metrics(resp.text)  # no kvserve series yet is fine: a fresh server has counted nothing


def _delta(before: Any, after: Any) -> Any:
    if before is None and after is None:
        return None
    if isinstance(after, dict) or isinstance(before, dict):
        before, after = before or {}, after or {}
        return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))
                if after.get(k, 0.0) - before.get(k, 0.0) != 0}
    return (after or 0.0) - (before or 0.0)


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q*count."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = cumulative[b]
        if c >= rank:
            if math.isinf(b):
                return prev_bound  # the quantile lies past the highest finite bucket
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return prev_bound


def histogram_delta(name: str, before: Snapshot, after: Snapshot) -> dict[str, Any] | None:
    hb, ha = before.histogram(name) or {}, after.histogram(name)
    if ha is None:
        return None
    buckets = {b: ha[b] - hb.get(b, 0.0) for b in sorted(ha)}
    count = _delta(before.total(name + "_count"), after.total(name + "_count")) or 0.0
    total = _delta(before.total(name + "_sum"), after.total(name + "_sum")) or 0.0
    return {
        "count": count,
        "mean": total / count if count > 0 else None,
        "p50": histogram_quantile(0.5, buckets),
        "p90": histogram_quantile(0.9, buckets),
        "p99": histogram_quantile(0.99, buckets),
        "buckets": {("+Inf" if math.isinf(b) else f"{b:g}"): c for b, c in buckets.items()},
    }


def server_delta(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """The server's counters over the run; None where a metric is missing, `error` if a scrape failed."""
    error = before.error or after.error
    if error:
        return {"available": False, "error": error}
    if not after.samples:
        return {"available": False, "error": f"the server's /metrics has no {PREFIX}* series"}
    out: dict[str, Any] = {
        "available": True,
        "requests": _delta(before.total(REQUESTS), after.total(REQUESTS)),
        "requests_by_status": _delta(before.total(REQUESTS, by="status"), after.total(REQUESTS, by="status")),
        "requests_by_endpoint": _delta(before.total(REQUESTS, by="endpoint"),
                                       after.total(REQUESTS, by="endpoint")),
        "generated_tokens": _delta(before.total(GENERATED), after.total(GENERATED)),
        "prompt_tokens": _delta(before.total(PROMPT), after.total(PROMPT)),
        "batch_size": next((h for h in (histogram_delta(n, before, after) for n in BATCH) if h), None),
        "queue_wait_seconds": histogram_delta(QUEUE_WAIT, before, after),
        "rejections_by_reason": _delta(before.total(REJECTIONS, by="reason"),
                                       after.total(REJECTIONS, by="reason")),
        "waiting_requests": {"before": before.total(WAITING), "after": after.total(WAITING)},
        "running_requests": {"before": before.total(RUNNING), "after": after.total(RUNNING)},
    }
    for key in ("requests", "generated_tokens", "prompt_tokens"):
        if out[key] is not None and out[key] < 0:
            out[key] = None
            out["error"] = "a counter went down during the run (server restarted?): deltas are n/a"
    return out
