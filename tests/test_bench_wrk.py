"""bench/wrk.py against a small local HTTP server: wrk's Lua hook counts each answer's tokens, the TTFT probe
times streamed answers and adds its tokens, errors are counted, wrk's own CPU is reported."""
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.wrk import _lua, run_wrk

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (apt-get install wrk)")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["max_tokens"]
        if n == 0:  # a bad request: counted as an error, no tokens
            out, status, kind = b'{"error": "max_tokens must be >= 1"}', 400, "application/json"
        elif self.path == "/v1/generate":
            events = [{"token": "a"}] * n + [{"finish_reason": "length", "usage": {"completion_tokens": n}}]
            out, status, kind = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode(), 200, "text/event-stream"
        else:
            out, status, kind = json.dumps({"usage": {"completion_tokens": n}}).encode(), 200, "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_wrk_counts_the_tokens_of_every_answer_and_the_probe_times_first_tokens(server):
    bodies = [{"prompt": "x", "max_tokens": 5}, {"prompt": "y", "max_tokens": 3}]
    r = run_wrk(server, "/v1/completions", bodies, connections=3, seconds=1,
                probe_bodies=[{"prompt": "z", "max_tokens": 4}])
    assert r["connections"] == 2 and r["answers"] > 10 and r["errors"] == 0
    # wrk's answers alternate 5 and 3 tokens; the probe's are 4 tokens each and add to the total
    assert 3 * r["answers"] <= r["wrk_tokens"] <= 5 * r["answers"] and abs(r["wrk_tokens"] - 4 * r["answers"]) <= 3, r
    assert r["probe_tokens"] > 0 and r["probe_tokens"] % 4 == 0, r
    assert r["output_tokens_per_s"] == pytest.approx((r["wrk_tokens"] + r["probe_tokens"]) / r["seconds"])
    assert r["probe_requests"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] < 1
    assert 0 <= r["load_generator_cpu"] < 1.5


def test_wrk_counts_errors_and_no_tokens_for_them(server):
    r = run_wrk(server, "/v1/completions", [{"prompt": "x", "max_tokens": 0}], connections=1, seconds=1)
    assert r["errors"] > 0 and r["answers"] == 0 and r["output_tokens_per_s"] == 0 and r["ttft_p99_s"] is None


def test_lua_bodies_survive_long_bracket_text():
    script = _lua(['{"prompt": "a]]b]=]c"}'], "/v1/generate", offset=0)
    assert '[==[{"prompt": "a]]b]=]c"}]==]' in script
