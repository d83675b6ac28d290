"""A deterministic numpy stand-in for serving.runtime.ModelRuntime, for tests of the engine's own logic.

Its "model": the logits of a row are a fixed random table indexed by a hash of the row's whole cached
token history (and, encoder-decoder, of its source), so a row's output depends only on its own history,
as a real model's does. It also polices the runtime contract the engine must honour: contiguous rows
inside the pool, no write past the cache, no read of a cache position that was never written (a stale or
mis-copied slot shows up as an error, not as silently different tokens).

It is no substitute for the real runtime: tests/test_engine.py runs the engine on a tiny exported model.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

PAD, BOS, EOS = 0, 1, 2


class FakeRuntime:
    def __init__(self, n_slots: int = 8, vocab_size: int = 40, max_len: int = 64, encoder_decoder: bool = False,
                 eos_bias: float = 0.0, seed: int = 0) -> None:
        self.n_slots, self.vocab_size, self.max_len = n_slots, vocab_size, max_len
        self.is_encoder_decoder = encoder_decoder
        self.bos_id, self.eos_id, self.pad_id = BOS, EOS, PAD
        self.max_src_len = max_len
        self.provider = "fake"
        self.table = np.random.default_rng(seed).normal(size=(4096, vocab_size)).astype(np.float32)
        self.table[:, EOS] += eos_bias
        self.hist = np.full((n_slots, max_len), -1, dtype=np.int64)  # -1: never written
        self.src = np.zeros(n_slots, dtype=np.int64)  # a hash of each slot's source
        self.calls: list[tuple[str, int, int, int]] = []  # (kind, start, rows, tokens)

    def encode(self, start: int, sources: list[list[int]]) -> None:
        assert self.is_encoder_decoder and 0 <= start and start + len(sources) <= self.n_slots
        for i, s in enumerate(sources):
            self.src[start + i] = hash(tuple(s)) % 100_003
        self.calls.append(("encode", start, len(sources), sum(map(len, sources))))

    def step(self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray) -> np.ndarray:
        n, t = input_ids.shape
        assert input_ids.dtype == np.int64 and input_len.shape == (n,) and write_pos.shape == (n,)
        assert 0 <= start and start + n <= self.n_slots, f"rows [{start}, {start + n}) outside the pool"
        out = np.empty((n, self.vocab_size), dtype=np.float32)
        for r in range(n):
            slot, k, w = start + r, int(input_len[r]), int(write_pos[r])
            assert 1 <= k <= t and w + k <= self.max_len, f"row {slot}: write [{w}, {w + k}) past the cache"
            assert (self.hist[slot, :w] >= 0).all(), f"row {slot} reads unwritten cache positions below {w}"
            self.hist[slot, w: w + k] = input_ids[r, :k]
            self.hist[slot, w + k:] = -1  # later positions are stale now
            seq = self.hist[slot, : w + k]
            h = (int(self.src[slot]) * 31 + int(np.dot(seq, 7 ** np.arange(len(seq)) % 1009))) % 4096
            out[r] = self.table[h]
        self.calls.append(("step", start, n, int(input_len.sum())))
        return out

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        src, dst = list(src), list(dst)
        assert len(src) == len(dst) and len(set(dst)) == len(dst)
        self.hist[dst] = self.hist[src].copy()  # gather, then scatter: overlapping src/dst are safe
        self.src[dst] = self.src[src].copy()
        self.calls.append(("copy", len(src), 0, 0))


def reference_generate(rt: FakeRuntime, prompt: list[int], steps: int, pick) -> list[int]:
    """Tokens of one request run alone on a fresh slot 0 of `rt`; pick(logits (V,), tokens) -> next id."""
    if rt.is_encoder_decoder:
        rt.encode(0, [prompt])
        dec = [rt.bos_id]
    else:
        dec = list(prompt)
    logits = rt.step(0, np.asarray([dec], dtype=np.int64), np.asarray([len(dec)]), np.asarray([0]))[0]
    out: list[int] = []
    for _ in range(steps):
        tok = pick(logits, out)
        out.append(tok)
        pos = len(dec) + len(out) - 1
        if len(out) == steps:
            break
        logits = rt.step(0, np.asarray([[tok]], dtype=np.int64), np.asarray([1]), np.asarray([pos]))[0]
    return out
