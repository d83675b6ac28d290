"""int8 weights that ONNX Runtime's CPU kernels multiply exactly on every x86 CPU: `fit_int8_weights`.

ONNX Runtime's uint8 x int8 GEMM (MLAS) on an x86 CPU without VNNI (AVX2 or AVX-512BW only: AMD Zen 2/3, Intel
before Cascade Lake) adds each pair of u8 x s8 products into a 16-bit lane with saturation (`vpmaddubsw`): two
products of 255 x 127 exceed 32,767 and the sum is silently wrong: on an AVX2-only CPU, `MatMulIntegerToFloat`
(ORT 1.32) over random full-range values gives sums off by tens of thousands. With weights within +-64
(2 x 255 x 64 = 32,640 fits) the products are exact (tests/test_int8_fit.py checks it on the CPU it runs on).
With VNNI (`vpdpbusd`: every sum in 32 bits) full-range weights are exact.

So, where the CPU lacks VNNI, the runtime halves the int8 weights of every `MatMulIntegerToFloat` whose weights
reach past +-64 (rounded to the nearest, the column's scale doubled) before it creates the session: 7-bit
weights with exact products instead of 8-bit weights with overflowing ones. Bundles stay as exported (8-bit);
a VNNI CPU runs them unchanged.

Does not own: the quantization itself (export/variants.py `rows_int8`); `int8-dynamic` exports its weights in
7 bits (`reduce_range`) on every CPU.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

SAFE = 64  # |w| <= 64: 2 x 255 x 64 = 32,640 fits a saturating int16 sum of two u8 x s8 products
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_has_vnni(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU's flags (Linux /proc/cpuinfo) name a VNNI instruction set; False when unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(f in flags for f in VNNI_FLAGS)


@lru_cache(maxsize=1)
def int8_sums_can_overflow() -> bool:
    """True on x86 CPUs without VNNI (ONNX Runtime's u8 x s8 kernel saturates there)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86") and not cpu_has_vnni()


def fit_int8_weights(model: bytes) -> bytes:
    """The graph with every `MatMulIntegerToFloat` int8 weight initializer within +-SAFE (halved, its scale
    doubled) where it reached past it; the same bytes when nothing needed it. A weight read by several nodes is
    halved once (each node's scale initializer once)."""
    proto = onnx.load_from_string(model)
    inits = {t.name: t for t in proto.graph.initializer}
    halved: set[str] = set()
    for node in proto.graph.node:
        if node.op_type != "MatMulIntegerToFloat" or len(node.input) < 4:
            continue
        w, scale = inits.get(node.input[1]), inits.get(node.input[3])
        if w is None or scale is None or w.data_type != onnx.TensorProto.INT8:
            continue
        if w.name not in halved:
            q = numpy_helper.to_array(w)
            if np.abs(q.astype(np.int16)).max() <= SAFE:
                continue
            half = np.clip(np.rint(q.astype(np.float32) / 2), -SAFE, SAFE).astype(np.int8)
            w.CopyFrom(numpy_helper.from_array(half, w.name))
        if scale.name not in halved:  # a node reading a halved weight through a scale of its own doubles it too
            scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(2), scale.name))
            halved.add(scale.name)
        halved.add(w.name)
    return proto.SerializeToString() if halved else model
