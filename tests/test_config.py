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
from serving.server.config import (AppArgs, IngressKnobs, Limits, ModelSpec, colocate, engine_config,
                                   validate_serve_config)

ROOT = Path(__file__).resolve().parents[1]


def shipped() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())


def model_deployment(raw: dict, name: str) -> dict:
    return next(d for d in raw["applications"][0]["deployments"] if d["name"] == name)


def test_every_engine_knob_belongs_to_exactly_one_section():
    sections = [set(s.model_fields) for s in (ReplicaKnobs, BatchingKnobs, RequestBounds)]
    assert set().union(*sections) == set(EngineConfig.model_fields)
    assert sum(len(s) for s in sections) == len(EngineConfig.model_fields)


def test_every_knob_of_the_serve_config_reaches_the_engine(tmp_path):
    raw = shipped()
    live = {"batching": "request", "max_waiting": 7, "max_waiting_tokens": 12_345, "max_tokens_per_step": 99,
            "max_batch_size": 5, "batch_wait_timeout_s": 0.5}
    dep = model_deployment(raw, "generate")
    dep["user_config"] = live
    dep["max_ongoing_requests"] = max(dep.get("max_ongoing_requests") or 0, 64)
    validate_serve_config(raw, tmp_path)
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    spec = next(m for m in args.models if m.name == "generate")
    config = engine_config(spec, BatchingKnobs.model_validate(live), args.limits)
    assert {k: getattr(config, k) for k in live} == {**live, "batching": BatchingMode.REQUEST}
    assert config.replica_knobs() == spec.engine
    assert config.max_new_tokens == args.limits.max_tokens
    assert config.max_prompt_tokens == args.limits.max_prompt_tokens + 1  # the bos the server adds


@pytest.mark.parametrize("where,key", [("user_config", "max_waiting_tokenz"), ("engine", "slots")])
def test_an_unknown_engine_key_is_refused_by_name(tmp_path, where, key):
    raw = shipped()
    if where == "user_config":
        model_deployment(raw, "generate")["user_config"][key] = 1
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


def test_the_shipped_config_composes_without_dropping_keys(tmp_path):
    raw = validate_serve_config(copy.deepcopy(shipped()), tmp_path)
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    for spec in args.models:
        user = model_deployment(raw, spec.name).get("user_config") or {}
        config = engine_config(spec, BatchingKnobs.model_validate(user), args.limits)
        assert all(getattr(config, k) == BatchingKnobs.model_validate(user).model_dump()[k] for k in user)


def test_a_colocated_model_moves_into_the_ingress_and_validates(tmp_path):
    raw = shipped()
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
    raw = shipped()
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
