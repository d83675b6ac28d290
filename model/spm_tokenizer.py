"""Marian's tokenizer: SentencePiece models for source and target over one shared vocabulary (vocab.json).

The second implementation of the tokenizer interface (model/tokenizer.py is the first: byte-level BPE), for
imported Marian / OPUS-MT bundles. It tokenizes and detokenizes as Hugging Face's `MarianTokenizer` does:
- encode (a source sentence): a leading language code `>>xx<<` is kept as one token, the rest is split into
  pieces by source.spm, each piece becomes its vocab.json id (`<unk>` if it has none), and `</s>` is appended;
- decode (target ids): the special tokens (pad, eos, unk) are dropped, the ids become their pieces, which
  target.spm joins (`decode_pieces`), then every "▁" becomes a space and the ends are stripped.
Not done: Moses punctuation normalisation of the source (MarianTokenizer applies it only when `sacremoses` is
installed); pass text already normalised if the model was trained on normalised text.

TORCH-FREE: serving loads it (`sentencepiece` is in the serve extra).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SOURCE_SPM, TARGET_SPM, VOCAB = "source.spm", "target.spm", "vocab.json"
FILES = (VOCAB, SOURCE_SPM, TARGET_SPM)


class SentencePieceTokenizer:
    """encode: source text -> ids (with the trailing `</s>`); decode: target ids -> text."""

    def __init__(self, folder: str | Path, special_ids: dict[str, int]) -> None:
        import sentencepiece as spm

        folder = Path(folder)
        for name in FILES:
            if not (folder / name).is_file():
                raise FileNotFoundError(f"SentencePiece tokenizer file {folder / name} does not exist")
        self.vocab: dict[str, int] = json.loads((folder / VOCAB).read_text(encoding="utf-8"))
        self.pieces = {i: p for p, i in self.vocab.items()}
        self.source = spm.SentencePieceProcessor(model_file=str(folder / SOURCE_SPM))
        self.target = spm.SentencePieceProcessor(model_file=str(folder / TARGET_SPM))
        missing = {"pad", "bos", "eos", "unk"} - set(special_ids)
        if missing:
            raise ValueError(f"special_ids lacks {sorted(missing)}; it needs pad, bos, eos and unk")
        self.pad_id, self.bos_id = special_ids["pad"], special_ids["bos"]
        self.eos_id, self.unk_id = special_ids["eos"], special_ids["unk"]
        self._skip = {self.pad_id, self.eos_id, self.unk_id}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def special_ids(self) -> dict[str, int]:
        return {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "unk": self.unk_id}

    def pieces_of(self, text: str) -> list[str]:
        """The source pieces of `text`, a leading language code `>>xx<<` kept whole (MarianTokenizer's rule)."""
        code: list[str] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2:]
        return code + self.source.encode(text, out_type=str)

    def encode(self, text: str) -> list[int]:
        """A source sentence as the encoder takes it: piece ids, then `</s>` (an empty text is `[</s>]`)."""
        return [self.vocab.get(p, self.unk_id) for p in self.pieces_of(text)] + [self.eos_id]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        pieces = [self._piece(int(i)) for i in ids if int(i) not in self._skip]
        return self.target.decode_pieces(pieces).replace("\u2581", " ").strip() if pieces else ""

    def _piece(self, i: int) -> str:
        """vocab.json's piece; else, as MarianTokenizer does, target.spm's piece of that id (or `<unk>`)."""
        if i in self.pieces:
            return self.pieces[i]
        return self.target.id_to_piece(i) if 0 <= i < self.target.get_piece_size() else "<unk>"

    def token_bytes(self, token_id: int) -> str:
        return self.decode([token_id])
