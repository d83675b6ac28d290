"""The encoder's inputs: the distinct sources of an encoder call and their binding.

A source given several times in one call (the rows of a beam, identical requests joining together) is encoded
once: `distinct_sources` says which row each slot gets. TORCH-FREE. Does not own: running the encoder or placing
its outputs in the slots (serving/engine/runtime.py).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort


def distinct_sources(sources: list[list[int]]) -> tuple[list[list[int]], np.ndarray | None]:
    """The distinct sources, in first-seen order, and each given source's row among them (None: all distinct)."""
    rows: dict[tuple[int, ...], int] = {}
    index = [rows.setdefault(tuple(s), len(rows)) for s in sources]
    if len(rows) == len(sources):
        return sources, None
    return [list(s) for s in rows], np.array(index, np.intp)


def source_binding(
    encoder: ort.InferenceSession, sources: list[list[int]], pad_id: int
) -> tuple[ort.IOBinding, tuple[np.ndarray, ...]]:
    """The encoder's inputs bound: the sources right-padded to the longest, and their lengths (the arrays returned
    with the binding, for the caller to hold until the run: a CPU input may be bound by pointer)."""
    lens = np.array([len(s) for s in sources], np.int64)
    ids = np.full((len(sources), int(lens.max())), pad_id, np.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = s
    io = encoder.io_binding()
    io.bind_cpu_input("src_ids", ids)
    io.bind_cpu_input("src_len", lens)
    return io, (ids, lens)
