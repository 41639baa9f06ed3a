"""Damage and failures become misses or skipped writes, counted and logged: never an exception, never wrong KV."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
import time

import pytest
import redis
import torch

from kvreuse.store.codec import BufferSource, EntryDamaged, EntryReader, encode
from kvreuse.store.disk import DiskTier
from kvreuse.store.keys import InvalidKey
from kvreuse.store.memory import MemoryTier
from kvreuse.store.redis import RedisTier
from kvreuse.store.tiered import TieredStore


def raw_bytes(tier, key: str) -> bytes:
    with tier._open(key) as source:
        return bytes(source.read_ranges([(0, source.size)])[0])


def reads(tier, key: str) -> list:
    """Every kind of read, including partial ones that touch the start, middle and end of the entry."""
    return [tier.get(key), tier.get_layers(key, 0, 4), tier.get_layers(key, 3, 4),
            tier.get_rows(key, [0, 99]), tier.get_rows(key, [70], range(2, 3))]


@pytest.mark.parametrize("cut", [0, 7, 100, 0.5, -1])
def test_truncated_entry_is_a_miss(blob_tier_maker, make_entry, cut, caplog):
    tier = blob_tier_maker()
    entry = make_entry()
    tier.put(entry)
    data = raw_bytes(tier, entry.key)
    tier._write(entry.key, data[: int(len(data) * cut) if isinstance(cut, float) else cut % len(data)])
    assert all(r is None for r in reads(tier, entry.key))
    assert tier.stats()["damaged"] == 1 and "damaged" in caplog.text
    # The damaged blob was dropped, so the entry can be stored again.
    assert tier.put(entry) and torch.equal(tier.get(entry.key).k, entry.k)


def test_flipped_byte_anywhere_is_a_miss(blob_tier_maker, make_entry):
    tier = blob_tier_maker()
    entry = make_entry(extras=True)
    data = encode(entry)
    positions = sorted({*range(0, len(data), len(data) // 50), len(data) - 1})
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 0xFF
        tier._write(entry.key, bytes(flipped))
        assert tier.get(entry.key) is None, f"flip at byte {pos} of {len(data)} went unnoticed"
    assert tier.stats()["damaged"] == len(positions)


@pytest.mark.parametrize("tensor", ["k.1", "v.3"])
def test_partial_reads_verify_what_they_read(blob_tier_maker, make_entry, tensor):
    tier = blob_tier_maker()
    entry = make_entry()
    data = encode(entry)
    layout = EntryReader(BufferSource(data), entry.key).tensors[tensor]
    row_bytes = layout.nbytes // 100
    rows, layers = [1, 20, 40, 50, 64, 90, 99], range(1, 4)
    for row in range(0, 100, 7):
        flipped = bytearray(data)
        flipped[layout.start + row * row_bytes + 5] ^= 0x01
        tier._write(entry.key, bytes(flipped))
        kv = tier.get_rows(entry.key, rows, layers)
        # These rows touch all seven 16-row checksum groups, so a flip in any row of a read layer is caught...
        assert kv is None, f"flip in row {row} of {tensor} went unnoticed"
        # ...while a read of a layer the flip is not in reads other bytes, and gets them exactly.
        tier._write(entry.key, bytes(flipped))
        k, v = tier.get_layers(entry.key, 0, 1)
        assert torch.equal(k, entry.k[:1]) and torch.equal(v, entry.v[:1])


def test_missing_piece_is_a_miss(blob_tier_maker, make_entry):
    tier = blob_tier_maker()
    entry = make_entry()
    tier.put(entry)
    if isinstance(tier, DiskTier):
        tier.path(entry.key).unlink()
    else:  # one part of a multi-part entry vanished (e.g. evicted by the server)
        tier.client.delete(next(tier.client.scan_iter(match=f"{tier.prefix}:p:*:1")))
    assert all(r is None for r in reads(tier, entry.key))
    assert tier.stats()["misses"] == 5


def test_entry_stored_under_another_key_is_a_miss(blob_tier_maker, make_entry):
    tier = blob_tier_maker()
    a, b = make_entry(), make_entry()
    tier._write(b.key, encode(a))
    assert tier.get(b.key) is None and tier.stats()["damaged"] == 1


@pytest.mark.parametrize("expect", [{"model_fingerprint": "model-a"}, {"dtype": "float16"}])
def test_entry_of_other_model_or_dtype_is_a_miss(blob_tier_maker, make_entry, expect):
    writer, reader = blob_tier_maker(), blob_tier_maker(**expect)
    entry = make_entry(model="model-b", dtype=torch.bfloat16)
    writer.put(entry)
    assert all(r is None for r in reads(reader, entry.key))
    assert reader.stats()["wrong_model"] == 5 and reader.stats()["damaged"] == 0
    assert writer.get(entry.key) is not None  # not damage: the entry stays for its own model


@contextlib.contextmanager
def backend_full(tier, monkeypatch):
    """Disk: every fsync fails with ENOSPC. Redis: maxmemory 1 byte with no eviction, so writes get OOM."""
    if isinstance(tier, DiskTier):
        def no_space(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "fsync", no_space)
        yield
        monkeypatch.undo()
    else:
        tier.client.config_set("maxmemory-policy", "noeviction")
        tier.client.config_set("maxmemory", 1)
        try:
            yield
        finally:
            tier.client.config_set("maxmemory", 0)


def leftovers(tier) -> list:
    if isinstance(tier, DiskTier):
        return [p for p in tier.root.rglob("*") if p.is_file()]
    return list(tier.client.scan_iter(match=f"{tier.prefix}:*"))


def test_full_backend_skips_the_write(blob_tier_maker, make_entry, monkeypatch, caplog):
    tier = blob_tier_maker()
    entry = make_entry()
    with backend_full(tier, monkeypatch):
        assert tier.put(entry) is False
    assert tier.stats()["write_errors"] == 1 and "write errors" in caplog.text
    assert not tier.contains(entry.key) and leftovers(tier) == []
    assert tier.put(entry) and tier.get(entry.key) is not None  # the backend recovered


def test_disk_quota_skips_an_entry_that_cannot_fit(tmp_path, make_entry):
    tier = DiskTier(tmp_path, capacity=1000)
    assert tier.put(make_entry()) is False
    assert tier.stats()["write_errors"] == 1 and leftovers(tier) == []


@pytest.mark.parametrize("failing", ["pread", "preadv"])  # the header's read, the K/V's (into the result)
def test_disk_read_error_is_a_miss(tmp_path, make_entry, monkeypatch, failing):
    tier = DiskTier(tmp_path)
    entry = make_entry()
    tier.put(entry)

    def io_error(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, failing, io_error)
    assert all(r is None for r in reads(tier, entry.key))
    assert tier.stats()["unavailable"] == 5


def test_a_disk_file_cut_while_it_is_read_is_a_short_read(tmp_path, make_entry):
    """A file shortened in place after the reader opened it (its size taken then): the read into the result
    comes back short, which is damage, before any checksum is asked."""
    tier = DiskTier(tmp_path)
    entry = make_entry()
    assert tier.put(entry)
    with tier._open(entry.key) as source:
        reader = EntryReader(source, entry.key)
        os.truncate(tier.path(entry.key), source.size - 100)
        with pytest.raises(EntryDamaged, match="short read"):
            reader.read()


def test_concurrent_writers_of_one_key_leave_one_valid_entry(blob_tier_maker, make_entry):
    tier = blob_tier_maker()
    entry = make_entry()
    data = encode(entry)
    barrier = threading.Barrier(6)

    def write() -> None:
        barrier.wait()
        for _ in range(5):
            tier._write(entry.key, data)  # below put's dedup, so the writes really race

    threads = [threading.Thread(target=write) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(tier.get(entry.key).v, entry.v)
    if isinstance(tier, DiskTier):
        assert len(leftovers(tier)) == 1
    else:  # the manifest and its parts stay; every replaced part is on its way out
        lasting = [name for name in leftovers(tier) if tier.client.ttl(name) == -1]
        assert len(lasting) == 1 + -(-len(data) // tier.part_size)
        assert all(0 < tier.client.ttl(name) <= 30 for name in set(leftovers(tier)) - set(lasting))


def test_disk_keys_stay_inside_the_store_directory(tmp_path, make_entry):
    tier = DiskTier(tmp_path / "store")
    entry = make_entry()
    assert tier.path(entry.key).resolve().is_relative_to((tmp_path / "store").resolve())
    for bad in ("../escape", "/etc/passwd", "..", "a/../../b"):
        with pytest.raises(InvalidKey):
            tier.path(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_killed_redis_server_turns_into_misses(own_redis_server, make_entry, caplog):
    redis_tier = RedisTier(own_redis_server.url, timeout=0.5)
    store = TieredStore([MemoryTier(1 << 20), redis_tier])
    hot, cold, new = make_entry(), make_entry(), make_entry()
    store.put(hot)
    redis_tier.put(cold)
    store.flush()
    own_redis_server.stop()

    assert store.get(cold.key) is None and redis_tier.stats()["unavailable"] >= 1
    assert torch.equal(store.get(hot.key).k, hot.k)  # memory keeps serving
    assert store.put(new)
    store.flush()
    assert redis_tier.stats()["write_errors"] == 1 and store.stats()["writeback_errors"] == 0
    assert not redis_tier.contains(new.key) and "unavailable" in caplog.text
    store.close()


class Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"the backend was asked ({name}) inside an outage's pause")


def test_hung_redis_server_costs_one_timeout_then_misses_until_the_pause_ends(own_redis_server, make_entry):
    entry = make_entry()
    tier = RedisTier(own_redis_server.url, timeout=0.3, outage_pause=1.0)
    assert tier.put(entry)
    os.kill(own_redis_server.proc.pid, signal.SIGSTOP)  # alive but silent: every call waits out its timeout
    try:
        started = time.monotonic()
        assert tier.get(entry.key) is None
        assert time.monotonic() - started >= 0.3
        client, tier.client = tier.client, Untouchable()
        assert tier.meta(entry.key) is None and not tier.contains(entry.key) and not tier.put(make_entry())
        assert tier.stats()["unavailable"] == 3 and tier.stats()["write_errors"] == 1
        tier.client = client
    finally:
        os.kill(own_redis_server.proc.pid, signal.SIGCONT)
    time.sleep(1.0)
    assert torch.equal(tier.get(entry.key).k, entry.k)  # asked again once the pause is over
    tier.close()


def test_a_database_the_redis_server_lacks_is_an_outage_not_a_fault_per_call(redis_server, make_entry):
    """redis://HOST:PORT/99 on a server of 16 databases: every call fails alike, so the tier pauses as for a
    server that is down instead of asking (and warning) on every call."""
    tier = RedisTier(redis_server.url.rsplit("/", 1)[0] + "/99", outage_pause=60)
    written = []
    tier._write = lambda key, data: written.append(key)
    assert not tier.put(make_entry()) and tier.in_outage()
    assert written == []  # its look-up found the server out: the write is not tried as well
    tier.client = Untouchable()
    assert tier.get("any") is None  # not asked: Untouchable
    assert tier.stats()["write_errors"] == 1 and tier.stats()["unavailable"] == 2  # the put's look-up, the get


def test_redis_reader_of_a_replaced_version_still_reads_it(redis_server, make_entry):
    tier = RedisTier(redis_server.url, prefix="replace-test", part_size=8192)
    entry = make_entry()
    data = encode(entry)
    tier._write(entry.key, data)
    with tier._open(entry.key) as old_version:
        tier._write(entry.key, data)  # a concurrent writer swaps the manifest mid-read
        assert bytes(old_version.read_ranges([(0, old_version.size)])[0]) == data
    with tier._open(entry.key) as deleted:
        assert tier.delete(entry.key)  # and a concurrent delete
        assert bytes(deleted.read_ranges([(0, deleted.size)])[0]) == data
    assert tier.stats()["damaged"] == 0
    tier.clear()


def test_redis_write_failing_at_its_manifest_leaves_only_parts_that_expire(redis_server, make_entry, monkeypatch):
    tier = RedisTier(redis_server.url, prefix="half-written", part_size=8192, outage_pause=0)
    entry = make_entry()
    pipeline = tier.client.pipeline

    def manifest_times_out(transaction=True, **kwargs):
        pipe = pipeline(transaction=transaction, **kwargs)
        if transaction:
            def execute(*args, **kwargs):
                raise redis.TimeoutError("Timeout reading from socket")
            pipe.execute = execute
        return pipe

    monkeypatch.setattr(tier.client, "pipeline", manifest_times_out)
    assert not tier.put(entry) and tier.stats()["write_errors"] == 1
    monkeypatch.undo()
    parts = leftovers(tier)
    assert parts and all(0 < tier.client.ttl(name) for name in parts)  # no part outlives its write for good
    assert tier.put(entry) and tier.get(entry.key) is not None
    committed = tier._part_keys(entry.key, tier.client.get(tier._manifest(entry.key)))
    assert [tier.client.ttl(name) for name in committed] == [-1] * len(committed)  # named by a manifest: kept
    tier.clear()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("claim", ["999999999999999:1", "9000000000:1"])
def test_redis_manifest_claiming_too_many_parts_is_a_miss(redis_server, make_entry, claim):
    """A damaged manifest is refused before it is acted on: naming a billion parts to read or drop used to hang
    the reader (and the removal of the damaged entry)."""
    tier = RedisTier(redis_server.url, prefix="bounds-test")
    entry = make_entry()
    tier.put(entry)
    manifest = tier._manifest(entry.key)
    version = tier.client.get(manifest).split(b":")[0].decode()
    tier.client.set(manifest, f"{version}:{claim}")
    assert all(r is None for r in reads(tier, entry.key))
    assert tier.stats()["damaged"] >= 1 and not tier.contains(entry.key)
    tier.clear()


def test_redis_usage_skips_a_damaged_manifest(redis_server, make_entry):
    tier = RedisTier(redis_server.url, prefix="usage-test")
    good, bad = make_entry(), make_entry()
    tier.put(good)
    tier.put(bad)
    tier.client.set(tier._manifest(bad.key), b"not a manifest")
    assert tier.usage() == {"entries": 1, "bytes_used": len(raw_bytes(tier, good.key))}
    tier.clear()


def test_redis_key_of_another_type_is_not_contained(redis_server, make_entry):
    tier = RedisTier(redis_server.url, prefix="type-test")
    entry = make_entry()
    tier.client.rpush(tier._manifest(entry.key), b"x")
    assert not tier.contains(entry.key) and tier.get(entry.key) is None
    tier.clear()


def test_a_put_over_a_manifest_of_another_type_leaves_no_part_for_good(redis_server, make_entry):
    """The commit's SET fails on a value of another type, and the transaction still makes the parts persist:
    they are dropped with the damaged value, and the next put stores the entry."""
    tier = RedisTier(redis_server.url, prefix="type-put-test", part_size=8192, outage_pause=0)
    entry = make_entry()
    tier.client.rpush(tier._manifest(entry.key), b"x")
    assert not tier.put(entry) and tier.stats()["write_errors"] == 1
    assert all(tier.client.ttl(name) > 0 for name in leftovers(tier))  # nothing left for good
    assert tier.put(entry) and torch.equal(tier.get(entry.key).k, entry.k)
    tier.clear()


def test_a_stray_name_among_redis_manifests_is_not_listed_as_an_entry(redis_server, make_entry):
    """Another client's key under the manifests' prefix (not a store key) is not an entry: listing the tier, and
    clearing it, go on past it (they stopped at an InvalidKey)."""
    tier = RedisTier(redis_server.url, prefix="stray-test")
    entry = make_entry()
    tier.put(entry)
    tier.client.set(tier._manifest("not/a.key"), b"x")
    assert list(tier.keys()) == [entry.key]
    assert tier.clear() == 1 and tier.get(entry.key) is None
    tier.client.delete(tier._manifest("not/a.key"))


def test_a_disk_tier_whose_directory_was_deleted_writes_again(tmp_path, make_entry):
    tier = DiskTier(tmp_path / "store")
    first, second = make_entry(), make_entry()
    assert tier.put(first)
    shutil.rmtree(tmp_path / "store")
    assert tier.get(first.key) is None
    assert tier.put(second) and torch.equal(tier.get(second.key).k, second.k)


@pytest.mark.timeout(30)
def test_fifo_at_a_disk_entry_path_is_a_miss_without_blocking(tmp_path, make_entry):
    tier = DiskTier(tmp_path)
    entry = make_entry()
    path = tier.path(entry.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)  # opening it for reading would wait for a writer forever
    assert not tier.contains(entry.key)
    assert all(r is None for r in reads(tier, entry.key))
    assert tier.put(entry) and torch.equal(tier.get(entry.key).k, entry.k)


def test_directory_or_symlink_at_a_disk_entry_path_is_not_contained(tmp_path, make_entry):
    tier = DiskTier(tmp_path)
    as_dir, as_link = make_entry(), make_entry()
    tier.path(as_dir.key).mkdir(parents=True)
    tier.path(as_link.key).parent.mkdir(parents=True, exist_ok=True)
    tier.path(as_link.key).symlink_to(tmp_path / "elsewhere")
    assert not tier.contains(as_dir.key) and not tier.contains(as_link.key)
