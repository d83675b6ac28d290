"""loadtest/ without a load run: arrivals, request inputs and bodies, SLO parsing and gating, the report on
fixture data, /metrics parsing. Runs against a real local HTTP server are in tests/test_loadtest_live.py."""
from __future__ import annotations

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
from loadtest.slo import evaluate, parse_slos
from loadtest.workloads import FALLBACK_SENTENCES, load_inputs, read_test_prompts, read_test_sources, request_body
from loadtest_server import ServerThread

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


def test_inputs_read_the_files_model_data_writes_as_model_data_reads_them(tmp_path) -> None:
    """loadtest/ reads the prepared test split itself (it imports nothing of model/): same texts, same prompts."""
    from model import data

    (tmp_path / "translate").mkdir()
    (tmp_path / "translate" / "test.tsv").write_text("Good morning.\tGuten Morgen.\n\nA\ttab\tin it.\tx\n"
                                                     "Thank you.\tDanke.\n", encoding="utf-8")
    assert read_test_sources(tmp_path) == [en for en, _ in data.load_pairs(tmp_path, "test")] == [
        "Good morning.", "A", "Thank you."]
    (tmp_path / "generate").mkdir()
    text = "".join(f"{'  ' if i % 3 else ''}Line {i}: the play goes on, and on, and on.\n" for i in range(700))
    (tmp_path / "generate" / "test.txt").write_text(text, encoding="utf-8")
    for n, chars in ((512, 120), (7, 30), (1, 5)):
        got = read_test_prompts(tmp_path, n, chars)
        assert got == data.lm_prompts(data.load_text(tmp_path, "test"), n, chars) and 0 < len(got) <= n
    with pytest.raises(FileNotFoundError, match="kvserve data --task generate"):
        read_test_prompts(tmp_path / "missing", 3, 10)


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


def test_repeat_fraction_repeats_that_share_of_earlier_requests_exactly():
    from loadtest.config import LoadConfig
    from loadtest.workloads import Inputs, request_body

    inputs = Inputs(tuple(f"sentence {i}" for i in range(1000)), "test", False)
    config = LoadConfig(url="http://127.0.0.1:1", workload="translate", concurrency=1, repeat_fraction=0.5, seed=3)
    bodies = [request_body(config, inputs, i) for i in range(600)]
    seen, repeats = set(), 0
    for b in bodies:
        repeats += b["text"] in seen
        seen.add(b["text"])
    assert 0.45 <= repeats / len(bodies) <= 0.55
    assert [request_body(config, inputs, i) for i in (5, 77, 599)] == [bodies[5], bodies[77], bodies[599]]
    plain = LoadConfig(url="http://127.0.0.1:1", workload="translate", concurrency=1, seed=3)
    assert request_body(plain, inputs, 7) == request_body(plain, inputs, 7)
    with pytest.raises(ValueError, match="repeat_fraction"):
        LoadConfig(url="http://127.0.0.1:1", concurrency=1, repeat_fraction=1.0)
