"""Bundle variants: int8 (CPU) and fp16 (CUDA) graphs beside the fp32 reference.

Owns: int8 quantization of the MatMul/Gemm weights of exported graphs, the way CTranslate2 quantizes on the
CPU: weights int8 per output channel, each activation row quantized at run time with its own scale, int8 x int8
products with exact int32 sums (ONNX Runtime's `MatMulIntegerToFloat`, MLAS's u8s8 kernels: 2-2.7x faster
than ORT's float32 MatMul at 32 rows on a 256-wide model, where its `MatMulNBits` 8-bit kernel was no faster
than float32). Per-row scales keep a row's result independent of the other rows of its batch, which the
continuous engine relies on (a request's tokens must not depend on what else runs); ORT's dynamic
quantization (`quantize_dynamic`) scales activations per tensor and breaks that (a prompt's logits alone and in
an 8-row batch differ: docs/bundle.md): it stays available as the `int8-dynamic` variant.
Also owns the structural check of fp16 graphs
(every float initializer, input and output is float16). fp16 graphs themselves are exported straight from
the half-precision PyTorch model (export/onnx_export.py, float_dtype="float16"), so the attention mask uses
float16's most negative finite value instead of a float32 constant squeezed into float16.

Does not own: the export (export/onnx_export.py), quality figures (export/parity.py): a variant ships with
its measured quality change, which the export records in the manifest.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def quantize_int8(path: Path) -> None:
    """Replace the graph at `path` by its int8 version (see `rows_int8`)."""
    model = rows_int8(onnx.load(str(path)))
    tmp = path.with_name(path.name + ".int8.tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)


def rows_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every MatMul (and Gemm) with a constant float32 2-D weight becomes int8 x int8 with int32 sums:
    weights symmetric int8 per output column, activations quantized per row at run time (uint8 around 128, the
    row's max |x| -> 127). Each activation is quantized once for all the products that read it, and one zero
    point tensor serves every activation of the same symbolic row shape. A row's int32 sums are exact and its
    scales its own, so its result does not depend on the other rows of its batch."""
    g = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 21:
        raise ValueError(f"int8 needs opset >= 21 (blocked QuantizeLinear); the graph has opset {opset}")
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: v.type.tensor_type.shape for v in (*inferred.graph.value_info, *inferred.graph.input)}
    weights = {i.name: i for i in g.initializer}
    readers = Counter(name for n in g.node for name in n.input)
    rw = _RowQuantizer(shapes)
    nodes: list[onnx.NodeProto] = []
    quantized_weights: set[str] = set()
    for n in g.node:
        w = _constant_weight(n, weights)
        if w is None:
            nodes.append(n)
            continue
        x, y = n.input[0], n.output[0]
        q, scale = rw.quantize(x, w.shape[0], nodes)
        name = n.input[1]
        if name not in quantized_weights:  # a weight two products read is quantized once
            quantized_weights.add(name)
            wq, ws = _int8_columns(w)
            rw.inits += [numpy_helper.from_array(wq, f"{name}/int8"), numpy_helper.from_array(ws, f"{name}/int8_scale")]
            if readers[name] == 1:
                g.initializer.remove(weights[name])
        # (x_q - 128) @ w_q times the row's scale (a_scale, one per row) and the column's; a Gemm's bias is added
        # after it (passed as the kernel's own bias input with per-row scales, ORT 1.32 gave 10% errors)
        bias = n.input[2] if len(n.input) > 2 and n.input[2] else None
        nodes.append(
            helper.make_node(
                "MatMulIntegerToFloat",
                [q, f"{name}/int8", scale, f"{name}/int8_scale", "int8/zero_point"],
                [f"{y}/int8" if bias else y],
                domain="com.microsoft",
            )
        )
        if bias:
            nodes.append(helper.make_node("Add", [f"{y}/int8", bias], [y]))
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(rw.inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _constant_weight(n: onnx.NodeProto, weights: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    """The (K, N) float32 weight of a MatMul x @ W or a Gemm x @ W^T (+ bias) with a constant W, else None."""
    w = weights.get(n.input[1]) if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 else None
    if w is None or len(w.dims) != 2 or w.data_type != TensorProto.FLOAT:
        return None
    a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
    if n.op_type == "Gemm":
        if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
            return None
        return numpy_helper.to_array(w).T if a.get("transB", 0) else numpy_helper.to_array(w)
    return numpy_helper.to_array(w)


def _int8_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output column: (int8 weights (K, N), float32 scales (N,))."""
    scale = np.abs(w).max(axis=0) / 127.0
    scale[scale == 0] = 1.0
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


class _RowQuantizer:
    """Builds the nodes that quantize an activation per row (blocked QuantizeLinear with one block per row):
    scale = max|x| / 127 over the last axis; q = round(x / scale) + 128 as uint8. A row of zeros gets scale 0,
    and the product, scaled by it, is 0 (plus a Gemm's bias) whatever q holds."""

    def __init__(self, shapes: dict[str, Any]) -> None:
        self.shapes, self.inits = (
            shapes,
            [
                numpy_helper.from_array(np.array([-1], np.int64), "int8/last_axis"),
                numpy_helper.from_array(np.array(1.0 / 127, np.float32), "int8/inv127"),
                numpy_helper.from_array(np.array(128, np.uint8), "int8/zero_point"),
                numpy_helper.from_array(np.array([128], np.uint8), "int8/zero_point_1"),
            ],
        )
        self.done: dict[str, tuple[str, str]] = {}  # activation -> (uint8 tensor, row scales)
        self.zero_points: dict[tuple, str] = {}  # symbolic row shape -> a zero-point tensor of that shape

    def quantize(self, x: str, k: int, nodes: list[onnx.NodeProto]) -> tuple[str, str]:
        if x in self.done:
            return self.done[x]
        p = f"int8/{len(self.done)}"
        nodes += [
            helper.make_node("Abs", [x], [f"{p}/abs"]),
            helper.make_node("ReduceMax", [f"{p}/abs", "int8/last_axis"], [f"{p}/max"], keepdims=1),
            helper.make_node("Mul", [f"{p}/max", "int8/inv127"], [f"{p}/scale"]),
        ]
        rows = self._row_shape(x)
        zp = self.zero_points.get(rows) if rows else None
        if zp is None:
            zp = f"{p}/zero_point"
            nodes += [
                helper.make_node("Shape", [f"{p}/scale"], [f"{p}/shape"]),
                helper.make_node("Expand", ["int8/zero_point_1", f"{p}/shape"], [zp]),
            ]
            if rows:
                self.zero_points[rows] = zp
        nodes.append(helper.make_node("QuantizeLinear", [x, f"{p}/scale", zp], [f"{p}/q"], axis=-1, block_size=k))
        self.done[x] = (f"{p}/q", f"{p}/scale")
        return self.done[x]

    def _row_shape(self, x: str) -> tuple | None:
        """The symbolic dims of x but the last (None unless every dim is named or fixed)."""
        shape = self.shapes.get(x)
        if shape is None or not shape.dim:
            return None
        dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in shape.dim[:-1]]
        return tuple(dims) if all(d is not None and d != "" for d in dims) else None


def quantize_int8_dynamic(path: Path, per_channel: bool = True) -> None:
    """Replace the graph at `path` by its dynamic-int8 version (MatMul weights int8 per output channel, activations
    uint8 quantized per tensor at run time: ORT fuses DynamicQuantizeLinear + MatMulInteger into DynamicQuantizeMatMul).
    A row's result depends on the other rows of its batch. Weights in 7 bits (`reduce_range`): on x86 CPUs without VNNI,
    ORT's u8 x s8 sums of 8-bit weights saturate (serving/engine/int8_fit.py)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = path.with_name(path.name + ".int8.tmp")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer advises "pre-processing" through the root logger
    try:
        quantize_dynamic(
            str(path),
            str(tmp),
            op_types_to_quantize=["MatMul"],
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            reduce_range=True,
        )
    finally:
        root.setLevel(level)
    os.replace(tmp, path)


def float_types(path: Path) -> Counter:
    """Element types of the float initializers, inputs and outputs of a graph: {"float32": n, ...}."""
    model = onnx.load(str(path))
    g = model.graph
    types = [i.data_type for i in g.initializer] + [v.type.tensor_type.elem_type for v in (*g.input, *g.output)]
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
    return Counter(onnx.helper.tensor_dtype_to_np_dtype(t).name for t in types if t in floats)


def check_fp16(path: Path) -> None:
    """Every float initializer, input and output of an fp16 graph is float16."""
    counts = float_types(path)
    others = {k: v for k, v in counts.items() if k != "float16"}
    if others or not counts:
        raise ValueError(f"fp16 graph {path} holds non-float16 float tensors: {dict(counts)}")


def count_ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
