"""loadtest/: arrivals, SLO parsing and gating, the report on fixture data, /metrics parsing, and runs
against a real local HTTP server (tests/loadtest_server.py) whose Prometheus counters must agree with the
report's request and token counts."""
from __future__ import annotations

import argparse
import json
import math

import httpx
import numpy as np
import pytest

from loadtest import cli
from loadtest.arrivals import arrival_times
from loadtest.client import RequestRecord
from loadtest.config import SLO, Arrival, LoadConfig, Workload
from loadtest.promscrape import histogram_quantile, parse_metrics, server_delta
from loadtest.report import Report
from loadtest.runner import run_load
from loadtest.slo import evaluate, parse_slos
from loadtest.workloads import FALLBACK_SENTENCES, load_inputs, request_body
from loadtest_server import ServerThread, build_app

# ------------------------------------------------------------------------------------------ arrivals


def _gaps(rate: float, arrival: Arrival, cv: float, seed: int, n: int) -> np.ndarray:
    it = arrival_times(rate, arrival, cv, seed)
    return np.diff([next(it) for _ in range(n + 1)])


@pytest.mark.parametrize("arrival,cv", [(Arrival.POISSON, 1.0), (Arrival.GAMMA, 3.0), (Arrival.GAMMA, 0.5)])
def test_arrivals_have_the_set_rate_and_burstiness(arrival: Arrival, cv: float) -> None:
    gaps = _gaps(50.0, arrival, cv, seed=7, n=50_000)
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_arrivals_are_seeded() -> None:
    a, b, c = (_gaps(10.0, Arrival.GAMMA, 2.0, s, 100) for s in (1, 1, 2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert next(arrival_times(10.0, Arrival.POISSON, 1.0, 0)) == 0.0


def test_request_bodies_are_seeded_per_index(tmp_path) -> None:
    cfg = LoadConfig("http://127.0.0.1:1", workload=Workload.COMPLETIONS, rate=1.0, seed=3, max_tokens=9)
    inputs = load_inputs(cfg.workload, tmp_path / "missing")
    body = request_body(cfg, inputs, 5)
    assert body == request_body(cfg, inputs, 5) != request_body(cfg, inputs, 6)
    assert body["model"] == "generate" and body["stream"] is True and body["max_tokens"] == 9
    assert body["stream_options"] == {"include_usage": True} and body["prompt"] in FALLBACK_SENTENCES


# ------------------------------------------------------------------------------------------ inputs


def test_inputs_come_from_the_test_split_or_say_they_do_not(tmp_path) -> None:
    fallback = load_inputs(Workload.TRANSLATE, tmp_path)
    assert fallback.fallback and "built-in" in fallback.source and "not prepared" in fallback.source
    (tmp_path / "translate").mkdir()
    (tmp_path / "translate" / "test.tsv").write_text("Good morning.\tGuten Morgen.\nThank you.\tDanke.\n")
    real = load_inputs(Workload.TRANSLATE, tmp_path)
    assert not real.fallback and set(real.texts) == {"Good morning.", "Thank you."}
    (tmp_path / "generate").mkdir()
    (tmp_path / "generate" / "test.txt").write_text("".join(f"Line {i} of the play, and more words.\n"
                                                            for i in range(40)))
    gen = load_inputs(Workload.GENERATE, tmp_path)
    assert not gen.fallback and all(t.startswith("Line ") for t in gen.texts) and len(gen.texts) > 10


# ------------------------------------------------------------------------------------------ config, SLOs


def test_parse_slos() -> None:
    slos = parse_slos("ttft_p99=0.5, e2e_p99=2,itl_p50=0.02,tpot_mean=0.05,e2e_p99.9=3")
    assert [s.name for s in slos] == ["ttft_p99", "e2e_p99", "itl_p50", "tpot_mean", "e2e_p99.9"]
    assert slos[0] == SLO("ttft", "p99", 0.5) and slos[4].percentile == 99.9
    assert parse_slos(None) == () == parse_slos("")


@pytest.mark.parametrize("text,match", [
    ("latency_p99=1", "METRIC_STAT=SECONDS"), ("ttft_p99", "METRIC_STAT=SECONDS"),
    ("ttft_p99=fast", "number of seconds"), ("ttft_p99=-1", "> 0"), ("e2e_p99=inf", "finite"),
    ("ttft_p99=1,ttft_p99=2", "twice"), ("ttft_max=1", "METRIC_STAT"),
])
def test_parse_slos_rejects_bad_input(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_slos(text)


@pytest.mark.parametrize("kwargs,match", [
    ({"rate": 1.0, "concurrency": 2}, "exactly one of rate"), ({}, "exactly one of rate"),
    ({"rate": 0.0}, "rate=0.0 must be > 0"), ({"rate": math.nan}, "rate=nan"),
    ({"concurrency": 2, "url": "127.0.0.1:8000"}, "absolute http"),
    ({"rate": 1.0, "workload": "translate", "stream": True}, "translate"),
    ({"rate": 1.0, "burstiness": 2.0}, "needs arrival=gamma"),
    ({"rate": 1.0, "workload": "summarize"}, "workload='summarize' is not one of"),
    ({"rate": 1.0, "workload": "translate", "slos": (SLO("ttft", "p99", 1.0),)}, "needs a streamed"),
    ({"concurrency": 20_000}, "concurrency=20000 exceeds the limit 10000"),
])
def test_config_rejects_bad_input(kwargs: dict, match: str) -> None:
    kwargs.setdefault("url", "http://127.0.0.1:8000")
    with pytest.raises(ValueError, match=match):
        LoadConfig(**kwargs)


def _rec(i: int, start: float, e2e: float, ttft: float | None = None, tokens: int = 4, status: int = 200,
         warmup: bool = False, gap: float = 0.01, error: str | None = None) -> RequestRecord:
    r = RequestRecord(index=i, warmup=warmup, start=start, end=start + e2e, status=status, error=error,
                      output_tokens=tokens, prompt_tokens=3, usage_reported=True)
    if ttft is not None:
        r.ttft = ttft
        r.token_times = [ttft + k * gap for k in range(tokens)]
    if status != 200 and error is None:
        r.error = f"http {status}: busy"
    return r


def _fixture_records() -> list[RequestRecord]:
    """100 measured requests: TTFT 10..109 ms, e2e 0.2..1.19 s; plus warm-up ones that must not count."""
    recs = [_rec(i, 1.0 + i * 0.05, 0.2 + i * 0.01, ttft=0.01 + i * 0.001) for i in range(100)]
    recs += [_rec(100 + i, 0.1 * i, 9.0, ttft=5.0, warmup=True) for i in range(5)]
    recs += [_rec(200, 2.0, 0.001, status=429), _rec(201, 2.0, 0.001, status=429),
             _rec(202, 3.0, 0.5, status=500), _rec(203, 3.0, 0.5, status=None, error="ConnectError: refused")]
    recs[-4].retry_after = 0.5
    return recs


def test_slo_gate_on_fixture_data() -> None:
    recs = _fixture_records()
    ok = {r.slo.name: r for r in evaluate(parse_slos("ttft_p99=0.2,e2e_p50=0.7,itl_p99=0.02"), recs)}
    assert all(r.met for r in ok.values())
    assert ok["ttft_p99"].observed == pytest.approx(np.percentile([0.01 + i * 0.001 for i in range(100)], 99))
    assert ok["ttft_p99"].n == 100  # warm-up (TTFT 5 s) and failed requests left out
    missed = evaluate(parse_slos("ttft_p99=0.1,e2e_p50=0.7"), recs)
    assert [r.met for r in missed] == [False, True]
    none = evaluate(parse_slos("e2e_p50=10"), [r for r in recs if not r.ok])
    assert none[0].observed is None and not none[0].met  # no samples is a miss, not a pass


def _report(slos: str = "") -> Report:
    cfg = LoadConfig("http://127.0.0.1:8000", rate=20.0, warmup_s=1.0, slos=parse_slos(slos))
    return Report.build(config=cfg.to_dict(), records=_fixture_records(), measure_start=1.0,
                        slos=cfg.slos, inputs="fixture", started_at="2025-01-01T00:00:00+00:00")


def test_report_figures_on_fixture_data() -> None:
    rep = _report("e2e_p99=1.0")
    t, th = rep.totals, rep.throughput
    assert (t["sent"], t["warmup"], t["measured"], t["succeeded"], t["rejected_429"]) == (109, 5, 104, 100, 2)
    assert rep.errors == {"429": 2, "500": 1, "ConnectError": 1}
    last_end = 1.0 + 99 * 0.05 + 0.2 + 99 * 0.01
    assert th["window_s"] == pytest.approx(last_end - 1.0)
    assert th["requests_per_s"] == pytest.approx(100 / (last_end - 1.0))
    assert th["output_tokens_per_s"] == pytest.approx(400 / (last_end - 1.0))
    # e2e = 0.2 + 0.01 i <= 1.0 for i <= 80: 81 good requests.
    assert th["good_requests"] == 81 and not rep.slo_met
    assert rep.latency["itl"]["n"] == 300 and rep.latency["itl"]["p50"] == pytest.approx(0.01)
    assert rep.latency["tpot"]["p50"] == pytest.approx(np.median([(0.19 + 0.009 * i) / 3 for i in range(100)]))
    assert rep.retry_after["max"] == 0.5
    assert cli.exit_status(rep) == cli.EXIT_SLO_MISSED and cli.exit_status(_report("e2e_p99=2")) == cli.EXIT_OK
    failed = Report.build(config=rep.config, records=[r for r in _fixture_records() if not r.ok],
                          measure_start=1.0)
    assert cli.exit_status(failed) == cli.EXIT_NOTHING_SUCCEEDED


def test_report_json_markdown_and_plots(tmp_path) -> None:
    rep = _report("ttft_p99=0.05")
    doc = json.loads(rep.to_json())
    assert doc["slo"] == [{"name": "ttft_p99", "threshold_s": 0.05, "observed_s": pytest.approx(0.109, abs=1e-3),
                           "samples": 100, "met": False}]
    assert doc["errors_by_status"]["429"] == 2 and doc["server_metrics_delta"]["available"] is False
    md = rep.to_markdown()
    assert "## SLOs: **MISSED**" in md and "| 429 | 2 |" in md and "n/a: not scraped" in md
    paths = rep.write(tmp_path)
    for key in ("latency_png", "timeline_png"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[key].stat().st_size > 10_000
    assert len(paths["requests"].read_text().splitlines()) == 109
    assert "![Latency distribution](latency.png)" in paths["markdown"].read_text()


# ------------------------------------------------------------------------------------------ /metrics

METRICS_BEFORE = """\
# TYPE kvserve_requests_total counter
kvserve_requests_total{model="m",endpoint="generate",status="200"} 10
# TYPE kvserve_generated_tokens_total counter
kvserve_generated_tokens_total{model="m"} 100
# TYPE kvserve_engine_batch_size histogram
kvserve_engine_batch_size_bucket{le="1.0"} 5
kvserve_engine_batch_size_bucket{le="4.0"} 5
kvserve_engine_batch_size_bucket{le="+Inf"} 5
kvserve_engine_batch_size_count 5
kvserve_engine_batch_size_sum 5
"""
METRICS_AFTER = """\
# TYPE ray_kvserve_requests_total counter
ray_kvserve_requests_total{model="m",endpoint="generate",status="200",WorkerId="a"} 20
ray_kvserve_requests_total{model="m",endpoint="generate",status="429",WorkerId="b"} 3
# TYPE kvserve_generated_tokens_total counter
kvserve_generated_tokens_total{model="m"} 180
# TYPE kvserve_engine_batch_size histogram
kvserve_engine_batch_size_bucket{le="1.0"} 5
kvserve_engine_batch_size_bucket{le="4.0"} 15
kvserve_engine_batch_size_bucket{le="+Inf"} 15
kvserve_engine_batch_size_count 15
kvserve_engine_batch_size_sum 35
# TYPE kvserve_rejections_total counter
kvserve_rejections_total{model="m",reason="queue_full"} 3
# TYPE other_metric gauge
other_metric 1
"""


def test_server_delta_reads_metrics_tolerantly() -> None:
    d = server_delta(parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER))
    assert d["available"] and d["requests"] == 13 and d["requests_by_status"] == {"200": 10, "429": 3}
    assert d["generated_tokens"] == 80 and d["prompt_tokens"] is None  # missing metric: n/a, no crash
    assert d["batch_size"]["count"] == 10 and d["batch_size"]["mean"] == 3.0
    assert d["batch_size"]["p50"] == pytest.approx(2.5)  # all 10 new steps in (1, 4]: halfway
    assert d["queue_wait_seconds"] is None and d["rejections_by_reason"] == {"queue_full": 3}
    assert server_delta(parse_metrics(""), parse_metrics(METRICS_AFTER))["requests"] == 23
    assert histogram_quantile(0.99, {1.0: 0, 2.0: 0, math.inf: 4}) == 2.0


async def test_a_fresh_server_without_series_is_not_a_scrape_error() -> None:
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from loadtest.promscrape import scrape

    app = FastAPI()
    declared_only = "# HELP kvserve_requests_total x\n# TYPE kvserve_requests_total counter\n"
    app.get("/metrics")(lambda: PlainTextResponse(declared_only))
    with ServerThread(app) as s:
        async with httpx.AsyncClient() as c:
            fresh, missing = await scrape(c, s.url + "/metrics"), await scrape(c, s.url + "/nowhere")
    assert fresh.error is None and fresh.samples == {}
    assert missing.error == f"GET {s.url}/nowhere answered 404"
    assert server_delta(fresh, parse_metrics(METRICS_AFTER))["requests"] == 23
    assert "no kvserve_* series" in server_delta(fresh, fresh)["error"]


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
    assert post["num_failures"] == 0 and post["num_requests"] > 10
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
