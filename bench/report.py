"""docs/benchmarks.md from the JSON of `kvserve bench`'s sections: tables, ratios, a reading of the numbers.

`render(sections, machine, plan, invocation, elapsed_s)` is a pure function of the saved results (tested on
fixture data), so the doc can be rendered again without measuring (`kvserve bench --render-only`). The
sentences that interpret the figures are computed from them (`http_verdict`, ...): they say what the
numbers say, whichever way they fall. Measures nothing: owns the wording and layout only.
"""
from __future__ import annotations

from typing import Any

from bench.http import COMPLETIONS as COMPLETIONS_MODE  # the mode name of the non-streaming runs


def t(s: float | None) -> str:
    """A duration for humans: ms below 1 s, else s."""
    if s is None:
        return "n/a"
    if s < 0.01:
        return f"{s * 1e3:.2f} ms"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    return f"{s:.2f} s" if s < 10 else f"{s:.1f} s"


def x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def gflops(f: float) -> str:
    return f"{f / 1e9:.1f} GFLOP/s"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


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


def _failed(body: dict[str, Any]) -> list[str]:
    return [f"**This section failed** ({body.get('date_utc')}): `{body.get('error')}`", ""]


def _commands(body: dict[str, Any]) -> list[str]:
    if not body.get("commands"):
        return []
    return ["Commands run by this section:", "", "```", *body["commands"], "```", ""]


def _section_date(body: dict[str, Any]) -> str:
    return f"_Measured {body.get('date_utc')}, {body.get('elapsed_s', 0) / 60:.1f} min._"


# -- 1. HTTP -------------------------------------------------------------------------------------------
HTTP_TARGETS = {"streaming": 0.5, "non-streaming": 0.6}  # HTTP / in-process tokens/s at 32 clients (docs/http_path.md)


def http_ratios(http: dict[str, Any], inproc: dict[str, Any]) -> dict[str, Any] | None:
    """Output tokens/s through HTTP at the bench's concurrency over the in-process engine's at the same
    concurrency (section 2: same bundle, KV slots, ORT threads and output lengths): streaming /v1/generate and
    non-streaming /v1/completions, both with continuous batching."""
    c = http["plan"]["concurrency"]
    row = next((r for r in inproc["engine"]["summary"] if r["mode"] == "continuous" and r["concurrency"] == c), None)
    runs = {"streaming": http["summary"].get("closed", {}).get("continuous"),
            "non-streaming": http["summary"].get("completions", {}).get(COMPLETIONS_MODE)}
    if not row or not any(runs.values()):
        return None
    return {"concurrency": c, "inprocess_tokens_per_s": row["busy_tokens_per_s"],
            **{k: {"tokens_per_s": v["output_tokens_per_s"], "ratio": v["output_tokens_per_s"] / row["busy_tokens_per_s"],
                   "target": HTTP_TARGETS[k]} for k, v in runs.items() if v}}


def http_vs_inprocess(http: dict[str, Any], inproc: dict[str, Any]) -> str | None:
    """How much of the in-process engine's continuous-batching throughput the HTTP path delivers."""
    r = http_ratios(http, inproc)
    if r is None:
        return None
    parts = [f"{k} {v['tokens_per_s']:.0f} output tokens/s, **{v['ratio']:.2f}** of it (target {v['target']:g})"
             for k, v in r.items() if isinstance(v, dict)]
    return (f"HTTP / in-process at {r['concurrency']} clients: the engine in-process reaches "
            f"{r['inprocess_tokens_per_s']:.0f} tokens/s (section 2, same bundle, slots, ORT threads and output "
            f"lengths); through HTTP, " + "; ".join(parts) + ". Everything shares this machine's "
            f"{inproc.get('cpus') or 'few'} cores, the load generator included.")


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
    out += [HTTP_NOTE, ""]
    versus = http_vs_inprocess(b, inproc) if inproc and inproc.get("ok") else None
    return out + ([versus, ""] if versus else []) + _commands(b)


def render_http_path(b: dict[str, Any]) -> list[str]:
    from bench.http_path import markdown

    out = ["### The HTTP path, per data plane and placement: what each process spends", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    return out + [_section_date(b), "",
                  f"{b['clients']} closed-loop clients, {b['tokens']} sampled tokens per request, {b['seconds']:g} s "
                  "measured per run; the generate model, 32 KV slots, 1 ONNX Runtime thread. Proxy `python`: Ray's "
                  "Python proxy actor (Ray's default); `haproxy`: Serve's HAProxy data plane (kvserve's). Placement "
                  "`split`: the model in its own deployment; `colocated`: in the ingress replica (`kvserve serve`'s "
                  "default). CPU: CPU seconds per second of each process (1.00 = a core). How a request travels: "
                  "[docs/http_path.md](http_path.md).", "", markdown(b), "", *_commands(b)]


def render_agreement(b: dict[str, Any]) -> list[str]:
    from bench.agreement import markdown

    out = ["### Load generators agree: `kvserve loadtest` vs Locust", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    return out + [_section_date(b), "",
                  f"The same server (placement `{b['placement']}`), {b['clients']} closed-loop clients each, "
                  f"non-streaming /v1/completions of {b['tokens']} sampled tokens, {b['seconds']:g} s per run, the "
                  "two tools in turns (order alternated). Locust runs headless in its own process with "
                  "loadtest/locustfile.py, which counts the output tokens of every answer.", "", markdown(b), "",
                  *_commands(b)]


# -- 2. In-process -------------------------------------------------------------------------------------
def render_inprocess(b: dict[str, Any]) -> list[str]:
    out = ["## 2. In-process: ONNX Runtime vs PyTorch eager, and the engine's batching modes", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    from bench.decode_step import markdown as step_markdown  # torch-free to import
    from bench.engine import markdown as engine_markdown

    out += [_section_date(b), "", "### Decode step: ONNX Runtime fp32 / int8 vs PyTorch eager with KV cache", "",
            "One decode step (one new token per row) on a prefilled KV cache, the backends alternated call by call "
            "(bench/decode_step.py). Speedup = PyTorch time / backend time.", ""]
    for task in ("generate", "translate"):
        if task in b["step"]:
            out += [step_markdown(b["step"][task]), ""]
    out += ["### Engine in-process: continuous vs request-level vs no batching", "",
            "The same engine and workload, no HTTP (bench/engine.py, closed loop, modes alternated).", "",
            engine_markdown(b["engine"]), ""]
    if "engine_all_cores" in b:
        out += [f"The same benchmark with every core of this machine as ONNX Runtime threads "
                f"({b['engine_all_cores'].get('threads')}), the same for every mode:", "",
                engine_markdown(b["engine_all_cores"]), ""]
    return out + _commands(b)


def engine_reading(doc: dict[str, Any]) -> str | None:
    """continuous vs the other modes at the highest concurrency of an engine benchmark."""
    rows = doc["summary"]
    c = max(r["concurrency"] for r in rows)
    by = {r["mode"]: r for r in rows if r["concurrency"] == c}
    cont, req, none = by.get("continuous"), by.get("request"), by.get("none")
    if not cont or not req or not none:
        return None
    return (f"{c} clients, {doc.get('threads') or 'default'} ORT thread(s): continuous batching "
            f"{cont['busy_tokens_per_s']:.0f} tokens/s, {x(req['continuous_speedup'])} request-level and "
            f"{x(none['continuous_speedup'])} no batching; p99 TTFT {1e3 * cont['ttft_p99_s']:.1f} vs "
            f"{1e3 * req['ttft_p99_s']:.1f} ms (request-level)")


# -- 3. Translation vs CTranslate2 -------------------------------------------------------------------------
def translate_reading(b: dict[str, Any]) -> str:
    parts = []
    for r in b["rows"]:
        q = r["throughput_ratio"]
        parts.append(f"at {r['concurrency']}: ours {x(q)} CTranslate2's sentences/s ("
                     f"{'faster' if q >= 1 else 'slower'}; CTranslate2 is {x(1 / q)} ours)")
    same = ", ".join(f"{100 * r['identical']:.0f}%" for r in b["rows"])
    return ("Throughput " + "; ".join(parts) + f". Identical outputs (token for token): {same}.")


def render_translate(b: dict[str, Any]) -> list[str]:
    out = ["## 3. Translation: our engine vs CTranslate2 on the same weights", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    out += [_section_date(b), "",
            f"Bundle `{b['bundle']}` and its checkpoint `{b['checkpoint']}` converted to CTranslate2 "
            f"(`{b['ct2_model']}`; the converter's own check: {b['conversion'].get('greedy_identical')} identical "
            f"to PyTorch). {b['source']}. Greedy, at most {b['max_new_tokens']} output tokens, "
            f"{b['threads']} intra-op thread(s) each. Ours: concurrency C = C clients in a closed loop on the "
            f"continuous-batching engine, in-process. CTranslate2: `Translator.translate_batch` on consecutive "
            f"chunks of C sentences (batch = C); each sentence's latency is its chunk's. Systems alternated, "
            f"medians of {b['rounds']} round(s).", "",
            "| C = batch | ours sent/s | CT2 sent/s | ours / CT2 | ours tok/s | CT2 tok/s | ours p50 | CT2 p50 | "
            "ours p99 | CT2 p99 | identical outputs |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in b["rows"]:
        o, c = r["ours"], r["ct2"]
        out.append(f"| {r['concurrency']} | {o['sentences_per_s']:.1f} | {c['sentences_per_s']:.1f} | "
                   f"{x(r['throughput_ratio'])} | {o['tokens_per_s']:.0f} | {c['tokens_per_s']:.0f} | "
                   f"{t(o['latency_p50_s'])} | {t(c['latency_p50_s'])} | {t(o['latency_p99_s'])} | "
                   f"{t(c['latency_p99_s'])} | {100 * r['identical']:.1f}% |")
    out += ["", translate_reading(b)]
    slower = [r["concurrency"] for r in b["rows"] if r["throughput_ratio"] < 1]
    if slower:
        out.append(f"Where CTranslate2 is ahead (concurrency {', '.join(map(str, slower))}), the gap is overhead per "
                   "step, not arithmetic (the same weights, and the outputs compare above): CTranslate2 runs a whole "
                   "batch's greedy loop inside one C++ call, while our engine returns to Python between steps to "
                   "schedule, choose tokens and stream each token to its request. That is the price of continuous "
                   "batching and streaming, which `translate_batch` does not offer (its batch is gathered first, then "
                   "run to its end: its latency column is the whole batch's).")
    if b["rows"][0].get("chrf_ours") is not None:
        out.append(f"chrF against the test-split references: ours {b['rows'][0]['chrf_ours']}, "
                   f"CTranslate2 {b['rows'][0]['chrf_ct2']}.")
    out.append("Our outputs are " + ("the same" if b.get("ours_batch_invariant") else "**not** all the same")
               + " at every concurrency (batching does not change a greedy translation).")
    return out + [""] + _commands(b)


# -- 4. Share of peak ----------------------------------------------------------------------------------------
def render_compute(b: dict[str, Any], inproc: dict[str, Any] | None) -> list[str]:
    out = ["## 4. Share of the machine's peak matmul FLOP/s", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    from bench.compute import engine_best, flops_per_token

    peak, cfg = b["peak"], b["model_config"]
    out += [_section_date(b), "",
            f"Peak: the fastest of {peak['reps']} float32 {peak['n']}x{peak['n']} matmuls (2n^3 FLOPs each).", "",
            "| measurement | FLOP/s |", "| --- | ---: |"]
    out += [f"| {k} | {gflops(v)} |" for k, v in peak["flops_per_s"].items()]
    per_tok = flops_per_token(cfg, b["sweep_context"])
    out += ["", f"Model `{b['bundle']}`: d_model {cfg['d_model']}, {cfg['n_decoder_layers']} decoder layers, d_ff "
                f"{cfg['d_ff']}, vocabulary {cfg['vocab_size']}. FLOPs per generated token = 2 x the weights each "
                f"token multiplies + attention over the cached length (4 x d_model per position and layer): "
                f"{per_tok / 1e6:.2f} MFLOP at {b['sweep_context']} cached tokens.", "",
            f"The runtime's decode step alone ({b['threads']} thread(s), {b['sweep_context']} cached tokens per row; "
            "no scheduling, sampling or HTTP):", "",
            "| batch | step | tokens/s | FLOP/s | share of machine peak | share of 1-thread peak |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in b["sweep"]:
        out.append(f"| {r['batch']} | {t(r['step_ms'] / 1e3)} | {r['tokens_per_s']:.0f} | {gflops(r['flops_per_s'])} | "
                   f"{100 * r['flops_per_s'] / peak['peak_flops_per_s']:.1f}% | "
                   f"{100 * r['flops_per_s'] / peak['peak_1_thread_flops_per_s']:.1f}% |")
    out.append("")
    if b.get("scaling"):
        from bench.engine import step_scaling_markdown

        out += ["The same step by cached length, every row at that length (a block of steps per row count, as the "
                "engine runs them): the gain per row of a batch over one row falls as contexts grow, because "
                "attention streams every row's cached keys and values from memory, while a lone request's stay "
                "in the CPU's caches. This, not the engine, bounds continuous batching's gain over no batching.", "",
                step_scaling_markdown(b["scaling"]), ""]
    if any(r["flops_per_s"] > peak["peak_flops_per_s"] for r in b["sweep"]):
        out += ["**Noise warning:** a decode step measured above the matmul peak: the machine was busy while the "
                "peak was measured; re-run this section on a quiet machine (`kvserve bench --sections compute`).", ""]
    if inproc and inproc.get("ok"):
        e = engine_best(inproc["engine"], cfg)
        share, share1 = e["flops_per_s"] / peak["peak_flops_per_s"], e["flops_per_s"] / peak["peak_1_thread_flops_per_s"]
        out += [f"**The engine at its best batch** (continuous batching, {e['concurrency']} clients, "
                f"{e['rows_per_step']:.1f} rows per step on average, section 2): {e['tokens_per_s']:.0f} generated "
                f"tokens/s x {e['flops_per_token'] / 1e6:.2f} MFLOP per token (prefill included) = "
                f"{gflops(e['flops_per_s'])}, **{100 * share:.1f}% of the machine's measured peak** "
                f"({gflops(peak['peak_flops_per_s'])})" + (
                    f"; {100 * share1:.1f}% of one thread's ({gflops(peak['peak_1_thread_flops_per_s'])}), the "
                    f"engine's thread count" if share1 != share else
                    ": one thread is the measured peak here (more threads did not raise the GEMM rate)") + ".", ""]
        best = max(b["sweep"], key=lambda r: r["flops_per_s"])
        out += [f"Reading: the decode step alone reaches {100 * best['flops_per_s'] / peak['peak_flops_per_s']:.1f}% "
                f"of the machine's peak at batch {best['batch']} "
                f"({100 * best['flops_per_s'] / peak['peak_1_thread_flops_per_s']:.1f}% of one thread's, the thread "
                f"count it ran with: every backend here gets the serve config's 1 thread per replica, the other "
                f"cores being for more replicas and the HTTP path); the engine's figure is lower by what happens between and around "
                f"steps (prefill of joining requests, scheduling, sampling in Python). A model this small "
                f"(d_model {cfg['d_model']}) multiplies small matrices ({cfg['d_model']}x{cfg['d_ff']} at most, "
                f"besides the {cfg['d_model']}x{cfg['vocab_size']} output projection), so per-call overheads and "
                f"attention's memory traffic weigh more than the multiply-adds: a large square GEMM is a ceiling "
                f"no decoder step of this size approaches.", ""]
    return out + _commands(b)


# -- the document ----------------------------------------------------------------------------------------------
def _machine(m: dict[str, Any]) -> list[str]:
    v = m["versions"]
    return ["## Machine", "", "| | |", "| --- | --- |",
            f"| CPU | {m['cpu']} ({', '.join(m['cpu_flags'])}) |", f"| logical CPUs | {m['logical_cpus']} |",
            f"| RAM | {m['ram_gib']} GiB |", f"| OS | {m['os']}, Python {m['python']} |",
            "| versions | " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + " |",
            f"| code | git {m['git']} |", ""]


def _summary(sections: dict[str, dict[str, Any]]) -> list[str]:
    out = ["## Summary", ""]
    h = sections.get("http", {})
    if h.get("ok"):
        out += [f"- HTTP, {sentence[0].lower()}{sentence[1:]}" for _, sentence in http_readings(h)]
    i = sections.get("inprocess", {})
    if h.get("ok") and i.get("ok"):
        versus = http_vs_inprocess(h, i)
        if versus:
            out.append("- " + versus.split(" (section 2")[0] + "; through HTTP, " + versus.split("; through HTTP, ")[1])
    hp = sections.get("http_path", {})
    if hp.get("ok"):
        by = {(r.get("data_plane"), r.get("placement"), r["run"].split()[0]): r["tokens_per_s"] for r in hp["runs"]}
        first, last = hp["runs"][0], hp["runs"][-1]
        pairs = [(kind, by.get((first.get("data_plane"), first.get("placement"), kind)),
                  by.get((last.get("data_plane"), last.get("placement"), kind))) for kind in ("streaming", "non-streaming")]
        out.append(f"- The HTTP path, Ray's {first.get('data_plane')} proxy with a {first.get('placement')} model vs "
                   f"kvserve's {last.get('data_plane')} data plane with a {last.get('placement')} model: "
                   + "; ".join(f"{k} {a:.0f} -> {b:.0f} tok/s ({b / a:.2f}x)" for k, a, b in pairs if a and b) + ".")
    ag = sections.get("agreement", {})
    if ag.get("ok"):
        out.append(f"- Load generators: Locust / `kvserve loadtest` output tok/s = {ag['locust_over_kvserve']:.3f}.")
    if i.get("ok"):
        for key in ("engine", "engine_all_cores"):
            reading = key in i and engine_reading(i[key])
            if reading:
                out.append(f"- Engine in-process, {reading}.")
        for task, r in i["step"].items():
            sp = ", ".join(f"batch {row['batch']}: fp32 {x(row['speedup_vs_pytorch']['ort_fp32'])}"
                           + (f", int8 {x(row['speedup_vs_pytorch']['ort_int8'])}" if "ort_int8" in row["speedup_vs_pytorch"]
                              else "") for row in r["rows"])
            out.append(f"- Decode step vs PyTorch eager ({task}): {sp}.")
    tr = sections.get("translate", {})
    if tr.get("ok"):
        out.append("- Translation vs CTranslate2: " + translate_reading(tr))
    c = sections.get("compute", {})
    if c.get("ok") and i.get("ok"):
        from bench.compute import engine_best

        e = engine_best(i["engine"], c["model_config"])
        out.append(f"- The engine's best batch reaches {gflops(e['flops_per_s'])}, "
                   f"{100 * e['flops_per_s'] / c['peak']['peak_flops_per_s']:.1f}% of the measured peak matmul FLOP/s.")
    failed = [n for n, s in sections.items() if not s.get("ok")]
    if failed:
        out.append(f"- **Failed sections: {', '.join(failed)}** (see below).")
    return out + [""]


def render(sections: dict[str, dict[str, Any]], machine: dict[str, Any], plan: dict[str, Any], invocation: str,
           elapsed_s: float | None) -> str:
    took = f", {elapsed_s / 60:.1f} min" if elapsed_s is not None else ""
    out = ["# Benchmarks", "",
           f"Generated by `{invocation}` (`make bench`) on {machine['date_utc']}{took}. Do not edit: run it again. "
           "Every comparison is measured side by side in one run on the machine below (A and B alternated, "
           "medians, ratios): absolute figures belong to this machine, the ratios are the result.", "",
           *_summary(sections), *_machine(machine)]
    if "http" in sections:
        out += render_http(sections["http"], sections.get("inprocess"))
    if "http_path" in sections:
        out += render_http_path(sections["http_path"])
    if "agreement" in sections:
        out += render_agreement(sections["agreement"])
    if "inprocess" in sections:
        out += render_inprocess(sections["inprocess"])
    if "translate" in sections:
        out += render_translate(sections["translate"])
    if "compute" in sections:
        out += render_compute(sections["compute"], sections.get("inprocess"))
    from bench.gpu_check.report import BENCHMARKS_SECTION  # measured apart: `make gpu-check` on a GPU machine

    out += [*BENCHMARKS_SECTION, "## Plan", "", "The settings of this run (bench/cli.py `BenchPlan`):", "", "```",
            *(f"{k}: {v}" for k, v in plan.items()), "```", ""]
    return "\n".join(out)
