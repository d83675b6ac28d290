"""Model lifecycle on a real Ray Serve cluster (slow): a rolling update under load, a 90/10 canary, autoscaling.

Two bundles of the generate model (tiny random models with other weights, so other versions) are served by the
config of bench/autoscale.py `single_model_config`, deployed the way `kvserve serve` deploys (serving.server.launch.start):
a new bundle is a new config, deployed again, as `serve deploy` does.
"""
from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest
from integration_cluster import settled_metrics
from bench.clients import Load
from bench.autoscale import single_model_config as lifecycle_config
from reliability_cluster import metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_versions(bundles):
    """(artifacts dir, version of bundles/generate, version of bundles/generate-next)."""
    from engine_bundle import tiny_model, write_bundle
    from export.bundle import load_bundle

    model, cfg = tiny_model("generate", seed=1)
    write_bundle(model, cfg, "generate", bundles / "bundles" / "generate-next")
    return (bundles, load_bundle(bundles / "bundles" / "generate").version,
            load_bundle(bundles / "bundles" / "generate-next").version)


def _deploy(cfg: dict) -> str:
    from serving.server.config import validate_serve_config
    from serving.server.launch import start

    start(validate_serve_config(cfg), timeout_s=300)
    return f"http://127.0.0.1:{cfg['http_options']['port']}"


def _wait_rolled_out(base: str, version: str, timeout_s: float = 180) -> float:
    """Seconds until Serve runs one replica per deployment again (none starting or stopping: every old one has
    finished its requests) and an answer names `version`."""
    from ray import serve

    t0 = time.monotonic()
    with httpx.Client(base_url=base, timeout=30) as c:
        while True:
            assert time.monotonic() - t0 < timeout_s, f"the rollout to {version} did not finish in {timeout_s}s"
            app = serve.status().applications.get("kvserve")
            states = [{getattr(k, "value", str(k)): n for k, n in d.replica_states.items()}
                      for d in (app.deployments.values() if app else [])]
            settled = app is not None and getattr(app.status, "value", str(app.status)) == "RUNNING" and all(
                s == {"RUNNING": 1} for s in states)
            if settled and c.post("/v1/completions", json={"model": "generate", "prompt": "a", "max_tokens": 1}
                                  ).headers.get("x-model-version") == version:
                return time.monotonic() - t0
            time.sleep(0.25)


@pytest.mark.cluster
def test_a_new_bundle_rolls_out_under_load_without_a_failed_request_or_a_cut_stream(two_versions, ray_cluster):
    art, old, new = two_versions
    base = _deploy(lifecycle_config(art, ray_cluster["port"]))
    load = Load(base, clients=32).start()
    time.sleep(5)
    rollout_started = time.monotonic()
    _deploy(lifecycle_config(art, ray_cluster["port"], bundle="bundles/generate-next"))
    _wait_rolled_out(base, new)
    rolled_out = time.monotonic()
    time.sleep(3)
    outcomes = load.stop()
    failed = [o for o in outcomes if o.status != 200]
    cut = [o for o in outcomes if o.status == 200 and not o.complete]
    print(f"rollout under 32 clients: {len(outcomes)} requests, {len(failed)} failed, {len(cut)} cut streams, "
          f"old replicas all gone {rolled_out - rollout_started:.1f}s after deploying the new bundle")
    assert not failed, Counter(o.status for o in failed)
    assert not cut, cut[:3]
    versions = Counter(o.version for o in outcomes)
    assert versions[old] > 0 and versions[new] > 0 and set(versions) == {old, new}, versions
    started_after = [o for o in outcomes if o.started > rolled_out]
    assert started_after and Counter(o.version for o in started_after) == {new: len(started_after)}


def test_a_canary_takes_its_share_and_the_metrics_split_by_version(two_versions, ray_cluster):
    art, stable, canary = two_versions
    cfg = lifecycle_config(art, ray_cluster["port"], canary={"bundle": "bundles/generate-next", "weight": 10})
    base = _deploy(cfg)
    with httpx.Client(base_url=base, timeout=60) as c:
        before = settled_metrics(c)
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["generate"]["version"] == stable and f"generate@{canary}" in models
        assert {v["version"]: v["weight"] for v in models["generate"]["versions"]} == {stable: 90.0, canary: 10.0}
        seen = _requests(c, 1000)
        pinned = {c.post("/v1/completions", json={"model": f"generate@{canary}", "prompt": "a", "max_tokens": 1}
                         ).headers["x-model-version"] for _ in range(20)}
        after = settled_metrics(c)
    share = seen[canary] / 1000
    print(f"canary 90/10 over 1,000 requests: {seen[stable]} stable, {seen[canary]} canary ({share:.1%})")
    assert abs(share - 0.10) <= 0.03 and seen[stable] + seen[canary] == 1000
    assert pinned == {canary}
    for version, want in ((stable, seen[stable]), (canary, seen[canary] + 20)):
        counted = (metric(after, "kvserve_requests_total", version=version, status="200")
                   - metric(before, "kvserve_requests_total", version=version, status="200"))
        assert counted == want, (version, counted, want)
        assert metric(after, "kvserve_generated_tokens_total", version=version) > 0


def _requests(client: httpx.Client, n: int) -> Counter:
    """`n` short completions from 8 threads; the versions that answered."""
    import concurrent.futures as cf

    def one(_: int) -> str:
        r = client.post("/v1/completions", json={"model": "generate", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.headers["x-model-version"]
    with cf.ThreadPoolExecutor(8) as pool:
        return Counter(pool.map(one, range(n)))


def test_the_generate_model_scales_up_under_a_load_ramp_and_back_down(two_versions, ray_cluster):
    """Autoscaling on the engine's load (EngineLoadPolicy): 2 -> 24 -> 2 clients; replicas 1 -> 2+ -> 1."""
    from bench.autoscale import AUTOSCALING, phase_table, run_ramp

    art, _, _ = two_versions
    base = _deploy(lifecycle_config(art, ray_cluster["port"], autoscaling=AUTOSCALING, slots=4))
    run = run_ramp(base, ((2, 10.0), (24, 40.0), (2, 50.0)), max_tokens=16, progress=False)
    rows = phase_table(run)
    print("autoscaling ramp:", rows)
    assert [r["failed"] for r in rows] == [0, 0, 0]
    assert rows[0]["replicas_max"] == 1 and rows[1]["replicas_max"] >= 2, rows
    assert run["samples"][-1]["replicas"] == 1, run["samples"][-5:]
