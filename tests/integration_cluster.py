"""The integration suites' Serve config and helpers (tests/test_server_integration.py, test_server_lifecycle.py).

The Serve config is deploy/serve_config.yaml with test overrides (launch.prepare_config + start, exactly
what `kvserve serve` runs): 2 ingress replicas, 2 `generate` replicas, `translate` in the engine's
request-level batching mode, `slowgen` (1 KV slot, no waiting room, a tiny Ray queue) for 429s,
and `waitgen` (request-level batching that waits 10 s for a batch) for deadlines and disconnects.
The `server` and `client` fixtures that deploy it live in tests/conftest.py.
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import yaml
from reliability_cluster import metric  # one exposition parser for the integration and reliability suites

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ["the quick brown fox", "jumps over the lazy dog", "the dog", "", "brown fox over the dog"]


def integration_config(art: Path, port: int) -> dict:
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["http_options"].update(port=port, host="127.0.0.1")
    app = cfg["applications"][0]
    app["args"]["artifacts_dir"] = str(art)
    app["args"]["limits"].update(max_prompt_tokens=24, max_tokens=63, default_max_tokens=16, max_texts=8,
                                 request_timeout_s=4)
    engine = {"max_slots": 4, "intra_op_threads": 1}
    app["args"]["models"] = [
        {"name": "translate", "bundle": "bundles/translate", "engine": engine},
        {"name": "generate", "bundle": "bundles/generate", "engine": engine},
        {"name": "slowgen", "bundle": "bundles/generate", "engine": {**engine, "max_slots": 1}},
        {"name": "waitgen", "bundle": "bundles/generate", "engine": engine}]
    small = {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 5}
    live = {"max_waiting": 16, "max_batch_size": 4, "batch_wait_timeout_s": 0.02}
    app["deployments"] = [
        {"name": "ingress", "num_replicas": 2, "max_ongoing_requests": 64, **small},
        {"name": "translate", "max_ongoing_requests": 16, **small, "user_config": {**live, "batching": "request"}},
        {"name": "generate", "num_replicas": 2, "max_ongoing_requests": 16, **small,
         "user_config": {**live, "batching": "continuous"}},
        {"name": "slowgen", "max_ongoing_requests": 2, "max_queued_requests": 1, **small,
         "backpressure_config": {"status_code": 429, "retry_after_s": 1},
         "user_config": {**live, "max_waiting": 0, "max_batch_size": 1}},
        {"name": "waitgen", "max_ongoing_requests": 16, **small,
         "user_config": {**live, "batching": "request", "max_batch_size": 8, "batch_wait_timeout_s": 10}}]
    return cfg


def sse(text: str) -> list:
    return [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


def wait_metric(client: httpx.Client, name: str, want: float, timeout_s: float = 20, **labels: str) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        if metric(text, name, **labels) >= want or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def settled_metrics(client: httpx.Client) -> str:
    """/metrics once Ray's exporters have caught up with earlier tests: two equal reads in a row, further apart
    than the ingress may serve one cached scrape (serving/server/ingress.py), so equal means settled."""
    from serving.server.ingress import METRICS_STALE_S, METRICS_TTL_S

    text = client.get("/metrics").text
    for _ in range(20):
        time.sleep(1.5 + METRICS_TTL_S + METRICS_STALE_S)
        again = client.get("/metrics").text
        if again == text:
            return text
        text = again
    return text
