"""A tiny checkpoint with a real tokenizer: the tiny preset fitted for a few steps to eight sentence pairs.

For tests and for checks that need a model when no trained artifacts exist (bench/gpu_check): the model is
small enough to export in seconds, and fitted just enough that greedy outputs vary and end with eos (an
untrained tiny model repeats one token forever, which makes decoding comparisons weak). Not a model of any
language: use `kvserve train` for that.
"""
from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint import save_checkpoint
from model.config import preset
from model.tokenizer import Tokenizer
from model.transformer import build_model

PAIRS = [
    ("The cat sleeps on the mat.", "Die Katze schläft auf der Matte."),
    ("I would like a cup of coffee.", "Ich hätte gern eine Tasse Kaffee."),
    ("Where is the train station?", "Wo ist der Bahnhof?"),
    ("The weather is nice today.", "Das Wetter ist heute schön."),
    ("We are going to the market tomorrow.", "Wir gehen morgen auf den Markt."),
    ("Please close the door.", "Bitte schließen Sie die Tür."),
    ("My brother reads a book.", "Mein Bruder liest ein Buch."),
    ("The children play in the garden.", "Die Kinder spielen im Garten."),
]


def tiny_tokenizer(path: Path) -> Tokenizer:
    """A byte-level BPE trained on a few sentences (vocabulary = 256 bytes + specials + a few merges)."""
    texts = [t for pair in PAIRS for t in pair] * 4
    tok = Tokenizer.train(texts, vocab_size=300)
    tok.save(path)
    return Tokenizer.load(path)


def _fit(model: torch.nn.Module, tok: Tokenizer, task: str, steps: int) -> None:
    """A few optimizer steps on PAIRS, so greedy outputs vary and end with eos (an untrained tiny model
    repeats one token forever, which makes decoding comparisons weak)."""
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True)
    src = [tok.encode(e) for e, _ in PAIRS]
    tgt = [[tok.bos_id, *tok.encode(d), tok.eos_id] for _, d in PAIRS]
    lm = [[tok.bos_id, *tok.encode(f"{e} {d}"), tok.eos_id] for e, d in PAIRS]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        if task == "translate":
            y = pad(tgt)
            logits = model(pad(src), torch.tensor([len(s) for s in src]), y[:, :-1])
        else:
            y = pad(lm)
            logits = model(y[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten(), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def tiny_checkpoint(out: Path, task: str, seed: int = 0, train_steps: int = 80, **overrides) -> Path:
    """Save a tiny model of `task` ("translate" or "generate"), briefly fitted to PAIRS, as a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    tok_file = out.parent / f"{out.name}-tokenizer.json"
    tok = tiny_tokenizer(tok_file)
    cfg = preset("tiny", task, tok.vocab_size).replace(**overrides)
    torch.manual_seed(seed)
    model = build_model(cfg)
    _fit(model, tok, task, train_steps)
    save_checkpoint(out, model, cfg, task, tok_file, {"step": train_steps, "metrics": {}})
    return out
