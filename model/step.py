"""One training step: the loss of a batch, backward, gradient clipping and the AdamW update.

Owns the optimizer's construction, the step itself, as `kvserve train` runs it,
and the measurement that resolves the precision "auto" for a run. Does not own the batches (model/batching.py),
the learning rate (model/schedule.py, set on the optimizer before each step), the loss's arithmetic
(model/loss.py) nor what the precisions are (model/precision.py).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch

from model.loss import Criterion, smoothed_cross_entropy
from model.precision import Bf16Twin, measure, pick
from model.train_config import TrainConfig


def loss_on(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], cfg: TrainConfig, pad: int,
            smoothing: float, criterion: Criterion = smoothed_cross_entropy) -> tuple[torch.Tensor, int]:
    """The mean loss over the batch's non-pad target tokens, and their count."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16-autocast"):
        if cfg.task == "translate":
            src, lens, tin, tout = batch
            logits = model(src, lens, tin)  # (B, T, V)
        else:
            x, tout = batch
            logits = model(x)  # (B, T, V)
    loss = criterion(logits.reshape(-1, logits.shape[-1]), tout.reshape(-1), pad, smoothing)
    return loss, int((tout != pad).sum())


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool = True) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only; fused: one kernel for all parameters (its update 3.5 vs 10 ms per
    step on the CPU; a whole step of the small translator 258.6 -> 250.5 ms;
    docs/decisions/training-step-cost.md)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9,
                             fused=fused)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...],
               cfg: TrainConfig, pad: int, criterion: Criterion = smoothed_cross_entropy,
               twin: Bf16Twin | None = None) -> tuple[torch.Tensor, int]:
    """One update: loss, backward, gradient clipping, optimizer step. Returns the loss and its token count. With
    a `twin` (precision "bf16") the twin of `model` computes the loss and gradients, `model` is updated."""
    net = twin.pull() if twin else model
    loss, ntok = loss_on(net, batch, cfg, pad, cfg.label_smoothing, criterion)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if twin:
        twin.push_grads()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    return loss, ntok


def choose_precision(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], cfg: TrainConfig,
                     pad: int) -> tuple[str, dict[str, float]]:
    """Resolve the precision "auto" (model/precision.py) by timing a few steps of a copy of the model on `batch`
    in fp32 and in bf16 autocast; returns the choice and the ms per step measured. The model and torch's RNG are left as
    they were."""
    probe = copy.deepcopy(model)
    opt = make_optimizer(probe, cfg)
    twin = Bf16Twin(probe)

    def step(name: str) -> None:
        train_step(probe, opt, batch, replace(cfg, precision=name), pad, twin=twin if name == "bf16" else None)

    ms = measure(step)
    return pick(ms), ms
