"""A stack of tiers, fastest first: promotion on hit, demotion on eviction, asynchronous write-back.

- put: tiers whose writes cost no I/O (memory) are written inline; the others get the entry from a background
  writer thread, so a request never waits for disk or network. The writer queue is bounded: when it is full a
  write is dropped (counted), never blocking the caller.
- get: the first tier that has the key serves it; the entry is then promoted into the tiers above it.
- partial reads (get_layers, get_rows and their views) are served from the first tier that has the key; a hit below the top
  schedules a background promotion of the whole entry, which stays off the request's critical path.
- an entry the memory tier evicts is demoted to the tier below if that tier lacks it.
- dedup: keys name content, so a key any tier already holds is never written to it again.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

from kvreuse.store.base import KV, KVStore, PickedKV, Rows
from kvreuse.store.entry import EntryMeta, KVEntry
from kvreuse.store.memory import MemoryTier

T = TypeVar("T")

log = logging.getLogger("kvreuse.store")
# Entries a slow tier has yet to take are held in memory beside the memory tier's budget: bounded in bytes too.
DEFAULT_QUEUE_BYTES = 1 << 30
Job = Callable[[], None]


class TieredStore(KVStore):
    def __init__(self, tiers: list[KVStore], *, queue_size: int = 256, queue_bytes: int = DEFAULT_QUEUE_BYTES):
        """queue_size, queue_bytes: the background writes that may wait for a slow tier, in jobs and in the bytes
        of the entries they hold; past either, a write is dropped (a later request stores its entry again)."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers
        self.name = " > ".join(t.name for t in tiers)
        self.counters = {"hits_by_tier": [0] * len(tiers), "misses": 0, "promotions": 0, "demotions": 0,
                         "writeback_queued": 0, "writeback_dropped": 0, "writeback_errors": 0}
        self._lock = threading.Lock()
        self._pending: set[tuple[str, int, str]] = set()  # (what, tier index, key) of queued jobs
        self._queue: queue.Queue[Job | None] = queue.Queue(queue_size)
        self.queue_bytes = queue_bytes
        self._queued_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-writeback", daemon=True)
        self._writer.start()
        self._closed = False
        for i, tier in enumerate(tiers[:-1]):
            if isinstance(tier, MemoryTier):
                tier.on_evict = lambda entry, below=i + 1: self._demote(entry, below)

    # -- background writes -------------------------------------------------------------------------------
    def _bump(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counters[counter] += n

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            except Exception:  # the writer thread must outlive any one bad write
                log.exception("store write-back failed")
                self._bump("writeback_errors")
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _submit(self, tag: tuple[str, int, str], job: Job, nbytes: int = 0) -> None:
        """Queue `job`, tagged (what, tier index, key) and holding an entry of `nbytes`, unless the same job is
        pending, the queue is full (in jobs or bytes) or the store is closed (its writer gone: a job queued then
        would never run, and a flush would wait forever)."""

        def run() -> None:
            try:
                job()
            finally:
                with self._lock:
                    self._pending.discard(tag)
                    self._queued_bytes -= nbytes

        with self._lock:
            if self._closed or tag in self._pending:
                return
            full = self._queued_bytes + nbytes > self.queue_bytes
            if not full:
                try:
                    self._queue.put_nowait(run)
                except queue.Full:
                    full = True
            if not full:
                self._pending.add(tag)
                self._queued_bytes += nbytes
                self.counters["writeback_queued"] += 1
        if full:
            log.warning("store write-back queue full: dropped a %s of %s (tier %d)", tag[0], tag[2], tag[1])
            self._bump("writeback_dropped")

    def _write(self, tier_index: int, entry: KVEntry) -> None:
        """Put `entry`, which is the store's own: no tier copies it again."""
        tier = self.tiers[tier_index]
        if tier.writes_are_cheap:
            tier.put(entry, handed_over=True)
        else:
            self._submit(("write", tier_index, entry.key), lambda: tier.put(entry, handed_over=True), entry.nbytes)

    def _demote(self, entry: KVEntry, below: int) -> None:
        tier = self.tiers[below]

        def demote() -> None:
            if not tier.contains(entry.key) and tier.put(entry, handed_over=True):
                self._bump("demotions")

        self._submit(("demote", below, entry.key), demote, entry.nbytes)

    def _promote_later(self, key: str, source: int) -> None:
        def promote() -> None:
            entry = self.tiers[source].get(key)
            if entry is not None:
                self._promote(entry, source)

        self._submit(("promote", source, key), promote)

    def _promote(self, entry: KVEntry, source: int) -> None:
        above = [i for i in range(source) if self.tiers[i].fits(entry.nbytes)]  # else each hit logs a refusal
        for i in above:
            self._write(i, entry)
        if above:
            self._bump("promotions")

    def flush(self) -> None:
        """Wait until every queued write has been done."""
        self._queue.join()

    # -- the store interface -----------------------------------------------------------------------------
    def put(self, entry: KVEntry, tier: int = 0, *, handed_over: bool = False) -> bool:
        """Accept `entry` (True) into tier `tier` and every tier below it: a placement policy may keep a new
        entry out of the faster tiers, and a hit promotes it later. Cheap tiers are written now, the others
        queued. Bad input raises here, not later in the writer thread. Unless `handed_over`, the store keeps a
        copy of its own."""
        if self._closed:
            raise RuntimeError(f"store {self.name} is closed")
        if not 0 <= tier < len(self.tiers):
            raise ValueError(f"tier: {tier} is not a tier of {self.name} (0..{len(self.tiers) - 1})")
        for t in self.tiers:
            t.check_put(entry)
        owned = entry if handed_over else entry.clone()  # async writes and the memory tier need a stable copy
        for i in range(tier, len(self.tiers)):
            self._write(i, owned)
        return True

    def fits(self, nbytes: int) -> bool:
        """Whether some tier could hold an entry of `nbytes`."""
        return any(tier.fits(nbytes) for tier in self.tiers)

    def free_bytes(self, tier: int) -> int | None:
        """Room left in tier `tier` before it evicts, or None if it has no capacity limit."""
        return self.tiers[tier].room_left()

    def _first_hit(self, read: Callable[[KVStore], Any]) -> tuple[int, Any]:
        for i, tier in enumerate(self.tiers):
            result = read(tier)
            if result is not None:
                with self._lock:
                    self.counters["hits_by_tier"][i] += 1
                return i, result
        self._bump("misses")
        return -1, None

    def get(self, key: str) -> KVEntry | None:
        return self.get_from_tier(key)[1]

    def get_from_tier(self, key: str) -> tuple[int, KVEntry | None]:
        """The entry and the index of the tier that delivered it ((-1, None) on a miss)."""
        i, entry = self._first_hit(lambda t: t.get(key))
        if i > 0:
            # The caller owns `entry` and may write into it; the upper tiers get their own copy.
            self._promote(entry.clone(), i)
        return i, entry

    def _partial(self, key: str, read: Callable[[KVStore], T | None]) -> T | None:
        i, kv = self._first_hit(read)
        if i > 0:
            self._promote_later(key, i)
        return kv

    def get_layers(self, key: str, start: int, stop: int) -> KV | None:
        return self._partial(key, lambda t: t.get_layers(key, start, stop))

    def view_layers(self, key: str, start: int, stop: int) -> KV | None:
        return self._partial(key, lambda t: t.view_layers(key, start, stop))

    def get_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        return self._partial(key, lambda t: t.get_rows(key, rows, layers))

    def view_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        return self._partial(key, lambda t: t.view_rows(key, rows, layers))

    def view_picking(self, key: str, rows: Rows, layers: range | None = None) -> PickedKV | None:
        return self._partial(key, lambda t: t.view_picking(key, rows, layers))

    def view_layers_picking(self, key: str, start: int, stop: int) -> PickedKV | None:
        return self._partial(key, lambda t: t.view_layers_picking(key, start, stop))

    def contains(self, key: str) -> bool:
        return self.locate(key) is not None

    def locate(self, key: str) -> int | None:
        """Index of the first tier holding `key`, or None: what a planner needs to price loading it."""
        return next((i for i, t in enumerate(self.tiers) if t.contains(key)), None)

    def delete(self, key: str) -> bool:
        self.flush()  # a queued write must not bring the key back
        return any([t.delete(key) for t in self.tiers])

    def clear(self) -> int:
        """Empty every tier; returns the entry count of the fullest (tiers overlap, so no sum is right)."""
        self.flush()
        return max(t.clear() for t in self.tiers)

    def keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for tier in self.tiers:
            for key in tier.keys():
                if key not in seen:
                    seen.add(key)
                    yield key

    def meta(self, key: str, with_extras: bool = False) -> EntryMeta | None:
        return next((m for t in self.tiers if (m := t.meta(key, with_extras)) is not None), None)

    def probe(self, keys: Iterable[str], with_extras: bool = False) -> dict[str, Probed]:
        """Where each key lives and its metadata, in one walk down the tiers: a key is asked of a tier only while
        no tier above holds it, and once, where `meta` then `locate` would each walk the tiers. Keys held nowhere
        (or unreadable) are absent."""
        found: dict[str, Probed] = {}
        missing = list(dict.fromkeys(keys))
        for i, tier in enumerate(self.tiers):
            still = []
            for key in missing:
                meta = tier.meta(key, with_extras)
                if meta is None:
                    still.append(key)
                else:
                    found[key] = Probed(i, meta)
            missing = still
        return found

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = {k: list(v) if isinstance(v, list) else v for k, v in self.counters.items()}
        return {**counters, "writeback_pending": self._queue.qsize(), "tiers": [t.stats() for t in self.tiers]}

    def close(self) -> None:
        """Finish queued writes and release the tiers; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        self._queue.put(None)
        self._writer.join()
        for tier in self.tiers:
            tier.close()


@dataclass(frozen=True)
class Probed:
    """A stored entry as a planner sees it: the first tier holding it, and its metadata."""

    tier: int
    meta: EntryMeta


def tier_label(store: KVStore, tier: int) -> str:
    """A tier's kind, stable across runs: memory, disk, redis, or the emulated device (ssd, hdd, net10g)."""
    inner = store.tiers[tier] if isinstance(store, TieredStore) else store
    device = getattr(inner, "device", None)
    return device.name if device is not None else inner.name.split(":")[0].split(" ")[0]
