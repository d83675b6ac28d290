#!/usr/bin/env python3
"""Generate the Kubernetes and image Serve configs from deploy/serve_config.yaml: never copy them by hand.

Owns the *only* differences between the Serve config a checkout runs (`deploy/serve_config.yaml`, owned by
serving/) and what runs in images and on Kubernetes. Every difference is an explicit, tested override:

1. Bundles: `args.artifacts_dir` becomes /models and each model's `bundle` its last path component, so
   `artifacts/bundles/translate` in a checkout is `/models/translate` in an image (baked in or mounted).
2. HTTP: the proxy listens on 0.0.0.0:8000, where KubeRay's Serve service and probes expect it, whatever
   host the checkout's config binds (127.0.0.1 there: a local server is for that machine only). Inside a
   container loopback would reach nothing; the API key (6) and, on Kubernetes, the NetworkPolicy guard it.
3. The head takes no replicas: the head pod starts with num-cpus 0, and every deployment here asks for
   some CPU (an ingress that holds no engine 0.25), so Ray can never place a replica there.
4. Autoscaling: each deployment gets an `autoscaling_config` instead of a fixed `num_replicas`, so Serve
   asks for replicas under load and the KubeRay autoscaler adds worker pods to hold them. Every deployment
   that holds engines -- the ingress with its colocated models (the shipped placement), a model deployment,
   a canary -- scales on the engines' load, KV slots in use and waiting requests
   (serving/server/autoscale.py `EngineLoadPolicy`, settings measured by bench/autoscale.py).
5. ONNX Runtime provider named, never `auto`: the GPU variant runs provider=cuda (a broken CUDA setup
   fails at replica start instead of silently falling back to the CPU) and gives each engine half a GPU
   (the shipped ingress replica, holding both models, one GPU per worker pod); the CPU variant runs
   provider=cpu.
6. API key from the environment: `args.api_key_env` names `API_KEY_ENV`, which the pods take from a
   Kubernetes Secret and `docker run` from `-e`/`--env-file`. A plaintext `args.api_key` is refused: Serve's
   config and REST API would show it to anyone who can read them.
7. Graceful stop: every deployment (the ingress included) waits for its in-flight requests at least as
   long as a request may run (`args.limits.request_timeout_s`) before a replica stops, so deleting a pod
   lets its streams finish (deploy/README.md, "Deleting a pod").
8. Pinned bundles: each model whose bundle is a published model's (published/<name>, what `make serve`
   exports and the images bake) gets that bundle's content hash as `bundle_sha256`, so a replica refuses a
   bundle swapped on the image or the models volume (serving/server/config.py ModelSpec). A config of other
   bundles keeps its own pins; deploy/validate.py refuses a model without one.
9. /metrics behind the API key (`args.metrics_require_key`): Prometheus scrapes each Ray pod's metrics port
   (deploy/k8s/base/podmonitors.yaml), not the API, so no unauthenticated answer names the models.

Writes (and with --check only compares):
- deploy/k8s/base/rayservice.yaml            rayservice.template.yaml + serveConfigV2 (GPU variant)
- deploy/k8s/overlays/cpu/serve-config-v2.yaml  a JSON patch replacing serveConfigV2 (CPU variant)
- deploy/docker/serve_config.{gpu,cpu}.yaml  the image's default config (`kvserve serve --config ...`)

Not here: the cluster shape (deploy/k8s/rayservice.template.yaml), validation (deploy/validate.py).
Run from anywhere: `python deploy/gen_rayservice.py [--check]`.
"""
from __future__ import annotations

import argparse
import copy
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
SERVE_CONFIG = DEPLOY / "serve_config.yaml"
TEMPLATE = DEPLOY / "k8s" / "rayservice.template.yaml"
PLACEHOLDER = "__SERVE_CONFIG_V2__"
KVSERVE_IMPORT_PATH = "serving.server.app:build_app"
INGRESS = "ingress"



class Variant(str, Enum):
    GPU = "gpu"
    CPU = "cpu"


# --- the overrides, as data (tests read these) -------------------------------------------------------
IMAGE_MODELS_DIR = "/models"
HTTP_OPTIONS = {"host": "0.0.0.0", "port": 8000}  # replaces the checkout's host
INGRESS_NUM_CPUS = 0.25
GPU_PER_MODEL_REPLICA = 0.5
PROVIDER = {Variant.GPU: "cuda", Variant.CPU: "cpu"}
MODEL_AUTOSCALING: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 4,
    "upscale_delay_s": 10,
    "downscale_delay_s": 300,
    "metrics_interval_s": 2,
    "look_back_period_s": 10,
    # A replica wants its KV slots 75% full (running + waiting requests); docs/lifecycle.md, "Autoscaling".
    "policy": {"policy_function": "serving.server.autoscale:EngineLoadPolicy",
               "policy_kwargs": {"target_utilization": 0.75}},
}
INGRESS_AUTOSCALING: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": 256,
    "upscale_delay_s": 10,
    "downscale_delay_s": 300,
}
API_KEY_ENV = "KVSERVE_API_KEY"
PUBLISHED = DEPLOY.parent / "published"  # published/<name>/manifest.json: bundle.sha256 of its export


def load_serve_config(path: Path = SERVE_CONFIG) -> dict[str, Any]:
    """The checkout's Serve config as a dict (serving/ validates its meaning; we only transform it)."""
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict) or not cfg.get("applications"):
        raise ValueError(f"{path}: expected a Serve config with an 'applications' list")
    return cfg


def image_serve_config(cfg: dict[str, Any], variant: Variant) -> dict[str, Any]:
    """The Serve config for images and Kubernetes: `cfg` with the overrides in this module's docstring."""
    out = copy.deepcopy(cfg)
    out["http_options"] = {**out.get("http_options", {}), **HTTP_OPTIONS}
    kvserve_apps = [a for a in out["applications"] if a.get("import_path") == KVSERVE_IMPORT_PATH]
    if not kvserve_apps:
        raise ValueError(f"no application with import_path {KVSERVE_IMPORT_PATH!r} in the Serve config")
    for app in kvserve_apps:
        models = _rewrite_bundles(app)
        _key_from_environment(app)
        _pin_published_bundles(app)
        app["args"]["metrics_require_key"] = True
        stop_wait_s = _request_timeout_s(app)
        colocated = sum(1 for m in app["args"]["models"] if m.get("colocated"))
        for dep in app.get("deployments", []):
            _override_deployment(dep, engines=colocated if dep["name"] == INGRESS else int(dep["name"] in models),
                                 variant=variant)
            dep["graceful_shutdown_timeout_s"] = max(dep.get("graceful_shutdown_timeout_s", 0), stop_wait_s)
        for model in app["args"]["models"]:
            model.setdefault("engine", {})["provider"] = PROVIDER[variant]
    return out


def _rewrite_bundles(app: dict[str, Any]) -> set[str]:
    args = app.setdefault("args", {})
    args["artifacts_dir"] = IMAGE_MODELS_DIR
    names = set()
    for model in args.get("models", []):
        model["bundle"] = Path(model["bundle"]).name
        names.add(model["name"])
        if model.get("canary"):
            model["canary"]["bundle"] = Path(model["canary"]["bundle"]).name
            names.add(model["name"] + "-canary")
    return names


def _pin_published_bundles(app: dict[str, Any]) -> None:
    """`bundle_sha256` of each model (and canary) whose bundle is a published model's export, unless pinned."""
    import json

    for model in app["args"].get("models", []):
        for spec in (model, model.get("canary") or {}):
            manifest = PUBLISHED / str(spec.get("bundle", "")) / "manifest.json"
            if spec and "bundle_sha256" not in spec and manifest.is_file():
                spec["bundle_sha256"] = json.loads(manifest.read_text())["bundle"]["sha256"]


def _key_from_environment(app: dict[str, Any]) -> None:
    args = app["args"]
    if args.pop("api_key", None) is not None:
        raise ValueError(f"application {app.get('name')!r}: a plaintext args.api_key would ship in the image and the "
                         f"RayService, readable through Serve's config and REST API; set args.api_key_env instead")
    args["api_key_env"] = API_KEY_ENV


def _request_timeout_s(app: dict[str, Any]) -> float:
    limits = app["args"].get("limits") or {}
    if "request_timeout_s" not in limits:
        raise ValueError(f"application {app.get('name')!r}: set args.limits.request_timeout_s explicitly; the "
                         f"deployments' graceful_shutdown_timeout_s is derived from it")
    return limits["request_timeout_s"]


def _override_deployment(dep: dict[str, Any], engines: int, variant: Variant) -> None:
    """`engines`: how many model engines each replica of `dep` holds (an ingress with colocated models: theirs)."""
    dep.pop("num_replicas", None)
    dep["autoscaling_config"] = dict(MODEL_AUTOSCALING if engines else INGRESS_AUTOSCALING)
    opts = dep.setdefault("ray_actor_options", {})
    if dep["name"] == INGRESS and not engines:
        opts["num_cpus"] = INGRESS_NUM_CPUS
    elif not opts.get("num_cpus"):
        raise ValueError(f"deployment {dep['name']!r} asks for no CPU; on Kubernetes it could land on the head")
    if engines and variant is Variant.GPU:
        opts["num_gpus"] = min(1.0, GPU_PER_MODEL_REPLICA * engines)


def dump_serve_config(cfg: dict[str, Any]) -> str:
    """The canonical text of a Serve config (what serveConfigV2 holds)."""
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False, width=100)


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


def render_rayservice(serve_config_v2: str, template: Path = TEMPLATE) -> str:
    """The RayService manifest: the template with serveConfigV2 filled in as a YAML block scalar."""
    lines = template.read_text(encoding="utf-8").splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if PLACEHOLDER in line]
    if len(hits) != 1:
        raise ValueError(f"{template}: expected exactly one {PLACEHOLDER} line, found {len(hits)}")
    line = lines[hits[0]]
    indent = len(line) - len(line.lstrip())
    key = line.strip().split(":", 1)[0]
    lines[hits[0]] = f"{' ' * indent}{key}: |\n{_indent(serve_config_v2, indent + 2)}"
    header = ("# GENERATED by deploy/gen_rayservice.py from deploy/k8s/rayservice.template.yaml and\n"
              "# deploy/serve_config.yaml. Do not edit: edit those and run `python deploy/gen_rayservice.py`.\n")
    body = "".join(lines)
    while body.startswith("#"):  # the template's own header comment describes the template
        body = body.split("\n", 1)[1]
    return header + body


def render_cpu_patch(serve_config_v2: str) -> str:
    """A JSON 6902 patch (for the cpu kustomize overlay) that swaps in the CPU variant's serveConfigV2."""
    ops = [{"op": "replace", "path": "/spec/serveConfigV2", "value": serve_config_v2}]
    return ("# GENERATED by deploy/gen_rayservice.py (CPU variant of serveConfigV2). Do not edit.\n"
            + yaml.dump(ops, Dumper=_LiteralDumper, sort_keys=False, width=100))


class _LiteralDumper(yaml.SafeDumper):
    """Dumps multi-line strings as `|` blocks so the embedded config stays readable in review."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _str_representer)


def outputs(serve_config: Path = SERVE_CONFIG) -> dict[Path, str]:
    """Every generated file and its content."""
    cfg = load_serve_config(serve_config)
    gpu = dump_serve_config(image_serve_config(cfg, Variant.GPU))
    cpu = dump_serve_config(image_serve_config(cfg, Variant.CPU))
    image_header = ("# GENERATED by deploy/gen_rayservice.py from deploy/serve_config.yaml: the image's default\n"
                    "# Serve config (`kvserve serve --config /etc/kvserve/serve_config.yaml`). Do not edit.\n")
    return {
        DEPLOY / "k8s" / "base" / "rayservice.yaml": render_rayservice(gpu),
        DEPLOY / "k8s" / "overlays" / "cpu" / "serve-config-v2.yaml": render_cpu_patch(cpu),
        DEPLOY / "docker" / "serve_config.gpu.yaml": image_header + gpu,
        DEPLOY / "docker" / "serve_config.cpu.yaml": image_header + cpu,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    parser.add_argument("--serve-config", type=Path, default=SERVE_CONFIG, help="source Serve config")
    opts = parser.parse_args(argv)
    stale = []
    for path, text in outputs(opts.serve_config).items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not opts.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for path in stale:
        verb = "stale" if opts.check else "wrote"
        print(f"{verb}: {path.relative_to(DEPLOY.parent)}", file=sys.stderr if opts.check else sys.stdout)
    if opts.check and stale:
        print("run `python deploy/gen_rayservice.py` and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
