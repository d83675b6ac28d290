"""Closed-loop HTTP clients whose number can change while they run: `Load` (bench/autoscale.py's ramp, the
model-lifecycle tests in tests/test_lifecycle.py).

`Load` drives a kvserve server from client threads with real HTTP: half `/v1/completions`, half streaming
`/v1/generate`, recording for every request its start and end, status, the model version that answered
(X-Model-Version), its time to first token (streams), and whether the answer was whole (a stream that was cut
never reaches its final event). For steady load at a fixed concurrency or rate, use loadtest/.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    started: float
    ended: float
    endpoint: str
    status: int
    version: str
    complete: bool  # the answer was whole: a JSON body, or a stream that reached its final event
    ttft_s: float | None = None


@dataclass
class Load:
    """`clients` threads sending requests until `stop()`; `set_clients(n)` changes how many are active."""
    base: str
    clients: int
    max_tokens: int = 16
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop, self._lock, self._active = threading.Event(), threading.Lock(), self.clients
        self._threads: list[threading.Thread] = []

    def start(self, max_clients: int | None = None) -> "Load":
        for i in range(max_clients or self.clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def set_clients(self, n: int) -> None:
        self._active = n

    def active(self) -> int:
        return self._active

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        return self.outcomes

    def _client(self, i: int) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as client:
            n = 0
            while not self._stop.is_set():
                if i >= self._active:
                    time.sleep(0.05)
                    continue
                outcome = (self._stream if (i + n) % 2 else self._complete)(client)
                with self._lock:
                    self.outcomes.append(outcome)
                n += 1

    def _complete(self, client: httpx.Client) -> Outcome:
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"model": "generate", "prompt": "the quick brown fox",
                                                 "max_tokens": self.max_tokens, "temperature": 0})
        complete = r.status_code == 200 and bool(r.json().get("choices"))
        return Outcome(t0, time.monotonic(), "completions", r.status_code, r.headers.get("x-model-version", ""),
                       complete)

    def _stream(self, client: httpx.Client) -> Outcome:
        t0, ttft, last = time.monotonic(), None, None
        body = {"prompt": "the lazy dog", "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True}
        with client.stream("POST", "/v1/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    last = json.loads(line[6:])
            version = r.headers.get("x-model-version", "")
        complete = r.status_code == 200 and last is not None and last.get("finish_reason") is not None
        return Outcome(t0, time.monotonic(), "generate-stream", r.status_code, version, complete, ttft)
