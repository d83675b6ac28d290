"""deploy/grafana: the dashboard queries only metrics the server really exports, and covers what operators need.

Prometheus scrapes Ray's metrics port (the PodMonitors), where Ray exports kvserve's metrics as
ray_kvserve_* (ray.util.metrics adds the `ray_` prefix; a counter keeps a single `_total`). The fast tests
check the dashboard against serving/server/metrics.py's definitions and Ray's own metric names; the slow test
runs a real Serve app and reads the names from a real scrape of the node's metrics endpoint.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploy_helpers import (DASHBOARD, DEPLOY, dashboard_exprs, dashboard_metric_names, dashboard_metric_names_in,
                            load)

RAY_PREFIX = "ray_"


def _declared_names() -> set[str]:
    """What the Ray metrics port exports for serving/server/metrics.py's definitions."""
    from serving.server.metrics import METRICS, Kind

    names = set()
    for d in METRICS.values():
        base = RAY_PREFIX + d.name
        names |= {base + s for s in ("_bucket", "_sum", "_count")} if d.kind is Kind.HISTOGRAM else {base}
    return names


def _ray_serve_metric_defined(name: str) -> bool:
    import ray.serve

    bare = name.removeprefix(RAY_PREFIX)
    root = Path(ray.serve.__file__).parent
    return any(f'"{bare}"' in p.read_text(encoding="utf-8", errors="ignore") for p in root.rglob("*.py"))


def test_dashboard_names_only_declared_kvserve_metrics_and_real_ray_serve_metrics() -> None:
    names = dashboard_metric_names()
    kvserve = {n for n in names if n.startswith(RAY_PREFIX + "kvserve_")}
    assert kvserve and kvserve <= _declared_names(), sorted(kvserve - _declared_names())
    others = names - kvserve
    assert all(n.startswith("ray_serve_") for n in others), sorted(others)
    assert [n for n in others if not _ray_serve_metric_defined(n)] == []


def test_every_metric_reference_is_a_selector() -> None:
    """The name extraction above sees every metric: each kvserve/ray name is followed by `{...}`."""
    for expr in dashboard_exprs():
        for match in re.finditer(r"\b(?:ray|kvserve)_[a-z0-9_]+\b", expr):
            rest = expr[match.end():].lstrip()
            assert rest.startswith(("{", ",")), f"{match.group()} in {expr!r} has no label selector"


def test_dashboard_covers_the_operator_questions() -> None:
    exprs = "\n".join(dashboard_exprs())
    for quantile_of in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_duration_seconds"):
        for q in ("0.5", "0.99"):
            assert re.search(rf"histogram_quantile\({q}, [^\n]*ray_kvserve_{quantile_of}_bucket", exprs), quantile_of
    for needed in ("ray_kvserve_requests_total", "ray_kvserve_generated_tokens_total", "ray_kvserve_waiting_requests",
                   "ray_kvserve_engine_batch_size", "ray_kvserve_kv_slots_used", "ray_kvserve_kv_slots_capacity",
                   "ray_serve_deployment_replica_healthy", "ray_kvserve_rejections_total"):
        assert needed in exprs, needed
    assert re.search(r'sum by \(status\) \(rate\(ray_kvserve_requests_total\{[^}]*status!~"2\.\."', exprs)


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dash["templating"]["list"]}
    for p in panels:
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= variables, used - variables


def test_dashboard_promql_parses() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    concrete = [e.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$model", ".*")
                for e in dashboard_exprs() if not e.startswith("label_values")]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"kvserve:dashboard:{i}", "expr": e}
                                                        for i, e in enumerate(concrete)]}]}
    path = DEPLOY.parent / ".pytest_cache" / "dashboard-rules.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# --- slow: a real server, a real scrape ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_bundles(root: Path) -> Path:
    """Tiny random bundles for the config's models, exported with export/'s own functions."""
    from engine_bundle import tiny_model, write_bundle

    models = load("gen_rayservice").load_serve_config()["applications"][0]["args"]["models"]
    for spec in models:
        task = "translate" if spec["name"] == "translate" else "generate"
        model, cfg = tiny_model(task)
        write_bundle(model, cfg, task, root / Path(spec["bundle"]).name)
    return root


def _exercise(base: str, api_key: str) -> None:
    """Traffic that records every kvserve metric: answers, a stream, a 422, a stop string (a cancellation,
    reason stop_string) and engine rejections (429: `generate` has one KV slot and no waiting room)."""
    import concurrent.futures as cf

    import httpx

    with httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {api_key}"}) as client:
        for _ in range(3):
            assert client.post("/v1/translate", json={"text": "the dog", "max_tokens": 8}).status_code == 200
        assert client.post("/v1/generate", json={"prompt": "x", "top_p": 2}).status_code == 422
        r = client.post("/v1/generate", json={"prompt": "the", "max_tokens": 24, "stream": True})
        assert r.status_code == 200 and r.text.count("data: ") > 1
        text = client.post("/v1/generate", json={"prompt": "the", "max_tokens": 24}).json()["text"]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        assert client.post("/v1/generate", json={"prompt": "the", "max_tokens": 24, "stop": stop}).status_code == 200
        body = {"prompt": "the quick", "max_tokens": 40}
        with cf.ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(lambda _: client.post("/v1/generate", json=body).status_code, range(24)))
        assert 429 in codes and 200 in codes, codes


def _scrape_labels(port: int) -> dict[str, set[str]]:
    """Metric name -> label names, from the node's metrics endpoint (what a PodMonitor scrapes)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def _labels_used(expr: str) -> set[str]:
    """Label names an expression groups by or matches on (`namespace` is added by Prometheus at scrape)."""
    used = {x.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for x in group.split(",")}
    used |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", expr))
    return used - {"namespace", "le", ""}


@pytest.mark.slow
def test_dashboard_metrics_appear_in_a_real_scrape(tmp_path, monkeypatch) -> None:
    """Serve the CPU image's config (generated, autoscaling included) on tiny bundles with a real local
    Ray, send traffic, and read the metric names off the node's metrics port, as the PodMonitor does."""
    import secrets

    import ray

    from serving.server.launch import prepare_config, start, stop
    from serving.server.ray_env import use_fast_data_plane

    if ray.is_initialized():  # conftest's ray_cluster holds this process's Ray: run in a fresh interpreter
        this = f"{__file__}::test_dashboard_metrics_appear_in_a_real_scrape"
        cmd = [sys.executable, "-m", "pytest", "-m", "slow", "-o", "addopts=-q", "-p", "no:cacheprovider", this]
        run = subprocess.run(cmd, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-4000:]
        return
    gen = load("gen_rayservice")
    cfg = gen.image_serve_config(gen.load_serve_config(), gen.Variant.CPU)
    app = cfg["applications"][0]
    app["args"]["artifacts_dir"] = str(_tiny_bundles(tmp_path / "models"))
    api_key = secrets.token_urlsafe(16)  # the image's config reads its key from this variable (a Secret in a pod)
    monkeypatch.setenv(app["args"]["api_key_env"], api_key)  # set before Ray starts: its workers inherit it
    generate = next(m for m in app["args"]["models"] if m["name"] == "generate")
    generate["engine"]["max_slots"] = 1  # so that a second request is rejected (see _exercise)
    next(d for d in app["deployments"] if d["name"] == "generate")["user_config"]["max_waiting"] = 0
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    raw = prepare_config(path, host="127.0.0.1", port=_free_port())
    metrics_port = _free_port()
    use_fast_data_plane()  # as `kvserve serve` runs it
    ray.init(num_cpus=4, include_dashboard=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        start(raw, timeout_s=300)
        _exercise(f"http://127.0.0.1:{raw['http_options']['port']}", api_key)
        wanted, seen, deadline = dashboard_metric_names(), {}, time.monotonic() + 90
        while time.monotonic() < deadline and not wanted <= seen.keys():
            seen = _scrape_labels(metrics_port)
            time.sleep(2)
        missing = wanted - seen.keys()
        assert missing == set(), f"dashboard names missing from a real scrape: {sorted(missing)}"
        for expr in dashboard_exprs():
            names = dashboard_metric_names_in(expr)
            have = set().union(*(seen[n] for n in names)) if names else set()
            assert _labels_used(expr) <= have, f"{expr}: labels {sorted(_labels_used(expr) - have)} not exported"
    finally:
        stop()
