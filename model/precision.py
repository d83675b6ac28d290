"""The arithmetic of a training step: fp32, bf16 autocast, or a bf16 twin of the model with fp32 master weights;
and `choose_precision`, which picks between fp32 and bf16 on this CPU by a short measurement at the start of a run.

- "fp32": everything in fp32.
- "bf16-autocast": torch.autocast around the forward pass. Every step casts each weight to bf16 again, every
  Linear casts its fp32 input (q, k and v each cast the same normalised activations) and backward casts the
  gradients back: a step of the small translator makes ~850 copies against fp32's ~430, and `aten::copy_` is 18%
  of its time (docs/decisions/training-precision.md).
- "bf16": `Bf16Twin`, a bf16 copy of the model that runs forward and backward. Its weights are copied from the
  fp32 master once per step (one `_foreach_copy_`) and its gradients copied back once; clipping and AdamW run on
  the fp32 master weights, which validation, the moving average and checkpoints use as before. Activations, the
  residual stream, LayerNorm and dropout are bf16 too (LayerNorm and the loss accumulate in fp32 inside).
- "auto": "bf16-autocast", the precision the recipes were tuned in, where the CPU does bf16 arithmetic natively
  (AVX512-BF16 or AMX, as torch's oneDNN reports it) and a measurement on the run's first batch does not find
  fp32 clearly faster; otherwise "fp32". The twin ("bf16") is opt-in: over the first 150 steps of the LM recipe
  its loss matched autocast's to the third decimal (valid 2.991 bits/char at step 100 in both), but its step is
  only 1.03x faster (1.10x in the quietest rounds; measured: docs/decisions/training-precision.md).

Owns the precisions and their choice. Does not own the step itself (model/step.py), which runs whichever it is
given. A run records the precision it chose (its TrainConfig), and --resume keeps it.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Callable

import torch

from model.train_config import PRECISIONS  # noqa: F401  (the names, declared torch-free beside the recipes)

AUTO_BF16 = "bf16-autocast"  # what "auto" takes where the CPU has bf16 natively
FP32_MARGIN = 1.25  # "auto" takes fp32 only when its steps are this much faster: a noisy machine does not flip it


class Bf16Twin:
    """A bf16 copy of `master` for forward and backward; `pull` before a step, `push_grads` after backward."""

    def __init__(self, master: torch.nn.Module) -> None:
        self.master = master
        self.model = copy.deepcopy(master).to(torch.bfloat16)  # tied weights stay tied
        self._master_params = list(master.parameters())
        self._params = list(self.model.parameters())

    def pull(self) -> torch.nn.Module:
        """The twin with the master's current weights (one cast of all of them) and mode; returns it."""
        self.model.train(self.master.training)
        with torch.no_grad():
            torch._foreach_copy_(self._params, self._master_params)
        for p in self._params:
            p.grad = None
        return self.model

    def push_grads(self) -> None:
        """The twin's gradients, in fp32, become the master's."""
        for m, p in zip(self._master_params, self._params):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)


def bf16_native() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as torch's oneDNN sees it."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pick(ms_per_step: dict[str, float]) -> str:
    """The rule "auto" applies to measured step times: AUTO_BF16 unless fp32 is FP32_MARGIN times faster."""
    if AUTO_BF16 not in ms_per_step:
        return "fp32"
    return "fp32" if ms_per_step["fp32"] * FP32_MARGIN < ms_per_step[AUTO_BF16] else AUTO_BF16


def measure(step: Callable[[str], None], rounds: int = 2, steps: int = 2) -> dict[str, float]:
    """Median ms of `step(precision)` for fp32 and (where the CPU has it natively) AUTO_BF16, alternated; torch's RNG
    state is put back afterwards, so the run that follows is the same as without the measurement."""
    names = ["fp32", AUTO_BF16] if bf16_native() else ["fp32"]
    if len(names) == 1:
        return {"fp32": 0.0}
    rng = torch.get_rng_state()
    times: dict[str, list[float]] = {n: [] for n in names}
    try:
        for n in names:
            step(n)  # the first step of each pays one-time costs
        for _ in range(rounds):
            for n in names:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(n)
                times[n].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        torch.set_rng_state(rng)
    return {n: statistics.median(v) for n, v in times.items()}
