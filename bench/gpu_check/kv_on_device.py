"""The gpu check's KV-on-device step: after warm-up, a decode step moves no cache bytes between host and device.

The runtime is built with ORT's profiler on; after a prefill and a few warm-up decode steps, MEASURED decode
steps run and the decoder's profile is read for those runs only (its `model_run` events bound them). A
cache tensor is one whose last three dimensions are the cache's (heads, max_len, head_dim). The check
passes when, in the measured steps:
- no Memcpy node (MemcpyToHost / MemcpyFromHost, which ORT inserts where a tensor crosses between EPs) moves
  a cache tensor;
- on CUDA, no node of the CPU EP reads or writes a cache tensor (such a node would need the cache on the
  host; ORT copies its inputs outside the graph when a whole graph runs on the CPU EP);
- every cache row keeps its address (the buffers are bound by pointer; `ModelRuntime.step` itself checks
  that the present outputs come back in the bound buffers).
Also reported: the bytes every Memcpy node moved per step, and which op types ran on which EP. The data
of the inputs bound from the host (token ids, lengths: a few bytes per row) and of the logits copied back
are not graph nodes, so they do not show here.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu_check.bundles import Bundles
from bench.gpu_check.plan import Plan, Step

MEMCPY = ("MemcpyToHost", "MemcpyFromHost")
ITEMSIZE = {"float": 4, "float16": 2, "double": 8, "int64": 8, "int32": 4, "bool": 1, "int8": 1, "uint8": 1}
WARMUP, MEASURED, SLOTS, PROMPT = 3, 3, 8, 6


def tensors(arg: list[dict[str, list[int]]] | None) -> list[tuple[str, list[int]]]:
    """[(dtype, shape)] of a profile event's input_type_shape / output_type_shape."""
    return [(dtype, list(shape)) for item in arg or [] for dtype, shape in item.items()]


def nbytes(dtype: str, shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * ITEMSIZE.get(dtype, 4)


def measured_nodes(events: list[dict[str, Any]], runs: int) -> list[dict[str, Any]]:
    """Node events of the last `runs` model_run events in one ORT profile (one InferenceSession)."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run"][-runs:]
    return [e for e in events if e.get("cat") == "Node" and e.get("args", {}).get("op_name")
            and any(a <= e["ts"] <= b for a, b in spans)]


def summarize(nodes: list[dict[str, Any]], cache_dims: tuple[int, int, int], runs: int,
              host_nodes_allowed: bool) -> dict[str, Any]:
    """What the measured steps moved and where they ran; `violations` lists each node that breaks the rule."""
    violations, memcpy_bytes, by_ep = [], 0, Counter()
    for e in nodes:
        args = e["args"]
        op, ep = args["op_name"], args.get("provider", "?")
        by_ep[f"{ep}:{op}"] += 1
        io = tensors(args.get("input_type_shape")) + tensors(args.get("output_type_shape"))
        holds_cache = any(len(s) >= 3 and tuple(s[-3:]) == cache_dims for _, s in io)
        if op in MEMCPY:
            memcpy_bytes += sum(nbytes(d, s) for d, s in tensors(args.get("input_type_shape")))
            if holds_cache:
                violations.append(f"{op} {e['name']} copies a cache tensor {io}")
        elif holds_cache and ep == "CPUExecutionProvider" and not host_nodes_allowed:
            violations.append(f"{op} {e['name']} runs on the CPU EP with a cache tensor {io}")
    return {"nodes_per_step": len(nodes) // max(runs, 1), "memcpy_bytes_per_step": memcpy_bytes // max(runs, 1),
            "ops_by_ep_per_step": {k: v // max(runs, 1) for k, v in sorted(by_ep.items())},
            "violations": violations[:20], "violation_count": len(violations)}


def drive(rt, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Prefill SLOTS rows, warm up, then MEASURED decode steps; (cache addresses before, after)."""
    vocab, n = rt.vocab_size, SLOTS
    if rt.is_encoder_decoder:
        rt.encode(0, [rng.integers(4, vocab, int(k)).tolist() for k in rng.integers(3, 12, n)])
        ids = np.full((n, 1), rt.bos_id, np.int64)
    else:
        ids = rng.integers(4, vocab, (n, PROMPT)).astype(np.int64)
        ids[:, 0] = rt.bos_id
    rt.step(0, ids, np.full(n, ids.shape[1], np.int64), np.zeros(n, np.int64))
    pos = np.full(n, ids.shape[1], np.int64)
    addresses = lambda: [rt.cache_ptr(layer, s) for layer in range(rt.bundle.config.n_decoder_layers)
                         for s in range(n)]
    before = None
    for i in range(WARMUP + MEASURED):
        if i == WARMUP:
            before = addresses()
        rt.step(0, rng.integers(4, vocab, (n, 1)).astype(np.int64), np.ones(n, np.int64), pos)
        pos = pos + 1
    return before, addresses()


def check_bundle(path: Path, device: str, work: Path) -> dict[str, Any]:
    from export.bundle import load_bundle
    from serving.engine.runtime import ModelRuntime

    work.mkdir(parents=True, exist_ok=True)
    bundle = load_bundle(path)
    cfg = bundle.config
    rt = ModelRuntime(bundle, SLOTS, provider=device, profile_prefix=str(work / "ort-profile-"))
    before, after = drive(rt, np.random.default_rng(0))
    files = rt.end_profiling()
    decoder = next(f for f in files if Path(f).name.startswith(f"ort-profile-{rt.decoder_graph}"))
    nodes = measured_nodes(json.loads(Path(decoder).read_text()), MEASURED)
    out = summarize(nodes, (cfg.n_heads, cfg.max_len, cfg.head_dim), MEASURED, host_nodes_allowed=device == "cpu")
    out.update(provider=rt.provider, graph=rt.decoder_graph, profile=decoder, measured_steps=MEASURED,
               addresses_unchanged=before == after, cache_tensor_dims=[cfg.n_heads, cfg.max_len, cfg.head_dim])
    out["passed"] = out["addresses_unchanged"] and out["violation_count"] == 0 and len(nodes) > 0
    return out


def run(step: Step, plan: Plan, bundles: Bundles, device: str, work: Path) -> None:
    for task in plan.tasks:
        for variant in plan.kv_variants:
            path = bundles.get(task, variant)
            if path is None:
                continue
            name = f"kv_on_device/{task}/{variant}"
            result = check_bundle(path, device, work / f"{task}-{variant}")
            step.data[name] = result
            step.check(name, result["passed"])
    if not step.checks:
        step.reason = "no bundle to check"
