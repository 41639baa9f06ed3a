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

A model's packed weights (`long_lived_empty`) are read whole by every forward, from memory past a few layers: in
pages of 4 KB each of a panel's pages costs its first row tile a page walk and the prefetchers stop at every page's
end, which few rows cannot hide behind their sums. They live in mappings advised for transparent huge pages
(`MADV_HUGEPAGE`, which Linux's default THP setting "madvise" waits for). The `kvreuse` command's heap is advised
as well, by glibc itself (`kvreuse.model.huge_pages`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import threading
from dataclasses import dataclass

import torch

from kvreuse.model.huge_pages import HUGE_PAGE, huge_pages_advisable

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


# Long-lived tensors are carved from mappings of at least this much: huge pages filled end to end, a region unmapped
# once none of its tensors lives.
REGION_BYTES = 64 << 20
ALIGNMENT = 64  # a cache line: each tensor starts on one


@dataclass
class _Region:
    memory: torch.Tensor  # uint8, from the mapping's first huge-page boundary; holds the mapping while it lives
    used: int = 0


_region: _Region | None = None
_region_lock = threading.Lock()


def long_lived_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for data kept as long as the model (its packed weights), in memory advised for
    transparent huge pages where Linux offers them (else torch.empty's)."""
    global _region
    nbytes = max(1, torch.Size(shape).numel()) * dtype.itemsize  # an empty tensor still views one element
    if not huge_pages_advisable():
        return torch.empty(shape, dtype=dtype)
    with _region_lock:
        start = -(-(_region.used if _region else 0) // ALIGNMENT) * ALIGNMENT
        if _region is None or start + nbytes > _region.memory.numel():
            _region, start = _Region(_huge_page_mapping(max(nbytes, REGION_BYTES))), 0
        _region.used = start + nbytes
        return _region.memory[start : start + nbytes].view(dtype)[: torch.Size(shape).numel()].view(shape)


def _huge_page_mapping(nbytes: int) -> torch.Tensor:
    """An anonymous mapping of `nbytes` rounded up to huge pages, advised for them, as a uint8 tensor from its
    first huge-page boundary (the tensor keeps the mapping alive; its unused head is never touched)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    head = -whole.data_ptr() % HUGE_PAGE
    return whole[head : head + size]
