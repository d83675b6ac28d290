"""`kvserve distill`: a translator's training data made of a teacher's beam-search translations.

    kvserve distill --teacher BUNDLE --data-dir artifacts/data --out artifacts/data-kd [--beam-size 4]

Sequence-level knowledge distillation (Kim & Rush, 2016): each distinct English sentence of the train split is
translated by the teacher bundle through the serving engine with beam search, and the (English, teacher's
German) pairs make the new train split (`--real-pairs`: after the real pairs). A model trained on them learns the
teacher's beam output, so its greedy decoding gets part of what the teacher needed a beam for
(docs/decisions/distillation.md). Valid and test are copied unchanged: nothing held out is translated or trained
on.

Owns choosing the sentences, which outputs are kept and the data directory it writes (meta.json records the
teacher and the decoding). Needs the `serve` extra (the engine), not torch.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

SOURCE_NAME = "teacher's beam search on the train sources (train only)"


def train_sources(data_dir: Path) -> list[str]:
    """The English side of the train split, each sentence once, in file order."""
    from model.data import load_pairs

    return list(dict.fromkeys(en for en, _ in load_pairs(data_dir, "train")))


def keep(source: str, output: str) -> bool:
    """A teacher output worth training on: not empty, one line without tabs, and not a loop (more than three times
    the source's words plus five)."""
    out = output.strip()
    return bool(out) and "\t" not in out and "\n" not in out and len(out.split()) <= 3 * len(source.split()) + 5


def write_distilled(data_dir: Path, sources: Sequence[str], outputs: Sequence[str], out_dir: Path,
                    teacher: dict, real_pairs: bool = False) -> dict:
    """out_dir/translate/: data_dir's splits with a train split of the kept (source, teacher output) pairs, after
    the real pairs with `real_pairs`; returns the meta.json written there (`teacher` says what made the outputs)."""
    if len(sources) != len(outputs):
        raise ValueError(f"{len(sources)} sources but {len(outputs)} teacher outputs")
    src, dst = Path(data_dir) / "translate", Path(out_dir) / "translate"
    dst.mkdir(parents=True, exist_ok=True)
    for split in ("valid", "test"):
        shutil.copyfile(src / f"{split}.tsv", dst / f"{split}.tsv")
    pairs = [(s, o.strip()) for s, o in zip(sources, outputs, strict=True) if keep(s, o)]
    real = (src / "train.tsv").read_text(encoding="utf-8") if real_pairs else ""
    (dst / "train.tsv").write_text(real + "".join(f"{s}\t{o}\n" for s, o in pairs), encoding="utf-8")
    meta = json.loads((src / "meta.json").read_text())
    teacher_data = {"sources": dict(meta["sources"]), "train_pairs": meta["counts"]["train"]}  # what the teacher had
    if not real_pairs:  # every train pair is the teacher's; the sources of the English sides are the teacher's data's
        meta["sources"], meta["counts"]["train"] = {}, 0
    meta["sources"][SOURCE_NAME] = len(pairs)
    meta["counts"]["train"] += len(pairs)
    meta["distillation"] = {"sentences": len(sources), "pairs_kept": len(pairs), "real_pairs": real_pairs,
                            **teacher, "data": teacher_data}
    (dst / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def teacher_record(bundle: Path, beam_size: int, length_penalty: float) -> dict:
    """What the data's meta.json says of the teacher: the weights its bundle was exported from and the decoding
    (no paths: a rerun elsewhere writes the same bytes)."""
    manifest = json.loads((Path(bundle) / "manifest.json").read_text())
    return {"teacher_weights_sha256": manifest.get("source", {}).get("weights_sha256"),
            "teacher_variant": manifest.get("variant"), "decoding": "beam", "beam_size": beam_size,
            "length_penalty": length_penalty}


def translate_sharded(teacher: str, sources: list[str], params: Any, slots: int, workers: int) -> list[str]:
    """The teacher's translations of `sources` in order, by `workers` engines in processes of their own (one ONNX
    Runtime thread each: on a CPU one-thread engines side by side translate more than one engine with more
    threads), each on a contiguous share; the first one draws the progress bar."""
    from kvserve.translate import translate_texts

    if workers <= 1:
        return translate_texts(teacher, sources, params, slots=slots, threads=1, progress=True)
    size = -(-len(sources) // workers)
    shares = [sources[i:i + size] for i in range(0, len(sources), size)]
    with ProcessPoolExecutor(len(shares), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(translate_texts, teacher, share, params, slots, 1, "auto", i == 0)
                   for i, share in enumerate(shares)]
        return [text for f in futures for text in f.result()]


def distill(teacher: Path, data_dir: Path, out_dir: Path, beam_size: int = 4, length_penalty: float = 1.0,
            slots: int = 64, workers: int = 1, limit: int | None = None, real_pairs: bool = False) -> dict:
    """Translate the train sources with the teacher and write out_dir (skipped when its meta.json names the
    same teacher, data and decoding)."""
    from export.bundle import sha256_file
    from serving.engine.types import SamplingParams

    record = {**teacher_record(teacher, beam_size, length_penalty), "real_pairs": real_pairs,
              "train_sha256": sha256_file(Path(data_dir) / "translate" / "train.tsv")}
    meta_file = Path(out_dir) / "translate" / "meta.json"
    if meta_file.is_file() and limit is None:
        meta = json.loads(meta_file.read_text())
        if {k: meta.get("distillation", {}).get(k) for k in record} == record:
            return meta
    sources = train_sources(data_dir)[: limit or None]
    print(f"==> distill: {len(sources)} train sources through {teacher} (beam {beam_size})", file=sys.stderr,
          flush=True)
    t0 = time.time()
    params = SamplingParams(max_new_tokens=128, beam_size=beam_size, length_penalty=length_penalty)
    outputs = translate_sharded(str(teacher), sources, params, slots, workers)
    print(f"==> distill: translated in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return write_distilled(data_dir, sources, outputs, out_dir, record, real_pairs)


def _cmd(args: argparse.Namespace) -> int:
    meta = distill(Path(args.teacher), Path(args.data_dir), Path(args.out), args.beam_size, args.length_penalty,
                   args.slots, args.workers, args.limit, args.real_pairs)
    print(json.dumps(meta["distillation"], indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "distill", help="train data of a teacher bundle's beam-search translations (distillation)",
        description="Sequence-level knowledge distillation: translate each distinct English train sentence with the "
                    "teacher bundle (the serving engine, beam search) and write a data directory whose train split "
                    "is made of the (English, teacher's German) pairs (--real-pairs: after the real ones); valid and "
                    "test are copied unchanged.")
    p.add_argument("--teacher", required=True, help="translation bundle that translates (kvserve export)")
    p.add_argument("--data-dir", default="artifacts/data", help="data directory of `kvserve data`")
    p.add_argument("--out", default="artifacts/data-kd", help="data directory to write")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--slots", type=int, default=64, help="KV-cache slots of the engine (rows per step)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="engines side by side, one thread each, each on a share of the sources (default: one per CPU)")
    p.add_argument("--real-pairs", action="store_true",
                   help="keep the real train pairs before the distilled ones (default: the distilled pairs only, "
                        "what the published translator was fine-tuned on)")
    p.add_argument("--limit", type=int, help="first N sources only (a trial)")
    p.set_defaults(func=_cmd)
