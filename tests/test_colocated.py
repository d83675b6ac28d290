"""A model colocated in the ingress replica, on a real Ray Serve cluster (slow).

The config is the integration suite's (tests/integration_cluster.py) reduced to `translate` in its own
deployment and `generate` colocated (serving.server.config.colocate): the API and the generate engine in one
process, with 2 KV slots and no waiting room, so that admission shows. Both models answer through the same
API; what a model deployment guarantees holds for the colocated one too: its version in every answer,
per-model readiness, a 429 + Retry-After when its engine is full, its response cache answering repeats, its slots freed when a client goes away,
its batching knobs applied from the ingress's user_config.
"""
from __future__ import annotations

import threading

import httpx
import pytest
from integration_cluster import integration_config, sse
from reliability_cluster import metric, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # the cluster suite CI runs (`make test-cluster`)


@pytest.fixture(scope="module")
def colocated(bundles, ray_cluster):
    from export.bundle import load_bundle
    from serving.server.config import colocate, validate_serve_config
    from serving.server.launch import start

    cfg = integration_config(bundles, ray_cluster["port"])
    app = cfg["applications"][0]
    app["args"]["models"] = [m for m in app["args"]["models"] if m["name"] in ("translate", "generate")]
    app["args"]["models"][1]["engine"]["max_slots"] = 2
    app["args"]["models"][1]["response_cache_entries"] = 64
    app["deployments"] = [d for d in app["deployments"] if d["name"] in ("ingress", "translate", "generate")]
    next(d for d in app["deployments"] if d["name"] == "ingress")["num_replicas"] = 1
    next(d for d in app["deployments"] if d["name"] == "generate")["user_config"].update(max_waiting=0)
    colocate(app, ["generate"])
    start(validate_serve_config(cfg), timeout_s=300)
    base = f"http://127.0.0.1:{cfg['http_options']['port']}"
    with httpx.Client(base_url=base, timeout=30) as c:
        yield c, load_bundle(bundles / "bundles" / "generate").version


def test_both_models_answer_and_the_colocated_one_names_its_version(colocated):
    from ray import serve

    c, version = colocated
    deployments = serve.status().applications["kvserve"].deployments
    assert sorted(deployments) == ["ingress", "translate"]  # no deployment of its own for generate
    r = c.post("/v1/completions", json={"model": "generate", "prompt": "the dog", "max_tokens": 5,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.headers["x-model-version"] == version and r.json()["usage"]["completion_tokens"] == 5
    r = c.post("/v1/generate", json={"model": "generate", "prompt": "the dog", "max_tokens": 5, "stream": True})
    events = sse(r.text)
    assert r.status_code == 200 and r.headers["x-model-version"] == version
    assert '"finish_reason": "length"' in events[-1]
    r = c.post("/v1/translate", json={"text": "the quick brown fox", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert c.get("/v2/models/generate/ready").status_code == 200
    models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert f"generate@{version}" in models


def test_a_repeated_request_is_answered_from_the_colocated_models_cache(colocated):
    """Through Ray Serve's ingress: the second of two identical seeded requests is the first's answer, kept whole
    (serving/server/answer_front.py); sampling without a seed is computed each time."""
    c, version = colocated
    body = {"model": "generate", "prompt": "the cat", "max_tokens": 6, "temperature": 0.9, "seed": 3}
    first, again = c.post("/v1/generate", json=body), c.post("/v1/generate", json=body)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert "x-cache" not in first.headers and again.headers["x-cache"] == "hit"
    assert again.json()["text"] == first.json()["text"] and again.headers["x-model-version"] == version
    assert again.headers["x-request-id"] != first.headers["x-request-id"]  # per request, not kept
    unseeded = {k: v for k, v in body.items() if k != "seed"}
    assert all("x-cache" not in c.post("/v1/generate", json=unseeded).headers for _ in range(2))


def test_a_full_colocated_engine_answers_429_with_retry_after(colocated):
    """8 requests at once for 2 KV slots and no waiting room: the engine admits what fits, refuses the rest."""
    from concurrent.futures import ThreadPoolExecutor

    c, _ = colocated
    barrier = threading.Barrier(8)

    def one(i: int) -> httpx.Response:  # prompts of their own: the response cache never answers one for another
        barrier.wait()
        return c.post("/v1/generate", json={"model": "generate", "prompt": "abcdefgh"[i], "max_tokens": 63, "ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    busy = [r for r in answers if r.status_code == 429]
    assert all(float(r.headers["retry-after"]) > 0 for r in busy)
    assert all(r.json()["error"]["type"] for r in busy)


def test_a_dropped_stream_frees_its_colocated_slot(colocated):
    c, _ = colocated
    for _ in range(2):
        with c.stream("POST", "/v1/generate", json={"model": "generate", "prompt": "a", "max_tokens": 63,
                                                    "stream": True, "ignore_eos": True}) as r:
            next(r.iter_bytes())  # the first event, then the client goes away
    freed = wait_for(lambda: metric(c.get("/metrics").text, "kvserve_kv_slots_used", model="generate") == 0, 20,
                     period_s=0.5)
    assert freed is not None, "the colocated engine kept the dropped streams' slots"
    r = c.post("/v1/completions", json={"model": "generate", "prompt": "c", "max_tokens": 3})
    assert r.status_code == 200, r.text
