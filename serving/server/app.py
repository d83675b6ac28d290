"""The Ray Serve application: `build_app(args)`, the Serve config's `import_path` (serving.server.app:build_app).

It parses `AppArgs` (serving/server/config.py), checks every bundle exists, and binds the graph (`bind_app`): one
`ModelDeployment` (replica.py) per model bundle (a model's canary is a second deployment, `<model>-canary`) plus
the HTTP `Ingress` (ingress.py) that holds their handles and each model's routes (deployment, weight). A
`colocated` model's bundle gets no deployment: the ingress replica loads it and serves it in-process.
Deployment options (replicas, autoscaling, queue limits, actor options, user_config) come from the Serve
config file, not from code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serving.server.config import AppArgs
from serving.server.ingress import Ingress
from serving.server.placement import INGRESS_DEPLOYMENT
from serving.server.pool_deployment import PoolDeployment
from serving.server.pool_routes import POOL_DEPLOYMENT
from serving.server.replica import ModelDeployment


def bundle_task(bundle_dir: Path) -> str:
    """The task in a bundle's manifest (full verification happens when a replica loads it)."""
    manifest = bundle_dir / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"model bundle {bundle_dir} has no manifest.json; export one with "
            f"`kvserve export` or point args.artifacts_dir / models[].bundle at it"
        )
    return str(json.loads(manifest.read_text())["task"])


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for the Serve config's `args` (see serving/server/config.py AppArgs)."""
    return bind_app(AppArgs.model_validate(args))


def bind_app(parsed: AppArgs, model_deployment: Any = ModelDeployment) -> Any:
    """The application graph; tests pass a `model_deployment` that injects faults (tests/fault_app.py)."""
    tasks: dict[str, str] = {}  # model -> task
    handles: dict[str, Any] = {}  # deployment -> its bound deployment
    routes: dict[str, list[tuple[str, float]]] = {}  # model -> (deployment, weight) of its bundles
    local: dict[str, tuple[dict, str]] = {}  # colocated deployment -> (ModelSpec, bundle dir)
    limits = parsed.limits.model_dump(mode="json")
    for spec in parsed.models:
        routes[spec.name] = []
        for deployment, bundle, weight in spec.deployments():  # the model's stable bundle, and its canary's
            bundle_dir = parsed.bundle_dir(spec, bundle)
            task = bundle_task(bundle_dir)
            if tasks.setdefault(spec.name, task) != task:
                raise ValueError(
                    f"model {spec.name!r}: its canary bundle {bundle_dir} is a {task} model, its "
                    f"bundle a {tasks[spec.name]} one; a canary must serve the same task"
                )
            if deployment in spec.serve_deployments():
                handles[deployment] = model_deployment.options(name=deployment).bind(
                    spec.model_dump(mode="json"), str(bundle_dir), limits
                )
            else:  # colocated: the ingress replica loads it
                local[deployment] = (spec.model_dump(mode="json"), str(bundle_dir))
            routes[spec.name].append((deployment, weight))
    resolved = parsed.model_dump(mode="json")
    resolved["artifacts_dir"] = str(parsed.artifacts_dir.resolve())
    if parsed.api_key is not None:
        resolved["api_key"] = parsed.api_key.get_secret_value()
    if parsed.repository is not None:  # the pool: every bundle of the repository, by name (pool_deployment.py)
        repo = resolved["repository"]
        repo["paths"] = [str(parsed.resolve_path(Path(p))) for p in parsed.repository.paths]
        handles[POOL_DEPLOYMENT] = PoolDeployment.options(name=POOL_DEPLOYMENT).bind(  # type: ignore[attr-defined]
            {**resolved, "api_key": None, "api_key_env": None}
        )
    # mypy keeps a decorated class's own type: it does not see that @serve.deployment made Ingress a Deployment
    return Ingress.options(name=INGRESS_DEPLOYMENT).bind(resolved, tasks, routes, local, **handles)  # type: ignore[attr-defined]
