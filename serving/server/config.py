"""The server's configuration: one validated pydantic object per process boundary, parsed once at startup.

- `AppArgs` is `applications[].args` of the Serve config (deploy/serve_config.yaml): where the bundles are,
  each model's engine knobs that are fixed when a replica starts (`ReplicaKnobs`: KV slots, provider,
  threads), and the HTTP limits. `serving.server.app.build_app` parses it; nothing else reads the raw dict.
- A model deployment's `user_config` is the engine's `BatchingKnobs`, which `reconfigure` applies live.
- `IngressKnobs` is the ingress deployment's `user_config`: the graceful drain switch (serving/server/drain.py)
  and the batching knobs of the models `colocated` in the ingress replica.
- `load_serve_config` / `validate_serve_config` check a whole Serve config offline (Ray's own schema, then ours),
  for `kvserve serve`, tests and the deploy tooling.

Deployment-level knobs (replicas, autoscaling, max_ongoing_requests, max_queued_requests, actor options)
stay in Ray's own schema, which `load_serve_config` validates with `ServeDeploySchema`; this module adds
the checks Ray cannot know (e.g. max_ongoing_requests >= max_batch_size). The engine's knobs are declared
once, in serving/engine/config.py, and used here as they are; `engine_config()` composes the engine's
`EngineConfig` from the pieces of the Serve config. Where the models run (`colocate`, `split`) is
serving/server/placement.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from serving.engine.config import BatchingKnobs, EngineConfig, ReplicaKnobs, RequestBounds
from serving.engine.types import BatchingMode
from serving.server.placement import INGRESS_DEPLOYMENT, POOL_DEPLOYMENT
from serving.server.placement import colocate as colocate  # re-exported: a config's placement rewrites
from serving.server.placement import split as split

MODEL_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
CANARY_SUFFIX = "-canary"  # a model's canary deployment is named "<model>-canary"


class _Strict(BaseModel):
    # Unknown keys are errors: Ray's schema ignores them, so a typo would otherwise pass silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


class IngressKnobs(_Strict):
    """The ingress deployment's `user_config`, applied live by `Ingress.reconfigure` (serving/server/drain.py)."""

    draining: bool = Field(
        False,
        description="true: refuse new API requests with 503 + Retry-After and report "
        "not ready, while the ones in flight finish (graceful shutdown).",
    )
    models: dict[str, BatchingKnobs] = Field(
        default_factory=dict,
        description=(
            "The batching knobs of each `colocated` model (what a model deployment's own user_config holds "
            "otherwise), by model name; applied live."
        ),
    )


class Limits(_Strict):
    """What one HTTP request may ask for; beyond these the API answers 413 or 422 naming the limit."""

    max_body_bytes: int = Field(65_536, ge=256, le=16 * 2**20, description="Largest request body (bytes) -> 413.")
    max_prompt_tokens: int = Field(256, ge=1, le=65_536, description="Longest prompt/source in tokens -> 413.")
    max_tokens: int = Field(256, ge=1, le=65_536, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int | None = Field(
        None, ge=1, le=65_536, description=("max_tokens when a request names none; None = min(128, max_tokens).")
    )
    max_texts: int = Field(32, ge=1, le=1024, description="Most texts in one /v1/translate request.")
    max_beam_size: int = Field(8, ge=1, le=8, description="Largest beam_size (the API allows 1-8).")
    max_n_best: int = Field(8, ge=1, le=8, description="Most hypotheses per text (n_best <= beam_size).")
    max_stop_strings: int = Field(4, ge=0, le=16, description="Most stop strings per request.")
    request_timeout_s: float = Field(60.0, gt=0, le=3600, description="Deadline per request -> 504 past it.")

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> Limits:
        if self.default_max_tokens is not None and self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds max_tokens={self.max_tokens}")
        return self

    def engine_bounds(self) -> RequestBounds:
        """What the engine enforces per request. It counts the bos that serving/server/service.py puts before
        an LM's prompt; the user's limit does not."""
        return RequestBounds(
            max_prompt_tokens=self.max_prompt_tokens + 1,
            max_new_tokens=self.max_tokens,
            max_beam_size=self.max_beam_size,
        )

    @property
    def default_tokens(self) -> int:
        return self.default_max_tokens if self.default_max_tokens is not None else min(128, self.max_tokens)


SHA256 = r"^[0-9a-f]{64}$"
PIN_DESCRIPTION = (
    "The bundle's content hash (`kvserve bundle-hash DIR` prints it): set, a replica refuses a bundle "
    "whose content differs (one swapped on a shared volume), whatever its own manifest says."
)


class CanarySpec(_Strict):
    """A second bundle of the same model served beside the first, with a share of the model's traffic."""

    bundle: Path = Field(..., description="The canary's bundle directory (relative: under artifacts_dir).")
    bundle_sha256: str | None = Field(None, pattern=SHA256, description=PIN_DESCRIPTION)
    weight: float = Field(
        ...,
        gt=0,
        lt=100,
        description=(
            "Percent of the model's requests that go to the canary (the rest go to `bundle`); a request naming "
            "`model@version` goes to that version whatever the weights. Promote: make this bundle the model's "
            "`bundle` and drop `canary`; roll back: drop `canary`."
        ),
    )


class ModelSpec(_Strict):
    """One served model: a bundle directory and its replica-lifetime engine knobs."""

    name: str = Field(..., description="Model name in the API and Serve deployment name, e.g. 'translate'.")
    bundle: Path = Field(..., description="Bundle directory; relative paths are under AppArgs.artifacts_dir.")
    bundle_sha256: str | None = Field(None, pattern=SHA256, description=PIN_DESCRIPTION)
    engine: ReplicaKnobs = Field(default_factory=ReplicaKnobs)
    canary: CanarySpec | None = Field(
        None,
        description=(
            "Serve a second bundle of this model beside `bundle`, as the deployment '<name>-canary' (its own "
            "replicas and deployment options in the Serve config), with `weight` percent of the traffic."
        ),
    )
    colocated: bool = Field(
        False,
        description=(
            "true: the model's engine runs inside the ingress replica, so a request and each streamed token cross "
            "no process boundary between the API and the engine (the HTTP path's fastest form, docs/http_path.md); "
            "the model then has no deployment of its own: it scales with the ingress deployment, whose "
            "`ray_actor_options` must reserve its CPUs, and its batching knobs are the ingress user_config's "
            "`models.<name>`. A canary stays a deployment of its own. false: a deployment of its own, reached "
            "through a handle (scales on its own; one more hop per request and per streamed chunk)."
        ),
    )
    response_cache_entries: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Deterministic answers (greedy, beam, seeded) each replica keeps, by request, for identical requests to "
            "the same version (serving/server/response_cache.py); 0 = off. `Cache-Control: no-cache` bypasses it."
        ),
    )
    response_cache_bytes: int = Field(
        64 * 2**20, ge=2**16, le=2**34, description=("Bound on the bytes of the cached answers' texts per replica.")
    )
    stream_interval_s: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description=(
            "A stream's tokens cross from the model replica to the client at most once per this interval (the first "
            "token at once, the last without waiting); 0 = as soon as each is ready. The SSE output stays one event "
            "per token. Fewer, larger messages cost the proxy and the ingress less CPU (docs/benchmarks.md)."
        ),
    )

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not MODEL_NAME.match(v) or v in (INGRESS_DEPLOYMENT, POOL_DEPLOYMENT) or v.endswith(CANARY_SUFFIX):
            raise ValueError(
                f"model name {v!r} must match {MODEL_NAME.pattern}, not be '{INGRESS_DEPLOYMENT}' or "
                f"'{POOL_DEPLOYMENT}' "
                f"and not end in '{CANARY_SUFFIX}' (the name of a model's canary deployment)"
            )
        return v

    def serve_deployments(self) -> list[str]:
        """The Serve deployments this model needs (a colocated model's stable bundle needs none)."""
        return [name for name, _, _ in self.deployments() if not (self.colocated and name == self.name)]

    def bundle_pin(self, deployment: str) -> str | None:
        """The `bundle_sha256` the bundle of `deployment` (the model's, or its canary's) must have, if pinned."""
        if self.canary is not None and deployment == self.name + CANARY_SUFFIX:
            return self.canary.bundle_sha256
        return self.bundle_sha256

    def deployments(self) -> list[tuple[str, Path, float]]:
        """(Serve deployment name, bundle, percent of this model's traffic) of each version served."""
        if self.canary is None:
            return [(self.name, self.bundle, 100.0)]
        return [
            (self.name, self.bundle, 100.0 - self.canary.weight),
            (self.name + CANARY_SUFFIX, self.canary.bundle, self.canary.weight),
        ]


class RepositorySpec(_Strict):
    """A model repository served by a pool of replicas (serving/server/model_pool.py, pool_deployment.py)."""

    paths: list[Path] = Field(..., min_length=1, description="Folders of bundles; each subfolder is a model.")
    max_models_per_replica: int = Field(4, ge=1, le=256, description="Models one pool replica holds at most.")
    max_bytes_per_replica: int | None = Field(None, ge=1, description="Bundle bytes one pool replica holds at most.")
    pinned: list[str] = Field(
        default_factory=list, description="Warm models: loaded at start on every replica, never evicted."
    )
    rescan_s: float = Field(30.0, gt=0, description="How often the folders are read again for new bundles.")
    load_timeout_s: float = Field(
        60.0, gt=0, description="How long a cold model waits for room (a held model to become idle), else 503."
    )
    engine: ReplicaKnobs = Field(default_factory=ReplicaKnobs, description="Each pool model's engine knobs.")

    @model_validator(mode="after")
    def _fits(self) -> RepositorySpec:
        if len(self.pinned) > self.max_models_per_replica:
            raise ValueError(
                f"{len(self.pinned)} pinned models exceed max_models_per_replica={self.max_models_per_replica}"
            )
        return self


class AppArgs(_Strict):
    """`applications[].args` of the Serve config, parsed once by `serving.server.app.build_app`."""

    artifacts_dir: Path = Field(Path("artifacts"), description="Root for relative bundle paths.")
    models: list[ModelSpec] = Field(..., min_length=1, max_length=16, description="Served models.")
    repository: RepositorySpec | None = Field(
        None, description="A model repository whose every bundle is servable by name, through the `pool` deployment."
    )
    limits: Limits = Field(default_factory=Limits)
    api_key: SecretStr | None = Field(None, description="If set, requests need 'Authorization: Bearer <key>'.")
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Z_][A-Z0-9_]*$",
        description="Name of an environment variable holding the API key (wins "
        "over api_key; read once when the ingress starts).",
    )
    metrics_require_key: bool = Field(
        False,
        description=(
            "true: /metrics needs the API key too (Prometheus then sends it, e.g. a ServiceMonitor's "
            "`authorization` with the key's Secret). false (default): /metrics is open like the health probes, "
            "so scrapers need no credentials. Without an API key it has no effect."
        ),
    )

    @field_validator("models")
    @classmethod
    def _unique_names(cls, v: list[ModelSpec]) -> list[ModelSpec]:
        names = [m.name for m in v]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return v

    def resolve_path(self, path: Path) -> Path:
        """A path of the config, absolute: relative ones are under artifacts_dir."""
        return (path if path.is_absolute() else self.artifacts_dir / path).resolve()

    def bundle_dir(self, spec: ModelSpec, bundle: Path | None = None) -> Path:
        """The absolute bundle directory of a model, or of `bundle` (its canary's), resolved where the app is
        built."""
        bundle = spec.bundle if bundle is None else bundle
        path = bundle if bundle.is_absolute() else self.artifacts_dir / bundle
        return path.resolve()

    def resolved_api_key(self) -> str | None:
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"api_key_env={self.api_key_env!r} names an unset or empty environment variable")
            return key
        return self.api_key.get_secret_value() if self.api_key else None


def engine_config(spec: ModelSpec, live: BatchingKnobs, limits: Limits) -> EngineConfig:
    """The engine's config for one model: its replica knobs, the live batching knobs and the request bounds."""
    return EngineConfig.compose(spec.engine, live, limits.engine_bounds())


def check_deployments(app: dict[str, Any], args: AppArgs) -> None:
    """Cross-checks Ray cannot do: every model has a deployment entry whose limits let batches form."""
    deployments = {d["name"]: d for d in app.get("deployments", [])}
    expected = {INGRESS_DEPLOYMENT, *(name for m in args.models for name in m.serve_deployments())}
    if args.repository is not None:
        expected.add(POOL_DEPLOYMENT)
    colocated = {m.name for m in args.models if m.colocated}
    listed = sorted(colocated & set(deployments))
    if listed:
        raise ValueError(
            f"models {listed} are colocated (they run in the ingress replica) and have no deployment "
            f"of their own: remove their entries from `deployments`, put their batching knobs in the "
            f"ingress's user_config under models.<name>, and size the ingress's ray_actor_options"
        )
    unknown = set(deployments) - expected
    if unknown:
        raise ValueError(f"deployments {sorted(unknown)} match no model; expected names {sorted(expected)}")
    ingress = deployments.get(INGRESS_DEPLOYMENT, {})
    knobs = IngressKnobs.model_validate(ingress.get("user_config") or {})
    stray = sorted(set(knobs.models) - colocated)
    if stray:
        raise ValueError(
            f"the ingress user_config has batching knobs for {stray}, which are not colocated models "
            f"(colocated: {sorted(colocated)}); a model deployment's knobs go in its own user_config"
        )
    for spec in args.models:
        for name in spec.serve_deployments():
            _check_model_deployment(name, deployments.get(name, {}), spec)
        if spec.colocated:
            _check_model_deployment(
                INGRESS_DEPLOYMENT,
                {**ingress, "user_config": knobs.models[spec.name].model_dump() if spec.name in knobs.models else None},
                spec,
            )


def _check_model_deployment(name: str, dep: dict[str, Any], spec: ModelSpec) -> None:
    live = BatchingKnobs.model_validate(dep.get("user_config") or {})
    ongoing = dep.get("max_ongoing_requests")
    if ongoing is not None and ongoing < live.max_batch_size:
        raise ValueError(
            f"deployment {name!r}: max_ongoing_requests={ongoing} < max_batch_size="
            f"{live.max_batch_size}; a full batch could never form. Raise max_ongoing_requests."
        )
    if ongoing is not None and live.batching == BatchingMode.CONTINUOUS and ongoing < spec.engine.max_slots:
        raise ValueError(
            f"deployment {name!r}: max_ongoing_requests={ongoing} < max_slots="
            f"{spec.engine.max_slots}; KV slots would sit idle. Raise max_ongoing_requests."
        )


def load_serve_config(path: str | Path, artifacts_dir: str | Path | None = None) -> dict[str, Any]:
    """Read a Serve config file and validate it (see `validate_serve_config`); returns the dict."""
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return validate_serve_config(raw, artifacts_dir)


def validate_serve_config(raw: dict[str, Any], artifacts_dir: str | Path | None = None) -> dict[str, Any]:
    """Validate a Serve config dict: Ray's schema, then AppArgs and the cross-checks of every kvserve app.

    `artifacts_dir` overrides `args.artifacts_dir` of every kvserve application (the `--artifacts` flag).
    """
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(raw)
    for app in raw.get("applications", []):
        if app.get("import_path") != "serving.server.app:build_app":
            continue
        if artifacts_dir is not None:
            app.setdefault("args", {})["artifacts_dir"] = str(Path(artifacts_dir).resolve())
        args = AppArgs.model_validate(app.get("args") or {})
        check_deployments(app, args)
    return raw
