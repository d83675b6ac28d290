"""Choosing the next token from logits: pure numpy functions of (logits, params, generator).

Owns: greedy (vectorised over rows), repetition penalty, temperature, top-k, top-p, and the per-request
random generator. A sampled request draws exactly one uniform number per token from its own generator,
seeded from `SamplingParams.seed`, and its logits row does not depend on the other rows of the batch, so
the same seed gives the same tokens whatever else runs in the same step.

Does not own: which rows are sampled (serving/engine/engine.py), beam search (serving/engine/beam.py), stop conditions.
"""
from __future__ import annotations

import numpy as np

from serving.engine.types import SamplingParams


def make_generator(seed: int | None) -> np.random.Generator:
    """The request's own generator: seeded -> reproducible; None -> fresh OS entropy."""
    return np.random.default_rng(seed)


def is_plain_greedy(params: SamplingParams) -> bool:
    """Rows whose token is the plain argmax of the logits (no per-row work beyond the batched argmax)."""
    return params.temperature == 0.0 and params.repetition_penalty == 1.0 and params.beam_size == 1


def greedy(logits: np.ndarray) -> np.ndarray:
    """(n, V) -> (n,) int64 argmax per row (first index on ties)."""
    return np.argmax(logits, axis=1).astype(np.int64)


def apply_repetition_penalty(row: np.ndarray, history: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL-style penalty on every token id already seen: positive logits / p, negative logits * p."""
    if penalty == 1.0 or history.size == 0:
        return row
    ids = np.unique(history)
    vals = row[ids]
    row[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return row


def _best_first(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of row, best first (deterministic for a given row)."""
    ids = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    return ids[np.argsort(-row[ids])]


def filter_top_k_top_p(row: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their probabilities after top-k then top-p (nucleus), best first.

    `row` holds temperature-scaled logits (V,) in float64. Top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (always at least one token). Only the head of the distribution
    is sorted (64, then 1024 candidates, then all): a full sort of the vocabulary per row and step is the
    costliest thing sampling does, and a trained model's nucleus is usually small.
    """
    v = row.shape[0]
    limit = top_k if 0 < top_k < v else v
    probs_all = np.exp(row - row.max())
    total = probs_all[np.argpartition(-row, limit - 1)[:limit]].sum() if limit < v else probs_all.sum()
    for k in sorted({min(limit, 64), min(limit, 1024), limit}) if top_p < 1.0 else (limit,):
        ids = _best_first(row, k)
        probs = probs_all[ids] / total
        cum = np.cumsum(probs)
        if cum[-1] >= top_p or k == limit:
            keep = min(int(np.searchsorted(cum, top_p)) + 1, k) if top_p < 1.0 else k
            return ids[:keep], probs[:keep] / probs[:keep].sum()
    raise AssertionError("unreachable: the last round covers every candidate")


def sample_row(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
               history: np.ndarray) -> int:
    """One token for one row: repetition penalty, then greedy or temperature/top-k/top-p sampling.

    logits (V,) float32 (not modified); history: ids the repetition penalty applies to.
    """
    row = logits.astype(np.float64)  # a copy: the caller's logits stay untouched
    row = apply_repetition_penalty(row, history, params.repetition_penalty)
    if params.temperature == 0.0:
        return int(np.argmax(row))
    row /= params.temperature
    if params.top_k == 0 and params.top_p >= 1.0:  # plain sampling: no sort needed
        probs = np.exp(row - row.max())
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), row.shape[0] - 1))
    ids, probs = filter_top_k_top_p(row, params.top_k, params.top_p)
    cdf = np.cumsum(probs)
    j = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(j, ids.shape[0] - 1)])
