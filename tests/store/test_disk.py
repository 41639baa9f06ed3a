"""The disk tier's directory: what opening it does (tracks, never deletes), what it lists; the KV placer's reads
as views of its files' pages."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from kvreuse.store import disk
from kvreuse.store.codec import encode
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


def _folder_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def test_the_folder_never_holds_more_than_its_capacity_not_even_while_a_write_lands(
        tmp_path, make_entry, monkeypatch):
    entries = [make_entry() for _ in range(4)]
    size = DiskTier(tmp_path / "sizing").path(fill(tmp_path / "sizing", entries[:1])[0]).stat().st_size
    tier = DiskTier(tmp_path / "kv", capacity=int(2.5 * size))
    landing: list[int] = []  # the folder's bytes as each new file is about to take its entry's name
    replace = os.replace
    monkeypatch.setattr(disk.os, "replace", lambda src, dst: (landing.append(_folder_bytes(tier.root)),
                                                               replace(src, dst)))
    assert all(tier.put(entry) for entry in entries)
    assert len(landing) == 4 and max(landing) <= tier.policy.capacity
    assert sorted(tier.keys()) == sorted(e.key for e in entries[2:])


def test_a_read_while_its_entry_lands_leaves_the_entry_counted(tmp_path, make_entry, monkeypatch):
    """A reader finds no file yet (a miss) while the room for it is already taken: the entry still counts once it
    lands, so the folder's budget holds it."""
    entry = make_entry()
    tier = DiskTier(tmp_path, capacity=10 << 20)
    replace = os.replace
    misses = []
    monkeypatch.setattr(disk.os, "replace", lambda src, dst: (misses.append(tier.get(entry.key)), replace(src, dst)))
    assert tier.put(entry) and misses == [None]
    assert tier.stats()["bytes_used"] == tier.path(entry.key).stat().st_size
    assert tier.get(entry.key) is not None


def test_a_failed_write_is_a_miss_that_holds_no_room(tmp_path, make_entry, monkeypatch):
    entry = make_entry()
    tier = DiskTier(tmp_path, capacity=10 << 20)

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk.os, "fsync", full)
    assert not tier.put(entry)
    assert tier.stats()["bytes_used"] == 0 and tier.get(entry.key) is None
    assert not list(tier.root.rglob(f"{TMP_PREFIX}*"))
    monkeypatch.undo()
    assert tier.put(entry) and tier.get(entry.key) is not None


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


def in_order(picked):
    k, v, picks = picked
    return (k, v) if picks is None else (k[:, picks], v[:, picks])


def mapped_bytes(tier: DiskTier, key: str) -> range:
    """The addresses of the key's file as the tier keeps it mapped."""
    _, mapping = tier.mappings._maps[str(tier.path(key))]
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return range(start, start + len(mapping))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranked", [False, True])
def test_the_placer_reads_views_of_a_file_kept_mapped(tmp_path, make_entry, monkeypatch, ranked, dtype):
    """view_picking and view_layers_picking hand out the file's own pages (nothing copied into the tensors they
    return), from a mapping kept for the next read; a file replaced under its key is mapped afresh, a deleted one
    is let go."""
    tier = DiskTier(tmp_path)
    entry = make_entry(layers=6, tokens=100, extras=ranked, dtype=dtype)
    assert tier.put(entry)
    picked = tier.view_layers_picking(entry.key, 1, 4)
    mapped = mapped_bytes(tier, entry.key)
    assert picked[0].data_ptr() in mapped and picked[1].data_ptr() in mapped
    k, v = in_order(picked)
    assert torch.equal(k, entry.k[1:4]) and torch.equal(v, entry.v[1:4])
    k, v = in_order(tier.view_layers_picking(entry.key, 2, 2))  # no layers: nothing to map
    assert k.shape == v.shape == (0, *entry.k.shape[1:])

    def remapped(*args, **kwargs):
        raise AssertionError("a kept file mapped again")

    monkeypatch.setattr(disk.mmap, "mmap", remapped)
    k, v, picks = tier.view_picking(entry.key, torch.arange(20, 90), range(6))
    assert k.data_ptr() in mapped and torch.equal(in_order((k, v, picks))[0], entry.k[:, 20:90])
    monkeypatch.undo()
    replaced = make_entry(key=entry.key, layers=6, tokens=100, dtype=dtype)
    assert tier.delete(entry.key) and str(tier.path(entry.key)) not in tier.mappings._maps
    assert tier.put(replaced)
    picked = tier.view_layers_picking(entry.key, 0, 6)
    assert picked[0].data_ptr() in mapped_bytes(tier, entry.key)
    assert all(torch.equal(got, want) for got, want in zip(in_order(picked), (replaced.k, replaced.v)))


def test_a_byte_changed_in_a_mapped_file_is_a_miss(tmp_path, make_entry):
    tier = DiskTier(tmp_path)
    entry = make_entry(layers=4, tokens=100)
    assert tier.put(entry)
    assert tier.view_layers_picking(entry.key, 0, 4) is not None
    path = tier.path(entry.key)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    at = 8 + n + json.loads(data[8 : 8 + n])["v.2"]["data_offsets"][0] + 5 * entry.v[0, 0].nbytes
    with open(path, "r+b") as f:  # in place, as no writer of ours does: the checks must catch it
        f.seek(at)
        f.write(bytes([data[at] ^ 1]))
    assert tier.view_layers_picking(entry.key, 2, 3) is None and tier.stats()["damaged"] == 1


def test_an_entry_file_in_safetensors_name_order_still_reads(tmp_path, make_entry):
    """Entries written by safetensors' own writer (k.10 between k.1 and k.2): layers that do not lie equally
    spaced are copied, those that do are views; both are the entry's."""
    tier = DiskTier(tmp_path)
    entry = make_entry(layers=12, tokens=40)
    data = encode(entry)
    n = int.from_bytes(data[:8], "little")
    tier._write(entry.key, save(load(data), metadata=json.loads(data[8 : 8 + n])["__metadata__"]))
    for start, stop in ((0, 12), (2, 6), (9, 12)):
        k, v = in_order(tier.view_layers_picking(entry.key, start, stop))
        assert torch.equal(k, entry.k[start:stop]) and torch.equal(v, entry.v[start:stop])
    k, _ = in_order(tier.view_layers_picking(entry.key, 2, 6))
    assert k.data_ptr() in mapped_bytes(tier, entry.key)


def test_a_file_that_cannot_be_mapped_is_read_by_copies(tmp_path, make_entry, monkeypatch):
    tier = DiskTier(tmp_path)
    entry = make_entry(layers=4, tokens=100)
    assert tier.put(entry)

    def unmappable(*args, **kwargs):
        raise OSError(19, "No such device")  # a file system without mmap

    monkeypatch.setattr(disk.mmap, "mmap", unmappable)
    k, v = in_order(tier.view_layers_picking(entry.key, 0, 4))
    assert torch.equal(k, entry.k) and torch.equal(v, entry.v) and tier.stats()["unavailable"] == 0


def test_entries_deleted_by_someone_else_stop_counting_once_found_missing(tmp_path, make_entry):
    """`kvreuse cache rm` or `clear` beside a server, or its folder deleted: the server's stats and budget still
    counted the vanished entries, for good."""
    entries = [make_entry() for _ in range(3)]
    tier = DiskTier(tmp_path / "kv", capacity=10 << 20)
    for entry in entries:
        assert tier.put(entry)
    size = tier.path(entries[2].key).stat().st_size  # the one left
    DiskTier(tmp_path / "kv").delete(entries[0].key)  # another process's
    assert not tier.contains(entries[0].key)
    DiskTier(tmp_path / "kv").delete(entries[1].key)
    assert tier.get(entries[1].key) is None
    assert (tier.stats()["entries"], tier.stats()["bytes_used"]) == (1, size)
    assert tier.room_left() == (10 << 20) - size
    shutil.rmtree(tmp_path / "kv")
    assert (tier.stats()["entries"], tier.stats()["bytes_used"]) == (0, 0)
    assert tier.put(entries[0]) and list(tier.keys()) == [entries[0].key] and tier.stats()["entries"] == 1
