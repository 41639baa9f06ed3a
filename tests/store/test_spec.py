from __future__ import annotations

import pytest

from kvreuse.store.disk import DiskTier
from kvreuse.store.memory import MemoryTier
from kvreuse.store.redis import RedisTier
from kvreuse.store.spec import open_store, parse_size, parse_store_spec
from kvreuse.store.throttled import ThrottledTier
from kvreuse.store.tiered import tier_label


@pytest.mark.parametrize("text,size", [("2GB", 2 * 10**9), ("512MiB", 512 << 20), ("1.5 kb", 1500), ("100", 100)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_a_spec_lists_tiers_top_to_bottom(tmp_path, redis_server):
    store = open_store(f"memory:1MB, disk:{tmp_path}/a:5GB, {redis_server.url}, throttled:ssd:disk:{tmp_path}/b",
                       model_fingerprint="m")
    memory, disk, redis_tier, throttled = store.tiers
    assert isinstance(memory, MemoryTier) and memory.policy.capacity == 10**6 and memory.model_fingerprint == "m"
    assert isinstance(disk, DiskTier) and disk.root == tmp_path / "a" and disk.policy.capacity == 5 * 10**9
    assert isinstance(redis_tier, RedisTier) and redis_tier.name == redis_server.url
    assert isinstance(throttled, ThrottledTier) and "emulated" in throttled.name
    assert isinstance(throttled.inner, DiskTier) and throttled.inner.policy.capacity is None
    store.close()


def test_list_form_keeps_commas_in_paths(tmp_path):
    store = open_store([f"disk:{tmp_path}/with,comma"])
    assert store.tiers[0].root == tmp_path / "with,comma"
    store.close()


@pytest.mark.parametrize("spec,message", [
    ("memory", "memory:SIZE"),
    ("memory:lots", "bad size 'lots'"),
    ("memory:0GB", "bad size"),
    ("disk:", "disk:PATH"),
    ("ftp://host", "bad store spec 'ftp://host'"),
    ("throttled:floppy:memory:1GB", "DEVICE in"),
    ("", "no tiers"),
    ("memory:1GB,,disk:/x", "no tiers"),
    ("memory:" + "9" * 400, "bad size"),  # a float's infinity, not an OverflowError
    ("disk:5GB", "names no path"),  # not a folder '5GB' of unlimited size
    ("disk::5GB", "names no path"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        open_store(spec)
    with pytest.raises(ValueError, match=message):
        parse_store_spec(spec)


def test_a_spec_is_read_without_opening_anything(tmp_path):
    """What a command checks when it starts: no folder made, no server asked (nothing listens on port 1)."""
    tiers = parse_store_spec(f"memory:2GB, int8:disk:{tmp_path}/kv:1GB, throttled:ssd:redis://127.0.0.1:1/3")
    assert [t.kind for t in tiers] == ["memory", "disk", "throttled"]
    assert (tiers[0].capacity, tiers[1].capacity, tiers[1].path, tiers[1].quantize) == \
        (2 * 10**9, 10**9, f"{tmp_path}/kv", True)
    assert tiers[2].device.name == "ssd" and tiers[2].inner.kind == "redis"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", ["50XB", "5OGB", "", "-1GB", "0"])
def test_a_mistyped_disk_size_is_refused_not_taken_as_a_path(tmp_path, size):
    with pytest.raises(ValueError, match=f"bad size '{size}'"):
        open_store(f"disk:{tmp_path}/kv:{size}")
    assert list(tmp_path.iterdir()) == []  # no directory "kv:50XB" of unlimited size


def test_a_disk_path_with_a_colon(tmp_path):
    store = open_store(f"disk:{tmp_path}/kv:2024:1GB, disk:{tmp_path}/kv:old")
    assert [t.root for t in store.tiers] == [tmp_path / "kv:2024", tmp_path / "kv:old"]
    assert store.tiers[0].policy.capacity == 10**9 and store.tiers[1].policy.capacity is None
    store.close()


@pytest.mark.parametrize("spec,message", [
    ("redis://127.0.0.1:6379/abc", "database after the port must be a number, got 'abc'"),
    ("redis://127.0.0.1:port/0", "bad store spec 'redis://127.0.0.1:port/0': Port"),
    ("redis://", "names no host"),
])
def test_bad_redis_urls_name_the_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        open_store(spec)


@pytest.mark.parametrize("spec", ["redis://app:s3cret@127.0.0.1:6379/x", "redis://app:s3cret@127.0.0.1:63790000/0",
                                  "memory:1GB,,redis://:s3cret@127.0.0.1:6379"])
def test_a_redis_password_is_never_in_an_error(spec):
    with pytest.raises(ValueError, match=r":\*\*\*@127") as refused:
        open_store(spec)
    assert "s3cret" not in str(refused.value)


def test_a_disk_path_from_the_home_folder(tmp_path, monkeypatch):
    """A shell leaves '~' inside a word as it is (--store disk:~/kv): not a folder named '~' in the working one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    store = open_store("disk:~/kv:1GB")
    assert store.tiers[0].root == tmp_path / "home" / "kv" and not (tmp_path / "~").exists()
    store.close()


@pytest.mark.parametrize("spec, name", [("rediss://:pw@127.0.0.1:6380/2", "redis://127.0.0.1:6380/2 (tls)"),
                                        ("redis://[::1]:6379", "redis://[::1]:6379/0")])
def test_a_redis_tier_is_named_by_its_host_port_db_and_tls(spec, name):
    """An IPv6 host keeps its brackets; no password, and nothing is connected to. Its kind stays redis."""
    store = open_store(spec)
    assert store.tiers[0].name == name and tier_label(store, 0) == "redis"
    store.close()
