"""Render deploy/k8s kustomizations: with the real kustomize when it is installed, else a small Python subset.

kustomize (`kustomize build` or `kubectl kustomize`) is the renderer users run. Where neither is installed
(a bare CI machine), `render_lite` renders the subset of kustomize that deploy/k8s uses, and nothing more:
`resources` (files and directories), `components`, `namespace`, `images`, and `patches` given as JSON 6902
operation lists (add / remove / replace) with a `target`. Anything else (strategic-merge patches, labels,
generators) raises `Unsupported` naming the field, so the subset can never silently diverge from kustomize.
Where both exist, tests/test_deploy.py checks that they render the same objects.

Not here: validating what is rendered (deploy/validate.py).
"""
from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED = {"apiVersion", "kind", "resources", "components", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                  "PersistentVolume", "StorageClass", "PriorityClass"}

Doc = dict[str, Any]


class Unsupported(ValueError):
    """A kustomization uses a feature outside this module's subset."""


def kustomize_command() -> list[str] | None:
    """The real renderer's command line, or None: `kustomize build`, else `kubectl kustomize`."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        probe = subprocess.run(["kubectl", "kustomize", "--help"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return ["kubectl", "kustomize"]
    return None


def render_kustomize(directory: Path, command: list[str]) -> list[Doc]:
    """Render with the real kustomize."""
    done = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} {directory} failed: {done.stderr.strip()}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def render(directory: Path) -> tuple[list[Doc], str]:
    """Render with real kustomize if installed, else the Python subset; also says which one ran."""
    command = kustomize_command()
    if command:
        return render_kustomize(directory, command), " ".join(command)
    return render_lite(directory), "kustomize_lite"


def render_lite(directory: Path) -> list[Doc]:
    """Render a kustomization directory with the Python subset."""
    kust = _load_kustomization(directory, expect_kind="Kustomization")
    docs: list[Doc] = []
    for entry in kust.get("resources", []):
        docs.extend(_load_resource(directory / entry))
    for entry in kust.get("components", []):
        docs = _apply_component(directory / entry, docs)
    return _apply_transformers(directory, kust, docs)


def _load_kustomization(directory: Path, expect_kind: str) -> Doc:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            kust = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            break
    else:
        raise FileNotFoundError(f"no kustomization file in {directory}")
    unsupported = set(kust) - SUPPORTED
    if unsupported:
        raise Unsupported(f"{path}: fields {sorted(unsupported)} are outside kustomize_lite's subset "
                          f"{sorted(SUPPORTED)}; render with kustomize instead")
    kind = kust.get("kind", "Kustomization")
    if kind != expect_kind:
        raise Unsupported(f"{path}: expected kind {expect_kind}, got {kind}")
    return kust


def _load_resource(path: Path) -> list[Doc]:
    if path.is_dir():
        return render_lite(path)
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _apply_component(directory: Path, docs: list[Doc]) -> list[Doc]:
    comp = _load_kustomization(directory, expect_kind="Component")
    docs = [*docs, *(d for entry in comp.get("resources", []) for d in _load_resource(directory / entry))]
    return _apply_transformers(directory, comp, docs)


def _apply_transformers(directory: Path, kust: Doc, docs: list[Doc]) -> list[Doc]:
    docs = copy.deepcopy(docs)
    for patch in kust.get("patches", []):
        ops, target = _load_patch(directory, patch)
        hits = [d for d in docs if _matches(d, target)]
        if not hits:
            raise ValueError(f"{directory}: patch target {target} matches no resource")
        for doc in hits:
            for op in ops:
                apply_json_patch_op(doc, op)
    if "namespace" in kust:
        for doc in docs:
            if doc.get("kind") not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = kust["namespace"]
    for image in kust.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    return docs


def _load_patch(directory: Path, patch: Doc) -> tuple[list[Doc], Doc]:
    if set(patch) - {"path", "patch", "target"}:
        raise Unsupported(f"{directory}: patch fields {sorted(set(patch) - {'path', 'patch', 'target'})}")
    text = (directory / patch["path"]).read_text(encoding="utf-8") if "path" in patch else patch["patch"]
    ops = yaml.safe_load(text)
    if not isinstance(ops, list) or "target" not in patch:
        raise Unsupported(f"{directory}: only JSON 6902 patches (an operation list with a target) are supported")
    return ops, patch["target"]


def _matches(doc: Doc, target: Doc) -> bool:
    group, _, version = doc.get("apiVersion", "").rpartition("/")
    want = {"group": group, "version": version, "kind": doc.get("kind"), "name": doc["metadata"].get("name")}
    return all(want[k] == v for k, v in target.items() if k in want) and set(target) <= set(want)


def _split_pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_json_patch_op(doc: Doc, op: Doc) -> None:
    """Apply one RFC 6902 add / remove / replace operation in place."""
    kind = op.get("op")
    if kind not in ("add", "remove", "replace"):
        raise Unsupported(f"JSON patch op {kind!r} (only add, remove, replace)")
    *parents, last = _split_pointer(op["path"])
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(index, copy.deepcopy(op["value"]))
            return
        node[index]  # noqa: B018 -- raises IndexError like kustomize's "path not found"
        if kind == "remove":
            del node[index]
        else:
            node[index] = copy.deepcopy(op["value"])
        return
    if kind != "add" and last not in node:
        raise KeyError(f"JSON patch {kind} {op['path']}: no such field")
    if kind == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(op["value"])


def _set_image(node: Any, image: Doc) -> None:
    if isinstance(node, list):
        for item in node:
            _set_image(item, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                container["image"] = _new_image(container.get("image", ""), image)
        else:
            _set_image(value, image)


def _new_image(current: str, image: Doc) -> str:
    name, tag = current, None
    if "@" in name:
        name = name.split("@", 1)[0]
    elif ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    if name != image["name"]:
        return current
    new = image.get("newName", name)
    if "digest" in image:
        return f"{new}@{image['digest']}"
    tag = image.get("newTag", tag)
    return f"{new}:{tag}" if tag else new
