"""An imported Marian bundle named in a Ray Serve config is served by a real local Ray Serve cluster (slow).

The Serve config is deploy/serve_config.yaml with its models replaced by one imported bundle (what a user
writes), deployed with serving/server/launch.py exactly as `kvserve serve` does, on the test run's Ray cluster
(tests/conftest.py `ray_cluster`). 30 source lines through `/v1/translate`, greedy and beam 4, must give
`MarianMTModel.generate`'s texts (settings pinned as in tests/test_marian_parity.py).
"""
from __future__ import annotations

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


def serve_config(art: Path, port: int) -> dict:
    import yaml

    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["http_options"].update(port=port, host="127.0.0.1")
    app = cfg["applications"][0]
    app["args"]["artifacts_dir"] = str(art)
    app["args"]["models"] = [{"name": "opus-en-de", "bundle": "bundles/opus-en-de",
                              "engine": {"max_slots": 8, "intra_op_threads": 1}}]
    small = {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 5}
    app["deployments"] = [{"name": "ingress", "max_ongoing_requests": 64, **small},
                          {"name": "opus-en-de", "max_ongoing_requests": 32, **small,
                           "user_config": {"batching": "continuous"}}]
    return cfg


def test_ray_serve_serves_an_imported_bundle_as_marian_translates(ray_cluster, tmp_path_factory):
    import httpx
    import torch
    import yaml

    from serving.server.launch import prepare_config, start

    torch.set_num_threads(1)
    art = tmp_path_factory.mktemp("marian-serve")
    folder = build_marian_checkpoint(art / "hf")
    out = subprocess.run([sys.executable, "-m", "kvserve", "import", "marian", str(folder), "--out",
                          str(art / "bundles" / "opus-en-de"), "--max-len", "64", "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    path = art / "serve_config.yaml"
    path.write_text(yaml.safe_dump(serve_config(art, ray_cluster["port"])))
    raw = prepare_config(path)
    start(raw, timeout_s=300)
    model, tok = load_reference(folder)
    sources = corpus()[300:330]
    with httpx.Client(base_url=f"http://127.0.0.1:{raw['http_options']['port']}", timeout=120) as client:
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["opus-en-de", f"opus-en-de@{models[0]['version']}"]
        for beams in (1, 4):
            batch = tok(sources, return_tensors="pt", padding=True)
            with torch.no_grad():
                gen = model.generate(**batch, do_sample=False, num_beams=beams, max_new_tokens=MAX_NEW,
                                     forced_eos_token_id=None, bad_words_ids=[[tok.pad_token_id]],
                                     length_penalty=1.0, early_stopping=True)
            want = tok.batch_decode(gen, skip_special_tokens=True)
            r = client.post("/v1/translate", json={"model": "opus-en-de", "text": sources, "beam_size": beams,
                                                   "max_tokens": MAX_NEW})
            assert r.status_code == 200, r.text
            assert [t["text"] for t in r.json()["translations"]] == want
