"""Test helper: export a tiny PyTorch model to a verified kvserve bundle (for the engine tests).

Uses the export helper's own functions (export/onnx_export.export_model, run once per model and test run by
tests/export_once.py; export/bundle.write_manifest); the tokenizer is a small trained byte-level BPE so the
bundle is complete, though the engine never reads it (the API tests encode text with it).

`cached_bundle`'s models: for generate a random one (`tiny_model`), which never ends on its own; for
translate the export tests' tiny translator (tests/helpers_tiny.py: 2 + 3 layers, fitted to a few sentence
pairs), whose export they share. Its greedy and beam outputs vary and some end early with eos, where a random
translator repeats one token; the engine works on token ids, so that it was fitted with another tokenizer
than this bundle's (300 ids both) does not matter.
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
    """(bundle dir, PyTorch model) of the tiny model of `task` (see above), exported once per test process.
    The bundle lives in a temporary directory removed when the process exits."""
    if task not in _CACHE:
        import atexit
        import shutil
        import tempfile

        # as tests/helpers_tiny.py: the machine is shared, and one thread is faster than two oversubscribed
        # (the export, and the tests that run this model as the reference)
        torch.set_num_threads(1)
        root = Path(tempfile.mkdtemp(prefix=f"kvserve-{task}-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        if task == "translate":
            from model.checkpoint import load_checkpoint
            from tests.helpers_tiny import session_checkpoint

            ck = load_checkpoint(session_checkpoint(root, task))
            model, cfg = ck.model, ck.config
        else:
            model, cfg = tiny_model(task)
        _CACHE[task] = (write_bundle(model, cfg, task, root / "bundle"), model)
    return _CACHE[task]
