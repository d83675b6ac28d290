"""The one model configuration: a frozen dataclass with named presets.

The same object is saved in checkpoints and in bundle manifests, so a model can always be rebuilt
from its config alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any


ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")  # gelu: exact (erf); gelu_tanh: the tanh approximation
POSITION_LAYOUTS = ("interleaved", "halves")


class Arch(str, Enum):
    ENCODER_DECODER = "encoder_decoder"  # translation
    DECODER_ONLY = "decoder_only"  # language model (generation)


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch = Arch.ENCODER_DECODER
    vocab_size: int = 8000
    d_model: int = 256
    n_heads: int = 4
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    d_ff: int = 1024
    dropout: float = 0.1  # on embeddings and each sublayer's output (before the residual add)
    attention_dropout: float | None = None  # on the attention weights; None = `dropout`
    activation_dropout: float | None = None  # on the feed-forward's ReLU output; None = `dropout`
    max_len: int = 256  # longest sequence (prompt + generated) the positional table and KV cache cover
    pre_norm: bool = True  # False = post-norm, as in the paper
    tie_embeddings: bool = True  # share source/target embeddings and the output projection
    pad_id: int = 0
    # Options of imported models (model/marian.py); the defaults are the reference notes' model.
    activation: str = "relu"  # the feed-forward's: one of ACTIVATIONS
    positions: str = "interleaved"  # sinusoid layout: "interleaved" (sin even dims, cos odd) or "halves" (Marian)
    scale_embedding: bool = True  # token embeddings times sqrt(d_model)
    logits_bias: bool = False  # a bias on the output logits (Marian's final_logits_bias)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            p = getattr(self, name)
            if p is not None and not 0.0 <= p < 1.0:
                raise ValueError(f"{name}={p} must be in [0, 1)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not supported; choose one of {ACTIVATIONS}")
        if self.positions not in POSITION_LAYOUTS:
            raise ValueError(f"positions={self.positions!r} is not supported; choose one of {POSITION_LAYOUTS}")
        if self.d_model % 2:
            raise ValueError(f"d_model={self.d_model} must be even (sinusoidal positions pair sin and cos)")
        if isinstance(self.arch, str) and not isinstance(self.arch, Arch):
            object.__setattr__(self, "arch", Arch(self.arch))

    @property
    def attn_p(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def act_p(self) -> float:
        return self.dropout if self.activation_dropout is None else self.activation_dropout

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["arch"] = self.arch.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# Presets are per task because the LM has no encoder. `base` is the paper's model.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "translate": dict(d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                          dropout=0.0, max_len=64),
        "generate": dict(d_model=32, n_heads=4, n_encoder_layers=0, n_decoder_layers=2, d_ff=64,
                         dropout=0.0, max_len=64),
    },
    "small": {
        # 2 encoder + 4 decoder layers: at the same step count valid chrF 28.08 vs 27.11 (3+3) and 27.92 (1+5);
        # 4+2 was far behind (16.1 vs 20.2 at step 1,200). No dropout on attention weights and ReLU outputs
        # (as fairseq's transformer): 1.1x faster steps at the same valid chrF. Figures and commands in
        # docs/decisions/translator-shape.md.
        "translate": dict(d_model=256, n_heads=4, n_encoder_layers=2, n_decoder_layers=4, d_ff=1024,
                          dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, max_len=160),
        "generate": dict(d_model=256, n_heads=4, n_encoder_layers=0, n_decoder_layers=4, d_ff=1024,
                         dropout=0.1, max_len=256),
    },
    "base": {
        "translate": dict(d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048,
                          dropout=0.1, max_len=256),
        "generate": dict(d_model=512, n_heads=8, n_encoder_layers=0, n_decoder_layers=6, d_ff=2048,
                         dropout=0.1, max_len=512),
    },
}

TASK_ARCH = {"translate": Arch.ENCODER_DECODER, "generate": Arch.DECODER_ONLY}


def preset(name: str, task: str, vocab_size: int, pad_id: int = 0) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    if task not in TASK_ARCH:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASK_ARCH)}")
    return ModelConfig(arch=TASK_ARCH[task], vocab_size=vocab_size, pad_id=pad_id, **PRESETS[name][task])
