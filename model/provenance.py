"""Where a run or a measurement came from: the commit, the machine and the library versions.

Owns reading them (git, /proc/cpuinfo, installed package metadata). TORCH-FREE: the published models' manifests
(model/publish.py) and the benchmarks' reports (bench/compute.py) both record what it returns.
"""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

# The CPU features that decide which kernels run (bf16 autocast in training, int8/bf16 GEMMs in serving).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile")
TRAIN_PACKAGES = ("torch", "numpy", "tokenizers", "safetensors", "sacrebleu")


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The flags of CPU_FLAGS this CPU has, in that order."""
    have = set((_cpuinfo_field("flags") or "").split())
    return [f for f in CPU_FLAGS if f in have]


def package_versions(names: tuple[str, ...] = TRAIN_PACKAGES) -> dict[str, str]:
    """Installed versions of `names` (those not installed are left out), and Python's."""
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit(repo: Path | None = None) -> str | None:
    """The checked-out commit of the repository holding this code, with "-dirty" when tracked files differ
    from it; None outside a git checkout (an sdist, an image)."""
    root = repo or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def machine() -> dict[str, object]:
    """The machine a run used: CPU model and flags, logical CPUs, the platform."""
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "logical_cpus": os.cpu_count(),
            "platform": f"{platform.system()} {platform.machine()}"}
