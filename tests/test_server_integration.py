"""Integration tests: a real local Ray Serve cluster (one per session) serving tiny exported bundles.

The Serve config is deploy/serve_config.yaml with test overrides (serve_cli.prepare_config + start, exactly
what `kvserve serve` runs): 2 ingress replicas, 2 `generate` replicas, `translate` in request-level mode
(`@serve.batch` -> Engine.run_batch), `slowgen` (1 KV slot, no waiting room, a tiny Ray queue) for 429s,
and `waitgen` (request-level batching that waits 10 s for a batch) for deadlines and disconnects.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from reliability_cluster import metric

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ["the quick brown fox", "jumps over the lazy dog", "the dog", "", "brown fox over the dog"]


def _config(art: Path, port: int) -> dict:
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


@pytest.fixture(scope="session")
def server(bundles, ray_cluster):
    """This suite's application on the session's Ray cluster (tests/conftest.py: `bundles`, `ray_cluster`)."""
    from serving.server.launch import prepare_config, start

    path = bundles / "serve_config.yaml"
    path.write_text(yaml.safe_dump(_config(bundles, ray_cluster["port"])))
    raw = prepare_config(path)
    start(raw, timeout_s=300)
    base = f"http://127.0.0.1:{raw['http_options']['port']}"
    yield {"base": base, "raw": raw, "art": bundles}


@pytest.fixture(scope="session")
def client(server):
    with httpx.Client(base_url=server["base"], timeout=60) as c:
        yield c


def _sse(text: str) -> list:
    return [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


_metric = metric  # one exposition parser for the integration and reliability suites (tests/reliability_cluster.py)


def _wait_metric(client: httpx.Client, name: str, want: float, timeout_s: float = 20, **labels: str) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        if _metric(text, name, **labels) >= want or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


# -- endpoints ---------------------------------------------------------------------------------------------
def test_health_and_models(client):
    assert client.get("/v2/health/live").json() == {"status": "live"}
    assert client.get("/v2/health/ready").json() == {"status": "ready"}
    ids = {m["id"]: m["task"] for m in client.get("/v1/models").json()["data"]}
    assert ids == {"translate": "translate", "generate": "generate", "slowgen": "generate", "waitgen": "generate"}


def test_translate_matches_bundle_evaluation(client, server):
    """HTTP translations (request-level batching, @serve.batch) equal export/evaluate.py's on the bundle,
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
    """`translate` runs @serve.batch -> Engine.run_batch: a request the engine refuses (beam 8 > its 4 KV slots)
    fails alone with a 4xx, and a batch needing more slots than the pool (3 x beam 2) still completes."""
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
    events = [json.loads(e) for e in _sse(r.text)]
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
    text = _wait_metric(client, "kvserve_rejections_total", len(rejected), model="slowgen")
    engine = _metric(text, "kvserve_rejections_total", model="slowgen", reason="queue_full")
    ray_queue = _metric(text, "kvserve_rejections_total", model="slowgen", reason="deployment_queue_full")
    assert engine >= 1 and ray_queue >= 1 and engine + ray_queue == len(rejected)


def test_deadline_is_504(client):
    t0 = time.monotonic()
    r = client.post("/v1/generate", json={"prompt": "the", "model": "waitgen", "max_tokens": 4})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "deadline_exceeded" and time.monotonic() - t0 < 9


def _settled_metrics(client: httpx.Client) -> str:
    """/metrics once Ray's exporters have caught up with earlier tests (two equal reads in a row)."""
    text = client.get("/metrics").text
    for _ in range(20):
        time.sleep(1.5)
        again = client.get("/metrics").text
        if again == text:
            return text
        text = again
    return text


def test_client_disconnect_cancels(client, server):
    before = _metric(_settled_metrics(client), "kvserve_cancellations_total", model="waitgen", reason="disconnect")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/generate", timeout=1.0,
                   json={"prompt": "the", "model": "waitgen", "max_tokens": 4, "stream": True})
    text = _wait_metric(client, "kvserve_cancellations_total", before + 1, model="waitgen", reason="disconnect")
    assert _metric(text, "kvserve_cancellations_total", model="waitgen", reason="disconnect") == before + 1


# -- metrics across replicas ---------------------------------------------------------------------------------
def test_request_counter_sums_over_replicas(client):
    import ray
    from serving.server.metrics import RAY_PREFIX

    labels = {"endpoint": "/v1/generate", "model": "generate", "status": "200"}
    before_text = _settled_metrics(client)
    before = _metric(before_text, "kvserve_requests_total", **labels)
    tokens_before = _metric(before_text, "kvserve_generated_tokens_total", model="generate")
    n, generated = 24, 0
    for i in range(n):
        r = httpx.post(str(client.base_url) + "/v1/generate", json={"prompt": f"the {i}", "max_tokens": 3})
        assert r.status_code == 200
        generated += r.json()["usage"]["completion_tokens"]
    text = _wait_metric(client, "kvserve_requests_total", before + n, **labels)
    assert _metric(text, "kvserve_requests_total", **labels) == before + n
    text = _wait_metric(client, "kvserve_generated_tokens_total", tokens_before + generated, model="generate")
    assert _metric(text, "kvserve_generated_tokens_total", model="generate") == tokens_before + generated
    # Both replicas of each deployment really served: their series are distinct in Ray's own export.
    node = next(x for x in ray.nodes() if x["Alive"])
    raw = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics").text
    # This application's series only: other suites' applications ran on the same cluster (tests/conftest.py).
    ours = "\n".join(line for line in raw.splitlines() if 'application="kvserve"' in line)
    for name, dep in (("kvserve_requests_total", "ingress"), ("kvserve_generated_tokens_total", "generate")):
        replicas = set(re.findall(rf'^{RAY_PREFIX}{name}{{[^}}]*deployment="{dep}"[^}}]*replica="([^"]+)"', ours, re.M))
        assert len(replicas) == 2, (name, replicas)


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


# -- a trained bundle, when one exists (`make serve` / `kvserve up` make artifacts/bundles/translate) -----------
REAL_ARTIFACTS = Path(os.environ.get("KVSERVE_ARTIFACTS", ROOT / "artifacts"))
REAL_SENTENCES = 100


@pytest.mark.skipif(not (REAL_ARTIFACTS / "bundles" / "translate" / "manifest.json").is_file()
                    or not (REAL_ARTIFACTS / "data" / "translate" / "test.tsv").is_file(),
                    reason="no trained translate bundle and data under KVSERVE_ARTIFACTS (default artifacts/)")
def test_trained_bundle_chrf_over_http_equals_evaluate(server):
    """Acceptance: chrF of translations served over HTTP == `kvserve evaluate BUNDLE` on the test split."""
    from export.evaluate import evaluate_bundle, scores
    from model.data import load_pairs
    from serving.server.launch import start

    bundle = REAL_ARTIFACTS / "bundles" / "translate"
    want = evaluate_bundle(bundle, split="test", limit=REAL_SENTENCES, data_dir=REAL_ARTIFACTS / "data")
    raw = json.loads(json.dumps(server["raw"]))
    real = {"name": "real", "route_prefix": "/real", "import_path": "serving.server.app:build_app",
            "args": {"artifacts_dir": str(REAL_ARTIFACTS),
                     "models": [{"name": "translate", "bundle": "bundles/translate", "engine": {"max_slots": 16}}],
                     "limits": {"max_prompt_tokens": 4096, "max_tokens": 4096, "max_texts": 32}},
            "deployments": [{"name": "ingress", "ray_actor_options": {"num_cpus": 0.1}},
                            {"name": "translate", "max_ongoing_requests": 32,
                             "ray_actor_options": {"num_cpus": 0.1}}]}
    raw["applications"].append(real)
    start(raw, timeout_s=300)
    try:
        pairs = load_pairs(REAL_ARTIFACTS / "data", "test")[:REAL_SENTENCES]
        max_len = json.loads((bundle / "manifest.json").read_text())["model_config"]["max_len"]
        hyps: list[str] = []
        for i in range(0, len(pairs), 32):
            r = httpx.post(server["base"] + "/real/v1/translate", timeout=600,
                           json={"text": [s for s, _ in pairs[i:i + 32]], "max_tokens": max_len - 1})
            assert r.status_code == 200, r.text
            hyps += [t["text"] for t in r.json()["translations"]]
        got = scores(hyps, [t for _, t in pairs])
        print(f"chrF over HTTP {got['chrf']:.2f} vs evaluate {want['chrf']:.2f} ({len(pairs)} sentences)")
        assert got["chrf"] == pytest.approx(want["chrf"], abs=0.05)
    finally:
        start(server["raw"], timeout_s=120)  # back to the session's applications


# -- live reconfiguration (it changes the deployed config: only order-tolerant tests follow) ------------------
def test_reconfigure_is_live(client, server):
    from ray import serve
    from serving.server.launch import start

    handle = serve.get_deployment_handle("generate", app_name="kvserve")
    pids = {handle.info.remote().result()["pid"] for _ in range(8)}
    raw = json.loads(json.dumps(server["raw"]))
    dep = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "generate")
    dep["user_config"].update(batching="request", max_batch_size=2)
    start(raw, timeout_s=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        infos = [handle.info.remote().result() for _ in range(8)]
        if all(i["live"]["batching"] == "request" for i in infos):
            break
        time.sleep(0.5)
    assert {i["live"]["batching"] for i in infos} == {"request"}
    assert {i["pid"] for i in infos} <= pids  # same replicas: reconfigured, not restarted
    r = client.post("/v1/generate", json={"prompt": "the quick", "max_tokens": 5})  # through @serve.batch
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# -- the load tester against this server ---------------------------------------------------------------------
def test_loadtest_report_agrees_with_server_metrics(client, server):
    """A few seconds of `kvserve loadtest` (the library behind it) against the real server: the report's
    request and token counts equal what the server's own /metrics counted over the run."""
    import asyncio

    from loadtest import LoadConfig, run_load

    labels = {"endpoint": "/v1/generate", "model": "generate"}
    before = _settled_metrics(client)
    cfg = LoadConfig(url=server["base"], concurrency=4, requests=24, max_tokens=8, seed=3, timeout_s=30,
                     data_dir=server["art"] / "no-data")
    report = asyncio.run(run_load(cfg))
    sent, tokens = report.totals["sent"], report.totals["all_output_tokens"]
    assert sent >= 24 and tokens > 0
    after = _wait_metric(client, "kvserve_requests_total", _metric(before, "kvserve_requests_total", **labels) + sent,
                         **labels)
    after = _wait_metric(client, "kvserve_generated_tokens_total",
                         _metric(before, "kvserve_generated_tokens_total", model="generate") + tokens, model="generate")
    assert _metric(after, "kvserve_requests_total", **labels) - _metric(before, "kvserve_requests_total", **labels) == sent
    assert (_metric(after, "kvserve_generated_tokens_total", model="generate")
            - _metric(before, "kvserve_generated_tokens_total", model="generate")) == tokens


# -- last: it deletes the app the other tests share ---------------------------------------------------------
def test_shutdown_drains_in_flight_requests(server):
    """What `kvserve serve` does on Ctrl-C/SIGTERM (serve_cli.stop): delete the app first, so in-flight
    requests finish (graceful_shutdown_*) while new ones are refused; then Serve and Ray stop (teardown)."""
    from ray import serve
    from serving.server.launch import start

    raw = json.loads(json.dumps(server["raw"]))
    dep = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "waitgen")
    dep["user_config"]["batch_wait_timeout_s"] = 2.0  # live: a lone request now waits 2 s for its batch
    start(raw, timeout_s=120)
    time.sleep(1.0)  # reconfigure reaches the replica
    with cf.ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        slow = pool.submit(httpx.post, server["base"] + "/v1/generate", timeout=30,
                           json={"prompt": "the", "model": "waitgen", "max_tokens": 3})
        time.sleep(0.5)
        assert not slow.done()
        serve.delete("kvserve", _blocking=True)
        r = slow.result()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1 and time.monotonic() - t0 >= 2.0
    assert httpx.get(server["base"] + "/v2/health/live", timeout=10).status_code == 404
