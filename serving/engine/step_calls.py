"""How a multi-token decoder step splits into the calls a CPU decoder graph accepts (serving/engine/runtime.py).

`decoder_cpu.onnx`'s GroupQueryAttention kernel (export/gqa.py) takes a batch of multi-token rows only when no row
has a cache yet, and a translator's takes one token per row at all times (its cross-attention too runs on that
kernel). The engine's translation steps are all one token; multi-token calls come from prompts and direct callers.

TORCH-FREE (numpy only).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# A decoder call on rows [start, start + n): (start, input_ids, input_len, write_pos) -> logits (n, V)
Call = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def gqa_runs(input_len: np.ndarray, write_pos: np.ndarray) -> list[tuple[int, int, int]]:
    """(first row, end row, new tokens) of the calls GroupQueryAttention accepts for a multi-token step:
    consecutive rows without a cache together (right-padded to their longest), each row with a cache alone
    with exactly its own tokens (its kernel takes every new token of such a row as real)."""
    runs: list[tuple[int, int, int]] = []
    a, n = 0, len(write_pos)
    while a < n:
        b = a + 1
        if write_pos[a] == 0:
            while b < n and write_pos[b] == 0:
                b += 1
        runs.append((a, b, int(input_len[a:b].max())))
        a = b
    return runs


def token_runs(input_len: np.ndarray) -> list[tuple[int, int, int]]:
    """(token index t, first row, end row) of the one-token calls that feed every row its tokens in order, for a
    graph that takes one token per row: each call is a run of consecutive rows that all have a token t."""
    runs: list[tuple[int, int, int]] = []
    for t in range(int(input_len.max(initial=0))):
        has = np.concatenate([[False], input_len > t, [False]])
        edges = np.flatnonzero(has[1:] != has[:-1])  # run starts and ends, alternating
        runs += [(t, int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    return runs


def by_gqa_run(
    call: Call, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray
) -> np.ndarray:
    """A multi-token step as the calls `gqa_runs` plans (each trimmed to its run's tokens): the rows' logits."""
    return np.concatenate(
        [
            call(start + a, np.ascontiguousarray(input_ids[a:b, :width]), input_len[a:b], write_pos[a:b])
            for a, b, width in gqa_runs(input_len, write_pos)
        ]
    )


def by_token(
    call: Call, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray, vocab: int
) -> np.ndarray:
    """A multi-token step as the one-token calls `token_runs` plans: each row's logits are those of its last
    real token."""
    logits = np.empty((len(input_len), vocab), np.float32)
    for t, a, b in token_runs(input_len):
        out = call(
            start + a, np.ascontiguousarray(input_ids[a:b, t : t + 1]), np.ones(b - a, np.int64), write_pos[a:b] + t
        )
        last = input_len[a:b] == t + 1
        logits[a:b][last] = out[last]
    return logits
