"""The published models (published/<task>, model/published.py) in every checkout: their manifests, their export,
the quality gates of reduced-precision variants (export/quality_gate.py) and a served translation's quality.

The exports here are the real ones (the published weights through `kvserve export`'s pipeline, with its parity
checks); one fp32 bundle per model per test session.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from export.bundle import Variant, content_sha256, sha256_file, write_manifest
from model.published import BEAM_SET, BEAM_SIZE, PUBLISHED_DIR, TASKS, compare, everyday_pairs, lm_text, read_manifest

SIZE_LIMIT_BYTES = 40_000_000  # what the published files may weigh in all (issue: a small repository)


@pytest.fixture(scope="module")
def fp32_bundles(tmp_path_factory) -> dict[str, Path]:
    """Each published model exported as `kvserve up` does (fp32, parity against PyTorch checked)."""
    import torch

    from kvserve.export import build_bundle

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("published-bundles")
    for task in TASKS:
        build_bundle(PUBLISHED_DIR / task, base / task, check_sentences=0)
    return {task: base / task for task in TASKS}


@pytest.mark.parametrize("task", TASKS)
def test_the_manifest_says_where_the_model_came_from(task):
    m, d = read_manifest(PUBLISHED_DIR / task), PUBLISHED_DIR / task
    assert m["weights"]["sha256"] == sha256_file(d / "model.safetensors") and m["weights"]["dtype"] == "float16"
    assert m["tokenizer"]["sha256"] == sha256_file(d / "tokenizer.json")
    recipe = m["recipe"]
    assert recipe["task"] == task and recipe["precision"] == "bf16-autocast" and isinstance(recipe["seed"], int)
    assert m["training"]["steps"] == recipe["steps"] > 0  # the whole recipe ran
    assert all(len(h) == 64 for h in m["data"]["sha256"].values()) and {"train", "valid", "test"} <= {
        Path(f).stem for f in m["data"]["sha256"]}
    start = m["training"]["starts"][0]
    assert start["commit"] and start["machine"]["cpu"] and start["versions"]["torch"]
    assert m["measured"]["versions"]["torch"] and "make train" in m["reproduce"]
    key = "chrf" if task == "translate" else "bits_per_char"
    assert m["metrics"]["test"][key] > 0 and len(m["version"]) == 12
    if task == "translate":  # distilled: the teacher's run and the data it made are named, and they agree
        init, distilled = m["training"]["init"], m["data"]["distillation"]
        assert init["step"] == init["train_config"]["steps"] > 0 and init["starts"][0]["commit"]
        assert distilled["teacher_weights_sha256"] == init["weights_sha256"] and distilled["beam_size"] > 1


def test_the_published_files_are_small():
    size = sum(p.stat().st_size for p in PUBLISHED_DIR.rglob("*") if p.is_file())
    assert size < SIZE_LIMIT_BYTES, f"published/ holds {size / 1e6:.1f} MB"


@pytest.mark.parametrize("task", TASKS)
def test_the_export_of_a_published_model_has_the_manifests_version(fp32_bundles, task):
    """build_bundle checked fp32 parity against PyTorch on the published weights (it raises otherwise); the same
    weights exported with the manifest's library versions give the bundle version the manifest names, which is
    the version /v1/models reports."""
    bundle = json.loads((fp32_bundles[task] / "manifest.json").read_text())
    published = read_manifest(PUBLISHED_DIR / task)
    assert bundle["source"]["weights_sha256"] == published["weights"]["sha256"]
    syn = bundle["parity"]["synthetic_cpu"]
    assert syn["rows_greedy_identical"] == syn["rows"] and syn["logits_max_abs"] < 1e-4
    exporters = ("torch", "onnx", "onnxscript")  # what the graphs' bytes depend on
    if all(bundle["export"][k] == published["bundle"]["export"].get(k) for k in exporters):
        assert bundle["version"] == published["version"]
        assert content_sha256(bundle) == published["bundle"]["sha256"]  # what the shipped Serve configs pin


# -- the quality gates -------------------------------------------------------------------------------------------
def _add_noise(onnx_path: Path, scale: float, seed: int = 0) -> None:
    """Perturb every float weight matrix of a graph by Gaussian noise of `scale` times its spread: a deliberately
    degraded variant."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    rng = np.random.default_rng(seed)
    for init in model.graph.initializer:
        w = numpy_helper.to_array(init)
        if w.dtype == np.float32 and w.ndim == 2:
            noisy = (w + rng.normal(0, scale * float(w.std()), w.shape)).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(noisy, init.name))
    onnx.save(model, str(onnx_path))


def _degraded_copy(bundle: Path, dst: Path, scale: float) -> Path:
    shutil.copytree(bundle, dst)
    for graph in dst.glob("*.onnx"):
        _add_noise(graph, scale)
    doc = json.loads((dst / "manifest.json").read_text())
    write_manifest(dst, {k: v for k, v in doc.items() if k not in ("files", "version", "created", "format_version")})
    return dst


def _gate(task: str, bundle: Path) -> dict:
    from export import quality_gate
    from export.bundle import load_bundle
    from export.parity import TorchRuntime
    from kvserve.runtime import ort_runtime
    from model.checkpoint import load_checkpoint

    ckpt = load_checkpoint(PUBLISHED_DIR / task)
    ref = TorchRuntime(ckpt.model, 32, ckpt.tokenizer.special_ids)
    return quality_gate.measure(task, ref, ort_runtime(provider="cpu")(load_bundle(bundle), 32), ckpt.tokenizer)


def test_the_translation_gate_passes_the_fp32_bundle_and_refuses_a_degraded_one(fp32_bundles, tmp_path):
    from export.quality_gate import QualityGateError, check

    same = _gate("translate", fp32_bundles["translate"])
    assert same["passed"] and abs(same["delta"]) < 0.5 and same["reference"] > 20
    bad = _gate("translate", _degraded_copy(fp32_bundles["translate"], tmp_path / "noisy", scale=0.3))
    assert not bad["passed"] and bad["delta"] < -1.0
    with pytest.raises(QualityGateError, match=r"fails the quality gate: chrf on everyday.en-de.tsv .* at most 1.0"):
        check(bad, "the noisy variant")


def test_export_refuses_a_variant_that_fails_its_gate_and_writes_nothing(tmp_path, monkeypatch):
    """The LM's int8 export with its quantizer made lossy: `kvserve export` raises and leaves no bundle."""
    import torch

    import export.variants
    from kvserve.export import ExportError, build_bundle

    torch.set_num_threads(1)
    quantize = export.variants.quantize_int8

    def lossy(path: Path) -> None:
        quantize(path)
        _add_noise(path, scale=0.5)
    monkeypatch.setattr(export.variants, "quantize_int8", lossy)
    with pytest.raises(ExportError, match=r"int8 variant fails the quality gate: bits_per_char on hamlet.txt"):
        build_bundle(PUBLISHED_DIR / "generate", tmp_path / "int8", Variant.INT8, check_sentences=0)
    assert not (tmp_path / "int8").exists() and not list(tmp_path.glob(".int8.partial*"))


def test_the_int8_variant_of_the_published_lm_passes_its_gate(tmp_path):
    import torch

    from kvserve.export import build_bundle

    torch.set_num_threads(1)
    gate = build_bundle(PUBLISHED_DIR / "generate", tmp_path / "int8", Variant.INT8,
                        check_sentences=0)["parity"]["quality_gate"]
    assert gate["passed"] and gate["metric"] == "bits_per_char" and gate["delta"] <= 0.02


# -- served quality ------------------------------------------------------------------------------------------------
EVERYDAY_FLOOR_CHRF = 40.0  # beam 4 on the first 24 everyday sentences; the published translator: see its manifest


def test_a_served_translation_of_everyday_sentences_passes_a_chrf_floor(fp32_bundles):
    """Through the real API and engine (in-process, no Ray): the published translator's answers, and /v1/models
    naming the bundle's version."""
    from inprocess_app import InProcessServer
    from model.scores import chrf
    from serving.server.config import Limits

    pairs = everyday_pairs()[:24]
    server = InProcessServer(Limits(), bundles=fp32_bundles)
    try:
        hyps = []
        for i in range(0, len(pairs), 2):  # four beams fill the in-process engine's slots: the second text waits
            r = server.request("POST", "/v1/translate", json={"text": [s for s, _ in pairs[i:i + 2]], "beam_size": 4})
            assert r.status_code == 200, r.text
            hyps += [t["text"] for t in r.json()["translations"]]
        models = {m["id"]: m for m in server.request("GET", "/v1/models").json()["data"]}
    finally:
        server.close()
    assert chrf(hyps, [t for _, t in pairs]) >= EVERYDAY_FLOOR_CHRF, list(zip(hyps, pairs))
    version = json.loads((fp32_bundles["translate"] / "manifest.json").read_text())["version"]
    assert models["translate"]["version"] == version


# -- comparing a rerun with the published figures ------------------------------------------------------------------
def test_compare_counts_a_rerun_within_the_tolerance_or_better_as_reproduced():
    published = {"metrics": {"test": {"chrf": 33.0, "bleu": 10.0, "sentences": 817},
                             "lm": {"bits_per_char": 2.10}}}
    rerun = {"metrics": {"test": {"chrf": 32.2, "bleu": 12.0, "sentences": 817}, "lm": {"bits_per_char": 2.13}}}
    rows = {(r["set"], r["metric"]): r for r in compare(published, rerun)}
    assert set(rows) == {("test", "chrf"), ("test", "bleu"), ("lm", "bits_per_char")}  # counts are not metrics
    assert rows["test", "chrf"]["within"] and rows["test", "bleu"]["within"]  # 0.8 worse; better
    assert not rows["lm", "bits_per_char"]["within"] and rows["lm", "bits_per_char"]["delta"] == 0.03


def test_the_eval_sets_are_what_the_gates_read():
    pairs = everyday_pairs()
    assert len(pairs) == 120 and len({s for s, _ in pairs}) == 120
    assert ("I would like a cup of coffee.", "Ich hätte gern eine Tasse Kaffee.") in pairs
    assert lm_text().startswith("ACT I.") and len(lm_text()) == 7902


# -- slow: the test split (a ~1 GB data download) and a whole retraining ------------------------------------------
@pytest.fixture(scope="module")
def prepared_data() -> Path:
    """The prepared data: artifacts/data when `kvserve data` made it, else prepared now (downloads)."""
    from model import data

    d = Path(__file__).resolve().parents[1] / "artifacts" / "data"
    for task in TASKS:
        if not data.is_prepared(d, task):
            (data.prepare_translation if task == "translate" else data.prepare_generation)(d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_kvserve_evaluate_on_a_published_model_gives_the_manifests_test_figures(prepared_data, task, capsys):
    from kvserve import cli

    want = read_manifest(PUBLISHED_DIR / task)["metrics"]["test"]
    assert cli.main(["evaluate", str(PUBLISHED_DIR / task), "--split", "test", "--data-dir", str(prepared_data)]) == 0
    got = json.loads(capsys.readouterr().out)
    keys = ("chrf", "bleu", "sentences") if task == "translate" else ("bits_per_char", "chars")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}


@pytest.mark.slow
def test_the_translators_beam_figures_are_the_manifests_in_pytorch_and_through_the_engine(prepared_data,
                                                                                       fp32_bundles, capsys):
    """`kvserve evaluate --beam-size 4` on the published translator (PyTorch) and on its fp32 bundle (the serving
    engine, as a request with beam_size 4 is answered) both give the manifest's beam figures."""
    from kvserve import cli

    want = read_manifest(PUBLISHED_DIR / "translate")["metrics"][BEAM_SET]
    for path in (PUBLISHED_DIR / "translate", fp32_bundles["translate"]):
        argv = ["evaluate", str(path), "--split", "test", "--data-dir", str(prepared_data), "--beam-size",
                str(BEAM_SIZE)]
        assert cli.main(argv) == 0
        got = json.loads(capsys.readouterr().out)
        assert {k: got[k] for k in want} == want, path


@pytest.mark.slow
@pytest.mark.retrain
def test_make_train_reproduces_the_published_metrics(tmp_path):
    """`make train` from nothing (hours on 2 cores): data, both recipes, publication, comparison. Exit 0 means
    every metric is within model/published.py TOLERANCE of the published one."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "kvserve", "up", "--train", "--no-serve", "--artifacts",
                        str(tmp_path / "artifacts")], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "reproduce the published metrics" in r.stderr


def test_readme_shows_the_published_models_figures():
    """README's model table quotes the manifests (a retrained model changes both, or this fails)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    t, g = (read_manifest(PUBLISHED_DIR / task)["metrics"] for task in TASKS)
    test, beam, everyday = t["test"], t[BEAM_SET], t["everyday"]
    assert (f"chrF {test['chrf']:.2f}, BLEU {test['bleu']:.2f} (beam {BEAM_SIZE}: chrF {beam['chrf']:.2f}); "
            f"everyday chrF {everyday['chrf']:.2f}") in readme
    lm_test, hamlet = g["test"]["bits_per_char"], g["hamlet_excerpt"]["bits_per_char"]
    assert f"{lm_test:.4f} bits/char; Hamlet excerpt {hamlet:.4f}" in readme
