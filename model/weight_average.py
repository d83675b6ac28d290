"""An exponential moving average of a model's parameters (Polyak averaging), kept beside them in training.

Owns the average and swapping it into the model and back. Does not own the choice between the average and the
last weights (model/validation.py `better`, made in model/train.py) nor saving it (model/train_state.py).
"""
from __future__ import annotations

import torch


class WeightAverage:
    """Exponential moving average of the parameters, with a warm-up of the decay so the average is not
    dominated by the random initial weights. `swap()` exchanges the model's weights and the average."""

    def __init__(self, model: torch.nn.Module, decay: float, state: list[torch.Tensor] | None = None) -> None:
        self.params = [p for p in model.parameters()]
        self.decay = decay
        self.shadow = [t.clone() for t in state] if state else [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - d)

    @torch.no_grad()
    def swap(self) -> None:
        for p, s in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)
