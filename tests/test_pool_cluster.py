"""A model repository served by the pool deployment, on a real Ray Serve cluster (slow; the cluster suite CI runs).

The integration suite's config reduced to `translate` plus `args.repository`: a folder of four tiny bundles (two
translators and two language models, each a version of its own), one pool replica holding at most two models. Every
model of the folder answers by name, each answer equal to that model's served alone (the first request of each); a
bundle added to the folder is served without a restart; an unknown model is a 404 naming the repository; the admin
routes list, load and unload; loads and evictions are metrics.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from integration_cluster import integration_config
from reliability_cluster import metric

from export.bundle import write_manifest

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def variant(src: Path, dst: Path, banned: list[int]) -> None:
    """A copy of a bundle with other generation settings: another version (tests/test_model_pool.py's)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["generation"] = {"banned_ids": banned}
    write_manifest(dst, {k: v for k, v in manifest.items() if k not in ("files", "version", "created")})


@pytest.fixture(scope="module")
def pool(bundles, ray_cluster, tmp_path_factory):
    from serving.server.config import validate_serve_config
    from serving.server.launch import start

    repo = tmp_path_factory.mktemp("repository")
    variant(bundles / "bundles" / "translate", repo / "en-de", [])
    variant(bundles / "bundles" / "translate", repo / "en-fr", [7])
    variant(bundles / "bundles" / "generate", repo / "lm-a", [])
    variant(bundles / "bundles" / "generate", repo / "lm-b", [9])
    cfg = integration_config(bundles, ray_cluster["port"])
    app = cfg["applications"][0]
    app["args"]["models"] = [m for m in app["args"]["models"] if m["name"] == "translate"]
    app["args"]["repository"] = {
        "paths": [str(repo)],
        "max_models_per_replica": 2,
        "rescan_s": 1,
        "engine": {"max_slots": 2, "intra_op_threads": 1},
    }
    app["deployments"] = [d for d in app["deployments"] if d["name"] in ("ingress", "translate")]
    next(d for d in app["deployments"] if d["name"] == "ingress")["num_replicas"] = 1
    app["deployments"].append(
        {
            "name": "pool",
            "num_replicas": 1,
            "max_ongoing_requests": 32,
            "ray_actor_options": {"num_cpus": 0.1},
            "graceful_shutdown_timeout_s": 5,
        }
    )
    start(validate_serve_config(cfg), timeout_s=300)
    with httpx.Client(base_url=f"http://127.0.0.1:{cfg['http_options']['port']}", timeout=60) as c:
        yield c, repo, bundles


def until(fetch, ok, timeout_s: float = 30.0):
    """fetch() until ok(its value) or timeout_s passed; the last value."""
    deadline = time.monotonic() + timeout_s
    value = fetch()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = fetch()
    return value


def ask(c: httpx.Client, model: str) -> httpx.Response:
    if model.startswith("lm"):
        return c.post("/v1/generate", json={"model": model, "prompt": "the dog", "max_tokens": 6})
    return c.post("/v1/translate", json={"model": model, "text": "the quick brown fox", "max_tokens": 6})


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    body = r.json()
    return body["text"] if "text" in body else body["translations"][0]["text"]


def test_every_model_of_the_repository_answers_by_name_within_the_pools_bound(pool):
    c, repo, _ = pool
    models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert {"en-de", "en-fr", "lm-a", "lm-b", "translate"} <= set(models)
    first = {name: answer(ask(c, name)) for name in ("en-de", "lm-a", "en-fr", "lm-b")}  # 4 models, room for 2
    for _ in range(2):  # evicted and loaded again: the same answers
        assert {name: answer(ask(c, name)) for name in first} == first
    assert ask(c, "translate").status_code == 200  # the config's own model still answers
    # One scrape once showed 4 evictions beside 5 loads, which a replica holding two models cannot have: the exported
    # counters can lag each other, so both are waited for (12 loads and 10 evictions in all)
    loads, evictions = "kvserve_model_loads_total", "kvserve_model_evictions_total"
    text = until(lambda: c.get("/metrics").text, lambda t: metric(t, loads) >= 6 and metric(t, evictions) >= 4)
    assert metric(text, loads) >= 6 and metric(text, evictions) >= 4, (metric(text, loads), metric(text, evictions))


def test_a_new_bundle_is_served_without_a_restart_and_an_unknown_one_is_a_404(pool):
    c, repo, bundles = pool
    r = ask(c, "late")
    assert r.status_code == 404 and str(repo) in r.json()["error"]["message"]
    variant(bundles / "bundles" / "translate", repo / "late", [11])
    r = until(lambda: ask(c, "late"), lambda r: r.status_code == 200)
    assert r.status_code == 200 and r.headers["x-model-version"] != ask(c, "en-de").headers["x-model-version"]


def test_the_admin_routes_list_load_and_unload(pool):
    c, _, _ = pool
    index = {m["id"]: m for m in c.get("/v2/repository/index").json()["models"]}
    assert index["en-de"]["task"] == "translate" and index["lm-a"]["task"] == "generate" and index["en-de"]["bytes"]
    loaded = c.post("/v2/repository/models/lm-b/load").json()
    assert any(h["id"] == "lm-b" for h in loaded["replica_holds"])
    assert c.post("/v2/repository/models/lm-b/unload").json()["unloaded_from_replicas"] == 1
    assert c.post("/v2/repository/models/nope/load").status_code == 404
    pinned = c.post("/v2/repository/models/en-de/pin").json()
    assert any(h["id"] == "en-de" and h["pinned"] for h in pinned["replica_holds"])
    for name in ("lm-a", "lm-b", "en-fr", "lm-a"):  # one place left beside the pinned model: en-de stays
        answer(ask(c, name))
    assert any(h["id"] == "en-de" for h in c.post("/v2/repository/models/en-de/load").json()["replica_holds"])
    assert c.post("/v2/repository/models/en-de/unpin").json()["unpinned_on_replicas"] == 1
