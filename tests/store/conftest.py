"""Store test fixtures: small entries, and every tier kind behind one factory so one contract suite runs on all."""

from __future__ import annotations

import itertools
import uuid
from typing import Callable

import pytest
import torch

from kvreuse.store.base import KVStore
from kvreuse.store.disk import DiskTier
from kvreuse.store.entry import EntryMeta, KVEntry, dtype_name
from kvreuse.store.keys import KeySpace, chunk_key
from kvreuse.store.memory import MemoryTier
from kvreuse.store.redis import RedisTier
from kvreuse.store.throttled import Device, ThrottledTier
from kvreuse.store.tiered import TieredStore

SPACE = KeySpace("test-model/float32", "test-tokenizer")
# Fast enough to keep the suite quick, slow enough that the wrapper really sleeps on every read.
TEST_DEVICE = Device("test", read_gbps=20.0, latency_ms=0.05)
_seeds = itertools.count()


def _make_entry(key: str | None = None, *, layers: int = 4, tokens: int = 100, heads: int = 2, dim: int = 16,
               dtype: torch.dtype = torch.float32, model: str = "test-model", extras: bool = False) -> KVEntry:
    """A random entry (100 tokens: two checksum row groups, the second one partial)."""
    seed = next(_seeds)
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(layers, tokens, heads, dim, generator=gen).to(dtype) for _ in range(2))
    meta = EntryMeta(model, dtype_name(dtype), layers, tokens)
    if extras:
        meta.ranking = torch.rand(tokens, generator=gen)
        meta.boundary = torch.randn(2, tokens, 8, generator=gen).to(dtype)
        meta.boundary_layers = [0, layers // 2]
    return KVEntry(key or chunk_key([seed, 1, 2, 3], SPACE), k, v, meta)


@pytest.fixture
def make_entry() -> Callable[..., KVEntry]:
    return _make_entry


TierMaker = Callable[..., KVStore]


def _tier_maker(request, tmp_path) -> TierMaker:
    """make(**expect) -> a tier of kind request.param; tiers made in one test share one backing store."""
    kind = request.param
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    made: list[KVStore] = []

    def redis_url() -> str:
        return request.getfixturevalue("redis_server").url

    def make(**expect: str | None) -> KVStore:
        tier: KVStore
        if kind == "memory":
            tier = MemoryTier(64 << 20, **expect)
        elif kind == "disk":
            tier = DiskTier(tmp_path / "disk", **expect)
        elif kind == "redis":
            tier = RedisTier(redis_url(), prefix=prefix, part_size=8192, **expect)  # multi-part entries
        elif kind == "throttled":
            tier = ThrottledTier(MemoryTier(64 << 20, **expect), TEST_DEVICE)
        else:
            tier = TieredStore([MemoryTier(64 << 20, **expect), DiskTier(tmp_path / "disk", **expect),
                                RedisTier(redis_url(), prefix=prefix, **expect)])
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.clear()
        tier.close()


@pytest.fixture(params=["memory", "disk", "redis", "throttled", "tiered"])
def tier_maker(request, tmp_path) -> TierMaker:
    """Every kind: the contract suite runs on each."""
    yield from _tier_maker(request, tmp_path)


@pytest.fixture(params=["disk", "redis"])
def blob_tier_maker(request, tmp_path) -> TierMaker:
    """The tiers that keep bytes, where bytes can be damaged."""
    yield from _tier_maker(request, tmp_path)


@pytest.fixture
def tier(tier_maker: TierMaker) -> KVStore:
    return tier_maker()
