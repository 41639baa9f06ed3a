import subprocess
import sys

import pytest

from kvreuse.model.allocator import keep_freed_memory

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
