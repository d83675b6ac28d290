#!/usr/bin/env python3
"""Validate kvserve's Kubernetes manifests offline, against the real schemas, with unknown fields rejected.

The API server prunes unknown fields silently, so a misspelled field would vanish without a trace; every
check here therefore treats an unknown key as an error:
- core kinds (Namespace, PodDisruptionBudget, PersistentVolumeClaim, ...): `kubernetes-validate --strict`;
- custom resources (RayService, PodMonitor): the CRD's openAPIV3Schema from deploy/crds with
  `additionalProperties: false` injected into every object schema that lists `properties` and does not
  say `x-kubernetes-preserve-unknown-fields`; their `metadata` as a strict ObjectMeta;
- every Serve config (serveConfigV2 and the files under deploy/): Ray's `ServeDeploySchema`, a walk that
  reports keys Ray's schema would ignore, kvserve's own `AppArgs` (serving/server/config.py), and
  `serve_safety_errors`: a bounded queue answering 429 + Retry-After on every deployment (the ingress
  included), no plaintext API key, an API key from the environment and every bundle pinned (`bundle_sha256`)
  wherever HTTP binds beyond loopback;
- KubeRay facts no schema states (`check_rayservice`): upgrade strategy, head without replicas, GPU
  tolerations, requests and limits, autoscaling capacity, Ray version equal to the images', the API key
  from a Secret, the proxy's header guard, graceful pod deletion (preStop, Ray's drain on SIGTERM and
  the grace period outlasting the replicas' graceful_shutdown_timeout_s), no ServiceAccount token in the Ray
  containers and read-only root filesystems (deploy/pods.py);
- exposure (deploy/exposure.py): Services, the head Service's ports, Ray token auth, ingress NetworkPolicies;
- egress (deploy/egress.py): where the Ray pods may connect (their own pods, DNS, the head's API server);
- every namespaced object in the RayService's namespace.

CLI: `python deploy/validate.py` renders every overlay under deploy/k8s/overlays, validates everything and
the Serve configs under deploy/, checks that the generated files and the images' dependency locks are current
(deploy/docker/lock.py), warns about base images not pinned by digest, and exits 1 on any problem.
Not here: rendering (deploy/kustomize_lite.py) or generating (deploy/gen_rayservice.py).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import yaml

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
OVERLAYS = DEPLOY / "k8s" / "overlays"
DOCKERFILES = (DEPLOY / "docker" / "Dockerfile.gpu", DEPLOY / "docker" / "Dockerfile.cpu")
SERVE_CONFIGS = (DEPLOY / "serve_config.yaml", DEPLOY / "docker" / "serve_config.gpu.yaml",
                 DEPLOY / "docker" / "serve_config.cpu.yaml")
KVSERVE_IMPORT_PATH = "serving.server.app:build_app"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # oldest we support, newest kubernetes-validate knows
CRD_FILES = {
    ("ray.io/v1", "RayService"): "ray.io_rayservices.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
}
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
# RayService.spec.upgradeStrategy.type is a free string in the CRD; KubeRay knows these values.
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
GPU_RESOURCE = "nvidia.com/gpu"

Doc = dict[str, Any]


def crd_dir() -> Path:
    """deploy/crds, the vendored CRD schemas (KVSERVE_CRD_DIR overrides)."""
    env = os.environ.get("KVSERVE_CRD_DIR")
    return Path(env) if env else REPO / "deploy" / "crds"


def strict_schema(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema where objects with `properties` reject unknown keys."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def load_crd(path: Path) -> Doc:
    """A CRD file (about 1 MB for KubeRay's: libyaml's loader when present, 10x faster)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506 -- a safe loader


@functools.lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """A strict validator for one custom resource kind, from its CRD file."""
    path = crd_dir() / CRD_FILES[(api_version, kind)]
    crd = load_crd(path)
    version = api_version.rsplit("/", 1)[1]
    matches = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if not matches:
        raise ValueError(f"{path}: no version {version!r}")
    schema = strict_schema(matches[0]["schema"]["openAPIV3Schema"])
    return jsonschema.Draft202012Validator(schema)


def _where(error: jsonschema.ValidationError) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(root)"


def validate_custom(doc: Doc) -> list[str]:
    """Errors of a RayService or PodMonitor against its strict CRD schema (and strict metadata)."""
    validator = crd_validator(doc["apiVersion"], doc["kind"])
    errors = [f"{_name(doc)}: {_where(e)}: {e.message}" for e in validator.iter_errors(doc)]
    metadata_doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
    return errors + [e.replace("configmap/", f"{doc['kind'].lower()}/") for e in validate_core(metadata_doc)]


def validate_core(doc: Doc) -> list[str]:
    """Errors of a core kind from `kubernetes-validate` in strict mode, for each supported version."""
    import kubernetes_validate

    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{_name(doc)} (k8s {version}): {'/'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{_name(doc)}: {e.message}")
    return errors


def _name(doc: Doc) -> str:
    return f"{doc.get('kind', '?').lower()}/{doc.get('metadata', {}).get('name', '?')}"


def unknown_keys(model: type, data: Any, where: str = "") -> list[str]:
    """Keys in `data` that pydantic `model` would silently drop, recursing into nested models."""
    from pydantic import BaseModel

    if not isinstance(data, dict):
        return []
    found = []
    fields = model.model_fields
    aliases = {f.alias: n for n, f in fields.items() if f.alias}
    for key, value in data.items():
        name = aliases.get(key, key)
        if name not in fields:
            found.append(f"{where}{key}")
            continue
        for sub in _model_types(fields[name].annotation, BaseModel):
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                suffix = f"[{i}]" if isinstance(value, list) else ""
                found += unknown_keys(sub, item, f"{where}{key}{suffix}.")
    return found


def _model_types(annotation: Any, base: type) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, base):
        return [annotation]
    return [t for arg in typing.get_args(annotation) for t in _model_types(arg, base)]


def validate_serve_config(text: str) -> list[str]:
    """Errors of a serveConfigV2: Ray's schema, keys Ray would ignore, kvserve's args and cross-checks."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load(text)
    try:
        ServeDeploySchema.model_validate(cfg)
    except ValidationError as e:
        return [f"serveConfigV2: {e}"]
    errors = [f"serveConfigV2: unknown key {k!r} (Ray would ignore it)" for k in unknown_keys(ServeDeploySchema, cfg)]
    for app in cfg["applications"]:
        for dep in app.get("deployments", []):
            if isinstance(dep.get("autoscaling_config"), dict):  # typed Dict | AutoscalingConfig: check it
                try:
                    AutoscalingConfig.model_validate(dep["autoscaling_config"])
                except ValidationError as e:
                    errors.append(f"serveConfigV2: deployment {dep['name']!r} autoscaling_config: {e}")
        if app.get("import_path") == KVSERVE_IMPORT_PATH:
            errors += _kvserve_args_errors(app)
    return errors + serve_safety_errors(cfg)


def serve_safety_errors(cfg: Doc) -> list[str]:
    """Bounded queues with 429 + Retry-After on every deployment, no plaintext API key, and an API key from the
    environment wherever HTTP binds beyond loopback."""
    errors = []
    host = (cfg.get("http_options") or {}).get("host", "127.0.0.1")  # Serve's own default
    for app in cfg["applications"]:
        name, deployments = app.get("name", "default"), app.get("deployments") or []
        errors += [e for dep in deployments for e in _queue_errors(name, dep)]
        if app.get("import_path") != KVSERVE_IMPORT_PATH:
            continue
        args = app.get("args") or {}
        models = args.get("models") or []  # a colocated model runs in the ingress; a canary always has its own
        expected = {"ingress", *(m.get("name") for m in models if not m.get("colocated")),
                    *(f"{m.get('name')}-canary" for m in models if m.get("canary"))}
        for missing in sorted(expected - {d["name"] for d in deployments}):
            errors.append(f"application {name!r}: deployment {missing!r} has no entry, so its queue is Serve's "
                          f"default, unbounded (max_queued_requests -1); list it with max_queued_requests and "
                          f"backpressure_config")
        if args.get("api_key") is not None:
            errors.append(f"application {name!r}: plaintext args.api_key: Serve's config and REST API show it to "
                          f"anyone who can read them; name an environment variable with args.api_key_env")
        if host not in LOOPBACK_HOSTS and not args.get("api_key_env"):
            errors.append(f"application {name!r}: HTTP binds {host} (beyond loopback) with no API key; set "
                          f"args.api_key_env (deploy/gen_rayservice.py does for images and Kubernetes)")
        if host not in LOOPBACK_HOSTS:
            for model in models:
                for where, spec in ((model.get("name"), model), (f"{model.get('name')}-canary", model.get("canary"))):
                    if spec and not spec.get("bundle_sha256"):
                        errors.append(f"application {name!r}: model {where!r} serves an unpinned bundle: set its "
                                      f"bundle_sha256 (`kvserve bundle-hash DIR`), so that a bundle swapped on the "
                                      f"image or the volume is refused (deploy/gen_rayservice.py pins the published "
                                      f"models)")
    return errors


def _queue_errors(app: str, dep: Doc) -> list[str]:
    where = f"application {app!r}: deployment {dep['name']!r}"
    errors = []
    queued = dep.get("max_queued_requests", -1)
    if not isinstance(queued, int) or queued < 1:
        errors.append(f"{where}: max_queued_requests={queued} leaves the queue unbounded (a flood waits until it "
                      f"times out); set a bound, e.g. 256")
    pressure = dep.get("backpressure_config") or {}
    if pressure.get("status_code") != 429 or not pressure.get("retry_after_s"):
        errors.append(f"{where}: backpressure_config={pressure or None}: a full queue must answer 429 with "
                      f"Retry-After (Serve's default is a bare 503); set {{status_code: 429, retry_after_s: 1}}")
    return errors


def _kvserve_args_errors(app: Doc) -> list[str]:
    from pydantic import ValidationError

    from serving.server.config import AppArgs, check_deployments

    try:
        args = AppArgs.model_validate(app.get("args") or {})
        check_deployments(app, args)
    except (ValidationError, ValueError) as e:
        return [f"serveConfigV2: application {app['name']!r} args: {e}"]
    return []


def _containers(group: Doc) -> list[Doc]:
    return group["template"]["spec"]["containers"]


def check_rayservice(doc: Doc) -> list[str]:
    """KubeRay facts the CRD schema does not state; each message names the field and the fix."""
    spec, errors = doc["spec"], []
    cluster = spec["rayClusterConfig"]
    if spec.get("upgradeStrategy", {}).get("type") not in UPGRADE_TYPES:
        errors.append(f"spec.upgradeStrategy.type must be one of {sorted(UPGRADE_TYPES)}")
    head_params = cluster["headGroupSpec"].get("rayStartParams", {})
    for param in ("num-cpus", "num-gpus"):
        if head_params.get(param) != "0":
            errors.append(f'headGroupSpec.rayStartParams.{param} must be "0" so the head takes no replicas')
    if not cluster.get("enableInTreeAutoscaling"):
        errors.append("rayClusterConfig.enableInTreeAutoscaling must be true: Serve's autoscaler needs pods")
    images = _image_ray_versions()
    if images and set(images.values()) != {cluster.get("rayVersion")}:
        errors.append(f"rayClusterConfig.rayVersion={cluster.get('rayVersion')!r} differs from the images' "
                      f"RAY_VERSION {images}")
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    for group in groups:
        errors += _check_group(group)
    serve = yaml.safe_load(spec["serveConfigV2"])
    workers = cluster.get("workerGroupSpecs", [])
    pods = _sibling("pods")
    return (errors + _check_capacity(serve, workers) + pods.env_errors(serve, groups)
            + [e for w in workers for e in pods.graceful_errors(serve, w)] + pods.privilege_errors(cluster))


def _check_group(group: Doc) -> list[str]:
    name, errors = group.get("groupName", "head"), []
    for c in _containers(group):
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            for key in ("cpu", "memory"):
                if key not in res.get(part, {}):
                    errors.append(f"group {name}: container {c['name']} has no resources.{part}.{key}")
        if GPU_RESOURCE in res.get("limits", {}):
            tolerated = any(t.get("key") == GPU_RESOURCE for t in group["template"]["spec"].get("tolerations", []))
            if not tolerated:
                errors.append(f"group {name}: requests {GPU_RESOURCE} but does not tolerate the {GPU_RESOURCE} taint")
        if "groupName" in group and "readinessProbe" not in c:
            errors.append(f"group {name}: container {c['name']} has no readinessProbe")
    if "groupName" in group and not group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]:
        errors.append(f"group {name}: replicas must lie within [minReplicas, maxReplicas]")
    return errors


def _quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _check_capacity(serve: Doc, workers: list[Doc]) -> list[str]:
    """Every deployment needs CPU or GPU (so none fits the head), and the maxima fit the largest cluster."""
    errors, need = [], {"cpu": 0.0, "gpu": 0.0}
    for app in serve["applications"]:
        for dep in app.get("deployments", []):
            opts = dep.get("ray_actor_options", {})
            cpus, gpus = float(opts.get("num_cpus", 1)), float(opts.get("num_gpus", 0))
            if cpus <= 0 and gpus <= 0:
                errors.append(f"deployment {dep['name']!r} asks for no CPU or GPU: it could run on the head")
            scaling = dep.get("autoscaling_config") or {}
            most = scaling.get("max_replicas", dep.get("num_replicas", 1))
            need["cpu"] += most * cpus
            need["gpu"] += most * gpus
    have = {"cpu": 0.0, "gpu": 0.0}
    for group in workers:
        limits = _containers(group)[0]["resources"]["limits"]
        have["cpu"] += group["maxReplicas"] * _quantity(limits["cpu"])
        have["gpu"] += group["maxReplicas"] * _quantity(limits.get(GPU_RESOURCE, 0))
    for kind in ("cpu", "gpu"):
        if need[kind] > have[kind]:
            errors.append(f"deployments at max_replicas need {need[kind]:g} {kind}s, worker groups at "
                          f"maxReplicas hold {have[kind]:g}: raise maxReplicas or lower max_replicas")
    return errors


def _image_ray_versions() -> dict[str, str]:
    found = {}
    for path in DOCKERFILES:
        match = re.search(r"^ARG RAY_VERSION=(\S+)$", path.read_text(encoding="utf-8"), re.M)
        if match:
            found[path.name] = match.group(1)
    return found


def validate_docs(docs: list[Doc]) -> list[str]:
    """Every problem in a rendered set of manifests."""
    errors, well_formed = [], True
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        found = validate_custom(doc) if key in CRD_FILES else validate_core(doc)
        if key == ("ray.io/v1", "RayService") and not found:  # the checks below need a well-formed doc
            found += validate_serve_config(doc["spec"]["serveConfigV2"]) + check_rayservice(doc)
        well_formed &= not found
        errors += found
    if well_formed:
        errors += _sibling("exposure").check(docs) + _sibling("egress").check(docs) + namespace_errors(docs)
    return errors


def namespace_errors(docs: list[Doc]) -> list[str]:
    """Every namespaced object lands in the RayService's namespace (a component's resources are not under the
    base's `namespace:`; without their own they would land in whatever namespace kubectl defaults to)."""
    namespaces = {d["metadata"].get("namespace") for d in docs if d.get("kind") == "RayService"}
    cluster_scoped = _sibling("kustomize_lite").CLUSTER_SCOPED
    return [f"{_name(d)}: namespace {d['metadata'].get('namespace')!r}, not the RayService's {sorted(namespaces)}"
            for d in docs if d.get("kind") not in cluster_scoped and len(namespaces) == 1
            and d["metadata"].get("namespace") not in namespaces]


def _sibling(name: str) -> ModuleType:
    """deploy/<name>.py, imported by its path once (deploy/ is a directory of scripts, not a package)."""
    key = "kvserve_deploy_" + name.replace("/", "_")
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, DEPLOY / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def main() -> int:
    sys.path[:0] = [str(REPO), str(DEPLOY)]
    import gen_rayservice
    from kustomize_lite import render

    failed = gen_rayservice.main(["--check"]) != 0
    lock = _sibling("docker/lock")
    failed |= lock.main(["--check"]) != 0
    for warning in lock.unpinned_base_images():
        print(f"warning: {warning}")
    for path in SERVE_CONFIGS:
        errors = validate_serve_config(path.read_text(encoding="utf-8"))
        failed |= bool(errors)
        print(f"{path.relative_to(REPO)}: {'FAIL' if errors else 'ok'}")
        for e in errors:
            print(f"  {e}")
    for overlay in sorted(p for p in OVERLAYS.iterdir() if p.is_dir()):
        docs, renderer = render(overlay)
        errors = validate_docs(docs)
        failed |= bool(errors)
        print(f"{overlay.relative_to(REPO)}: {len(docs)} objects ({renderer}): {'FAIL' if errors else 'ok'}")
        for e in errors:
            print(f"  {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
