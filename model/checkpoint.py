"""Checkpoints: a directory with safetensors weights, a JSON description and the tokenizer.

Loading never unpickles arbitrary objects: weights are safetensors, metadata JSON, and the optimizer
state is read with `torch.load(weights_only=True)`.

    CKPT/model.safetensors   weights
    CKPT/checkpoint.json     {"task", "model_config", "step", "metrics", ...}
    CKPT/tokenizer.json      the tokenizer the model was trained with
    CKPT/train_state.pt      optimizer/scheduler/RNG state for --resume (optional)
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from model.config import ModelConfig
from model.tokenizer import Tokenizer
from model.transformer import build_model

WEIGHTS, META, TOKENIZER, TRAIN_STATE = "model.safetensors", "checkpoint.json", "tokenizer.json", "train_state.pt"


@dataclass
class Checkpoint:
    model: torch.nn.Module
    config: ModelConfig
    task: str
    tokenizer: Tokenizer
    meta: dict[str, Any]
    path: Path

    def weights_sha256(self) -> str:
        return file_sha256(self.path / WEIGHTS)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(path: Path, model: torch.nn.Module, cfg: ModelConfig, task: str, tokenizer_file: Path,
                    meta: dict[str, Any], train_state: dict[str, Any] | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # Tied weights are one tensor under two names; safetensors wants each storage once.
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
             if not (cfg.tie_embeddings and k == "decoder.lm_head.weight")}
    save_file(state, str(path / (WEIGHTS + ".tmp")))
    (path / (WEIGHTS + ".tmp")).replace(path / WEIGHTS)
    if tokenizer_file.resolve() != (path / TOKENIZER).resolve():
        shutil.copyfile(tokenizer_file, path / TOKENIZER)
    doc = {"task": task, "model_config": cfg.to_dict(), **meta}
    (path / META).write_text(json.dumps(doc, indent=2))
    if train_state is not None:
        torch.save(train_state, path / (TRAIN_STATE + ".tmp"))
        (path / (TRAIN_STATE + ".tmp")).replace(path / TRAIN_STATE)


def load_checkpoint(path: str | Path, device: str = "cpu") -> Checkpoint:
    path = Path(path)
    for name in (WEIGHTS, META, TOKENIZER):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a kvserve checkpoint: {name} is missing")
    meta = json.loads((path / META).read_text())
    cfg = ModelConfig.from_dict(meta["model_config"])
    model = build_model(cfg)
    state = load_file(str(path / WEIGHTS), device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "decoder.lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    model.eval()
    return Checkpoint(model, cfg, meta["task"], Tokenizer.load(path / TOKENIZER), meta, path)


def load_train_state(path: Path) -> dict[str, Any] | None:
    f = path / TRAIN_STATE
    return torch.load(f, weights_only=True) if f.is_file() else None


def load_model_config(path: str | Path) -> ModelConfig | None:
    """The model config of the checkpoint in `path`, or None when there is none."""
    meta = Path(path) / META
    return ModelConfig.from_dict(json.loads(meta.read_text())["model_config"]) if meta.is_file() else None
