"""Back-translation data: German sentences from outside the parallel data, paired with a reverse model's English.

The translator's test references hold German words that no training pair has (5% of their tokens); German text
without an English side widens what the decoder has seen. The German sentences are those of `fortunes-de`
(Debian: sayings, jokes, quotations, anecdotes; everyday German, as the test split's dictionary examples are).
A German -> English model trained on the reversed parallel data translates them; each (synthetic English, real
German) pair joins the real training pairs, untagged (docs/decisions/back-translation.md).

    write_reversed(data, reverse)                 the splits with the two sides swapped (the reverse model's data)
    german_sentences(data, cache)                 fortunes-de cut into sentences, none resembling a held-out pair
    write_back_translated(data, de, en, out)      real pairs + the synthetic ones -> out/translate/

The reverse model's training and the translation itself are kvserve/back_translate.py's (they need the trainer
and the serving engine). Torch-free.
"""
from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from model.data import SPLITS, NearDuplicates, load_pairs
from model.data_sources import SENTENCE_END, clean, is_sentence, unpacked_package

FORTUNES_PACKAGE = "fortunes-de"
FORTUNES_ROOT = "usr/share/games/fortunes/de"
# Files that are not prose: pictures, word lists, names, quiz questions, IRC logs, translations of fortunes.
FORTUNES_SKIPPED = frozenset({"asciiart", "translations", "woerterbuch", "vornamen", "namen", "quiz",
                              "channel-debian.fortunes"})
MIN_WORDS, MAX_WORDS = 3, 30
_NOT_PROSE = re.compile(r"[<>|@#{}_=]")
_WORD = re.compile(r"\w+")
SOURCE_NAME = f"debian:{FORTUNES_PACKAGE} back-translated (train only)"


def fetch_fortunes(cache: Path) -> Path:
    """The directory of fortunes-de's fortune files (UTF-8 text, one file per theme), downloaded and taken out
    once."""
    return unpacked_package(FORTUNES_PACKAGE, cache / "monolingual", f"{FORTUNES_ROOT}/*") / FORTUNES_ROOT


def write_reversed(data_dir: Path, out_dir: Path) -> None:
    """out_dir/translate/: each split of data_dir with German as the source and English as the target."""
    src, dst = Path(data_dir) / "translate", Path(out_dir) / "translate"
    dst.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        with open(dst / f"{split}.tsv", "w", encoding="utf-8") as f:
            f.writelines(f"{de}\t{en}\n" for en, de in load_pairs(data_dir, split))
    meta = json.loads((src / "meta.json").read_text())
    (dst / "meta.json").write_text(json.dumps({**meta, "direction": "de-en"}, indent=2))


def german_sentences(data_dir: Path, fortunes: Path) -> list[str]:
    """The fortunes' whole sentences of MIN_WORDS-MAX_WORDS words, each once, in file order: attribution lines
    ("-- Goethe") dropped, a fortune's lines joined and cut into sentences as the catalogs are; a word spelt with
    ß where the training pairs spell it ss (ten times as often) takes their spelling; a sentence that resembles the
    German side of a valid or test pair is left out."""
    train_words = Counter(w for _, de in load_pairs(data_dir, "train") for w in _WORD.findall(de))
    held = NearDuplicates([de for split in ("valid", "test") for _, de in load_pairs(data_dir, split)])

    def modern(m: re.Match) -> str:
        word = m.group()
        alt = word.replace("ß", "ss")
        return alt if "ß" in word and train_words[alt] > 10 * train_words[word] else word

    seen: set[str] = set()
    kept: list[str] = []
    for path in sorted(Path(fortunes).iterdir()):
        if path.name in FORTUNES_SKIPPED or path.name.startswith(".") or not path.is_file():
            continue
        for fortune in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            lines = [ln for ln in fortune.split("\n") if ln.strip() and not ln.strip().startswith("--")]
            for s in SENTENCE_END.split(clean(" ".join(lines))):
                s = _WORD.sub(modern, s.strip())
                if (is_sentence(s) and MIN_WORDS <= len(s.split()) <= MAX_WORDS and s not in seen
                        and not _NOT_PROSE.search(s)):
                    seen.add(s)
                    if s not in held:
                        kept.append(s)
    return kept


def write_back_translated(data_dir: Path, german: Sequence[str], english: Sequence[str], out_dir: Path,
                          reverse_model: dict | None = None) -> dict:
    """out_dir/translate/: data_dir's splits, train extended by the (English, German) pairs of the back-translation.
    A pair is dropped when its English is empty, holds a tab, runs past three times the German's words (a
    reverse model stuck in a loop) or resembles the English side of a valid or test pair. `reverse_model` (what
    made the English: its steps, validation, weights) goes into the meta.json."""
    if len(german) != len(english):
        raise ValueError(f"{len(german)} German sentences but {len(english)} translations")
    src, dst = Path(data_dir) / "translate", Path(out_dir) / "translate"
    dst.mkdir(parents=True, exist_ok=True)
    for split in ("valid", "test"):
        shutil.copyfile(src / f"{split}.tsv", dst / f"{split}.tsv")
    held = NearDuplicates([en for split in ("valid", "test") for en, _ in load_pairs(data_dir, split)])
    pairs = [(en.strip(), de.strip()) for en, de in zip(english, german, strict=True)]
    pairs = [(en, de) for en, de in pairs if en and de and "\t" not in en
             and len(en.split()) <= 3 * len(de.split()) and en not in held]
    real = (src / "train.tsv").read_text(encoding="utf-8")
    (dst / "train.tsv").write_text(real + "".join(f"{en}\t{de}\n" for en, de in pairs), encoding="utf-8")
    meta = json.loads((src / "meta.json").read_text())
    meta["sources"][SOURCE_NAME] = len(pairs)
    meta["counts"]["train"] += len(pairs)
    meta["back_translation"] = {"german": f"debian:{FORTUNES_PACKAGE}", "sentences": len(german),
                                "pairs_kept": len(pairs), "decoding": "greedy", "reverse_model": reverse_model or {}}
    (dst / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta
