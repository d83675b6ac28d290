"""Validation during training: the valid split's figures of the model (and of its moving average).

Translation: greedy chrF on the valid sentences (the first `eval_sentences` on the way, all of them at the
end); LM: bits per character (of the first 60,000 characters on the way, all of them at the end). Owns these
figures and which of two is better. Does not own the test-split evaluation of a saved checkpoint
(model/evaluate.py) nor when to validate (model/train.py).
"""
from __future__ import annotations

import torch

from model import data as data_mod
from model.decode import lm_nll, translate
from model.scores import bits_per_char, chrf
from model.tokenizer import Tokenizer
from model.train_config import TrainConfig
from model.weight_average import WeightAverage

LM_CHARS_ON_THE_WAY = 60000  # LM: characters of the valid split scored at each validation before the last


def validate(model: torch.nn.Module, tok: Tokenizer, cfg: TrainConfig, max_len: int, final: bool = False) -> dict:
    """Validation metrics: chrF on valid sentences (translation), bits per char (LM); the model is left in
    training mode."""
    model.eval()
    if cfg.task == "translate":
        pairs = data_mod.load_pairs(cfg.data_dir, "valid")[: None if final else cfg.eval_sentences]
        hyps = translate(model, tok, [p[0] for p in pairs], max_new_tokens=max_len - 1)
        out = {"valid_chrf": chrf(hyps, [p[1] for p in pairs]), "valid_sentences": len(pairs)}
    else:
        text = data_mod.load_text(cfg.data_dir, "valid")
        text = text if final else text[:LM_CHARS_ON_THE_WAY]
        nll, _ = lm_nll(model, tok.encode(text), tok.bos_id)
        out = {"valid_bpc": round(bits_per_char(nll, len(text)), 4)}
    model.train()
    return out


def validate_average(avg: WeightAverage, model: torch.nn.Module, tok: Tokenizer, cfg: TrainConfig, max_len: int,
                     final: bool = False) -> dict:
    """`validate` of the moving average: swapped into the model for it, and out again after."""
    avg.swap()
    try:
        return validate(model, tok, cfg, max_len, final)
    finally:
        avg.swap()


def better(a: dict, b: dict) -> bool:
    """True when metrics a beat metrics b (higher chrF, lower bits per char)."""
    return a["valid_chrf"] > b["valid_chrf"] if "valid_chrf" in a else a["valid_bpc"] < b["valid_bpc"]
