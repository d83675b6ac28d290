"""Integration tests: a real local Ray Serve cluster (one per test run) serving tiny exported bundles: the
endpoints, client errors, overload, deadlines, disconnects and metrics across replicas (the application:
tests/integration_cluster.py; the lifecycle tests that change it: tests/test_server_lifecycle.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import shutil
import subprocess
import time

import httpx
import pytest
from integration_cluster import SENTENCES, metric, settled_metrics, sse, wait_metric

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # the cluster suite CI runs (`make test-cluster`)


# -- endpoints ---------------------------------------------------------------------------------------------
def test_health_and_models(client):
    assert client.get("/v2/health/live").json() == {"status": "live"}
    assert client.get("/v2/health/ready").json() == {"status": "ready"}
    data = client.get("/v1/models").json()["data"]
    ids = {m["id"]: m["task"] for m in data if "parent" not in m}
    assert ids == {"translate": "translate", "generate": "generate", "slowgen": "generate", "waitgen": "generate"}
    pinned = {m["id"] for m in data if "parent" in m}  # one `model@version` entry per served version
    assert pinned == {f"{m['id']}@{m['version']}" for m in data if "parent" not in m}
    meta = client.get("/v2/models/translate").json()  # KServe v2 metadata
    assert meta["name"] == "translate" and meta["versions"] == [ids_version(data, "translate")]
    # the tokenizer of a model in a deployment of its own, through its replica's handle
    tokens = client.post("/tokenize", json={"model": "generate", "prompt": "the dog"}).json()["tokens"]
    assert client.post("/detokenize", json={"model": "generate", "tokens": tokens[1:]}).json() == {"prompt": "the dog"}
    r = client.post("/detokenize", json={"model": "generate", "tokens": [-1]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "tokens"


def ids_version(data: list, model: str) -> str:
    return next(m["version"] for m in data if m["id"] == model)


def test_translate_matches_bundle_evaluation(client, server):
    """HTTP translations (request-level batching) equal export/evaluate.py's on the bundle,
    so chrF over HTTP equals `kvserve evaluate` on the bundle."""
    from export.bundle import load_bundle
    from export.evaluate import scores, translate_texts
    from model.tokenizer import Tokenizer
    from serving.engine.runtime import ModelRuntime

    bundle = load_bundle(server["art"] / "bundles" / "translate")
    rt = ModelRuntime(bundle, n_slots=4, provider="cpu", intra_op_threads=1)
    want = translate_texts(rt, Tokenizer.load(bundle.tokenizer_path), SENTENCES)
    r = client.post("/v1/translate", json={"text": SENTENCES, "max_tokens": rt.max_len - 1})
    assert r.status_code == 200, r.text
    got = [t["text"] for t in r.json()["translations"]]
    assert got == want
    refs = ["the quick brown fox", "over the lazy dog", "dog", "", "the dog"]
    assert scores(got, refs)["chrf"] == scores(want, refs)["chrf"]
    usage = r.json()["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


def test_translate_beam_n_best(client):
    r = client.post("/v1/translate", json={"text": "the lazy dog", "beam_size": 4, "n_best": 3, "max_tokens": 10})
    assert r.status_code == 200, r.text
    t = r.json()["translations"][0]
    assert len(t["n_best"]) == 3 and t["text"] == t["n_best"][0]["text"]
    scores = [h["score"] for h in t["n_best"]]
    assert scores == sorted(scores, reverse=True)


def test_request_level_batch_isolates_bad_requests(server):
    """`translate` batches at the request level: a request the engine refuses (beam 8 > its 4 KV slots) fails
    alone with a 4xx, and a batch needing more slots than the pool (3 x beam 2) still completes."""
    bodies = [{"text": "the dog", "beam_size": 8}, {"text": "the fox", "max_tokens": 8},
              {"text": "a dog", "beam_size": 2, "max_tokens": 8}, {"text": "a fox", "beam_size": 2, "max_tokens": 8},
              {"text": "the cat", "beam_size": 2, "max_tokens": 8}] * 2

    def call(body: dict) -> httpx.Response:
        return httpx.post(server["base"] + "/v1/translate", json=body, timeout=60)
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(call, bodies))
    for body, r in zip(bodies, responses):
        if body.get("beam_size") == 8:
            assert r.status_code == 422 and r.json()["error"]["field"] == "beam_size", r.text
        else:
            assert r.status_code == 200, r.text


def test_generate_json_equals_stream(client):
    body = {"prompt": "the quick", "max_tokens": 12}
    plain = client.post("/v1/generate", json=body).json()
    r = client.post("/v1/generate", json={**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse(r.text)]
    final = events[-1]
    assert "".join(e["token"] for e in events[:-1]) == final["text"] == plain["text"]
    assert final["finish_reason"] == plain["finish_reason"]
    assert final["usage"] == plain["usage"] and plain["usage"]["prompt_tokens"] == 2
    assert final["timings"]["ttft_s"] is not None and final["timings"]["total_s"] >= final["timings"]["ttft_s"]


def test_generate_seed_reproducible_and_stop(client):
    body = {"prompt": "the", "max_tokens": 20, "temperature": 1.0, "top_k": 50, "seed": 7}
    a, b = (client.post("/v1/generate", json=body).json()["text"] for _ in range(2))
    assert a == b and len(a) > 2
    stop = a[len(a) // 2: len(a) // 2 + 2]
    r = client.post("/v1/generate", json={**body, "stop": stop}).json()
    assert r["text"] == a[: a.index(stop)] and r["finish_reason"] == "stop"


def test_openai_client(server):
    import openai

    oai = openai.OpenAI(api_key="unused", base_url=server["base"] + "/v1", max_retries=0)
    assert {m.id for m in oai.models.list().data} >= {"generate", "translate"}
    c = oai.completions.create(model="generate", prompt="the quick", max_tokens=8, temperature=0)
    assert c.object == "text_completion" and c.usage.completion_tokens <= 8
    chunks = list(oai.completions.create(model="generate", prompt="the quick", max_tokens=8, temperature=0,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.choices[0].text
    assert chunks[-1].choices[0].finish_reason == c.choices[0].finish_reason
    t = oai.completions.create(model="translate", prompt="the dog", max_tokens=8)
    assert t.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x")


# -- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,status,field", [
    ("/v1/translate", {"text": "x", "beam_size": 9}, 422, "beam_size"),
    ("/v1/generate", {"prompt": "x", "top_p": 2}, 422, "top_p"),
    ("/v1/generate", {"prompt": "x", "beam_size": 2}, 422, "beam_size"),
    ("/v1/generate", {"prompt": "x", "model": "gpt"}, 404, "model"),
    ("/v1/generate", {"prompt": "fox " * 30}, 413, "prompt"),
    ("/v1/generate", {"prompt": "the dog", "max_tokens": 63}, 413, None),  # engine: prompt + 63 > KV cache
    ("/v1/generate", {"prompt": "x" * 70_000}, 413, "body"),
])
def test_client_errors(client, path, body, status, field):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (field is None or err["field"] == field)


def test_overload_is_429_with_retry_after(client, server):
    body = {"prompt": "the", "max_tokens": 40, "model": "slowgen", "stream": True}

    def call(_: int) -> httpx.Response:
        return httpx.post(server["base"] + "/v1/generate", json=body, timeout=60)
    with cf.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(call, range(24)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected and statuses.count(200) >= 1
    assert all(r.headers.get("content-type") == "application/json" for r in rejected), [r.text for r in rejected]
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "overloaded" for r in rejected)
    # Both kinds of refusal happen: the engine's (1 slot, no waiting room) and Ray's queue (backpressure).
    text = wait_metric(client, "kvserve_rejections_total", len(rejected), model="slowgen")
    engine = metric(text, "kvserve_rejections_total", model="slowgen", reason="queue_full")
    ray_queue = metric(text, "kvserve_rejections_total", model="slowgen", reason="deployment_queue_full")
    assert engine >= 1 and ray_queue >= 1 and engine + ray_queue == len(rejected)


def test_deadline_is_504(client):
    t0 = time.monotonic()
    r = client.post("/v1/generate", json={"prompt": "the", "model": "waitgen", "max_tokens": 4})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "deadline_exceeded" and time.monotonic() - t0 < 9


def test_client_disconnect_cancels(client, server):
    before = metric(settled_metrics(client), "kvserve_cancellations_total", model="waitgen", reason="disconnect")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/generate", timeout=1.0,
                   json={"prompt": "the", "model": "waitgen", "max_tokens": 4, "stream": True})
    text = wait_metric(client, "kvserve_cancellations_total", before + 1, model="waitgen", reason="disconnect")
    assert metric(text, "kvserve_cancellations_total", model="waitgen", reason="disconnect") == before + 1


# -- metrics across replicas ---------------------------------------------------------------------------------
def _series_by_replica(name: str, deployment: str) -> dict[str, float]:
    """replica -> value of `name` summed over its series, in Ray's own export of this application."""
    import ray
    from serving.server.metrics import RAY_PREFIX

    node = next(x for x in ray.nodes() if x["Alive"])
    raw = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics").text
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{RAY_PREFIX}{name}{{([^}}]*)}} (\S+)$', raw, re.M):
        labels = m.group(1)
        # This application's series only: other suites' applications ran on the same cluster (tests/conftest.py).
        replica = re.search(r'replica="([^"]+)"', labels)
        if 'application="kvserve"' in labels and f'deployment="{deployment}"' in labels and replica:
            out[replica.group(1)] = out.get(replica.group(1), 0.0) + float(m.group(2))
    return out


def test_request_counter_sums_over_replicas(client):
    labels = {"endpoint": "/v1/generate", "model": "generate", "status": "200"}
    before_text = settled_metrics(client)
    before = metric(before_text, "kvserve_requests_total", **labels)
    tokens_before = metric(before_text, "kvserve_generated_tokens_total", model="generate")
    series = (("kvserve_requests_total", "ingress"), ("kvserve_generated_tokens_total", "generate"))
    replicas_before = {key: _series_by_replica(*key) for key in series}
    n, generated = 24, 0
    for i in range(n):
        r = httpx.post(str(client.base_url) + "/v1/generate", json={"prompt": f"the {i}", "max_tokens": 3})
        assert r.status_code == 200
        generated += r.json()["usage"]["completion_tokens"]
    text = wait_metric(client, "kvserve_requests_total", before + n, **labels)
    assert metric(text, "kvserve_requests_total", **labels) == before + n
    text = wait_metric(client, "kvserve_generated_tokens_total", tokens_before + generated, model="generate")
    assert metric(text, "kvserve_generated_tokens_total", model="generate") == tokens_before + generated
    # Both replicas of each deployment really served: each one's own series grew in Ray's export (series of
    # replicas of earlier applications on this cluster may still be listed; they do not grow).
    for key in series:
        after = _series_by_replica(*key)
        grew = {r for r, v in after.items() if v > replicas_before[key].get(r, 0.0)}
        assert len(grew) == 2, (key, replicas_before[key], after)


def test_metrics_exposition_is_promtool_clean(client):
    text = client.get("/metrics").text
    for name in ("kvserve_time_to_first_token_seconds_bucket", "kvserve_engine_step_duration_seconds_count",
                 "kvserve_engine_batch_size_bucket", "kvserve_queue_wait_seconds_sum"):
        assert name in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr
