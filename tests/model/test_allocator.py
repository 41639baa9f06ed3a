import gc
import subprocess
import sys

import pytest
import torch

from kvreuse.model import allocator, native
from kvreuse.model.allocator import huge_pages_advisable, keep_freed_memory, long_lived_empty
from tests.conftest import mapping_flags

# In a fresh interpreter, so that no earlier allocation moved glibc's thresholds: blocks of the first sizes (MB)
# are malloc'ed, written and freed, then one of the last size; the page faults of writing that last one are
# printed.
LAST_WRITE_FAULTS = """
import ctypes, resource, sys
from kvreuse.model.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
*first, last = (int(mb) << 20 for mb in sys.argv[2:])
blocks = [libc.malloc(n) for n in first]
for block, n in zip(blocks, first):
    libc.memset(block, 1, n)
for block in blocks:
    libc.free(block)
block = libc.malloc(last)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.memset(block, 1, last)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _last_write_faults(mode: str, megabytes: list[int]) -> int:
    run = subprocess.run([sys.executable, "-c", LAST_WRITE_FAULTS, mode, *map(str, megabytes)], capture_output=True,
                         text=True, check=True)
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(not keep_freed_memory(), reason="not glibc")
@pytest.mark.parametrize("megabytes", [
    [16, 15],  # above glibc's first mmap threshold: unmapped when freed; kept on the heap, trimmed off its top
    [8] * 8 + [15],
])
def test_freed_blocks_are_reused_without_faulting_their_pages_in_again(megabytes):
    pages = (megabytes[-1] << 20) // 4096
    assert _last_write_faults("default", megabytes) > pages // 2  # glibc's defaults: fresh pages again
    assert _last_write_faults("keep", megabytes) < pages // 100


def test_the_runtime_keeps_freed_memory(make_tiny, monkeypatch):
    from kvreuse.model import runtime

    calls = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: calls.append(1))
    runtime.LayerwiseModel(make_tiny("llama"))
    assert calls


needs_huge_pages = pytest.mark.skipif(not huge_pages_advisable(), reason="Linux offers no transparent huge pages")


@needs_huge_pages
def test_long_lived_tensors_lie_apart_aligned_in_memory_advised_for_huge_pages():
    tensors = [long_lived_empty(shape, dtype) for shape, dtype in
               [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 3, 4), torch.int8), ((1000, 33), torch.float32)]]
    assert long_lived_empty((0, 4), torch.float32).shape == (0, 4)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
        assert t.is_contiguous() and t.data_ptr() % allocator.ALIGNMENT == 0 and "hg" in mapping_flags(t.data_ptr())
    assert [t.float().mean().item() for t in tensors] == [1, 2, 3, 4]  # none wrote over another
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


@needs_huge_pages
def test_a_long_lived_tensor_outlives_the_region_it_was_carved_from(monkeypatch):
    """A full region is replaced by a new mapping; the old one stays mapped as long as a tensor of it lives."""
    monkeypatch.setattr(allocator, "REGION_BYTES", allocator.HUGE_PAGE)
    monkeypatch.setattr(allocator, "_region", None)
    first = long_lived_empty((1000,), torch.float32).fill_(7)
    others = [long_lived_empty((200_000,), torch.float32).fill_(i) for i in range(4)]  # 800 KB each: new regions
    del others
    gc.collect()
    assert torch.equal(first, torch.full((1000,), 7.0))
    assert long_lived_empty((3 << 20,), torch.uint8).numel() == 3 << 20  # larger than a region: one of its own


def test_long_lived_tensors_come_from_torch_where_linux_offers_no_huge_pages(monkeypatch):
    monkeypatch.setattr(allocator, "huge_pages_advisable", lambda: False)
    t = long_lived_empty((4, 4), torch.float32)
    assert t.shape == (4, 4) and t.untyped_storage().nbytes() == 64  # its own storage, no region's


@needs_huge_pages
@pytest.mark.skipif(not native.available(), reason="no C compiler")
def test_weights_in_panels_live_in_memory_advised_for_huge_pages():
    """Every forward reads them whole from memory: a page walk for each 4 KB of them (docs/RESULTS.md)."""
    for weight in (torch.randn(96, 40), torch.randn(96, 40).bfloat16()):
        if native.panels_take(weight.dtype):
            assert "hg" in mapping_flags(native.panels(weight).data_ptr())
    assert "hg" in mapping_flags(native.int8_panels(torch.randn(96, 40)).data_ptr())
