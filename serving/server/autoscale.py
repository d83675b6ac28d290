"""Serve's autoscaling policy for model deployments, on the engine's own load: `EngineLoadPolicy`.

Ray Serve's default policy scales on ongoing requests per replica against a hand-set
`target_ongoing_requests`. A kvserve replica knows what it can take: its KV slots. Every model replica reports
its engine's running and waiting requests and its slots (serving/server/replica.py `record_autoscaling_stats`,
averaged by Serve over `look_back_period_s`); this policy asks for as many replicas as it takes for the load
to fill `target_utilization` of their slots:

    desired = load / (target_utilization * KV slots per replica)
    load    = max(engine running + waiting, summed over replicas;  Serve's ongoing requests of the deployment)

Serve's own count also sees requests still queued in the handles, before an engine admits them. Serve then
applies the deployment's `autoscaling_config`: min/max_replicas, upscale/downscale delays and factors. Until
the replicas report (starting up), it falls back to Serve's ongoing requests over `target_ongoing_requests`.

In the Serve config (deploy/serve_config.autoscale.yaml):

    autoscaling_config:
      min_replicas: 1
      max_replicas: 3
      policy:
        policy_function: serving.server.autoscale:EngineLoadPolicy
        policy_kwargs: {target_utilization: 0.75}

Self-contained (standard library only) on purpose: Serve pickles this module by value into its controller.
"""

from __future__ import annotations

from typing import Any

LOAD_KEYS = ("running", "waiting")  # reported by each replica with "slots_total"


class EngineLoadPolicy:
    """A Serve autoscaling policy: enough replicas for the engines' load to fill `target_utilization` of their
    KV slots."""

    def __init__(self, target_utilization: float = 0.75) -> None:
        if not 0 < target_utilization <= 4:
            raise ValueError(
                f"target_utilization={target_utilization} must be in (0, 4]: the share of a "
                f"replica's KV slots the load should fill (above 1: count waiting requests too)"
            )
        self.target_utilization = target_utilization

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        """(desired replicas, policy state) for Serve's AutoscalingContext `ctx`."""
        state = dict(ctx.policy_state or {})
        metrics = ctx.aggregated_metrics or {}
        slots = list((metrics.get("slots_total") or {}).values())
        if ctx.current_num_replicas == 0 or not slots or max(slots) <= 0:
            target = ctx.config.get_target_ongoing_requests() if ctx.config is not None else 2.0
            return ctx.total_num_requests / max(target, 1e-9), state
        engine_load = sum(sum((metrics.get(key) or {}).values()) for key in LOAD_KEYS)
        load = max(engine_load, float(ctx.total_num_requests))
        per_replica = self.target_utilization * (sum(slots) / len(slots))
        state["load"], state["desired"] = load, load / per_replica
        return load / per_replica, state
