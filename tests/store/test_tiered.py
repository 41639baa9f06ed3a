"""The tiered store: write-back off the critical path, promotion, demotion, dedup, scan resistance."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from kvreuse.store.disk import DiskTier
from kvreuse.store.memory import MemoryTier
from kvreuse.store.spec import open_store
from kvreuse.store.tiered import TieredStore


class GatedTier(MemoryTier):
    """A tier whose writes block until the test opens the gate, like a disk that is very slow."""

    writes_are_cheap = False

    def __init__(self):
        super().__init__(None)
        self.gate = threading.Event()

    def put(self, entry, *, handed_over=False):
        self.gate.wait(timeout=10)
        return super().put(entry, handed_over=handed_over)


@pytest.fixture
def mem_disk(tmp_path):
    memory, disk = MemoryTier(64 << 20), DiskTier(tmp_path)
    store = TieredStore([memory, disk])
    yield store, memory, disk
    store.close()


def test_put_never_waits_for_a_slow_tier(make_entry):
    memory, slow = MemoryTier(None), GatedTier()
    store = TieredStore([memory, slow])
    entry = make_entry()
    start = time.perf_counter()
    store.put(entry)
    assert time.perf_counter() - start < 1.0
    assert memory.contains(entry.key) and not slow.contains(entry.key)
    slow.gate.set()
    store.flush()
    assert slow.contains(entry.key)
    store.close()


def test_full_write_back_queue_drops_writes_instead_of_blocking(make_entry):
    slow = GatedTier()
    store = TieredStore([MemoryTier(None), slow], queue_size=1)
    for _ in range(4):
        store.put(make_entry())
    assert store.stats()["writeback_dropped"] >= 2
    slow.gate.set()
    store.close()


def test_write_back_drops_writes_past_its_bytes(make_entry):
    slow, entries = GatedTier(), [make_entry() for _ in range(5)]
    store = TieredStore([MemoryTier(None), slow], queue_bytes=int(2.5 * entries[0].nbytes))
    for entry in entries:
        store.put(entry)
    assert store.stats()["writeback_queued"] == 2 and store.stats()["writeback_dropped"] == 3
    slow.gate.set()
    store.flush()
    assert [slow.contains(e.key) for e in entries] == [True, True, False, False, False]
    assert store.put(entries[2]) and (store.flush() or slow.contains(entries[2].key))  # room again
    store.close()


def test_get_promotes_from_a_lower_tier(mem_disk, make_entry):
    store, memory, disk = mem_disk
    entry = make_entry()
    store.put(entry)
    store.flush()
    memory.delete(entry.key)
    assert store.locate(entry.key) == 1 and store.locate(make_entry().key) is None
    got = store.get(entry.key)
    assert torch.equal(got.k, entry.k) and store.stats()["hits_by_tier"] == [0, 1]
    assert memory.contains(entry.key) and store.stats()["promotions"] == 1
    got.k.zero_()  # the caller's copy is not the promoted one
    assert torch.equal(store.get(entry.key).k, entry.k) and store.stats()["hits_by_tier"] == [1, 1]


def test_an_entry_larger_than_a_tier_is_not_promoted_into_it(tmp_path, make_entry, caplog):
    """Each hit below would otherwise try, and log the tier's refusal, again."""
    entry = make_entry()
    memory, disk = MemoryTier(entry.nbytes - 1), DiskTier(tmp_path)
    store = TieredStore([memory, disk])
    try:
        store.put(entry, tier=1)
        store.flush()
        for _ in range(3):
            assert torch.equal(store.get(entry.key).k, entry.k)
            store.flush()
        assert memory.stats()["write_errors"] == 0 and "exceed the tier's capacity" not in caplog.text
        assert store.stats()["hits_by_tier"] == [0, 3] and store.stats()["promotions"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("read", [lambda s, key: s.get_layers(key, 1, 2), lambda s, key: s.view_layers(key, 1, 2),
                                  lambda s, key: s.get_rows(key, [3, 4])])
def test_partial_hit_below_promotes_in_the_background(mem_disk, make_entry, read):
    store, memory, disk = mem_disk
    entry = make_entry()
    store.put(entry)
    store.flush()
    memory.delete(entry.key)
    assert read(store, entry.key) is not None
    store.flush()
    assert memory.contains(entry.key) and store.stats()["promotions"] == 1


def test_evicted_entries_are_demoted(tmp_path, make_entry):
    entries = [make_entry() for _ in range(3)]
    memory, disk = MemoryTier(2 * entries[0].nbytes), DiskTier(tmp_path)
    store = TieredStore([memory, disk])
    for e in entries:  # straight into memory: only demotion can bring them to disk
        memory.put(e)
    store.flush()
    assert not memory.contains(entries[0].key) and disk.contains(entries[0].key)
    assert not disk.contains(entries[2].key) and store.stats()["demotions"] == 1
    store.close()


def test_same_content_is_written_once(mem_disk, make_entry):
    store, memory, disk = mem_disk
    entry = make_entry()
    for _ in range(3):
        store.put(entry)
    store.flush()
    assert disk.stats()["puts"] == 1 and memory.stats()["puts"] == 1
    assert len(list(disk.root.rglob("*.safetensors"))) == 1


def test_a_burst_of_one_off_chunks_does_not_flush_hot_chunks(tmp_path, make_entry):
    size = make_entry().nbytes
    memory = MemoryTier(10 * size)
    store = TieredStore([memory, DiskTier(tmp_path)])
    hot = [make_entry() for _ in range(4)]
    for e in hot:
        store.put(e)
        store.get(e.key)
    for _ in range(50):  # RAG traffic: chunks seen once
        store.put(make_entry())
    store.flush()
    before = store.stats()["hits_by_tier"][0]
    assert all(store.get(e.key) is not None for e in hot)
    assert store.stats()["hits_by_tier"][0] - before == 4  # all served from memory
    store.close()


def test_store_needs_a_tier():
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])


def test_bad_put_fails_at_the_call_even_for_background_tiers(tmp_path, make_entry):
    store = TieredStore([DiskTier(tmp_path, model_fingerprint="model-a")])
    with pytest.raises(ValueError, match="model-a"):
        store.put(make_entry(model="model-b"))
    store.close()


def test_concurrent_use_never_returns_wrong_kv(tmp_path, make_entry):
    entries = [make_entry() for _ in range(8)]
    store = TieredStore([MemoryTier(3 * entries[0].nbytes), DiskTier(tmp_path)])  # evictions under way
    wrong: list[str] = []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for step in range(40):
            e = entries[int(torch.randint(len(entries), (1,), generator=gen))]
            if step % 3 == 0:
                store.put(e)
            elif (got := store.get(e.key)) is not None and not torch.equal(got.k, e.k):
                wrong.append(e.key)
            elif (kv := store.get_rows(e.key, [7, 80], range(1, 3))) is not None and not torch.equal(
                    kv[1], e.v[1:3][:, [7, 80]]):
                wrong.append(e.key)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    assert wrong == []
    stored = [e for e in entries if store.contains(e.key)]
    assert all(torch.equal(store.get(e.key).v, e.v) for e in stored) and stored
    store.close()


def test_close_is_idempotent_and_final(tmp_path, make_entry):
    store = TieredStore([MemoryTier(None), DiskTier(tmp_path)])
    store.put(make_entry())
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(make_entry())


@pytest.mark.timeout(30)
def test_a_read_after_close_queues_no_background_work_a_flush_would_wait_for(tmp_path, make_entry):
    entry = make_entry()
    memory, disk = MemoryTier(None), DiskTier(tmp_path)
    store = TieredStore([memory, disk])
    store.put(entry, tier=1)
    store.close()
    assert store.get_layers(entry.key, 1, 2) is not None  # a hit below: would queue its promotion
    store.flush()
    assert store.delete(entry.key) and not memory.contains(entry.key)


def test_a_probe_walks_the_tiers_once_and_asks_a_tier_only_for_keys_not_found_above(mem_disk, make_entry,
                                                                                  monkeypatch):
    store, memory, disk = mem_disk
    top, below, both = make_entry(extras=True), make_entry(), make_entry()
    for entry in (top, below, both):
        store.put(entry)
    store.flush()
    memory.delete(below.key)
    asked = {"memory": [], "disk": []}
    for name, tier in (("memory", memory), ("disk", disk)):
        original = tier.meta
        monkeypatch.setattr(tier, "meta", lambda key, extras=False, original=original, name=name:
                            asked[name].append(key) or original(key, extras))
    nowhere = make_entry().key
    found = store.probe([top.key, below.key, both.key, nowhere, top.key], with_extras=True)
    assert {key: hit.tier for key, hit in found.items()} == {top.key: 0, below.key: 1, both.key: 0}
    assert torch.equal(found[top.key].meta.ranking, top.meta.ranking)  # extras read where asked
    assert sorted(asked["memory"]) == sorted([top.key, below.key, both.key, nowhere])  # each key once
    assert sorted(asked["disk"]) == sorted([below.key, nowhere])  # only what the memory tier lacked


def test_view_layers_lends_the_memory_tier_s_own_tensors_and_get_layers_copies(mem_disk, make_entry):
    store, memory, disk = mem_disk
    entry = make_entry()
    store.put(entry)
    store.flush()
    stored = memory.entries[entry.key]
    viewed, copied = store.view_layers(entry.key, 1, 3), store.get_layers(entry.key, 1, 3)
    for got, kept in zip(viewed, (stored.k, stored.v)):
        assert got.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
        assert torch.equal(got, kept[1:3])
    for got, kept in zip(copied, (stored.k, stored.v)):
        assert got.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
        assert torch.equal(got, kept[1:3])
    memory.delete(entry.key)  # evicted meanwhile: the views live on
    assert torch.equal(viewed[0], entry.k[1:3])


def test_a_handed_over_entry_is_kept_as_is_and_any_other_as_a_copy(mem_disk, make_entry):
    store, memory, disk = mem_disk
    handed, lent = make_entry(key="handed"), make_entry(key="lent")
    store.put(handed, handed_over=True)
    store.put(lent)
    store.flush()
    assert memory.entries["handed"].k is handed.k  # no copy: its owner gave it up
    assert memory.entries["lent"].k is not lent.k
    lent.k.zero_()  # the lender's later writes reach no tier
    assert store.get("lent").k.abs().sum() > 0 and disk.get("handed") is not None


def test_free_bytes_is_each_tier_s_room_left_without_asking_a_server(tmp_path, make_entry, redis_server):
    store = open_store(f"memory:1MB, disk:{tmp_path}/a:2MB, throttled:ssd:memory:3MB, {redis_server.url}, "
                       f"disk:{tmp_path}/b")
    store.put(make_entry())
    store.flush()
    used = [tier.stats().get("bytes_used") for tier in store.tiers]
    assert all(used[:3])
    store.tiers[3].client = None  # a Redis tier's room is the server's business: never asked for it
    assert [store.free_bytes(i) for i in range(5)] == [10**6 - used[0], 2 * 10**6 - used[1], 3 * 10**6 - used[2],
                                                       None, None]
    store.tiers[3].client = redis.Redis.from_url(redis_server.url)
    store.close()


def test_a_store_fits_an_entry_some_tier_could_hold():
    store = TieredStore([MemoryTier(100), MemoryTier(1000)])
    try:
        assert store.fits(100) and store.fits(1000) and not store.fits(1001)
    finally:
        store.close()
