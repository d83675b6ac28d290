"""The gpu check's parity step: each bundle on the device's EP against its PyTorch checkpoint on the CPU.

export/parity.py's `synthetic_parity`: a 20-step lockstep decode (both backends fed PyTorch's greedy tokens)
of random prompts at batch sizes 1, 2, 5 and 7 with right-padded mixed lengths, other than the traced ones.
A check passes when the logits stay within the variant's tolerance on the device and, for fp32, every row's
greedy tokens are PyTorch's; an fp16 bundle instead passes the quality gate of its export (export/quality_gate.py:
chrF on the everyday set at most 1.0 below PyTorch's fp32, bits per char at most 0.02 above), run on the device,
since a correct fp16 variant changes a few greedy outputs where two tokens are nearly tied. Tolerances: fp32 1e-4 on the CPU EP (as `kvserve export` demands) and 1e-3 on CUDA
(other kernels, other summation order; TF32 is off for fp32); fp16 0.1 (float16 keeps ~3 significant digits
of logits that reach ~20; the tiny model measured < 0.05 on the CPU EP).
"""
from __future__ import annotations

from bench.gpu_check.bundles import Bundles
from bench.gpu_check.plan import Plan, Step

TOLERANCE = {("fp32", "cpu"): 1e-4, ("fp32", "cuda"): 1e-3, ("fp16", "cpu"): 0.1, ("fp16", "cuda"): 0.1}


def run(step: Step, plan: Plan, bundles: Bundles, device: str) -> None:
    import torch

    from export.bundle import load_bundle
    from export import quality_gate
    from export.parity import TorchRuntime, synthetic_parity
    from kvserve.export import GATE_SLOTS
    from model.checkpoint import load_checkpoint
    from serving.engine.runtime import ModelRuntime

    torch.set_num_threads(plan.torch_threads)
    step.data["tolerance"] = {f"{v}/{d}": t for (v, d), t in TOLERANCE.items() if d == device}
    for task in plan.tasks:
        if task not in bundles.checkpoints:
            continue
        ckpt = load_checkpoint(bundles.checkpoints[task])
        for variant in plan.variants:
            path = bundles.get(task, variant)
            if path is None:
                continue
            rt = ModelRuntime(load_bundle(path), plan.parity_slots, provider=device)
            syn = synthetic_parity(ckpt.model, rt, ckpt.tokenizer.special_ids, steps=plan.parity_steps)
            tol = TOLERANCE[(variant, device)]
            name = f"parity/{task}/{variant}"
            if variant == "fp32":
                ok = syn["logits_max_abs"] <= tol and syn["rows_greedy_identical"] == syn["rows"]
            else:
                gate = quality_gate.measure(task, TorchRuntime(ckpt.model, GATE_SLOTS, ckpt.tokenizer.special_ids),
                                            ModelRuntime(load_bundle(path), GATE_SLOTS, provider=device),
                                            ckpt.tokenizer)
                step.data[f"quality_gate/{task}/{variant}"] = gate
                ok = syn["logits_max_abs"] <= tol and gate["passed"]
            step.data[name] = {"provider": rt.provider, "graph": rt.decoder_graph, "tolerance": tol,
                               "steps": syn["steps"], "rows": syn["rows"],
                               "rows_greedy_identical": syn["rows_greedy_identical"],
                               "logits_max_abs": syn["logits_max_abs"],
                               "per_batch": [{k: b[k] for k in ("batch", "logits_max_abs", "rows_greedy_identical")}
                                             for b in syn["batches"]]}
            step.check(name, ok)
    if not step.checks:
        step.reason = "no bundle with a checkpoint to compare against"
