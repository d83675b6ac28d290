"""The Ray Serve application: `build_app(args)`, the Serve config's `import_path` (serving.server.app:build_app).

It parses `AppArgs` (serving/server/config.py), checks every bundle exists, and binds the graph (`bind_app`): one
`ModelDeployment` (replica.py) per model bundle plus the HTTP `Ingress` (ingress.py) that holds their handles.
Deployment options (replicas, autoscaling, queue limits, actor options, user_config) come from the Serve
config file, not from code.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serving.server.config import INGRESS_DEPLOYMENT, AppArgs
from serving.server.ingress import Ingress
from serving.server.replica import ModelDeployment


def bundle_task(bundle_dir: Path) -> str:
    """The task in a bundle's manifest (full verification happens when a replica loads it)."""
    manifest = bundle_dir / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"model bundle {bundle_dir} has no manifest.json; export one with "
                                f"`kvserve export` or point args.artifacts_dir / models[].bundle at it")
    return str(json.loads(manifest.read_text())["task"])


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for the Serve config's `args` (see serving/server/config.py AppArgs)."""
    return bind_app(AppArgs.model_validate(args))


def bind_app(parsed: AppArgs, model_deployment: Any = ModelDeployment) -> Any:
    """The application graph; tests pass a `model_deployment` that injects faults (tests/fault_app.py)."""
    tasks, handles = {}, {}
    limits = parsed.limits.model_dump(mode="json")
    for spec in parsed.models:
        bundle_dir = parsed.bundle_dir(spec)
        tasks[spec.name] = bundle_task(bundle_dir)
        handles[spec.name] = model_deployment.options(name=spec.name).bind(
            spec.model_dump(mode="json"), str(bundle_dir), limits)
    resolved = parsed.model_dump(mode="json")
    resolved["artifacts_dir"] = str(parsed.artifacts_dir.resolve())
    if parsed.api_key is not None:
        resolved["api_key"] = parsed.api_key.get_secret_value()
    return Ingress.options(name=INGRESS_DEPLOYMENT).bind(resolved, tasks, **handles)
