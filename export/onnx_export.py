"""PyTorch -> ONNX: the encoder graph and the decoder step graph of a kvserve model.

Owns: the wrapper modules that give model.transformer's cached decode path the flat input/output lists of
export/contract.py, the export-only self-attention (TensorScatter KV write + attention over the live prefix
of the cache), the torch.onnx (dynamo) export call, and the check that a saved graph honours its contract.

Does not own: the model itself (model/transformer.py), bundles and manifests (export/bundle.py), variants
(export/variants.py), parity (export/parity.py).

Graph design (see DESIGN.md "export/"):
- the KV write is ONNX `TensorScatter` (opset 24), emitted with `torch.onnx.ops.symbolic`: ORT's CPU and
  CUDA kernels update the cache in place when `present_*` is bound to the same buffer as `past_*`;
- `F.scaled_dot_product_attention` exports as the fused ONNX `Attention` op (opset >= 23);
- self-attention reads only the live prefix `[:max(write_pos) + new_tokens]` of the M-slot cache, so its
  cost follows the longest live row, not the buffer length (measured on the `small` LM, batch 16,
  write_pos 30, M 256, ORT CPU 1 thread: 3.08 -> 1.89 ms/step). The cache outputs stay full size.
- decoder_cpu.onnx (the CPU EP's graph, see export/contract.py): each self-attention is one
  `com.microsoft.GroupQueryAttention` over the shared (in-place) cache with per-row lengths
  (seqlens_k = write_pos + input_len - 1): no TensorScatter, no prefix copy, each row reads only its own
  cached length. The `small` LM, 28 decode rows at write_pos 100, ORT CPU 1 thread: the live-prefix Slice
  copies were 26% of decoder.onnx's step (ORT profiler). Its kernel accepts a batch of several rows with
  more than one new token only when no row has a cache yet (a first prompt, right-padded);
  serving/engine/runtime.py splits other prefill calls accordingly. A translator's decoder_cpu.onnx also
  does cross-attention with that kernel, over each row's own source (export/gqa.py): one new token per row.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import onnx
import torch
from torch import Tensor, nn

from export.bundle import check_graph_io, graph_contracts
from export.contract import DECODER_CPU_FILE, DECODER_FILE, ENCODER_FILE, NEW_TOKENS, GraphContract
from export.gqa import cross_positions, gqa_cross_attend, gqa_self_attention, qkv_proj
from export.torch_model import layers
from model.config import ModelConfig
from model.transformer import KV, DecoderLayer, DecoderOnlyLM, EncoderDecoder, EncoderLayer, MultiHeadAttention

MIN_OPSET = 24  # TensorScatter
DEFAULT_OPSET = 24
# ONNX protobufs cannot exceed 2 GiB; beyond this the weights go to an external data file.
EXTERNAL_DATA_BYTES = 1_800_000_000


def tensor_scatter(buf: Tensor, new: Tensor, write_pos: Tensor) -> Tensor:
    """ONNX TensorScatter (linear mode): buf[b, :, write_pos[b] + i] = new[b, :, i]; export-time only."""
    return torch.onnx.ops.symbolic(
        "TensorScatter",
        (buf, new, write_pos),
        {"axis": 2, "mode": "linear"},
        dtype=buf.dtype,
        shape=buf.shape,
        version=24,
    )


def _export_self_attention(
    self: MultiHeadAttention, x: Tensor, cache: KV, write_pos: Tensor, allowed: Tensor
) -> tuple[Tensor, KV]:
    """MultiHeadAttention.forward_cached as exported: in-place write, attention over the live prefix."""
    q, k_new, v_new = _fused_qkv(self, x)  # (B, H, T, Dh)
    k = tensor_scatter(cache[0], k_new, write_pos)  # (B, H, M, Dh)
    v = tensor_scatter(cache[1], v_new, write_pos)
    live = (write_pos.max() + x.shape[1]).item()  # every real query position is < live
    torch._check(live >= 1)
    torch._check(live <= k.shape[2])
    y = self.attend(q, k[:, :, :live], v[:, :, :live], allowed[..., :live])
    return y, (k, v)


def _attend_full_mask(self: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """MultiHeadAttention.attend with the mask expanded to (B, 1, T, S): ORT's Attention kernel (1.32)
    rejects a mask that broadcasts over the query dimension, such as the (B, 1, 1, S) padding mask."""
    b, _, t, _ = q.shape
    return MultiHeadAttention.attend(self, q, k, v, allowed.expand(b, 1, t, k.shape[2]))


def _set_method(module: nn.Module, name: str, method: Callable[..., Any]) -> None:
    """Replace a method of `module` (on the export copy): mypy rejects assigning to a method; setattr is the same."""
    setattr(module, name, method)


def _for_export(model: EncoderDecoder | DecoderOnlyLM) -> EncoderDecoder | DecoderOnlyLM:
    """A copy of the model with the export versions of attention (the caller's model is untouched): the
    padding mask expanded for ORT's kernel, and fused projections (one MatMul where the graph had several:
    each self-attention's q/k/v, the encoder's cross-attention keys/values of every decoder layer), as
    CTranslate2 fuses them: fewer, larger GEMMs and ~40% fewer encoder nodes, whose per-node cost dominates
    a short source's encode."""
    model = copy.deepcopy(model).eval()
    for mod in model.modules():
        if isinstance(mod, MultiHeadAttention):
            _set_method(mod, "attend", types.MethodType(_attend_full_mask, mod))
    decoder_layers = layers(model.decoder.layers, DecoderLayer)
    self_attns = [layer.self_attn for layer in decoder_layers]
    for layer in decoder_layers:
        _set_method(layer.self_attn, "forward_cached", types.MethodType(_export_self_attention, layer.self_attn))
    if isinstance(model, EncoderDecoder):
        encoder_layers = layers(model.enc_layers, EncoderLayer)
        for enc_layer in encoder_layers:
            _set_method(enc_layer.self_attn, "forward", types.MethodType(_fused_self_attention, enc_layer.self_attn))
        self_attns += [enc_layer.self_attn for enc_layer in encoder_layers]
        cross_attns = [layer.cross_attn for layer in decoder_layers if layer.cross_attn is not None]
        model.cross_proj = fused_linear([p for ca in cross_attns for p in (ca.k_proj, ca.v_proj)])
        _set_method(model, "cross_kv", types.MethodType(_fused_cross_kv, model))
    for attn in self_attns:
        attn.qkv_proj = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
    return model


def fused_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of the outputs of `linears` (same input)."""
    out = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears), bias=linears[0].bias is not None)
    with torch.no_grad():
        out.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return out.to(linears[0].weight.dtype)


def _fused_qkv(self: MultiHeadAttention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (each (B, H, T, Dh)) from the one fused projection `qkv_proj` that `_for_export` adds."""
    q, k, v = qkv_proj(self)(x).chunk(3, dim=-1)
    return self.split_heads(q), self.split_heads(k), self.split_heads(v)


def _fused_self_attention(self: MultiHeadAttention, x: Tensor, kv_src: Tensor, allowed: Tensor) -> Tensor:
    """MultiHeadAttention.forward for self-attention (kv_src is x), with one q/k/v projection."""
    return self.attend(*_fused_qkv(self, x), allowed)


def _fused_cross_kv(self: EncoderDecoder, memory: Tensor) -> list[KV]:
    """EncoderDecoder.cross_kv with one projection for every layer's keys and values: (B, S, 2L*D) ->
    (B, 2L*H, S, Dh) split into the 2L (B, H, S, Dh) tensors."""
    b, s, _ = memory.shape
    heads = self.cfg.n_heads  # every cross-attention's
    kv = (
        cast(nn.Linear, self.cross_proj)(memory)
        .view(b, s, -1, memory.shape[-1] // heads)
        .transpose(1, 2)
        .split(heads, dim=1)
    )
    return [(kv[2 * i], kv[2 * i + 1]) for i in range(len(kv) // 2)]


class EncoderGraph(nn.Module):
    """(src_ids, src_len) -> cross_key_0, cross_value_0, ... of every decoder layer."""

    def __init__(self, model: EncoderDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor, src_len: Tensor) -> tuple[Tensor, ...]:
        memory = self.model.encode(src_ids, src_len)  # (B, S, D)
        return tuple(t for kv in self.model.cross_kv(memory) for t in kv)  # each (B, H, S, Dh)


class DecoderStepGraph(nn.Module):
    """One decoder step in contract order: (input_ids, input_len, write_pos, past..., [cross..., src_len])."""

    def __init__(self, model: EncoderDecoder | DecoderOnlyLM) -> None:
        super().__init__()
        self.model, self.n_layers = model, model.cfg.n_decoder_layers

    def forward(self, input_ids: Tensor, input_len: Tensor, write_pos: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        n = self.n_layers
        caches = [(rest[2 * i], rest[2 * i + 1]) for i in range(n)]
        if isinstance(self.model, EncoderDecoder):
            cross = [(rest[2 * n + 2 * i], rest[2 * n + 2 * i + 1]) for i in range(n)]
            logits, new = self.model.step(input_ids, input_len, write_pos, caches, cross, rest[4 * n])
        else:
            logits, new = self.model.step(input_ids, input_len, write_pos, caches)
        return (logits, *(t for kv in new for t in kv))


class CpuDecoderStepGraph(DecoderStepGraph):
    """DecoderStepGraph with GroupQueryAttention (decoder_cpu.onnx, export/gqa.py): self-attention, and for
    translation cross-attention over each row's own source (one new token per row; the cross buffers are also
    outputs, `present_cross_*`, bound in place)."""

    def forward(self, input_ids: Tensor, input_len: Tensor, write_pos: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        seqlens_k = (write_pos + input_len - 1).to(torch.int32)
        total_len = (write_pos + input_ids.shape[1]).max().to(torch.int32)
        cross: list[KV] = []
        n = self.n_layers
        positions = cross_positions(rest[4 * n], rest[2 * n]) if isinstance(self.model, EncoderDecoder) else None
        for layer in layers(self.model.decoder.layers, DecoderLayer):
            attn = layer.self_attn
            self_gqa = functools.partial(gqa_self_attention, attn, seqlens_k=seqlens_k, total_len=total_len)
            _set_method(attn, "forward_cached", self_gqa)
            if layer.cross_attn is not None and positions is not None:
                cross_gqa = functools.partial(gqa_cross_attend, layer.cross_attn, positions=positions, sink=cross)
                _set_method(layer.cross_attn, "attend", cross_gqa)
        out = super().forward(input_ids, input_len, write_pos, *rest)
        return (*out, *(t for kv in cross for t in kv))


def example_inputs(contract: GraphContract, cfg: ModelConfig, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Trace examples: batch 3, 4 new tokens, 5 source tokens (all >= 2 so no dimension specializes),
    right-padded rows of different lengths, write positions that differ per row."""
    sizes = {"batch": 3, "new_tokens": 4, "src_tokens": 5}
    ids_dim = next((t.shape[1] for t in contract.inputs if t.name == "input_ids"), NEW_TOKENS)
    new_tokens = ids_dim if isinstance(ids_dim, int) else sizes[ids_dim]  # 1 for a one-token graph
    g = torch.Generator().manual_seed(0)
    values = {
        "src_ids": lambda s: torch.randint(4, cfg.vocab_size, s, generator=g),
        "input_ids": lambda s: torch.randint(4, cfg.vocab_size, s, generator=g),
        "src_len": lambda s: torch.tensor([5, 3, 4]),
        "input_len": lambda s: torch.tensor([4, 1, 3]).clamp(max=new_tokens),
        "write_pos": lambda s: torch.tensor([0, 7, 2]),
    }
    out = []
    for spec in contract.inputs:
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape)
        make = values.get(spec.name)
        out.append(make(shape) if make else torch.randn(shape, generator=g).to(dtype))
    return tuple(out)


def _dynamic_shapes(contract: GraphContract, varargs_from: int | None) -> tuple:
    dyn = [{axis: d for axis, d in enumerate(t.shape) if isinstance(d, str)} for t in contract.inputs]
    if varargs_from is None:
        return tuple(dyn)
    return (*dyn[:varargs_from], tuple(dyn[varargs_from:]))


def export_graph(
    module: nn.Module,
    contract: GraphContract,
    args: tuple[Tensor, ...],
    path: Path,
    opset: int,
    varargs_from: int | None,
) -> None:
    """torch.onnx.export (dynamo) of one wrapper module to `path`, names and dynamic axes from the contract."""
    n_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    external = n_bytes > EXTERNAL_DATA_BYTES
    with _quiet_export():
        program = torch.onnx.export(
            module,
            args,
            input_names=[t.name for t in contract.inputs],
            output_names=[t.name for t in contract.outputs],
            dynamic_shapes=_dynamic_shapes(contract, varargs_from),
            opset_version=opset,
            dynamo=True,
            external_data=external,
            verbose=False,
            optimize=True,
        )
    assert program is not None
    _strip_source_locations(program.model)
    program.save(str(path), external_data=external)


def _strip_source_locations(model: Any) -> None:
    """Drop what the exporter records of the Python source per node (stack traces with file paths, module names):
    the graph's bytes, and so the bundle's version, then depend on the weights and the code's graph only, not on
    where the checkout lies."""
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.metadata_props.clear()
        node.doc_string = None


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """torch.onnx warns and logs a line per missing optional library (torchvision) and per deprecation;
    keep the export report readable."""
    names = ("torch.onnx", "torch._export", "torch.export")
    saved = {n: logging.getLogger(n).level for n in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for n, level in saved.items():
                logging.getLogger(n).setLevel(level)


def export_model(
    model: EncoderDecoder | DecoderOnlyLM, out_dir: Path, float_dtype: str = "float32", opset: int = DEFAULT_OPSET
) -> dict[str, GraphContract]:
    """Export every graph of `model` into out_dir; returns the contracts (each one checked on its graph)."""
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset} is too old: the in-place KV update needs TensorScatter, opset >= {MIN_OPSET}")
    if float_dtype not in ("float32", "float16"):
        raise ValueError(f"float_dtype {float_dtype!r} is not supported; use float32 or float16")
    dtype = torch.float16 if float_dtype == "float16" else torch.float32
    cfg: ModelConfig = model.cfg
    contracts = graph_contracts(cfg, float_dtype)
    m = _for_export(model).to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if "encoder" in contracts:
            assert isinstance(m, EncoderDecoder), "only a translation model has an encoder graph"
            c = contracts["encoder"]
            export_graph(EncoderGraph(m), c, example_inputs(c, cfg, dtype), out_dir / ENCODER_FILE, opset, None)
        c = contracts["decoder"]
        export_graph(DecoderStepGraph(m), c, example_inputs(c, cfg, dtype), out_dir / DECODER_FILE, opset, 3)
        if "decoder_cpu" in contracts:
            c = contracts["decoder_cpu"]
            export_graph(
                CpuDecoderStepGraph(copy.deepcopy(m)),
                c,
                example_inputs(c, cfg, dtype),
                out_dir / DECODER_CPU_FILE,
                opset,
                3,
            )
    for c in contracts.values():
        check_onnx_graph(out_dir / c.file, c)
    return contracts


def check_onnx_graph(path: Path, contract: GraphContract) -> None:
    """onnx.checker (full, with shape inference) + the graph's inputs/outputs equal the contract's."""

    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)

    def io(values) -> list[tuple[str, str, list]]:
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in t.shape.dim]
            out.append((v.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, shape))
        return out

    check_graph_io(contract.to_dict(), io(model.graph.input), io(model.graph.output), str(path))
