"""Opening the ONNX Runtime sessions of a bundle's graphs (serving/engine/runtime.py holds them).

Owns: the session options (threads set explicitly, sequential execution, errors-only logging, an optional
profile), the execution-provider list (TF32 off for fp32 bundles), refusing a CUDA session that came up without
the CUDA EP (ORT falls back to the CPU EP when the CUDA or cuDNN libraries cannot be loaded), 7-bit int8 weights
where the CPU's int8 sums would saturate (serving/engine/int8_fit.py), and checking each graph's inputs and outputs
against the bundle's graph contract.

TORCH-FREE. Does not own: which provider (serving/engine/providers.py), the KV slots or the runs (runtime.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort

from export.bundle import check_graph_io
from serving.engine.int8_fit import fit_int8_weights, int8_sums_can_overflow
from serving.engine.providers import CPU_EP, CUDA_EP

_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64"}


def execution_providers(provider: str, dtype: np.dtype) -> list:
    """The `providers` argument of a session on `provider` for a bundle of float type `dtype`."""
    if provider == CPU_EP:
        return [CPU_EP]
    # TF32 rounds fp32 matmul inputs to 10 mantissa bits: off for the fp32 (reference) variant
    tf32 = "0" if dtype == np.float32 else "1"
    return [(CUDA_EP, {"device_id": "0", "use_tf32": tf32}), CPU_EP]


def open_session(
    model: bytes, provider: str, providers: list, threads: int, profile_file_prefix: str | None, fit_int8: bool
) -> ort.InferenceSession:
    """A session of `model` (its bytes) on `provider`; `fit_int8`: a graph of the bundle on the CPU EP, whose
    int8 weights may need 7 bits."""
    if fit_int8 and int8_sums_can_overflow():
        model = fit_int8_weights(model)  # 7-bit int8 weights where ORT's int8 sums would saturate (int8_fit.py)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # errors only: step() itself checks that the KV update stayed in place
    if profile_file_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_file_prefix
    sess = ort.InferenceSession(model, so, providers=providers)
    if provider == CUDA_EP and CUDA_EP not in sess.get_providers():
        raise RuntimeError(
            "onnxruntime could not start its CUDA execution provider (the session has only "
            f"{sess.get_providers()}): the CUDA or cuDNN libraries it needs are not loadable. "
            "`python -m bench.gpu_check --device cuda --out DIR` lists what is found; provider 'cpu' serves "
            "on the CPU meanwhile"
        )
    return sess


def check_session_io(sess: ort.InferenceSession, contract: dict[str, Any], where: str) -> None:
    """The graph's inputs and outputs (name, dtype, shape) as loaded must be its contract's (export/bundle.py)."""

    def io(args: list) -> list[tuple[str, str, list]]:
        return [(a.name, _ORT_TYPES.get(a.type, a.type), a.shape) for a in args]

    check_graph_io(contract, io(sess.get_inputs()), io(sess.get_outputs()), where)
