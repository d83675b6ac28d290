"""Model versions (fast): bundle versions, `model@version`, X-Model-Version, /v1/models, canary routing by weight,
canary config, and the engine-load autoscaling policy. The Ray cluster side (rollout under load, a 90/10 canary
over 1,000 requests, an autoscaling ramp) is in tests/test_lifecycle.py (slow)."""
from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from export.bundle import BundleError, content_version, load_bundle
from serving.server.autoscale import EngineLoadPolicy
from serving.server.config import AppArgs, check_deployments
from serving.server.versions import Router, ServedVersion, split_model_name
from test_api import VERSIONS, make_client, sse, tok  # noqa: F401 (tok: a fixture)
from tests.helpers_tiny import copy_bundle, tiny_bundle


# -- bundle versions ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("bundle"), "generate")


def test_a_bundle_has_a_content_version_and_a_creation_time(pristine, tmp_path):
    b = load_bundle(copy_bundle(pristine, tmp_path / "b"))
    assert len(b.version) == 12 and int(b.version, 16) >= 0
    assert b.version == content_version(b.manifest) == json.loads((b.dir / "manifest.json").read_text())["version"]
    assert b.created > 1.7e9


def test_the_version_follows_the_content_not_the_place(pristine, tmp_path):
    a = load_bundle(copy_bundle(pristine, tmp_path / "a"))
    moved = load_bundle(copy_bundle(pristine, tmp_path / "elsewhere"))
    assert moved.version == a.version
    other = json.loads((pristine / "manifest.json").read_text())
    other["files"]["decoder.onnx"] = "0" * 64  # other weights
    assert content_version(other) != a.version


def test_a_manifest_without_version_gets_one_and_an_edited_version_is_refused(pristine, tmp_path):
    legacy = copy_bundle(pristine, tmp_path / "legacy")
    m = json.loads((legacy / "manifest.json").read_text())
    want = m.pop("version")
    m.pop("created")
    (legacy / "manifest.json").write_text(json.dumps(m))
    assert load_bundle(legacy).version == want and load_bundle(legacy).created > 0  # mtime of manifest.json
    m["version"] = "feedfacecafe"
    (legacy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="says version 'feedfacecafe', but its content hashes to"):
        load_bundle(legacy)


# -- names and routing -------------------------------------------------------------------------------------------
def test_model_names_split_at_the_at_sign():
    assert split_model_name("generate") == ("generate", None)
    assert split_model_name("generate@3f2a9c0d1e2b") == ("generate", "3f2a9c0d1e2b")
    assert split_model_name("generate@") == ("generate", "")


def test_weighted_routing_is_exact_over_every_window_of_its_period():
    router = Router({"generate": [("generate", 90.0), ("generate-canary", 10.0)], "translate": [("translate", 100.0)]})
    picks = [router.pick("generate") for _ in range(1000)]
    assert Counter(picks) == {"generate": 900, "generate-canary": 100}
    assert all(Counter(picks[i:i + 10])["generate-canary"] == 1 for i in range(0, 1000, 10))
    assert {router.pick("translate") for _ in range(5)} == {"translate"}
    served = [ServedVersion("generate", "generate", "aaa", 0, 90.0), ServedVersion("generate", "generate-canary",
                                                                                     "bbb", 0, 10.0)]
    assert Router.serving("generate", "bbb", served) == "generate-canary"
    assert Router.serving("generate", "ccc", served) is None
    with pytest.raises(ValueError, match="add up to 100"):
        Router({"generate": [("generate", 90.0), ("generate-canary", 20.0)]})


# -- the API -----------------------------------------------------------------------------------------------------
async def test_every_answer_names_the_version_that_answered(tok):
    client, _ = make_client(tok)
    g, t = VERSIONS["generate"], VERSIONS["translate"]
    r = await client.post("/v1/generate", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-model-version"] == g
    r = await client.post("/v1/generate", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert r.headers["x-model-version"] == g and json.loads(sse(r.text)[-1])["finish_reason"] == "length"
    r = await client.post("/v1/translate", json={"text": ["a", "b"]})
    assert r.status_code == 200 and r.headers["x-model-version"] == t
    for stream in (False, True):
        r = await client.post("/v1/completions", json={"model": "generate", "prompt": "hi", "max_tokens": 2,
                                                       "stream": stream})
        assert r.status_code == 200 and r.headers["x-model-version"] == g


async def test_a_request_may_pin_a_version_and_an_unserved_one_is_a_404(tok):
    client, _ = make_client(tok)
    g = VERSIONS["generate"]
    r = await client.post("/v1/completions", json={"model": f"generate@{g}", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-model-version"] == g and r.json()["model"] == "generate"
    r = await client.post("/v1/generate", json={"model": "generate@000000000000", "prompt": "hi", "stream": True})
    assert r.status_code == 404 and r.json()["error"]["field"] == "model"
    assert f"serves version {g}" in r.json()["error"]["message"]
    r = await client.post("/v1/generate", json={"model": "generate@", "prompt": "hi"})
    assert r.status_code == 422 and "names no version" in r.json()["error"]["message"]
    r = await client.post("/v1/translate", json={"model": f"generate@{g}", "text": "hi"})
    assert r.status_code == 422 and "generate model" in r.json()["error"]["message"]


async def test_models_list_each_version_with_its_creation_time(tok):
    client, _ = make_client(tok)
    data = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    g = VERSIONS["generate"]
    assert data["generate"]["version"] == g and data["generate"]["versions"] == [
        {"version": g, "created": 0, "weight": 100.0}]
    assert data[f"generate@{g}"]["parent"] == "generate" and data[f"generate@{g}"]["task"] == "generate"


# -- canary config -----------------------------------------------------------------------------------------------
def _args(**canary) -> AppArgs:
    return AppArgs.model_validate({"models": [{"name": "generate", "bundle": "bundles/generate",
                                               **({"canary": canary} if canary else {})}]})


def test_a_canary_is_a_second_deployment_with_its_share():
    args = _args(bundle="bundles/generate-next", weight=10)
    assert [(d, str(b), w) for d, b, w in args.models[0].deployments()] == [
        ("generate", "bundles/generate", 90.0), ("generate-canary", "bundles/generate-next", 10.0)]
    check_deployments({"deployments": [{"name": "generate-canary", "max_ongoing_requests": 64}]}, args)
    with pytest.raises(ValueError, match=r"deployment 'generate-canary': max_ongoing_requests=2 < max_batch_size"):
        check_deployments({"deployments": [{"name": "generate-canary", "max_ongoing_requests": 2}]}, args)
    with pytest.raises(ValueError, match=r"\[.generate-canary.\] match no model"):
        check_deployments({"deployments": [{"name": "generate-canary"}]}, _args())


@pytest.mark.parametrize("bad,match", [
    ({"canary": {"bundle": "b", "weight": 100}}, "less than 100"),
    ({"canary": {"bundle": "b", "weight": 0}}, "greater than 0"),
    ({"canary": {"bundle": "b"}}, "weight"),
    ({"name": "generate-canary"}, "not end in '-canary'"),
])
def test_bad_canary_configs_are_refused_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        AppArgs.model_validate({"models": [{"name": "generate", "bundle": "bundles/generate", **bad}]})


# -- autoscaling policy ------------------------------------------------------------------------------------------
def _ctx(replicas: int, running: list[float], waiting: list[float], slots: list[float] | None = None,
         ongoing: float = 0.0) -> SimpleNamespace:
    ids = [f"r{i}" for i in range(len(running))]
    metrics = {"running": dict(zip(ids, running)), "waiting": dict(zip(ids, waiting))}
    if slots is not None:
        metrics["slots_total"] = dict(zip(ids, slots))
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 2.0)
    return SimpleNamespace(current_num_replicas=replicas, aggregated_metrics=metrics, total_num_requests=ongoing,
                           policy_state={}, config=config)


def test_the_policy_asks_for_enough_replicas_to_fill_a_share_of_their_kv_slots():
    policy = EngineLoadPolicy(target_utilization=0.75)
    desired, state = policy(_ctx(1, [16.0], [16.0], [16.0], ongoing=32.0))
    assert desired == pytest.approx(32 / 12) and state["load"] == 32.0
    desired, _ = policy(_ctx(3, [1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [16.0] * 3, ongoing=2.0))
    assert desired == pytest.approx(2 / 12)  # Serve's bounds keep min_replicas
    desired, _ = policy(_ctx(1, [4.0], [0.0], [16.0], ongoing=40.0))  # queued in the handles: Serve's count wins
    assert desired == pytest.approx(40 / 12)
    desired, _ = policy(_ctx(1, [], [], None, ongoing=6.0))  # no engine report yet: Serve's own rule
    assert desired == pytest.approx(3.0)
    with pytest.raises(ValueError, match="target_utilization=0"):
        EngineLoadPolicy(target_utilization=0)


def test_a_pinned_hash_refuses_a_swapped_bundle_and_accepts_its_own(pristine, tmp_path, capsys):
    from export.bundle import content_sha256
    from kvserve.cli import main
    from serving.server.config import ModelSpec

    bundle = copy_bundle(pristine, tmp_path / "b")
    pin = content_sha256(load_bundle(bundle).manifest)
    assert main(["bundle-hash", str(bundle)]) == 0 and capsys.readouterr().out.split() == [pin, str(bundle)]
    assert load_bundle(bundle, sha256=pin).version == pin[:12]
    other = tiny_bundle(tmp_path / "other", "translate")  # self-consistent, manifest and all: not the pinned one
    with pytest.raises(BundleError, match="not the one the Serve config pins"):
        load_bundle(other, sha256=pin)
    spec = ModelSpec.model_validate({"name": "generate", "bundle": "b", "bundle_sha256": pin,
                                     "canary": {"bundle": "c", "weight": 10, "bundle_sha256": "0" * 64}})
    assert spec.bundle_pin("generate") == pin and spec.bundle_pin("generate-canary") == "0" * 64
    with pytest.raises(ValueError):
        ModelSpec.model_validate({"name": "generate", "bundle": "b", "bundle_sha256": pin[:12]})
