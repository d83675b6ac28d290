"""loadtest/ against a real local HTTP server (tests/loadtest_server.py): open- and closed-loop runs, 429s,
the CLI and the Locust file, each checked against the server's Prometheus counters (request and token counts
must agree with the report's)."""
from __future__ import annotations

import argparse
import json

import httpx
import pytest

from loadtest import cli
from loadtest.arrivals import arrival_times
from loadtest.config import Arrival, LoadConfig, Workload
from loadtest.promscrape import parse_metrics, server_delta
from loadtest.runner import run_load
from loadtest_server import ServerThread, build_app

# ------------------------------------------------------------------------------------------ real server


@pytest.fixture(scope="module")
def server():
    with ServerThread(build_app(max_concurrent=64)) as s:
        yield s


async def _metric_totals(url: str) -> dict:
    """The server's counters now (0 for a series not created yet)."""
    async with httpx.AsyncClient() as c:
        d = server_delta(parse_metrics(""), parse_metrics((await c.get(url + "/metrics")).text))
    return {k: d[k] or 0.0 for k in ("requests", "generated_tokens")}


async def test_open_loop_streaming_run_agrees_with_server_metrics(server) -> None:
    cfg = LoadConfig(server.url, workload=Workload.GENERATE, rate=40.0, duration_s=1.5, warmup_s=0.5, seed=11,
                     max_tokens=12, data_dir="/nonexistent")
    rep = await run_load(cfg)
    srv, t = rep.server, rep.totals
    assert srv["available"] and not rep.errors, (srv, rep.errors)
    expected_sent = sum(1 for x in _times_until(40.0, 11, 2.0))  # exactly the seeded arrivals in 2 s
    assert t["sent"] == expected_sent and t["warmup"] == sum(1 for x in _times_until(40.0, 11, 0.5))
    assert srv["requests"] == t["sent"] == t["all_completed"]
    assert srv["generated_tokens"] == t["all_output_tokens"] > 0
    assert srv["prompt_tokens"] == t["all_prompt_tokens"] > 0
    assert srv["batch_size"]["count"] == t["all_output_tokens"] and srv["batch_size"]["mean"] >= 1
    assert rep.inputs_fallback and "built-in" in rep.inputs
    lat = rep.latency
    assert lat["ttft"]["n"] == t["succeeded"] and lat["ttft"]["p50"] >= 0.01  # the server's 10 ms prefill
    assert lat["itl"]["p50"] >= 0.003 and lat["e2e"]["p50"] > lat["ttft"]["p50"]
    streamed = [r for r in rep.records if r.ok]
    assert all(len(r.token_times) == r.output_tokens for r in streamed)  # usage agrees with the stream


def _times_until(rate: float, seed: int, end: float):
    for t in arrival_times(rate, Arrival.POISSON, 1.0, seed):
        if t >= end:
            return
        yield t


@pytest.mark.parametrize("workload,stream", [(Workload.COMPLETIONS, True), (Workload.COMPLETIONS, False),
                                             (Workload.TRANSLATE, None), (Workload.GENERATE, False)])
async def test_closed_loop_workloads_agree_with_server_metrics(server, workload: Workload, stream) -> None:
    before = await _metric_totals(server.url)
    cfg = LoadConfig(server.url, workload=workload, concurrency=4, requests=12, stream=stream, max_tokens=8,
                     data_dir="/nonexistent", scrape_metrics=False)
    rep = await run_load(cfg)
    after = await _metric_totals(server.url)
    assert rep.totals["measured"] == rep.totals["succeeded"] == 12 and not rep.errors
    assert after["requests"] - before["requests"] == 12
    assert after["generated_tokens"] - before["generated_tokens"] == rep.totals["output_tokens"]
    assert (rep.latency["ttft"]["n"] == 12) == bool(cfg.streams)


async def test_429s_are_counted_apart_and_match_the_server() -> None:
    with ServerThread(build_app(max_concurrent=2, prefill_s=0.05)) as s:
        rep = await run_load(LoadConfig(s.url, workload=Workload.GENERATE, rate=60.0, duration_s=1.0, seed=2,
                                        data_dir="/nonexistent"))
    srv, t = rep.server, rep.totals
    assert t["rejected_429"] > 0 and rep.errors == {"429": t["rejected_429"]}
    assert srv["requests_by_status"] == {"200": t["succeeded"], "429": t["rejected_429"]}
    assert rep.retry_after["p50"] == 0.05


async def test_only_the_given_url_is_contacted(server, monkeypatch) -> None:
    """A proxy set in the environment must not capture the traffic (a dead proxy would fail every request)."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    async with httpx.AsyncClient(trust_env=True) as c:  # what the proxy would do to a careless client
        with pytest.raises(httpx.ConnectError):
            await c.get(server.url + "/metrics")
    rep = await run_load(LoadConfig(server.url, concurrency=2, requests=4, data_dir="/nonexistent"))
    assert rep.totals["succeeded"] == 4 and rep.server["available"]


def test_cli_writes_the_report_and_gates_on_slos(server, tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="kvserve")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.register(sub)
    common = ["loadtest", server.url, "--workload", "generate", "--concurrency", "3", "--requests", "9",
              "--data-dir", str(tmp_path / "none"), "--quiet"]
    args = parser.parse_args(common + ["--out", str(tmp_path / "a"), "--slo", "e2e_p99=0.000001"])
    assert args.func(args) == cli.EXIT_SLO_MISSED
    assert "SLO e2e_p99 <= 0.0 ms" in capsys.readouterr().out
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["slo_met"] is False and report["totals"]["succeeded"] == 9
    assert {p.name for p in (tmp_path / "a").iterdir()} == {
        "report.json", "report.md", "requests.jsonl", "latency.png", "timeline.png"}
    args = parser.parse_args(common + ["--out", str(tmp_path / "b"), "--slo", "ttft_p99=30,e2e_p99=60"])
    assert args.func(args) == cli.EXIT_OK
    bad = parser.parse_args(common + ["--slo", "ttft_p99=zero"])
    assert bad.func(bad) == cli.EXIT_USAGE and "number of seconds" in capsys.readouterr().err


def test_cli_reports_an_unreachable_server(tmp_path) -> None:
    with socket_closed_port() as url:
        code = cli.main([url, "--concurrency", "1", "--requests", "2", "--quiet", "--timeout", "5",
                         "--out", str(tmp_path), "--data-dir", str(tmp_path / "none")])
    assert code == cli.EXIT_NOTHING_SUCCEEDED
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["errors_by_status"] == {"ConnectError": 2}
    assert report["server_metrics_delta"]["available"] is False


class socket_closed_port:
    """A loopback URL on which nothing listens (bound, never listening, so no one else takes the port)."""

    def __enter__(self) -> str:
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


# ------------------------------------------------------------------------------------------ Locust


def test_locustfile_headless_run_agrees_with_server_metrics(server, tmp_path) -> None:
    """The documented headless command, as a subprocess (gevent patches the process it runs in)."""
    import importlib.util
    if importlib.util.find_spec("locust") is None:  # never import it here: it monkey-patches the process
        pytest.skip("the `locust` extra is not installed")
    import re
    import subprocess
    import sys
    from pathlib import Path

    locustfile = Path(__file__).resolve().parents[1] / "loadtest" / "locustfile.py"
    before = asyncio_run(_metric_totals(server.url))
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "--host", server.url,
         "--users", "3", "--spawn-rate", "3", "--run-time", "2s", "--stop-timeout", "10", "--only-summary",
         "--workload", "generate", "--max-tokens", "10", "--data-dir", str(tmp_path / "none"),
         "--json-file", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=locustfile.parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = asyncio_run(_metric_totals(server.url))
    rows = {(e["method"], e["name"]): e for e in json.loads((tmp_path / "run.json").read_text())}
    post = rows[("POST", "/v1/generate")]
    assert post["num_failures"] == 0 and post["num_requests"] >= 3  # each user's requests (fewer on a busy machine)
    assert after["requests"] - before["requests"] == post["num_requests"]
    tokens = int(re.search(r"output tokens (\d+) in", proc.stderr).group(1))
    assert after["generated_tokens"] - before["generated_tokens"] == tokens
    ttft = rows[("TTFT", "/v1/generate")]
    assert ttft["num_requests"] == post["num_requests"]
    # Streamed for real: the first token (after the server's 10 ms prefill) comes well before the whole answer.
    mean = lambda e: e["total_response_time"] / e["num_requests"]  # noqa: E731
    assert 10 <= mean(ttft) < mean(post)


def asyncio_run(coro):
    import asyncio
    return asyncio.run(coro)


async def test_api_key_from_the_environment_is_sent_and_never_reported(monkeypatch) -> None:
    from fastapi.responses import JSONResponse

    key = "kvs-loadtest-secret"
    app = build_app(max_concurrent=64)

    @app.middleware("http")
    async def require_key(request, call_next):  # what serving/server/auth.py does, in short
        if request.url.path.startswith("/v1/") and request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"type": "unauthorized"}}, status_code=401)
        return await call_next(request)

    monkeypatch.setenv("LOADTEST_TEST_KEY", key)
    with ServerThread(app) as s:
        base = dict(workload=Workload.GENERATE, concurrency=2, requests=6, seed=1, data_dir="/nonexistent")
        anonymous = await run_load(LoadConfig(s.url, **base))
        keyed = await run_load(LoadConfig(s.url, api_key_env="LOADTEST_TEST_KEY", **base))
    assert anonymous.errors == {"401": anonymous.totals["sent"]} and anonymous.totals["succeeded"] == 0
    assert keyed.totals["succeeded"] == keyed.totals["sent"] >= 6 and not keyed.errors
    assert key not in keyed.to_json() and "LOADTEST_TEST_KEY" in keyed.to_json()
    monkeypatch.delenv("LOADTEST_TEST_KEY")
    with pytest.raises(ValueError, match="LOADTEST_TEST_KEY"):
        LoadConfig(s.url, api_key_env="LOADTEST_TEST_KEY", **base)
