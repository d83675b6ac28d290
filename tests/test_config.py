"""One engine configuration: serving/engine/config.py declares every knob once; the Serve config uses it as is.

The acceptance: every engine knob settable from deploy/serve_config.yaml reaches the engine (none is dropped on
the way), is validated with the engine's bounds, and an unknown key is an error that names it.
"""
import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from engine_bundle import cached_bundle
from serving.engine.config import BatchingKnobs, EngineConfig, ReplicaKnobs, RequestBounds
from serving.engine.engine import Engine
from serving.engine.types import BatchingMode
from serving.server.config import (AppArgs, IngressKnobs, Limits, ModelSpec, colocate, engine_config, split,
                                   validate_serve_config)

ROOT = Path(__file__).resolve().parents[1]


def shipped() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())


def split_form(raw: dict) -> dict:
    """`raw` (the shipped config, its models colocated in the ingress) with a deployment per model, as
    `kvserve serve --placement split` runs it (serving.server.config.split, the inverse of `colocate`)."""
    split(raw["applications"][0], ["translate", "generate"])
    return raw


PLACEMENTS = {"shipped": shipped, "split": lambda: split_form(shipped())}


def model_deployment(raw: dict, name: str) -> dict:
    return next(d for d in raw["applications"][0]["deployments"] if d["name"] == name)


def batching_knobs(raw: dict, name: str) -> dict:
    """Where a model's batching knobs live: the ingress's user_config `models.<name>` when the model is colocated,
    its own deployment's user_config otherwise."""
    spec = next(m for m in raw["applications"][0]["args"]["models"] if m["name"] == name)
    if spec.get("colocated"):
        return model_deployment(raw, "ingress")["user_config"]["models"][name]
    return model_deployment(raw, name)["user_config"]


def test_every_engine_knob_belongs_to_exactly_one_section():
    sections = [set(s.model_fields) for s in (ReplicaKnobs, BatchingKnobs, RequestBounds)]
    assert set().union(*sections) == set(EngineConfig.model_fields)
    assert sum(len(s) for s in sections) == len(EngineConfig.model_fields)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_knob_of_the_serve_config_reaches_the_engine(tmp_path, placement):
    raw = PLACEMENTS[placement]()
    live = {"batching": "request", "max_waiting": 7, "max_waiting_tokens": 12_345, "max_tokens_per_step": 99,
            "max_batch_size": 5, "batch_wait_timeout_s": 0.5}
    knobs = batching_knobs(raw, "generate")
    knobs.clear()
    knobs.update(live)
    dep = model_deployment(raw, "ingress" if placement == "shipped" else "generate")
    dep["max_ongoing_requests"] = max(dep.get("max_ongoing_requests") or 0, 64)
    validate_serve_config(raw, tmp_path)
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    spec = next(m for m in args.models if m.name == "generate")
    user = model_deployment(raw, "ingress" if spec.colocated else "generate")["user_config"]
    parsed = IngressKnobs.model_validate(user).models["generate"] if spec.colocated else BatchingKnobs(**user)
    assert spec.colocated is (placement == "shipped")
    config = engine_config(spec, parsed, args.limits)
    assert {k: getattr(config, k) for k in live} == {**live, "batching": BatchingMode.REQUEST}
    assert config.replica_knobs() == spec.engine
    assert config.max_new_tokens == args.limits.max_tokens
    assert config.max_prompt_tokens == args.limits.max_prompt_tokens + 1  # the bos the server adds


@pytest.mark.parametrize("where,key", [("user_config", "max_waiting_tokenz"), ("engine", "slots"),
                                       ("split user_config", "max_waiting_tokenz")])
def test_an_unknown_engine_key_is_refused_by_name(tmp_path, where, key):
    """user_config: a colocated model's knobs in the ingress's user_config (shipped); split user_config: a model
    deployment's own."""
    raw = split_form(shipped()) if where.startswith("split") else shipped()
    validate_serve_config(copy.deepcopy(raw), tmp_path)  # valid before the typo
    if where.endswith("user_config"):
        batching_knobs(raw, "generate")[key] = 1
    else:
        raw["applications"][0]["args"]["models"][0]["engine"] = {key: 1}
    with pytest.raises(ValidationError, match=key):
        validate_serve_config(raw, tmp_path)


@pytest.mark.parametrize("knob,value", [("max_slots", 2048), ("max_waiting", 200_000), ("max_batch_size", 0),
                                        ("batch_wait_timeout_s", 11.0), ("max_waiting_tokens", 0)])
def test_one_set_of_bounds_wherever_a_knob_is_set(knob, value):
    section = ReplicaKnobs if knob in ReplicaKnobs.model_fields else BatchingKnobs
    with pytest.raises(ValidationError, match=knob):
        section(**{knob: value})
    with pytest.raises(ValidationError, match=knob):
        EngineConfig(**{knob: value})


def test_request_bounds_come_from_the_http_limits():
    limits = Limits(max_prompt_tokens=10, max_tokens=20, max_beam_size=3)
    spec = ModelSpec(name="m", bundle=Path("b"), engine=ReplicaKnobs(max_slots=2))
    config = engine_config(spec, BatchingKnobs(), limits)
    assert (config.max_prompt_tokens, config.max_new_tokens, config.max_beam_size) == (11, 20, 3)


async def test_reconfigure_applies_batching_knobs_live_and_refuses_replica_knobs():
    bundle, _ = cached_bundle("generate")
    eng = Engine.from_bundle(bundle, EngineConfig(max_slots=4, provider="cpu", intra_op_threads=1))
    await eng.start()
    new = EngineConfig(max_slots=4, provider="cpu", intra_op_threads=1, max_waiting_tokens=321,
                       batching=BatchingMode.NONE, max_new_tokens=7)
    eng.reconfigure(new)
    assert eng.scheduler.knobs.max_waiting_tokens == 321 and eng.snapshot()["mode"] == "none"
    assert eng.request_limits.max_new_tokens == 7
    with pytest.raises(ValueError, match="max_slots"):
        eng.reconfigure(new.model_copy(update={"max_slots": 2}))
    await eng.stop()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_shipped_config_composes_without_dropping_keys(tmp_path, placement):
    raw = validate_serve_config(PLACEMENTS[placement](), tmp_path)
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    assert [m.name for m in args.models] == ["translate", "generate"]
    for spec in args.models:
        user = batching_knobs(raw, spec.name)
        assert user  # the shipped config sets every model's knobs
        config = engine_config(spec, BatchingKnobs.model_validate(user), args.limits)
        assert all(getattr(config, k) == BatchingKnobs.model_validate(user).model_dump()[k] for k in user)


def test_a_colocated_model_moves_into_the_ingress_and_validates(tmp_path):
    raw = split_form(shipped())
    app = raw["applications"][0]
    knobs = model_deployment(raw, "generate")["user_config"]
    colocate(app, ["generate"])
    names = [d["name"] for d in app["deployments"]]
    assert "generate" not in names and "translate" in names
    ingress = model_deployment(raw, "ingress")
    assert ingress["user_config"]["models"] == {"generate": knobs}
    assert ingress["ray_actor_options"]["num_cpus"] == 1  # the model's CPU, on the ingress now
    validate_serve_config(raw, tmp_path)
    args = AppArgs.model_validate(app["args"])
    generate = next(m for m in args.models if m.name == "generate")
    assert generate.colocated and generate.serve_deployments() == []
    assert IngressKnobs.model_validate(ingress["user_config"]).models["generate"] == BatchingKnobs(**knobs)


def test_a_colocated_models_canary_keeps_its_own_deployment(tmp_path):
    spec = ModelSpec(name="generate", bundle="b1", colocated=True, canary={"bundle": "b2", "weight": 10})
    assert spec.serve_deployments() == ["generate-canary"]
    assert [d for d, _, _ in spec.deployments()] == ["generate", "generate-canary"]  # both routed


@pytest.mark.parametrize("mistake,match", [
    ("deployment entry kept", "colocated .* remove their entries"),
    ("knobs for a non-colocated model", "not colocated models"),
    ("unknown knob", "max_waitng"),
    ("ongoing below a batch", "ingress.: max_ongoing_requests=4 < max_batch_size"),
])
def test_colocation_mistakes_are_refused_by_name(tmp_path, mistake, match):
    raw = split_form(shipped())
    app = raw["applications"][0]
    kept = copy.deepcopy(model_deployment(raw, "generate"))
    colocate(app, ["generate"])
    ingress = model_deployment(raw, "ingress")
    if mistake == "deployment entry kept":
        app["deployments"].append(kept)
    elif mistake == "knobs for a non-colocated model":
        ingress["user_config"]["models"]["translate"] = {}
    elif mistake == "unknown knob":
        ingress["user_config"]["models"]["generate"]["max_waitng"] = 3
    else:
        ingress["max_ongoing_requests"] = 4
    with pytest.raises((ValueError, ValidationError), match=match):
        validate_serve_config(raw, tmp_path)
