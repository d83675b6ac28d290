"""Open-loop arrival times: Poisson, or gamma-distributed gaps for bursty (or smooth) traffic.

A gamma distribution with shape k = 1/CV^2 and scale 1/(rate*k) has mean gap 1/rate and coefficient of
variation CV: CV = 1 is Poisson, CV > 1 clusters arrivals into bursts, CV < 1 spaces them evenly. The
times are a pure function of (rate, arrival, CV, seed). Sending is loadtest/runner.py's business.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from loadtest.config import Arrival

_BLOCK = 256  # gaps drawn per numpy call


def arrival_gaps(rate: float, arrival: Arrival, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """An endless stream of gaps (seconds) between consecutive arrivals."""
    if not rate > 0:
        raise ValueError(f"rate={rate} must be > 0")
    if not burstiness > 0:
        raise ValueError(f"burstiness={burstiness} must be > 0")
    while True:
        if arrival is Arrival.POISSON:
            block = rng.exponential(1.0 / rate, size=_BLOCK)
        else:
            shape = 1.0 / burstiness**2
            block = rng.gamma(shape, 1.0 / (rate * shape), size=_BLOCK)
        yield from block.tolist()


def arrival_times(rate: float, arrival: Arrival, burstiness: float, seed: int) -> Iterator[float]:
    """Absolute arrival times (seconds from the start), increasing; the first one is 0."""
    rng = np.random.default_rng([seed, 0xA77])
    t = 0.0
    for gap in arrival_gaps(rate, arrival, burstiness, rng):
        yield t
        t += gap
