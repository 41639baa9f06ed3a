"""How the process keeps the memory requests free, so that the next request does not fault it in again.

A request's buffers are freed when it ends: its KV cache (two tensors a layer, 1.5 MB each for SmolLM2 at 2K
tokens) and the products' outputs (up to 25 MB). glibc's malloc returns buffers above its mmap threshold (128 KB
at start, moved up to the largest one freed) to the kernel, and trims its heap's free top; the next request's
buffers then come back as fresh pages, each one faulted in and zeroed by the kernel as the kernels first write it.
On a 2-core Zen 4 EPYC (SmolLM2, fp32, 2K-token hotpotqa prompts) that was 15-52 thousand page faults per full
prefill and 10-13 thousand per CacheBlend one; placing stored KV into a cache layer whose pages fault in took 0.9
ms instead of 0.2. Kept, there were none, and full prefill took 2895 / 2860 ms instead of 3069 / 2908 (two runs),
CacheBlend 716 / 696 instead of 764 / 715 (docs/RESULTS.md, "Products of up to 1024 rows in panels, freed memory
kept mapped, ..."). A server holds its peak memory anyway, as vLLM does with its preallocated KV blocks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Buffers up to this size come from the heap: glibc's largest mmap threshold on 64-bit (HEAP_MAX / 2). Larger ones
# are still mapped and unmapped each time; the MLP's outputs, the largest, come in passes of 24 MB
# (adapters.MLP_PASS_BYTES).
MMAP_THRESHOLD = 32 << 20
# The heap's free top is returned to the kernel only past this.
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed buffers of up to MMAP_THRESHOLD for the next allocations, and the heap's
    free top up to TRIM_THRESHOLD: once per process. False where the C library is not glibc (nothing is changed)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc's own: other C libraries' mallopt, if any, takes other parameters
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
