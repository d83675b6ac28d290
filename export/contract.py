"""The ONNX contract: every graph's inputs and outputs (name, dtype, symbolic shape), declared once.

export/ builds graphs that honour it and serving/ binds buffers by it, so names cannot drift. This module
imports neither torch nor onnxruntime.

Graphs of a bundle:
- translation: `encoder.onnx` (source -> cross-attention keys/values of every decoder layer) and
  `decoder.onnx` (one step of the decoder, prefill or decode, with the self-attention KV cache);
- generation: `decoder.onnx` only (no cross inputs);
- both, fp32/int8 variants with head_dim % 8 == 0: `decoder_cpu.onnx` beside `decoder.onnx`, its
  self-attention being ONNX Runtime's `com.microsoft.GroupQueryAttention` (in-place KV write, each row attends
  over its own cached length only, no copy of the live cache prefix). The CPU EP runs it; `decoder.onnx`
  (standard ONNX ops only) is the portable graph every EP can run (CUDA runs that one). A translator's
  `decoder_cpu.onnx` does its cross-attention with that kernel too, over each row's own source length: it takes
  one new token per row only (`input_ids` (batch, 1)), and its cross buffers are also outputs
  (`present_cross_key_i`, `present_cross_value_i`, the same values): bind them to the inputs' buffers.

Decoder step semantics (the same as model.transformer's cached path):
- `input_ids[b, :input_len[b]]` are row b's new tokens (right-padded to new_tokens);
- `write_pos[b]` = tokens already cached for row b = absolute position of its first new token;
- the new keys/values are written at write_pos[b] + i; query i may attend to cache position j iff
  j <= write_pos[b] + i; `present_*` are the updated caches: bind them (IOBinding) to the same buffers as
  `past_*` and ORT updates the cache in place;
- `logits[b]` are the logits of row b's last real new token.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_VERSION = 2  # 2: a translator's decoder_cpu.onnx takes one token per row and outputs its cross buffers
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder.onnx"
DECODER_CPU_FILE = "decoder_cpu.onnx"

# Symbolic dimension names.
BATCH, NEW_TOKENS, SRC_TOKENS = "batch", "new_tokens", "src_tokens"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16"
    shape: tuple[str | int, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphContract:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }


def past_key(i: int) -> str:
    return f"past_key_{i}"


def past_value(i: int) -> str:
    return f"past_value_{i}"


def present_key(i: int) -> str:
    return f"present_key_{i}"


def present_value(i: int) -> str:
    return f"present_value_{i}"


def cross_key(i: int) -> str:
    return f"cross_key_{i}"


def cross_value(i: int) -> str:
    return f"cross_value_{i}"


def present_cross_key(i: int) -> str:
    return f"present_cross_key_{i}"


def present_cross_value(i: int) -> str:
    return f"present_cross_value_{i}"


@dataclass(frozen=True)
class Dims:
    """The model dimensions a contract depends on (from model.config.ModelConfig)."""

    n_layers: int  # decoder layers
    n_heads: int
    head_dim: int
    max_len: int  # KV cache length M
    vocab_size: int
    float_dtype: str = "float32"


def encoder_contract(d: Dims) -> GraphContract:
    kv = (BATCH, d.n_heads, SRC_TOKENS, d.head_dim)
    outputs = []
    for i in range(d.n_layers):
        outputs += [TensorSpec(cross_key(i), d.float_dtype, kv), TensorSpec(cross_value(i), d.float_dtype, kv)]
    return GraphContract(
        ENCODER_FILE,
        (TensorSpec("src_ids", "int64", (BATCH, SRC_TOKENS)), TensorSpec("src_len", "int64", (BATCH,))),
        tuple(outputs),
    )


def decoder_contract(d: Dims, cross: bool) -> GraphContract:
    cache = (BATCH, d.n_heads, d.max_len, d.head_dim)
    inputs = [
        TensorSpec("input_ids", "int64", (BATCH, NEW_TOKENS)),
        TensorSpec("input_len", "int64", (BATCH,)),
        TensorSpec("write_pos", "int64", (BATCH,)),
    ]
    outputs = [TensorSpec("logits", d.float_dtype, (BATCH, d.vocab_size))]
    for i in range(d.n_layers):
        inputs += [TensorSpec(past_key(i), d.float_dtype, cache), TensorSpec(past_value(i), d.float_dtype, cache)]
        outputs += [
            TensorSpec(present_key(i), d.float_dtype, cache),
            TensorSpec(present_value(i), d.float_dtype, cache),
        ]
    if cross:
        kv = (BATCH, d.n_heads, SRC_TOKENS, d.head_dim)
        for i in range(d.n_layers):
            inputs += [TensorSpec(cross_key(i), d.float_dtype, kv), TensorSpec(cross_value(i), d.float_dtype, kv)]
        inputs.append(TensorSpec("src_len", "int64", (BATCH,)))
    return GraphContract(DECODER_FILE, tuple(inputs), tuple(outputs))


def decoder_cpu_contract(d: Dims, cross: bool) -> GraphContract:
    """decoder_cpu.onnx's contract: decoder.onnx's, and for a translator one new token per row and the cross
    buffers as outputs too (see the module docstring)."""
    c = decoder_contract(d, cross)
    if not cross:
        return GraphContract(DECODER_CPU_FILE, c.inputs, c.outputs)
    inputs = tuple(TensorSpec(t.name, t.dtype, (BATCH, 1)) if t.name == "input_ids" else t for t in c.inputs)
    kv = (BATCH, d.n_heads, SRC_TOKENS, d.head_dim)
    outputs = [
        TensorSpec(f(i), d.float_dtype, kv) for i in range(d.n_layers) for f in (present_cross_key, present_cross_value)
    ]
    return GraphContract(DECODER_CPU_FILE, inputs, (*c.outputs, *outputs))


def has_cpu_decoder(d: Dims) -> bool:
    """Whether a bundle of these dims carries decoder_cpu.onnx: float32 graphs (fp32, int8) whose head size
    ONNX Runtime's GroupQueryAttention CPU kernel accepts (a multiple of 8)."""
    return d.float_dtype == "float32" and d.head_dim % 8 == 0
