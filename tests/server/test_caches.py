"""The context-cache registry: ids by tenant and tokens, bounded to the caches used last."""

from kvreuse.server.caches import CacheRegistry, cache_id


def test_the_registry_keeps_the_caches_used_last():
    """Clients create caches at will, under any number of tenants (600 caches of 8000 tokens took 270 MB)."""
    registry = CacheRegistry(max_caches=3)
    a, b, c = (registry.add([i, i + 1], f"tenant-{i}", [f"key{i}"]) for i in range(3))
    assert registry.get(a.id, "tenant-0") == a  # used: b is now the oldest
    d = registry.add([7, 8], None, ["key7"])
    assert registry.get(b.id, "tenant-1") is None
    assert [registry.get(x.id, x.salt) for x in (a, c, d)] == [a, c, d]
    assert registry.add([1, 2], "tenant-1", []).id == b.id  # created again: the same id
    assert a.token_ids.itemsize == 4 and list(a.token_ids) == [0, 1]


def test_an_id_is_the_tenants_alone():
    registry = CacheRegistry()
    cache = registry.add([5, 6, 7], "acme", ["k"])
    assert cache.id == cache_id([5, 6, 7], "acme") != cache_id([5, 6, 7], None)
    assert registry.get(cache.id, None) is None and registry.remove(cache.id, "other") is None
    assert registry.remove(cache.id, "acme") == cache and registry.get(cache.id, "acme") is None
