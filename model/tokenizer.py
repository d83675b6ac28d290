"""Subword tokenizer: byte-level BPE (HF `tokenizers`), saved as one JSON file.

Byte-level BPE round-trips any UTF-8 text (umlauts, punctuation, emoji) and the empty string. The same
file is loaded by serving/ (which has `tokenizers` but never torch) through `Tokenizer.load`.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]  # ids 0, 1, 2, 3


class Tokenizer:
    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (hf.token_to_id(t) for t in SPECIALS)
        if None in (self.pad_id, self.bos_id, self.eos_id, self.unk_id):
            raise ValueError(f"tokenizer lacks special tokens {SPECIALS}")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        hf = HFTokenizer(models.BPE(unk_token=UNK))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    @property
    def special_ids(self) -> dict[str, int]:
        return {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "unk": self.unk_id}

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids if text else []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        specials = (self.pad_id, self.bos_id, self.eos_id)
        return self.hf.decode([i for i in ids if i not in specials], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> str:
        """The text of one token (for streaming; a token may end mid-character, see IncrementalDecoder)."""
        return self.decode([token_id])


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces without breaking multi-byte characters."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids, self.emitted = tok, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next token
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece


def iter_lines(paths: Iterable[Path]) -> Iterator[str]:
    for p in paths:
        with open(p, encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f)
