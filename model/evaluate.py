"""`kvserve evaluate CHECKPOINT`: test-split quality of a PyTorch checkpoint.

Translation: chrF and BLEU (sacrebleu) with greedy decoding or beam search; LM: bits per character. The same
figures for an exported bundle come from export.evaluate (greedy, ONNX Runtime) and kvserve/translate.py
(beam search, the serving engine).
"""
from __future__ import annotations

import time
from pathlib import Path

from model import data as data_mod
from model.checkpoint import load_checkpoint
from model.decode import lm_nll, translate
from model.scores import bits_per_char, bleu, chrf, search_record


def evaluate_checkpoint(path: str | Path, split: str = "test", limit: int | None = None,
                        data_dir: str | Path = data_mod.DEFAULT_DATA_DIR, beam_size: int = 1,
                        length_penalty: float = 1.0) -> dict:
    ck = load_checkpoint(path)
    if beam_size > 1 and ck.task != "translate":
        raise ValueError(f"beam search is for translation; {path} is a {ck.task!r} model (drop --beam-size)")
    t0 = time.perf_counter()
    if ck.task == "translate":
        pairs = data_mod.load_pairs(data_dir, split)[:limit]
        hyps = translate(ck.model, ck.tokenizer, [p[0] for p in pairs], max_new_tokens=ck.config.max_len - 1,
                         beam_size=beam_size, length_penalty=length_penalty)
        refs = [p[1] for p in pairs]
        out = {"chrf": chrf(hyps, refs), "bleu": bleu(hyps, refs), "sentences": len(pairs),
               **search_record(beam_size, length_penalty)}
    else:
        text = data_mod.load_text(data_dir, split)
        text = text[:limit] if limit else text
        nll, n_tokens = lm_nll(ck.model, ck.tokenizer.encode(text), ck.tokenizer.bos_id)
        out = {"bits_per_char": round(bits_per_char(nll, len(text)), 4), "chars": len(text), "tokens": n_tokens}
    return {"task": ck.task, "checkpoint": str(path), "split": split, "backend": "pytorch", **out,
            "seconds": round(time.perf_counter() - t0, 1)}
