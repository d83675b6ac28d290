"""`kvserve export`: checkpoint -> verified model bundle (or CTranslate2 model).

    kvserve export CHECKPOINT --out BUNDLE [--variant fp32|int8|int8-dynamic|fp16] [--format onnx|ctranslate2] [--force]

load -> export -> validate (onnx.checker, contract, parity against PyTorch) -> save. Refuses to overwrite
an existing output without --force; the bundle is built in a sibling temporary directory and moved into
place only once it passed, so a failed export never leaves a half-written bundle. Prints a short report
(file sizes, parity, timings).

Owns: the export pipeline and its report, `register(subparsers)` for kvserve/cli.py. Torch is imported
inside the command (this module is imported by `kvserve --help` on torch-free installs). The parity checks
run the bundle through serving's ONNX Runtime (kvserve/runtime.py), injected into export/parity.py.
`kvserve evaluate BUNDLE` is export/evaluate.evaluate_bundle.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from export.bundle import Variant, load_bundle, write_manifest
from export.contract import TOKENIZER_FILE
from export.evaluate import DEFAULT_DATA_DIR

DEFAULT_OPSET = 24
PARITY_SLOTS = 8
GATE_SLOTS = 32  # rows decoded at once by the quality gate (export/quality_gate.py): its sets in few batches


class ExportError(ValueError):
    """The export was refused or its validation failed; the message says why and what to do."""


def _prepare_out(out: Path, force: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} already exists and is not empty; pass --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    return work


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__}


def build_bundle(checkpoint: Path, out: Path, variant: Variant = Variant.FP32, force: bool = False,
                 opset: int = DEFAULT_OPSET, check_sentences: int | None = None,
                 data_dir: str = DEFAULT_DATA_DIR) -> dict[str, Any]:
    """Export a checkpoint into a verified bundle at `out`; returns the manifest.

    check_sentences: test-split sentences/prompts for the real-data parity and quality delta (default: 200
    for int8/fp16, which ship only with a measured quality change; 0 for fp32). Skipped, with a note in the
    manifest, when the data is not prepared."""
    from export.onnx_export import check_onnx_graph, export_model
    from model.checkpoint import load_checkpoint

    timings: dict[str, float] = {}
    t = time.perf_counter()
    ckpt = load_checkpoint(checkpoint)
    timings["load_s"] = time.perf_counter() - t
    work = _prepare_out(out, force)
    try:
        t = time.perf_counter()
        contracts = export_model(ckpt.model, work, variant.float_dtype, opset)
        timings["export_s"] = time.perf_counter() - t
        t = time.perf_counter()
        _apply_variant(work, contracts, variant, check_onnx_graph)
        timings["variant_s"] = time.perf_counter() - t
        shutil.copyfile(ckpt.path / TOKENIZER_FILE, work / TOKENIZER_FILE)
        core = {
            "task": ckpt.task, "model_config": ckpt.config.to_dict(), "variant": variant.value, "opset": opset,
            "tokenizer": {"file": TOKENIZER_FILE, "special_ids": ckpt.tokenizer.special_ids},
            "graphs": {k: c.to_dict() for k, c in contracts.items()},
            "source": {"checkpoint": str(checkpoint), "weights_sha256": ckpt.weights_sha256(),
                       "step": ckpt.meta.get("step"), "metrics": ckpt.meta.get("metrics")},
            "export": {**_versions(), "created_unix": int(time.time())},
        }
        write_manifest(work, core)
        t = time.perf_counter()
        parity = _validate(work, ckpt, variant, checkpoint, check_sentences, data_dir)
        timings["parity_s"] = time.perf_counter() - t
        core["export"]["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
        manifest = write_manifest(work, {**core, "parity": parity})
        load_bundle(work)  # the bundle as serving will see it
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _apply_variant(work: Path, contracts: dict, variant: Variant, check_onnx_graph) -> None:
    from export.variants import check_fp16, quantize_int8, quantize_int8_dynamic

    quantize = {Variant.INT8: quantize_int8, Variant.INT8_DYNAMIC: quantize_int8_dynamic}.get(variant)
    for c in contracts.values():
        path = work / c.file
        if quantize is not None:
            quantize(path)
            check_onnx_graph(path, c)
        elif variant is Variant.FP16:
            check_fp16(path)


def _validate(work: Path, ckpt: Any, variant: Variant, checkpoint: Path, check_sentences: int | None,
              data_dir: str) -> dict[str, Any]:
    """Synthetic lockstep parity (always; fp32 must be within FP32_TOLERANCE with identical greedy tokens),
    then real-data parity and quality delta when asked for and the data exists."""
    from export.parity import FP32_TOLERANCE, real_parity, synthetic_parity
    from kvserve.runtime import ort_runtime
    from model import data

    bundle = load_bundle(work)
    parity: dict[str, Any] = {"tolerance": FP32_TOLERANCE if variant is Variant.FP32 else None}
    # "synthetic_cpu": the graph the CPU EP serves (decoder_cpu.onnx where the bundle has it);
    # "synthetic_cpu_portable": decoder.onnx on the CPU EP, when it is not that graph
    graphs = {"synthetic_cpu": None, **({"synthetic_cpu_portable": "decoder"} if "decoder_cpu" in bundle.paths else {})}
    for key, graph in graphs.items():
        rt = ort_runtime(provider="cpu", decoder_graph=graph)(bundle, PARITY_SLOTS)
        syn = synthetic_parity(ckpt.model, rt, ckpt.tokenizer.special_ids)
        syn.pop("batches")
        syn["graph"] = rt.decoder_graph
        failed = syn["logits_max_abs"] > FP32_TOLERANCE or syn["rows_greedy_identical"] < syn["rows"]
        if variant is Variant.FP32 and failed:
            raise ExportError(f"parity check failed: fp32 logits of {rt.decoder_graph}.onnx differ from PyTorch "
                              f"by {syn['logits_max_abs']:.3g} (tolerance {FP32_TOLERANCE}), greedy tokens "
                              f"identical on {syn['rows_greedy_identical']}/{syn['rows']} rows; the bundle was "
                              f"not written")
        parity[key] = syn
    if variant is not Variant.FP32:
        parity["quality_gate"] = _quality_gate(bundle, ckpt, variant)
    n = (0 if variant is Variant.FP32 else 200) if check_sentences is None else check_sentences
    if n > 0 and data.is_prepared(Path(data_dir), ckpt.task):
        real = real_parity(work, checkpoint, n, data_dir, ort_runtime(provider="cpu"))
        parity["test_split_cpu"] = {k: real[k] for k in ("lockstep", "greedy", "quality")}
    elif n > 0:
        parity["test_split_cpu"] = None
        parity["note"] = (f"quality change not measured: the {ckpt.task} data is not prepared in {data_dir} "
                          f"(run `kvserve data --task {ckpt.task}`)")
    return parity


def _quality_gate(bundle: Any, ckpt: Any, variant: Variant) -> dict[str, Any]:
    """The variant on the CPU EP against the fp32 PyTorch model on the task's fixed set (export/quality_gate.py);
    ExportError beyond the bound."""
    from export import quality_gate
    from export.parity import TorchRuntime
    from kvserve.runtime import ort_runtime

    rt = ort_runtime(provider="cpu")(bundle, GATE_SLOTS)
    ref = TorchRuntime(ckpt.model, GATE_SLOTS, ckpt.tokenizer.special_ids)
    result = quality_gate.measure(ckpt.task, ref, rt, ckpt.tokenizer)
    try:
        quality_gate.check(result, f"the {variant.value} variant")
    except quality_gate.QualityGateError as e:
        raise ExportError(f"{e}; the bundle was not written") from e
    return result


def _report(out: Path, manifest: dict[str, Any]) -> str:
    sizes = {name: f"{(out / name).stat().st_size / 1e6:.2f} MB" for name in manifest["files"]}
    p = manifest["parity"]
    lines = [f"bundle {out}: task {manifest['task']}, variant {manifest['variant']}, opset {manifest['opset']}",
             "files: " + ", ".join(f"{k} {v}" for k, v in sizes.items()),
             *(f"parity (synthetic, CPU EP, {p[k]['graph']}.onnx): logits max-abs {p[k]['logits_max_abs']:.3g}, "
               f"greedy identical {p[k]['rows_greedy_identical']}/{p[k]['rows']} rows"
               for k in ("synthetic_cpu", "synthetic_cpu_portable") if k in p)]
    if p.get("quality_gate"):
        g = p["quality_gate"]
        lines.append(f"quality gate ({g['set']}): {g['metric']} {g['variant']} vs fp32 {g['reference']} "
                     f"(delta {g['delta']:+}, bound {g['max_loss']}): passed")
    if p.get("test_split_cpu"):
        lines.append("parity (test split): " + json.dumps(p["test_split_cpu"]))
    if p.get("note"):
        lines.append("note: " + p["note"])
    lines.append("timings: " + ", ".join(f"{k} {v}" for k, v in manifest["export"]["timings_s"].items()))
    return "\n".join(lines)


def _cmd_export(args: argparse.Namespace) -> int:
    out, ckpt = Path(args.out), Path(args.checkpoint)
    if args.format == "ctranslate2":
        from export.ctranslate2_convert import convert_checkpoint

        report = convert_checkpoint(ckpt, out, force=args.force, quantization=args.ct2_quantization)
        print(json.dumps(report, indent=2))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    manifest = build_bundle(ckpt, out, Variant(args.variant), args.force, args.opset, args.check_sentences,
                            args.data_dir)
    print(_report(out, manifest))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export", help="checkpoint -> verified ONNX model bundle (or CTranslate2 model)",
        description="Export a checkpoint to a model bundle (manifest.json with hashes and parity figures, "
                    "tokenizer.json, encoder.onnx + decoder.onnx or decoder.onnx) and verify it: onnx.checker, "
                    "the graph contract, and parity against PyTorch through ONNX Runtime. Or convert the same "
                    "weights to CTranslate2 (--format ctranslate2). Needs the `export` extra (torch).")
    p.add_argument("checkpoint", help="checkpoint directory (kvserve train --out)")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--variant", choices=[v.value for v in Variant], default="fp32",
                   help="fp32 (reference); int8 (CPU: 8-bit MatMul weights, per-row activation scales, so a "
                        "request's output does not depend on its batch); int8-dynamic (CPU: ORT dynamic quantization, "
                        "faster, but rows depend on their batch-mates); fp16 (CUDA)")
    p.add_argument("--format", choices=("onnx", "ctranslate2"), default="onnx")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (>= 24: TensorScatter)")
    p.add_argument("--check-sentences", type=int, default=None,
                   help="test-split sentences for real-data parity and the quality delta "
                        "(default 200 for int8/fp16, 0 for fp32)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="data directory of `kvserve data`")
    p.add_argument("--threads", type=int, default=2, help="torch and ORT threads for the checks")
    p.add_argument("--ct2-quantization", default=None, help="CTranslate2 weight type (e.g. int8), default float32")
    p.set_defaults(func=_cmd_export)
