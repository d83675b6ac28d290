"""The gpu check's bundles: fp32 and fp16 bundles of each task, with the checkpoint they came from.

Source per task: the checkpoint trained here, `ARTIFACTS/ckpt/<task>`, when it exists, else the published
model (published/<task>, in every checkout), else the tiny preset fitted for a few steps on built-in sentences
(model/tiny.py). Each variant is exported with `kvserve export`'s own pipeline (kvserve/export.build_bundle:
export, onnx checks, CPU parity) into OUT/bundles/<task>-<variant>. Without torch nothing can be exported:
then the bundles already in ARTIFACTS/bundles/<task> (fp32) are used as they are, with no checkpoint, so the
steps that need no PyTorch reference still run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu_check.plan import Plan, Step

WEIGHTS = "model.safetensors"  # a checkpoint's weights file (model/checkpoint.py)


@dataclass
class Bundles:
    checkpoints: dict[str, Path] = field(default_factory=dict)  # task -> checkpoint dir
    paths: dict[tuple[str, str], Path] = field(default_factory=dict)  # (task, variant) -> bundle dir

    def get(self, task: str, variant: str) -> Path | None:
        return self.paths.get((task, variant))


def checkpoint_for(task: str, artifacts: Path, work: Path, plan: Plan) -> tuple[Path, str]:
    """(checkpoint dir, "artifacts", "published" or "tiny") for `task`."""
    from model.published import PUBLISHED_DIR

    real = artifacts / "ckpt" / task
    if (real / WEIGHTS).is_file():
        return real, "artifacts"
    if (PUBLISHED_DIR / task / WEIGHTS).is_file():
        return PUBLISHED_DIR / task, "published"
    from model.tiny import tiny_checkpoint

    out = work / "ckpt" / task
    if not (out / WEIGHTS).is_file():
        tiny_checkpoint(out, task, train_steps=plan.tiny_train_steps)
    return out, "tiny"


def export_all(step: Step, plan: Plan, artifacts: Path, work: Path) -> Bundles:
    """Export every (task, variant) of the plan; the step's data records sources, paths and CPU parity."""
    import torch

    from export.bundle import Variant
    from kvserve.export import build_bundle

    torch.set_num_threads(plan.torch_threads)
    out = Bundles()
    for task in plan.tasks:
        ckpt, source = checkpoint_for(task, artifacts, work, plan)
        out.checkpoints[task] = ckpt
        step.data.setdefault("sources", {})[task] = {"source": source, "checkpoint": str(ckpt)}
        for variant in plan.variants:
            path = work / "bundles" / f"{task}-{variant}"
            manifest = build_bundle(ckpt, path, Variant(variant), force=True, check_sentences=0)
            out.paths[(task, variant)] = path
            syn = manifest["parity"]["synthetic_cpu"]
            step.data.setdefault("bundles", {})[f"{task}/{variant}"] = {
                "path": str(path), "export_cpu_parity_logits_max_abs": syn["logits_max_abs"],
                "export_cpu_parity_greedy_identical": f"{syn['rows_greedy_identical']}/{syn['rows']}"}
    return out


def existing(step: Step, plan: Plan, artifacts: Path) -> Bundles:
    """Without torch: the fp32 bundles under ARTIFACTS/bundles, if any (no checkpoints: no parity)."""
    out = Bundles()
    for task in plan.tasks:
        path = artifacts / "bundles" / task
        if (path / "manifest.json").is_file():
            out.paths[(task, "fp32")] = path
            step.data.setdefault("bundles", {})[f"{task}/fp32"] = {"path": str(path), "source": "artifacts"}
    return out


def run(step: Step, plan: Plan, artifacts: Path, work: Path, have_torch: bool) -> Bundles:
    if have_torch:
        return export_all(step, plan, artifacts, work)
    found = existing(step, plan, artifacts)
    step.reason = (f"torch is not importable: nothing exported; using {len(found.paths)} existing fp32 "
                   f"bundle(s) from {artifacts}/bundles")
    return found
