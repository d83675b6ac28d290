"""Evaluation of a BUNDLE through ONNX Runtime with the KV cache: the numbers users get from the server.

Owns: the prompt conventions (translation: the source is the tokenized text without special tokens and the
decoder starts from bos; LM: a prompt starts with bos), greedy decoding over any runtime with the
ModelRuntime interface (`encode`/`step`, so PyTorch and ORT decode through the same loop), bits per
character by teacher-forced single-token steps, and `evaluate_bundle` (chrF/BLEU or bits per char).

The runtime is injected: `evaluate_bundle` takes a `RuntimeFactory` (bundle, slots) -> StepRuntime, which
the composition roots build (kvserve/runtime.py `ort_runtime`: ONNX Runtime sessions), because serving
reads the bundle format from export and export must not import serving back.

TORCH-FREE. Does not own: the runtime (serving/engine/runtime.py), data splits (model/data.py), the PyTorch
evaluation of checkpoints (model/).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from export.bundle import Bundle

DEFAULT_DATA_DIR = "artifacts/data"


class StepRuntime(Protocol):
    """What greedy decoding needs: serving.engine.runtime.ModelRuntime, and export.parity.TorchRuntime."""

    provider: str  # where it runs, for reports: an ONNX Runtime execution provider, or "pytorch"
    is_encoder_decoder: bool
    n_slots: int
    max_len: int
    max_src_len: int  # the longest source (translation); max_len for a language model
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, start: int, sources: list[list[int]]) -> None: ...

    def step(self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray) -> np.ndarray: ...


# Builds the runtime of a loaded bundle with that many slots (rows decoded at once).
RuntimeFactory = Callable[["Bundle", int], StepRuntime]


def source_ids(tok: Any, text: str, max_src_len: int) -> list[int]:
    """Translation source: the text's tokens, no special tokens, truncated to what the encoder takes (as
    model/decode.py does); an empty text becomes one pad token (model/decode.py clamps its length to 1)."""
    return tok.encode(text)[:max_src_len] or [tok.pad_id]


def prompt_ids(tok: Any, text: str) -> list[int]:
    """LM prompt: bos + the text's tokens (the API layer's convention)."""
    return [tok.bos_id, *tok.encode(text)]


def _pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([len(r) for r in rows], np.int64)
    ids = np.full((len(rows), int(lens.max())), pad, np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, lens


def start_batch(rt: StepRuntime, inputs: Sequence[Sequence[int]], start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Encode (translation) or prefill (LM) rows start.. ; returns (first logits (n, V), write_pos (n,))."""
    prefix: Sequence[Sequence[int]] = inputs
    if rt.is_encoder_decoder:
        rt.encode(start, [list(s) for s in inputs])
        prefix = [[rt.bos_id]] * len(inputs)
    ids, lens = _pad(prefix, rt.pad_id)
    return rt.step(start, ids, lens, np.zeros(len(prefix), np.int64)), lens


def greedy_decode(
    rt: StepRuntime,
    inputs: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int | None = None,
    on_step: Callable[[np.ndarray], np.ndarray] | None = None,
) -> list[list[int]]:
    """Greedy decoding of sources (translation) or prompts (LM); returns the generated ids, eos excluded.

    Rows that finished keep stepping (their output is frozen) so a batch stays one contiguous run.
    `on_step(logits) -> tokens` may override the argmax (parity lockstep feeds a reference's tokens).
    """
    batch = min(batch_size or rt.n_slots, rt.n_slots)
    out: list[list[int]] = []
    for b0 in range(0, len(inputs), batch):
        chunk = inputs[b0 : b0 + batch]
        logits, pos = start_batch(rt, chunk)
        gen: list[list[int]] = [[] for _ in chunk]
        done = np.zeros(len(chunk), bool)
        for t in range(max_new_tokens):
            tok = on_step(logits) if on_step else logits.argmax(-1)
            for i in np.flatnonzero(~done):
                if tok[i] == rt.eos_id:
                    done[i] = True
                else:
                    gen[i].append(int(tok[i]))
            if done.all() or t == max_new_tokens - 1 or pos.max() + 1 > rt.max_len:
                break
            logits = rt.step(0, tok[:, None].astype(np.int64), np.ones(len(chunk), np.int64), pos)
            pos = pos + 1
        out += gen
    return out


def nll_bits(rt: StepRuntime, chunks: Sequence[Sequence[int]], batch_size: int | None = None) -> float:
    """Total -log2 p(chunk[i] | bos, chunk[:i]) over all tokens of all chunks, by single-token steps."""
    batch = min(batch_size or rt.n_slots, rt.n_slots)
    total = 0.0
    for b0 in range(0, len(chunks), batch):
        rows = chunks[b0 : b0 + batch]
        ids, lens = _pad(rows, rt.pad_id)
        n = len(rows)
        cur = np.full((n, 1), rt.bos_id, np.int64)
        for t in range(ids.shape[1]):
            logits = rt.step(0, cur, np.ones(n, np.int64), np.full(n, t, np.int64)).astype(np.float64)
            logz = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
            live = t < lens
            total += float((logz - logits[np.arange(n), ids[:, t]])[live].sum()) / math.log(2)
            cur = ids[:, t : t + 1]
    return total


def lm_chunks(tok: Any, text: str, max_len: int) -> list[list[int]]:
    """The text's tokens in non-overlapping windows of max_len - 1, each scored after a bos (the windows
    of model/decode.lm_nll, so bits per char compare with `kvserve evaluate CHECKPOINT`)."""
    ids = tok.encode(text)
    size = max_len - 1
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """chrF and BLEU with the project's scorer (model/scores.py, sacrebleu)."""
    from model.scores import bleu, chrf

    return {"chrf": chrf(hyps, refs), "bleu": bleu(hyps, refs)}


def translate_texts(rt: StepRuntime, tok: Any, sources: list[str], batch_size: int | None = None) -> list[str]:
    """Greedy translations (up to max_len - 1 tokens, as model/decode.py), batched by similar length."""
    ids = [source_ids(tok, s, getattr(rt, "max_src_len", rt.max_len)) for s in sources]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    batch = min(batch_size or rt.n_slots, rt.n_slots)
    for b0 in range(0, len(order), batch):
        idx = order[b0 : b0 + batch]
        for i, gen in zip(idx, greedy_decode(rt, [ids[i] for i in idx], rt.max_len - 1), strict=True):
            out[i] = tok.decode(gen)
    return out


def evaluate_bundle(
    bundle_dir: str | Path,
    make_runtime: RuntimeFactory,
    split: str = "test",
    limit: int | None = None,
    data_dir: str | Path = DEFAULT_DATA_DIR,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Evaluate a bundle through the runtime `make_runtime(bundle, batch_size)` builds (ONNX Runtime for
    `kvserve evaluate`): chrF/BLEU of greedy translations (first `limit` pairs of the split) or bits per
    character (first `limit` characters, default the whole split)."""
    from export.bundle import load_bundle
    from model import data

    bundle = load_bundle(bundle_dir)
    tok = bundle.load_tokenizer()
    rt = make_runtime(bundle, batch_size)
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "bundle": str(bundle_dir),
        "task": bundle.task,
        "variant": bundle.variant.value,
        "split": split,
        "provider": rt.provider,
    }
    if bundle.task == "translate":
        pairs = data.load_pairs(data_dir, split)[: limit or None]
        hyps = translate_texts(rt, tok, [s for s, _ in pairs])
        report |= {"sentences": len(pairs), **scores(hyps, [t for _, t in pairs])}
    else:
        text = data.load_text(data_dir, split)
        text = text[:limit] if limit else text
        chunks = lm_chunks(tok, text, rt.max_len)
        bits = nll_bits(rt, chunks)
        report |= {
            "chars": len(text),
            "tokens": sum(map(len, chunks)),
            "bits_per_char": round(bits / max(len(text), 1), 4),
        }
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report
