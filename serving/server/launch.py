"""What `kvserve serve` runs: start Ray and Ray Serve locally from existing bundles, with the Serve config file.

Validates the config offline (serving.server.config.load_serve_config), checks every bundle exists, binds HTTP to
127.0.0.1 unless the config or `--host` says otherwise (and warns at start when it binds beyond loopback with no API
key: `exposure_warning`), starts a local Ray instance, deploys the config exactly as `serve run`/`serve deploy` would
(the controller imports `serving.server.app:build_app`), waits until every application is RUNNING, prints the URLs, and
blocks. Ctrl-C (or SIGTERM) stops cleanly (`stop`): first `drain` -- every ingress replica answers new API requests with
503 + Retry-After and reports not ready, while the requests in flight finish -- then the applications are deleted (the
engines drain what is left), then Ray shuts down.

`serve_config(...)` is the whole command as a function; `prepare_config`, `start`, `drain` and `stop` are its
steps, also used by bench/http.py and the tests. Does not own: the command line (kvserve/serve.py), training
or exporting bundles (`kvserve up` does that first), the app itself (serving/server/app.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from serving.server import ray_env
from serving.server.config import AppArgs, load_serve_config, validate_serve_config
from serving.server.haproxy import HTTP_BIND_ENV
from serving.server.placement import INGRESS_DEPLOYMENT, PLACEMENTS, colocate_models, split_models

DEFAULT_CONFIG = "deploy/serve_config.yaml"
DEFAULT_HOST = "127.0.0.1"  # safe by default: only this machine reaches the API unless told otherwise
IMPORT_PATH = "serving.server.app:build_app"
START_TIMEOUT_S = 600.0
DRAIN_TIMEOUT_S = 60.0
METRICS_REPORT_MS = 2000


def prepare_config(
    config: str | Path,
    artifacts: str | Path | None = None,
    host: str | None = None,
    port: int | None = None,
    placement: str | None = None,
) -> dict[str, Any]:
    """The validated config dict with overrides applied and artifacts_dir made absolute (the controller's
    build task has another working directory); every bundle is checked to exist. `placement` None keeps the
    file's placement; "colocated" moves every model into the ingress replica (`colocate_models`), "split" each
    colocated one into a deployment of its own (`split_models`)."""
    from serving.server.app import bundle_task

    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: expected one of {PLACEMENTS}")
    raw = load_serve_config(config)
    for app in raw.get("applications", []):
        if app.get("import_path") != "serving.server.app:build_app":
            continue
        args = app.setdefault("args", {})
        root = Path(artifacts if artifacts is not None else args.get("artifacts_dir", "artifacts"))
        args["artifacts_dir"] = str(root.resolve())
        parsed = AppArgs.model_validate(args)
        for spec in parsed.models:
            for _, bundle, _ in spec.deployments():
                bundle_task(parsed.bundle_dir(spec, bundle))  # fails here, with the path, not in a replica
        if placement == "colocated":
            colocate_models(app)
        elif placement == "split":
            split_models(app)
    http = raw.setdefault("http_options", {})
    if host is not None:
        http["host"] = host
    http.setdefault("host", DEFAULT_HOST)
    if port is not None:
        http["port"] = port
    return validate_serve_config(raw)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (127.0.0.0/8, ::1, localhost); 0.0.0.0 and names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def exposure_warning(raw: dict[str, Any]) -> str | None:
    """A warning when the config serves beyond loopback while some kvserve application has no API key."""
    host = (raw.get("http_options") or {}).get("host", DEFAULT_HOST)
    if is_loopback(host):
        return None
    open_apps = [
        a.get("name", "default")
        for a in raw.get("applications", [])
        if a.get("import_path") == IMPORT_PATH
        and not ((a.get("args") or {}).get("api_key") or (a.get("args") or {}).get("api_key_env"))
    ]
    if not open_apps:
        return None
    return (
        f"WARNING: serving on {host}, beyond this machine's loopback interface, and application(s) "
        f"{open_apps} have no API key: anyone who can reach port {raw['http_options'].get('port', 8000)} "
        f"can use the API. Set args.api_key_env in the Serve config (the name of an environment variable "
        f"holding the key), or bind {DEFAULT_HOST} (the default: leave out --host / http_options.host)."
    )


def cpus_needed(raw: dict[str, Any]) -> int:
    """Logical CPUs the config's replicas reserve (autoscaling: at its min/initial replicas)."""
    total = 0.0
    for app in raw.get("applications", []):
        for d in app.get("deployments", []):
            auto = d.get("autoscaling_config") or {}
            n = d.get("num_replicas") or auto.get("initial_replicas") or auto.get("min_replicas") or 1
            cpus = (d.get("ray_actor_options") or {}).get("num_cpus", 1)
            total += n * cpus
    return max(1, math.ceil(total))


def start(
    raw: dict[str, Any],
    num_cpus: int | None = None,
    dashboard: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    wait_http: bool = True,
) -> None:
    """Start Ray (if not running), deploy the config, wait until every application is RUNNING and (`wait_http`)
    until each kvserve application answers ready on the HTTP port, as its clients reach it."""
    import ray
    from ray.serve._private.api import serve_start  # what `serve run CONFIG` itself uses
    from ray.serve.schema import ServeDeploySchema

    if not ray.is_initialized():
        host = (raw.get("http_options") or {}).get("host", DEFAULT_HOST)
        os.environ.pop(HTTP_BIND_ENV, None)
        if not is_loopback(host) and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "1":
            if not re.fullmatch(r"[A-Za-z0-9.:_-]+", host):
                raise ValueError(f"http host {host!r}: expected an IP address or a host name")
            os.environ[HTTP_BIND_ENV] = host  # HAProxy's API frontend binds it; the rest of Serve stays on loopback
        cpus = num_cpus or max(os.cpu_count() or 1, cpus_needed(raw))
        # Replicas push metrics to the node's exporter every metrics_report_interval_ms (Ray's default: 10 s);
        # 2 s keeps /metrics close to live for load tests at a negligible cost.
        ray_env.init_local_ray(
            cpus,
            include_dashboard=dashboard,
            log_to_driver=True,
            _system_config={"metrics_report_interval_ms": METRICS_REPORT_MS},
        )
    if os.environ.get(HTTP_BIND_ENV):
        raw = {**raw, "http_options": {**raw["http_options"], "host": ray_env.LOOPBACK}}
    schema = ServeDeploySchema.model_validate(raw)
    client = serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        global_logging_config=schema.logging_config,
    )
    client.deploy_apps(schema, _blocking=False)
    t0 = time.monotonic()
    wait_running([a.name for a in schema.applications], timeout_s)
    if wait_http:
        wait_http_ready(raw, timeout_s - (time.monotonic() - t0))


def with_draining(raw: dict[str, Any], draining: bool = True) -> dict[str, Any]:
    """A copy of the config whose kvserve applications' ingress has `user_config.draining` set."""
    out = json.loads(json.dumps(raw))
    for app in out.get("applications", []):
        if app.get("import_path") != IMPORT_PATH:
            continue
        deployments = app.setdefault("deployments", [])
        ingress = next((d for d in deployments if d.get("name") == INGRESS_DEPLOYMENT), None)
        if ingress is None:
            ingress = {"name": INGRESS_DEPLOYMENT}
            deployments.append(ingress)
        ingress["user_config"] = {**(ingress.get("user_config") or {}), "draining": draining}
    return out


_DRIVER_HANDLES: dict[tuple[str, str, str], Any] = {}


def driver_handle(deployment: str, app: str) -> Any:
    """A deployment handle for synchronous code outside an event loop (`.remote().result()`): its router runs on
    a loop of its own, whatever RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP the fast data plane put in the environment
    (with 0, a plain handle's call fails there: 'No event loop running'). One per deployment and Ray job, reused;
    `stop` shuts them down."""
    import ray
    from ray.serve.handle import DeploymentHandle

    key = (deployment, app, ray.get_runtime_context().get_job_id())
    if key not in _DRIVER_HANDLES:
        # not Serve's cached one: that may be bound to another loop
        handle: DeploymentHandle[Any] = DeploymentHandle(deployment, app)
        handle._init(_run_router_in_separate_loop=True)
        _DRIVER_HANDLES[key] = handle
    return _DRIVER_HANDLES[key]


def _shutdown_driver_handles() -> None:
    while _DRIVER_HANDLES:
        try:
            _DRIVER_HANDLES.popitem()[1].shutdown()
        except Exception as e:  # a handle that cannot shut down must not prevent Serve's shutdown
            print(f"kvserve: a driver handle did not shut down ({e!r})", file=sys.stderr, flush=True)


def drain(raw: dict[str, Any], timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Drain every kvserve application of the (deployed) config `raw`: new API requests get 503 from now on;
    returns True once every ingress replica reports nothing in flight, False if some still had requests
    after `timeout_s` (serving/server/drain.py explains why the wait is here and not in `reconfigure`). Call it
    outside an event loop (it runs its own: Serve's throughput-optimized handles route on the caller's loop)."""
    drained = with_draining(raw)
    start(drained, timeout_s=timeout_s, wait_http=False)  # a draining ingress reports not ready
    deadline = time.monotonic() + timeout_s
    apps = [a.get("name", "default") for a in drained["applications"] if a.get("import_path") == IMPORT_PATH]
    # A loop of its own, left open: the handle's router stays bound to it, and `stop`'s serve.shutdown() failed
    # with 'Event loop is closed' when asyncio.run had closed it (measured in test_graceful_drain's teardown).
    return asyncio.new_event_loop().run_until_complete(_wait_all_idle(apps, deadline))


async def _wait_all_idle(apps: list[str], deadline: float) -> bool:
    """Handles of this loop's own, not Serve's cached ones (a cached handle whose router is bound to this loop
    would break every later caller on another loop); shut down when done."""
    from ray.serve.handle import DeploymentHandle

    for app in apps:
        handle: DeploymentHandle[Any] = DeploymentHandle(INGRESS_DEPLOYMENT, app)
        try:
            if not await _wait_idle(handle, app, deadline):
                return False
        finally:
            await handle.shutdown_async()
    return True


async def _wait_idle(handle: Any, app: str, deadline: float) -> bool:
    """Poll `drain_status` until every running ingress replica has reported draining with nothing in flight.

    Calls reach replicas by Serve's routing (the least busy of two), so a busy replica is asked once it is
    idle; a replica that reported idle stays idle (draining refuses new requests)."""
    from ray import serve
    from ray.serve.schema import ReplicaState

    idle: set[str] = set()
    while time.monotonic() < deadline:
        states = serve.status().applications[app].deployments[INGRESS_DEPLOYMENT].replica_states
        replicas = states.get(ReplicaState.RUNNING, 1)
        status = await asyncio.wait_for(handle.drain_status.remote(), max(1.0, deadline - time.monotonic()))
        if status["phase"] == "draining" and status["in_flight"] == 0:
            idle.add(status["replica"])
        if len(idle) >= replicas:
            return True
        await asyncio.sleep(0.05)
    return False


def wait_running(names: list[str], timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = {n: (apps[n].status.value if n in apps else "NOT_STARTED") for n in names}
        failed = {n: failure_message(apps[n]) for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
        if failed:
            raise RuntimeError(f"Serve application(s) failed to deploy: {failed}")
        if all(s == "RUNNING" for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not RUNNING after {timeout_s:.0f}s: {states}")
        time.sleep(0.5)


def wait_http_ready(raw: dict[str, Any], timeout_s: float) -> None:
    """Poll each kvserve application's /v2/health/ready through the HTTP port until it answers 200: RUNNING
    means the replicas are up, while the data plane (HAProxy's server list) may not route to them yet."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + max(timeout_s, 1.0)
    kvserve = {"applications": [a for a in raw.get("applications", []) if a.get("import_path") == IMPORT_PATH]}
    last: Exception | None = None
    for url in (u for u in urls({**raw, **kvserve}) if u.endswith("/v2/health/ready")):
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError) as e:
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer ready within {timeout_s:.0f}s: {last!r}")
            time.sleep(0.2)


def failure_message(app: Any) -> str:
    """An application's failure with its failed deployments' own messages (e.g. the replica's BundleError,
    which names the damaged file): Serve's application message only says which deployments failed."""
    parts = [app.message]
    for name, dep in app.deployments.items():
        if dep.status.value in ("DEPLOY_FAILED", "UNHEALTHY") and dep.message:
            parts.append(f"deployment {name!r}: {dep.message[-1500:]}")
    return "\n".join(parts)


def urls(raw: dict[str, Any]) -> list[str]:
    http = raw.get("http_options") or {}
    host = http.get("host", DEFAULT_HOST)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http.get('port', 8000)}"
    out = []
    for app in raw.get("applications", []):
        prefix = (app.get("route_prefix") or "/").rstrip("/")
        out += [
            f"{base}{prefix}{p}"
            for p in (
                "/v1/translate",
                "/v1/generate",
                "/v1/completions",
                "/v1/models",
                "/v2/health/ready",
                "/metrics",
                "/docs",
            )
        ]
    return out


def stop(raw: dict[str, Any] | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Drain, then stop: with the deployed config `raw`, first `drain` (in-flight requests finish, new ones
    get 503); then delete the applications (anything still running gets each deployment's
    graceful_shutdown_timeout_s), then shut Serve and Ray down."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            if raw is not None:
                try:
                    if not drain(raw, drain_timeout_s):
                        print(
                            f"kvserve: requests still in flight after {drain_timeout_s:.0f}s of draining",
                            file=sys.stderr,
                            flush=True,
                        )
                except Exception as e:  # a failed drain must not prevent the shutdown
                    print(f"kvserve: drain failed ({e!r}); stopping anyway", file=sys.stderr, flush=True)
            for name in list(serve.status().applications):
                serve.delete(name, _blocking=True)
        finally:
            _shutdown_driver_handles()
            serve.shutdown()
            ray.shutdown()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_config(
    config: str | Path = DEFAULT_CONFIG,
    artifacts: str | Path | None = None,
    host: str | None = None,
    port: int | None = None,
    num_cpus: int | None = None,
    dashboard: bool = False,
    placement: str | None = None,
) -> int:
    t0 = time.monotonic()
    raw = prepare_config(config, artifacts, host, port, placement)
    warning = exposure_warning(raw)
    if warning:
        print(f"kvserve: {warning}", file=sys.stderr, flush=True)
    started = False
    try:
        start(raw, num_cpus=num_cpus, dashboard=dashboard)
        started = True
        # After ray.init, which installs its own SIGTERM handler: `kill`, systemd and containers stop like Ctrl-C.
        signal.signal(signal.SIGTERM, _interrupt)
        print(f"kvserve: serving after {time.monotonic() - t0:.1f}s", flush=True)
        for url in urls(raw):
            print(f"  {url}", flush=True)
        print("Ctrl-C stops the server (in-flight requests finish first).", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("kvserve: shutting down, draining in-flight requests...", file=sys.stderr, flush=True)
        return 0
    finally:
        stop(raw if started else None)
