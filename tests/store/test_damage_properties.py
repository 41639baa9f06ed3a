"""Property: whatever bytes stand where a stored object should be (the whole entry, any slice of it: header,
metadata, ranking, boundary, K/V; a Redis manifest or part, or a value of another Redis type; a directory in
place of a disk entry), every read is a miss or the exact stored data, never an exception; a miss deletes the
damaged object, and the next put stores the entry again."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.store.codec import encode
from kvreuse.store.disk import DiskTier
from kvreuse.store.entry import KVEntry
from kvreuse.store.redis import RedisTier
from kvreuse.store.tiered import TieredStore

from .conftest import _make_entry

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SMALL = dict(layers=2, tokens=10, heads=2, dim=4, extras=True)


def same(result, entry: KVEntry) -> bool:
    """Whether a read's result is the entry's exact data (for whatever kind of read it was)."""
    if isinstance(result, KVEntry):
        return torch.equal(result.k, entry.k) and torch.equal(result.v, entry.v)
    if isinstance(result, tuple):
        return all(torch.equal(got, entry_part) for got, entry_part in zip(result, expected_of(result, entry)))
    meta = entry.meta
    return (result.num_tokens, result.num_layers) == (meta.num_tokens, meta.num_layers) and \
        torch.equal(result.ranking, meta.ranking) and torch.equal(result.boundary, meta.boundary)


def expected_of(result: tuple, entry: KVEntry) -> tuple[torch.Tensor, torch.Tensor]:
    if result[0].shape[1] == 2:  # the rows read below
        return entry.k[:, [0, 7]], entry.v[:, [0, 7]]
    if result[0].shape[0] == 1:  # the layer read below
        return entry.k[:1], entry.v[:1]
    return entry.k, entry.v


def placer_reads(tier, entry: KVEntry) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """What the KV placer reads (a disk file's pages themselves), in token order."""
    picked = [tier.view_picking(entry.key, torch.arange(entry.meta.num_tokens)),
              tier.view_layers_picking(entry.key, 0, entry.meta.num_layers)]
    return [None if p is None else p[:2] if p[2] is None else (p[0][:, p[2]], p[1][:, p[2]]) for p in picked]


def check_reads_then_reput(tier, entry: KVEntry) -> None:
    # the placer's first: a read that finds damage deletes the entry, and the reads after it miss
    reads = [*placer_reads(tier, entry), tier.get(entry.key), tier.get_layers(entry.key, 0, 1),
             tier.get_rows(entry.key, [0, 7]), tier.meta(entry.key, with_extras=True)]
    for result in reads:
        assert result is None or same(result, entry)
    assert isinstance(tier.contains(entry.key), bool)
    assert tier.put(entry)
    flush = getattr(tier, "flush", None)
    if flush:
        flush()
    again = tier.get(entry.key)
    assert again is not None and same(again, entry)


@pytest.fixture(scope="module")
def disk_root():
    with tempfile.TemporaryDirectory() as root:
        yield Path(root)


def new_entry() -> KVEntry:
    return _make_entry(**SMALL)


def damage_blob(tier, entry: KVEntry, data: bytes, how: str, offset: int) -> None:
    """Write `entry` damaged: replaced by `data`, or with `data` spliced in at `offset` of its encoding."""
    good = encode(entry)
    if how == "replace":
        damaged = data
    elif how == "splice":
        at = offset % len(good)
        damaged = good[:at] + data + good[at + len(data):]
    else:  # truncate
        damaged = good[: offset % len(good)]
    tier._write(entry.key, damaged)


DAMAGE = dict(data=st.binary(max_size=300), how=st.sampled_from(["replace", "splice", "truncate"]),
              offset=st.integers(0, 1 << 16))


@PROPERTY
@given(**DAMAGE)
def test_any_bytes_for_a_disk_entry(disk_root, data, how, offset):
    tier = DiskTier(disk_root)
    entry = new_entry()
    damage_blob(tier, entry, data, how, offset)
    check_reads_then_reput(tier, entry)


@PROPERTY
@given(**DAMAGE)
def test_any_bytes_for_a_redis_entry(redis_server, data, how, offset):
    tier = RedisTier(redis_server.url, prefix=f"prop-{uuid.uuid4().hex[:8]}", part_size=256)
    try:
        entry = new_entry()
        damage_blob(tier, entry, data, how, offset)
        check_reads_then_reput(tier, entry)
    finally:
        tier.clear()
        tier.close()


@PROPERTY
@given(manifest=st.one_of(st.binary(max_size=60), st.from_regex(r"[0-9a-f]{0,20}:-?[0-9]{1,6}:-?[0-9]{1,6}",
                                                                   fullmatch=True).map(str.encode)))
def test_any_bytes_for_a_redis_manifest(redis_server, manifest):
    tier = RedisTier(redis_server.url, prefix=f"prop-{uuid.uuid4().hex[:8]}", part_size=256)
    try:
        entry = new_entry()
        tier.put(entry)
        tier.client.set(tier._manifest(entry.key), manifest)
        check_reads_then_reput(tier, entry)
    finally:
        tier.clear()
        tier.close()


@PROPERTY
@given(part=st.integers(0, 20), data=st.binary(max_size=300), wrong_type=st.booleans())
def test_any_bytes_or_type_for_a_redis_part(redis_server, part, data, wrong_type):
    tier = RedisTier(redis_server.url, prefix=f"prop-{uuid.uuid4().hex[:8]}", part_size=256)
    try:
        entry = new_entry()
        tier.put(entry)
        parts = tier._part_keys(entry.key, tier.client.get(tier._manifest(entry.key)))
        name = parts[part % len(parts)]
        tier.client.delete(name)
        if wrong_type:
            tier.client.rpush(name, data or b"x")
        else:
            tier.client.set(name, data)
        check_reads_then_reput(tier, entry)
    finally:
        tier.clear()
        tier.close()


@pytest.mark.parametrize("kind", ["list", "hash", "set"])
def test_a_redis_manifest_of_another_type_is_damage_and_deleted(redis_server, kind):
    tier = RedisTier(redis_server.url, prefix=f"prop-{uuid.uuid4().hex[:8]}")
    try:
        entry = new_entry()
        name = tier._manifest(entry.key)
        {"list": lambda: tier.client.rpush(name, b"x"), "hash": lambda: tier.client.hset(name, "a", b"x"),
         "set": lambda: tier.client.sadd(name, b"x")}[kind]()
        assert tier.get(entry.key) is None
        assert tier.stats()["damaged"] == 1 and not tier.client.exists(name)
        assert tier.put(entry) and same(tier.get(entry.key), entry)
    finally:
        tier.clear()
        tier.close()


def test_a_redis_manifest_with_part_size_zero_is_damage_and_deleted(redis_server):
    tier = RedisTier(redis_server.url, prefix=f"prop-{uuid.uuid4().hex[:8]}")
    try:
        entry = new_entry()
        tier.put(entry)
        tier.client.set(tier._manifest(entry.key), b"0123456789abcdef:10:0")
        assert tier.get(entry.key) is None and tier.meta(entry.key) is None
        assert tier.stats()["damaged"] == 1 and not tier.contains(entry.key)
        assert tier.put(entry) and same(tier.get(entry.key), entry)
    finally:
        tier.clear()
        tier.close()


def test_a_directory_in_place_of_a_disk_entry_is_damage_and_removed(tmp_path):
    tier = DiskTier(tmp_path)
    entry = new_entry()
    path = tier.path(entry.key)
    (path / "inside").mkdir(parents=True)
    assert tier.get(entry.key) is None
    assert tier.stats()["damaged"] == 1 and not path.exists()
    assert tier.put(entry) and same(tier.get(entry.key), entry)


@PROPERTY
@given(**DAMAGE)
def test_a_tiered_store_never_serves_a_damaged_lower_copy(disk_root, redis_server, data, how, offset):
    """The disk copy is damaged, the Redis copy below it is good: a read gives the good data or a miss."""
    redis_tier = RedisTier(redis_server.url, prefix=f"prop-{uuid.uuid4().hex[:8]}", part_size=256)
    disk = DiskTier(disk_root)
    store = TieredStore([disk, redis_tier])
    try:
        entry = new_entry()
        redis_tier.put(entry)
        damage_blob(disk, entry, data, how, offset)
        check_reads_then_reput(store, entry)
    finally:
        store.clear()
        store.close()
