"""The metrics exposition: the API's request counts on the real engines of the tiny bundles (tests/inprocess_app.py),
also behind a route prefix, and the ingress's aggregation of replicas' expositions as Prometheus reads them.
A metric is checked by how much it grew over the requests a test sent (the engines are shared by the module)."""
from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inprocess_app import InProcessServer
from serving.server.metrics import Recorder, aggregate_exposition
from test_api import LIMITS, samples


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    s = InProcessServer(LIMITS)
    yield s
    s.close()


# -- counted by the API --------------------------------------------------------------------------------------
@pytest.mark.parametrize("root_path", ["", "/prefix"])  # Ray Serve's route_prefix arrives as root_path
def test_metrics_count_requests_by_status(server, root_path):
    client = server.app_client(root_path=root_path)
    v = server.versions["generate"]
    ok = (("endpoint", "/v1/generate"), ("model", "generate"), ("status", "200"), ("version", v))
    refused = (("endpoint", "/v1/generate"), ("model", "none"), ("status", "422"), ("version", "none"))
    duration = (("endpoint", "/v1/generate"), ("model", "generate"), ("version", v))
    counted = [("kvserve_requests_total", ok), ("kvserve_requests_total", refused),
               ("kvserve_generated_tokens_total", (("model", "generate"), ("version", v))),
               ("kvserve_request_duration_seconds_count", duration)]
    before = samples(server.call(client.get("/metrics")).text)
    for _ in range(3):
        assert server.call(client.post("/v1/generate", json={"prompt": "x", "max_tokens": 2})).status_code == 200
    assert server.call(client.post("/v1/generate", json={"prompt": "x", "max_tokens": 0})).status_code == 422
    text = server.call(client.get("/metrics")).text
    after = samples(text)
    assert [after[k] - before.get(k, 0.0) for k in counted] == [3, 1, 6, 3]
    _promtool_clean(text)


# -- metrics aggregation -------------------------------------------------------------------------------------
def _ray_node(worker: str, n: int) -> str:
    labels = (f'Component="core_worker",WorkerId="{worker}",application="kvserve",deployment="ingress",'
              f'replica="{worker}"')
    return (f"# HELP ray_kvserve_requests_total x\n# TYPE ray_kvserve_requests_total counter\n"
            f'ray_kvserve_requests_total{{{labels},endpoint="/v1/generate",model="generate",status="200"}} {n}\n'
            f"# HELP ray_kvserve_engine_batch_size y\n# TYPE ray_kvserve_engine_batch_size histogram\n"
            f'ray_kvserve_engine_batch_size_bucket{{{labels},le="1.0",model="generate"}} 1.0\n'
            f'ray_kvserve_engine_batch_size_bucket{{{labels},le="+Inf",model="generate"}} {n}\n'
            f'ray_kvserve_engine_batch_size_count{{{labels},model="generate"}} {n}\n'
            f'ray_kvserve_engine_batch_size_sum{{{labels},model="generate"}} {2 * n}\n'
            f"# HELP ray_tasks z\n# TYPE ray_tasks gauge\nray_tasks{{{labels}}} 4\n")


def test_aggregation_sums_replicas_and_drops_unbounded_labels():
    text = aggregate_exposition([_ray_node("w1", 7), _ray_node("w2", 3)])
    assert 'kvserve_requests_total{endpoint="/v1/generate",model="generate",status="200"} 10.0' in text
    assert 'kvserve_engine_batch_size_bucket{le="1.0",model="generate"} 2.0' in text
    assert 'kvserve_engine_batch_size_sum{model="generate"} 20.0' in text
    assert "replica=" not in text and "WorkerId" not in text and "ray_tasks" not in text
    assert "# TYPE kvserve_time_to_first_token_seconds histogram" in text  # declared even before samples
    _promtool_clean(text)


def test_aggregation_reads_the_text_format_as_prometheus_does():
    # prometheus_client's own output (no ray_ prefix, _created samples), an escaped label value, a timestamp.
    r = Recorder("prometheus")
    odd = 'a "quoted" \\ model'
    r.inc("kvserve_generated_tokens_total", {"model": odd, "version": "v1"}, 5)
    r.observe("kvserve_engine_batch_size", {"model": odd, "version": "v1"}, 3)
    stamped = 'ray_kvserve_generated_tokens_total{model="m",version="v1",WorkerId="w"} 2.0 1700000000000\n'
    text = aggregate_exposition([r.exposition(), r.exposition(), stamped])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {s.labels["model"]: s.value for s in families["kvserve_generated_tokens"].samples}
    assert tokens == {odd: 10.0, "m": 2.0}
    buckets = {s.labels["le"]: s.value for s in families["kvserve_engine_batch_size"].samples
               if s.name.endswith("_bucket")}
    assert buckets["2.0"] == 0.0 and buckets["4.0"] == 2.0 and buckets["+Inf"] == 2.0
    assert "_created" not in text


def _promtool_clean(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # the integration suite and CI run it where the `prometheus` package is installed
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_promtool_clean_on_every_declared_metric():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    r = Recorder("prometheus")
    labels = {"model": "m", "version": "0123456789ab", "endpoint": "/v1/generate", "status": "200",
              "reason": "queue_full"}
    from serving.server.metrics import METRICS, Kind
    for d in METRICS.values():
        lab = {k: labels[k] for k in d.labels}
        {Kind.COUNTER: r.inc, Kind.HISTOGRAM: r.observe, Kind.GAUGE: r.set}[d.kind](d.name, lab, 1.0)
    _promtool_clean(aggregate_exposition([r.exposition()]))
