"""The models published with the project (published/<task>/) and the fixed evaluation sets beside them.

    published/<task>/model.safetensors  the weights, float16 (the release is these weights: its metrics are
                                        measured on them, upcast to float32 as every runtime loads them)
    published/<task>/checkpoint.json    model config and the run's train config (a kvserve checkpoint)
    published/<task>/tokenizer.json
    published/<task>/manifest.json      provenance: recipe, data sources and the sha256 of the prepared data,
                                        steps, commit, machine, library versions, metrics, bundle version,
                                        the command that reproduces it (kvserve/publish.py writes it)
    published/eval/everyday.en-de.tsv   120 everyday sentences written for kvserve, outside every training source
    published/eval/hamlet.txt           7,902 characters of Hamlet (the LM's test split)

A published folder is a kvserve checkpoint, so `kvserve evaluate`, `kvserve export` and `kvserve serve` take it
as it is. The eval sets are small enough for `make test`: the export's quality gate (export/quality_gate.py)
and the served-translation floor use them.

TORCH-FREE: owns the paths, reading the eval sets and the manifest, and comparing two runs' metrics.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PUBLISHED_DIR = REPO_ROOT / "published"
EVAL_DIR = PUBLISHED_DIR / "eval"
EVERYDAY_TSV = EVAL_DIR / "everyday.en-de.tsv"
LM_TEXT = EVAL_DIR / "hamlet.txt"
MANIFEST = "manifest.json"
TASKS = ("translate", "generate")

# How far a retrained model's metrics may fall from the published ones and still count as reproduced: the recipe
# pins the seed, the steps and the precision (bf16 autocast), so a rerun on the same machine kind gives the same
# weights; another CPU's bf16 kernels round differently, and greedy chrF of a few hundred sentences moves by
# about half a point between such runs.
TOLERANCE = {"chrf": 1.0, "bleu": 1.5, "bits_per_char": 0.02}

# The translator's test split is also measured with beam search of this width (metrics["test_beam4"]): what a
# request with beam_size 4 gets, the width Marian's OPUS-MT models are decoded with. Greedy stays the headline.
BEAM_SIZE = 4
BEAM_SET = f"test_beam{BEAM_SIZE}"


def published_model(task: str, root: Path = PUBLISHED_DIR) -> Path:
    """The folder of the published model of `task`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
    return root / task


def read_manifest(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a published model: {MANIFEST} is missing")
    return json.loads(path.read_text())


def everyday_pairs(path: Path = EVERYDAY_TSV) -> list[tuple[str, str]]:
    """(English, German) pairs of the everyday set."""
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            src, sep, tgt = line.partition("\t")
            if not sep or not src or not tgt:
                raise ValueError(f"{path}:{n}: expected `English<TAB>German`, got {line[:60]!r}")
            pairs.append((src, tgt))
    return pairs


def lm_text(path: Path = LM_TEXT) -> str:
    return path.read_text(encoding="utf-8")


def compare(published: dict[str, Any], rerun: dict[str, Any],
            tolerance: dict[str, float] = TOLERANCE) -> list[dict[str, Any]]:
    """Each metric both manifests report (per set: test, everyday, ...), the difference and whether it is within
    `tolerance`; a better rerun always counts as reproduced."""
    rows = []
    for subset, figures in published["metrics"].items():
        for name, want in figures.items():
            got = rerun["metrics"].get(subset, {}).get(name)
            if name not in tolerance or got is None:
                continue
            worse = (got - want) if name == "bits_per_char" else (want - got)
            rows.append({"set": subset, "metric": name, "published": want, "rerun": got,
                         "delta": round(got - want, 4), "tolerance": tolerance[name],
                         "within": worse <= tolerance[name]})
    return rows
