"""The gpu check's report: one JSON document and its markdown, and the exit status they imply.

`document(...)` gathers every step (status, reason, figures, named checks) with the device, date, commit and
elapsed time; `checks` lists every named check (parity/..., invariance/..., kv_on_device/..., gpu_tests,
server/...) with its outcome; `missing` the prerequisites that were not there. `markdown(doc)` is a pure
function of that document (tested on fixture data). `exit_status(doc)`: 0 every step ran and passed, 1 a
check failed, 2 nothing failed but a step was skipped or raised, or a prerequisite is missing. Measures nothing.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.gpu_check.plan import Status, Step

EXIT_OK, EXIT_CHECK_FAILED, EXIT_INCOMPLETE = 0, 1, 2
ROOT = Path(__file__).resolve().parents[2]
# The run docs/benchmarks.md's GPU section shows: a `make gpu-check` on a GPU machine, its OUT/gpu_check.json
# copied here and rendered by `kvserve bench --render-only` (bench/report.py).
PUBLISHED = ROOT / "docs" / "gpu" / "gpu_check.json"
HOW = ["```", "make gpu-check OUT=artifacts/gpu-check          # PY=python3 by default: any python with the deps",
       "python -m bench.gpu_check --device cuda --out artifacts/gpu-check", "```", ""]


def benchmarks_section(published: Path = PUBLISHED) -> list[str]:
    """docs/benchmarks.md's section 8: the published run's report under the section's heading, or, before any
    run on a GPU, what the check does and how to run it."""
    head = ["## 8. GPU (CUDA EP)", ""]
    if not published.is_file():
        return [*head, "The CUDA path (CUDA EP, fp16 bundles, the KV cache bound in device memory, the engine and a "
                "Ray Serve replica with `num_gpus: 1`) has not run on a GPU: no figures yet. One prepared command "
                "checks and measures all of it on a machine with an NVIDIA GPU and `onnxruntime-gpu` installed "
                "(offline; its plan is sized for 8 minutes on 16 cores) and writes `gpu_check.json` and "
                "`gpu_check.md` to `OUT`. `make gpu-check-cpu` runs the same steps on the CPU EP.", "", *HOW]
    doc = json.loads(published.read_text())
    env = doc["steps"].get("env", {}).get("data", {})
    gpus = ", ".join(env.get("gpu", {}).get("nvidia_smi") or []) or "unknown GPU"
    ort = env.get("onnxruntime", {}).get("version", "?")
    intro = (f"Measured by `make gpu-check` on {gpus} with {env.get('cpus', '?')} CPU cores, onnxruntime-gpu {ort} "
             f"(the record: docs/gpu/gpu_check.json; {doc['date_utc']}, {doc['commit']}). The engine figures are "
             "the generate model's, each batching mode alternated in one run; `make gpu-check-cpu` runs the same "
             "steps on the CPU EP.")
    body = markdown(doc).splitlines()[2:]  # the report without its title, its headings under this section's
    body = ["#" + line if line.startswith("## ") else line for line in body]
    return [*head, intro, "", *HOW, *body, ""]


def commit() -> str | None:
    try:
        # "-dirty" when tracked files differ from the commit: the run measured a tree no commit holds
        r = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                           cwd=ROOT, timeout=10)
    except OSError:
        return None
    return r.stdout.strip() or None


def exit_status(doc: dict[str, Any]) -> int:
    statuses = [s["status"] for s in doc["steps"].values()]
    if Status.FAILED.value in statuses or not all(doc["checks"].values()):
        return EXIT_CHECK_FAILED
    complete = all(s == Status.OK.value for s in statuses) and not doc["missing"]
    return EXIT_OK if complete else EXIT_INCOMPLETE


def document(device: str, plan: dict[str, Any], steps: list[Step], started: float, argv: list[str]) -> dict[str, Any]:
    env = next((s for s in steps if s.name == "env"), None)
    doc = {"device": device, "command": " ".join(argv), "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": commit(), "elapsed_s": round(time.time() - started, 1), "plan": plan,
           "missing": env.data.get("missing", []) if env else [],
           "checks": {k: v for s in steps for k, v in s.checks.items()},
           "steps": {s.name: s.to_dict() for s in steps}}
    doc["exit_status"] = exit_status(doc)
    doc["passed"] = doc["exit_status"] == EXIT_OK
    return doc


def _env_lines(env: dict[str, Any]) -> list[str]:
    d = env.get("data", {})
    ort = d.get("onnxruntime", {})
    gpu = d.get("gpu", {})
    lines = [f"- python {d.get('python')} ({d.get('executable')}), {d.get('cpus')} CPUs",
             f"- onnxruntime {ort.get('version')} ({ort.get('file')}): providers {ort.get('providers')}"]
    if gpu:
        lines.append(f"- GPU: {gpu.get('nvidia_smi')}; driver supports CUDA {gpu.get('driver_cuda')}")
    if "cuda_libraries" in d:
        found = {k: v for k, v in d["cuda_libraries"].items()}
        lines.append("- CUDA libraries: " + ", ".join(f"{k} {'found' if v else '**missing**'}" for k, v in found.items()))
    if ort.get("cuda_session"):
        lines.append(f"- CUDA session: {ort['cuda_session']}")
    if ort.get("note"):
        lines.append(f"- note: {ort['note']}")
    lines.append("- modules: " + ", ".join(f"{k} {v or '**missing**'}" for k, v in d.get("modules", {}).items()))
    return lines


def _parity_table(data: dict[str, Any]) -> list[str]:
    rows = [(k, v) for k, v in data.items() if k.startswith("parity/")]
    if not rows:
        return []
    out = ["| bundle | EP | graph | logits max-abs | tolerance | greedy identical |",
           "| --- | --- | --- | ---: | ---: | ---: |"]
    for k, v in rows:
        out.append(f"| {k[7:]} | {v['provider']} | {v['graph']} | {v['logits_max_abs']:.3g} | {v['tolerance']:g} | "
                   f"{v['rows_greedy_identical']}/{v['rows']} |")
    gates = [(k, v) for k, v in data.items() if k.startswith("quality_gate/")]
    if gates:
        out += ["", "| bundle | quality gate set | metric | fp32 PyTorch | variant on the device | delta | allowed loss |",
                "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        out += [f"| {k[13:]} | {g['set']} | {g['metric']} | {g['reference']} | {g['variant']} | {g['delta']:+} | "
                f"{g['max_loss']} |" for k, g in gates]
    return out + [""]


def _kv_table(data: dict[str, Any]) -> list[str]:
    rows = [(k, v) for k, v in data.items() if k.startswith("kv_on_device/")]
    if not rows:
        return []
    out = ["| bundle | EP | graph | nodes/step | Memcpy bytes/step | cache tensors crossing | addresses kept |",
           "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for k, v in rows:
        out.append(f"| {k[13:]} | {v['provider']} | {v['graph']} | {v['nodes_per_step']} | "
                   f"{v['memcpy_bytes_per_step']} | {v['violation_count']} | {v['addresses_unchanged']} |")
    return out + [""]


def _engine_lines(data: dict[str, Any]) -> list[str]:
    out = []
    for k, v in data.items():
        if k.startswith("throughput/"):
            out += [f"Throughput, {k[11:]}:", "", v["markdown"], ""]
        if k.startswith("breakdown/"):
            out += [f"Where a continuous-batching step's time goes, {k[10:]} (ms per step, share of the step):", "",
                    v["markdown"], ""]
    inv = [(k, v) for k, v in data.items() if k.startswith("invariance/")]
    if inv:
        out += ["| batch invariance | requests | identical to alone | tokens |", "| --- | ---: | ---: | ---: |"]
        out += [f"| {k[11:]} | {v['requests']} | {v['identical']} | {v['tokens']} |" for k, v in inv] + [""]
    return out


def _server_lines(data: dict[str, Any]) -> list[str]:
    runs = [(k, v) for k, v in data.items() if k.startswith("server/loadtest/")]
    out = [f"Replica EP: {data.get('replica_provider')}; started in {data.get('startup_s')} s; config "
           f"`{data.get('config')}`.", ""] if "config" in data else []
    if runs:
        out += ["| clients | req/s | output tok/s | TTFT p50 | TTFT p99 | e2e p99 | succeeded / measured |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        ms = lambda s: "n/a" if s is None else f"{1e3 * s:.0f} ms"  # noqa: E731
        out += [f"| {k[16:]} | {v.get('requests_per_s', 0):.2f} | {v.get('output_tokens_per_s', 0):.0f} | "
                f"{ms(v.get('ttft_p50_s'))} | {ms(v.get('ttft_p99_s'))} | {ms(v.get('e2e_p99_s'))} | "
                f"{v.get('succeeded', 0)} / {v.get('measured', 0)} |" for k, v in runs] + [""]
    return out


def markdown(doc: dict[str, Any]) -> str:
    verdict = {EXIT_OK: "every step ran and every check passed", EXIT_CHECK_FAILED: "**a check failed**",
               EXIT_INCOMPLETE: "no check failed, but **some steps did not run**"}[doc["exit_status"]]
    out = [f"# GPU check ({doc['device']})", "",
           f"`{doc['command']}` at {doc['commit']} on {doc['date_utc']}, {doc['elapsed_s'] / 60:.1f} min: {verdict}.", ""]
    if doc["missing"]:
        out += ["Missing:", "", *(f"- {m}" for m in doc["missing"]), ""]
    out += ["| step | status | seconds | note |", "| --- | --- | ---: | --- |"]
    out += [f"| {k} | {s['status']} | {s['seconds']} | {(s['reason'] or '').replace('|', '/')[:300]} |"
            for k, s in doc["steps"].items()] + [""]
    out += ["| check | passed |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in doc["checks"].items()), ""]
    steps = doc["steps"]
    sections = (("env", "Environment", _env_lines), ("parity", "Parity vs PyTorch (CPU)", _parity_table),
                ("kv_on_device", "KV cache on the device", _kv_table), ("engine", "Engine", _engine_lines),
                ("server", "Server", _server_lines))
    for key, title, fn in sections:
        if key in steps:
            body = fn(steps[key]) if key == "env" else fn(steps[key]["data"])
            while body and not body[-1]:
                body = body[:-1]
            if body:
                out += [f"## {title}", "", *body, ""]
    return "\n".join(out).rstrip() + "\n"
