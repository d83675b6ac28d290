"""docs/benchmarks.md from the JSON of `kvserve bench`'s sections: tables, ratios, a reading of the numbers.

`render(sections, machine, plan, invocation, elapsed_s)` is a pure function of the saved results (tested on
fixture data), so the doc can be rendered again without measuring (`kvserve bench --render-only`). The
sentences that interpret the figures are computed from them (`http_verdict`, ...): they say what the
numbers say, whichever way they fall. Measures nothing: owns the wording and layout only.
"""
from __future__ import annotations

from typing import Any

from bench.markdown import commands as _commands
from bench.markdown import failed as _failed
from bench.markdown import gflops, section_date as _section_date, t, x
from bench.report_http import http_summary, render_http, render_http_path


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
            "The same engine and workload, no HTTP (bench/engine.py, closed loop, modes alternated; "
            + _sampling(b["engine"]) + ").", "",
            engine_markdown(b["engine"]), ""]
    if "engine_all_cores" in b:
        out += [f"The same benchmark with every core of this machine as ONNX Runtime threads "
                f"({b['engine_all_cores'].get('threads')}), the same for every mode:", "",
                engine_markdown(b["engine_all_cores"]), ""]
    return out + _commands(b)


def _sampling(doc: dict[str, Any]) -> str:
    t = doc.get("temperature") or 0.0
    tokens = f"tokens sampled at temperature {t:g} with a seed per request" if t > 0 else "greedy tokens"
    return f"prompts: {doc.get('prompts', 'random ids, 4-24 tokens')}; {tokens}"


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


def translate_pairs(b: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(precision, result) of every pair measured: fp32 (the section's top level), then its variants."""
    return [(b.get("precision", "fp32"), b), *b.get("variants", {}).items()]


def _translate_table(b: dict[str, Any], precision: str) -> list[str]:
    out = [f"### {precision} vs {precision}", "",
           f"Ours: bundle `{b['bundle']}`. CTranslate2: `{b['ct2_model']}` (compute type "
           f"{b.get('ct2_compute_type', 'float32')}; the converter's own check: "
           f"{b['conversion'].get('greedy_identical')} identical to PyTorch).", "",
           "| C = batch | ours sent/s | CT2 sent/s | ours / CT2 | ours tok/s | CT2 tok/s | ours p50 | CT2 p50 | "
           "ours p99 | CT2 p99 | ours rows/step | ours ms/sentence: ORT decoder + encoder + rest | CT2 ms/sentence | "
           "identical outputs |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in b["rows"]:
        o, c = r["ours"], r["ct2"]
        out.append(f"| {r['concurrency']} | {o['sentences_per_s']:.1f} | {c['sentences_per_s']:.1f} | "
                   f"{x(r['throughput_ratio'])} | {o['tokens_per_s']:.0f} | {c['tokens_per_s']:.0f} | "
                   f"{t(o['latency_p50_s'])} | {t(c['latency_p50_s'])} | {t(o['latency_p99_s'])} | "
                   f"{t(c['latency_p99_s'])} | {_rows(o)} | {_split(o)} | {1e3 / c['sentences_per_s']:.2f} | "
                   f"{100 * r['identical']:.1f}% |")
    out += ["", translate_reading(b)]
    if b["rows"][0].get("chrf_ours") is not None:
        out.append(f"chrF against the test-split references: ours {b['rows'][0]['chrf_ours']}, "
                   f"CTranslate2 {b['rows'][0]['chrf_ct2']}.")
    out.append("Our outputs are " + ("the same" if b.get("ours_batch_invariant") else "**not** all the same")
               + " at every concurrency (batching does not change a greedy translation).")
    return out + [""]


def _rows(o: dict[str, Any]) -> str:
    return f"{o['rows_per_step']:.1f}" if o.get("rows_per_step") is not None else "-"


def _split(o: dict[str, Any]) -> str:
    if o.get("ms_decoder") is None:
        return "-"
    return f"{o['ms_decoder']:.2f} + {o['ms_encoder']:.2f} + {o['ms_other']:.2f}"


def render_translate(b: dict[str, Any]) -> list[str]:
    out = ["## 3. Translation: our engine vs CTranslate2 on the same weights", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    out += [_section_date(b), "",
            f"Each pair runs the same weights: the bundle's checkpoint `{b['checkpoint']}` converted to CTranslate2, "
            f"fp32 as it is and int8 with CTranslate2's own int8 quantization against our int8 bundle (8-bit weights, "
            f"per-row activation scales: batch-invariant). {b['source']}. Greedy, at most {b['max_new_tokens']} "
            f"output tokens, {b['threads']} intra-op thread(s) each. Ours: concurrency C = C clients in a closed loop "
            f"on the continuous-batching engine, in-process. CTranslate2: `Translator.translate_batch` on "
            f"consecutive chunks of C sentences (batch = C); each sentence's latency is its chunk's. Ours rows/step: "
            f"the engine's mean rows per step (decoding rows and joiners' first rows). Ours ms/sentence: the run's "
            f"wall time per sentence split into ONNX Runtime's decoder calls, its encoder calls and the rest (the "
            f"Python around them: scheduling, inputs, argmax, events), a clock around every ORT call "
            f"(bench/breakdown.py); CT2 ms/sentence: its wall time per sentence. Systems "
            f"alternated, medians of {b['rounds']} round(s).", ""]
    for precision, r in translate_pairs(b):
        out += _translate_table(r, precision)
    out += _where_ct2_is_ahead(b)
    return out + _commands(b)


def _where_ct2_is_ahead(b: dict[str, Any]) -> list[str]:
    """Each row where CTranslate2 is faster, with our ORT time alone against CTranslate2's whole time."""
    parts = []
    for precision, p in translate_pairs(b):
        for r in p["rows"]:
            o, ct2_ms = r["ours"], 1e3 / r["ct2"]["sentences_per_s"]
            if r["throughput_ratio"] >= 1 or o.get("ms_decoder") is None:
                continue
            ort, rest = o["ms_decoder"] + o["ms_encoder"], o["ms_other"]
            where = ("already more than CTranslate2's whole time: the gap is in the kernels" if ort >= ct2_ms else
                     f"{ct2_ms - ort:.2f} ms under it, the rest ({rest:.2f} ms) more than that")
            parts.append(f"{precision} at {r['concurrency']}: ours {ort:.2f} ms per sentence inside ONNX Runtime, "
                         f"CTranslate2 {ct2_ms:.2f} ms for everything ({where})")
    if not parts:
        return []
    return ["Where CTranslate2 is ahead: " + "; ".join(parts) + ". `translate_batch` offers neither continuous "
            "batching nor streaming: its batch is gathered first, then run to its end inside one C++ call (its "
            "latency column is the whole batch's), and it encodes the whole batch at once, where a sentence joins "
            "our running batch alone or with a few others.", ""]


# -- 5. Step-time breakdown --------------------------------------------------------------------------------------
def render_breakdown(b: dict[str, Any]) -> list[str]:
    out = ["## 5. Where an engine step's time goes", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    from bench.breakdown import table

    out += [_section_date(b), "",
            f"Each model on one continuous-batching engine, in-process, C clients in a closed loop ({b['threads']} ORT "
            f"thread(s), outputs of {b['min_new']}-{b['max_new']} tokens, greedy), timed from outside like a profiler: "
            "a clock around every ONNX Runtime call per graph and around the runner's step (bench/breakdown.py), "
            "read while all C clients are in flight (until the last request is handed out: the run's tail, with "
            "fewer and fewer clients, is not C clients). "
            "`runner python` = the runner outside ORT (inputs, bindings, argmax, slot copies); `engine loop` = "
            "the rest of the wall time (scheduling, events, finishing requests, thread hand-offs); the fastest of "
            f"{b['rounds']} round(s), each in a fresh process.", "", table(b), ""]
    return out + _commands(b)


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
    out += _noise_warning(b, inproc)
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


# -- 6. Autoscaling ---------------------------------------------------------------------------------------------
def render_autoscale(b: dict[str, Any]) -> list[str]:
    out = ["## 6. Autoscaling under a load ramp", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    from bench.autoscale import markdown, ramp_reading

    a = b["autoscaling_config"]
    out += [_section_date(b), "",
            f"The generate model alone in a deployment of its own, autoscaled on its engines' load (Serve's "
            f"`autoscaling_config` with `{a['policy']['policy_function']}`, target "
            f"{100 * a['policy']['policy_kwargs']['target_utilization']:.0f}% of the KV slots, "
            f"{a['min_replicas']}-{a['max_replicas']} replicas, upscale delay {a['upscale_delay_s']:g} s, downscale "
            f"delay {a['downscale_delay_s']:g} s), {b['slots']} KV slots per replica; closed-loop clients (half "
            "streaming `/v1/generate`, half `/v1/completions`) in phases, Serve's RUNNING replicas sampled every "
            "0.5 s. On a machine with few cores more replicas add no compute: this shows the mechanism, not a "
            "speed-up.", "", f"![clients and replicas over time]({b['plot']})", "", markdown(b["phases"]),
            f"The ramp: {ramp_reading(b)}.", ""]
    return out + _commands(b)


def render_cache(b: dict[str, Any]) -> list[str]:
    out = ["## 7. The response cache at 50% repeats", ""]
    if not b.get("ok"):
        return out + _failed(b) + _commands(b)
    from bench.cache import markdown

    out += [_section_date(b), "",
            f"The production Serve config with the translator's response cache on (`response_cache_entries: "
            f"{b['entries']}`); wrk, a C load generator, sends `/v1/translate` requests from {b['connections']} "
            f"closed-loop connections over {b['inputs']}, half of them repeating an earlier request; each round runs "
            f"the load with `Cache-Control: no-cache` on every request (bypassed) and without (cached), alternated, "
            f"{b['seconds']:g} s each, every run on keys of its own; then every request a hit. A hit skips the engine "
            "but still pays the HTTP path ([docs/api.md](api.md#response-cache)).", "", *markdown(b)]
    return out + _commands(b)


def _noise_warning(b: dict[str, Any], inproc: dict[str, Any] | None) -> list[str]:
    """A warning when a decode step or the engine measured above the matmul peak (a peak measured while busy)."""
    from bench.compute import engine_best

    engines = [engine_best(inproc[k], b["model_config"]) for k in ("engine", "engine_all_cores")
               if inproc and inproc.get("ok") and k in inproc]
    if not any(r["flops_per_s"] > b["peak"]["peak_flops_per_s"] for r in [*b["sweep"], *engines]):
        return []
    return ["**Noise warning:** a decode step or the engine measured above the matmul peak: the machine was busy "
            "while the peak was measured; re-run this section on a quiet machine (`kvserve bench --sections "
            "compute`).", ""]


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
    out += http_summary(sections)
    i = sections.get("inprocess", {})
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
        for precision, r in translate_pairs(tr):
            out.append(f"- Translation vs CTranslate2, {precision} vs {precision}: " + translate_reading(r))
    c = sections.get("compute", {})
    if c.get("ok") and i.get("ok"):
        from bench.compute import engine_best

        e, peak = engine_best(i["engine"], c["model_config"]), c["peak"]
        line = (f"- The engine's best batch reaches {gflops(e['flops_per_s'])} at {i['engine'].get('threads') or 1} ORT "
                f"thread(s): {100 * e['flops_per_s'] / peak['peak_1_thread_flops_per_s']:.1f}% of the measured "
                f"1-thread matmul peak, {100 * e['flops_per_s'] / peak['peak_flops_per_s']:.1f}% of the machine's "
                f"(every core)")
        if "engine_all_cores" in i:
            a = engine_best(i["engine_all_cores"], c["model_config"])
            line += (f"; with every core as ORT threads {gflops(a['flops_per_s'])}, "
                     f"{100 * a['flops_per_s'] / peak['peak_flops_per_s']:.1f}% of the machine's")
        out.append(line + ".")
    a = sections.get("autoscale", {})
    if a.get("ok"):
        from bench.autoscale import ramp_reading

        out.append(f"- Autoscaling on the engines' KV-slot load, {ramp_reading(a)}.")
    ca = sections.get("cache", {})
    if ca.get("ok"):
        out.append("- The response cache at 50% repeated requests: " + ", ".join(
            f"{name} {r['gain']:.2f}x requests/s" for name, r in ca["decodes"].items()) + " (vs bypassed).")
    failed = [n for n, s in sections.items() if not s.get("ok")]
    if failed:
        out.append(f"- **Failed sections: {', '.join(failed)}** (see below).")
    return out + [""]


def render(sections: dict[str, dict[str, Any]], machine: dict[str, Any], plan: dict[str, Any], invocation: str,
           elapsed_s: float | None, cpu_kinds: list[str] | None = None) -> str:
    """`cpu_kinds`: the section of every CPU kind's headline figures (bench/cpu_kinds.py), shown after the machine."""
    took = f", {elapsed_s / 60:.1f} min" if elapsed_s is not None else ""
    from bench.glance import glance
    from bench.readme import markers

    begin, end = markers("bench")  # README.md shows these lines (bench/readme.py)
    out = ["# Benchmarks", "",
           f"Generated by `{invocation}` (`make bench`) on {machine['date_utc']}{took}. Do not edit: run it again. "
           "Every comparison is measured side by side in one run on the machine below (A and B alternated, "
           "medians, ratios): absolute figures belong to this machine, the ratios are the result.", "",
           "## At a glance", "", begin, *glance(sections, machine, invocation), end, "",
           *_summary(sections), *_machine(machine)]
    out += cpu_kinds or []
    if "http" in sections:
        out += render_http(sections["http"], sections.get("inprocess"))
    if "http_path" in sections:
        out += render_http_path(sections["http_path"])
    if "inprocess" in sections:
        out += render_inprocess(sections["inprocess"])
    if "translate" in sections:
        out += render_translate(sections["translate"])
    if "compute" in sections:
        out += render_compute(sections["compute"], sections.get("inprocess"))
    if "breakdown" in sections:
        out += render_breakdown(sections["breakdown"])
    if "autoscale" in sections:
        out += render_autoscale(sections["autoscale"])
    if "cache" in sections:
        out += render_cache(sections["cache"])
    from bench.gpu_check.report import benchmarks_section  # measured apart: `make gpu-check` on a GPU machine

    out += [*benchmarks_section(), "## Plan", "", "The settings of this run (bench/cli.py `BenchPlan`):", "", "```",
            *(f"{k}: {v}" for k, v in plan.items()), "```", ""]
    return "\n".join(out)
