"""Keep freed memory in the process for the next training step (glibc's malloc, Linux).

A training step allocates and frees the same large tensors every time (activations, logits, gradients).
With glibc's defaults, memory freed at the top of the heap above 128 KiB (adjusted upward as it goes, up to
twice the mmap threshold) is given back to the kernel, and blocks above the mmap threshold get their own
mapping, unmapped when freed; either way the next step's tensors fault their pages in again, which costs
12-15% of a step (measured: docs/decisions/training-step-cost.md).

`keep_freed_memory()` pins the thresholds for the rest of the process: blocks up to 32 MiB (glibc's largest
mmap threshold on 64-bit) come from the heap, and the heap is trimmed only when 2 GiB are free at its top. The
memory a process holds is then about its peak, which for training is what it needs anyway. It does nothing
off glibc; under a preloaded allocator (jemalloc, tcmalloc) glibc accepts the settings but they do not apply.
"""
from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # 32 MiB on 64-bit, glibc's cap


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module docstring). True if it was set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    settings = {M_MMAP_THRESHOLD: MMAP_THRESHOLD_MAX, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 64 << 20}
    return all(libc.mallopt(param, value) == 1 for param, value in settings.items())
