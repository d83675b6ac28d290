"""The front page's figures: a few lines computed from `kvserve bench`'s results, shown at the top of
docs/benchmarks.md between `<!-- bench:begin -->` and `<!-- bench:end -->` and copied from there into README.md
(bench/readme.py). One source: README.md shows no benchmark figure that the report does not print.

`glance(sections, machine, invocation)` is a pure function of the saved results, like bench/report.py: a header
naming the command, the date, the machine and the commit, then one bullet per measured area (the engine, HTTP,
the decode step, translation vs CTranslate2, autoscaling), each left out when its section did not run.
Measures nothing; the wording of the full report is bench/report.py's.
"""
from __future__ import annotations

import textwrap
from typing import Any

from bench.markdown import x
from bench.report_http import http_ratios, http_verdict, lower

WIDTH = 115  # README.md's line length


def _engine(sections: dict[str, dict[str, Any]]) -> str | None:
    i, c = sections.get("inprocess", {}), sections.get("compute", {})
    if not i.get("ok"):
        return None
    by = {(r["concurrency"], r["mode"]): r for r in i["engine"]["summary"]}
    top = sorted(c for c, mode in by if mode == "continuous")[-2:]
    c_max = top[-1]
    if (c_max, "request") not in by or (c_max, "none") not in by:
        return None
    tokens = " / ".join(f"{by[(n, 'continuous')]['busy_tokens_per_s']:,.0f}" for n in top)
    threads = i["engine"].get("threads") or 1
    line = (f"In-process engine, {threads} ORT thread{'s' if threads > 1 else ''}: continuous batching {tokens} tokens/s "
            f"at {' / '.join(map(str, top))} clients ({x(by[(c_max, 'request')]['continuous_speedup'])} request-level, "
            f"{x(by[(c_max, 'none')]['continuous_speedup'])} no batching at {c_max})")
    if c.get("ok"):
        from bench.compute import engine_best

        peak = c["peak"]
        best = engine_best(i["engine"], c["model_config"])
        line += f"; {100 * best['flops_per_s'] / peak['peak_1_thread_flops_per_s']:.1f}% of one core's matmul peak"
        if "engine_all_cores" in i:
            every = engine_best(i["engine_all_cores"], c["model_config"])
            share = 100 * every["flops_per_s"] / peak["peak_flops_per_s"]
            line += (f", {share:.1f}% of the machine's at {i['engine_all_cores'].get('threads')} threads"
                     + (" (above it: the peak was measured on a busy machine)" if share > 100 else ""))
    return line + "."


def _http(sections: dict[str, dict[str, Any]]) -> str | None:
    h, i, hp = sections.get("http", {}), sections.get("inprocess", {}), sections.get("http_path", {})
    parts = []
    r = http_ratios(h, i) if h.get("ok") and i.get("ok") else None
    if r:
        names = {"wrk": "driven by wrk (C)", "loadtest": "by the Python load tester"}
        kept = []
        for n, (g, runs) in enumerate(r["generators"].items()):  # the first names the runs, the others follow it
            figures = " / ".join(f"{v['ratio']:.2f}" + (f" ({k})" if n == 0 else "") for k, v in runs.items())
            kept.append(figures + (" of in-process tokens/s" if n == 0 else "") + f" {names[g]}")
        parts.append(", ".join(kept))
    if h.get("ok") and "request" in h["summary"].get("closed", {}):
        v = http_verdict(h["summary"]["closed"], "request")
        parts.append(f"continuous batching {x(v['throughput_ratio'])} the requests/s of request-level at "
                     f"{lower(v['e2e_p99_ratio'])} p99 latency")
    if hp.get("ok"):
        by = {(p.get("data_plane"), p.get("placement"), p["run"].split()[0]): p["tokens_per_s"] for p in hp["runs"]}
        first, last = hp["runs"][0], hp["runs"][-1]
        gains = [by.get((last.get("data_plane"), last.get("placement"), k), 0) /
                 by[(first.get("data_plane"), first.get("placement"), k)]
                 for k in ("streaming", "non-streaming") if by.get((first.get("data_plane"), first.get("placement"), k))]
        name = {"haproxy": "HAProxy", "python": "Ray's proxy"}  # Serve's data planes as users know them
        parts.append(f"{name.get(last.get('data_plane'), last.get('data_plane'))} + {last.get('placement')} model vs "
                     f"{name.get(first.get('data_plane'), first.get('data_plane'))} + {first.get('placement')} model: "
                     + " / ".join(map(x, gains)) + " the tokens/s")
    if not parts:
        return None
    clients = h.get("plan", {}).get("concurrency") if h.get("ok") else None
    return f"Through HTTP{f', {clients} closed-loop clients' if clients else ''}: " + "; ".join(parts) + "."


def _decode_step(sections: dict[str, dict[str, Any]]) -> str | None:
    i = sections.get("inprocess", {})
    if not i.get("ok") or not i.get("step"):
        return None
    rows = [row for r in i["step"].values() for row in r["rows"]]
    batches = sorted({row["batch"] for row in rows})
    spans = []
    for backend, name in (("ort_fp32", "fp32"), ("ort_int8", "int8")):
        got = [row["speedup_vs_pytorch"][backend] for row in rows if backend in row["speedup_vs_pytorch"]]
        if got:
            spans.append(f"{name} {min(got):.2f}x" if min(got) == max(got) else f"{name} {min(got):.2f}-{max(got):.2f}x")
    models = "both models" if len(i["step"]) == 2 else " and ".join(i["step"])
    return (f"Decode step vs PyTorch eager with a KV cache, {models}, batch {' and '.join(map(str, batches))}: "
            + ", ".join(spans) + ".")


def _translate(sections: dict[str, dict[str, Any]]) -> str | None:
    tr = sections.get("translate", {})
    if not tr.get("ok"):
        return None
    rows = tr["rows"]
    pairs = [f"{precision} " + " / ".join(x(r["throughput_ratio"]) for r in p["rows"]) + f" ({_identical(p['rows'])}"
             + (" identical outputs)" if n == 0 else ")")
             for n, (precision, p) in enumerate([(tr.get("precision", "fp32"), tr), *tr.get("variants", {}).items()])]
    return (f"Translation vs CTranslate2 on the same weights, sentences/s at "
            f"{' / '.join(str(r['concurrency']) for r in rows)} concurrent: " + ", ".join(pairs) + ".")


def _identical(rows: list[dict[str, Any]]) -> str:
    shares = sorted({round(100 * r["identical"]) for r in rows})
    return f"{shares[0]}%" if len(shares) == 1 else f"{shares[0]}-{shares[-1]}%"


def _autoscale(sections: dict[str, dict[str, Any]]) -> str | None:
    a = sections.get("autoscale", {})
    if not a.get("ok"):
        return None
    from bench.autoscale import ramp_reading

    return f"Autoscaling on the engines' KV-slot load, {ramp_reading(a)}."


def glance(sections: dict[str, dict[str, Any]], machine: dict[str, Any], invocation: str) -> list[str]:
    """The header and bullets, wrapped to README.md's width."""
    m = machine
    head = (f"`make bench` (`{invocation}`) on {m['date_utc']}, {m['logical_cpus']} logical CPUs ({m['cpu']}), git "
            f"{m['git']}; every comparison alternates its sides in one run:")
    bullets = [b for b in (f(sections) for f in (_engine, _http, _decode_step, _translate, _autoscale)) if b]
    failed = [n for n, s in sections.items() if not s.get("ok")]
    if failed:
        bullets.append(f"**Failed sections: {', '.join(failed)}** (docs/benchmarks.md).")
    out = _wrap(head) + [""]
    for b in bullets:
        out += _wrap(b, "- ", "  ")
    return out


def _wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    """Lines of at most WIDTH characters, never broken inside a `code span` (a span split over two lines is no
    longer one to a reader of the raw file, nor to tests/test_readme.py's parser)."""
    spans = text.split("`")
    kept = "`".join(part.replace(" ", NBSP) if n % 2 else part for n, part in enumerate(spans))
    return [line.replace(NBSP, " ") for line in textwrap.wrap(kept, WIDTH, initial_indent=first,
                                                              subsequent_indent=rest, break_on_hyphens=False,
                                                              break_long_words=False)]


NBSP = "\x00"  # stands for a space inside a code span while wrapping
