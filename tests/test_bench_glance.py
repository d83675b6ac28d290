"""The front page's figures (bench/glance.py) and the autoscale section of the report, on the fixture results of
tests/test_bench.py: every figure of the glance is the report's own, the header names the run, code spans stay
whole; the ramp's table, plot and summary line."""
from __future__ import annotations

from bench.report import render
from test_bench import MACHINE, SMALL_LM
from test_bench import _sections as _bench_sections


def _sections() -> dict:
    """tests/test_bench.py's results and an autoscale section."""
    return {**_bench_sections(), "autoscale": _autoscale()}


def _autoscale() -> dict:
    """The autoscale section's JSON: 2 -> 32 -> 2 clients, 1 -> 3 -> 1 replicas, one request failed."""
    from bench.autoscale import AUTOSCALING

    row = lambda c, n, failed, lo, hi: {"clients": c, "seconds": 30, "requests": n, "failed": failed,
                                        "replicas_min": lo, "replicas_max": hi, "ttft_p50_s": 0.03, "ttft_p99_s": 0.1}
    samples = [{"t": t, "clients": c, "replicas": r, "done": 0} for t, c, r in
               ((0.0, 2, 1), (40.0, 32, 2), (60.0, 32, 3), (100.0, 2, 3), (150.0, 2, 1))]
    return {"ok": True, "autoscaling_config": AUTOSCALING, "slots": 8, "plot": "img/autoscaling.png",
            "phases": [row(2, 300, 0, 1, 1), row(32, 2000, 1, 1, 3), row(2, 1000, 0, 1, 3)],
            "phase_bounds_s": [[2, 0.0, 30.0], [32, 30.0, 90.0], [2, 90.0, 160.0]], "samples": samples,
            "commands": ["python -m bench.autoscale"], "date_utc": "d", "elapsed_s": 200}


def test_glance_shows_the_reports_own_figures_with_its_date_and_machine():
    """The lines README.md copies: each figure is one the report prints (its summary or tables) for the same
    results, under a header naming the command, the date, the machine and the commit."""
    from bench.compute import engine_best
    from bench.glance import glance
    from bench.readme import block

    s = _sections()
    doc = render(s, MACHINE, {"threads": 2}, "kvserve bench --artifacts artifacts", 600.0)
    lines = glance(s, MACHINE, "kvserve bench --artifacts artifacts")
    text = " ".join(line.strip() for line in lines)
    assert block(doc, "bench") == "\n".join(lines)  # the report carries them between the markers
    assert all(len(line) <= 115 for line in lines)
    assert text.startswith("`make bench` (`kvserve bench --artifacts artifacts`) on 2026-01-01, 2 logical CPUs "
                           "(Test CPU), git abc123;")
    assert ("continuous batching 2,000 tokens/s at 32 clients (2.00x request-level, 5.00x no batching at 32)" in text
            and "| 32 | continuous | 2000 |" in doc)
    c, i = s["compute"], s["inprocess"]
    one = 100 * engine_best(i["engine"], SMALL_LM)["flops_per_s"] / c["peak"]["peak_1_thread_flops_per_s"]
    every = 100 * engine_best(i["engine_all_cores"], SMALL_LM)["flops_per_s"] / c["peak"]["peak_flops_per_s"]
    assert f"{one:.1f}% of one core's matmul peak, {every:.1f}% of the machine's at 2 threads." in text
    assert f"{one:.1f}% of the measured 1-thread matmul peak" in doc and f", {every:.1f}% of the machine's" in doc
    # HTTP / in-process per load generator (the summary's **0.55** ...), and the closed-loop verdict
    assert ("Through HTTP, 32 closed-loop clients: 0.55 (streaming) / 0.75 (non-streaming) of in-process tokens/s "
            "driven by wrk (C), 0.34 / 0.65 by the Python load tester") in text
    assert "**0.55** (target 0.5)" in doc and "**0.65** (target 0.6)" in doc
    assert "continuous batching 2.00x the requests/s of request-level at 2.00x lower p99 latency" in text
    assert "Decode step vs PyTorch eager with a KV cache, generate, batch 16: fp32 2.00x, int8 4.00x." in text
    assert ("sentences/s at 8 concurrent: fp32 0.50x (95% identical outputs), int8 1.25x (90%).") in text
    assert "| 8 | 10.0 | 20.0 | 0.50x |" in doc
    assert "KV-slot load, 2 -> 32 -> 2 clients: 1 -> 3 -> 1 replicas, 1 of 3,300 requests failed." in text
    # a section that did not run leaves its line out; a failed one is named
    del s["autoscale"]
    s["translate"] = {"ok": False, "error": "boom"}
    text = " ".join(glance(s, MACHINE, "b"))
    assert "ramp" not in text and "CTranslate2" not in text and "**Failed sections: translate**" in text


def test_glance_never_breaks_a_code_span_across_lines():
    from bench.glance import glance

    lines = glance({}, {**MACHINE, "cpu": "A very long CPU name " * 3}, "kvserve bench --artifacts a --out b " * 2)
    assert all(line.count("`") % 2 == 0 for line in lines), lines


def test_autoscale_section_shows_the_ramp_and_its_plot(tmp_path):
    from bench.autoscale import plot

    doc = render(_sections(), MACHINE, {}, "kvserve bench", None)
    assert "## 6. Autoscaling under a load ramp" in doc and "## 8. GPU" in doc
    assert "![clients and replicas over time](img/autoscaling.png)" in doc
    assert "| 32 | 30 | 2000 | 1 | 1-3 | 0.03 s | 0.1 s |" in doc
    assert "- Autoscaling on the engines' KV-slot load, 2 -> 32 -> 2 clients: 1 -> 3 -> 1 replicas" in doc
    plot(_autoscale(), tmp_path / "img" / "autoscaling.png")
    assert (tmp_path / "img" / "autoscaling.png").stat().st_size > 10_000


def test_http_over_in_process_is_given_only_for_sections_measured_together():
    """`--sections inprocess` alone keeps the saved HTTP results of another day: their ratio would compare two
    machines' states, so the doc and the CPU-kinds ledger leave it out and say why."""
    from bench.cpu_kinds import figures
    from bench.report_http import http_ratios

    s = _bench_sections()
    s["http"].update(git="abc1234", date_utc="2026-01-01 10:00 UTC")
    s["inprocess"].update(git="abc1234", date_utc="2026-01-01 10:30 UTC")
    assert http_ratios(s["http"], s["inprocess"]) is not None
    assert "**0.55** (target 0.5)" in render(s, MACHINE, {"threads": 2}, "kvserve bench", 600.0)
    s["inprocess"].update(git="def5678", date_utc="2026-01-02 09:00 UTC")
    assert http_ratios(s["http"], s["inprocess"]) is None and "http" not in figures(s)
    doc = render(s, MACHINE, {"threads": 2}, "kvserve bench", 600.0)
    assert "**0.55**" not in doc and doc.count("HTTP / in-process: not compared, the two sections were measured apart "
                                               "(HTTP 2026-01-01 10:00 UTC at git abc1234, in-process 2026-01-02 09:00 "
                                               "UTC at git def5678)") >= 1
    s["inprocess"].update(git="abc1234", date_utc="2026-01-01 13:00 UTC")  # the same commit, hours later
    assert http_ratios(s["http"], s["inprocess"]) is None
