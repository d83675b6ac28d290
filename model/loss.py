"""The training loss: label-smoothed cross entropy over the vocabulary, fused for the CPU.

It computes what `F.cross_entropy(logits.float(), target, ignore_index=pad, label_smoothing=eps)` computes
(the mean over non-pad positions of (1 - eps) * NLL + eps * the mean NLL over all classes), with fewer
passes over the (positions x vocabulary) logits, which dominate the loss's cost at an 8k vocabulary:

- forward: a chunk of rows at a time in fp32: max, the target's logit, the row sum (smoothing) and the
  log-sum-exp; only the log-sum-exp per row is kept for backward, not a log-softmax tensor;
- backward: the gradient softmax - (1 - eps) * onehot - eps / V, scaled per row, recomputed a chunk at a
  time and written once in the logits' dtype; torch's version materializes the NLL and smoothing gradients
  separately, adds them and runs log-softmax's backward and the cast's backward after it.

Chunks keep the fp32 temporaries at 8 MiB: a fresh (positions x vocabulary) fp32 tensor is 49 MB at 1,530 x
8,000, above glibc's largest mmap threshold, so each one is a new mapping whose pages fault on first touch
(13 ms for `x.float()` of that size here vs 1.9 ms into reused memory). The gradient itself is one tensor in
the logits' dtype (24 MB in bf16; 49 MB, and so still a fresh mapping, when training without bf16).

One difference from torch: a batch whose targets are all pad gives a loss of 0 and zero gradients, not NaN.

What it saves per step against torch's loss: docs/decisions/training-step-cost.md. Owns only the loss; which positions count (pad) and the smoothing come
from model/step.py and the run's TrainConfig.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

Criterion = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]  # (logits, target, pad, eps) -> loss


_CHUNK_BYTES = 8 << 20  # bytes of fp32 per chunk of rows: well under glibc's 32 MiB mmap cap (model/cpu_memory.py)


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, pad: int, eps: float) -> torch.Tensor:
        # logits (N, V) in any float dtype, target (N,); the math runs in fp32, a chunk of rows at a time
        n_rows, vocab = logits.shape
        rows = max(1, _CHUNK_BYTES // (4 * vocab))
        keep = target != pad  # (N,)
        safe = target.masked_fill(~keep, 0)
        lse = logits.new_empty(n_rows, dtype=torch.float32)  # (N,) log-sum-exp of each row
        per_row = logits.new_empty(n_rows, dtype=torch.float32)  # (N,) the loss of each row
        for a in range(0, n_rows, rows):
            x = logits[a: a + rows].to(torch.float32, copy=True)  # (r, V); a copy also of fp32 logits
            m = x.amax(-1)
            loss = -(1.0 - eps) * x.gather(1, safe[a: a + rows, None]).squeeze(1)
            if eps:
                loss -= (eps / vocab) * x.sum(-1)
            lse[a: a + rows] = m + x.sub_(m[:, None]).exp_().sum(-1).log_()
            per_row[a: a + rows] = loss + lse[a: a + rows]
        n = keep.sum().clamp(min=1).to(torch.float32)
        ctx.save_for_backward(logits, lse, safe, keep, n)
        ctx.eps, ctx.rows = eps, rows
        return (per_row * keep).sum() / n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, lse, safe, keep, n = ctx.saved_tensors
        eps, rows = ctx.eps, ctx.rows
        scale = grad.float() * keep / n  # (N,) zero on pad rows
        out = torch.empty_like(logits)
        for a in range(0, logits.shape[0], rows):
            sc = scale[a: a + rows, None]  # (r, 1)
            g = logits[a: a + rows].to(torch.float32, copy=True)  # (r, V)
            g.sub_(lse[a: a + rows, None]).exp_().mul_(sc)  # softmax * scale
            if eps:
                g.sub_(sc * (eps / logits.shape[1]))
            g.scatter_add_(1, safe[a: a + rows, None], sc * -(1.0 - eps))
            out[a: a + rows] = g
        return out, None, None, None


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pad: int, eps: float = 0.0) -> torch.Tensor:
    """Mean label-smoothed cross entropy over positions whose target is not `pad`. logits (N, V), target (N,).
    Equals F.cross_entropy(logits.float(), target, ignore_index=pad, label_smoothing=eps) (tests/test_train.py)."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {eps}")
    return _SmoothedCrossEntropy.apply(logits, target, pad, float(eps))


def torch_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pad: int, eps: float = 0.0) -> torch.Tensor:
    """The same loss through torch's own ops (the reference for tests and the benchmark's baseline)."""
    return F.cross_entropy(logits.float(), target, ignore_index=pad, label_smoothing=eps)
