"""Test helpers for export/, bundles and the runtime: a tiny checkpoint (model/tiny.py: fitted to eight sentence
pairs) with a real tokenizer, one per task and test session; tests/engine_bundle.py serves its translator too.

Not a conftest (that file is shared): test modules import these and build module-scoped fixtures.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from model.tiny import PAIRS, tiny_checkpoint, tiny_tokenizer  # noqa: F401 (re-exported for the tests)


def copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


_BUNDLES: dict[tuple[str, str], Path] = {}
_CHECKPOINTS: dict[str, Path] = {}
# The tiny translator has unequal depths (2 encoder + 3 decoder layers, the tiny preset has 2 + 2), as the
# shipped one (2 + 4): a graph that mixed up the two depths fails every translate test of its bundles.
OVERRIDES = {"translate": {"n_decoder_layers": 3}, "generate": {}}


def tiny_bundle(base: Path, task: str, variant: str = "fp32") -> Path:
    """A verified bundle of the test run's tiny checkpoint of `task`, built once per test session
    (read-only: copy it with copy_bundle before changing anything). All variants of a task share one
    checkpoint, and fp32, int8 and int8-dynamic its float32 ONNX export (tests/export_once.py)."""
    from export_once import shared_exports

    from export.bundle import Variant
    from kvserve.export import build_bundle

    key = (task, variant)
    if key not in _BUNDLES or not _BUNDLES[key].is_dir():
        checkpoint = session_checkpoint(base, task)
        _BUNDLES[key] = base / f"bundle-{task}-{variant}"
        with shared_exports():
            build_bundle(checkpoint, _BUNDLES[key], Variant(variant), check_sentences=0)
    return _BUNDLES[key]


def session_checkpoint(base: Path, task: str) -> Path:
    """The test run's tiny checkpoint of `task`, fitted once per test session (into `base` the first time)."""
    torch.set_num_threads(1)  # the machine is shared; one thread is faster than two oversubscribed
    if task not in _CHECKPOINTS or not _CHECKPOINTS[task].is_dir():
        _CHECKPOINTS[task] = tiny_checkpoint(base / f"ckpt-{task}", task, **OVERRIDES[task])
    return _CHECKPOINTS[task]


def checkpoint_of(bundle: Path) -> Path:
    """The checkpoint a bundle was exported from (recorded in its manifest)."""
    import json

    return Path(json.loads((bundle / "manifest.json").read_text())["source"]["checkpoint"])
