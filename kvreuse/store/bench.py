"""Measure each tier's real read/write bandwidth and per-entry latency on this machine.

The figures feed the restoration controllers (which need a tier's bandwidth to split work between loading
and recomputing). Every throttled tier is reported as emulated: its figures come from the device model.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvreuse.store.base import KVStore
from kvreuse.store.disk import DiskTier
from kvreuse.store.entry import EntryMeta, KVEntry, dtype_name
from kvreuse.store.keys import KeySpace, chunk_key
from kvreuse.store.memory import MemoryTier
from kvreuse.store.redis import RedisTier
from kvreuse.store.redis_server import LocalRedis
from kvreuse.store.throttled import DEVICES, ThrottledTier

SPARSE_SHARE = 0.85  # CacheTune's sparse transfer at r = 15%: load the other 85% of rows


@dataclass(frozen=True)
class EntryShape:
    layers: int = 30  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    tokens: int = 256  # one prefix block
    heads: int = 3
    head_dim: int = 64
    dtype: str = "bfloat16"


@dataclass
class BenchResult:
    tier: str
    note: str  # how it was measured; "EMULATED" for throttled tiers
    write_gbps: float
    read_gbps: float
    get_ms: float  # median latency of one whole-entry get (read_gbps is the entry's bytes over it)
    layer_ms: float  # median latency of get_layers for one layer
    rows_ms: float  # median latency of get_rows for SPARSE_SHARE of the rows, all layers


def make_entries(shape: EntryShape, count: int) -> list[KVEntry]:
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    space = KeySpace("bench-model", "bench-tokenizer", salt=f"bench-{time.time_ns()}")
    dims = (shape.layers, shape.tokens, shape.heads, shape.head_dim)
    return [
        KVEntry(chunk_key([i], space), torch.randn(*dims, generator=gen).to(dtype),
                torch.randn(*dims, generator=gen).to(dtype),
                EntryMeta("bench-model", dtype_name(dtype), shape.layers, shape.tokens))
        for i in range(count)
    ]


def drop_page_cache(tier: KVStore) -> None:
    """Evict a disk tier's files from the page cache (fadvise DONTNEED: only these files, no root needed)."""
    inner = getattr(tier, "inner", tier)
    if isinstance(inner, DiskTier):
        for path in Path(inner.root).rglob("*.safetensors"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    if not fn():
        raise RuntimeError("a benchmark operation failed: a write was refused or a read missed")
    return time.perf_counter() - start


def bench_tier(tier: KVStore, entries: list[KVEntry], label: str, note: str, *, cold: bool = False) -> BenchResult:
    """Write `entries` one by one, then read them whole, one layer each, and 85% of their rows; `cold` drops
    the page cache before each read phase. Every figure is a median over the entries (GB/s: entry bytes over
    the median time), so a stall caused by other work on the machine moves it little. Clears what it wrote."""
    rows = torch.randperm(entries[0].meta.num_tokens)[: int(entries[0].meta.num_tokens * SPARSE_SHARE)]

    def phase(op: Callable[[KVEntry], object]) -> float:
        if cold:
            drop_page_cache(tier)
        return statistics.median(_timed(functools.partial(op, e)) for e in entries)

    put_s = phase(tier.put)
    get_s = phase(lambda e: tier.get(e.key))
    layer_s = phase(lambda e: tier.get_layers(e.key, 0, 1))
    rows_s = phase(lambda e: tier.get_rows(e.key, rows))
    for e in entries:
        tier.delete(e.key)
    size = entries[0].nbytes
    return BenchResult(label, note, size / put_s / 1e9, size / get_s / 1e9, get_s * 1e3, layer_s * 1e3, rows_s * 1e3)


def bench_all_tiers(entries: list[KVEntry], directory: str | None, redis: str, emulate: list[str]
                    ) -> list[BenchResult]:
    """Every tier kind on this machine: memory; disk with the page cache warm and cold, and its int8 form (in
    `directory`, default a temporary one under /var/tmp); Redis ('auto': a private redis-server on loopback, a URL,
    or 'none'); and the `emulate` devices over memory, labelled EMULATED."""
    results: list[BenchResult] = []
    with contextlib.ExitStack() as stack:
        root = directory or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvreuse-bench-", dir="/var/tmp"))
        disk = DiskTier(os.path.join(root, "store"))
        results.append(bench_tier(MemoryTier(None), entries, "memory", "measured"))
        results.append(bench_tier(disk, entries, "disk", f"measured, page cache warm ({root})"))
        results.append(bench_tier(disk, entries, "disk", "measured, page cache cold (fadvise DONTNEED)", cold=True))
        int8 = DiskTier(os.path.join(root, "int8"), quantize=True)
        results.append(bench_tier(int8, entries, "disk int8", "measured, page cache warm; lossy 8-bit form"))
        if redis != "none":
            url = stack.enter_context(LocalRedis()).url if redis == "auto" else redis
            redis_tier = RedisTier(url, prefix="kvreuse-bench")
            results.append(bench_tier(redis_tier, entries, "redis", f"measured ({url})"))
            redis_tier.close()
        for name in emulate:
            device = DEVICES[name]
            tier = ThrottledTier(MemoryTier(None), device)
            results.append(bench_tier(tier, entries, f"{name} (emulated)",
                                      f"EMULATED over memory: {device.read_gbps:g} GB/s, {device.latency_ms:g} ms"))
    return results
