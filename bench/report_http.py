"""docs/benchmarks.md, section 1: HTTP (batching modes through Ray Serve, HTTP / in-process, the HTTP path per
data plane and placement), and the summary lines of that section. Pure functions of the saved results, like
bench/report.py, which assembles the document.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from bench.http import COMPLETIONS as COMPLETIONS_MODE  # the mode name of the non-streaming runs
from bench.markdown import commands as _commands
from bench.markdown import failed as _failed
from bench.markdown import DATE_UTC, ratio, section_date as _section_date, t, x

SAME_LOAD = 0.03  # request rates within 3% of each other: both modes carried the same (offered) load


def http_verdict(summary: dict[str, dict[str, Any]], baseline: str = "request") -> dict[str, Any]:
    """Continuous vs a request-level mode in one phase: throughput and p99 ratios, and the claim "continuous
    ahead in throughput at equal or better p99 e2e latency": "holds", "same load" (equal request rates, as
    when an open-loop rate is carried by both: no throughput difference can show; p99 no worse) or "fails"."""
    c, r = summary["continuous"], summary[baseline]
    thr = ratio(c["requests_per_s"], r["requests_per_s"])
    p99_ok = c["e2e_p99_s"] is not None and r["e2e_p99_s"] is not None and c["e2e_p99_s"] <= r["e2e_p99_s"]
    if thr and abs(thr - 1) <= SAME_LOAD:
        claim = "same load" if p99_ok else "fails"
    else:
        claim = "holds" if thr and thr > 1 and p99_ok else "fails"
    return {"baseline": baseline, "throughput_ratio": thr,
            "tokens_ratio": ratio(c["output_tokens_per_s"], r["output_tokens_per_s"]),
            "e2e_p99_ratio": ratio(r["e2e_p99_s"], c["e2e_p99_s"]),
            "ttft_p99_ratio": ratio(r["ttft_p99_s"], c["ttft_p99_s"]), "claim": claim}



# -- 1. HTTP -------------------------------------------------------------------------------------------
HTTP_TARGETS = {"streaming": 0.5, "non-streaming": 0.6}  # HTTP / in-process tokens/s at 32 clients (docs/http_path.md)


TOGETHER_S = 2 * 3600  # sections of one `kvserve bench` run: a full run takes ~35 minutes


def measured_together(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Were two sections measured in one run (the same commit, within TOGETHER_S)? A ratio between them is side
    by side only then: `--sections` measures some again and keeps the others' saved results. Sections without
    a parsable stamp count as together."""
    try:
        ta, tb = (datetime.strptime(x["date_utc"], DATE_UTC) for x in (a, b))
    except (KeyError, TypeError, ValueError):
        return True
    return a.get("git") == b.get("git") and abs((ta - tb).total_seconds()) <= TOGETHER_S


def http_ratios(http: dict[str, Any], inproc: dict[str, Any]) -> dict[str, Any] | None:
    """Output tokens/s through HTTP at the bench's concurrency over the in-process engine's at the same
    concurrency (section 2: same bundle, KV slots, ORT threads and output lengths): streaming /v1/generate and
    non-streaming /v1/completions, both with continuous batching, per load generator: wrk (C, bench/wrk.py)
    and `kvserve loadtest` (Python, in the bench's process). None when the two sections were measured apart."""
    if not measured_together(http, inproc):
        return None
    c = http["plan"]["concurrency"]
    row = next((r for r in inproc["engine"]["summary"] if r["mode"] == "continuous" and r["concurrency"] == c), None)
    s = http["summary"]
    generators = {"wrk": {k: v for k, v in s.get("wrk", {}).items()},
                  "loadtest": {"streaming": s.get("closed", {}).get("continuous"),
                               "non-streaming": s.get("completions", {}).get(COMPLETIONS_MODE)}}
    if not row:
        return None
    base = row["busy_tokens_per_s"]
    out = {name: {k: {"tokens_per_s": v["output_tokens_per_s"], "ratio": v["output_tokens_per_s"] / base,
                      "target": HTTP_TARGETS[k], "ttft_p99_s": v.get("ttft_p99_s"),
                      "load_generator_cpu": v.get("load_generator_cpu")} for k, v in runs.items() if v}
           for name, runs in generators.items()}
    out = {name: runs for name, runs in out.items() if runs}
    return {"concurrency": c, "inprocess_tokens_per_s": base, "generators": out} if out else None


GENERATOR_NAMES = {"wrk": "wrk (C; one of the clients is a Python TTFT probe)",
                   "loadtest": "`kvserve loadtest` (Python, in the bench's process)"}


def http_vs_inprocess(http: dict[str, Any], inproc: dict[str, Any], short: bool = False) -> str | None:
    """How much of the in-process engine's continuous-batching throughput the HTTP path delivers."""
    if not measured_together(http, inproc):
        return (f"HTTP / in-process: not compared, the two sections were measured apart (HTTP {http.get('date_utc')} "
                f"at git {http.get('git')}, in-process {inproc.get('date_utc')} at git {inproc.get('git')}); `kvserve "
                f"bench --sections http inprocess` measures them together.")
    r = http_ratios(http, inproc)
    if r is None:
        return None
    parts = []
    for name, runs in r["generators"].items():
        cpu = [v["load_generator_cpu"] for v in runs.values() if v.get("load_generator_cpu") is not None]
        who = GENERATOR_NAMES[name] + (f", {max(cpu):.2f} of a core" if cpu else "")
        parts.append(f"driven by {who}: " + "; ".join(
            f"{k} {v['tokens_per_s']:.0f} output tokens/s, **{v['ratio']:.2f}** (target {v['target']:g})"
            + (f", p99 TTFT {v['ttft_p99_s'] * 1e3:.0f} ms" if v.get("ttft_p99_s") else "") for k, v in runs.items()))
    where = "" if short else " (section 2, same bundle, slots, ORT threads and output lengths)"
    return (f"HTTP / in-process at {r['concurrency']} clients: the engine in-process reaches "
            f"{r['inprocess_tokens_per_s']:.0f} tokens/s{where}; through HTTP " + "; ".join(parts) + ". Everything "
            f"shares this machine's {inproc.get('cpus') or 'few'} cores, the load generator included.")


def _http_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    out = ["| mode | req/s | output tok/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | ITL p50 | failed (429) | "
           "tokens/step (server) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, m in summary.items():
        rows = m.get("server_tokens_per_step")
        out.append(f"| {mode} | {m['requests_per_s']:.2f} | {m['output_tokens_per_s']:.0f} | {t(m.get('ttft_p50_s'))} | "
                   f"{t(m.get('ttft_p99_s'))} | {t(m.get('e2e_p50_s'))} | {t(m.get('e2e_p99_s'))} | "
                   f"{t(m.get('itl_p50_s'))} | {m['failed']:.0f} ({m['rejected_429']:.0f}) | "
                   f"{'n/a' if rows is None else f'{rows:.1f}'} |")
    return out


def _wrk_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    out = ["| run | output tok/s | answers/s | TTFT p50 (probe) | TTFT p99 (probe) | e2e p50 | e2e p99 | errors | "
           "wrk CPU (cores) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in summary.items():
        out.append(f"| {name} | {m['output_tokens_per_s']:.0f} | {m['requests_per_s']:.2f} | {t(m.get('ttft_p50_s'))} | "
                   f"{t(m.get('ttft_p99_s'))} | {t(m.get('e2e_p50_s'))} | {t(m.get('e2e_p99_s'))} | {m['errors']:.0f} | "
                   f"{m['load_generator_cpu']:.3f} |")
    return out


def _http_reading(name: str, v: dict[str, Any]) -> str:
    word = {"holds": "holds here",
            "same load": "is not tested by this load (both modes carried it: equal throughput), while its latency "
                         "half holds",
            "fails": "does **not** hold here"}[v["claim"]]
    base = "request-level batching" if v["baseline"] == "request" else f"request-level batching ({v['baseline']})"
    return (f"{name}: continuous batching served {x(v['throughput_ratio'])} the requests/s of {base} "
            f"({x(v['tokens_ratio'])} the output tokens/s), with {lower(v['e2e_p99_ratio'])} p99 end-to-end latency "
            f"and {lower(v['ttft_p99_ratio'])} p99 TTFT: the claim (ahead in throughput at equal or better p99) "
            f"{word}.")


def lower(r: float | None) -> str:
    """A baseline / continuous latency ratio in words."""
    if r is None:
        return "n/a"
    return f"{x(r)} lower" if r >= 1 else f"{x(1 / r)} higher"


def http_phases(b: dict[str, Any]) -> list[tuple[str, str]]:
    """(phase, title) of the HTTP section's phases, in order."""
    p = b["plan"]
    out = [("closed", f"Closed loop, {p['concurrency']} concurrent clients")]
    if "completions" in b.get("summary", {}):
        out.append(("completions", f"Closed loop, {p['concurrency']} clients, non-streaming /v1/completions"))
    why = {"request": "a load both batching modes should carry", "continuous": "near the capacity of the server as shipped"}
    for phase, o in b.get("open_phases", {}).items():
        out.append((phase, f"Open loop, Poisson arrivals at {o['rate']:g} req/s ({p['rate_fraction']:g} x the "
                           f"{o['basis']} mode's closed-loop {o['capacity_req_per_s']:.2f} req/s: {why[o['basis']]})"))
    return out


def http_readings(b: dict[str, Any]) -> list[tuple[str, str]]:
    """(phase, sentence) for every phase and request-level variant present."""
    out = []
    for phase, title in http_phases(b):
        s = b["summary"].get(phase, {})
        for base in [m for m in s if m.startswith("request")] if "continuous" in s else []:
            out.append((phase, _http_reading(title.split(" (")[0], http_verdict(s, base))))
    return out


HTTP_NOTE = (
    "TTFT is measured at the client from the stream. In request-level mode a request waits until its batch forms "
    "(up to `max_batch_size` requests or `batch_wait_timeout_s`) and, once the batch runs, streams its tokens; nothing "
    "joins a batch until all its members are done. Tokens/step is the server's own count (`/metrics`: generated tokens / "
    "engine steps over the run), i.e. how many rows an engine step carried on average. Req/s and tok/s count what "
    "completed inside the measured window (after the warm-up, before the last send), so the drain of requests still "
    "in flight at the end does not count against a slow mode. The variant with a longer wait gathers more per batch, "
    "at the cost of that wait.")


def render_http(b: dict[str, Any], inproc: dict[str, Any] | None = None) -> list[str]:
    out = ["## 1. Batching modes through HTTP (Ray Serve)", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    p, s = b["plan"], b["summary"]
    out += [_section_date(b), "",
            f"A local Ray Serve app started by the bench from `deploy/serve_config.yaml` (as written to "
            f"`{b['config_file']}`), with these changes: " + "; ".join(b["config_overrides"]) + ". "
            f"One replica of the generate model; its batching mode is switched live through `user_config` "
            f"(`reconfigure`, same replica process: pids {b['replica_pids']}). The load generator "
            f"(`loadtest.run_load`) runs on the same machine. Streaming `/v1/generate` requests, prompts from the "
            f"test split, `max_tokens` drawn per request in {p['min_tokens']}..{p['max_tokens']} (seeded: every "
            f"mode gets the same requests and sampling seeds, temperature {p['temperature']:g}); {p['warmup_s']:g} s "
            f"warm-up then {p['duration_s']:g} s measured per run, clients give up after {p['timeout_s']:g} s "
            f"(counted as failed); modes alternated, order reversed each round, medians of {p['closed_rounds']} "
            f"(closed loop) and {p['open_rounds']} (open loop) rounds.", ""]
    readings = http_readings(b)
    for phase, title in http_phases(b):
        if phase in s:
            out += [f"### {title}", "", *_http_table(s[phase]), "", *[r + "\n" for ph, r in readings if ph == phase]]
    if "wrk" in s:
        out += ["### Closed loop, driven by wrk", "",
                f"Continuous batching, {p['concurrency']} closed-loop clients: wrk, a load generator written in C "
                "(bench/wrk.py; a few hundredths of a core where the Python load tester takes about 0.4), with the "
                "same request bodies, and one Python client among them that times each streamed request's first "
                "token. Streaming `/v1/generate` and non-streaming `/v1/completions`, alternated, medians of "
                f"{p['closed_rounds']} rounds; tokens from each complete answer's `usage`.", "",
                *_wrk_table(s["wrk"]), ""]
    out += [HTTP_NOTE, ""]
    versus = http_vs_inprocess(b, inproc) if inproc and inproc.get("ok") else None
    return out + ([versus, ""] if versus else []) + _commands(b)


def _subsection(title: str, b: dict[str, Any], intro: str, table: str) -> list[str]:
    """A section 1 subsection: its date, what was run, its table and commands (or why it failed)."""
    out = [f"### {title}", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    return out + [_section_date(b), "", intro, "", table, "", *_commands(b)]


def render_http_path(b: dict[str, Any]) -> list[str]:
    from bench.http_path import markdown

    return _subsection("The HTTP path, per data plane and placement: what each process spends", b,
                       f"{b.get('clients')} closed-loop clients, {b.get('tokens')} sampled tokens per request, "
                       f"{b.get('seconds', 0):g} s measured per run; the generate model, 32 KV slots, 1 ONNX Runtime "
                       "thread. Proxy `python`: Ray's Python proxy actor (Ray's default); `haproxy`: Serve's HAProxy "
                       "data plane (kvserve's). Placement `split`: the model in its own deployment; `colocated`: in "
                       "the ingress replica (`kvserve serve`'s default). CPU: CPU seconds per second of each process "
                       "(1.00 = a core). How a request travels: [docs/http_path.md](http_path.md).",
                       markdown(b) if b.get("ok") else "")


def http_summary(sections: dict[str, dict[str, Any]]) -> list[str]:
    """The summary's lines for section 1."""
    out = []
    h = sections.get("http", {})
    if h.get("ok"):
        out += [f"- HTTP, {sentence[0].lower()}{sentence[1:]}" for _, sentence in http_readings(h)]
    i = sections.get("inprocess", {})
    if h.get("ok") and i.get("ok"):
        versus = http_vs_inprocess(h, i, short=True)
        if versus:
            out.append("- " + versus)
    hp = sections.get("http_path", {})
    if hp.get("ok"):
        by = {(r.get("data_plane"), r.get("placement"), r["run"].split()[0]): r["tokens_per_s"] for r in hp["runs"]}
        first, last = hp["runs"][0], hp["runs"][-1]
        pairs = [(kind, by.get((first.get("data_plane"), first.get("placement"), kind)),
                  by.get((last.get("data_plane"), last.get("placement"), kind))) for kind in ("streaming", "non-streaming")]
        out.append(f"- The HTTP path, Ray's {first.get('data_plane')} proxy with a {first.get('placement')} model vs "
                   f"kvserve's {last.get('data_plane')} data plane with a {last.get('placement')} model: "
                   + "; ".join(f"{k} {a:.0f} -> {b:.0f} tok/s ({b / a:.2f}x)" for k, a, b in pairs if a and b) + ".")
    return out
