"""The disk tier's directory: what opening it does (tracks, never deletes), what it lists."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvreuse.store.disk import STALE_TMP_SECONDS, TMP_PREFIX, DiskTier


def fill(root, entries) -> list[str]:
    """Store `entries` in a tier of no capacity, oldest first by their files' times."""
    tier = DiskTier(root)
    for age, entry in enumerate(reversed(entries)):
        assert tier.put(entry)
        os.utime(tier.path(entry.key), (time.time() - 100 - age, time.time() - 100 - age))
    return [e.key for e in entries]


def test_opening_a_directory_over_its_capacity_deletes_nothing_the_next_write_evicts_oldest_first(
        tmp_path, make_entry):
    entries = [make_entry() for _ in range(4)]
    keys = fill(tmp_path, entries)
    size = DiskTier(tmp_path).path(keys[0]).stat().st_size
    tier = DiskTier(tmp_path, capacity=int(2.5 * size))
    assert sorted(tier.keys()) == sorted(keys) and tier.stats()["evictions"] == 0
    assert tier.stats()["bytes_used"] == 4 * size  # over capacity, and says so
    newest = make_entry()
    assert tier.put(newest)
    assert sorted(tier.keys()) == sorted([keys[-1], newest.key]) and tier.stats()["evictions"] == 3


def test_an_entry_larger_than_the_capacity_goes_at_the_next_write(tmp_path, make_entry):
    big, small = make_entry(tokens=400), make_entry(tokens=10)
    fill(tmp_path, [big])
    tier = DiskTier(tmp_path, capacity=DiskTier(tmp_path).path(big.key).stat().st_size // 2)
    assert tier.put(small)
    assert list(tier.keys()) == [small.key]


def test_a_store_that_cannot_remove_its_stale_temp_files_still_opens(tmp_path, make_entry, monkeypatch, caplog):
    keys = fill(tmp_path, [make_entry()])
    stale = Path(DiskTier(tmp_path).path(keys[0])).parent / f"{TMP_PREFIX}dead-writer"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 2 * STALE_TMP_SECONDS,) * 2)

    def read_only(self, missing_ok=False):
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    tier = DiskTier(tmp_path)
    assert list(tier.keys()) == keys and tier.get(keys[0]) is not None
    assert "could not remove" in caplog.text


def test_a_stray_file_named_like_an_entry_is_not_listed(tmp_path, make_entry):
    keys = fill(tmp_path, [make_entry()])
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.v2.kv.safetensors").write_bytes(b"not ours")
    assert list(DiskTier(tmp_path).keys()) == keys
