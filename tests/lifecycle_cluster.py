"""The model-lifecycle suites' Serve config and load (tests/test_lifecycle.py, bench/autoscale.py).

`lifecycle_config` is deploy/serve_config.yaml reduced to one `generate` model (optionally with a canary or an
autoscaling_config), every deployment with `max_surge_percent: 100` as shipped, so that a rollout starts the new
replicas before it stops the old ones. `Load` drives it from client threads with real HTTP: half
`/v1/completions`, half streaming `/v1/generate`, recording for every request its status, the version that
answered (X-Model-Version), and whether a stream ended with its final event (a cut stream has none).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def lifecycle_config(art: Path, port: int, bundle: str = "bundles/generate", canary: dict | None = None,
                     autoscaling: dict | None = None, slots: int = 8) -> dict:
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["http_options"].update(port=port, host="127.0.0.1")
    app = cfg["applications"][0]
    app["args"]["artifacts_dir"] = str(art)
    app["args"]["limits"].update(max_prompt_tokens=24, max_tokens=64, request_timeout_s=60)
    model = {"name": "generate", "bundle": bundle, "engine": {"max_slots": slots, "intra_op_threads": 1}}
    if canary:
        model["canary"] = canary
    app["args"]["models"] = [model]
    small = {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 60, "max_surge_percent": 100}
    gen = {"name": "generate", "max_ongoing_requests": 64, **small,
           "user_config": {"batching": "continuous", "max_waiting": 64}}
    if autoscaling:
        gen["autoscaling_config"] = autoscaling
    app["deployments"] = [{"name": "ingress", "max_ongoing_requests": 512, **small}, gen]
    if canary:
        app["deployments"].append({**gen, "name": "generate-canary"})
    return cfg


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
