"""Greedy and beam-search decoding and LM scoring in PyTorch, through the KV-cache path (the reference for export
parity).

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


@torch.no_grad()
def beam_translate_ids(model: EncoderDecoder, sources: list[list[int]], bos: int, eos: int, max_new_tokens: int,
                       beam_size: int, length_penalty: float = 1.0) -> list[list[int]]:
    """Beam search over a batch of sources; returns each one's best hypothesis without bos/eos.

    The served algorithm (its spec: serving/engine/beam.py's docstring), over `beam_size` rows per source whose KV
    caches are reordered by the parents picked, as the engine's slot copies: summed float64 log-probabilities; the
    first step expands beam 0 only; of the best 2k candidates, an eos of rank < k finishes a hypothesis and the
    others extend the live beams until k are found; a source is done once k have finished, or at the length limit
    where its live beams join them; ranked by score / length ** length_penalty, length counting the eos.
    """
    cfg, k, b = model.cfg, beam_size, len(sources)
    src, src_len = pad_batch(sources, cfg.pad_id)
    src_len = src_len.clamp(min=1)
    cross = [(ck.repeat_interleave(k, 0), cv.repeat_interleave(k, 0))
             for ck, cv in model.cross_kv(model.encode(src, src_len))]
    src_len = src_len.repeat_interleave(k)
    steps = min(max_new_tokens, cfg.max_len)
    beams: list[list[list[int]]] = [[[]] for _ in range(b)]  # live beams' tokens, per source
    scores = torch.zeros(b, k, dtype=torch.float64)
    scores[:, 1:] = -torch.inf  # the first step expands beam 0 only
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(b)]
    done = [False] * b
    caches = model.decoder.empty_cache(b * k)
    ids = torch.full((b * k, 1), bos, dtype=torch.long)
    pos = torch.zeros(b * k, dtype=torch.long)
    ones = torch.ones(b * k, dtype=torch.long)
    for step in range(steps):
        logits, caches = model.step(ids, ones, pos, caches, cross, src_len)
        logp = torch.log_softmax(logits.double(), dim=-1).view(b, k, -1)
        vocab = logp.shape[-1]
        top_s, top_i = (scores[:, :, None] + logp).view(b, -1).topk(2 * k, dim=1)
        rows, nxt = torch.arange(b * k), ids[:, 0].clone()
        for i in range(b):
            if done[i]:
                continue
            live: list[tuple[int, int, float]] = []  # (parent, token, score)
            for rank, (sc, idx) in enumerate(zip(top_s[i].tolist(), top_i[i].tolist())):
                parent, tok = divmod(idx, vocab)
                if tok == eos:
                    if rank < k:
                        finished[i].append((beams[i][parent] + [tok], sc))
                else:
                    live.append((parent, tok, sc))
                if len(live) == k:
                    break
            beams[i] = [beams[i][p] + [t] for p, t, _ in live]
            scores[i] = torch.tensor([sc for _, _, sc in live], dtype=torch.float64)
            rows[i * k: (i + 1) * k] = torch.tensor([p for p, _, _ in live]) + i * k
            nxt[i * k: (i + 1) * k] = torch.tensor([t for _, t, _ in live])
            if step + 1 == steps:  # the length limit: the live beams finish too
                finished[i] += list(zip(beams[i], scores[i].tolist()))
            done[i] = step + 1 == steps or len(finished[i]) >= k
        if all(done):
            break
        caches = [(ck.index_select(0, rows), cv.index_select(0, rows)) for ck, cv in caches]
        ids, pos = nxt[:, None], pos + 1
    best = [max(hyps, key=lambda h: h[1] / len(h[0]) ** length_penalty)[0] for hyps in finished]  # first on ties
    return [toks[:-1] if toks[-1:] == [eos] else toks for toks in best]


def translate(model: EncoderDecoder, tok: Tokenizer, texts: list[str], max_new_tokens: int = 128,
              batch_size: int = 64, beam_size: int = 1, length_penalty: float = 1.0) -> list[str]:
    """Translations of `texts`: greedy, or beam search of `beam_size` ranked by score / length ** length_penalty."""
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths -> less padding
    out: list[str] = [""] * len(texts)
    batch_size = max(1, batch_size // beam_size)  # as many rows per step as greedy decoding
    for k in range(0, len(order), batch_size):
        idx = order[k: k + batch_size]
        srcs = [tok.encode(texts[i])[: model.cfg.max_len] for i in idx]
        if beam_size > 1:
            best = beam_translate_ids(model, srcs, tok.bos_id, tok.eos_id, max_new_tokens, beam_size, length_penalty)
        else:
            best = greedy_translate_ids(model, srcs, tok.bos_id, tok.eos_id, max_new_tokens)
        for i, ids in zip(idx, best):
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
