"""Imported Marian checkpoints translate exactly as transformers' MarianMTModel.generate does (slow).

Two locally built random checkpoints (tests/marian_checkpoint.py): A (swish, SentencePiece vocabularies of
200 + 220 pieces) and B (exact gelu, 150 + 260 pieces: another vocabulary size). Each is imported with `kvserve import marian`, then 100 source lines are translated greedily and with
beam 4 by
- MarianMTModel.generate, its defaults pinned to kvserve's decoding: max_new_tokens, no forced eos at the length
  limit, the pad token banned (bad_words_ids, as OPUS-MT's configs say), length_penalty 1, early_stopping=True;
- the HTTP API (/v1/translate, one concurrent request per line: the real app over the real engine, in-process);
- `kvserve translate` (a subprocess, stdin -> stdout);
and the decoded texts must be identical. A lockstep decode of the same lines compares the logits of the bundle
(ONNX Runtime) with transformers' at every step: within 1e-4.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from marian_checkpoint import build_marian_checkpoint, corpus, load_reference  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 30
N_SOURCES = 100
CHECKPOINTS = {
    "A": dict(seed=0, activation="swish", scale_embedding=True, spm_vocab=(200, 220)),
    "B": dict(seed=1, activation="gelu", spm_vocab=(150, 260)),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def imported(request, tmp_path_factory) -> dict:
    import torch

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp(f"marian-{request.param}")
    folder = build_marian_checkpoint(base / "hf", **CHECKPOINTS[request.param])
    bundle = base / "bundle"
    out = subprocess.run([sys.executable, "-m", "kvserve", "import", "marian", str(folder), "--out", str(bundle),
                          "--max-len", "64", "--threads", "1"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    model, tok = load_reference(folder)
    sources = corpus()[200: 200 + N_SOURCES]
    return {"folder": folder, "bundle": bundle, "model": model, "tok": tok, "sources": sources}


def hf_translations(imp: dict, beams: int) -> list[str]:
    import torch

    model, tok = imp["model"], imp["tok"]
    out = []
    for i in range(0, len(imp["sources"]), 10):
        batch = tok(imp["sources"][i: i + 10], return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**batch, do_sample=False, num_beams=beams, max_new_tokens=MAX_NEW,
                                 forced_eos_token_id=None, bad_words_ids=[[tok.pad_token_id]], length_penalty=1.0,
                                 early_stopping=True, num_return_sequences=1, repetition_penalty=1.0,
                                 no_repeat_ngram_size=0, min_length=0)
        out += tok.batch_decode(gen, skip_special_tokens=True)
    return out


def http_translations(imp: dict, beams: int) -> list[str]:
    import httpx

    from export.bundle import load_bundle
    from serving.engine.config import BatchingKnobs, ReplicaKnobs
    from serving.engine.engine import Engine
    from serving.server.api import create_app
    from serving.server.config import Limits, ModelSpec, engine_config
    from serving.server.metrics import Recorder
    from serving.server.service import ModelService
    from local_backend import LocalBackend

    async def run() -> list[str]:
        limits = Limits(max_prompt_tokens=64, max_tokens=MAX_NEW, max_beam_size=4)
        spec = ModelSpec(name="opus", bundle=str(imp["bundle"]),
                         engine=ReplicaKnobs(max_slots=16, provider="cpu", intra_op_threads=1))
        engine = Engine.from_bundle(imp["bundle"], engine_config(spec, BatchingKnobs(max_waiting=128), limits))
        await engine.start()
        recorder = Recorder("prometheus")
        service = ModelService("opus", engine, load_bundle(imp["bundle"]).load_tokenizer(), 64, recorder)
        app = create_app(LocalBackend({"opus": service}, recorder), limits, recorder, None)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=120) as client:
                replies = await asyncio.gather(*(client.post("/v1/translate", json={
                    "text": s, "beam_size": beams, "max_tokens": MAX_NEW}) for s in imp["sources"]))
        finally:
            await engine.stop(drain_timeout_s=5)
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200][:2]
        return [r.json()["translations"][0]["text"] for r in replies]

    return asyncio.run(run())


def cli_translations(imp: dict, beams: int) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "kvserve", "translate", str(imp["bundle"]), "--beam-size", str(beams),
                          "--max-tokens", str(MAX_NEW), "--slots", "8", "--threads", "1", "--provider", "cpu"],
                         cwd=ROOT, input="\n".join(imp["sources"]) + "\n", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "100%" in out.stderr  # the progress bar
    return out.stdout.split("\n")[:-1]


@pytest.mark.parametrize("beams", [1, 4])
def test_http_and_translate_command_equal_marian_generate(imported, beams):
    want = hf_translations(imported, beams)
    assert len(set(want)) > 10, "the reference outputs should vary with the source"
    http = http_translations(imported, beams)
    cli = cli_translations(imported, beams)
    assert [i for i, (a, b) in enumerate(zip(want, http)) if a != b] == [] and len(http) == len(want)
    assert [i for i, (a, b) in enumerate(zip(want, cli)) if a != b] == [] and len(cli) == len(want)


def test_lockstep_logits_against_transformers(imported):
    from export.bundle import load_bundle
    from export.marian_parity import HFMarianRuntime
    from export.parity import lockstep
    from kvserve.runtime import ort_runtime

    bundle = load_bundle(imported["bundle"])
    tok = bundle.load_tokenizer()
    ref = HFMarianRuntime(imported["folder"], 10, bundle.special_ids, bundle.config.max_len)
    rt = ort_runtime(provider="cpu")(bundle, 10)
    worst, identical = 0.0, 0
    for i in range(0, N_SOURCES, 10):
        ids = [tok.encode(s) for s in imported["sources"][i: i + 10]]
        r = lockstep(ref, rt, ids, steps=MAX_NEW)
        worst, identical = max(worst, r["logits_max_abs"]), identical + r["rows_greedy_identical"]
    assert worst <= 1e-4
    assert identical == N_SOURCES
