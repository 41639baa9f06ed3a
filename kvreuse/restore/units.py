"""Units of restoration work and the two-pointer claim logic, written once for every strategy.

A restoration splits into units along one axis: prefix blocks (token-wise: Cake, CacheFlow's token pointer) or
layers (CacheFlow's layer pointer). The compute side claims units from the front, the I/O side from the back;
each claims its next unit only when it is free (no lock-step), a unit is claimed once, and the run ends when
the pointers meet. An axis says what computing and loading one unit mean; the batch scheduler drives the same
axes and pointers for many requests at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol


class Axis(Protocol):
    """One request's restoration work along one axis. Units are numbered front (0) to back."""

    num_units: int

    def compute(self, unit: int) -> None:
        """Compute `unit`; every unit before it is in place already (computed by this side, in order)."""

    def load(self, unit: int) -> bool:
        """Load `unit` from the store; False if its stored KV is missing or damaged."""

    def recompute(self, units: list[int]) -> None:
        """Compute units whose load failed, once every other unit is in place."""

    def work(self, unit: int) -> int:
        """Size of `unit` in token-layers: what the batch scheduler weighs remaining work by."""

    def tier(self, unit: int) -> int:
        """Index of the store tier the unit loads from (one I/O channel per tier)."""


class TwoPointer:
    """Front and back pointers over units [0, n). Thread-safe; each unit is handed out exactly once."""

    def __init__(self, num_units: int):
        self.front, self.back = 0, num_units
        self.loading = 0  # back claims not yet finished
        self._lock = threading.Lock()

    def claim_front(self) -> int | None:
        with self._lock:
            if self.front >= self.back:
                return None
            self.front += 1
            return self.front - 1

    def claim_back(self) -> int | None:
        with self._lock:
            if self.front >= self.back:
                return None
            self.back -= 1
            self.loading += 1
            return self.back

    def loaded(self) -> None:
        with self._lock:
            self.loading -= 1

    @property
    def met(self) -> bool:
        """Every unit claimed and every claimed load finished: the prefix is in place (up to failed loads)."""
        with self._lock:
            return self.front >= self.back and self.loading == 0

    def peek_back(self) -> int | None:
        with self._lock:
            return self.back - 1 if self.front < self.back else None


@dataclass
class UnitLog:
    """What happened to each unit, and how long it took: the benchmark derives its ideal split from these."""

    computed: dict[int, float] = field(default_factory=dict)  # unit -> seconds
    loaded: dict[int, float] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)  # loads that failed; recomputed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def compute(self, axis: Axis, unit: int) -> None:
        start = time.perf_counter()
        axis.compute(unit)
        self.computed[unit] = time.perf_counter() - start

    def load(self, axis: Axis, unit: int) -> None:
        start = time.perf_counter()
        ok = axis.load(unit)
        with self.lock:
            if ok:
                self.loaded[unit] = time.perf_counter() - start
            else:
                self.failed.append(unit)

    def recompute_failed(self, axis: Axis) -> None:
        if self.failed:
            start = time.perf_counter()
            axis.recompute(sorted(self.failed))
            self.computed[-1] = time.perf_counter() - start  # -1: the recovery step, not a unit of its own

    def summary(self) -> dict:
        return {
            "units_computed": len([u for u in self.computed if u >= 0]),
            "units_loaded": len(self.loaded),
            "units_failed": sorted(self.failed),
            "compute_seconds": {u: t for u, t in sorted(self.computed.items())},
            "load_seconds": {u: t for u, t in sorted(self.loaded.items())},
        }


def two_pointer(axis: Axis, *, compute: bool = True, load: bool = True) -> UnitLog:
    """Restore every unit of `axis`: compute from the front on this thread, load from the back on an I/O thread.

    compute=False is load-only, load=False compute-only: the baselines run through the same code. Failed loads
    are recomputed once the pointers have met.
    """
    import torch  # grad mode is per thread: each worker enters inference mode itself

    pointers, log = TwoPointer(axis.num_units), UnitLog()
    errors: list[BaseException] = []

    def io_worker() -> None:
        try:
            with torch.inference_mode():
                while (unit := pointers.claim_back()) is not None:
                    try:
                        log.load(axis, unit)
                    finally:
                        pointers.loaded()
        except BaseException as e:  # re-raised on the caller's thread: a unit left unclaimed is not restored
            errors.append(e)

    io = threading.Thread(target=io_worker, name="restore-io", daemon=True)
    if load:
        io.start()
    if compute:
        with torch.inference_mode():
            while (unit := pointers.claim_front()) is not None:
                log.compute(axis, unit)
    if load:
        io.join()
    if errors:
        raise errors[0]
    with torch.inference_mode():
        log.recompute_failed(axis)
    return log
