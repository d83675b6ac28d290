"""The gpu check's pytest step: the `gpu`-marked tests (the CUDA paths of the runtime), run as a subprocess.

They skip themselves without a GPU, so on `--device cpu` they are collected and skipped (which checks that
they still import and collect); on `--device cuda` at least one must run and none may fail. The counts come
from pytest's JUnit XML, kept as OUT/gpu_tests.xml.
"""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.gpu_check.plan import Step

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ("tests/test_runtime_cuda.py",)


def counts(junit: Path) -> dict[str, int]:
    """tests, failures, errors, skipped (summed over the XML's test suites)."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def run(step: Step, device: str, out: Path) -> None:
    junit = out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *GPU_TESTS]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    step.data.update(command=" ".join(cmd[1:]), exit_status=proc.returncode,
                     output_tail=proc.stdout.strip().splitlines()[-15:])
    if not junit.is_file():
        step.check("gpu_tests", False)
        step.reason = f"pytest wrote no report (exit status {proc.returncode}): {proc.stderr.strip()[-500:]}"
        return
    c = counts(junit)
    step.data["counts"] = c
    ran = c["tests"] - c["skipped"]
    passed = c["failures"] == 0 and c["errors"] == 0 and (ran > 0 if device == "cuda" else True)
    if device == "cpu":
        step.data["note"] = "no GPU: the gpu tests were collected and skipped"
    step.check("gpu_tests", passed)
