"""Every socket the local server listens on, listed from the process tree of a real `kvserve serve` (slow; the
cluster suite CI runs).

`kvserve serve --host 0.0.0.0` with the shipped config (deploy/serve_config.yaml, as the soak and the images run
it) on tiny bundles: of every listening TCP socket of the server's process tree (Ray's GCS, raylet, object
manager, dashboard agent, every worker's gRPC server, each Serve replica's own servers, HAProxy's listeners),
the HTTP port is the only one off loopback. Ray's token authentication is on, with a token of this run's own.
"""
from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import free_port, own_ray_env, wait_serving

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[1]


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def listening(pid: int) -> dict[tuple[str, int], str]:
    """(address, port) -> process name of every listening TCP socket of `pid` and its descendants."""
    out = {}
    for p in _tree(pid):
        try:
            for c in p.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = p.name()
        except psutil.Error:  # a worker that exited meanwhile
            continue
    return out


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_only_the_http_port_listens_beyond_loopback_and_ray_requires_this_runs_token(bundles, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**own_ray_env(), "PYTHONUNBUFFERED": "1"}
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)  # as a fresh shell starts it
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "--config", "deploy/serve_config.yaml",
                                 "--artifacts", str(bundles), "--host", "0.0.0.0", "--port", str(port),
                                 "--num-cpus", "2"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_serving(proc, log)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/generate", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text  # served, with every server in place
        sockets = listening(proc.pid)
        names = {name for name in sockets.values()}
        assert {"gcs_server", "raylet", "haproxy"} <= names, sockets  # the whole tree was seen
        beyond = {addr: name for addr, name in sockets.items() if not _loopback(addr[0])}
        assert beyond == {("0.0.0.0", port): "haproxy"}, beyond
        raylet = next(p for p in _tree(proc.pid) if p.name() == "raylet")
        environ = raylet.environ()
        assert environ.get("RAY_AUTH_MODE") == "token"
        token = environ.get("RAY_AUTH_TOKEN", "")
        default = Path.home() / ".ray" / "auth_token"
        assert len(token) == 64 and (not default.exists() or default.read_text().strip() != token)
        print(f"LISTENING {len(sockets)} sockets of {len(names)} kinds of process; beyond loopback: {beyond}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()

