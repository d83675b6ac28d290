"""Which ONNX Runtime execution provider a runtime gets: the CUDA EP only where onnxruntime has it and the CUDA
driver sees a device (asked directly, so no failing CUDA session is ever attempted), else the CPU EP.

TORCH-FREE. Does not own: sessions (serving/engine/runtime.py).
"""

from __future__ import annotations

import ctypes

import onnxruntime as ort

CPU_EP, CUDA_EP = "CPUExecutionProvider", "CUDAExecutionProvider"
_PROVIDER_ALIASES = {"cpu": CPU_EP, "cuda": CUDA_EP, CPU_EP: CPU_EP, CUDA_EP: CUDA_EP}


def gpu_visible() -> bool:
    """True when onnxruntime has the CUDA EP and the CUDA driver sees a device (CUDA_VISIBLE_DEVICES is
    honoured by the driver). Asks the driver directly, so no failing CUDA session is ever attempted."""
    if CUDA_EP not in ort.get_available_providers():
        return False
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def choose_provider(requested: str) -> str:
    """The EP for `requested`: "auto" -> CUDA EP if a GPU is usable, else CPU EP; "cpu"/"cuda" or a full EP name
    force one."""
    if requested == "auto":
        return CUDA_EP if gpu_visible() else CPU_EP
    if requested not in _PROVIDER_ALIASES:
        raise ValueError(f"provider {requested!r} is not supported; use one of {['auto', *_PROVIDER_ALIASES]}")
    ep = _PROVIDER_ALIASES[requested]
    if ep == CUDA_EP and not gpu_visible():
        raise ValueError(
            "provider 'cuda' was requested but no GPU is visible to onnxruntime "
            f"(available providers: {ort.get_available_providers()}); use 'auto' or 'cpu'"
        )
    return ep
