"""bench/gpu_check: the KV-on-device rule on synthetic profiles, the report and exit status, what a run without
onnxruntime-gpu says, and (slow) `make gpu-check-cpu` end to end."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check.__main__ import main
from bench.gpu_check.kv_on_device import measured_nodes, summarize
from bench.gpu_check.plan import Status, Step
from bench.gpu_check.report import EXIT_CHECK_FAILED, EXIT_INCOMPLETE, EXIT_OK, document, exit_status, markdown
from serving.engine.runtime import gpu_visible

ROOT = Path(__file__).resolve().parents[1]
CACHE = (4, 64, 8)  # heads, max_len, head_dim


def node(op, ep, inputs, ts=10, name="n"):
    return {"cat": "Node", "name": name, "ts": ts, "dur": 1,
            "args": {"op_name": op, "provider": ep, "input_type_shape": [{"float": s} for s in inputs],
                     "output_type_shape": []}}


def test_kv_rule_flags_cache_copies_and_cache_on_host_nodes_only():
    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    ok = [node("MemcpyFromHost", cuda, [[8, 1]]), node("Attention", cuda, [[8, *CACHE]]),
          node("Shape", cpu, [[3]])]
    r = summarize(ok, CACHE, runs=1, host_nodes_allowed=False)
    assert r["violation_count"] == 0 and r["memcpy_bytes_per_step"] == 8 * 4 and r["nodes_per_step"] == 3
    bad = ok + [node("MemcpyToHost", cuda, [[8, *CACHE]], name="copy"), node("TensorScatter", cpu, [[8, *CACHE]])]
    r = summarize(bad, CACHE, runs=1, host_nodes_allowed=False)
    assert r["violation_count"] == 2 and "copy" in r["violations"][0]
    assert summarize(bad, CACHE, runs=1, host_nodes_allowed=True)["violation_count"] == 1  # the copy still counts


def test_measured_nodes_are_those_of_the_last_runs():
    runs = [{"cat": "Session", "name": "model_run", "ts": t, "dur": 5} for t in (0, 100, 200)]
    events = [*runs, node("Add", "x", [], ts=2), node("Mul", "x", [], ts=102), node("Sub", "x", [], ts=203)]
    assert [e["args"]["op_name"] for e in measured_nodes(events, 2)] == ["Mul", "Sub"]


def test_exit_status_and_markdown_follow_the_steps():
    env = Step("env", data={"missing": [], "modules": {"torch": "2"}})
    good = Step("parity", data={"parity/generate/fp16": {"provider": "CUDAExecutionProvider", "graph": "decoder",
                                                         "logits_max_abs": 0.02, "tolerance": 0.1, "rows": 15,
                                                         "rows_greedy_identical": 15}})
    good.check("parity/generate/fp16", True)
    doc = document("cuda", {}, [env, good], 0.0, ["python -m bench.gpu_check"])
    assert doc["exit_status"] == EXIT_OK and doc["checks"] == {"parity/generate/fp16": True}
    md = markdown(doc)
    assert "every check passed" in md and "| generate/fp16 | CUDAExecutionProvider | decoder | 0.02 | 0.1 | 15/15 |" in md
    bad = Step("engine")
    bad.check("invariance/generate/greedy", False)
    assert bad.status is Status.FAILED
    doc = document("cuda", {}, [env, good, bad, Step("server", Status.SKIPPED, "ray is not importable")], 0.0, [])
    assert exit_status(doc) == EXIT_CHECK_FAILED and "**a check failed**" in markdown(doc)
    doc = document("cuda", {}, [env, good, Step("server", Status.SKIPPED, "ray is not importable")], 0.0, [])
    assert exit_status(doc) == EXIT_INCOMPLETE and "ray is not importable" in markdown(doc)


def test_the_engine_step_reports_where_a_continuous_step_goes():
    row = {"concurrency": 32, "rows_per_step": 21.3, "step_ms": 8.5, "tokens_per_s": 2504.0,
           "per_step_ms": {"ort decoder": 7.5, "ort encoder": 0.0, "ort helpers": 0.0, "runner python": 0.6,
                           "engine loop": 0.4},
           "share": {"ort decoder": 0.88, "ort encoder": 0.0, "ort helpers": 0.0, "runner python": 0.07,
                     "engine loop": 0.05}}
    from bench.breakdown import table

    engine = Step("engine", data={"breakdown/generate/fp16": {
        "rows": [row], "markdown": table({"models": [{"bundle": "b/generate-fp16", "rows": [row]}]})}})
    md = markdown(document("cuda", {}, [Step("env", data={"missing": []}), engine], 0.0, []))
    assert "Where a continuous-batching step's time goes, generate/fp16" in md
    assert "| generate-fp16 | 32 | 21.3 | 8.500 | 7.500 (88%) |" in md


def test_benchmarks_section_shows_the_published_gpu_run_and_says_so_when_there_is_none(tmp_path):
    from bench.gpu_check.report import PUBLISHED, benchmarks_section

    assert "no figures yet" in "\n".join(benchmarks_section(tmp_path / "none.json"))
    doc = json.loads(PUBLISHED.read_text())  # the run docs/benchmarks.md shows: every check passed there
    assert doc["exit_status"] == EXIT_OK and doc["checks"] and all(doc["checks"].values())
    text = "\n".join(benchmarks_section())
    gpu = doc["steps"]["env"]["data"]["gpu"]["nvidia_smi"][0]
    assert text.startswith("## 8. GPU (CUDA EP)") and gpu in text and doc["date_utc"] in text
    assert [h for h in text.splitlines() if h.startswith("#")] == [
        "## 8. GPU (CUDA EP)", "### Environment", "### Parity vs PyTorch (CPU)", "### KV cache on the device",
        "### Engine", "### Server"]


@pytest.mark.skipif(gpu_visible(), reason="checks the run without onnxruntime-gpu")
def test_cuda_run_without_onnxruntime_gpu_says_what_is_missing_and_skips_the_device_steps(tmp_path, capsys):
    assert main(["--device", "cuda", "--out", str(tmp_path), "--steps", "parity", "engine"]) == EXIT_INCOMPLETE
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert any("no CUDAExecutionProvider" in m and "onnxruntime-gpu" in m for m in doc["missing"])
    for step in ("parity", "engine"):
        assert doc["steps"][step]["status"] == "skipped"
        assert "the cuda EP is not usable" in doc["steps"][step]["reason"]
    assert "Missing:" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_make_gpu_check_cpu_writes_every_check_by_name(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["make", "gpu-check-cpu", f"PY={sys.executable}", f"OUT={out}", f"ART={tmp_path / 'none'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    want = {f"parity/{t}/{v}" for t in ("generate", "translate") for v in ("fp32", "fp16")}
    want |= {f"invariance/{t}/{k}" for t in ("generate", "translate") for k in ("greedy", "seeded")}
    want |= {"kv_on_device/generate/fp32", "kv_on_device/translate/fp32", "gpu_tests", "server/replica_on_device",
             "server/loadtest/8", "server/loadtest/32"}
    assert want <= set(doc["checks"]) and all(doc["checks"].values()), doc["checks"]
    assert doc["steps"]["engine"]["data"]["throughput/generate/fp32"]["summary"]
    assert {s["status"] for s in doc["steps"].values()} == {"ok"}
    md = (out / "gpu_check.md").read_text()
    assert "## Parity vs PyTorch (CPU)" in md and "## Server" in md and "every check passed" in md
    gates = {k: v for k, v in doc["steps"]["parity"]["data"].items() if k.startswith("quality_gate/")}
    assert set(gates) == {"quality_gate/generate/fp16", "quality_gate/translate/fp16"}  # fp16 judged by quality
    assert all(g["passed"] for g in gates.values()) and "quality gate set" in md
