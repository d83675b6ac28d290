"""Test helper: each distinct tiny model is exported to ONNX once per test run, however many bundles use it.

torch.onnx's dynamo export of a tiny model takes 5-15 s on a 2-core machine (tracing and decomposition, not
the model's size), which was half the default suite when every bundle paid for its own. The same weights
come back often: the int8 and int8-dynamic bundles of a checkpoint quantize the float32 graphs its fp32
bundle exports, and tests/engine_bundle.py's random models have the weights of `tiny_checkpoint(...,
train_steps=0)` (same seed, preset and vocabulary).

`export_model_once` is export/onnx_export.export_model memoized on everything its files depend on: the
model's class, config and weights, the float dtype and the opset. A key's first call runs the real export
(its own checks included), so every distinct model is still exported and checked once per run; later calls
copy the saved graphs into their directory. `shared_exports()` puts it in export_model's place for code that
imports it at call time (kvserve.export.build_bundle), so bundles still go through the whole pipeline
(variant, manifest, parity against PyTorch). The cache lives in a temporary directory for this process only:
a change to the export code takes effect on the next run.

Import this module as `export_once` (tests/ is on sys.path under pytest), never as `tests.export_once`:
two module objects would hold two caches.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from export import onnx_export
from export.contract import GraphContract

_real_export_model = onnx_export.export_model
_GRAPHS: dict[str, tuple[Path, dict[str, GraphContract]]] = {}
_ROOT: Path | None = None


def _cache_root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="kvserve-test-exports-"))
        atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    return _ROOT


def model_key(model: torch.nn.Module, float_dtype: str, opset: int) -> str:
    """sha256 of what an export's graphs depend on: class, config, every state tensor, dtype and opset."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    h.update(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(f"{float_dtype}:{opset}".encode())
    return h.hexdigest()


def export_model_once(model, out_dir: Path, float_dtype: str = "float32",
                      opset: int = onnx_export.DEFAULT_OPSET) -> dict[str, GraphContract]:
    """export_model(model, out_dir, float_dtype, opset), the export run at most once per key and test run."""
    key = model_key(model, float_dtype, opset)
    if key not in _GRAPHS:
        graphs = _cache_root() / key[:16]
        _GRAPHS[key] = (graphs, _real_export_model(model, graphs, float_dtype, opset))
    graphs, contracts = _GRAPHS[key]
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in graphs.iterdir():
        shutil.copyfile(f, out_dir / f.name)
    return dict(contracts)


@contextlib.contextmanager
def shared_exports() -> Iterator[None]:
    """Within the block, export.onnx_export.export_model is export_model_once."""
    saved = onnx_export.export_model
    onnx_export.export_model = export_model_once
    try:
        yield
    finally:
        onnx_export.export_model = saved
