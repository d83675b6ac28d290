"""How close an int8 model's greedy outputs stay to fp32's, and which rounding makes them part.

    python -m bench.int8_fidelity artifacts/bundles/generate [--inputs 200] [--data-dir artifacts/data]

From an fp32 bundle it builds, in a temporary folder, the variants below and decodes the same inputs greedily with
each through serving's ONNX Runtime (CPU EP, as served), against the fp32 bundle:
- `int8`: the shipped variant (export/variants.py `rows_int8`: int8 weights per column, per-row int8 activations);
- `int8, output projection in float`: the same with the vocabulary projection left in float32;
- `weights rounded to int8`: float products, every product's weights rounded to int8 per column (no activation
  rounding: what the weights alone cost);
- `weights rounded to bf16`: float products, weights rounded to bfloat16 (8 bits of mantissa).

Per variant: the share of outputs identical to fp32's over their first 8 / 16 / 32 tokens and over the whole
output (LM: 64 new tokens from test-split prompts; translation: up to max_len - 1 tokens of test-split
sentences), and quality (LM: bits per character of published/eval/hamlet.txt; translation: chrF of
published/eval/everyday.en-de.tsv). An LM's continuations part at the first near-tie that rounding flips and
never meet again, so the whole-output share falls with the output's length while quality does not move.

Does not measure: speed (bench/decode_step.py, `kvserve bench --sections translate`). Owns this comparison only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from export.bundle import MANIFEST_FILE, load_bundle, write_manifest
from export.evaluate import greedy_decode, lm_chunks, nll_bits, prompt_ids, scores, source_ids, translate_texts
from export.parity import PREFIX_TOKENS, identical_by_prefix
from export.variants import _constant_weight, _int8_columns, rows_int8
from kvserve.runtime import ort_runtime
from model import data
from model.published import everyday_pairs, lm_text

SLOTS = 32
LM_TOKENS = 64


def _products(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, np.ndarray]]:
    weights = {i.name: i for i in model.graph.initializer}
    return [(n, w) for n in model.graph.node if (w := _constant_weight(n, weights)) is not None]


def _rounded_weights(rounding: Callable[[np.ndarray], np.ndarray]) -> Callable[[onnx.ModelProto], onnx.ModelProto]:
    """A graph transform that rounds every product's (K, N) weight in place, products left in float."""

    def transform(model: onnx.ModelProto) -> onnx.ModelProto:
        inits = {i.name: i for i in model.graph.initializer}
        for n, w in _products(model):
            transposed = n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)
            r = rounding(w).astype(np.float32)
            inits[n.input[1]].CopyFrom(
                numpy_helper.from_array(np.ascontiguousarray(r.T if transposed else r), n.input[1])
            )
        return model

    return transform


def _int8_weights(w: np.ndarray) -> np.ndarray:
    q, scale = _int8_columns(w)
    return q.astype(np.float32) * scale


def _bf16_weights(w: np.ndarray) -> np.ndarray:
    bits = w.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)  # round to nearest even


def _int8_float_output(vocab: int) -> Callable[[onnx.ModelProto], onnx.ModelProto]:
    def transform(model: onnx.ModelProto) -> onnx.ModelProto:
        keep = frozenset(n.output[0] for n, w in _products(model) if w.shape[1] == vocab)
        return rows_int8(model, float_nodes=keep)

    return transform


def variants(vocab: int) -> dict[str, tuple[str, Callable[[onnx.ModelProto], onnx.ModelProto]]]:
    """name -> (the bundle variant it is served as, graph transform)."""
    return {
        "int8": ("int8", rows_int8),
        "int8, output projection in float": ("int8", _int8_float_output(vocab)),
        "weights rounded to int8": ("fp32", _rounded_weights(_int8_weights)),
        "weights rounded to bf16": ("fp32", _rounded_weights(_bf16_weights)),
    }


def build_variant(
    fp32: Path, out: Path, served_as: str, transform: Callable[[onnx.ModelProto], onnx.ModelProto]
) -> Path:
    """A copy of the fp32 bundle with every graph transformed, its manifest rewritten (hashes, variant)."""
    shutil.copytree(fp32, out)
    doc = json.loads((out / MANIFEST_FILE).read_text())
    for graph in doc["graphs"].values():
        path = out / graph["file"]
        onnx.save(transform(onnx.load(str(path))), str(path))
    (out / MANIFEST_FILE).unlink()
    for key in ("files", "version", "created", "format_version"):
        doc.pop(key, None)
    write_manifest(out, {**doc, "variant": served_as})
    return out


def measure(fp32: Path, n_inputs: int, data_dir: Path) -> dict[str, Any]:
    ref_bundle = load_bundle(fp32)
    tok = ref_bundle.load_tokenizer()
    make = ort_runtime(provider="cpu")
    translate = ref_bundle.task == "translate"
    if translate:
        inputs = [
            source_ids(tok, s, ref_bundle.config.max_len) for s, _ in data.load_pairs(data_dir, "test")[:n_inputs]
        ]
        budget = ref_bundle.config.max_len - 1
    else:
        inputs = [prompt_ids(tok, p) for p in data.lm_prompts(data.load_text(data_dir, "test"), n_inputs)]
        budget = LM_TOKENS

    def run(bundle_dir: Path) -> dict[str, Any]:
        rt = make(load_bundle(bundle_dir), SLOTS)
        outputs = greedy_decode(rt, inputs, budget, SLOTS)
        if translate:
            pairs = everyday_pairs()
            quality = {
                "everyday_chrf": scores(translate_texts(rt, tok, [s for s, _ in pairs]), [t for _, t in pairs])["chrf"]
            }
        else:
            text = lm_text()
            quality = {"hamlet_bits_per_char": round(nll_bits(rt, lm_chunks(tok, text, rt.max_len)) / len(text), 4)}
        return {"outputs": outputs, **quality}

    ref = run(fp32)
    rows = {"fp32": {k: v for k, v in ref.items() if k != "outputs"}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (served_as, transform)) in enumerate(variants(ref_bundle.config.vocab_size).items()):
            got = run(build_variant(fp32, Path(tmp) / str(i), served_as, transform))
            lengths = [n for n in PREFIX_TOKENS if n < budget]
            same = identical_by_prefix(ref["outputs"], got["outputs"], [*lengths, budget])
            rows[name] = {"identical_by_tokens": same, **{k: v for k, v in got.items() if k != "outputs"}}
            print(f"  {name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
    return {
        "bundle": str(fp32),
        "task": ref_bundle.task,
        "inputs": len(inputs),
        "max_new_tokens": budget,
        "variants": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.int8_fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path, help="an fp32 bundle")
    p.add_argument("--inputs", type=int, default=200, help="test-split prompts (LM) or sentences (translation)")
    p.add_argument("--data-dir", type=Path, default=Path("artifacts/data"), help="data directory of `kvserve data`")
    a = p.parse_args(argv)
    print(json.dumps(measure(a.bundle, a.inputs, a.data_dir), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
