"""A request's own KV cache: an allocation past its capacity that cannot grow it leaves it as it was."""

from __future__ import annotations

import pytest
import torch

from kvreuse.model.kv_cache import KVCache
from tests.conftest import out_of_memory_after


def test_a_growth_that_fails_part_way_leaves_the_cache_as_it_was(monkeypatch):
    """Memory running out as the values are allocated, after the keys, must not leave grown keys beside old values
    (a cache whose layers disagree)."""
    cache = KVCache(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, capacity=4)
    cache.allocate(torch.arange(4))
    tensors = cache.keys + cache.values + [cache.positions]
    monkeypatch.setattr(KVCache, "_grown", out_of_memory_after(KVCache._grown, lambda cache: cache.num_layers))
    with pytest.raises(RuntimeError, match="not enough memory"):
        cache.allocate(torch.arange(4, 6))
    assert cache.length == 4 and cache.capacity == 4
    assert all(a is b for a, b in zip(cache.keys + cache.values, tensors))
    assert torch.equal(cache.positions, torch.arange(4))
