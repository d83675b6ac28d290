"""The load tester's one configuration object: what to send, where, how fast, for how long.

Owns validation of every knob (a bad value raises `ValueError` naming the field, the value and the
limit) and the URL rule: the tester only ever talks to the base URL it is given (its API paths and its
/metrics). It does not parse command lines (loadtest/cli.py) or send anything (loadtest/runner.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class Workload(str, Enum):
    TRANSLATE = "translate"  # POST /v1/translate, sentences from the translation test split
    GENERATE = "generate"  # POST /v1/generate, prompts cut from the generation test split
    COMPLETIONS = "completions"  # POST /v1/completions (OpenAI), the same prompts


class Arrival(str, Enum):
    POISSON = "poisson"  # exponential gaps: coefficient of variation 1
    GAMMA = "gamma"  # gamma gaps with a chosen coefficient of variation (>1 = bursty, <1 = smooth)


class LoadMode(str, Enum):
    OPEN = "open"  # requests arrive at a set rate whether or not earlier ones finished
    CLOSED = "closed"  # a fixed number of clients, each sends its next request when the last one ends


STREAMABLE = {Workload.GENERATE, Workload.COMPLETIONS}
DEFAULT_DURATION_S = 60.0


@dataclass(frozen=True)
class SLO:
    """One service-level objective: `metric`'s `stat` (p50, p99, mean, ...) must be <= `threshold_s`."""
    metric: str  # ttft | itl | tpot | e2e
    stat: str  # "p99", "p50", "p99.9" or "mean"
    threshold_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}"

    @property
    def percentile(self) -> float | None:
        return None if self.stat == "mean" else float(self.stat[1:])


@dataclass(frozen=True)
class LoadConfig:
    url: str  # base URL of the server, e.g. http://127.0.0.1:8000 (API paths are appended to it)
    workload: Workload = Workload.GENERATE
    rate: float | None = None  # open loop: mean arrivals per second
    concurrency: int | None = None  # closed loop: clients in flight
    duration_s: float | None = None  # measured phase length; None with requests=None -> 60 s
    requests: int | None = None  # measured requests to send (warm-up ones not counted)
    warmup_s: float = 0.0  # requests started in the first warmup_s seconds are excluded from stats
    arrival: Arrival = Arrival.POISSON
    burstiness: float = 1.0  # coefficient of variation of the gaps between arrivals (gamma only)
    seed: int = 0
    max_tokens: int = 64
    min_tokens: int | None = None  # set: request i asks for max_tokens drawn uniformly in [min_tokens, max_tokens]
    stream: bool | None = None  # None: stream where the endpoint can (generate, completions)
    temperature: float = 1.0
    beam_size: int | None = None  # translate only; None leaves the server's default
    model: str = "generate"  # the `model` field of OpenAI completions requests
    timeout_s: float = 120.0  # per-request deadline, connect to last byte
    max_inflight: int = 1024  # open loop: arrivals finding this many in flight are dropped and counted
    data_dir: Path = Path("artifacts/data")
    scrape_metrics: bool = True  # read the server's /metrics before and after the run
    api_key_env: str | None = None  # an environment variable holding the server's API key (sent as a Bearer token)
    progress: bool = False  # a tqdm bar on stderr
    slos: tuple[SLO, ...] = field(default_factory=tuple)
    # The share of requests that repeat an earlier request's input (and seed): a response cache's workload. None:
    # each input drawn at random from the test split, as usual.
    repeat_fraction: float | None = None
    no_cache: bool = False  # send `Cache-Control: no-cache`: the server's response cache is bypassed

    def __post_init__(self) -> None:
        for name, enum in (("workload", Workload), ("arrival", Arrival)):
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    object.__setattr__(self, name, enum(value))
                except ValueError:
                    raise ValueError(f"{name}={value!r} is not one of {[e.value for e in enum]}") from None
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        object.__setattr__(self, "slos", tuple(self.slos))
        self._validate()

    def _validate(self) -> None:
        check_url(self.url)
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env={self.api_key_env!r} names an unset or empty environment variable; "
                             f"export it with the server's API key")
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError(f"give exactly one of rate (open loop) or concurrency (closed loop); "
                             f"got rate={self.rate}, concurrency={self.concurrency}")
        _positive("rate", self.rate, finite=True)
        _positive("concurrency", self.concurrency, upper=10_000)
        _positive("duration_s", self.duration_s, finite=True)
        _positive("requests", self.requests, upper=10_000_000)
        _positive("burstiness", self.burstiness, finite=True)
        _positive("max_tokens", self.max_tokens, upper=100_000)
        _positive("min_tokens", self.min_tokens, upper=100_000)
        if self.min_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; "
                             f"give min_tokens <= max_tokens")
        _positive("timeout_s", self.timeout_s, finite=True)
        _positive("max_inflight", self.max_inflight, upper=100_000)
        _positive("beam_size", self.beam_size, upper=64)
        if self.repeat_fraction is not None and not 0.0 <= self.repeat_fraction < 1.0:
            raise ValueError(f"repeat_fraction={self.repeat_fraction} must be in [0, 1)")
        if not (0.0 <= self.warmup_s < math.inf):
            raise ValueError(f"warmup_s={self.warmup_s} must be >= 0 and finite")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature={self.temperature} must be in [0, 100]")
        if self.stream and self.workload not in STREAMABLE:
            raise ValueError(f"stream=True is not available for workload={self.workload.value}: "
                             f"/v1/translate answers in one JSON body; drop --stream")
        if self.arrival is Arrival.POISSON and self.burstiness != 1.0:
            raise ValueError(f"burstiness={self.burstiness} needs arrival=gamma (Poisson arrivals have "
                             f"burstiness 1 by definition)")
        if self.beam_size is not None and self.workload is not Workload.TRANSLATE:
            raise ValueError(f"beam_size={self.beam_size} applies to workload=translate only")
        for slo in self.slos:
            if slo.metric in ("ttft", "itl", "tpot") and not self.streams:
                raise ValueError(f"SLO {slo.name} needs a streamed response (TTFT and inter-token times "
                                 f"come from the stream); workload={self.workload.value} "
                                 f"stream={self.streams} measures e2e only")

    @property
    def mode(self) -> LoadMode:
        return LoadMode.OPEN if self.rate is not None else LoadMode.CLOSED

    @property
    def streams(self) -> bool:
        if self.stream is None:
            return self.workload in STREAMABLE
        return self.stream

    @property
    def effective_duration_s(self) -> float | None:
        """The measured phase's length; None means "until `requests` measured requests were sent"."""
        if self.duration_s is None and self.requests is None:
            return DEFAULT_DURATION_S
        return self.duration_s

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    @property
    def metrics_url(self) -> str:
        return self.base_url + "/metrics"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(workload=self.workload.value, arrival=self.arrival.value, mode=self.mode.value,
                 data_dir=str(self.data_dir), stream=self.streams,
                 duration_s=self.effective_duration_s,
                 slos={s.name: s.threshold_s for s in self.slos})
        return d


def check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url={url!r} must be an absolute http:// or https:// URL such as "
                         f"http://127.0.0.1:8000")
    if parts.query or parts.fragment:
        raise ValueError(f"url={url!r} must be a base URL without ?query or #fragment")


def _positive(name: str, value: float | int | None, finite: bool = False, upper: float | None = None) -> None:
    if value is None:
        return
    if not value > 0 or (finite and not math.isfinite(value)):
        raise ValueError(f"{name}={value} must be > 0" + (" and finite" if finite else ""))
    if upper is not None and value > upper:
        raise ValueError(f"{name}={value} exceeds the limit {upper}")
