"""Typed access to the parts of a kvserve PyTorch model (model/transformer.py) for the exporters.

`nn.Module` types what its attributes hold as `Tensor | Module` and a ModuleList's items as `Module`; a
checkpoint's model is any `nn.Module`. These functions give back the classes the model is built of, checked.
Does not own: the model (model/), what an exporter does with it.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from model.transformer import DecoderOnlyLM, EncoderDecoder

M = TypeVar("M", bound=nn.Module)


def kvserve_model(model: nn.Module) -> EncoderDecoder | DecoderOnlyLM:
    """`model` (a checkpoint's) as the kvserve model class it is."""
    if not isinstance(model, (EncoderDecoder, DecoderOnlyLM)):
        raise TypeError(f"expected a kvserve EncoderDecoder or DecoderOnlyLM, got {type(model).__name__}")
    return model


def layers(modules: nn.ModuleList, cls: type[M]) -> list[M]:
    """The modules of a ModuleList, each an instance of `cls` (the class the model builds them of)."""
    out = [m for m in modules if isinstance(m, cls)]
    if len(out) != len(modules):
        raise TypeError(f"expected only {cls.__name__} modules in {type(modules).__name__}")
    return out
