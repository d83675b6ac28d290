"""Where the models of a kvserve application run, as rewrites of its Serve config (a dict, changed in place).

A model is either colocated in the ingress replica (`colocate`: no deployment of its own, its batching knobs in the
ingress's user_config, its CPUs in the ingress's actor options) or served by a deployment of its own (`split`, the
inverse). `colocate_models` and `split_models` apply one placement to every model (`kvserve serve --placement`).

Does not own: validating the result (serving/server/config.py checks a whole Serve config), starting anything
(serving/server/launch.py).
"""

from __future__ import annotations

import copy
from typing import Any

from serving.engine.config import BatchingKnobs, ReplicaKnobs

INGRESS_DEPLOYMENT = "ingress"
POOL_DEPLOYMENT = "pool"  # the model repository's pool (serving/server/pool_deployment.py)


def colocate(app: dict[str, Any], models: list[str]) -> dict[str, Any]:
    """Make `models` of a kvserve application of a Serve config (a dict, changed in place and returned)
    colocated: each model's deployment entry goes, its batching knobs (user_config) move to the ingress's
    user_config `models.<name>`, its CPUs to the ingress's `ray_actor_options`, and the ingress takes at least
    its `max_ongoing_requests`."""
    deployments = app.setdefault("deployments", [])
    ingress = next((d for d in deployments if d["name"] == INGRESS_DEPLOYMENT), None)
    if ingress is None:
        ingress = {"name": INGRESS_DEPLOYMENT}
        deployments.append(ingress)
    for spec in app["args"]["models"]:
        if spec["name"] not in models:
            continue
        spec["colocated"] = True
        dep: dict[str, Any] = next((d for d in deployments if d["name"] == spec["name"]), {})
        if dep:
            deployments.remove(dep)
        ingress.setdefault("user_config", {}).setdefault("models", {})[spec["name"]] = dep.get("user_config") or {}
        actor = ingress.setdefault("ray_actor_options", {})
        actor["num_cpus"] = actor.get("num_cpus", 0) + (dep.get("ray_actor_options") or {}).get("num_cpus", 1)
        if dep.get("max_ongoing_requests"):
            ingress["max_ongoing_requests"] = max(ingress.get("max_ongoing_requests", 0), dep["max_ongoing_requests"])
    return app


# What a model deployment made by `split` gets besides its batching knobs: Ray's bounds as the ingress has them,
# its own CPU, and room for its KV slots and waiting room in max_ongoing_requests.
SPLIT_COPIED_OPTIONS = (
    "max_queued_requests",
    "backpressure_config",
    "graceful_shutdown_timeout_s",
    "max_surge_percent",
)


def split(app: dict[str, Any], models: list[str]) -> dict[str, Any]:
    """The inverse of `colocate`: each of `models` (colocated in the ingress replica) gets a deployment of its
    own, one replica holding `intra_op_threads` CPUs, with the batching knobs the ingress's user_config held for
    it and the ingress's queue bounds; the ingress gives those CPUs back. Changes `app` in place, returns it."""
    deployments = app.setdefault("deployments", [])
    ingress = next((d for d in deployments if d["name"] == INGRESS_DEPLOYMENT), None) or {}
    knobs = (ingress.get("user_config") or {}).get("models", {})
    actor = ingress.setdefault("ray_actor_options", {})
    for spec in app["args"]["models"]:
        if spec["name"] not in models or not spec.get("colocated"):
            continue
        spec["colocated"] = False
        live = knobs.pop(spec["name"], {})
        parsed, engine = BatchingKnobs.model_validate(live), ReplicaKnobs.model_validate(spec.get("engine") or {})
        cpus = engine.intra_op_threads or 1
        actor["num_cpus"] = max(0, actor.get("num_cpus", 0) - cpus)
        deployments.append(
            {
                "name": spec["name"],
                "num_replicas": 1,
                "max_ongoing_requests": max(engine.max_slots + parsed.max_waiting, parsed.max_batch_size),
                **{key: copy.deepcopy(ingress[key]) for key in SPLIT_COPIED_OPTIONS if key in ingress},
                "ray_actor_options": {"num_cpus": cpus},
                "user_config": live,
            }
        )
    return app


# Where the models run. deploy/serve_config.yaml (what `kvserve serve`, the soak, the images and the RayService
# run) colocates them in the ingress replica: a request and each streamed token cross no process boundary between
# the API and the engine (docs/http_path.md), and no handle call whose cancellation leaks
# (docs/decisions/production-placement.md). `--placement split` gives each model a deployment of its own (models
# scale on their own), for comparisons; `--placement colocated` colocates a config file written split.
PLACEMENTS = ("colocated", "split")


def colocate_models(app: dict[str, Any]) -> dict[str, Any]:
    """Every model of a kvserve application into its ingress replica (`colocate`); a model
    whose deployment asks for more than one replica or for autoscaling cannot be, and is refused by name."""
    names = [m["name"] for m in app["args"]["models"] if not m.get("colocated")]
    for dep in app.get("deployments", []):
        if dep["name"] in names and (dep.get("autoscaling_config") or (dep.get("num_replicas") or 1) != 1):
            raise ValueError(
                f"deployment {dep['name']!r} asks for several replicas or autoscaling; a colocated "
                f"model scales with the ingress deployment. Serve it with --placement split, or "
                f"scale the ingress instead."
            )
    return colocate(app, names)


def split_models(app: dict[str, Any]) -> dict[str, Any]:
    """Every colocated model of a kvserve application into a deployment of its own (`split`)."""
    return split(app, [m["name"] for m in app["args"]["models"] if m.get("colocated")])
