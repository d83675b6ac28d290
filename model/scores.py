"""Scores shared by training, evaluation, export checks and serving tests (torch-free)."""
from __future__ import annotations

import math

import sacrebleu


def chrf(hyps: list[str], refs: list[str]) -> float:
    return round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)


def bleu(hyps: list[str], refs: list[str]) -> float:
    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def bits_per_char(total_nll_nats: float, n_chars: int) -> float:
    return total_nll_nats / math.log(2) / max(n_chars, 1)


def search_record(beam_size: int, length_penalty: float) -> dict:
    """How translations were searched, as a report records it: nothing for greedy decoding."""
    return {"beam_size": beam_size, "length_penalty": length_penalty} if beam_size > 1 else {}
