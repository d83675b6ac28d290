"""Test helper: export a tiny random PyTorch model to a verified kvserve bundle (for the engine tests).

Uses the export helper's own functions (export/onnx_export.export_model, run once per model and test run by
tests/export_once.py; export/bundle.write_manifest); the tokenizer is a small trained byte-level BPE so the
bundle is complete, though the engine never reads it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from export_once import export_model_once

from export.bundle import graph_contracts, write_manifest
from model.config import preset
from model.tokenizer import Tokenizer
from model.transformer import build_model


def tiny_model(task: str, vocab: int = 300, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = preset("tiny", task, vocab).replace(**overrides)
    return build_model(cfg).eval(), cfg


def write_bundle(model, cfg, task: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    export_model_once(model, out)
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog"] * 8, vocab_size=cfg.vocab_size)
    tok.save(out / "tokenizer.json")
    manifest = {
        "task": task, "model_config": cfg.to_dict(), "variant": "fp32",
        "graphs": {k: c.to_dict() for k, c in graph_contracts(cfg).items()},
        "tokenizer": {"file": "tokenizer.json", "special_ids": tok.special_ids},
    }
    write_manifest(out, manifest)
    return out


_CACHE: dict[str, tuple] = {}


def cached_bundle(task: str) -> tuple[Path, object]:
    """(bundle dir, PyTorch model) of a tiny random model for `task`, exported once per test process."""
    if task not in _CACHE:
        import tempfile

        # as tests/helpers_tiny.py: the machine is shared, and one thread is faster than two oversubscribed
        # (the export, and the tests that run this model as the reference)
        torch.set_num_threads(1)
        model, cfg = tiny_model(task)
        out = Path(tempfile.mkdtemp(prefix=f"kvserve-{task}-")) / "bundle"
        _CACHE[task] = (write_bundle(model, cfg, task, out), model)
    return _CACHE[task]
