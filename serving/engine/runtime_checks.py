"""The argument checks of ModelRuntime's operations (serving/engine/runtime.py): slot ranges, a step's shapes and
positions, the slot lists of a copy, source lengths. Each raises ValueError naming what was given and what is
allowed. The engine never passes bad arguments; these guard the runtime's other callers (benchmarks, tests, tools).

TORCH-FREE (numpy). Does not own: a request's checks (serving/engine/checks.py).
"""

from __future__ import annotations

import numpy as np


def check_rows(start: int, n: int, n_slots: int) -> None:
    if n < 1 or start < 0 or start + n > n_slots:
        raise ValueError(f"slots [{start}, {start + n}) are outside [0, n_slots={n_slots}) or empty")


def check_source_lengths(lens: np.ndarray, max_src_len: int) -> None:
    if lens.min() < 1 or lens.max() > max_src_len:
        raise ValueError(
            f"source lengths must be in [1, max_src_len={max_src_len}]; got {int(lens.min())}..{int(lens.max())} tokens"
        )


def check_step(
    start: int,
    input_ids: np.ndarray,
    input_len: np.ndarray,
    write_pos: np.ndarray,
    n_slots: int,
    max_len: int,
    src_len: np.ndarray | None,
) -> None:
    """`src_len`: each slot's source length (0: none encoded) for an encoder-decoder model, else None."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (n, T) with T >= 1; got shape {input_ids.shape}")
    n, t = input_ids.shape
    check_rows(start, n, n_slots)
    if input_len.shape != (n,) or write_pos.shape != (n,):
        raise ValueError(f"input_len and write_pos must have shape ({n},); got {input_len.shape} and {write_pos.shape}")
    if input_len.min() < 1 or input_len.max() > t:
        raise ValueError(f"input_len must be in [1, T={t}]; got {input_len.tolist()}")
    if write_pos.min() < 0 or write_pos.max() + t > max_len:
        raise ValueError(
            f"write_pos + T must stay within the KV cache (max_len={max_len}); got "
            f"write_pos max {int(write_pos.max())} with T={t}"
        )
    if src_len is not None and src_len[start : start + n].min() < 1:
        empty = [start + i for i in np.flatnonzero(src_len[start : start + n] < 1)]
        raise ValueError(f"slots {empty} hold no encoded source: call encode() before step()")


def check_copy(src: np.ndarray, dst: np.ndarray, n_slots: int) -> None:
    """copy_slots' slot lists (1-D int64): as many sources as destinations, in [0, n_slots), destinations
    distinct."""
    if src.shape != dst.shape:
        raise ValueError(f"copy_slots: src has {src.size} slots, dst {dst.size}; they must match")
    if src.size == 0:
        return
    for what, a in (("src", src), ("dst", dst)):
        if a.min() < 0 or a.max() >= n_slots:
            raise ValueError(f"copy_slots: {what} slots must be in [0, {n_slots}); got {a.tolist()}")
    if len(set(dst.tolist())) != dst.size:
        raise ValueError(f"copy_slots: dst slots must be distinct; got {dst.tolist()}")
