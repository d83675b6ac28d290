"""Training batches: a deterministic, endless stream of tensors for each step, from the train split.

Translation batches are built by tokens (length-bucketed), so padding waste stays small: pairs of similar
length are packed under `batch_tokens` padded tokens, and the batch order of each epoch is a function of
(seed, epoch). LM batches are random windows of the train split's token stream, each starting with bos, drawn
from a generator seeded by (seed, step). Either way the batch of a step depends on the step only, which is
what lets --resume continue a run exactly.

Owns the train split's encoding and the batch tensors. Does not own the tokenizer (model/tokenizer.py),
the data files (model/data.py) nor what is done with a batch (model/step.py).
"""
from __future__ import annotations

import random

import torch

from model import data as data_mod
from model.tokenizer import Tokenizer
from model.train_config import TrainConfig

Pair = tuple[list[int], list[int]]  # (source ids, target ids), without bos/eos


def translation_batches(pairs: list[Pair], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Index batches of similar length, each under batch_tokens padded tokens, in a seeded order."""
    rng = random.Random(seed * 1000 + epoch)
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][1]), len(pairs[i][0]), rng.random()))
    batches, cur, longest = [], [], 0
    for i in order:
        n = len(pairs[i][0]) + len(pairs[i][1]) + 1
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate_pairs(pairs: list[Pair], idx: list[int], pad: int, bos: int, eos: int) -> tuple[torch.Tensor, ...]:
    """The padded tensors of pairs[idx]: src (B, S), source lengths (B,) (at least 1, so an empty source still
    has a key to attend to), decoder input bos + target (B, T+1) and decoder output target + eos (B, T+1)."""
    s_len = max(1, max(len(pairs[i][0]) for i in idx))
    t_len = max(len(pairs[i][1]) for i in idx) + 1
    src = torch.full((len(idx), s_len), pad, dtype=torch.long)
    tin = torch.full((len(idx), t_len), pad, dtype=torch.long)
    tout = torch.full((len(idx), t_len), pad, dtype=torch.long)
    lens = torch.zeros(len(idx), dtype=torch.long)
    for r, i in enumerate(idx):
        s, t = pairs[i]
        src[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        tin[r, : len(t) + 1] = torch.tensor([bos] + t, dtype=torch.long)
        tout[r, : len(t) + 1] = torch.tensor(t + [eos], dtype=torch.long)
        lens[r] = max(1, len(s))
    return src, lens, tin, tout


def lm_windows(stream: torch.Tensor, starts: list[int], window: int, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each start s: input bos + stream[s: s + window] and target stream[s: s + window + 1], each
    (B, window + 1)."""
    win = torch.stack([stream[s: s + window + 1] for s in starts])
    first = torch.full((win.shape[0], 1), bos, dtype=torch.long)
    x = torch.cat([first, win[:, :-1]], 1)  # bos + window predicts window
    return x, win[:, : x.shape[1]]


class Batcher:
    """Deterministic infinite stream of training batches: `batch(step)` depends only on the step."""

    def __init__(self, cfg: TrainConfig, tok: Tokenizer, max_len: int) -> None:
        self.cfg, self.tok = cfg, tok
        self.window = min(cfg.lm_window, max_len - 1)
        if cfg.task == "translate":
            texts = data_mod.load_pairs(cfg.data_dir, "train")
            src = tok.encode_batch([p[0] for p in texts])
            tgt = tok.encode_batch([p[1] for p in texts])
            self.pairs: list[Pair] = [(s[:max_len], t[: max_len - 1]) for s, t in zip(src, tgt)]
            # The packing depends on the pairs' lengths only (the seed just orders equal lengths and batches),
            # so every epoch has as many batches as the first.
            self._epoch, self._batches = 0, self._epoch_batches(0)
            self.batches_per_epoch = len(self._batches)
        else:
            self.stream = torch.tensor(tok.encode(data_mod.load_text(cfg.data_dir, "train")), dtype=torch.long)

    def batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """Translation: (src, source lengths, decoder input, decoder output); LM: (input, target)."""
        if self.cfg.task == "translate":
            epoch, k = divmod(step, self.batches_per_epoch)
            if epoch != self._epoch:  # only the current epoch's batch list is kept
                self._epoch, self._batches = epoch, self._epoch_batches(epoch)
            return collate_pairs(self.pairs, self._batches[k], self.tok.pad_id, self.tok.bos_id, self.tok.eos_id)
        g = torch.Generator().manual_seed(self.cfg.seed * 100003 + step)
        starts = torch.randint(0, len(self.stream) - self.window - 1, (self.cfg.lm_batch,), generator=g)
        return lm_windows(self.stream, starts.tolist(), self.window, self.tok.bos_id)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        return translation_batches(self.pairs, self.cfg.batch_tokens, self.cfg.seed, epoch)
