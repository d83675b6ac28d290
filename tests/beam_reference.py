"""A straightforward reference beam search over the PyTorch model, independent of the engine's code.

Every step recomputes each live hypothesis from scratch (bos + its tokens, one decoder call over the whole
prefix with a fresh cache), so no KV reordering is involved: it checks the engine's slot copies too. It
implements the spec written in serving/engine/beam.py's docstring: summed log-probabilities (float64), the best
k * (1 + number of end ids) candidates per step, end candidates of rank < k finish, stop once k have
finished before the last step, after max_new_tokens steps the live beams join the finished ones, rank by score / length ** length_penalty (length including the end
token), returned tokens without it.
"""
from __future__ import annotations

import torch

from model.transformer import EncoderDecoder


@torch.no_grad()
def reference_beam_search(model: EncoderDecoder, src: list[int], bos: int, end_ids: set[int], beam_size: int,
                          max_new_tokens: int, length_penalty: float = 1.0,
                          n_best: int = 1) -> list[tuple[tuple[int, ...], float]]:
    model.eval()
    k = beam_size
    src_len = torch.tensor([len(src)])
    cross = model.cross_kv(model.encode(torch.tensor([src]), src_len))
    hyps: list[list[int]] = [[]]
    scores = torch.zeros(1, dtype=torch.float64)
    finished: list[tuple[list[int], float]] = []
    for step in range(max_new_tokens):
        nb = len(hyps)
        ids = torch.tensor([[bos] + h for h in hyps])  # (nb, t + 1): the whole prefix, recomputed
        t = ids.shape[1]
        logits, _ = model.step(ids, torch.full((nb,), t), torch.zeros(nb, dtype=torch.long),
                               model.decoder.empty_cache(nb),
                               [(kk.expand(nb, -1, -1, -1), vv.expand(nb, -1, -1, -1)) for kk, vv in cross],
                               src_len.expand(nb))
        logp = torch.log_softmax(logits.double(), dim=-1)
        vocab = logp.shape[1]
        cand = (scores[:, None] + logp).reshape(-1)
        top_s, top_i = cand.topk(min(k * (1 + len(end_ids)), cand.numel()))
        new_hyps, new_scores = [], []
        for rank, (s, i) in enumerate(zip(top_s.tolist(), top_i.tolist())):
            b, tok = divmod(i, vocab)
            if tok in end_ids:
                if rank < k:
                    finished.append((hyps[b] + [tok], s))
            else:
                new_hyps.append(hyps[b] + [tok])
                new_scores.append(s)
            if len(new_hyps) == k:
                break
        hyps, scores = new_hyps, torch.tensor(new_scores, dtype=torch.float64)
        if len(finished) >= k and step + 1 < max_new_tokens:
            break
    else:  # the length limit: the live beams join the finished ones, even when k have finished at this step
        finished += list(zip(hyps, scores.tolist()))
    ranked = sorted(((tuple(h[:-1] if h and h[-1] in end_ids else h), s / len(h) ** length_penalty)
                     for h, s in finished), key=lambda x: -x[1])
    return ranked[:n_best]
