"""model/cpu_memory.py: glibc's malloc keeps freed memory, so repeated large tensors stop faulting pages in."""
import platform
import subprocess
import sys

import pytest

from model.cpu_memory import keep_freed_memory

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the setting is glibc's")

PAGE_FAULTS = """
import resource, sys, torch
from model.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # a training step's pattern: many large tensors alive at once, then all freed
    xs = [torch.ones(2 << 20) for _ in range(16)]  # 16 x 8 MiB
    del xs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PAGE_FAULTS, mode], capture_output=True, text=True, check=True)
    return float(out.stdout)


@glibc
def test_glibc_accepts_the_settings():
    assert keep_freed_memory() is True  # mallopt refuses values out of its range (e.g. a 64 MiB mmap threshold)


@glibc
def test_freed_memory_is_kept_for_the_next_step():
    default, kept = faults_per_step("default"), faults_per_step("keep")
    # 128 MiB are 32k pages; glibc's defaults hand much of it back and fault it in again every step
    assert default > 3000
    assert kept < 0.6 * default, (kept, default)
