"""A model repository and the pool of models one replica holds (serving/server/repository.py, model_pool.py), on
copies of the tiny exported bundles with real engines, in-process.

The acceptance: every bundle of the repository is servable by name and listed with its task, version and size; a
new bundle appears without a restart; a model loads on its first request and the least recently used idle one is
evicted beyond max_models; pinned models and models with requests in flight are never evicted (a cold request then
gets a 503 with Retry-After); an unknown model is a 404 naming the repository; a bundle that fails its integrity
check is refused with an error naming the file while the others keep serving; every answer equals that model's
served alone.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from engine_bundle import cached_bundle
from export.bundle import write_manifest
from serving.engine.config import ReplicaKnobs
from serving.engine.types import SamplingParams
from serving.server.config import Limits
from serving.server.errors import ServiceError
from serving.server.metrics import Recorder
from serving.server.model_pool import ModelPool
from serving.server.repository import Repository
from serving.server.service import TextRequest

LIMITS = Limits(max_prompt_tokens=40, max_tokens=16)
KNOBS = ReplicaKnobs(max_slots=2, provider="cpu", intra_op_threads=1)


def variant(src: Path, dst: Path, banned: list[int]) -> Path:
    """A copy of a bundle with other generation settings: another version of the same weights."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["generation"] = {"banned_ids": banned}
    write_manifest(dst, {k: v for k, v in manifest.items() if k not in ("files", "version", "created")})
    return dst


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    mt, lm = cached_bundle("translate")[0], cached_bundle("generate")[0]
    shutil.copytree(mt, root / "en-de")
    shutil.copytree(lm, root / "lm")
    variant(mt, root / "en-fr", [7])
    variant(lm, root / "lm-b", [9])
    return root


def ask(text: str = "the quick brown fox") -> TextRequest:
    import time

    return TextRequest(text, SamplingParams(max_new_tokens=6), time.time() + 60)


def test_the_repository_lists_every_bundle_and_sees_new_ones(repo_dir: Path, tmp_path: Path):
    repo = Repository([repo_dir], rescan_s=3600)
    listed = {e.name: e for e in repo.entries()}
    assert sorted(listed) == ["en-de", "en-fr", "lm", "lm-b"]
    assert listed["en-de"].task == "translate" and listed["lm"].task == "generate"
    assert listed["en-de"].version != listed["en-fr"].version and listed["en-de"].bytes > 10_000
    shutil.copytree(cached_bundle("translate")[0], repo_dir / "late")
    assert repo.get("late").task == "translate"  # found without a restart
    with pytest.raises(ServiceError) as e:
        repo.get("nope")
    assert e.value.kind.value == "not_found" and str(repo_dir) in e.value.message


async def test_models_load_on_demand_and_the_least_recently_used_idle_one_goes(repo_dir: Path):
    recorder = Recorder("prometheus")
    pool = ModelPool(Repository([repo_dir]), LIMITS, recorder, max_models=2, engine=KNOBS)
    alone = {}
    for name in ("en-de", "lm", "en-fr"):
        alone[name] = (await pool.complete(name, ask())).text
    assert [h["id"] for h in pool.held()] == ["lm", "en-fr"]  # en-de was the least recently used
    again = await pool.complete("en-de", ask())  # loads again, evicting lm
    assert again.text == alone["en-de"] and [h["id"] for h in pool.held()] == ["en-fr", "en-de"]
    text = recorder.exposition()
    assert 'kvserve_model_evictions_total{model="en-de"' in text and 'kvserve_model_loads_total{model="en-de"' in text
    await pool.close()


async def test_pinned_and_busy_models_are_never_evicted(repo_dir: Path):
    pool = ModelPool(Repository([repo_dir]), LIMITS, None, max_models=2, pinned=("lm",), engine=KNOBS,
                     load_timeout_s=1.0)
    await pool.warm(["lm"])
    stream = pool.stream("en-de", ask())
    await stream.__anext__()  # en-de is loaded and has a request in flight (its stream is open)
    with pytest.raises(ServiceError) as e:  # it stays busy past load_timeout_s
        await pool.complete("en-fr", ask())
    assert e.value.kind.value == "unavailable" and e.value.retry_after_s and "busy or pinned" in e.value.message
    cold = asyncio.ensure_future(pool.complete("en-fr", ask()))  # waits for en-de to become idle
    await asyncio.sleep(0.2)
    assert not cold.done()
    await stream.aclose()
    assert (await cold).text  # en-de went, the pinned lm stayed
    assert {h["id"] for h in pool.held()} == {"lm", "en-fr"}
    with pytest.raises(ServiceError):  # pinning a second model would leave no room for any other
        await pool.pin("en-fr")
    assert pool.unpin("lm") and not pool.unpin("lm")
    await pool.pin("en-fr")  # now en-fr stays and lm is evictable
    await pool.complete("en-de", ask())
    assert {h["id"] for h in pool.held()} == {"en-fr", "en-de"}
    await pool.close()


async def test_a_bundle_that_fails_its_check_is_refused_naming_the_file_the_others_serve(repo_dir: Path):
    onnx = next((repo_dir / "en-fr").glob("decoder*.onnx"))
    onnx.write_bytes(onnx.read_bytes()[:-10] + b"0123456789")
    pool = ModelPool(Repository([repo_dir]), LIMITS, None, max_models=2, engine=KNOBS)
    with pytest.raises(Exception) as e:
        await pool.complete("en-fr", ask())
    assert onnx.name in str(e.value)
    assert (await pool.complete("en-de", ask())).text  # the others keep serving
    assert [h["id"] for h in pool.held()] == ["en-de"]
    await pool.close()


async def test_requests_for_a_loading_model_wait_for_one_load(repo_dir: Path):
    recorder = Recorder("prometheus")
    pool = ModelPool(Repository([repo_dir]), LIMITS, recorder, max_models=1, engine=KNOBS)
    answers = await asyncio.gather(*(pool.complete("en-de", ask()) for _ in range(4)))
    assert len({a.text for a in answers}) == 1
    assert 'kvserve_model_loads_total{model="en-de",version=' in recorder.exposition()
    assert recorder.exposition().count("kvserve_model_loads_total{") == 1
    await pool.close()
