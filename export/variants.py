"""Bundle variants: int8 (CPU) and fp16 (CUDA) graphs beside the fp32 reference.

Owns: int8 quantization of the MatMul weights of exported graphs (onnxruntime.quantization's MatMulNBits
quantizer: weights int8 in blocks of 32 along K, symmetric; accuracy level 4 = the kernel quantizes each
activation row per block at run time and multiplies in int8). Per-row activation scales keep a row's result
independent of the other rows of its batch, which the continuous engine relies on (a request's tokens must
not depend on what else runs); ORT's dynamic quantization (`quantize_dynamic`, the earlier int8 variant) scales
activations per tensor and breaks that (max |logit difference| 0.054 for a prompt alone vs in an 8-row batch);
it stays available as the `int8-dynamic` variant, faster on this CPU where batch-invariance is not needed.
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

import onnx
from onnx import TensorProto


INT8_BLOCK = 32  # K elements per weight scale (and per activation scale at run time)


def quantize_int8(path: Path, block_size: int = INT8_BLOCK) -> None:
    """Replace the graph at `path` by its int8 version: every MatMul with a constant weight becomes a MatMulNBits
    (8-bit weights per block of `block_size`, int8 compute with per-row activation scales: batch-invariant)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    model = onnx.load(str(path))
    algo = mnq.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=4, bits=8)
    quantizer = mnq.MatMulNBitsQuantizer(model, bits=8, block_size=block_size, is_symmetric=True,
                                         accuracy_level=4, algo_config=algo)
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs every node it skips at INFO
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    tmp = path.with_name(path.name + ".int8.tmp")
    onnx.save(quantizer.model.model, str(tmp))
    os.replace(tmp, path)


def quantize_int8_dynamic(path: Path, per_channel: bool = True) -> None:
    """Replace the graph at `path` by its dynamic-int8 version (MatMul weights int8 per output channel, activations
    uint8 quantized per tensor at run time: ORT fuses DynamicQuantizeLinear + MatMulInteger into
    DynamicQuantizeMatMul). A row's result depends on the other rows of its batch."""
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
