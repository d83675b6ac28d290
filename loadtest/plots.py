"""PNG pictures of a load test: the latency distributions, and throughput and latency over time.

Draws on `matplotlib.figure.Figure` objects directly (no pyplot, so no global backend or figure state
is touched in the caller's process and no display is needed). Owns only drawing: it is given the request
records, the timeline (loadtest/stats.py) and the run's config dict, and knows nothing of the `Report`
(loadtest/report.py calls it from `Report.write`).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from loadtest.client import RequestRecord
from loadtest.stats import METRIC_TITLES, metric_samples


def plot_latency(records: Sequence[RequestRecord], config: dict[str, Any], path: Path) -> None:
    """Four panels: histogram + empirical CDF of each latency metric (measured successes), p50/p99 marked."""
    ok = [r for r in records if r.ok and not r.warmup]
    fig = Figure(figsize=(11, 7))
    axes = fig.subplots(2, 2)
    for ax, (key, title) in zip(axes.flat, METRIC_TITLES.items()):
        values = np.asarray(metric_samples(ok, key)) * 1000.0
        ax.set_title(title)
        ax.set_xlabel("ms")
        if values.size == 0:
            ax.text(0.5, 0.5, "n/a (not measured)", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
            continue
        ax.hist(values, color="tab:blue", alpha=0.6, **_bins(values))
        ax.set_ylabel("requests" if key != "itl" else "gaps")
        cdf = ax.twinx()
        xs = np.sort(values)
        cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size, color="tab:orange")
        cdf.set_ylim(0, 1.02)
        cdf.set_ylabel("CDF")
        for p, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(values, p))
            ax.axvline(v, color="black", linestyle=style, label=f"p{p} {v:.1f} ms")
        ax.legend(loc="center right", fontsize=8)
    fig.suptitle(_title(config))
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def plot_timeline(tl: dict[str, list], measure_start: float, config: dict[str, Any], path: Path) -> None:
    """Top: completed requests/s, output tokens/s, 429s and errors; bottom: e2e p50/p99 and TTFT p50.
    `tl` is loadtest/stats.py `timeline`; the warm-up (before `measure_start` seconds) is shaded."""
    fig = Figure(figsize=(11, 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    if tl.get("t"):
        t = np.asarray(tl["t"])
        top.plot(t, tl["requests_per_s"], label="completed req/s", color="tab:blue")
        top.plot(t, tl["rejected_per_s"], label="429/s", color="tab:red")
        top.plot(t, tl["errors_per_s"], label="other errors/s", color="black")
        tok = top.twinx()
        tok.plot(t, tl["output_tokens_per_s"], label="output tokens/s", color="tab:green", alpha=0.7)
        tok.set_ylabel("tokens/s")
        tok.legend(loc="upper right", fontsize=8)
        for key, label in (("e2e_p50", "e2e p50"), ("e2e_p99", "e2e p99"), ("ttft_p50", "TTFT p50")):
            ys = np.array([np.nan if v is None else v * 1000.0 for v in tl[key]])
            if not np.all(np.isnan(ys)):
                bottom.plot(t, ys, marker=".", label=label)
    for ax in (top, bottom):
        if measure_start > 0:
            ax.axvspan(0, measure_start, color="grey", alpha=0.15, label="warm-up")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
    top.set_ylabel(f"per second ({tl.get('bin_s', 0):g} s bins)")
    bottom.set_ylabel("latency (ms), by completion time")
    bottom.set_xlabel("seconds since start")
    fig.suptitle(_title(config))
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _bins(values: np.ndarray) -> dict:
    """Histogram bins; a (near-)constant sample gets one bin around its value (numpy refuses 0-width bins)."""
    lo, hi = float(values.min()), float(values.max())
    if hi - lo <= 1e-6 * max(1.0, abs(hi)):
        return {"bins": 1, "range": (lo - 0.5, hi + 0.5)}
    return {"bins": min(50, max(5, values.size // 4))}


def _title(c: dict[str, Any]) -> str:
    load = f"rate {c['rate']:g}/s" if c["mode"] == "open" else f"concurrency {c['concurrency']}"
    return f"{c['workload']} · {c['mode']} loop, {load} · {c['url']}"
