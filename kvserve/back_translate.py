"""`kvserve back-translate`: the translator's training data extended by back-translation, stage by stage.

    reverse data    ARTIFACTS/data-reverse/translate   the parallel splits, German -> English
    reverse model   ARTIFACTS/ckpt/translate-reverse   kvserve train --task translate --steps REVERSE_STEPS
    reverse bundle  ARTIFACTS/bundles/translate-reverse  kvserve export (fp32)
    data            ARTIFACTS/data-bt/translate        fortunes-de's German sentences translated by that bundle
                                                       (the serving engine, greedy), added to the real pairs

`make train` (kvserve/up.py `retrain`) runs the reverse model's training beside the LM's, then the rest, then the
translator's recipe on ARTIFACTS/data-bt. Each stage is skipped when its output is there, and an interrupted
training resumes, so the command can be run again after a stop. The data part is model/back_translation.py's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvserve import stages
from model.back_translation import fetch_fortunes, german_sentences, write_back_translated, write_reversed
from model.train_config import BACK_TRANSLATION

REVERSE = "translate-reverse"  # the reverse model's name under ARTIFACTS/ckpt and ARTIFACTS/bundles


def data_dir(art: Path) -> Path:
    """Where the translator's back-translated training data is written."""
    return art / "data-bt"


def is_done(art: Path) -> bool:
    return (data_dir(art) / "translate" / "meta.json").is_file()


def reverse_run(art: Path) -> tuple[Path, list[str]]:
    """The reverse model's checkpoint directory and its `kvserve train` arguments (the translate recipe on the
    reversed data, for BACK_TRANSLATION["reverse_steps"] steps on one thread); the reversed data is written
    first when it is not there yet."""
    reverse_data = art / "data-reverse"
    if not (reverse_data / "translate" / "meta.json").is_file():
        write_reversed(art / "data", reverse_data)
    out = art / "ckpt" / REVERSE
    return out, ["train", "--task", "translate", "--data-dir", str(reverse_data), "--out", str(out),
                 "--steps", str(BACK_TRANSLATION["reverse_steps"]), "--threads", "1"]


def translate_german(art: Path) -> dict:
    """The stages after the reverse model's training: its bundle, the translation of the German sentences and
    the data directory of real + synthetic pairs. Returns the data's meta."""
    from kvserve.translate import translate_texts
    from serving.engine.types import SamplingParams

    ckpt, bundle = art / "ckpt" / REVERSE, art / "bundles" / REVERSE
    if not (ckpt / "metrics.json").is_file():
        raise FileNotFoundError(f"{ckpt} holds no finished reverse model: run `kvserve back-translate` (it trains "
                                f"one) or `make train`")
    if not (bundle / "manifest.json").is_file():
        stages.run_stage(stages.kvserve_cmd("export", str(ckpt), "--out", str(bundle), "--force", "--data-dir",
                              str(art / "data-reverse")), "export the reverse model")
    german = german_sentences(art / "data", fetch_fortunes(art / "data" / "cache"))
    print(f"==> back-translate {len(german)} German sentences with {bundle}", file=sys.stderr, flush=True)
    t0 = time.time()
    params = SamplingParams(max_new_tokens=BACK_TRANSLATION["max_tokens"], beam_size=1)
    english = translate_texts(str(bundle), german, params, slots=BACK_TRANSLATION["slots"])
    print(f"==> back-translated in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return write_back_translated(art / "data", german, english, data_dir(art), reverse_record(ckpt, bundle))


def reverse_record(ckpt: Path, bundle: Path) -> dict:
    """What the data's meta.json says of the reverse model: its run and the weights its bundle was exported from
    (no paths: a rerun elsewhere writes the same bytes)."""
    metrics = json.loads((ckpt / "metrics.json").read_text())
    manifest = json.loads((bundle / "manifest.json").read_text())
    return {"steps": metrics.get("steps"), "valid": metrics.get("final", {}),
            "weights_sha256": manifest.get("source", {}).get("weights_sha256")}


def back_translate(art: Path) -> dict:
    """Every stage, in order, each skipped when done: what `kvserve back-translate` runs."""

    if is_done(art):
        return json.loads((data_dir(art) / "translate" / "meta.json").read_text())
    out, args = reverse_run(art)
    if not (out / "metrics.json").is_file():
        resume = ["--resume"] if (out / "train_state.pt").is_file() else []
        stages.run_stage(stages.kvserve_cmd(*args, *resume), "train the reverse model")
    return translate_german(art)


def _cmd(args: argparse.Namespace) -> int:
    art = Path(args.artifacts)
    if not (art / "data" / "translate" / "meta.json").is_file():
        raise FileNotFoundError(f"{art / 'data'} holds no translation data: run `kvserve data --task translate "
                                f"--out {art / 'data'}` first")
    print(json.dumps(back_translate(art), indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "back-translate", help="the translator's training data + back-translated German (needs torch)",
        description="Train a German -> English model on the reversed parallel data, translate the German sentences "
                    "of fortunes-de with it (the serving engine, greedy) and write ARTIFACTS/data-bt: the real "
                    "pairs plus the synthetic ones, what the translate recipe trains on. Stages already done are "
                    "skipped; an interrupted training resumes. About 80 minutes on one core.")
    p.add_argument("--artifacts", default="artifacts", help="holds data/ (kvserve data); ckpt/, bundles/ and "
                                                            "data-bt/ are written there")
    p.set_defaults(func=_cmd)
