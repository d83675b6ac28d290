"""The Transformer of "Attention Is All You Need", written from scratch.

Owns: sinusoidal positional encoding, scaled dot-product multi-head attention, the causal mask, cross
attention, Add & Norm, the ReLU feed-forward, the output projection (and the options imported Marian models
need: other activations, positions laid out in halves, unscaled embeddings, a logits bias); an encoder-decoder (translation) and a
decoder-only LM built from the same blocks; and the incremental (KV-cache) decoding path.

The cached path is written exactly as the exported ONNX graph works (export/ traces it), so PyTorch and
ONNX Runtime decode the same way:
- a fixed-size cache buffer per layer, keys and values `(B, H, M, Dh)`;
- `write_pos[b]` = how many tokens row b already has cached = absolute position of its first new token;
- new keys/values are written at `write_pos[b] + i` (`kv_write`), and query i of row b may attend to cache
  position j iff `j <= write_pos[b] + i` (the causal mask, built from positions).
Right-padded rows write junk past their length; it is overwritten before any real query can see it.

Does not own: tokenization, training loops, ONNX.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.config import Arch, ModelConfig

KV = tuple[Tensor, Tensor]  # (keys, values), each (B, H, M, Dh)


def neg_inf(dtype: torch.dtype) -> float:
    """The most negative finite value: -inf turns fully masked rows into NaN in ONNX Runtime."""
    return torch.finfo(dtype).min


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean "may attend" mask -> additive scores mask (0 or the most negative finite value)."""
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.full((), neg_inf(dtype), dtype=dtype))


def sinusoidal_table(max_len: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)) ("interleaved", the paper's);
    "halves" puts the same sines in the first half and the cosines in the second (Marian's layout)."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    i2 = torch.arange(0, d_model, 2, dtype=torch.float64)
    angle = pos / torch.pow(10000.0, i2 / d_model)  # (max_len, d/2)
    if layout == "halves":
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.float()


ACTIVATION_FNS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
                  "silu": F.silu}


def kv_write(buf: Tensor, new: Tensor, write_pos: Tensor) -> Tensor:
    """Write `new` (B, H, T, Dh) into `buf` (B, H, M, Dh) at positions write_pos[b] + [0, T).

    Out of place in PyTorch; export/ replaces it by ONNX TensorScatter, which ORT runs in place.
    """
    b, h, t, dh = new.shape
    idx = write_pos[:, None] + torch.arange(t, device=new.device)[None, :]  # (B, T)
    idx = idx.clamp(max=buf.shape[2] - 1)
    return buf.scatter(2, idx[:, None, :, None].expand(b, h, t, dh), new)


def step_mask(write_pos: Tensor, t: int, m: int) -> Tensor:
    """Causal mask for T new queries over an M-slot cache: (B, 1, T, M), True = may attend."""
    q_pos = write_pos[:, None] + torch.arange(t, device=write_pos.device)[None, :]  # (B, T)
    k_pos = torch.arange(m, device=write_pos.device)
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]


def length_mask(lengths: Tensor, s: int) -> Tensor:
    """Key padding mask (B, 1, 1, S): True for the first lengths[b] keys."""
    return (torch.arange(s, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


class Dropout(nn.Module):
    """nn.Dropout with a CPU fast path. On the CPU each element's keep decision is taken from 16 random bits
    (one 64-bit draw of torch's generator per four elements) instead of torch's bernoulli_, which took a quarter
    of a training step of the small translator (torch profiler: 26%, 2.5 ms per call; 23 of the 32 calls per
    step are these module dropouts, the other 9 the attention dropout inside scaled_dot_product_attention,
    which stays torch's). A step is 1.18x faster with this one (measured:
    docs/decisions/training-step-cost.md). The same seeded generator is used, so runs stay reproducible and
    resumable. p is rounded to a multiple of 2^-16; kept values are scaled by 1 / (1 - p) as usual. Elsewhere
    (CUDA) it is F.dropout."""

    def __init__(self, p: float) -> None:
        super().__init__()
        dropped = round(p * 65536)
        if not (0.0 <= p < 1.0 and dropped < 65536):
            raise ValueError(f"dropout probability must be in [0, 1 - 2^-17); got {p}")
        self._p = p
        self._threshold = dropped - 32768  # int16 draws below it drop their element
        self._scale = 65536 / (65536 - dropped)  # 1 / the exact keep probability of the rounded p

    @property
    def p(self) -> float:
        return self._p

    def extra_repr(self) -> str:
        return f"p={self._p}"

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self._p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self._p, True)
        n = x.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-2 ** 63, None)  # all 64 bits
        keep = words.view(torch.int16)[:n].view(x.shape) >= self._threshold
        return x * keep.to(x.dtype).mul_(self._scale)  # a multiply by a mask: cheaper than where() both ways


class MultiHeadAttention(nn.Module):
    """softmax(Q K^T / sqrt(d_k) + mask) V over n_heads heads, then an output projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def split_heads(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, H, T, Dh)
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, x: Tensor) -> KV:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        # q (B, H, T, Dh), k/v (B, H, S, Dh), allowed broadcastable to (B, H, T, S)
        mask = additive_mask(allowed, q.dtype)
        p = self.dropout if self.training else 0.0
        # Training on the CPU: the math kernel. Without attention dropout torch picks its CPU flash kernel, with
        # which a whole training step of the small preset is 1.3x slower (306 vs 237 ms).
        kernel = sdpa_kernel(SDPBackend.MATH) if self.training and q.device.type == "cpu" else nullcontext()
        with kernel:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, H, T, Dh)
        b, _, t, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward(self, x: Tensor, kv_src: Tensor, allowed: Tensor) -> Tensor:
        """Full (training) attention: queries from x, keys/values from kv_src (= x for self-attention)."""
        k, v = self.project_kv(kv_src)
        return self.attend(self.split_heads(self.q_proj(x)), k, v, allowed)

    def forward_cached(self, x: Tensor, cache: KV, write_pos: Tensor, allowed: Tensor) -> tuple[Tensor, KV]:
        """Self-attention for new tokens x (B, T, D) against the cache, which gets their keys/values."""
        k_new, v_new = self.project_kv(x)
        k = kv_write(cache[0], k_new, write_pos)
        v = kv_write(cache[1], v_new, write_pos)
        return self.attend(self.split_heads(self.q_proj(x)), k, v, allowed), (k, v)


class FeedForward(nn.Module):
    """Position-wise FFN: expand to d_ff, ReLU (or the configured activation), project back."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu") -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.drop = Dropout(dropout)
        self.act = ACTIVATION_FNS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Residual(nn.Module):
    """Add & Norm around a sublayer: post-norm LN(x + f(x)) as in the paper, or pre-norm x + f(LN(x))."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm, self.drop, self.pre_norm = nn.LayerNorm(d_model), Dropout(dropout), pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.drop(sublayer(self.norm(x)))
        return self.norm(x + self.drop(sublayer(x)))

    def forward_cached(self, x: Tensor, sublayer) -> tuple[Tensor, KV]:
        """As forward, for a sublayer that also returns its updated cache."""
        y, cache = sublayer(self.norm(x) if self.pre_norm else x)
        out = x + self.drop(y)
        return (out if self.pre_norm else self.norm(out)), cache


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_p)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.act_p, cfg.activation)
        self.res1 = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res2 = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        x = self.res1(x, lambda h: self.self_attn(h, h, allowed))
        return self.res2(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, then (encoder-decoder only) cross-attention, then the FFN."""

    def __init__(self, cfg: ModelConfig, cross: bool) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_p)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_p) if cross else None
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.act_p, cfg.activation)
        self.res_self = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm) if cross else None
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, self_allowed: Tensor, memory: Tensor | None = None,
                mem_allowed: Tensor | None = None) -> Tensor:
        x = self.res_self(x, lambda h: self.self_attn(h, h, self_allowed))
        if self.cross_attn is not None:
            x = self.res_cross(x, lambda h: self.cross_attn(h, memory, mem_allowed))
        return self.res_ffn(x, self.ffn)

    def forward_cached(self, x: Tensor, cache: KV, write_pos: Tensor, self_allowed: Tensor,
                       cross_kv: KV | None = None, mem_allowed: Tensor | None = None) -> tuple[Tensor, KV]:
        x, cache = self.res_self.forward_cached(
            x, lambda h: self.self_attn.forward_cached(h, cache, write_pos, self_allowed))
        if self.cross_attn is not None:
            ca = self.cross_attn
            x = self.res_cross(x, lambda h: ca.attend(ca.split_heads(ca.q_proj(h)), *cross_kv, mem_allowed))
        return self.res_ffn(x, self.ffn), cache


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(d_model) (unless cfg.scale_embedding is off) plus the fixed sinusoidal
    positional encoding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        nn.init.normal_(self.tok.weight, std=cfg.d_model ** -0.5)
        self.register_buffer("pe", sinusoidal_table(cfg.max_len, cfg.d_model, cfg.positions), persistent=False)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.drop = Dropout(cfg.dropout)

    def forward(self, ids: Tensor, positions: Tensor | None = None) -> Tensor:
        # ids (B, T); positions (B, T) absolute positions, default 0..T-1
        if positions is None:
            pe = self.pe[: ids.shape[1]][None]
        else:
            pe = self.pe[positions.clamp(max=self.pe.shape[0] - 1)]
        return self.drop(self.tok(ids) * self.scale + pe)


class Decoder(nn.Module):
    """Decoder stack + final norm + output projection; shared by both architectures."""

    def __init__(self, cfg: ModelConfig, embed: Embedding, cross: bool) -> None:
        super().__init__()
        self.cfg, self.embed = cfg, embed
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross) for _ in range(cfg.n_decoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.logits_bias)
        if cfg.logits_bias:
            nn.init.zeros_(self.lm_head.bias)
        if cfg.tie_embeddings:
            self.lm_head.weight = embed.tok.weight

    def forward(self, tgt: Tensor, memory: Tensor | None = None, mem_allowed: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V). Right padding needs no mask: causality hides it."""
        t = tgt.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt.device).tril()[None, None]
        x = self.embed(tgt)
        for layer in self.layers:
            x = layer(x, causal, memory, mem_allowed)
        return self.lm_head(self.norm(x))

    def step(self, input_ids: Tensor, input_len: Tensor, write_pos: Tensor, caches: list[KV],
             cross: list[KV] | None = None, mem_allowed: Tensor | None = None) -> tuple[Tensor, list[KV]]:
        """Incremental decoding: T new tokens per row (the first input_len[b] are real).

        Returns the logits of each row's last real token (B, V) and the updated caches.
        """
        b, t = input_ids.shape
        m = caches[0][0].shape[2]
        positions = write_pos[:, None] + torch.arange(t, device=input_ids.device)[None, :]
        x = self.embed(input_ids, positions)
        allowed = step_mask(write_pos, t, m)
        new_caches = []
        for i, layer in enumerate(self.layers):
            x, c = layer.forward_cached(x, caches[i], write_pos, allowed,
                                        cross[i] if cross is not None else None, mem_allowed)
            new_caches.append(c)
        last = (input_len - 1).clamp(min=0)
        h = x[torch.arange(b, device=x.device), last]  # (B, D)
        return self.lm_head(self.norm(h)), new_caches

    def empty_cache(self, batch: int, max_len: int | None = None) -> list[KV]:
        m = max_len or self.cfg.max_len
        shape = (batch, self.cfg.n_heads, m, self.cfg.head_dim)
        p = self.lm_head.weight
        return [(p.new_zeros(shape), p.new_zeros(shape)) for _ in self.layers]


class EncoderDecoder(nn.Module):
    """Translation model: encoder over the source, decoder with cross-attention over its states."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.arch == Arch.ENCODER_DECODER
        self.cfg = cfg
        self.embed = Embedding(cfg)  # shared source/target vocabulary and embeddings
        self.enc_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.decoder = Decoder(cfg, self.embed, cross=True)

    def encode(self, src: Tensor, src_len: Tensor) -> Tensor:
        """Encoder states (B, S, D) for right-padded sources with lengths src_len (B,)."""
        allowed = length_mask(src_len, src.shape[1])
        x = self.embed(src)
        for layer in self.enc_layers:
            x = layer(x, allowed)
        return self.enc_norm(x)

    def cross_kv(self, memory: Tensor) -> list[KV]:
        """Cross-attention keys/values of every decoder layer, computed once per request."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder.layers]

    def forward(self, src: Tensor, src_len: Tensor, tgt_in: Tensor) -> Tensor:
        memory = self.encode(src, src_len)
        return self.decoder(tgt_in, memory, length_mask(src_len, src.shape[1]))

    def step(self, input_ids: Tensor, input_len: Tensor, write_pos: Tensor, caches: list[KV],
             cross: list[KV], src_len: Tensor) -> tuple[Tensor, list[KV]]:
        return self.decoder.step(input_ids, input_len, write_pos, caches, cross,
                                 length_mask(src_len, cross[0][0].shape[2]))


class DecoderOnlyLM(nn.Module):
    """Generation model: the decoder stack without cross-attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.arch == Arch.DECODER_ONLY
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.decoder = Decoder(cfg, self.embed, cross=False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.decoder(ids)

    def step(self, input_ids: Tensor, input_len: Tensor, write_pos: Tensor,
             caches: list[KV]) -> tuple[Tensor, list[KV]]:
        return self.decoder.step(input_ids, input_len, write_pos, caches)


def build_model(cfg: ModelConfig) -> EncoderDecoder | DecoderOnlyLM:
    return EncoderDecoder(cfg) if cfg.arch == Arch.ENCODER_DECODER else DecoderOnlyLM(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
