"""The headline figures of `kvserve bench` per CPU kind: a ledger kept beside the report (docs/cpu_kinds.json) and
its table in docs/benchmarks.md, so a run on one machine does not erase what another kind of CPU measured.

A CPU kind is the CPU's model name and the instruction sets that pick different kernels (AVX2; AVX-512; AVX-512
with VNNI and BF16; AMX). Each `kvserve bench` run updates its own kind's entry with the sections it measured
(translation vs CTranslate2, HTTP over in-process, the engine's share of the matmul peak), each part with its date
and commit; the other kinds' entries and this kind's unmeasured parts stay as they were.

`kind`, `figures`, `update` and `render` are pure functions of their arguments (tested on made-up results); `load`,
`save` and `record` (what `kvserve bench` calls) read and write the ledger. Measures nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.markdown import x
from bench.report_http import http_ratios

LEDGER = "cpu_kinds.json"
# how the table names the flags machines record (model/provenance.py CPU_FLAGS, fma left out: every AVX2 CPU has it)
FLAG_NAMES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_vnni": "VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512_bf16": "BF16",
    "amx_tile": "AMX",
}


def isa(flags: list[str]) -> str:
    """The instruction-set class of a CPU: the one that picks its matmul kernels."""
    f = set(flags)
    if "amx_tile" in f:
        return "AMX"
    if "avx512f" in f:
        return "AVX-512" + (" VNNI" if "avx512_vnni" in f else "") + (" BF16" if "avx512_bf16" in f else "")
    return "AVX2" if "avx2" in f else "no AVX2"


def kind(machine: dict[str, Any]) -> str:
    return f"{machine['cpu']}, {isa(machine.get('cpu_flags', []))}"


def _stamp(section: dict[str, Any]) -> dict[str, Any]:
    return {"date_utc": section.get("date_utc"), "git": section.get("git")}


def figures(sections: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The ledger's parts measured by these sections (a part needs every section it reads to have succeeded)."""
    from bench.compute import engine_best
    from bench.report import translate_pairs

    out: dict[str, dict[str, Any]] = {}
    t = sections.get("translate", {})
    if t.get("ok"):
        out["translate"] = {
            **_stamp(t),
            **{
                precision: {
                    "ratio": {str(r["concurrency"]): round(r["throughput_ratio"], 2) for r in b["rows"]},
                    "identical": round(min(r["identical"] for r in b["rows"]), 3),
                }
                for precision, b in translate_pairs(t)
            },
        }
    h, i, c = sections.get("http", {}), sections.get("inprocess", {}), sections.get("compute", {})
    r = http_ratios(h, i) if h.get("ok") and i.get("ok") else None
    if r:
        out["http"] = {
            **_stamp(h),
            "concurrency": r["concurrency"],
            **{g: {k: round(v["ratio"], 2) for k, v in runs.items()} for g, runs in r["generators"].items()},
        }
    if c.get("ok") and i.get("ok"):
        best = engine_best(i["engine"], c["model_config"])
        share = best["flops_per_s"] / c["peak"]["peak_1_thread_flops_per_s"]
        out["matmul_peak"] = {**_stamp(i), "one_core": round(share, 3)}
    return out


def update(ledger: dict[str, Any], machine: dict[str, Any], measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ledger with this machine's kind given the parts measured now; nothing else changes."""
    if not measured:
        return ledger
    key = kind(machine)
    entry = dict(ledger.get(key, {}))
    entry.update(
        {
            "cpu": machine["cpu"],
            "cpu_flags": [f for f in FLAG_NAMES if f in machine.get("cpu_flags", [])],
            "logical_cpus": machine.get("logical_cpus"),
            **measured,
        }
    )
    return {**ledger, key: entry}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def save(path: Path, ledger: dict[str, Any]) -> None:
    path.write_text(json.dumps(dict(sorted(ledger.items())), indent=1) + "\n")


def record(path: Path, machine: dict[str, Any], sections: dict[str, dict[str, Any]]) -> list[str]:
    """Update the ledger at `path` with the sections measured now on this machine; its section of the report."""
    ledger = update(load(path), machine, figures(sections))
    path.parent.mkdir(parents=True, exist_ok=True)
    save(path, ledger)
    return render(ledger)


def _when(part: dict[str, Any]) -> str:
    return f"{(part.get('date_utc') or '?')[:10]}, {part.get('git') or '?'}"


def _translate(part: dict[str, Any] | None, precision: str) -> str:
    if not part or precision not in part:
        return "-"
    p = part[precision]
    return " / ".join(x(p["ratio"][c]) for c in sorted(p["ratio"], key=int)) + f" ({100 * p['identical']:.0f}%)"


def render(ledger: dict[str, Any]) -> list[str]:
    """The section of docs/benchmarks.md: one row per CPU kind."""
    out = [
        "## CPU kinds",
        "",
        f"The headline figures of every CPU kind `kvserve bench` has run on (docs/{LEDGER}: each run rewrites "
        "its own kind's row, part by part). Translation: our engine's sentences/s over CTranslate2's on the same "
        "weights at 1 / 8 / 32 concurrent clients (the least share of identical outputs); HTTP: output tokens/s "
        "through `kvserve serve`'s production config over the in-process engine's at 32 clients, wrk, streaming / "
        "non-streaming; matmul peak: the in-process engine's best FLOP/s over one core's measured peak.",
        "",
    ]
    if not ledger:
        return out + ["No run recorded.", ""]
    out += [
        "| CPU (logical CPUs; flags) | fp32 vs CTranslate2 fp32 | int8 vs CTranslate2 int8 | HTTP / in-process | "
        "matmul peak | measured (date, commit) |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    for key, e in sorted(ledger.items()):
        flags = ", ".join(FLAG_NAMES[f] for f in e.get("cpu_flags", []) if f in FLAG_NAMES)
        t, h, m = e.get("translate"), e.get("http"), e.get("matmul_peak")
        wrk = h.get("wrk", {}) if h else {}
        http = " / ".join(f"{wrk[k]:.2f}" for k in ("streaming", "non-streaming") if k in wrk) or "-"
        parts = [(name, _when(part)) for name, part in (("translation", t), ("HTTP", h), ("peak", m)) if part]
        whens = {w for _, w in parts}
        when = whens.pop() if len(whens) == 1 else "; ".join(f"{name} {w}" for name, w in parts)
        peak = f"{100 * m['one_core']:.1f}%" if m else "-"
        out.append(
            f"| {key} ({e.get('logical_cpus')}; {flags}) | {_translate(t, 'fp32')} | {_translate(t, 'int8')} | "
            f"{http} | {peak} | {when} |"
        )
    return out + [""]
