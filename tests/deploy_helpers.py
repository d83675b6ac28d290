"""Shared by tests/test_deploy*.py: load the deploy/ scripts (plain scripts, not a package) as modules,
render the kustomize overlays once per test session, and read each of kubernetes-validate's schema files
once per test session (`cache_kubernetes_schemas`)."""
from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
OVERLAYS = ("gpu", "cpu", "gpu-volume")


def cache_kubernetes_schemas() -> None:
    """kubernetes-validate parses a kind's schema file and the 1 MB definitions file at every validate() call
    (0.2 s of a validate_docs' 0.3 s, and the deploy tests call validate_docs dozens of times); the files are
    the installed package's, so one parse per test session gives the same schemas, which are only read.
    Done when deploy/validate.py is first loaded."""
    import kubernetes_validate.utils as kv

    if not hasattr(kv.schema_contents, "cache_info"):
        kv.schema_contents = functools.lru_cache(maxsize=None)(kv.schema_contents)


@functools.lru_cache(maxsize=None)
def load(relpath: str) -> ModuleType:
    """Import deploy/<relpath>.py once, under a name that cannot clash with other modules."""
    name = "kvserve_deploy_" + relpath.replace("/", "_")
    if relpath == "validate":
        cache_kubernetes_schemas()
    spec = importlib.util.spec_from_file_location(name, DEPLOY / f"{relpath}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def rendered_lite(overlay: str) -> tuple[dict[str, Any], ...]:
    """An overlay rendered by the Python subset of kustomize (always available)."""
    return tuple(load("kustomize_lite").render_lite(DEPLOY / "k8s" / "overlays" / overlay))


def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


DASHBOARD = DEPLOY / "grafana" / "kvserve-dashboard.json"
# A metric name in PromQL as the dashboard writes it: always followed by a {label selector}.
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")


def rendered_copy(overlay: str = "gpu") -> list[dict[str, Any]]:
    """A copy of an overlay's rendered objects, for a test to mutate."""
    import copy

    return copy.deepcopy(list(rendered_lite(overlay)))


def ray_cluster(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The RayService's rayClusterConfig."""
    return by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]


def head_group(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return ray_cluster(docs)["headGroupSpec"]


def worker_group(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return ray_cluster(docs)["workerGroupSpecs"][0]


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the Grafana dashboard (panel targets and templating queries)."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def dashboard_metric_names_in(expr: str) -> set[str]:
    """The metric names one expression queries (label_values(metric, label) included)."""
    names = set(_SELECTOR.findall(expr))
    return names | set(re.findall(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[,{]", expr))


def dashboard_metric_names() -> set[str]:
    """The metric names the dashboard queries."""
    return set().union(*(dashboard_metric_names_in(e) for e in dashboard_exprs()))
