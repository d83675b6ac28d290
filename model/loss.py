"""The training loss: label-smoothed cross entropy over the vocabulary, fused for the CPU.

It computes what `F.cross_entropy(logits.float(), target, ignore_index=pad, label_smoothing=eps)` computes
(the mean over non-pad positions of (1 - eps) * NLL + eps * the mean NLL over all classes), with fewer
passes over the (positions x vocabulary) logits, which dominate the loss's cost at an 8k vocabulary:

- forward: bf16 logits are read once into fp32 exp(x - max) (kept for backward in place of log-softmax's
  output), plus two reductions; no fp32 copy of the logits, no log-softmax tensor;
- backward: the gradient softmax - (1 - eps) * onehot - eps / V, scaled per row, is written in one pass and
  cast once to the logits' dtype; torch's version materializes the NLL and smoothing gradients separately,
  adds them and runs log-softmax's backward and the cast's backward after it.

Measured (`python -m model.bench_train_step --pairs 90 --threads 2`, variant "fused loss"): see README.
Owns only the loss; which positions count (pad) and the smoothing come from model/train.py.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Criterion = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]  # (logits, target, pad, eps) -> loss


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, pad: int, eps: float) -> torch.Tensor:
        # logits (N, V) in any float dtype, target (N,); the math runs in fp32
        keep = target != pad  # (N,)
        n = keep.sum().clamp(min=1).to(torch.float32)
        m = logits.amax(-1, keepdim=True).float()  # (N, 1)
        e = torch.sub(logits, m)  # (N, V) fp32: bf16 - fp32 promotes, one pass
        e.exp_()
        s = e.sum(-1)  # (N,)
        lse = m.squeeze(-1) + s.log()
        safe = target.masked_fill(~keep, 0)
        x_t = logits.gather(1, safe[:, None]).squeeze(1).float()
        per_row = lse - (1.0 - eps) * x_t
        if eps:
            per_row = per_row - eps * logits.sum(-1, dtype=torch.float32) / logits.shape[-1]
        loss = (per_row * keep).sum() / n
        ctx.save_for_backward(e, s, safe, keep, n)
        ctx.eps, ctx.dtype = eps, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        e, s, safe, keep, n = ctx.saved_tensors
        scale = grad.float() * keep / n  # (N,) zero on pad rows
        g = e.mul_(scale[:, None] / s[:, None])  # softmax * scale, in place of the saved exp
        if ctx.eps:
            g.sub_((ctx.eps / g.shape[-1]) * scale[:, None])
        g.scatter_add_(1, safe[:, None], (-(1.0 - ctx.eps) * scale)[:, None])
        return g.to(ctx.dtype), None, None, None


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pad: int, eps: float = 0.0) -> torch.Tensor:
    """Mean label-smoothed cross entropy over positions whose target is not `pad`. logits (N, V), target (N,).
    Equals F.cross_entropy(logits.float(), target, ignore_index=pad, label_smoothing=eps) (tests/test_train.py)."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {eps}")
    return _SmoothedCrossEntropy.apply(logits, target, pad, float(eps))


def torch_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pad: int, eps: float = 0.0) -> torch.Tensor:
    """The same loss through torch's own ops (the reference for tests and the benchmark's baseline)."""
    return F.cross_entropy(logits.float(), target, ignore_index=pad, label_smoothing=eps)
