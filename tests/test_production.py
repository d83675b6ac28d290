"""The production configuration on a real Ray Serve cluster (slow; `.ci/run` runs it as the cluster suite).

deploy/serve_config.yaml exactly as `kvserve serve` deploys it (serving/server/launch.py `prepare_config`; the
images' and the RayService's configs are generated from the same file, tests/test_deploy.py): both models
colocated in the ingress replicas, Serve's HAProxy in front with kvserve's retry settings and error answers
(ray_env.py HAPROXY_RETRY_ENV, serving/server/haproxy.py). What the test changes, and why: its own bundles (a tiny
translator; for `generate` a random model slow enough per step that a request runs for a second or more), the
port, two ingress replicas holding half a CPU each (the test's Ray instance has 2 logical CPUs), and Serve's
health check every 2 s (so that a killed replica's successor starts within the test's patience).

- the official openai client and the JSON API answer through HAProxy; /metrics sums both replicas;
- kill -9 one of two replicas under 200 seeded non-streaming requests: every one is answered 200, each with the
  answer the same request got before the kill (HAProxy retried the killed replica's requests on the live one);
- with one replica, kill -9 under load: no request hangs and none is left unanswered; each is answered 200 or a
  JSON 503 with Retry-After;
- a non-streaming client that hangs up frees its KV slot within a few steps.
"""
from __future__ import annotations

import asyncio
import collections
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from integration_cluster import sse
from reliability_cluster import metric, report, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[1]
INGRESS_TITLE = "ServeReplica:kvserve:ingress"
GEN = {"model": "generate", "prompt": "the quick", "max_tokens": 48, "ignore_eos": True, "temperature": 1.0}


@dataclass
class Prod:
    base: str
    raw: dict

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=timeout)


def ingress_pids() -> list[int]:
    """The PIDs of the live ingress replicas (Ray titles each replica's process after its deployment)."""
    out = []
    for p in psutil.process_iter():
        try:
            if INGRESS_TITLE in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def _deploy(raw: dict, replicas: int) -> None:
    from serving.server.launch import start

    ingress = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "ingress")
    ingress["num_replicas"] = replicas
    start(raw, timeout_s=300)
    assert wait_for(lambda: len(ingress_pids()) == replicas, 60), ingress_pids()


@pytest.fixture(scope="module")
def prod(bundles, ray_cluster, tmp_path_factory):
    from engine_bundle import tiny_model, write_bundle
    from serving.server.launch import prepare_config

    art = tmp_path_factory.mktemp("production")
    shutil.copytree(bundles / "bundles" / "translate", art / "bundles" / "translate")
    model, cfg = tiny_model("generate", max_len=128, d_model=384, d_ff=1536, n_decoder_layers=4)
    write_bundle(model, cfg, "generate", art / "bundles" / "generate")
    raw = prepare_config(ROOT / "deploy" / "serve_config.yaml", artifacts=art, port=ray_cluster["port"])
    ingress = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "ingress")
    ingress["ray_actor_options"]["num_cpus"] = 0.5
    ingress["health_check_period_s"] = 2
    _deploy(raw, 2)
    yield Prod(f"http://127.0.0.1:{ray_cluster['port']}", raw)


def test_the_openai_client_and_the_json_api_answer_through_haproxy(prod):
    import openai

    oa = openai.OpenAI(base_url=prod.base + "/v1", api_key="unused", max_retries=0)
    done = oa.completions.create(model="generate", prompt="the dog", max_tokens=5, seed=7)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    chunks = list(oa.completions.create(model="generate", prompt="the dog", max_tokens=5, seed=7, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    with prod.client() as c:
        r = c.post("/v1/translate", json={"text": ["the quick brown fox"], "max_tokens": 8},
                   headers={"X-Request-Id": "client-id.7"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "client-id.7"  # the client's id, answered back (HAProxy kept it)
        r = c.post("/v1/translate", json={"text": ["the dog"], "max_tokens": 4}, headers={"X-Request-Id": "a b"})
        assert r.headers["x-request-id"] not in ("", "a b")  # an invalid one replaced (serving/server/haproxy.py)
        r = c.post("/v1/generate", json={**GEN, "max_tokens": 4, "stream": True})
        assert r.status_code == 200 and '"finish_reason": "length"' in sse(r.text)[-1]
        assert {m["id"].split("@")[0] for m in c.get("/v1/models").json()["data"]} >= {"translate", "generate"}
        before = metric(c.get("/metrics").text, "kvserve_requests_total", model="translate", status="200")
        for _ in range(6):  # HAProxy spreads them over both replicas; /metrics sums what each counted
            assert c.post("/v1/translate", json={"text": ["the dog"], "max_tokens": 4}).status_code == 200
        assert wait_for(lambda: metric(c.get("/metrics").text, "kvserve_requests_total", model="translate",
                                       status="200") >= before + 6, 20, 0.5) is not None


def ingress_in_flight(calls: int = 8) -> dict[int, int]:
    """pid -> API requests in flight, of each ingress replica that answered one of `calls` handle calls
    (`Ingress.drain_status`; Serve spreads the calls over the replicas). Call it from a thread with no loop."""
    async def ask() -> dict[int, int]:
        from ray import serve
        from ray.serve.context import _get_global_client

        h = serve.get_deployment_handle("ingress", app_name="kvserve")
        try:
            out = {}
            for _ in range(calls):
                status = await asyncio.wait_for(h.drain_status.remote(), 30)
                out[status["pid"]] = status["in_flight"]
            return out
        finally:
            await _get_global_client().shutdown_cached_handles_async()  # their routers live on this loop
    return asyncio.run(ask())


async def _answers(base: str, n: int, concurrency: int, kill_after: int | None = None) -> tuple[dict, list, dict]:
    """n seeded /v1/generate requests (seed = index): index -> (status, text or error, Retry-After), the
    transport failures, and with `kill_after`: the requests in flight on each replica just before the busier
    one got SIGKILL, once that many requests were answered (`victim`: its pid)."""
    out: dict[int, tuple] = {}
    failures: list[str] = []
    seen: dict = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                try:
                    r = await client.post("/v1/generate", json={**GEN, "seed": i})
                except httpx.HTTPError as e:
                    failures.append(f"{i}: {type(e).__name__}: {e}")
                    return
                body = r.json()
                out[i] = (r.status_code, body.get("text") if r.status_code == 200 else body.get("error"),
                          r.headers.get("retry-after"))
        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        if kill_after is not None:
            while len(out) + len(failures) < kill_after:
                await asyncio.sleep(0.005)
            seen = await asyncio.to_thread(ingress_in_flight)
            seen["victim"] = max((pid for pid in seen if pid in ingress_pids()), key=seen.get)
            os.kill(seen["victim"], signal.SIGKILL)
        await asyncio.gather(*tasks)
    return out, failures, seen


def test_a_replica_killed_under_load_loses_no_request_and_changes_no_answer(prod):
    n = 200
    baseline, failures, _ = asyncio.run(_answers(prod.base, n, 24))
    assert not failures and {s for s, _, _ in baseline.values()} == {200}, (failures[:3], baseline)
    t0 = time.monotonic()
    killed, failures, seen = asyncio.run(_answers(prod.base, n, 24, kill_after=n // 4))
    took = time.monotonic() - t0
    victim = seen["victim"]
    assert seen[victim] > 0, f"no request was in flight on the killed replica: the scenario did not happen ({seen})"
    assert not failures, failures[:5]
    assert len(killed) == n and all(s == 200 for s, _, _ in killed.values()), \
        [(i, a) for i, a in killed.items() if a[0] != 200][:5]
    same = sum(killed[i][1] == baseline[i][1] for i in range(n))
    report("shipped_placement_replica_killed", requests=n, concurrency=24, in_flight_on_killed_replica=seen[victim],
           answered_200=sum(s == 200 for s, _, _ in killed.values()), same_answer_as_without_the_kill=same,
           seconds=round(took, 2))
    assert same == n  # the same seeded answers
    assert took < 60, took
    assert victim not in ingress_pids()
    assert wait_for(lambda: len(ingress_pids()) == 2, 90, 0.5) is not None, "Serve did not replace the replica"


def test_a_client_that_hangs_up_frees_its_kv_slot(prod):
    with prod.client() as c:
        assert wait_for(lambda: metric(c.get("/metrics").text, "kvserve_kv_slots_used", model="generate") == 0,
                        30, 0.5) is not None
        cancelled = metric(c.get("/metrics").text, "kvserve_cancellations_total", model="generate",
                           reason="disconnect")

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=prod.base, timeout=0.05) as client:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                await client.post("/v1/generate", json={**GEN, "max_tokens": 120, "seed": 1})
    for _ in range(4):
        asyncio.run(hang_up())
    with prod.client() as c:
        freed = wait_for(lambda: metric(c.get("/metrics").text, "kvserve_kv_slots_used", model="generate") == 0,
                         10, 0.2)
        assert freed is not None, "the engine kept the slots of requests whose clients left"
        assert wait_for(lambda: metric(c.get("/metrics").text, "kvserve_cancellations_total", model="generate",
                                       reason="disconnect") >= cancelled + 4, 20, 0.5) is not None


def test_with_one_replica_a_killed_replica_leaves_no_request_hanging(prod):
    """The requests in flight on the only replica are sent again (HAProxy's retries) until the replica is marked
    down, then to Serve's fallback proxy, which holds them for the replacement: each ends as a 200 or, where no
    replica could take it, a JSON 503 with Retry-After; none hangs, and no connection is closed unanswered (what
    HAProxy does to a request on a reused client connection whose retries all failed: haproxy/haproxy#3414; its
    10 retries outlast the replica's being marked down)."""
    _deploy(prod.raw, 1)
    n = 120
    t0 = time.monotonic()
    answers, failures, seen = asyncio.run(_answers(prod.base, n, 16, kill_after=20))
    took = time.monotonic() - t0
    victim = seen["victim"]
    report("shipped_placement_only_replica_killed", requests=n, concurrency=16,
           in_flight_on_killed_replica=seen[victim],
           statuses={str(k): v for k, v in collections.Counter(s for s, _, _ in answers.values()).items()},
           connections_closed_unanswered=len(failures), seconds=round(took, 2))
    assert seen[victim] > 0, seen
    assert len(answers) + len(failures) == n  # nothing hangs: every request ended before the client's timeout
    assert failures == [], failures  # HAProxy's retries outlast its marking the replica down (ray_env.py)
    assert {s for s, _, _ in answers.values()} <= {200, 503}, answers
    for status, error, retry_after in answers.values():
        if status == 503:
            assert error["type"] == "unavailable" and "retry" in error["message"] and retry_after == "1", error
    assert took < 90, took
    assert wait_for(lambda: len(ingress_pids()) == 1 and victim not in ingress_pids(), 90, 0.5) is not None
    with prod.client() as c:
        assert wait_for(lambda: c.post("/v1/generate", json={**GEN, "max_tokens": 2}).status_code == 200,
                        90, 1.0) is not None


def test_a_model_that_cannot_load_leaves_the_others_served_and_the_server_ready(prod, tmp_path):
    """The shipped config with the `generate` bundle damaged on disk (a graph's bytes no longer match its
    manifest): the ingress replica loads `translate` and serves it; `generate` answers a JSON 503 naming why;
    the server's readiness (the pods' probe) stays 200 "degraded", `generate`'s own readiness is 503."""
    from serving.server.launch import prepare_config

    art = Path(prod.raw["applications"][0]["args"]["artifacts_dir"])
    sick = tmp_path / "artifacts"
    shutil.copytree(art, sick)
    graph = sick / "bundles" / "generate" / "decoder.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    raw = prepare_config(ROOT / "deploy" / "serve_config.yaml", artifacts=sick, port=prod.raw["http_options"]["port"])
    ingress = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "ingress")
    ingress["ray_actor_options"]["num_cpus"] = 0.5
    try:
        _deploy(raw, 1)
        with prod.client() as c:
            assert wait_for(lambda: c.get("/v2/models/generate/ready").status_code == 503, 60, 0.5) is not None
            r = c.post("/v1/translate", json={"text": ["the quick brown fox"], "max_tokens": 8})
            assert r.status_code == 200, r.text
            r = c.post("/v1/generate", json={**GEN, "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert r.json()["error"]["type"] == "unavailable" and "could not be loaded" in r.json()["error"]["message"]
            ready = c.get("/v2/health/ready")
            assert ready.status_code == 200 and ready.json() == {"status": "degraded", "not_ready": ["generate"]}
            assert c.get("/v2/models/translate/ready").status_code == 200
            report("shipped_placement_model_cannot_load", translate=200, generate=r.status_code,
                   server_ready=ready.status_code, server_status=ready.json()["status"])
    finally:
        _deploy(prod.raw, 1)  # the module's server as the other tests found it

