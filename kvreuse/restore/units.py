"""Spans of restoration work and the two-pointer claim logic, written once for every strategy.

A restoration's work is a line of positions [0, length) along one axis: prefix rows (token-wise: Cake,
CacheFlow's token pointer; a position is one row through every layer) or layer-major cells (CacheFlow's layer
pointer; a position is one row of one layer). The compute side claims spans from the front, the I/O side from
the back; each claims its next span only when it is free (no lock-step), every position is claimed exactly
once, and the run ends when the pointers meet.

The two sides claim at different granularities. The I/O side claims what the store holds as one read: a
stored block (of one layer, on the layer axis), clipped at the compute side's pointer, since a block can be
read in part. The compute side claims short runs of rows, so that the meeting point can fall inside a block:
with whole blocks on both sides, a restoration could never be faster than computing one block, which on a CPU
is often slower than loading every block. The compute side claims no more than its share of the gap at the
two sides' rates (measured in this restoration, or in earlier ones until both sides have finished a span), and
stops when that share is under a quarter run: it would hold the I/O side up with a span it could not finish
first.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch


@dataclass(frozen=True)
class Span:
    """Positions [start, stop) of an axis."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


class Axis(Protocol):
    """One request's restoration work along one axis: positions [0, length), front to back."""

    length: int
    positions_per_token: int  # 1 on the token axis, the number of layers on the layer axis
    token_layers: int  # token-layers per position: what the batch scheduler weighs remaining work by

    def compute_stop(self, start: int, size: int, limit: int) -> int:
        """End of a compute span of at most `size` positions from `start`, not past `limit`."""

    def load_start(self, stop: int, limit: int) -> int:
        """Start of the stored piece ending at `stop` (its block's start), not before `limit`."""

    def compute(self, span: Span) -> None:
        """Compute `span`; every position before it is in place."""

    def read(self, span: Span) -> Any | None:
        """Read `span` from the store, ready to place; None if its stored KV is missing or damaged."""

    def place(self, span: Span, data: Any) -> None:
        """Write what `read` gave into the request's cache."""

    def recompute(self, spans: list[Span]) -> None:
        """Compute spans whose load failed, once every other position is in place."""

    def tier(self, position: int) -> int:
        """Index of the store tier the position loads from (one I/O channel per tier)."""


@dataclass
class Rate:
    """Positions per second one side has achieved so far."""

    positions: int = 0
    seconds: float = 0.0

    def add(self, span: Span, seconds: float) -> None:
        self.positions += len(span)
        self.seconds += seconds

    @property
    def known(self) -> bool:
        return self.positions > 0 and self.seconds > 0

    @property
    def value(self) -> float:
        return self.positions / self.seconds


@dataclass(frozen=True)
class Rates:
    """Positions per second of each side (None: not measured), carried from one restoration to the next."""

    compute: float | None = None
    load: float | None = None


class TwoPointer:
    """Front and back pointers over an axis's positions, and how many positions are settled. Thread-safe."""

    def __init__(self, axis: Axis, compute_run: int, prior: Rates = Rates(), *, by_rates: bool = True):
        """by_rates=False: whole runs always (in a batch, how much of the I/O channel a request gets is not its
        own to measure)."""
        self.axis, self.compute_run, self.prior, self.by_rates = axis, compute_run, prior, by_rates
        self.front, self.back = 0, axis.length
        self.placed = 0  # positions computed or loaded
        self.failed: list[Span] = []
        self.compute_rate, self.load_rate = Rate(), Rate()
        self._cond = threading.Condition()

    def claim_front(self) -> Span | None:
        with self._cond:
            size = self._size() if self.front < self.back else None
            if size is None:
                return None
            stop = self.axis.compute_stop(self.front, size, self.back)
            span, self.front = Span(self.front, stop), stop
            return span

    def _size(self) -> int | None:
        """Positions the compute side claims next: `compute_run` tokens' worth of work, or no more than its
        share of the gap at both sides' rates; None (stop) if that share is under a quarter run, since every
        span has a fixed cost."""
        run = self.compute_run * self.axis.positions_per_token
        compute, load = self.rates().compute, self.rates().load
        if compute is None or load is None or not self.by_rates:
            return run
        share = (self.back - self.front) * compute / (compute + load)
        return min(run, round(share)) if share >= max(1, run // 4) else None

    def rates(self) -> Rates:
        """Each side's rate measured so far in this restoration, else the prior's."""
        return Rates(self.compute_rate.value if self.compute_rate.known else self.prior.compute,
                     self.load_rate.value if self.load_rate.known else self.prior.load)

    def claim_back(self) -> Span | None:
        with self._cond:
            if self.front >= self.back:
                return None
            start = self.axis.load_start(self.back, self.front)
            span, self.back = Span(start, self.back), start
            return span

    def next_back(self) -> int | None:
        """The position the I/O side would claim next (the last unclaimed one), if any."""
        with self._cond:
            return self.back - 1 if self.front < self.back else None

    def unclaimed(self) -> Span:
        """The positions neither side has claimed yet."""
        with self._cond:
            return Span(self.front, max(self.front, self.back))

    def settle(self, span: Span, seconds: float, computed: bool) -> None:
        with self._cond:
            self.placed += len(span)
            (self.compute_rate if computed else self.load_rate).add(span, seconds)
            self._cond.notify_all()

    def fail(self, span: Span) -> None:
        with self._cond:
            self.failed.append(span)
            self._cond.notify_all()

    @property
    def settled(self) -> bool:
        """Every position is placed or known to need recomputing."""
        with self._cond:
            return self.placed + sum(len(s) for s in self.failed) == self.axis.length


@dataclass
class UnitLog:
    """What happened to each span, and how long it took: the benchmark derives its ideal split from these."""

    computed: list[tuple[Span, float]] = field(default_factory=list)
    loaded: list[tuple[Span, float]] = field(default_factory=list)
    failed: list[Span] = field(default_factory=list)  # loads that failed; recomputed
    recovery_seconds: float = 0.0
    rates: Rates = Rates()  # both sides' rates at the end, for the next restoration's first claims
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def compute(self, axis: Axis, pointers: TwoPointer, span: Span) -> None:
        start = time.perf_counter()
        axis.compute(span)
        self.settle_computed(pointers, span, time.perf_counter() - start)

    def settle_computed(self, pointers: TwoPointer, span: Span, seconds: float) -> None:
        """`span` is computed, in `seconds` (in a batch: the wall time of the step it shared with others)."""
        with self.lock:
            self.computed.append((span, seconds))
        pointers.settle(span, seconds, computed=True)

    def load(self, axis: Axis, pointers: TwoPointer, span: Span) -> None:
        start = time.perf_counter()
        data = axis.read(span)
        if data is None:
            with self.lock:
                self.failed.append(span)
            pointers.fail(span)
            return
        axis.place(span, data)
        seconds = time.perf_counter() - start
        with self.lock:
            self.loaded.append((span, seconds))
        pointers.settle(span, seconds, computed=False)

    def recompute_failed(self, axis: Axis) -> None:
        if self.failed:
            start = time.perf_counter()
            axis.recompute(sorted(self.failed, key=lambda s: s.start))
            self.recovery_seconds = time.perf_counter() - start

    def summary(self, axis: Axis) -> dict:
        """Tokens computed and loaded (in whole-token equivalents on the layer axis), also per store tier."""

        def by_tier(spans: list[Span]) -> dict[int, float]:
            positions: dict[int, int] = {}
            for span in spans:
                tier = axis.tier(span.start)
                positions[tier] = positions.get(tier, 0) + len(span)
            return {tier: n / axis.positions_per_token for tier, n in sorted(positions.items())}

        computed = [s for s, _ in self.computed] + self.failed
        loaded = [s for s, _ in self.loaded]
        return {
            "tokens_computed": sum(len(s) for s in computed) / axis.positions_per_token,
            "tokens_loaded": sum(len(s) for s in loaded) / axis.positions_per_token,
            "tokens_computed_by_tier": by_tier(computed),
            "tokens_loaded_by_tier": by_tier(loaded),
            "spans_computed": len(self.computed),
            "spans_loaded": len(self.loaded),
            "spans_failed": [[s.start, s.stop] for s in sorted(self.failed, key=lambda s: s.start)],
            "compute_spans": [[s.start, s.stop, t] for s, t in sorted(self.computed, key=lambda c: c[0].start)],
            "load_spans": [[s.start, s.stop, t] for s, t in sorted(self.loaded, key=lambda c: c[0].start)],
            "recovery_seconds": self.recovery_seconds,
        }


DEFAULT_COMPUTE_RUN = 32  # tokens' worth of work per compute span


def two_pointer(axis: Axis, *, compute: bool = True, load: bool = True, compute_run: int = DEFAULT_COMPUTE_RUN,
                prior: Rates = Rates()) -> UnitLog:
    """Restore every position of `axis`: a compute thread from the front (spans of `compute_run` tokens' work),
    an I/O thread from the back (stored blocks); returns once both are done.

    compute=False is load-only, load=False compute-only: the baselines run through the same code. Failed loads
    are recomputed on the caller's thread once every other position is in place. `prior`: the rates earlier
    restorations achieved (sizes the compute side's spans until this one has measured both sides).
    """
    pointers, log = TwoPointer(axis, compute_run, prior if compute and load else Rates()), UnitLog()
    errors: list[BaseException] = []

    def worker(claim: Callable[[], Span | None], work: Callable[[Span], None]) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread
                while (span := claim()) is not None:
                    work(span)
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)

    sides = [(load, "io", pointers.claim_back, lambda s: log.load(axis, pointers, s)),
             (compute, "compute", pointers.claim_front, lambda s: log.compute(axis, pointers, s))]
    workers = [threading.Thread(target=worker, args=(claim, work), name=f"restore-{name}", daemon=True)
               for enabled, name, claim, work in sides if enabled]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    if errors:
        raise errors[0]
    with torch.inference_mode():
        log.recompute_failed(axis)
    log.rates = pointers.rates()
    return log
