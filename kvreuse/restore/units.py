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
first. The share counts what a span costs beyond its rows: a fixed cost per span (one step per layer), and the
I/O it slows down, since on a CPU both sides share the cores. A span is claimed only if the loading it saves
outweighs the loading lost while it runs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import astuple, dataclass, field
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


@dataclass
class SpanCost:
    """Seconds per compute span = fixed + positions / rate, fitted by least squares over the spans seen. With
    spans of one size only the fixed cost cannot be told apart: it is taken as zero and the rate is the mean."""

    spans: int = 0
    positions: float = 0.0
    seconds: float = 0.0
    positions_sq: float = 0.0
    positions_seconds: float = 0.0
    fastest: float = float("inf")  # the shortest span's seconds: the fixed cost is never more

    def add(self, span: Span, seconds: float) -> None:
        n = len(span)
        self.spans += 1
        self.positions += n
        self.seconds += seconds
        self.positions_sq += n * n
        self.positions_seconds += n * seconds
        self.fastest = min(self.fastest, seconds)

    @property
    def known(self) -> bool:
        return self.positions > 0 and self.seconds > 0

    def fit(self) -> tuple[float, float]:
        """(fixed seconds per span, positions per second past it)."""
        spread = self.spans * self.positions_sq - self.positions**2
        if spread > 0:
            slope = (self.spans * self.positions_seconds - self.positions * self.seconds) / spread
            fixed = (self.seconds - slope * self.positions) / self.spans
            if slope > 0 and 0 <= fixed < self.fastest:
                return fixed, 1 / slope
        return 0.0, self.positions / self.seconds


@dataclass(frozen=True)
class Rates:
    """What each side achieved (None: not measured), carried from one restoration to the next: compute
    positions per second past a fixed cost per span, and load positions per second alone and while the compute
    side runs beside it."""

    compute: float | None = None
    load: float | None = None
    compute_fixed: float | None = None  # seconds per compute span
    load_shared: float | None = None

    def loads(self) -> tuple[float, float] | None:
        """(load rate alone, load rate beside a compute span), each standing in for the other when only one was
        measured; None if neither was."""
        alone, shared = self.load or self.load_shared, self.load_shared or self.load
        return None if alone is None or shared is None else (alone, shared)

    def merged_over(self, older: Rates) -> Rates:
        """These rates, with `older`'s where these were not measured."""
        return Rates(*(new if new is not None else old for new, old in zip(astuple(self), astuple(older))))


class TwoPointer:
    """Front and back pointers over an axis's positions, and how many positions are settled. Thread-safe."""

    def __init__(self, axis: Axis, compute_run: int, prior: Rates = Rates()):
        self.axis, self.compute_run, self.prior = axis, compute_run, prior
        self.front, self.back = 0, axis.length
        self.placed = 0  # positions computed or loaded
        self.failed: list[Span] = []
        self.compute_cost, self.load_rate, self.shared_load_rate = SpanCost(), Rate(), Rate()
        self._computing: Span | None = None
        self._loading: dict[Span, bool] = {}  # loads in flight: whether each ran, at least in part, beside compute
        self._cond = threading.Condition()

    def claim_front(self, io_wait: float = 0.0) -> Span | None:
        """io_wait: seconds before the I/O side starts on this axis's next span (in a batch, the channel serves
        the requests ahead of this one first)."""
        with self._cond:
            size = self._size(io_wait) if self.front < self.back else None
            if size is None:
                return None
            stop = self.axis.compute_stop(self.front, size, self.back)
            span, self.front = Span(self.front, stop), stop
            self._computing = span
            self._loading = dict.fromkeys(self._loading, True)
            return span

    def _size(self, io_wait: float) -> int | None:
        """Positions the compute side claims next: `compute_run` tokens' worth of work, or no more than its
        share of the gap; None (stop) if that share is under a quarter run or not worth its cost.

        With compute rate c past a fixed cost f per span, and the I/O side loading at l alone and l' beside a
        compute span, starting after `io_wait` seconds: a span of n positions ends with the I/O side when
        f + n/c = io_wait + (gap - n)/l', and it saves n/l of loading while costing the I/O side
        (f + n/c)(1 - l'/l)."""
        run = self.compute_run * self.axis.positions_per_token
        rates = self.rates()
        loads = rates.loads()
        if rates.compute is None or loads is None:
            return run
        alone, shared = loads
        fixed = rates.compute_fixed or 0.0
        reach = self.back - self.front + (io_wait - fixed) * shared  # positions the I/O side could load meanwhile
        share = round(reach * rates.compute / (rates.compute + shared))
        if share < max(1, run // 4):
            return None
        size = min(run, share)
        lost_loading = (fixed + size / rates.compute) * max(0.0, 1 - shared / alone)
        return size if size / alone > lost_loading else None

    def rates(self) -> Rates:
        """Each side's rates measured so far in this restoration, else the prior's."""
        fixed, compute = self.compute_cost.fit() if self.compute_cost.known else (None, None)
        measured = Rates(compute, self.load_rate.value if self.load_rate.known else None, fixed,
                         self.shared_load_rate.value if self.shared_load_rate.known else None)
        return measured.merged_over(self.prior)

    def claim_back(self) -> Span | None:
        with self._cond:
            if self.front >= self.back:
                return None
            start = self.axis.load_start(self.back, self.front)
            span, self.back = Span(start, self.back), start
            self._loading[span] = self._computing is not None
            return span

    def next_back(self) -> int | None:
        """The position the I/O side would claim next (the last unclaimed one), if any."""
        with self._cond:
            return self.back - 1 if self.front < self.back else None

    def load_seconds(self) -> float:
        """Seconds the I/O side would take to load every unclaimed position at its rate (0 if not measured)."""
        loads = self.rates().loads()
        return len(self.unclaimed()) / loads[1] if loads else 0.0

    def unclaimed(self) -> Span:
        """The positions neither side has claimed yet."""
        with self._cond:
            return Span(self.front, max(self.front, self.back))

    def settle(self, span: Span, seconds: float, computed: bool) -> None:
        with self._cond:
            self.placed += len(span)
            if computed:
                self.compute_cost.add(span, seconds)
                self._computing = None
            else:
                shared = self._loading.pop(span, False)
                (self.shared_load_rate if shared else self.load_rate).add(span, seconds)
            self._cond.notify_all()

    def fail(self, span: Span) -> None:
        with self._cond:
            self.failed.append(span)
            self._loading.pop(span, None)
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
    an I/O thread from the back (stored blocks); returns once both are done. A single side runs on the caller's
    thread.

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

    sides = [(name, claim, work) for enabled, name, claim, work in [
        (load, "io", pointers.claim_back, lambda s: log.load(axis, pointers, s)),
        (compute, "compute", pointers.claim_front, lambda s: log.compute(axis, pointers, s))] if enabled]
    if len(sides) == 1:  # one side has nothing to overlap with: it runs on the caller's thread
        worker(*sides[0][1:])
    else:
        workers = [threading.Thread(target=worker, args=(claim, work), name=f"restore-{name}", daemon=True)
                   for name, claim, work in sides]
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
