"""Parity of a bundle against the PyTorch model it was exported from.

Owns: `TorchRuntime` (the PyTorch model behind the ModelRuntime interface, so both backends decode through
the same greedy loop of export/evaluate.py), the lockstep check (both backends fed the reference's greedy
tokens: logits max-abs at every step, and the first step where the bundle's own argmax would differ, i.e.
whether its greedy output is identical), synthetic parity at export time (random token ids, batch sizes and
lengths other than the traced ones, right-padded mixed-length batches), and the full-size check on real
data (`real_parity`; its command line is kvserve/parity.py: `python -m kvserve.parity BUNDLE CHECKPOINT`).

The runtime under test is given (a built runtime, or a `RuntimeFactory` for `real_parity`): the composition
roots (kvserve/, tests, bench/) build serving's ModelRuntime, since export must not import serving.
Does not own: the runtime (serving/engine/runtime.py), evaluation metrics (export/evaluate.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.evaluate import (
    RuntimeFactory,
    StepRuntime,
    greedy_decode,
    lm_chunks,
    nll_bits,
    prompt_ids,
    scores,
    source_ids,
    start_batch,
    translate_texts,
)
from export.torch_model import kvserve_model
from model.transformer import DecoderOnlyLM, EncoderDecoder

FP32_TOLERANCE = 1e-4  # max-abs logits difference accepted for the fp32 variant
LM_PARITY_CHARS = 50_000  # test-split characters scored by both backends for the LM's bits-per-char delta
PREFIX_TOKENS = (8, 16, 32)  # greedy outputs also compared on their first n tokens (an LM runs 64)


class TorchRuntime:
    """The PyTorch model (eager, KV cache) with ModelRuntime's encode/step interface."""

    provider = "pytorch"

    def __init__(self, model: EncoderDecoder | DecoderOnlyLM, n_slots: int, special_ids: dict[str, int]) -> None:
        self.model, self.n_slots, self.cfg = model.eval(), n_slots, model.cfg
        self.is_encoder_decoder = isinstance(model, EncoderDecoder)
        self.max_len = self.max_src_len = self.cfg.max_len
        self.bos_id, self.eos_id, self.pad_id = special_ids["bos"], special_ids["eos"], special_ids["pad"]
        self.caches = model.decoder.empty_cache(n_slots)
        if self.is_encoder_decoder:
            self.cross = model.decoder.empty_cache(n_slots)  # same shape: (slots, H, max_len, Dh)
            self.src_len = torch.zeros(n_slots, dtype=torch.long)

    @torch.no_grad()
    def encode(self, start: int, sources: list[list[int]]) -> None:
        lens = torch.tensor([len(s) for s in sources])
        src = torch.full((len(sources), int(lens.max())), self.pad_id, dtype=torch.long)
        for i, s in enumerate(sources):
            src[i, : len(s)] = torch.tensor(s)
        model = self.model
        assert isinstance(model, EncoderDecoder), "encode() needs an encoder-decoder model"
        for (ck, cv), (k, v) in zip(self.cross, model.cross_kv(model.encode(src, lens)), strict=True):
            ck[start : start + len(sources), :, : k.shape[2]] = k
            cv[start : start + len(sources), :, : v.shape[2]] = v
        self.src_len[start : start + len(sources)] = lens

    @torch.no_grad()
    def step(self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray) -> np.ndarray:
        rows = slice(start, start + len(input_ids))
        ids, lens, pos = (torch.from_numpy(np.asarray(a, np.int64)) for a in (input_ids, input_len, write_pos))
        caches = [(k[rows], v[rows]) for k, v in self.caches]
        if isinstance(self.model, EncoderDecoder):  # = self.is_encoder_decoder
            cross = [(k[rows], v[rows]) for k, v in self.cross]
            logits, new = self.model.step(ids, lens, pos, caches, cross, self.src_len[rows])
        else:
            logits, new = self.model.step(ids, lens, pos, caches)
        for (k, v), (nk, nv) in zip(self.caches, new, strict=True):
            k[rows], v[rows] = nk, nv
        return logits.float().numpy()


def lockstep(
    ref: StepRuntime, test: StepRuntime, inputs: Sequence[Sequence[int]], steps: int = 20, start: int = 0
) -> dict[str, Any]:
    """Feed both backends the reference's greedy tokens for `steps` steps (after the prefill step).

    Returns the max-abs logits difference per step and, per row, whether the test backend's own argmax
    matched the reference's token at every step up to the reference's eos (then its greedy output is
    identical, token for token, within these steps)."""
    a_logits, pos = start_batch(ref, inputs, start)
    b_logits, _ = start_batch(test, inputs, start)
    n = len(inputs)
    per_step, agree, done = [], np.ones(n, bool), np.zeros(n, bool)
    for t in range(steps + 1):
        per_step.append(float(np.abs(a_logits - b_logits).max()))
        tok = a_logits.argmax(-1)
        agree &= done | (b_logits.argmax(-1) == tok)
        done |= tok == ref.eos_id
        if t == steps or pos.max() + 1 > ref.max_len:
            break
        ids, one = tok[:, None].astype(np.int64), np.ones(n, np.int64)
        a_logits, b_logits = ref.step(start, ids, one, pos), test.step(start, ids, one, pos)
        pos = pos + 1
    return {
        "rows": n,
        "steps": len(per_step) - 1,
        "logits_max_abs": max(per_step),
        "per_step_max_abs": [float(f"{x:.3g}") for x in per_step],
        "rows_greedy_identical": int(agree.sum()),
    }


def synthetic_inputs(vocab: int, lengths: Sequence[int], seed: int, bos: int | None) -> list[list[int]]:
    """Random token ids (specials excluded) of the given lengths; LM prompts start with bos."""
    g = np.random.default_rng(seed)
    rows = [g.integers(4, vocab, n).tolist() for n in lengths]
    return [[bos, *r[1:]] for r in rows] if bos is not None else rows


# Batch sizes and lengths other than the traced ones (batch 3, 4 new tokens, 5 source tokens).
SYNTHETIC_BATCHES = ((1, (6,)), (2, (2, 9)), (5, (7, 1, 12, 3, 8)), (7, (11, 2, 6, 13, 4, 9, 1)))


def synthetic_parity(
    model: EncoderDecoder | DecoderOnlyLM, rt: StepRuntime, special_ids: dict[str, int], steps: int = 20
) -> dict[str, Any]:
    """Lockstep parity on random inputs at several batch sizes with right-padded mixed lengths."""
    ref = TorchRuntime(model, rt.n_slots, special_ids)
    bos = None if ref.is_encoder_decoder else special_ids["bos"]
    results = []
    for i, (batch, lengths) in enumerate(SYNTHETIC_BATCHES):
        if batch > rt.n_slots:
            continue
        inputs = synthetic_inputs(model.cfg.vocab_size, [max(1, n) for n in lengths], seed=i, bos=bos)
        results.append({"batch": batch, **lockstep(ref, rt, inputs, steps, start=rt.n_slots - batch)})
    return {
        "steps": steps,
        "logits_max_abs": max(r["logits_max_abs"] for r in results),
        "rows": sum(r["rows"] for r in results),
        "rows_greedy_identical": sum(r["rows_greedy_identical"] for r in results),
        "batches": results,
    }


def real_parity(
    bundle_dir: Path,
    checkpoint_dir: Path,
    n: int,
    data_dir: str | Path,
    make_runtime: RuntimeFactory,
    batch_size: int = 16,
    steps: int = 20,
) -> dict[str, Any]:
    """Full-size parity on the test split of the runtime `make_runtime(bundle, batch_size)` builds against
    the checkpoint in PyTorch: lockstep logits, identical greedy outputs, quality delta."""
    from export.bundle import load_bundle
    from model import data
    from model.checkpoint import load_checkpoint

    bundle, ckpt = load_bundle(bundle_dir), load_checkpoint(checkpoint_dir)
    tok = ckpt.tokenizer
    rt = make_runtime(bundle, batch_size)
    ref = TorchRuntime(kvserve_model(ckpt.model), batch_size, tok.special_ids)
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "bundle": str(bundle_dir),
        "checkpoint": str(checkpoint_dir),
        "task": bundle.task,
        "variant": bundle.variant.value,
        "provider": rt.provider,
    }
    if bundle.task == "translate":
        pairs = data.load_pairs(data_dir, "test")[:n]
        inputs = [source_ids(tok, s, rt.max_src_len) for s, _ in pairs]
    else:
        text = data.load_text(data_dir, "test")
        inputs = [prompt_ids(tok, p) for p in data.lm_prompts(text, n)]
    out["lockstep"] = _batched_lockstep(ref, rt, inputs, batch_size, steps)
    out["greedy"] = _greedy_equality(ref, rt, inputs, batch_size)
    if bundle.task == "translate":
        refs = [t for _, t in pairs]
        q_ref = scores(translate_texts(ref, tok, [s for s, _ in pairs], batch_size), refs)
        q_bun = scores(translate_texts(rt, tok, [s for s, _ in pairs], batch_size), refs)
        out["quality"] = {
            "sentences": len(pairs),
            "chrf_torch": q_ref["chrf"],
            "chrf_bundle": q_bun["chrf"],
            "chrf_delta": round(q_bun["chrf"] - q_ref["chrf"], 3),
            "bleu_torch": q_ref["bleu"],
            "bleu_bundle": q_bun["bleu"],
        }
    else:
        text = data.load_text(data_dir, "test")[:LM_PARITY_CHARS]
        chunks, chars = lm_chunks(tok, text, rt.max_len), len(text)
        b_ref, b_bun = nll_bits(ref, chunks, batch_size) / chars, nll_bits(rt, chunks, batch_size) / chars
        out["quality"] = {
            "chars": chars,
            "bpc_torch": round(b_ref, 4),
            "bpc_bundle": round(b_bun, 4),
            "bpc_delta": round(b_bun - b_ref, 4),
        }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _batched_lockstep(
    ref: StepRuntime, rt: StepRuntime, inputs: list[list[int]], batch: int, steps: int
) -> dict[str, Any]:
    parts = [lockstep(ref, rt, inputs[i : i + batch], steps) for i in range(0, len(inputs), batch)]
    return {
        "rows": len(inputs),
        "steps": steps,
        "logits_max_abs": max(p["logits_max_abs"] for p in parts),
        "rows_greedy_identical": sum(p["rows_greedy_identical"] for p in parts),
    }


def _greedy_equality(ref: StepRuntime, rt: StepRuntime, inputs: list[list[int]], batch: int) -> dict[str, Any]:
    # translation: as model/decode.py; LM: 64 new tokens (greedy_decode also stops where the cache ends)
    budget = ref.max_len - 1 if ref.is_encoder_decoder else 64
    a = greedy_decode(ref, inputs, budget, batch)
    b = greedy_decode(rt, inputs, budget, batch)
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return {
        "inputs": len(inputs),
        "max_new_tokens": budget,
        "identical": same,
        "identical_fraction": round(same / max(len(inputs), 1), 4),
        # an LM's continuations part at the first near-tie a variant's rounding flips, and never meet again: the
        # share still identical after n tokens tells a variant's closeness better than the whole 64 tokens alone
        "identical_fraction_by_tokens": identical_by_prefix(a, b, [n for n in PREFIX_TOKENS if n < budget]),
    }


def identical_by_prefix(a: list[list[int]], b: list[list[int]], lengths: list[int]) -> dict[str, float]:
    """{str(n): the share of outputs whose first n tokens are the same in `a` and `b`} (two shorter outputs that
    end together count as the same)."""
    return {str(n): round(sum(x[:n] == y[:n] for x, y in zip(a, b, strict=True)) / max(len(a), 1), 4) for n in lengths}
