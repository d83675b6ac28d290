"""model/cpu_memory.py: glibc's malloc keeps freed memory, so repeated large tensors stop faulting pages in."""
import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the setting is glibc's")

ACCEPTS = "from model.cpu_memory import keep_freed_memory; print(keep_freed_memory())"
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


def run(code: str, *args: str) -> str:
    """In a child with glibc's malloc as it comes (the settings last for a whole process)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


@glibc
def test_glibc_accepts_the_settings():
    assert run(ACCEPTS) == "True"  # mallopt refuses values out of its range (e.g. a 64 MiB mmap threshold)


@glibc
def test_freed_memory_is_kept_for_the_next_step():
    default = float(run(PAGE_FAULTS, "default"))
    if default < 3000:  # e.g. transparent huge pages always on: faults per 2 MiB, nothing left to save
        pytest.skip(f"glibc's defaults fault only {default:.0f} pages per step here")
    kept = float(run(PAGE_FAULTS, "keep"))
    # 128 MiB are 32k pages; glibc's defaults hand much of it back and fault it in again every step
    assert kept < 0.6 * default, (kept, default)
