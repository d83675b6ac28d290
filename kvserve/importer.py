"""`kvserve import marian`: a downloaded Hugging Face Marian / OPUS-MT checkpoint -> a verified model bundle.

    kvserve import marian HF_DIR --out BUNDLE [--variant fp32|int8|fp16] [--max-len N] [--force]

read + check the folder (model/marian.py: refuses what the mapping was not written for, naming the field) ->
map the weights into kvserve's EncoderDecoder -> check it against transformers' MarianMTModel (lockstep, when
transformers is installed) -> export the same bundle format as `kvserve export` (export/onnx_export.py,
variants) -> parity of the bundle against the imported PyTorch model (fp32 must agree within the tolerance)
-> move into place. The bundle carries Marian's tokenizer (vocab.json, source.spm, target.spm: model/
spm_tokenizer.py) and its bad_words_ids as `generation.banned_ids`, which the engine never generates.

Owns: the import pipeline, its report, `register(subparsers)` for kvserve/cli.py (subcommand `import`). Reuses
kvserve/export.py's output handling, variant step and bundle validation. Torch is imported inside the command.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from export.bundle import Variant, load_bundle, sha256_file, write_manifest
from kvserve.export import DEFAULT_OPSET, ExportError, _apply_variant, _prepare_out, _report, _validate, _versions

REFERENCE_TOLERANCE = 1e-4  # max-abs logits difference accepted between the imported model and transformers'
HF_CONFIG_KEPT = ("activation_function", "d_model", "encoder_layers", "decoder_layers", "vocab_size",
                  "max_position_embeddings", "scale_embedding", "decoder_start_token_id", "pad_token_id",
                  "eos_token_id", "_name_or_path")


def _reference_check(ck: Any, model: Any) -> dict[str, Any]:
    """The imported model against transformers' MarianMTModel; skipped (with a note) without transformers."""
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        return {"skipped": "transformers is not installed (pip install 'kvserve[import]' to check the mapping "
                           "against MarianMTModel)"}
    from export.marian_parity import reference_parity

    result = reference_parity(ck.folder, model, ck.special_ids)
    if result["logits_max_abs"] > REFERENCE_TOLERANCE or result["rows_greedy_identical"] < result["rows"]:
        raise ExportError(f"the imported model differs from transformers' MarianMTModel: logits max-abs "
                          f"{result['logits_max_abs']:.3g} (tolerance {REFERENCE_TOLERANCE}), greedy identical on "
                          f"{result['rows_greedy_identical']}/{result['rows']} rows; this checkpoint uses something "
                          f"the importer does not map. The bundle was not written")
    return result


def _weights_file(folder: Path) -> Path:
    safe = folder / "model.safetensors"
    return safe if safe.is_file() else folder / "pytorch_model.bin"


def import_marian(folder: Path, out: Path, variant: Variant = Variant.FP32, force: bool = False,
                  opset: int = DEFAULT_OPSET, max_len: int | None = None) -> dict[str, Any]:
    """Import a Marian checkpoint folder into a verified bundle at `out`; returns the manifest."""
    from export.onnx_export import check_onnx_graph, export_model
    from model.marian import import_model, read_checkpoint
    from model.spm_tokenizer import FILES, SentencePieceTokenizer, VOCAB

    timings: dict[str, float] = {}
    t = time.perf_counter()
    ck = read_checkpoint(folder, max_len)
    SentencePieceTokenizer(folder, ck.special_ids)  # the tokenizer files load before anything is written
    model = import_model(ck)
    reference = _reference_check(ck, model)
    timings["load_s"] = time.perf_counter() - t
    work = _prepare_out(out, force)
    try:
        t = time.perf_counter()
        contracts = export_model(model, work, variant.float_dtype, opset)
        _apply_variant(work, contracts, variant, check_onnx_graph)
        timings["export_s"] = time.perf_counter() - t
        for name in FILES:
            shutil.copyfile(folder / name, work / name)
        core = {
            "task": "translate", "model_config": ck.config.to_dict(), "variant": variant.value, "opset": opset,
            "tokenizer": {"kind": "sentencepiece", "file": VOCAB, "files": [f for f in FILES if f != VOCAB],
                          "special_ids": ck.special_ids},
            "generation": {"banned_ids": list(ck.banned_ids)},
            "graphs": {k: c.to_dict() for k, c in contracts.items()},
            "source": {"marian": str(folder), "weights_sha256": sha256_file(_weights_file(folder)),
                       "config": {k: ck.hf_config[k] for k in HF_CONFIG_KEPT if k in ck.hf_config}},
            "export": {**_versions(), "created_unix": int(time.time())},
        }
        write_manifest(work, core)
        t = time.perf_counter()
        stand_in = SimpleNamespace(model=model, tokenizer=SimpleNamespace(special_ids=ck.special_ids),
                                   task="translate")
        parity = _validate(work, stand_in, variant, folder, 0, "")
        parity["transformers"] = reference
        timings["parity_s"] = time.perf_counter() - t
        core["export"]["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
        manifest = write_manifest(work, {**core, "parity": parity})
        load_bundle(work).load_tokenizer()  # the bundle as serving will see it
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _cmd_import(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    manifest = import_marian(Path(args.checkpoint), out, Variant(args.variant), args.force, args.opset, args.max_len)
    print(_report(out, manifest))
    ref = manifest["parity"]["transformers"]
    print("parity (imported model vs transformers' MarianMTModel): " + json.dumps(
        {k: ref[k] for k in ("logits_max_abs", "rows", "rows_greedy_identical", "skipped") if k in ref}))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import", help="a Hugging Face Marian / OPUS-MT checkpoint folder -> verified model bundle",
        description="Import a downloaded Marian checkpoint (MarianMTModel, Helsinki-NLP/opus-mt-*: config.json, "
                    "model.safetensors or pytorch_model.bin, source.spm, target.spm, vocab.json, "
                    "tokenizer_config.json) into a bundle served like kvserve's own translator. Checks the mapping "
                    "against transformers' MarianMTModel when transformers is installed, and the bundle against "
                    "the imported PyTorch model. Refuses configs it does not support, naming the field. Needs the "
                    "`import` extra (torch, sentencepiece; transformers for the reference check).")
    p.add_argument("format", choices=("marian",), help="checkpoint family (marian)")
    p.add_argument("checkpoint", help="the checkpoint folder (downloaded; nothing is fetched)")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--variant", choices=("fp32", "int8", "fp16"), default="fp32",
                   help="fp32 (reference), int8 (CPU, batch-invariant), fp16 (CUDA)")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest source and translation in tokens (KV cache length; default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (>= 24)")
    p.add_argument("--threads", type=int, default=2, help="torch and ORT threads for the checks")
    p.set_defaults(func=_cmd_import)
