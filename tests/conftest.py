"""Fixtures shared by the suites that run a real local Ray Serve cluster (all slow-marked).

- `bundles`: tiny random bundles (translate, generate) exported once per test run with export's own functions.
- `server` / `client`: the integration suites' application (tests/integration_cluster.py) and an HTTP client.
- `ray_cluster`: ONE local Ray instance per test run for tests/test_server_integration.py and the
  reliability suites (test_reliability.py, test_reliability_admission.py, test_fuzz.py, test_security.py). Each suite deploys its own Serve
  application with `serving.server.launch.start`, which replaces the application deployed before (a Serve config
  is declarative), so suites take turns on one cluster instead of paying for a new one each. Serve's HTTP
  port is chosen once here, because Serve keeps the port it started with. Before Ray starts, the
  environment variable `API_KEY_ENV` gets a fresh random key: every Ray worker inherits it, the way a
  Kubernetes Secret reaches a pod's environment, and the reliability application reads it (`api_key_env`);
  and, as `serving.server.launch.start` does, Ray's proxy gets serving/server/proxy_guard.py's middleware.
  Nothing here starts unless a test asks for it, so the default (fast) suite never starts Ray.
"""
from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path

import pytest

API_KEY_ENV = "KVSERVE_TEST_API_KEY"


def wait_serving(proc, log: Path, timeout_s: float = 300) -> None:
    """Until the `kvserve serve` subprocess `proc`, writing to `log`, says it serves (it has then answered its own
    readiness through the HTTP port); an AssertionError with the log's end if it exits or takes longer."""
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and proc.poll() is None:
        if "kvserve: serving after" in log.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError("kvserve serve did not start:\n" + log.read_text(errors="replace")[-3000:])


def own_ray_env() -> dict[str, str]:
    """This environment without the HAProxy ports that this test run's own Ray took (`ray_cluster`): for a
    subprocess that starts a Ray of its own outside `launch.start` (which picks ports of its own when it inherited
    another process's: ray_env.PORTS_OWNER_ENV)."""
    from serving.server.ray_env import HAPROXY_PORT_ENV

    return {k: v for k, v in os.environ.items() if k not in HAPROXY_PORT_ENV}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> Path:
    """An artifacts directory with bundles/translate and bundles/generate (tiny random models, max_len 64)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_bundle import tiny_model, write_bundle  # export's functions, on a tiny random model

    art = tmp_path_factory.mktemp("artifacts")
    for task in ("translate", "generate"):
        model, cfg = tiny_model(task)
        write_bundle(model, cfg, task, art / "bundles" / task)
    return art


@pytest.fixture(scope="session")
def ray_cluster():
    """{"port": Serve's HTTP port, "api_key": the key in API_KEY_ENV}; Serve and Ray stop at the test run's end."""
    from serving.server.launch import stop
    from serving.server.ray_env import init_local_ray

    key = os.environ.setdefault(API_KEY_ENV, "kvs-test-" + secrets.token_urlsafe(24))
    # the local cluster `kvserve serve` starts: HAProxy in front, token auth, loopback (serving/server/ray_env.py)
    init_local_ray(2, include_dashboard=False, _system_config={"metrics_report_interval_ms": 1000})
    try:
        yield {"port": free_port(), "api_key": key}
    finally:
        stop()


@pytest.fixture(scope="session")
def reliability_app(bundles, ray_cluster):
    """The reliability suites' application (tests/reliability_cluster.py), deployed once per session."""
    from reliability_cluster import deploy

    return deploy(bundles, ray_cluster["port"], ray_cluster["api_key"], API_KEY_ENV)


@pytest.fixture
def rel(reliability_app):
    """`reliability_app`, deployed again first if another suite's application replaced it."""
    reliability_app.ensure_running()
    return reliability_app


@pytest.fixture(scope="session")
def server(bundles, ray_cluster):
    """This suite's application on the test run's Ray cluster (tests/conftest.py: `bundles`, `ray_cluster`)."""
    import yaml
    from integration_cluster import integration_config
    from serving.server.launch import prepare_config, start

    path = bundles / "serve_config.yaml"
    path.write_text(yaml.safe_dump(integration_config(bundles, ray_cluster["port"])))
    raw = prepare_config(path)
    start(raw, timeout_s=300)
    base = f"http://127.0.0.1:{raw['http_options']['port']}"
    yield {"base": base, "raw": raw, "art": bundles}


@pytest.fixture(scope="session")
def client(server):
    import httpx

    with httpx.Client(base_url=server["base"], timeout=60) as c:
        yield c
