"""decoder_cpu.onnx's attention: ONNX Runtime's `com.microsoft.GroupQueryAttention` for the decoder's self- and
cross-attention (export-time only; the CPU EP runs the graph, see export/contract.py).

Owns: the two export forms of attention that replace model.transformer's on the export copy of a decoder layer.
Does not own: which graph they go into (export/onnx_export.py `CpuDecoderStepGraph`) or the contract.

- Self-attention: one kernel over the shared (in-place) cache with per-row lengths (seqlens_k = write_pos +
  input_len - 1); it writes the new keys/values at seqlens_k + 1 - new_tokens, causally masked.
- Cross-attention over each row's own source length: the kernel always appends its "new" key/value at position
  seqlens_k and attends over [0, seqlens_k]. With seqlens_k = src_len - 1 and the row's last source key/value as
  the new token it writes that key/value back where it already is (past and present bound to the same memory)
  and reads only the row's own positions, where ONNX `Attention` reads the cross buffers' whole width, padding
  included (docs/decisions/cross-attention-gqa.md). One new token per row only: with several, the kernel's causal
  mask would hide the last source positions from the earlier queries.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from model.transformer import KV, MultiHeadAttention


def qkv_proj(attn: MultiHeadAttention) -> nn.Linear:
    """The fused q/k/v projection that export/onnx_export.py `_for_export` adds to a self-attention."""
    return cast(nn.Linear, attn.qkv_proj)


def gqa(
    q: Tensor,
    k_new: Tensor | None,
    v_new: Tensor | None,
    past: KV,
    seqlens_k: Tensor,
    total_len: Tensor,
    n_heads: int,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """GroupQueryAttention on (B, T, H*Dh) queries (packed q/k/v when k_new is None): (y, present_k, present_v)."""
    y, k_out, v_out = torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::GroupQueryAttention",
        (q, k_new, v_new, past[0], past[1], seqlens_k, total_len),
        {"num_heads": n_heads, "kv_num_heads": n_heads, "scale": head_dim**-0.5},
        dtypes=(q.dtype, past[0].dtype, past[1].dtype),
        shapes=((*q.shape[:-1], n_heads * head_dim), past[0].shape, past[1].shape),
        version=1,
    )
    return y, k_out, v_out


def gqa_self_attention(
    self: MultiHeadAttention,
    x: Tensor,
    cache: KV,
    write_pos: Tensor,
    allowed: Tensor,
    *,
    seqlens_k: Tensor,
    total_len: Tensor,
) -> tuple[Tensor, KV]:
    """MultiHeadAttention.forward_cached as decoder_cpu.onnx exports it (write_pos and allowed are implied by
    seqlens_k). The packed q/k/v projection is `_for_export`'s `qkv_proj`: the kernel splits the heads."""
    qkv = qkv_proj(self)(x)  # (B, T, 3D)
    y, k_cache, v_cache = gqa(qkv, None, None, cache, seqlens_k, total_len, self.n_heads, self.head_dim)
    return self.out_proj(y), (k_cache, v_cache)


def cross_positions(src_len: Tensor, cross_key: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What every layer's cross-attention shares, computed once per step (all cross buffers have one shape):
    (the row of each (row, head)'s last source position in a buffer seen as (B*H*W, Dh), seqlens_k, W)."""
    b, h, w, _ = cross_key.shape
    last = src_len - 1
    heads = torch.arange(h).view(1, h) * w + torch.arange(b).view(b, 1) * (h * w)
    rows = (heads + last.view(b, 1)).reshape(b * h)
    width = torch.ones(w, dtype=torch.int32).sum(dtype=torch.int32)  # W from the shape: present as wide as past
    return rows, last.to(torch.int32), width


def gqa_cross_attend(
    self: MultiHeadAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    *,
    positions: tuple[Tensor, Tensor, Tensor],
    sink: list[KV],
) -> Tensor:
    """MultiHeadAttention.attend for cross-attention of one new token per row over the row's own source: q (B, H,
    1, Dh), k/v the cross buffers (B, H, W, Dh), `positions` from `cross_positions`. The kernel's present
    keys/values (the same values) go to `sink`: graph outputs, bound to the cross buffers themselves."""
    b, h, t, dh = q.shape
    rows, seqlens_k, width = positions
    # Each row's last key/value, (B, H*Dh): one Gather of B*H rows of Dh values (GatherElements took 0.39 ms of a
    # 32-row int8 step for the 8 buffers; advanced indexing k[rows, :, last] exports as a Transpose of the buffer)
    k_last = k.reshape(-1, dh).index_select(0, rows).reshape(b, 1, h * dh)
    v_last = v.reshape(-1, dh).index_select(0, rows).reshape(b, 1, h * dh)
    q_flat = q.transpose(1, 2).reshape(b, t, h * dh)
    y, k_out, v_out = gqa(q_flat, k_last, v_last, (k, v), seqlens_k, width, h, dh)
    sink.append((k_out, v_out))
    return self.out_proj(y)
