"""Memory tier: entries kept as tensors under a byte budget, replaced by segmented LRU (scan resistant)."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Iterator

from kvreuse.store.base import KV, PickedKV, Rows, Tier, nbytes_of
from kvreuse.store.entry import EntryMeta, KVEntry, check_layers, check_rows, consecutive, copy_tensor, take_rows
from kvreuse.store.keys import check_key
from kvreuse.store.policy import SegmentedLRU


class MemoryTier(Tier):
    """Keeps a copy of what it is given and hands out copies, so no caller's writes can change the cache."""

    writes_are_cheap = True

    def __init__(self, capacity: int | None, *, protected_share: float = 0.8, **expect: str | None):
        super().__init__("memory", **expect)
        self.policy = SegmentedLRU(capacity, protected_share)
        self.entries: dict[str, KVEntry] = {}
        self.lock = threading.Lock()
        self.on_evict = lambda entry: None  # TieredStore demotes evicted entries through this

    def _lookup(self, key: str) -> KVEntry | None:
        check_key(key)
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.policy.touch(key)
        if entry is None or not self.accepts(key, entry.meta.model_fingerprint, entry.meta.dtype):
            self.count("misses")
            return None
        self.count("hits")
        return entry

    def _served(self, kv: KV) -> KV:
        self.count_read(nbytes_of(kv))
        return kv

    def contains(self, key: str) -> bool:
        check_key(key)
        return key in self.entries

    def get(self, key: str) -> KVEntry | None:
        entry = self._lookup(key)
        if entry is None:
            return None
        copy = entry.clone()
        self._served((copy.k, copy.v))
        return copy

    def get_layers(self, key: str, start: int, stop: int) -> KV | None:
        kv = self.view_layers(key, start, stop)
        return None if kv is None else (copy_tensor(kv[0]), copy_tensor(kv[1]))

    def view_layers(self, key: str, start: int, stop: int) -> KV | None:
        # The entry's own tensors: nothing writes a stored entry's tensors (a put keeps a copy, or tensors handed
        # over), and one evicted meanwhile lives on in the caller's views.
        entry = self._lookup(key)
        if entry is None:
            return None
        check_layers(range(start, stop), entry.meta.num_layers)
        return self._served((entry.k[start:stop], entry.v[start:stop]))

    def get_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        return self._picked_rows(key, rows, layers, copy_run=True)

    def view_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        # Consecutive rows (a chunk but its first tokens, which LegoLink recomputes; part of a prefix block) are a
        # view of each layer, as view_layers hands out: copying them cost a 2K-token LegoLink prefill 30 ms.
        return self._picked_rows(key, rows, layers, copy_run=False)

    def _picked_rows(self, key: str, rows: Rows, layers: range | None, copy_run: bool) -> KV | None:
        """The rows themselves: `view_picking`'s rows gathered into a copy, its run of consecutive rows copied
        too if `copy_run`."""
        picked = self.view_picking(key, rows, layers)
        if picked is None:
            return None
        k, v, picks = picked
        if picks is not None:
            return take_rows(k, picks), take_rows(v, picks)
        return (copy_tensor(k), copy_tensor(v)) if copy_run else (k, v)

    def view_picking(self, key: str, rows: Rows, layers: range | None = None) -> PickedKV | None:
        # Rows in any other order (CacheTune's) are left to the caller to pick as it places them: a gathered copy
        # here cost a 1.6K-token CacheTune prefill 30 ms of 500.
        entry = self._lookup(key)
        if entry is None:
            return None
        layers = check_layers(layers, entry.meta.num_layers)
        idx = check_rows(rows, entry.meta.num_tokens)
        k, v = entry.k[layers.start : layers.stop], entry.v[layers.start : layers.stop]
        run = consecutive(idx)
        if run is not None:
            return (*self._served((k[:, run], v[:, run])), None)
        self.count_read(2 * idx.numel() * k[:, :1].nbytes)
        return k, v, idx

    def put(self, entry: KVEntry, *, handed_over: bool = False) -> bool:
        self.check_put(entry)
        size = entry.nbytes
        if entry.key in self.entries:
            self.count("duplicates")
            return True
        if not self.policy.fits(size):
            self.fault("write_errors", entry.key, f"{size} bytes exceed the tier's capacity")
            return False
        copy = entry if handed_over else entry.clone()  # outside the lock: readers need not wait for a copy
        with self.lock:
            if entry.key in self.entries:  # another writer won the race; same key, same content
                self.count("duplicates")
                return True
            self.entries[entry.key] = copy
            evicted = [self.entries.pop(key) for key in self.policy.admit(entry.key, size)]
        self.count("puts")
        self.count("bytes_written", size)
        self.count("evictions", len(evicted))
        for old in evicted:
            self.on_evict(old)
        return True

    def delete(self, key: str) -> bool:
        check_key(key)
        with self.lock:
            self.policy.remove(key)
            return self.entries.pop(key, None) is not None

    def keys(self) -> Iterator[str]:
        return iter(list(self.entries))

    def meta(self, key: str, with_extras: bool = False) -> EntryMeta | None:
        check_key(key)
        entry = self.entries.get(key)
        if entry is None:
            return None
        m = entry.meta
        ranking, boundary = (m.ranking, m.boundary) if with_extras else (None, None)
        return replace(m, ranking=None if ranking is None else copy_tensor(ranking),
                       boundary=None if boundary is None else copy_tensor(boundary),
                       boundary_layers=list(m.boundary_layers))

    def fits(self, nbytes: int) -> bool:
        return self.policy.fits(nbytes)

    def room_left(self) -> int | None:
        return self.policy.room_left()

    def usage(self) -> dict[str, int]:
        return {"entries": len(self.entries), "bytes_used": self.policy.used,
                "capacity": self.policy.capacity or 0}

