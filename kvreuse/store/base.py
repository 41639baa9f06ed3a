"""The interface every tier and the tiered store share, and the code all byte-storing tiers share.

Reads return None on a miss and on any damage (logged, counted in `stats()`), never wrong KV and never an
exception for a fault; bad arguments (an invalid key, a layer range out of bounds) raise ValueError.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, ContextManager, Hashable, Iterator, Sequence, TypeVar

import torch

from kvreuse.store.codec import ByteSource, EntryDamaged, EntryReader, encode
from kvreuse.store.entry import EntryMeta, KVEntry
from kvreuse.store.keys import check_key

log = logging.getLogger("kvreuse.store")
KV = tuple[torch.Tensor, torch.Tensor]
# Keys and values of some layers with the rows to pick from each (None: they are the rows asked for)
PickedKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
Rows = Sequence[int] | torch.Tensor
KVForm = tuple[torch.dtype, tuple[int, ...]]  # a KV row's dtype and shape: (heads, head_dim)
T = TypeVar("T")


class KVStore(ABC):
    """contains / get / get_layers / get_rows (and their views) / put / delete / stats, plus listing for tooling."""

    name: str
    writes_are_cheap = False  # True where a put costs no I/O, so the tiered store does it inline
    # True where a read mostly waits (network, a device) rather than runs on the CPU. Only such reads gain from
    # a loader thread beside the compute on a CPU host: a CPU-bound read there only contends with it.
    reads_wait = False
    read_latency_seconds = 0.0  # what every read pays before its bytes (a device's seek, a network round trip)
    # True where a read inline is best of a stored span's every layer at once: its reads lend views (hold no copy)
    # and each pays a call's cost beside its bytes (a file's open, header and mapping look-up)
    reads_whole_spans = False

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> KVEntry | None: ...

    @abstractmethod
    def get_layers(self, key: str, start: int, stop: int) -> KV | None:
        """K and V of layers [start, stop)."""

    def view_layers(self, key: str, start: int, stop: int) -> KV | None:
        """`get_layers` for a caller that only reads them (and must not write them): a tier that keeps tensors
        hands out its own, not a copy."""
        return self.get_layers(key, start, stop)

    @abstractmethod
    def get_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        """K and V of token `rows` (in the order given), for `layers` (default all)."""

    def view_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        """`get_rows` for a caller that only reads them (and must not write them): a tier that keeps tensors
        hands out its own where the rows are consecutive, not a copy."""
        return self.get_rows(key, rows, layers)

    def view_picking(self, key: str, rows: Rows, layers: range | None = None) -> PickedKV | None:
        """`view_rows` for a caller that picks rows itself as it copies them (the KV placer): a tier that keeps
        tensors hands out its layers whole with the rows to pick, where `view_rows` would gather a copy of them."""
        kv = self.view_rows(key, rows, layers)
        return None if kv is None else (*kv, None)

    def view_layers_picking(self, key: str, start: int, stop: int) -> PickedKV | None:
        """`view_layers` for a caller that picks rows itself as it copies them (the KV placer): a tier that keeps
        an entry's rows in another order than its tokens' (CacheTune's rank order on disk and Redis) hands them out
        as read, with the token order's rows to pick, where `view_layers` would gather a copy of them."""
        kv = self.view_layers(key, start, stop)
        return None if kv is None else (*kv, None)

    @abstractmethod
    def put(self, entry: KVEntry, *, handed_over: bool = False) -> bool:
        """Store `entry`; True if it is stored (now or already), False if the write was skipped. `handed_over`:
        the caller will never write the entry's tensors again, so a tier that keeps tensors may keep these."""

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    @abstractmethod
    def meta(self, key: str, with_extras: bool = False) -> EntryMeta | None:
        """Metadata, or None; the per-token extras (ranking, boundary) only `with_extras`."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    def check_put(self, entry: KVEntry) -> None:  # noqa: B027 - a store that expects no model accepts all
        """Raise ValueError if this store would refuse `entry` (another model or dtype than it holds)."""

    def room_left(self) -> int | None:
        """Bytes this store takes before it evicts, or None if it keeps no budget of its own (Redis leaves it to
        the server). Cheap: asked for every chunk a placement policy places."""
        return None

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` could be held at all (not more than the whole capacity)."""
        return True

    def clear(self) -> int:
        """Delete every entry; returns how many."""
        return sum(self.delete(key) for key in list(self.keys()))

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing to release
        pass


class TierUnavailable(RuntimeError):
    """A tier's backend could not be reached for a whole-store operation (listing its entries)."""


class ReadMeter:
    """Bytes the tiers' backends fetched for the reads made on one thread while it was on (`metered`)."""

    def __init__(self) -> None:
        self.bytes = 0


_meters = threading.local()


@contextlib.contextmanager
def metered() -> Iterator[ReadMeter]:
    """Measure what this thread's reads really fetch (whole row groups, headers), not the rows handed back."""
    outer, meter = getattr(_meters, "current", None), ReadMeter()
    _meters.current = meter
    try:
        yield meter
    finally:
        _meters.current = outer
        if outer is not None:
            outer.bytes += meter.bytes


HEADER_CACHE_ENTRIES = 256  # parsed headers a blob tier keeps: a few requests' chunks and prefix blocks


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    damaged: int = 0  # entries that failed a check on read (checksum, truncation, layout, foreign key)
    wrong_model: int = 0  # entries for another model fingerprint or dtype than the tier expects
    unavailable: int = 0  # reads the backend could not serve (I/O error, server down)
    puts: int = 0
    duplicates: int = 0  # puts of a key already stored: content-addressed, so nothing is written
    write_errors: int = 0  # skipped writes (disk full, over capacity, server down)
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class Tier(KVStore):
    """A single tier: counters, a lock for them, and the optional model/dtype it accepts."""

    def __init__(self, name: str, *, model_fingerprint: str | None = None, dtype: str | None = None):
        self.name = name
        self.model_fingerprint = model_fingerprint
        self.dtype = dtype
        self.counters = TierStats()
        self._stats_lock = threading.Lock()

    def count(self, counter: str, n: int = 1) -> None:
        with self._stats_lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + n)

    def count_read(self, nbytes: int) -> None:
        """A read fetched `nbytes` from this tier's backend: counted, and on the thread's meter if one is on."""
        self.count("bytes_read", nbytes)
        meter = getattr(_meters, "current", None)
        if meter is not None:
            meter.bytes += nbytes

    def fault(self, counter: str, key: str, why: object) -> None:
        log.warning("%s: %s on %s: %s", self.name, counter.replace("_", " "), key, why)
        self.count(counter)

    def _expects(self, model_fingerprint: str, dtype: str) -> bool:
        return self.model_fingerprint in (None, model_fingerprint) and self.dtype in (None, dtype)

    def accepts(self, key: str, model_fingerprint: str, dtype: str) -> bool:
        """False (counted, logged) for an entry of another model or dtype than this tier expects."""
        if not self._expects(model_fingerprint, dtype):
            self.fault("wrong_model", key, f"entry is {model_fingerprint}/{dtype}")
            return False
        return True

    def check_put(self, entry: KVEntry) -> None:
        if not self._expects(entry.meta.model_fingerprint, entry.meta.dtype):
            raise ValueError(
                f"{self.name} holds {self.model_fingerprint}/{self.dtype} entries; "
                f"got {entry.meta.model_fingerprint}/{entry.meta.dtype} for {entry.key}"
            )

    def usage(self) -> dict[str, int]:
        """Entries and bytes held; tiers that track them cheaply override this."""
        return {}

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            counters = asdict(self.counters)
        return {"tier": self.name, **counters, **self.usage()}


class BlobTier(Tier):
    """A tier that keeps each entry as one encoded blob (disk file, Redis values) and reads byte ranges of it.

    Subclasses implement storage only; this class owns encoding, checks, partial reads and fault handling.
    `backend_errors` are the exceptions that mean "the backend failed", turned into misses or skipped writes.
    `outage_errors` (some of them) mean the whole backend is out, not one entry: the tier then answers every
    call as a miss or a skipped write, without I/O, for `outage_pause` seconds before it tries the backend again.
    """

    backend_errors: tuple[type[BaseException], ...] = (OSError,)
    outage_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, name: str, *, quantize: bool = False, outage_pause: float = 0.0, **expect: str | None):
        """quantize: keep entries in the lossy int8 form (about half the bytes of bf16); reads say so."""
        super().__init__(f"{name} (int8)" if quantize else name, **expect)
        self.quantize = quantize
        self.outage_pause = outage_pause
        self._out_until = 0.0  # time.monotonic() before which the backend is not asked
        # Parsed headers of recently read entries, by key, with the identity of the bytes they were parsed from:
        # a plan reads each entry once per layer, and parsing the header was most of a one-layer read.
        self._headers: OrderedDict[str, tuple[Hashable, EntryReader]] = OrderedDict()
        self._headers_lock = threading.Lock()

    @abstractmethod
    def _open(self, key: str) -> ContextManager[ByteSource | None]:
        """The stored bytes of `key`, or None if absent."""

    @abstractmethod
    def _write(self, key: str, data: bytes) -> None:
        """Store `data` atomically under `key` (readers see the old blob or the new one, never a mix)."""

    @abstractmethod
    def _remove(self, key: str) -> bool: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    def _hit(self, key: str) -> None:
        """Called on every successful read (replacement policies hook in here)."""

    def _load(self, key: str, fn: Callable[[EntryReader], T]) -> T | None:
        """fn applied to the checked entry, or None if it is absent, damaged, foreign or unreachable."""
        check_key(key)
        if self._out("unavailable"):
            return None
        try:
            with self._open(key) as source:
                if source is None:
                    return None
                reader = self._reader(key, source)
                if not self.accepts(key, reader.info.model_fingerprint, reader.info.dtype):
                    return None
                return fn(reader)
        except EntryDamaged as e:
            self.fault("damaged", key, e)
            self._forget_header(key)
            self._drop_damaged(key)
        except self.backend_errors as e:
            self._backend_failed("unavailable", key, e)
        return None

    def is_outage(self, error: BaseException) -> bool:
        """Whether `error` means the whole backend is out (`outage_errors`), not one entry."""
        return isinstance(error, self.outage_errors)

    def in_outage(self) -> bool:
        """Whether the backend failed as a whole less than `outage_pause` seconds ago: it is not asked then."""
        return time.monotonic() < self._out_until

    def _out(self, counter: str) -> bool:
        """in_outage(), the call it skips counted under `counter`."""
        if not self.in_outage():
            return False
        self.count(counter)
        return True

    def _backend_failed(self, counter: str, key: str, error: BaseException) -> None:
        self.fault(counter, key, error)
        if self.outage_pause and self.is_outage(error):
            # A server that hangs costs a whole timeout per call: a request probing twenty keys would wait for
            # twenty of them, and the next request again.
            self._out_until = time.monotonic() + self.outage_pause
            log.warning("%s: unreachable; answering misses without asking it for %.1f s", self.name,
                        self.outage_pause)

    def _reader(self, key: str, source: ByteSource) -> EntryReader:
        """The entry's parsed header over `source`: the cached one if it was parsed from these same bytes."""
        if source.identity is None:
            return EntryReader(source, key)
        with self._headers_lock:
            cached = self._headers.get(key)
            if cached is not None and cached[0] == source.identity:
                self._headers.move_to_end(key)
                return cached[1].rebound(source)
        reader = EntryReader(source, key)
        with self._headers_lock:
            self._headers[key] = (source.identity, reader.rebound(None))
            self._headers.move_to_end(key)
            while len(self._headers) > HEADER_CACHE_ENTRIES:
                self._headers.popitem(last=False)
        return reader

    def _forget_header(self, key: str) -> None:
        with self._headers_lock:
            self._headers.pop(key, None)

    def _read(self, key: str, fn: Callable[[EntryReader], T]) -> T | None:
        """_load for a request: counted as a hit or a miss, and a hit refreshes the key's replacement rank."""
        loaded = self._load(key, lambda reader: (fn(reader), reader.source))
        if loaded is None:
            self.count("misses")
            return None
        result, source = loaded
        self.count("hits")
        self.count_read(source.fetched)  # what the backend handed over: whole row groups, the header
        self._hit(key)
        return result

    def _drop_damaged(self, key: str) -> None:
        # A damaged blob would otherwise block a good re-put forever (puts skip keys that exist).
        with contextlib.suppress(*self.backend_errors):
            self._remove(key)

    def _unless_unavailable(self, key: str, op: Callable[[str], bool]) -> bool:
        """op(key), or False (counted, logged) when the backend fails."""
        check_key(key)
        if self._out("unavailable"):
            return False
        try:
            return op(key)
        except self.backend_errors as e:
            self._backend_failed("unavailable", key, e)
            return False

    def contains(self, key: str) -> bool:
        return self._unless_unavailable(key, self._exists)

    def get(self, key: str) -> KVEntry | None:
        return self._read(key, lambda r: KVEntry(key, *r.read(), r.meta()))

    def get_layers(self, key: str, start: int, stop: int) -> KV | None:
        return self._read(key, lambda r: r.read(range(start, stop)))

    def get_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        return self._read(key, lambda r: r.read(layers, rows))

    def view_picking(self, key: str, rows: Rows, layers: range | None = None) -> PickedKV | None:
        # The row groups read, with the rows to pick (no gathered copy of them).
        return self._read(key, lambda r: r.read_picking(layers, rows, mapped=True))

    def view_layers_picking(self, key: str, start: int, stop: int) -> PickedKV | None:
        # Rank-ordered rows as read, with the token order to pick: putting them in token order first (a gathered
        # copy) cost a 1.6K-token naive prefill from disk 13-15 ms of 200-280.
        return self._read(key, lambda r: r.read_picking(range(start, stop), mapped=True))

    def meta(self, key: str, with_extras: bool = False) -> EntryMeta | None:
        # A look-up, not a read: neither a hit nor a use that protects the entry from eviction.
        return self._load(key, lambda r: r.meta(with_extras=with_extras))

    def put(self, entry: KVEntry, *, handed_over: bool = False) -> bool:
        self.check_put(entry)
        if self._out("write_errors"):
            return False
        if self.contains(entry.key):
            self.count("duplicates")
            return True
        if self._out("write_errors"):  # the look-up found the backend out: a hung server costs one timeout, not two
            return False
        try:
            data = encode(entry, quantize=self.quantize)
        except ValueError as e:  # a form the entry cannot take (int8 of values that are not finite)
            self.fault("write_errors", entry.key, e)
            return False
        try:
            self._write(entry.key, data)
        except self.backend_errors as e:
            self._backend_failed("write_errors", entry.key, e)
            return False
        self.count("puts")
        self.count("bytes_written", len(data))
        return True

    def delete(self, key: str) -> bool:
        self._forget_header(key)
        return self._unless_unavailable(key, self._remove)


def view_planned(store: KVStore, key: str, layers: range, rows: Rows | None, num_rows: int, form: KVForm
                 ) -> PickedKV | None:
    """What a plan loads, for the KV placer: `layers` of the entry's `rows` (None: all of them), or the layers with
    the rows to pick from them (`view_layers_picking`, `view_picking`); None if the entry is missing or damaged, or
    does not hold what the plan counted on: the layers, the `num_rows` rows, or rows of the `form` its cache
    holds (another entry under the key: a writer's bug, or a store two models share under one fingerprint)."""
    try:
        if rows is None:
            picked = store.view_layers_picking(key, layers.start, layers.stop)
        else:
            picked = store.view_picking(key, rows, layers)
    except ValueError:  # the layers or rows lie outside the entry (check_layers, check_rows)
        return None
    if picked is None:
        return None
    k, _, picks = picked
    if (k.shape[0] != len(layers) or (k.shape[1] if picks is None else picks.numel()) != num_rows
            or (k.dtype, tuple(k.shape[2:])) != form):
        return None
    return picked


def nbytes_of(result: object) -> int:
    """Bytes of tensor data in a read's result (an entry or a (k, v) pair)."""
    if isinstance(result, KVEntry):
        return result.nbytes
    if isinstance(result, tuple):
        return sum(t.numel() * t.element_size() for t in result)
    return 0

