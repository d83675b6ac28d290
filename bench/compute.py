"""`kvserve bench`, compute side: the machine's description, its measured peak matmul FLOP/s, the model's
FLOPs per generated token, and how much of that peak the engine's ONNX Runtime decode step reaches.

- `machine()` describes where the figures were measured (CPU model, cores, RAM, kernel, library versions,
  git commit) without importing torch (versions come from package metadata).
- `peak_gemm(n, reps, threads)` times a large square float32 matmul, with numpy (its BLAS, default threads)
  and with ONNX Runtime's MatMul at 1 thread and at every core: the machine's "peak" is the best of them.
- `flops_per_token(cfg, context, src_len)` counts a decoder step's useful FLOPs per row: 2 x the weights
  every token multiplies (self-attention q/k/v/o, cross-attention q/o, FFN, output projection) plus
  attention over the `context` cached positions (QK^T and AV: 4 x d_model per position and layer).
  `workload_flops` adds prefill (prompt tokens through the same weights, causal attention, one logits row).
- `step_sweep(bundle, batches, context, threads)` times the runtime's decode step alone at each batch size
  (the engine's ceiling: no scheduling, sampling or HTTP; timed by bench.engine.step_scaling), as
  FLOP/s; `step_scaling_of` the same step by rows and cached length (how batching's gain falls as contexts grow).

Does not measure: what the engine adds around the step (scheduling, sampling: bench/engine.py) or HTTP
(bench/http.py), GPU figures (every figure here is the CPU's), or FLOPs that do no useful work (padding,
masked attention positions are not counted).
Owns only these measurements and counts; the doc is bench/report.py's, orchestration bench/cli.py's.
"""
from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from bench.markdown import DATE_UTC
from model.provenance import cpu_flags, cpu_model

PACKAGES = ("numpy", "onnxruntime", "onnx", "ray", "ctranslate2", "torch", "httpx")


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git(root: Path) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + (" (with uncommitted changes)" if dirty else "")


def machine(root: Path | None = None) -> dict[str, Any]:
    """Where the figures were measured."""
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "logical_cpus": os.cpu_count(),
            "ram_gib": _ram_gib(), "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "versions": versions,
            "git": _git(root or Path.cwd()), "date_utc": time.strftime(DATE_UTC, time.gmtime())}


def _times(fn: Any, reps: int) -> list[float]:
    fn()  # warm-up (first-call allocation, thread pool start)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _best_time(fn: Any, reps: int) -> float:
    """A peak is what the machine can do: the fastest of the repetitions (noise only ever slows it)."""
    return min(_times(fn, reps))


def _ort_matmul(n: int, threads: int) -> Any:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                              [helper.make_tensor_value_info(k, TensorProto.FLOAT, [n, n]) for k in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    return lambda: sess.run(None, {"a": a, "b": b})


def peak_gemm(n: int = 2048, reps: int = 5, threads: int | None = None) -> dict[str, Any]:
    """float32 n x n x n matmul FLOP/s (2 n^3 per product, best of `reps`): numpy (default threads), ORT at 1
    and `threads` threads."""
    threads = threads or os.cpu_count() or 1
    flops = 2.0 * n ** 3
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    results = {"numpy (BLAS, default threads)": flops / _best_time(lambda: a @ b, reps)}
    for t in sorted({1, threads}):
        results[f"onnxruntime MatMul, {t} thread{'s' if t > 1 else ''}"] = flops / _best_time(_ort_matmul(n, t), reps)
    one = results["onnxruntime MatMul, 1 thread"]
    return {"n": n, "reps": reps, "threads": threads, "flops_per_s": results,
            "peak_flops_per_s": max(results.values()), "peak_1_thread_flops_per_s": one}


def matmul_weights_per_token(cfg: dict[str, Any]) -> int:
    """Weights one decoder token multiplies (self-attention, cross q/o, FFN, output projection)."""
    d, ff, layers, vocab = cfg["d_model"], cfg["d_ff"], cfg["n_decoder_layers"], cfg["vocab_size"]
    cross = 2 * d * d if cfg["arch"] == "encoder_decoder" else 0
    return layers * (4 * d * d + 2 * d * ff + cross) + d * vocab


def flops_per_token(cfg: dict[str, Any], context: float, src_len: float = 0.0) -> float:
    """Useful FLOPs of one decoded token with `context` cached positions (and `src_len` source tokens)."""
    d, layers = cfg["d_model"], cfg["n_decoder_layers"]
    attention = 4.0 * d * layers * (context + 1 + (src_len if cfg["arch"] == "encoder_decoder" else 0))
    return 2.0 * matmul_weights_per_token(cfg) + attention


def workload_flops(cfg: dict[str, Any], requests: list[tuple[int, int]]) -> float:
    """FLOPs of a decoder-only workload of (prompt_len, generated) requests, prefill included: prompt
    tokens multiply every decoder weight but the output projection (logits of the last position only)."""
    d, layers, vocab = cfg["d_model"], cfg["n_decoder_layers"], cfg["vocab_size"]
    total = 0.0
    for prompt, generated in requests:
        body = 2.0 * (matmul_weights_per_token(cfg) - d * vocab)
        total += prompt * body + 2.0 * d * vocab + 4.0 * d * layers * prompt * (prompt + 1) / 2
        total += sum(flops_per_token(cfg, prompt + i) for i in range(max(generated - 1, 0)))
    return total


def _cpu_runtime(bundle: Path, n_slots: int, threads: int) -> Any:
    from export.bundle import load_bundle
    from serving.engine.runtime import ModelRuntime

    return ModelRuntime(load_bundle(bundle), n_slots=n_slots, provider="cpu", intra_op_threads=threads)


def step_sweep(bundle: Path, batches: list[int], context: int, threads: int, reps: int = 30) -> list[dict[str, Any]]:
    """The runtime's decode step alone (one token per row, `context` cached), per batch: time and FLOP/s
    (timed by bench.engine.step_scaling; a translation model's rows attend over `context` source tokens)."""
    from bench.engine import step_scaling

    rt = _cpu_runtime(bundle, max(batches), threads)
    cfg = rt.bundle.model_config
    src_len = context if rt.is_encoder_decoder else 0
    rows = []
    for r in step_scaling(rt, sorted(set(batches)), [context], reps=reps, src_tokens=max(1, src_len)):
        sec = r["step_ms"] / 1e3
        flops = r["rows"] * flops_per_token(cfg, context, src_len)
        rows.append({"batch": r["rows"], "step_ms": r["step_ms"], "tokens_per_s": r["rows"] / sec,
                     "flops_per_s": flops / sec})
    return rows


def step_scaling_of(bundle: Path, rows: list[int], contexts: list[int], threads: int) -> list[dict[str, Any]]:
    """bench.engine.step_scaling on a bundle: the decode step by rows and cached length, and the gain
    per row of a batch over one row at each length."""
    from bench.engine import step_scaling

    return step_scaling(_cpu_runtime(bundle, max(rows), threads), sorted(set(rows)), contexts)


BENCH_ENGINE_MEAN_PROMPT = 15  # bench/engine.py's random prompts: bos + 4..24 tokens (JSON without mean_prompt_tokens)


def engine_best(engine_doc: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The engine's best continuous-batching throughput (bench/engine.py JSON) as FLOP/s: its
    generated tokens/s x the workload's FLOPs per generated token (prefill included, mean prompt length)."""
    rows = [r for r in engine_doc["summary"] if r["mode"] == "continuous"]
    best = max(rows, key=lambda r: r["busy_tokens_per_s"])
    n = best["concurrency"] * engine_doc["requests_per_client"]
    outs = np.linspace(engine_doc["min_new"], engine_doc["max_new"], n).round().astype(int)
    prompt = round(engine_doc.get("mean_prompt_tokens", BENCH_ENGINE_MEAN_PROMPT))
    per_token = workload_flops(cfg, [(prompt, int(o)) for o in outs]) / int(outs.sum())
    return {"concurrency": best["concurrency"], "rows_per_step": best["mean_rows_per_step"],
            "tokens_per_s": best["busy_tokens_per_s"], "flops_per_token": per_token,
            "flops_per_s": per_token * best["busy_tokens_per_s"]}
