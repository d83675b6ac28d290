"""The reliability suites' Serve application and helpers (test_reliability.py, test_reliability_admission.py,
test_fuzz.py, test_security.py; what they send is tests/reliability_client.py).

One application, "reliability", on the Ray cluster shared by the test run (tests/conftest.py `ray_cluster`),
built from deploy/serve_config.yaml with test overrides, exactly as `kvserve serve` would deploy it:

    ingress    1 replica, API key from the environment variable API_KEY_ENV (api_key_env)
    translate  tiny translate bundle (max_len 64), 4 KV slots                 fuzzing /v1/translate
    generate   tiny LM (max_len 64), 2 replicas x 8 slots, health check 2 s   replica failure, fuzzing
    busy       `long` bundle, 2 slots, 2 waiting, Ray queue 6 -> 429          overload
    long       `long` bundle, 104 slots                                       disconnects, graceful drain
    longtr     `longtr` bundle, 32 slots, 128 waiting                        plain /v1/translate disconnects

The `long` bundle is a small random LM (d_model 384, 4 layers, KV cache of 256 tokens): slow enough per
step that 100 requests of 250 tokens are still generating seconds later (and their tokens do not flood the
streaming path), small enough for 104 KV slots. `longtr` is its translation counterpart (d_model 384, 2+3
layers, 256 tokens), so that 160 texts of 250 tokens take seconds too.

Figures of a run are printed as `RELIABILITY {json}` lines (pytest -s shows them) and, when the environment
variable KVSERVE_RELIABILITY_OUT names a file, appended to it as JSON lines; docs/reliability.md quotes them.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
APP = "reliability"
DEADLINE_S = 10.0  # limits.request_timeout_s of the app
LONG_MAX_LEN = 256
LIMITS = {"max_body_bytes": 65_536, "max_prompt_tokens": 32, "max_tokens": 1000, "default_max_tokens": 16,
          "max_texts": 8, "max_beam_size": 4, "max_n_best": 4, "max_stop_strings": 4,
          "request_timeout_s": DEADLINE_S}


def write_long_bundles(art: Path) -> None:
    """bundles/long and bundles/longtr: small random models whose KV cache holds 256 tokens, slow enough per
    step that a request can run for seconds."""
    from engine_bundle import tiny_model, write_bundle

    for name, task, layers in (("long", "generate", {"n_decoder_layers": 4}),
                               ("longtr", "translate", {"n_encoder_layers": 2, "n_decoder_layers": 3})):
        out = art / "bundles" / name
        if not (out / "manifest.json").is_file():
            model, cfg = tiny_model(task, max_len=LONG_MAX_LEN, d_model=384, d_ff=1536, **layers)
            write_bundle(model, cfg, task, out)


def reliability_config(art: Path, port: int, key_env: str) -> dict:
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["http_options"].update(port=port)  # the host is the shipped default, 127.0.0.1 (tests/test_launch.py)
    app = cfg["applications"][0]
    app["name"] = APP
    args = app["args"]
    args.update(artifacts_dir=str(art), api_key=None, api_key_env=key_env)
    args["limits"] = dict(LIMITS)
    one = {"intra_op_threads": 1, "provider": "cpu"}
    args["models"] = [
        {"name": "translate", "bundle": "bundles/translate", "engine": {**one, "max_slots": 4}},
        {"name": "generate", "bundle": "bundles/generate", "engine": {**one, "max_slots": 8}},
        {"name": "busy", "bundle": "bundles/long", "engine": {**one, "max_slots": 2}},
        {"name": "long", "bundle": "bundles/long", "engine": {**one, "max_slots": 104}},
        {"name": "longtr", "bundle": "bundles/longtr", "engine": {**one, "max_slots": 32}}]
    small = {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 5,
             "graceful_shutdown_wait_loop_s": 0.5}
    live = {"batching": "continuous", "max_waiting": 16, "max_batch_size": 4, "batch_wait_timeout_s": 0.01}
    app["deployments"] = [
        # draining: false explicitly, so that deploying this config again resumes a drained ingress (Serve
        # calls reconfigure only with a user_config, never to clear one).
        # The front end bounds its queue too: past 400 + 400 requests the proxy answers 429 at once.
        {"name": "ingress", "num_replicas": 1, "max_ongoing_requests": 400, "max_queued_requests": 400,
         "backpressure_config": {"status_code": 429, "retry_after_s": 1}, **small,
         "user_config": {"draining": False}},
        {"name": "translate", "max_ongoing_requests": 16, **small, "user_config": live},
        # A dead replica is noticed at its next health check (2 s); a generous timeout keeps a replica that is
        # merely slow on a loaded machine from being restarted.
        {"name": "generate", "num_replicas": 2, "max_ongoing_requests": 24, "health_check_period_s": 2,
         "health_check_timeout_s": 30, **small, "user_config": live},
        {"name": "busy", "max_ongoing_requests": 6, "max_queued_requests": 6,
         "backpressure_config": {"status_code": 429, "retry_after_s": 1}, **small,
         "user_config": {**live, "max_waiting": 2}},
        {"name": "long", "max_ongoing_requests": 128, **small, "user_config": {**live, "max_waiting": 16}},
        {"name": "longtr", "max_ongoing_requests": 176, **small, "user_config": {**live, "max_waiting": 144}}]
    return cfg


@dataclass
class RelApp:
    raw: dict
    base: str
    api_key: str
    art: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=self.auth, timeout=timeout)

    def async_client(self, timeout: float = 60.0, connections: int = 200) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(base_url=self.base, headers=self.auth, timeout=timeout, limits=limits)

    def ensure_running(self) -> None:
        """Deploy the application again if another suite replaced it (a Serve config is declarative)."""
        from ray import serve
        from serving.server.launch import start

        status = serve.status().applications.get(APP)
        if status is None or status.status.value != "RUNNING":
            start(self.raw, timeout_s=300)


def deploy(art: Path, port: int, api_key: str, key_env: str) -> RelApp:
    from serving.server.launch import prepare_config, start

    write_long_bundles(art)
    path = art / "reliability_serve_config.yaml"
    path.write_text(yaml.safe_dump(reliability_config(art, port, key_env)))
    raw = prepare_config(path)
    start(raw, timeout_s=300)
    return RelApp(raw=raw, base=f"http://127.0.0.1:{port}", api_key=api_key, art=art)


# -- replicas --------------------------------------------------------------------------------------------
def handle(model: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(model, app_name=APP)


def handle_infos(model: str, calls: int, app: str = APP) -> list[dict]:
    """`calls` answers of `ModelDeployment.info()`, through a handle on an event loop of this call's own: with
    Serve's throughput-optimized data plane a handle's router runs on the caller's loop, so a handle cannot be
    used from a thread without one (call this from a thread with no running loop)."""
    async def ask() -> list[dict]:
        from ray.serve.context import _get_global_client

        from ray import serve

        h = serve.get_deployment_handle(model, app_name=app)
        try:
            return [await asyncio.wait_for(h.info.remote(), 30) for _ in range(calls)]
        finally:
            await _get_global_client().shutdown_cached_handles_async()  # their routers live on this loop
    return asyncio.run(ask())


def replica_infos(model: str, calls: int = 8) -> dict[int, dict]:
    """pid -> `ModelDeployment.info()` of the replicas that answered `calls` calls (Serve routes them)."""
    return {info["pid"]: info for info in handle_infos(model, calls)}


def engine_snapshot(model: str) -> dict:
    """The engine snapshot of the model's (single) replica."""
    return handle_infos(model, 1)[0]["engine"]


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


# -- metrics ---------------------------------------------------------------------------------------------
def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_for(predicate: Any, timeout_s: float, period_s: float = 0.05) -> float | None:
    """Seconds until predicate() is true, or None if it is still false after timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(period_s)
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(scenario: str, **figures: Any) -> None:
    line = json.dumps({"scenario": scenario, **figures}, sort_keys=True, default=str)
    print(f"RELIABILITY {line}", flush=True)
    out = os.environ.get("KVSERVE_RELIABILITY_OUT")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")
