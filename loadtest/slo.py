"""Service-level objectives: parse `ttft_p99=0.5,e2e_p99=2`, judge a run against them.

An SLO names a latency metric (ttft, itl, tpot, e2e), a statistic (pNN such as p50, p90, p99, p99.9, or
mean) and a bound in seconds; it is met when the statistic over the measured, successful requests is at
most the bound. A metric with no samples is a miss, never a silent pass. The process exit status that
follows from the verdicts is loadtest/cli.py's business.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadtest.client import RequestRecord
from loadtest.config import SLO
from loadtest.stats import metric_samples, stat_of

SLO_METRICS = ("ttft", "itl", "tpot", "e2e")
_NAME = re.compile(r"^(ttft|itl|tpot|e2e)_(p(?:\d{1,2}(?:\.\d+)?|100)|mean)$")


@dataclass(frozen=True)
class SLOResult:
    slo: SLO
    observed: float | None  # None: no samples
    n: int

    @property
    def met(self) -> bool:
        return self.observed is not None and self.observed <= self.slo.threshold_s

    def to_dict(self) -> dict:
        return {"name": self.slo.name, "threshold_s": self.slo.threshold_s, "observed_s": self.observed,
                "samples": self.n, "met": self.met}


def parse_slos(text: str | None) -> tuple[SLO, ...]:
    """`"ttft_p99=0.5,e2e_p99=2"` -> SLOs; raises ValueError naming the bad item and what is allowed."""
    if not text or not text.strip():
        return ()
    slos: dict[str, SLO] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        m = _NAME.match(name)
        if not sep or not m:
            raise ValueError(f"SLO {item!r} is not METRIC_STAT=SECONDS with METRIC one of {SLO_METRICS} and "
                             f"STAT p50, p90, p99, p99.9 or mean (example: ttft_p99=0.5,e2e_p99=2)")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"SLO {name}={value!r}: the bound must be a number of seconds") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"SLO {name}={value}: the bound must be > 0 seconds and finite")
        stat = m.group(2)
        if stat != "mean" and not 0 < float(stat[1:]) <= 100:
            raise ValueError(f"SLO {name}: percentile {stat[1:]} must be in (0, 100]")
        if name in slos:
            raise ValueError(f"SLO {name} is given twice")
        slos[name] = SLO(m.group(1), stat, seconds)
    return tuple(slos.values())


def evaluate(slos: Sequence[SLO], records: Iterable[RequestRecord]) -> list[SLOResult]:
    """Verdicts over the measured (non-warm-up), successful requests among `records`."""
    ok = [r for r in records if r.ok and not r.warmup]
    results = []
    for slo in slos:
        values = metric_samples(ok, slo.metric)
        results.append(SLOResult(slo, stat_of(values, slo.stat), len(values)))
    return results


def all_met(results: Iterable[SLOResult]) -> bool:
    return all(r.met for r in results)
