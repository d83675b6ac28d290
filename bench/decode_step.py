"""Decode-step latency: ONNX Runtime fp32 and int8 bundles vs PyTorch eager with the KV cache.

    python -m bench.decode_step --checkpoint CKPT --fp32 BUNDLE [--int8 BUNDLE] [--batches 1 16]
        [--context 32] [--iters 200] [--threads 1] [--markdown]

Each backend holds a KV cache prefilled with `context` tokens per row (random ids, the same for all), and
one decode step (1 new token per row at write_pos = context) is timed again and again. Backends are
alternated within every iteration (the order rotates), so a noisy shared machine slows all of them alike;
the figures are medians, and the headline is the ratio PyTorch / backend (> 1 = faster than PyTorch).
PyTorch runs `model.step` under inference_mode with the same thread count as ONNX Runtime.

Does not measure: prefill or encoding, the engine around the step (scheduling, sampling: bench/engine.py),
HTTP (bench/http.py), or quality (an int8 bundle's quality change is measured at export).
Owns: the measurement and its report (JSON, or a markdown table for docs/benchmarks.md; `markdown` is the one
renderer of that table, torch-free to import: bench/report.py embeds it).
Does not own: the runtime (serving/engine/runtime.py).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _ort_stepper(bundle: Path, batch: int, context: int, threads: int, ids: np.ndarray) -> Callable[[], None]:
    from export.bundle import load_bundle
    from serving.engine.runtime import ModelRuntime

    rt = ModelRuntime(load_bundle(bundle), n_slots=batch, provider="cpu", intra_op_threads=threads)
    if rt.is_encoder_decoder:
        rt.encode(0, [ids[b, :context].tolist() for b in range(batch)])
    rt.step(0, ids[:, :context], np.full(batch, context), np.zeros(batch, np.int64))
    tok, one, pos = ids[:, context : context + 1], np.ones(batch, np.int64), np.full(batch, context, np.int64)
    return lambda: rt.step(0, tok, one, pos)


def _torch_stepper(model: Any, batch: int, context: int, ids: np.ndarray) -> Callable[[], None]:
    import torch

    t_ids = torch.from_numpy(ids)
    kw: dict[str, Any] = {}
    with torch.inference_mode():
        if hasattr(model, "cross_kv"):
            src_len = torch.full((batch,), context)
            kw = {"cross": model.cross_kv(model.encode(t_ids[:, :context], src_len)), "src_len": src_len}
        caches = model.decoder.empty_cache(batch)
        _, caches = model.step(t_ids[:, :context], torch.full((batch,), context), torch.zeros(batch, dtype=torch.long),
                               caches, **kw)
    tok, one, pos = t_ids[:, context : context + 1], torch.ones(batch, dtype=torch.long), torch.full((batch,), context)

    def step() -> None:
        with torch.inference_mode():
            model.step(tok, one, pos, caches, **kw)
    return step


def measure(steppers: dict[str, Callable[[], None]], iters: int, warmup: int = 10) -> dict[str, float]:
    """Median seconds per call of each stepper, calls alternated (order rotating every iteration)."""
    names = list(steppers)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + iters):
        order = names[i % len(names):] + names[: i % len(names)]
        for n in order:
            t0 = time.perf_counter()
            steppers[n]()
            if i >= warmup:
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def run(checkpoint: Path, fp32: Path, int8: Path | None, batches: list[int], context: int, iters: int,
        threads: int) -> dict[str, Any]:
    import torch

    from model.checkpoint import load_checkpoint

    torch.set_num_threads(threads)
    ck = load_checkpoint(checkpoint)
    if context + 1 > ck.config.max_len:
        raise ValueError(f"--context {context} leaves no room in the KV cache (max_len {ck.config.max_len})")
    rows = []
    for batch in batches:
        ids = np.random.default_rng(0).integers(4, ck.config.vocab_size, (batch, context + 1)).astype(np.int64)
        steppers = {"pytorch": _torch_stepper(ck.model, batch, context, ids),
                    "ort_fp32": _ort_stepper(fp32, batch, context, threads, ids)}
        if int8 is not None:
            steppers["ort_int8"] = _ort_stepper(int8, batch, context, threads, ids)
        med = measure(steppers, iters)
        rows.append({"batch": batch, "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                     "speedup_vs_pytorch": {k: round(med["pytorch"] / v, 2) for k, v in med.items() if k != "pytorch"},
                     **({"int8_vs_fp32": round(med["ort_fp32"] / med["ort_int8"], 2)} if int8 else {})})
    return {"checkpoint": str(checkpoint), "task": ck.task, "context": context, "iters": iters, "threads": threads,
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s)",
            "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = [f"**{result['task']}** (`{result['checkpoint']}`), {result['context']} cached tokens per row, "
             f"{result['threads']} thread(s), median of {result['iters']} alternated calls:", "",
             "| batch | PyTorch eager | ORT fp32 | ORT int8 | fp32 vs PyTorch | int8 vs PyTorch | int8 vs fp32 |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        m, s = r["median_ms"], r["speedup_vs_pytorch"]
        int8 = "-" if "ort_int8" not in m else f"{m['ort_int8']:.3f} ms"
        lines.append(f"| {r['batch']} | {m['pytorch']:.3f} ms | {m['ort_fp32']:.3f} ms | {int8} | "
                     f"{x(s['ort_fp32'])} | {x(s.get('ort_int8'))} | {x(r.get('int8_vs_fp32'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint the bundles were exported from")
    p.add_argument("--fp32", type=Path, required=True, help="fp32 bundle")
    p.add_argument("--int8", type=Path, default=None, help="int8 bundle (optional)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=32, help="cached tokens per row before the timed step")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for every backend")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead of JSON")
    a = p.parse_args(argv)
    if min(a.batches) < 1 or a.iters < 1 or a.context < 1 or a.threads < 1:
        p.error("--batches, --iters, --context and --threads must be >= 1")
    result = run(a.checkpoint, a.fp32, a.int8, a.batches, a.context, a.iters, a.threads)
    print(markdown(result) if a.markdown else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
