"""The load test's result: one `Report` built from the request records, written as JSON and markdown.

Owns what a run's figures are called and how they read (`to_json`, `to_markdown`, `write`). The figures
themselves come from loadtest/stats.py and loadtest/slo.py, the server's deltas from
loadtest/promscrape.py, the pictures from loadtest/plots.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import stats
from loadtest.client import RequestRecord
from loadtest.config import SLO
from loadtest.slo import SLOResult, all_met, evaluate


@dataclass
class Report:
    config: dict[str, Any]
    started_at: str  # ISO 8601, UTC
    inputs: str  # where the request texts came from
    inputs_fallback: bool
    measure_start: float  # seconds after the start when the measured phase began
    totals: dict[str, Any]
    throughput: dict[str, Any]
    latency: dict[str, dict[str, Any]]
    errors: dict[str, int]
    retry_after: dict[str, Any]
    slo_results: list[SLOResult]
    server: dict[str, Any]
    client_lag: dict[str, Any]
    timeline: dict[str, list]
    records: list[RequestRecord] = field(repr=False, default_factory=list)

    @classmethod
    def build(cls, *, config: dict[str, Any], records: list[RequestRecord], measure_start: float,
              slos: tuple[SLO, ...] = (), server: dict[str, Any] | None = None, inputs: str = "",
              inputs_fallback: bool = False, dropped: int = 0, started_at: str = "") -> "Report":
        m = stats.measured(records)
        ok = [r for r in m if r.ok]
        done_all = [r for r in records if r.ok]
        totals = {
            "sent": len(records), "warmup": len(records) - len(m), "measured": len(m), "succeeded": len(ok),
            "failed": len(m) - len(ok), "rejected_429": sum(r.status == 429 for r in m),
            "dropped_client_side": dropped,
            # Every request sent, warm-up included: what the server's counters should show.
            "all_completed": len(done_all),
            "all_output_tokens": sum(r.output_tokens for r in done_all),
            "all_prompt_tokens": sum(r.prompt_tokens or 0 for r in done_all),
            "output_tokens": sum(r.output_tokens for r in ok),
        }
        return cls(
            config=config, started_at=started_at, inputs=inputs, inputs_fallback=inputs_fallback,
            measure_start=measure_start, totals=totals,
            throughput=stats.throughput(m, measure_start, slos),
            latency={k: stats.summarize(stats.metric_samples(ok, k)) for k in stats.METRICS},
            errors=stats.errors_by_status(m),
            retry_after=stats.summarize([r.retry_after for r in m if r.retry_after is not None]),
            slo_results=evaluate(slos, records), server=server or {"available": False, "error": "not scraped"},
            client_lag=stats.client_lag(m), timeline=stats.timeline(records), records=records)

    @property
    def slo_met(self) -> bool:
        return all_met(self.slo_results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config, "started_at": self.started_at, "inputs": self.inputs,
            "inputs_fallback": self.inputs_fallback, "measure_start_s": self.measure_start,
            "totals": self.totals, "throughput": self.throughput, "latency_s": self.latency,
            "errors_by_status": self.errors, "retry_after_s": self.retry_after,
            "slo": [r.to_dict() for r in self.slo_results], "slo_met": self.slo_met,
            "server_metrics_delta": self.server, "client_send_lag_s": self.client_lag,
            "timeline": self.timeline,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False, default=_json_default)

    def to_markdown(self, plots: dict[str, str] | None = None) -> str:
        c, t, th = self.config, self.totals, self.throughput
        load = _load_text(c)
        lines = [
            f"# Load test: {c['workload']} against {c['url']}", "",
            f"{self.started_at} · {c['mode']} loop, {load} · stream={c['stream']} · max_tokens={c['max_tokens']}"
            f" · warm-up {c['warmup_s']:g} s · seed {c['seed']}", "",
            f"Inputs: {self.inputs}" + (" **(fallback: the test split was not found)**"
                                        if self.inputs_fallback else ""), "",
            "## Throughput", "", "| figure | value |", "| --- | --- |",
            f"| measured window | {th['window_s']:.2f} s |",
            f"| requests sent (measured / warm-up) | {t['measured']} / {t['warmup']} |",
            f"| succeeded / failed (429) | {t['succeeded']} / {t['failed']} ({t['rejected_429']}) |",
            *_offered(c, t),
            f"| request throughput | {th['requests_per_s']:.2f} req/s |",
            f"| output tokens/s | {th['output_tokens_per_s']:.1f} |",
            f"| goodput | {th['goodput_requests_per_s']:.2f} req/s ({th['good_requests']} requests"
            f"{_limits(th['goodput_limits_s'])}) |",
        ]
        if t["dropped_client_side"]:
            lines.append(f"| dropped by the client (max_inflight reached) | {t['dropped_client_side']} |")
        lines += ["", *self._latency_md(), "", *self._slo_md(), "", *self._errors_md(), "",
                  *self._server_md(), ""]
        lag = self.client_lag
        if lag["n"]:
            lines += [f"Client send lag behind the arrival schedule: p99 {_ms(lag['p99'])}, max {_ms(lag['max'])}"
                      " (large values mean the load generator, not the server, was the bottleneck).", ""]
        for title, path in (plots or {}).items():
            lines += [f"![{title}]({path})", ""]
        return "\n".join(lines)

    def _latency_md(self) -> list[str]:
        out = ["## Latency (successful measured requests)", "", "| metric | n | p50 | p90 | p99 | mean | max |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for key, label in stats.METRIC_TITLES.items():
            s = self.latency[key]
            out.append(f"| {label} ({key}) | {s['n']} | " + " | ".join(
                _ms(s[k]) for k in ("p50", "p90", "p99", "mean", "max")) + " |")
        if not self.config.get("stream"):
            out += ["", "TTFT, TPOT and inter-token latency need a streamed answer: n/a for this run."]
        return out

    def _slo_md(self) -> list[str]:
        if not self.slo_results:
            return ["## SLOs", "", "No SLO given (goodput counts every successful request)."]
        verdict = "all met" if self.slo_met else "**MISSED**"
        out = [f"## SLOs: {verdict}", "", "| SLO | bound | observed | samples | met |",
               "| --- | --- | --- | --- | --- |"]
        for r in self.slo_results:
            out.append(f"| {r.slo.name} | {_ms(r.slo.threshold_s)} | {_ms(r.observed)} | {r.n} | "
                       f"{'yes' if r.met else '**no**'} |")
        return out

    def _errors_md(self) -> list[str]:
        if not self.errors:
            return ["## Errors", "", "None."]
        out = ["## Errors by status", "", "| status | count |", "| --- | --- |"]
        out += [f"| {k} | {v} |" for k, v in self.errors.items()]
        if self.retry_after["n"]:
            out += ["", f"429 answers carried Retry-After: median {self.retry_after['p50']:g} s, "
                        f"max {self.retry_after['max']:g} s."]
        return out

    def _server_md(self) -> list[str]:
        s, t = self.server, self.totals
        if not s.get("available"):
            return ["## Server /metrics", "", f"n/a: {s.get('error')}"]
        bs, qw = s.get("batch_size"), s.get("queue_wait_seconds")
        wr = s.get("waiting_requests") or {}
        out = ["## Server /metrics (after - before; includes warm-up and any other client's traffic)", "",
               "| figure | server | client |", "| --- | --- | --- |",
               f"| requests | {_n(s.get('requests'))} | {t['sent']} sent |",
               f"| requests by status | {_dict(s.get('requests_by_status'))} | {_dict(self.errors) or '-'} "
               f"(measured errors) |",
               f"| generated tokens | {_n(s.get('generated_tokens'))} | {t['all_output_tokens']} |",
               f"| prompt tokens | {_n(s.get('prompt_tokens'))} | {t['all_prompt_tokens']} |",
               "| batch size per step (mean / p50 / p90) | " + (
                   f"{_n(bs['mean'])} / {_n(bs['p50'])} / {_n(bs['p90'])} over {bs['count']:.0f} steps"
                   if bs else "n/a") + " | |",
               "| queue wait (mean / p50 / p99; percentiles interpolated in buckets) | " + (
                   f"{_ms(qw['mean'])} / {_ms(qw['p50'])} / {_ms(qw['p99'])}" if qw else "n/a") + " | |",
               f"| waiting requests (before / after) | {_n(wr.get('before'))} / {_n(wr.get('after'))} | |",
               f"| rejections by reason | {_dict(s.get('rejections_by_reason')) or '-'} | |"]
        if s.get("error"):
            out += ["", f"Note: {s['error']}"]
        return out

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """report.json, report.md, requests.jsonl and the PNG plots under out_dir."""
        from loadtest.plots import plot_latency, plot_timeline  # matplotlib only when writing

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "report.json", "markdown": out / "report.md", "requests": out / "requests.jsonl",
                 "latency_png": out / "latency.png", "timeline_png": out / "timeline.png"}
        plot_latency(self.records, self.config, paths["latency_png"])
        plot_timeline(self.timeline, self.measure_start, self.config, paths["timeline_png"])
        paths["json"].write_text(self.to_json() + "\n", encoding="utf-8")
        paths["markdown"].write_text(self.to_markdown({"Latency distribution": "latency.png",
                                                       "Throughput and latency over time": "timeline.png"}),
                                     encoding="utf-8")
        with open(paths["requests"], "w", encoding="utf-8") as f:
            for r in self.records:
                f.write(json.dumps(r.to_dict(), default=_json_default) + "\n")
        return paths


def _offered(c: dict[str, Any], t: dict[str, Any]) -> list[str]:
    """Open loop: the rate actually offered (a seeded random process only averages `rate` in the long run)."""
    if c["mode"] != "open" or not c.get("duration_s") or c.get("requests"):
        return []
    return [f"| offered load (measured arrivals / duration) | {t['measured'] / c['duration_s']:.2f} req/s |"]


def _load_text(c: dict[str, Any]) -> str:
    if c["mode"] != "open":
        return f"concurrency {c['concurrency']}"
    shape = f"gamma, CV {c['burstiness']:g}" if c["arrival"] == "gamma" else c["arrival"]
    return f"rate {c['rate']:g}/s ({shape})"


def _json_default(o: Any) -> Any:
    if hasattr(o, "value"):
        return o.value
    return str(o)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f} ms"


def _n(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.2f}"


def _dict(d: dict | None) -> str:
    return "n/a" if d is None else ", ".join(f"{k}: {_n(v)}" for k, v in d.items()) or "-"


def _limits(limits: dict[str, float]) -> str:
    return "" if not limits else " within " + ", ".join(f"{k} <= {_ms(v)}" for k, v in limits.items())
