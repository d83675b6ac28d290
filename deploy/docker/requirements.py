#!/usr/bin/env python3
"""Print the serving image's pip requirements from pyproject.toml: the base dependencies plus the `serve`
extra, with Ray and ONNX Runtime pinned and, for the GPU image, `onnxruntime` swapped for `onnxruntime-gpu`.

Why a script: the two ONNX Runtime wheels install the same `onnxruntime` module and must never sit side by
side, and the image installs dependencies in a layer of their own (cached while only code changes), so
it needs them as a list before the package itself is installed with `--no-deps`. Reading pyproject keeps
that list from drifting. Never emits torch (a test checks): the serving side does not need it.

Usage (in deploy/docker/Dockerfile.*):  python requirements.py pyproject.toml --ray 2.60.0 \
    --onnxruntime-gpu 1.31.1  > requirements.txt
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib  # Python 3.11+ (the images run 3.12)
except ModuleNotFoundError:  # pragma: no cover -- Python 3.10
    import tomli as tomllib

EXTRA = "serve"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if not match:
        raise ValueError(f"cannot read a package name from requirement {requirement!r}")
    return match.group(1).lower().replace("_", "-")


def serve_requirements(pyproject: Path, ray: str, onnxruntime: str | None = None,
                       onnxruntime_gpu: str | None = None) -> list[str]:
    """Base + `serve` requirements with the pins applied; exactly one ONNX Runtime version must be given."""
    if (onnxruntime is None) == (onnxruntime_gpu is None):
        raise ValueError("give exactly one of onnxruntime (CPU image) or onnxruntime_gpu (GPU image)")
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    if EXTRA not in extras:
        raise ValueError(f"{pyproject}: no [project.optional-dependencies] {EXTRA!r} extra")
    out: list[str] = []
    for req in [*project.get("dependencies", []), *extras[EXTRA]]:
        name = _name(req)
        if name == "torch":
            raise ValueError(f"{pyproject}: the {EXTRA!r} extra must not need torch, found {req!r}")
        if name == "ray":
            req = f"ray[serve]=={ray}"
        elif name == "onnxruntime":
            req = f"onnxruntime-gpu=={onnxruntime_gpu}" if onnxruntime_gpu else f"onnxruntime=={onnxruntime}"
        out.append(req)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the serving image's pip requirements.")
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--ray", required=True, help="Ray version (must match the RayService's rayVersion)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--onnxruntime", help="CPU image: onnxruntime version")
    group.add_argument("--onnxruntime-gpu", help="GPU image: onnxruntime-gpu version")
    opts = parser.parse_args(argv)
    reqs = serve_requirements(opts.pyproject, opts.ray, opts.onnxruntime, opts.onnxruntime_gpu)
    sys.stdout.write("".join(r + "\n" for r in reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
