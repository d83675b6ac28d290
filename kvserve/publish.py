"""`kvserve publish`: a trained checkpoint -> a published model (float16 weights + a provenance manifest).

    kvserve publish CHECKPOINT --out published/translate [--compare published/translate] [--force]

write the float16 release -> measure it (test split, and the fixed eval sets of published/eval/) -> export it
once to learn its bundle version (the version `/v1/models` reports for it) -> write manifest.json. With
--compare, the new metrics are set against another published model's (the repository's, when `make train`
reproduces them) and the command fails when one falls outside model/published.py TOLERANCE.

Owns the manifest's contents. The layout and the comparison are model/published.py's. Torch is imported inside
the command (this module is imported by `kvserve --help` on torch-free installs).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from export.bundle import sha256_file
from model.published import (BEAM_SET, BEAM_SIZE, MANIFEST, TOLERANCE, compare, everyday_pairs, lm_text,
                             read_manifest)

RELEASE_DTYPE = "float16"
REPRODUCE = ("make train   # = kvserve up --train --no-serve: kvserve data --task all, then both recipes "
             "(kvserve train --task translate|generate --threads 1, side by side); the translator distilled: the "
             "recipe's one published and exported as the teacher, kvserve distill --beam-size 4, kvserve train "
             "--init TEACHER --data-dir artifacts/data-kd --steps 4000 --lr 0.0005 --warmup 200 --threads 1 "
             "(model/train_config.py DISTILLATION); then kvserve publish --compare published/<task>")


def write_release(checkpoint: Path, out: Path) -> Any:
    """The checkpoint's weights in float16, its description and tokenizer, in `out`; returns the loaded
    checkpoint (its model converted to float16 in place)."""
    import torch

    from model.checkpoint import META, TOKENIZER, load_checkpoint, save_checkpoint

    ckpt = load_checkpoint(checkpoint)
    meta = {k: v for k, v in json.loads((checkpoint / META).read_text()).items() if k not in ("task", "model_config")}
    save_checkpoint(out, ckpt.model.to(torch.float16), ckpt.config, ckpt.task, checkpoint / TOKENIZER,
                    {**meta, "weights_dtype": RELEASE_DTYPE})
    return ckpt


def data_record(data_dir: Path, task: str) -> dict[str, Any]:
    """The prepared data the model was trained and measured on: its sources and counts, and the sha256 of
    every file `kvserve data` wrote, so a rerun can tell whether it trained on the same bytes."""
    d = Path(data_dir) / task
    meta = json.loads((d / "meta.json").read_text())
    files = {p.name: sha256_file(p) for p in sorted(d.iterdir()) if p.is_file()}
    keep = ("source", "sources", "counts", "distillation") if task == "translate" else ("source", "works", "chars")
    return {**{k: meta[k] for k in keep if k in meta}, "sha256": files}


def measure(release: Path, data_dir: Path) -> dict[str, dict[str, Any]]:
    """Metrics of the release in PyTorch (float16 weights upcast): what `kvserve evaluate` reports for the test
    split (the translator's also with `--beam-size 4`), and the same figures on the fixed eval sets of
    published/eval/ (no download needed)."""
    from model.checkpoint import load_checkpoint
    from model.decode import lm_nll, translate
    from model.evaluate import evaluate_checkpoint
    from model.scores import bits_per_char, bleu, chrf

    test = evaluate_checkpoint(release, split="test", data_dir=data_dir)
    ck = load_checkpoint(release)
    if ck.task == "translate":
        pairs = everyday_pairs()
        hyps = translate(ck.model, ck.tokenizer, [s for s, _ in pairs], max_new_tokens=ck.config.max_len - 1)
        refs = [t for _, t in pairs]
        beam = evaluate_checkpoint(release, split="test", data_dir=data_dir, beam_size=BEAM_SIZE)
        return {"test": {k: test[k] for k in ("chrf", "bleu", "sentences")},
                "everyday": {"chrf": chrf(hyps, refs), "bleu": bleu(hyps, refs), "sentences": len(pairs)},
                BEAM_SET: {k: beam[k] for k in ("chrf", "bleu", "sentences", "beam_size", "length_penalty")}}
    text = lm_text()
    nll, n_tokens = lm_nll(ck.model, ck.tokenizer.encode(text), ck.tokenizer.bos_id)
    return {"test": {k: test[k] for k in ("bits_per_char", "chars", "tokens")},
            "hamlet_excerpt": {"bits_per_char": round(bits_per_char(nll, len(text)), 4), "chars": len(text),
                               "tokens": n_tokens}}


def bundle_version(release: Path) -> dict[str, Any]:
    """Export the release once (fp32, with its parity checks) and return the bundle's version, content hash
    (what a Serve config pins: `bundle_sha256`) and size."""
    from export.bundle import content_sha256
    from kvserve.export import build_bundle

    with tempfile.TemporaryDirectory() as tmp:
        manifest = build_bundle(release, Path(tmp) / "bundle")
        size = sum(p.stat().st_size for p in (Path(tmp) / "bundle").iterdir())
    versions = {k: manifest["export"][k] for k in ("torch", "onnx", "onnxscript", "onnxruntime")}
    return {"version": manifest["version"], "sha256": content_sha256(manifest), "fp32_bundle_bytes": size,
            "export_versions": versions}


def publish(checkpoint: Path, out: Path, data_dir: Path, force: bool = False,
            trained_commit: str | None = None) -> dict[str, Any]:
    """Write the published model of `checkpoint` into `out`; returns its manifest."""
    from model.provenance import git_commit, machine, package_versions

    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"--out {out} already exists and is not empty; pass --force to replace it")
    work = out.parent / f".{out.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    ckpt = write_release(checkpoint, work)
    meta = json.loads((work / "checkpoint.json").read_text())
    starts = meta.get("starts") or [{}]
    if trained_commit:  # a checkpoint trained before runs recorded where they ran: published on the same machine
        starts[0] = {"step": 0, "machine": machine(), "versions": package_versions(), **starts[0],
                     "commit": trained_commit}
    t0 = time.perf_counter()
    metrics = measure(work, data_dir)
    built = bundle_version(work)
    manifest = {
        "name": ckpt.task, "task": ckpt.task, "version": built["version"],
        "weights": {"file": "model.safetensors", "dtype": RELEASE_DTYPE, "parameters": meta.get("parameters"),
                    "bytes": (work / "model.safetensors").stat().st_size,
                    "sha256": sha256_file(work / "model.safetensors")},
        "tokenizer": {"file": "tokenizer.json", "vocab_size": ckpt.tokenizer.vocab_size,
                      "sha256": sha256_file(work / "tokenizer.json")},
        "model_config": ckpt.config.to_dict(),
        "recipe": meta.get("train_config", {}),
        "training": {"steps": meta.get("step"), "train_seconds": meta.get("elapsed_s"),
                     "weights_kept": meta.get("weights"), "valid": meta.get("metrics"), "starts": starts,
                     **({"init": meta["init"]} if meta.get("init") else {})},
        "data": data_record(data_dir, ckpt.task),
        "metrics": metrics,
        "metrics_tolerance": TOLERANCE,
        "measured": {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "machine": machine(),
                     "versions": package_versions(), "seconds": round(time.perf_counter() - t0, 1)},
        "bundle": {"sha256": built["sha256"], "fp32_bytes": built["fp32_bundle_bytes"],
                   "export": built["export_versions"]},
        "reproduce": REPRODUCE,
    }
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    work.replace(out)
    return manifest


def _cmd_publish(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    manifest = publish(Path(args.checkpoint), out, Path(args.data_dir), args.force, args.trained_commit)
    print(json.dumps({k: manifest[k] for k in ("name", "version", "metrics")}, indent=2))
    if not args.compare:
        return 0
    rows = compare(read_manifest(Path(args.compare)), manifest)
    for r in rows:
        print(f"{r['set']:>15} {r['metric']:>14}: published {r['published']}, this run {r['rerun']} "
              f"(delta {r['delta']:+}, tolerance {r['tolerance']}): {'reproduced' if r['within'] else 'NOT reproduced'}")
    return 0 if rows and all(r["within"] for r in rows) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "publish", help="trained checkpoint -> published model (float16 weights + provenance manifest)",
        description="Write a checkpoint as a published model: float16 weights, tokenizer, and manifest.json with "
                    "the recipe, the data's sha256, steps, commit, machine, library versions, the metrics (test "
                    "split and published/eval/), the bundle version and the command that reproduces it. Needs the "
                    "`export` extra (torch) and the prepared data (kvserve data).")
    p.add_argument("checkpoint", help="checkpoint directory (kvserve train --out)")
    p.add_argument("--out", required=True, help="directory of the published model to write")
    p.add_argument("--data-dir", default="artifacts/data", help="data directory of `kvserve data`")
    p.add_argument("--compare", default=None, help="a published model to compare the metrics with (exit 1 when "
                                                   "one is outside the tolerance)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--trained-commit", default=None, help="the commit that trained a checkpoint whose run did not "
                                                          "record it (trained on this machine)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.set_defaults(func=_cmd_publish)
