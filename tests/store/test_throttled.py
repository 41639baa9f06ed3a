from __future__ import annotations

import time

from kvreuse.store.memory import MemoryTier
from kvreuse.store.throttled import Device, ThrottledTier


def test_view_layers_lends_the_inner_tier_s_own_tensors(make_entry):
    memory = MemoryTier(None)
    tier = ThrottledTier(memory, Device("fast", read_gbps=100.0, latency_ms=0.0))
    entry = make_entry()
    tier.put(entry)
    k, _ = tier.view_layers(entry.key, 1, 2)
    assert k.untyped_storage().data_ptr() == memory.entries[entry.key].k.untyped_storage().data_ptr()


def test_reads_take_at_least_latency_plus_size_over_bandwidth(make_entry):
    device = Device("slow", read_gbps=0.01, latency_ms=2.0)  # 10 MB/s
    tier = ThrottledTier(MemoryTier(None), device)
    entry = make_entry()  # 51.2 kB of K/V: 5.12 ms at 10 MB/s
    tier.put(entry)
    start = time.perf_counter()
    assert tier.get(entry.key) is not None
    assert time.perf_counter() - start >= 0.002 + entry.nbytes / 1e7
    start = time.perf_counter()
    tier.get_layers(entry.key, 0, 1)
    assert time.perf_counter() - start >= 0.002 + entry.nbytes / 4 / 1e7
    slept = tier.sleep_seconds
    assert tier.get(make_entry().key) is None and tier.sleep_seconds == slept  # a miss is not slowed
    stats = tier.stats()
    assert stats["emulated"] == "slow (emulated: 0.01 GB/s, 2 ms)" and stats["throttle_sleep_s"] > 0
