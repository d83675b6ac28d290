"""Integration tests that change or end the shared application: a trained bundle beside it, live
reconfiguration, the load tester against it, and last the drain on shutdown (tests/integration_cluster.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from integration_cluster import ROOT, metric, settled_metrics, wait_metric
from reliability_cluster import handle_infos

pytestmark = pytest.mark.slow


# -- a trained bundle, when one exists (`make serve` / `kvserve up` make artifacts/bundles/translate) -----------
REAL_ARTIFACTS = Path(os.environ.get("KVSERVE_ARTIFACTS", ROOT / "artifacts"))
REAL_SENTENCES = 100


@pytest.mark.skipif(not (REAL_ARTIFACTS / "bundles" / "translate" / "manifest.json").is_file()
                    or not (REAL_ARTIFACTS / "data" / "translate" / "test.tsv").is_file(),
                    reason="no trained translate bundle and data under KVSERVE_ARTIFACTS (default artifacts/)")
def test_trained_bundle_chrf_over_http_equals_evaluate(server):
    """Acceptance: chrF of translations served over HTTP == `kvserve evaluate BUNDLE` on the test split."""
    from export.evaluate import evaluate_bundle, scores
    from kvserve.runtime import ort_runtime
    from model.data import load_pairs
    from serving.server.launch import start

    bundle = REAL_ARTIFACTS / "bundles" / "translate"
    want = evaluate_bundle(bundle, ort_runtime(), split="test", limit=REAL_SENTENCES,
                           data_dir=REAL_ARTIFACTS / "data")
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
        start(server["raw"], timeout_s=120)  # back to the test run's applications


# -- live reconfiguration (it changes the deployed config: only order-tolerant tests follow) ------------------
@pytest.mark.cluster
def test_reconfigure_is_live(client, server):
    from serving.server.launch import start

    pids = {i["pid"] for i in handle_infos("generate", 8, app="kvserve")}
    raw = json.loads(json.dumps(server["raw"]))
    dep = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "generate")
    dep["user_config"].update(batching="request", max_batch_size=2)
    start(raw, timeout_s=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        infos = handle_infos("generate", 8, app="kvserve")
        if all(i["live"]["batching"] == "request" for i in infos):
            break
        time.sleep(0.5)
    assert {i["live"]["batching"] for i in infos} == {"request"}
    assert {i["pid"] for i in infos} <= pids  # same replicas: reconfigured, not restarted
    r = client.post("/v1/generate", json={"prompt": "the quick", "max_tokens": 5})  # through request-level batching
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# -- the load tester against this server ---------------------------------------------------------------------
def test_loadtest_report_agrees_with_server_metrics(client, server):
    """A few seconds of `kvserve loadtest` (the library behind it) against the real server: the report's
    request and token counts equal what the server's own /metrics counted over the run."""
    import asyncio

    from loadtest import LoadConfig, run_load

    labels = {"endpoint": "/v1/generate", "model": "generate"}
    before = settled_metrics(client)
    cfg = LoadConfig(url=server["base"], concurrency=4, requests=24, max_tokens=8, seed=3, timeout_s=30,
                     data_dir=server["art"] / "no-data")
    report = asyncio.run(run_load(cfg))
    sent, tokens = report.totals["sent"], report.totals["all_output_tokens"]
    assert sent >= 24 and tokens > 0
    after = wait_metric(client, "kvserve_requests_total", metric(before, "kvserve_requests_total", **labels) + sent,
                         **labels)
    after = wait_metric(client, "kvserve_generated_tokens_total",
                         metric(before, "kvserve_generated_tokens_total", model="generate") + tokens, model="generate")
    assert metric(after, "kvserve_requests_total", **labels) - metric(before, "kvserve_requests_total", **labels) == sent
    assert (metric(after, "kvserve_generated_tokens_total", model="generate")
            - metric(before, "kvserve_generated_tokens_total", model="generate")) == tokens


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
