"""The Serve config file and `kvserve serve`'s preparation of it (no Ray started), and serving's imports: what the
API is launched from, checked without an engine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serving.engine.config import BatchingKnobs
from serving.server.config import AppArgs, load_serve_config

ROOT = Path(__file__).resolve().parents[1]


# -- config --------------------------------------------------------------------------------------------------
def _serve_config() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())


def test_serve_config_file_is_valid(tmp_path):
    raw = load_serve_config(ROOT / "deploy" / "serve_config.yaml", artifacts_dir=tmp_path)
    app = raw["applications"][0]
    args = AppArgs.model_validate(app["args"])
    assert app["import_path"] == "serving.server.app:build_app" and args.artifacts_dir == tmp_path.resolve()
    names = {d["name"] for d in app["deployments"]}
    assert names == {"ingress", *(m.name for m in args.models if not m.colocated)}
    assert all(m.colocated for m in args.models)  # the shipped placement: every engine in the ingress replicas
    ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
    assert ingress["backpressure_config"]["status_code"] == 429
    for m in args.models:
        BatchingKnobs.model_validate(ingress["user_config"]["models"][m.name])


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c["applications"][0]["deployments"][0].update(max_ongoing_requests=4), "max_ongoing_requests"),
    (lambda c: c["applications"][0]["deployments"][0]["user_config"]["models"]["generate"].update(max_batch_sise=4),
     "max_batch_sise"),
    (lambda c: c["applications"][0]["args"]["limits"].update(max_beam_size=9), "max_beam_size"),
    (lambda c: c["applications"][0]["args"]["models"][0].update(name="Bad Name"), "Bad Name"),
    (lambda c: c["applications"][0]["deployments"].append({"name": "ghost"}), "ghost"),
    (lambda c: c["applications"][0]["args"]["models"][1].update(name="translate"), "unique"),
])
def test_serve_config_rejects(tmp_path, mutate, match):
    cfg = _serve_config()
    mutate(cfg)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=match):
        load_serve_config(path)


# -- kvserve serve (no Ray started) ----------------------------------------------------------------------------
def test_serve_cli_refuses_missing_bundles(tmp_path):
    from kvserve.cli import build_parser
    from serving.server.launch import prepare_config

    args = build_parser().parse_args(["serve", "--artifacts", str(tmp_path), "--port", "9000"])
    assert args.func.__name__ == "_cmd_serve" and args.port == 9000
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "bundles" / "translate")):
        prepare_config(ROOT / "deploy" / "serve_config.yaml", artifacts=tmp_path)


def test_serving_never_imports_torch():
    code = ("import sys, serving.server.app, serving.server.api, serving.server.launch, serving.server.metrics; "
            "assert 'torch' not in sys.modules, 'serving imported torch'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
