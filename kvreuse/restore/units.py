"""Units of restoration work and the two-pointer claim logic, written once for every strategy.

A restoration splits into units along one axis: prefix blocks (token-wise: Cake, CacheFlow's token pointer) or
layers (CacheFlow's layer pointer). The compute side claims units from the front, the I/O side from the back;
each claims its next unit only when it is free (no lock-step), and the run ends when the pointers meet. An
axis says what computing and loading one unit mean; the batch scheduler drives the same axes and pointers for
many requests at once.

A unit is claimed once by each side at most. When the I/O side finds nothing left to claim while the compute
side is still working on its last unit, it loads that unit too (Cake's pointers move when a chunk is done,
not when it is begun): whichever side finishes first settles it. The compute side writes each layer's KV only
while its unit is unsettled, so once the load has won it writes nothing more and stops at its next layer; the
restoration does not wait for it. Without this, a restoration could never beat the time to compute one unit,
even where loading all of them is faster, which on a CPU it often is.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

Write = Callable[[], None]
# guard(write): do the compute side's write unless its unit was settled by the I/O side; False: stop computing.
Guard = Callable[[Write], bool]


class Axis(Protocol):
    """One request's restoration work along one axis. Units are numbered front (0) to back."""

    num_units: int

    def compute(self, unit: int, guard: Guard) -> None:
        """Compute `unit` (every unit before it is in place), each cache write through `guard`; return as soon
        as guard refuses one."""

    def read(self, unit: int) -> Any | None:
        """Read `unit` from the store, ready to place; None if its stored KV is missing or damaged."""

    def place(self, unit: int, data: Any) -> None:
        """Write what `read` gave into the request's cache."""

    def recompute(self, units: list[int]) -> None:
        """Compute units whose load failed, once every other unit is in place."""

    def work(self, unit: int) -> int:
        """Size of `unit` in token-layers: what the batch scheduler weighs remaining work by."""

    def tier(self, unit: int) -> int:
        """Index of the store tier the unit loads from (one I/O channel per tier)."""


class TwoPointer:
    """Front and back pointers over units [0, n), and which units are settled. Thread-safe."""

    def __init__(self, num_units: int):
        self.num_units = num_units
        self.front, self.back = 0, num_units
        self.computing: int | None = None  # the compute side's current unit
        self.stolen: int | None = None  # a unit the I/O side took over from the compute side
        self.done: set[int] = set()
        self.failed: set[int] = set()
        self._cond = threading.Condition()

    def claim_front(self) -> int | None:
        with self._cond:
            if self.front >= self.back:
                return None
            self.front += 1
            self.computing = self.front - 1
            return self.computing

    def claim_back(self) -> int | None:
        with self._cond:
            unit = self._next_back()
            if self.front < self.back:
                self.back -= 1
            elif unit is not None:
                self.stolen = unit
            return unit

    def peek_back(self) -> int | None:
        """The unit claim_back would give now."""
        with self._cond:
            return self._next_back()

    def _next_back(self) -> int | None:
        if self.front < self.back:
            return self.back - 1
        unit = self.computing
        return unit if unit is not None and unit not in self.done and unit != self.stolen else None

    def guard(self, unit: int) -> Guard:
        def guarded(write: Write) -> bool:
            with self._cond:
                if unit in self.done:
                    return False
                write()
                return True

        return guarded

    def settle(self, unit: int, write: Write = lambda: None) -> bool:
        """Run write() and mark `unit` done, unless the other side settled it first; True if this side won."""
        with self._cond:
            if self.computing == unit:
                self.computing = None
            if unit in self.done:
                return False
            write()
            self.done.add(unit)
            self._cond.notify_all()
            return True

    def fail(self, unit: int) -> bool:
        """A load failed: True if the unit must be recomputed (one the compute side is on is left to it)."""
        with self._cond:
            if unit == self.stolen:
                return False
            self.failed.add(unit)
            self._cond.notify_all()
            return True

    @property
    def settled(self) -> bool:
        """Every unit is placed or known to need recomputing."""
        with self._cond:
            return len(self.done | self.failed) == self.num_units

    def wait_settled(self, or_else: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: or_else() or self.settled)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


@dataclass
class UnitLog:
    """What happened to each unit, and how long it took: the benchmark derives its ideal split from these."""

    computed: dict[int, float] = field(default_factory=dict)  # unit -> seconds
    loaded: dict[int, float] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)  # loads that failed; recomputed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    workers: list[threading.Thread] = field(default_factory=list, repr=False)  # may outlive the restoration

    def compute(self, axis: Axis, pointers: TwoPointer, unit: int) -> None:
        start = time.perf_counter()
        axis.compute(unit, pointers.guard(unit))
        if pointers.settle(unit):
            self.computed[unit] = time.perf_counter() - start

    def load(self, axis: Axis, pointers: TwoPointer, unit: int) -> None:
        start = time.perf_counter()
        data = axis.read(unit)
        if data is None:
            if pointers.fail(unit):
                with self.lock:
                    self.failed.append(unit)
        elif pointers.settle(unit, lambda: axis.place(unit, data)):
            with self.lock:
                self.loaded[unit] = time.perf_counter() - start

    def recompute_failed(self, axis: Axis, pointers: TwoPointer) -> None:
        units = sorted(pointers.failed - pointers.done)
        if units:
            start = time.perf_counter()
            axis.recompute(units)
            self.computed[-1] = time.perf_counter() - start  # -1: the recovery step, not a unit of its own

    def summary(self) -> dict:
        return {
            "units_computed": len([u for u in self.computed if u >= 0]),
            "units_loaded": len(self.loaded),
            "units_failed": sorted(self.failed),
            "compute_seconds": dict(sorted(self.computed.items())),
            "load_seconds": dict(sorted(self.loaded.items())),
        }


def two_pointer(axis: Axis, *, compute: bool = True, load: bool = True) -> UnitLog:
    """Restore every unit of `axis`: a compute thread from the front, an I/O thread from the back; returns once
    every unit is settled.

    compute=False is load-only, load=False compute-only: the baselines run through the same code. Failed loads
    are recomputed on the caller's thread once every other unit is in place. The side that lost a race for the
    last unit may still be busy when this returns; it writes nothing.
    """
    pointers, log = TwoPointer(axis.num_units), UnitLog()
    errors: list[BaseException] = []

    def worker(claim: Callable[[], int | None], work: Callable[[int], None]) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread
                while (unit := claim()) is not None:
                    work(unit)
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)
        finally:
            pointers.wake()

    sides = [(load, "io", pointers.claim_back, lambda u: log.load(axis, pointers, u)),
             (compute, "compute", pointers.claim_front, lambda u: log.compute(axis, pointers, u))]
    for enabled, name, claim, work in sides:
        if enabled:
            log.workers.append(threading.Thread(target=worker, args=(claim, work), name=f"restore-{name}",
                                                daemon=True))
            log.workers[-1].start()
    pointers.wait_settled(or_else=lambda: bool(errors))
    for straggler in log.workers:
        if straggler.is_alive():
            _deprioritise(straggler)
    if errors:
        raise errors[0]
    with torch.inference_mode():
        log.recompute_failed(axis, pointers)
    return log


def _deprioritise(thread: threading.Thread) -> None:
    """A worker still finishing a lost race only wastes CPU now: let the request's next steps have the core
    first (Linux sets nice values per thread; elsewhere this does nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, thread.native_id, 19)
