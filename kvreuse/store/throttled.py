"""A wrapper that makes a fast tier behave like a slower device, for benchmarks on one machine.

Each read takes at least `latency + bytes / bandwidth`: the wrapper sleeps for whatever the real read did not
already take. Everything it reports is marked emulated, since the figures come from the model, not a device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from kvreuse.store.base import KV, KVStore, Rows, nbytes_of
from kvreuse.store.entry import EntryMeta, KVEntry

T = TypeVar("T")


@dataclass(frozen=True)
class Device:
    name: str
    read_gbps: float  # GB/s (1e9 bytes)
    latency_ms: float

    def __str__(self) -> str:
        return f"{self.name} (emulated: {self.read_gbps:g} GB/s, {self.latency_ms:g} ms)"


DEVICES = {
    "ssd": Device("ssd", 0.5, 0.1),
    "hdd": Device("hdd", 0.2, 8.0),
    "net10g": Device("net10g", 1.25, 0.2),
}


class ThrottledTier(KVStore):
    def __init__(self, inner: KVStore, device: Device):
        self.inner = inner
        self.device = device
        self.name = f"{inner.name}@{device}"
        self.sleep_seconds = 0.0
        self.writes_are_cheap = inner.writes_are_cheap
        self.reads_wait = True  # the device model's latency and bandwidth are waits
        self.read_latency_seconds = device.latency_ms / 1e3

    def _throttled(self, read: Callable[[], T], nbytes: Callable[[T], int]) -> T:
        start = time.perf_counter()
        result = read()
        if result is not None:
            floor = self.device.latency_ms / 1e3 + nbytes(result) / (self.device.read_gbps * 1e9)
            pause = floor - (time.perf_counter() - start)
            if pause > 0:
                self.sleep_seconds += pause
                time.sleep(pause)
        return result

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def get(self, key: str) -> KVEntry | None:
        return self._throttled(lambda: self.inner.get(key), nbytes_of)

    def get_layers(self, key: str, start: int, stop: int) -> KV | None:
        return self._throttled(lambda: self.inner.get_layers(key, start, stop), nbytes_of)

    def view_layers(self, key: str, start: int, stop: int) -> KV | None:
        return self._throttled(lambda: self.inner.view_layers(key, start, stop), nbytes_of)

    def get_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        return self._throttled(lambda: self.inner.get_rows(key, rows, layers), nbytes_of)

    def view_rows(self, key: str, rows: Rows, layers: range | None = None) -> KV | None:
        return self._throttled(lambda: self.inner.view_rows(key, rows, layers), nbytes_of)

    def put(self, entry: KVEntry, *, handed_over: bool = False) -> bool:
        return self.inner.put(entry, handed_over=handed_over)

    def check_put(self, entry: KVEntry) -> None:
        self.inner.check_put(entry)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def keys(self) -> Iterator[str]:
        return self.inner.keys()

    def meta(self, key: str, with_extras: bool = False) -> EntryMeta | None:
        return self.inner.meta(key, with_extras)

    def fits(self, nbytes: int) -> bool:
        return self.inner.fits(nbytes)

    def room_left(self) -> int | None:
        return self.inner.room_left()

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "tier": self.name, "emulated": str(self.device),
                "throttle_sleep_s": round(self.sleep_seconds, 6)}

    def close(self) -> None:
        self.inner.close()

