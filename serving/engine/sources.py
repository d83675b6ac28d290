"""The encoder's inputs: which calls encode a step's sources, and their binding.

A source given several times (the rows of a beam, identical requests joining together) is encoded once:
`distinct_sources` says which row each slot gets. More than `MOST_PER_CALL` distinct sources (a translation request
with a list of texts, a burst of joiners) are encoded in calls of that many, shortest first (`encoder_calls`): every
row of a call is padded to its longest source, and past 8 short sentences a call costs more per sentence, not less
(docs/decisions/encoder-join-window.md). TORCH-FREE. Does not own: running the encoder or placing its outputs in the
slots (serving/engine/runtime.py).
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


MOST_PER_CALL = 8
# an encoder call: its sources, the slots it fills (None: 0..k-1 in order), the row each of them takes (None: in order)
EncoderCall = tuple[list[list[int]], np.ndarray | None, np.ndarray | None]


def encoder_calls(sources: list[list[int]], most: int = MOST_PER_CALL) -> list[EncoderCall]:
    """The encoder calls for the sources of slots 0..n-1: per call, (its sources, the slots it fills (None: slots
    0..k-1, in order), the row of the call each of those slots takes (None: one row each, in order))."""
    distinct, index = distinct_sources(sources)
    if len(distinct) <= most:
        return [(distinct, None, index)]
    slot_rows = np.arange(len(distinct)) if index is None else index  # slot i takes distinct row slot_rows[i]
    order = np.argsort(np.array([len(s) for s in distinct]), kind="stable")
    calls: list[EncoderCall] = []
    for first in range(0, len(order), most):
        rows = order[first : first + most]
        row_in_call = np.full(len(distinct), -1, np.intp)
        row_in_call[rows] = np.arange(len(rows))
        slots = np.flatnonzero(row_in_call[slot_rows] >= 0)
        calls.append(([distinct[r] for r in rows], slots, row_in_call[slot_rows[slots]]))
    return calls


def encoder_inputs(sources: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The encoder's inputs: the sources right-padded to the longest (src_ids), and their lengths (src_len)."""
    lens = np.array([len(s) for s in sources], np.int64)
    ids = np.full((len(sources), int(lens.max())), pad_id, np.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = s
    return ids, lens


def source_binding(
    encoder: ort.InferenceSession, sources: list[list[int]], pad_id: int
) -> tuple[ort.IOBinding, tuple[np.ndarray, ...]]:
    """The encoder's inputs bound (`encoder_inputs`; the arrays returned with the binding, for the caller to hold
    until the run: a CPU input may be bound by pointer)."""
    ids, lens = encoder_inputs(sources, pad_id)
    io = encoder.io_binding()
    io.bind_cpu_input("src_ids", ids)
    io.bind_cpu_input("src_len", lens)
    return io, (ids, lens)
