"""What the reliability suites send and how they read the answers: the request bodies of the models of
tests/reliability_cluster.py, `post` and `stream` (each request ends as one `Outcome`, whatever happens to
it), and `counts` of statuses. Used by tests/test_reliability.py and tests/test_reliability_admission.py.
"""
from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass

import httpx

from serving.server.stream import DEADLINE_GRACE_S

from reliability_cluster import DEADLINE_S

GRACE_S = DEADLINE_GRACE_S  # the backstop past the engine's own deadline
CLIENT_TIMEOUT_S = DEADLINE_S + GRACE_S + 10  # a response later than this counts as a hang
GEN = {"model": "generate", "prompt": "the quick", "max_tokens": 60, "ignore_eos": True}  # KV cache: 64
BUSY = {"model": "busy", "prompt": "the", "max_tokens": 100, "ignore_eos": True}
LONG = {"model": "long", "prompt": "the", "max_tokens": 250, "ignore_eos": True}  # KV cache: 256


@dataclass
class Outcome:
    status: int | None  # None: no HTTP response at all (connection error or client timeout)
    latency: float
    retry_after: str | None = None
    error: dict | None = None
    failure: str | None = None
    finished_at: float = 0.0


async def post(client: httpx.AsyncClient, body: dict, path: str = "/v1/generate") -> Outcome:
    t0 = time.monotonic()
    try:
        r = await client.post(path, json=body)
    except httpx.HTTPError as e:
        return Outcome(None, time.monotonic() - t0, failure=f"{type(e).__name__}: {e}")
    error = None
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        error = r.json().get("error")
    return Outcome(r.status_code, time.monotonic() - t0, r.headers.get("retry-after"), error,
                   finished_at=time.monotonic())


async def stream(client: httpx.AsyncClient, body: dict) -> Outcome:
    """A streamed /v1/generate: a 200 ends with the final event, or with an error event after a failure."""
    t0 = time.monotonic()
    try:
        async with client.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(r.status_code, time.monotonic() - t0, r.headers.get("retry-after"),
                               r.json().get("error"), finished_at=time.monotonic())
            events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        return Outcome(None, time.monotonic() - t0, failure=f"{type(e).__name__}: {e}")
    final = events[-1] if events else {}
    outcome = Outcome(200, time.monotonic() - t0, error=final.get("error"), finished_at=time.monotonic())
    if outcome.error is None:  # a complete stream: every token once, in order (a replayed stream would not be)
        tokens = [e["token"] for e in events[:-1]]
        if "".join(tokens) != final.get("text") or len(tokens) > final["usage"]["completion_tokens"]:
            outcome.failure = f"stream text differs from its final event: {tokens!r} vs {final!r}"
    return outcome


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(sorted(collections.Counter(str(o.status) for o in outcomes).items()))
