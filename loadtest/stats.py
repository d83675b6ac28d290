"""Statistics over request records: percentiles, throughput, goodput, errors by status, the timeline.

Pure functions of a list of `RequestRecord`s (no network, no files), so they are tested on fixture data.
Conventions: warm-up requests are left out of every figure except the totals sent; latencies come from
successful requests only; TTFT, inter-token latency (ITL) and time per output token (TPOT) exist only for
streamed answers. Goodput counts the successful requests whose own TTFT, TPOT, e2e and largest
inter-token gap are within the loosest threshold the SLOs give for that metric.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from loadtest.client import RequestRecord
from loadtest.config import SLO

METRICS = ("ttft", "tpot", "itl", "e2e")
METRIC_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
                 "e2e": "End-to-end latency"}  # the report's and the plots' name of each metric
PERCENTILES = (50, 90, 99)


def metric_samples(records: Iterable[RequestRecord], metric: str) -> list[float]:
    """All values of one latency metric over the given (successful) records; ITL pools every gap."""
    out: list[float] = []
    for r in records:
        if metric == "itl":
            out.extend(r.itls)
        else:
            v = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}[metric]
            if v is not None:
                out.append(v)
    return out


def stat_of(values: Sequence[float], stat: str) -> float | None:
    """`stat` is "mean" or "pNN" (any percentile, linear interpolation); None for no values."""
    if not values:
        return None
    if stat == "mean":
        return float(np.mean(values))
    return float(np.percentile(values, float(stat[1:])))


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {"n": len(values), "mean": stat_of(values, "mean")}
    for p in PERCENTILES:
        out[f"p{p}"] = stat_of(values, f"p{p}")
    out["max"] = float(max(values)) if values else None
    return out


def measured(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.warmup]


def window(records: Sequence[RequestRecord], measure_start: float) -> float:
    """Seconds from the end of warm-up to the last measured request's end (> 0)."""
    ends = [r.end for r in records]
    return max(max(ends, default=measure_start) - measure_start, 1e-9)


def request_meets(r: RequestRecord, limits: dict[str, float]) -> bool:
    """Whether one request is "good" under per-metric limits; an unmeasured metric is a miss."""
    if not r.ok:
        return False
    for metric, limit in limits.items():
        if metric == "itl":
            gaps = r.itls
            value = max(gaps) if gaps else (0.0 if r.ttft is not None else None)
        else:
            value = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}[metric]
            if metric == "tpot" and value is None and r.ttft is not None:
                value = 0.0  # a one-token answer has no time per *further* token
        if value is None or value > limit:
            return False
    return True


def goodput_limits(slos: Sequence[SLO]) -> dict[str, float]:
    limits: dict[str, float] = {}
    for s in slos:
        limits[s.metric] = max(limits.get(s.metric, 0.0), s.threshold_s)
    return limits


def errors_by_status(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.error_kind for r in records if not r.ok).items()))


def throughput(records: Sequence[RequestRecord], measure_start: float, slos: Sequence[SLO]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    span = window(records, measure_start)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    limits = goodput_limits(slos)
    good = sum(request_meets(r, limits) for r in ok)
    return {
        "window_s": span,
        "requests_per_s": len(ok) / span,
        "output_tokens_per_s": out_tokens / span,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / span,
        "goodput_requests_per_s": good / span,
        "good_requests": good,
        "goodput_limits_s": limits,
    }


def client_lag(records: Iterable[RequestRecord]) -> dict[str, float | int | None]:
    """How late the open-loop sender was against its schedule (large values: the client could not keep up)."""
    return summarize([max(r.start - r.scheduled, 0.0) for r in records if r.scheduled is not None])


def timeline(records: Sequence[RequestRecord], bin_s: float | None = None) -> dict[str, list]:
    """Per-bin series over the whole run (warm-up included), binned by each request's end time."""
    if not records:
        return {"bin_s": 0.0, "t": []}
    t_end = max(r.end for r in records)
    bin_s = bin_s or max(1.0, t_end / 120)
    n = max(1, round(t_end / bin_s))  # the last bin absorbs the remainder, so no stub bin at the end
    widths = np.full(n, bin_s)
    widths[-1] = max(t_end - (n - 1) * bin_s, 1e-9)
    done, errors, rejected, tokens = (np.zeros(n) for _ in range(4))
    e2e: list[list[float]] = [[] for _ in range(n)]
    ttft: list[list[float]] = [[] for _ in range(n)]
    for r in records:
        i = min(int(r.end // bin_s), n - 1)
        if r.ok:
            done[i] += 1
            e2e[i].append(r.e2e)
            if r.ttft is not None:
                ttft[i].append(r.ttft)
            _spread_tokens(r, tokens, bin_s, n)
        elif r.status == 429:
            rejected[i] += 1
        else:
            errors[i] += 1
    return {
        "bin_s": bin_s,
        "t": [i * bin_s + widths[i] / 2 for i in range(n)],
        "requests_per_s": (done / widths).tolist(),
        "output_tokens_per_s": (tokens / widths).tolist(),
        "rejected_per_s": (rejected / widths).tolist(),
        "errors_per_s": (errors / widths).tolist(),
        "e2e_p50": [stat_of(v, "p50") for v in e2e],
        "e2e_p99": [stat_of(v, "p99") for v in e2e],
        "ttft_p50": [stat_of(v, "p50") for v in ttft],
    }


def _spread_tokens(r: RequestRecord, tokens: np.ndarray, bin_s: float, n: int) -> None:
    """Streamed tokens count when they arrived; a JSON answer's tokens when it ended."""
    if r.token_times and len(r.token_times) == r.output_tokens:
        for t in r.token_times:
            tokens[min(int((r.start + t) // bin_s), n - 1)] += 1
    else:
        tokens[min(int(r.end // bin_s), n - 1)] += r.output_tokens
