"""Keep a CPU training process's freed tensor memory instead of handing it back to the kernel.

PyTorch's CPU tensors come from glibc's malloc. A chunk above glibc's mmap threshold (at most
32 MiB) is its own `mmap`, and `free` unmaps it, so every step of a CPU run re-maps its big
activations (the demo's logits alone are 32 × 256 × 8,192 fp32 = 256 MiB) and takes one minor
page fault per 4 KiB page on first touch: about 350,000 faults and 0.8 s of kernel time in a
3.4 s step of `bench/training/bank_parallel.py`'s one-process run, and the fault cost grows with the
process's resident size, so a larger bank made the same step slower (docs/BENCHMARKS.md,
"Memory-parallel co-training"). With mmap turned off and the heap never trimmed, freed chunks
are reused from the second step on: zero faults per step in steady state.

The cost is that the process's resident size stays at its peak (the allocator keeps what it
freed), which a training process reaches in its first steps anyway, plus some fragmentation:
a freed chunk is reused only once it is large enough for the next (64-byte aligned) request,
so the first few re-allocations of a size may extend the heap until freed neighbours coalesce
(3-9 allocations of a lone 64 MiB tensor in tests/test_host_alloc.py; in the 4-rank training
benchmark the peak RSS per rank was 0.11-0.17 GiB above malloc's defaults). GPU runs keep the
default: their activations live in CUDA's caching allocator, not in malloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# the largest trim threshold mallopt takes (an int): the heap is never returned to the kernel
_NEVER_TRIM = 2**31 - 1

_applied = False


def retain_freed_host_memory() -> bool:
    """Tell this process's glibc malloc to serve every allocation from its heap (no per-chunk
    mmap) and never trim the heap, so freed tensor memory is reused without page faults. Applies
    to allocations made after the call. Idempotent; returns whether the setting is in force
    (False where the C library is not glibc, e.g. macOS or musl)."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    # mallopt returns 1 on success, 0 on error
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    if not ok:
        log.warning(
            "mallopt refused the retain settings; freed host memory goes back to the kernel"
        )
        return False
    _applied = True
    log.info("host allocator: freed tensor memory is kept for reuse (mmap off, no heap trim)")
    return True
