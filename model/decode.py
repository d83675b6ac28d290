"""Greedy decoding and LM scoring in PyTorch, through the KV-cache path (the reference for export parity).

Conventions shared with serving: a translation decoder starts from bos and stops at eos; an LM sequence
starts with bos (prompts get bos prepended).
"""
from __future__ import annotations

import torch
from torch import Tensor

from model.tokenizer import Tokenizer
from model.transformer import DecoderOnlyLM, EncoderDecoder


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad id lists into (B, T) with lengths (B,). Empty sequences get length 0 (one pad column)."""
    t = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out, torch.tensor([len(s) for s in seqs], dtype=torch.long)


@torch.no_grad()
def greedy_translate_ids(model: EncoderDecoder, sources: list[list[int]], bos: int, eos: int,
                         max_new_tokens: int) -> list[list[int]]:
    """Greedy decode a batch of source id lists; returns generated ids without bos/eos."""
    cfg = model.cfg
    src, src_len = pad_batch(sources, cfg.pad_id)
    src_len = src_len.clamp(min=1)  # an empty source still has one (pad) key to attend to
    cross = model.cross_kv(model.encode(src, src_len))
    b = len(sources)
    caches = model.decoder.empty_cache(b)
    steps = min(max_new_tokens, cfg.max_len)
    ids = torch.full((b, 1), bos, dtype=torch.long)
    pos = torch.zeros(b, dtype=torch.long)
    ones = torch.ones(b, dtype=torch.long)
    out = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    for _ in range(steps):
        logits, caches = model.step(ids, ones, pos, caches, cross, src_len)
        nxt = logits.argmax(-1)
        for i in range(b):
            if not done[i]:
                if nxt[i].item() == eos:
                    done[i] = True
                else:
                    out[i].append(nxt[i].item())
        if done.all():
            break
        ids, pos = nxt[:, None], pos + 1
    return out


def translate(model: EncoderDecoder, tok: Tokenizer, texts: list[str], max_new_tokens: int = 128,
              batch_size: int = 64) -> list[str]:
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths -> less padding
    out: list[str] = [""] * len(texts)
    for k in range(0, len(order), batch_size):
        idx = order[k: k + batch_size]
        srcs = [tok.encode(texts[i])[: model.cfg.max_len] for i in idx]
        for i, ids in zip(idx, greedy_translate_ids(model, srcs, tok.bos_id, tok.eos_id, max_new_tokens)):
            out[i] = tok.decode(ids)
    return out


@torch.no_grad()
def lm_nll(model: DecoderOnlyLM, ids: list[int], bos: int, window: int | None = None,
           batch_size: int = 16) -> tuple[float, int]:
    """Total NLL (nats) of a token stream, scored in non-overlapping windows that each start with bos."""
    model.eval()
    window = window or model.cfg.max_len - 1
    chunks = [ids[i: i + window] for i in range(0, len(ids), window)]
    total, count = 0.0, 0
    for k in range(0, len(chunks), batch_size):
        batch = [[bos] + c for c in chunks[k: k + batch_size]]
        x, lens = pad_batch(batch, model.cfg.pad_id)
        logp = torch.log_softmax(model(x[:, :-1]).float(), -1)
        tgt = x[:, 1:]
        mask = torch.arange(tgt.shape[1])[None] < (lens - 1)[:, None]
        nll = -logp.gather(-1, tgt[..., None])[..., 0]
        total += nll[mask].sum().item()
        count += int(mask.sum())
    return total, count
