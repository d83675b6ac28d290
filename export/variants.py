"""Bundle variants: dynamic int8 (CPU) and fp16 (CUDA) graphs beside the fp32 reference.

Owns: int8 dynamic quantization of the MatMul weights of exported graphs (onnxruntime.quantization,
weights int8 per output channel, activations quantized at run time), and the structural check of fp16 graphs
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

import onnx
from onnx import TensorProto


def quantize_int8(path: Path, per_channel: bool = True) -> None:
    """Replace the graph at `path` by its dynamic-int8 version (MatMul weights int8, activations uint8
    quantized at run time: ORT fuses DynamicQuantizeLinear + MatMulInteger into DynamicQuantizeMatMul)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = path.with_name(path.name + ".int8.tmp")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer advises "pre-processing" through the root logger
    try:
        quantize_dynamic(str(path), str(tmp), op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8,
                         per_channel=per_channel)
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
