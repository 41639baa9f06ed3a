"""Recompute-ratio selection: CacheBlend's loading-hiding rule, CacheTune's roofline prior and its warm-started
golden-section search over measured TTFT.

CacheTune (paper 000, eq. 11 and Algorithm 1) starts from r0 = t_i / (t_c + t_i), clipped to a 15% quality
floor, and refines it with golden-section search. Its literal loop puts r0 in one probe slot and keeps the
golden update rules, so the two probes no longer split the bracket in the golden ratio: with r0 near an end
they can even swap sides, the next comparison then drops the half that holds the optimum, and the loop returns
the final bracket's midpoint, which need not be any point it measured. Following DESIGN.md, r0 here only
shrinks the bracket; both probes are then placed afresh at its golden points, so every later step keeps the
golden invariant, and the answer is the best point ever evaluated, r0 and the ends included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

GOLDEN = (math.sqrt(5) - 1) / 2  # ~0.618: each step keeps this share of the bracket


@dataclass(frozen=True)
class SearchResult:
    x: float  # best point evaluated
    cost: float  # f(x)
    evaluations: tuple[tuple[float, float], ...]  # every (x, f(x)) in the order evaluated, each x once


class _OutOfBudget(Exception):
    pass


class _CachedCost:
    """f evaluated at most once per x (each call is a mean TTFT over a calibration set), and at most `budget`
    times in all."""

    def __init__(self, f: Callable[[float], float], budget: int):
        self.f, self.budget = f, budget
        self.seen: dict[float, float] = {}

    def __call__(self, x: float) -> float:
        if x not in self.seen:
            if len(self.seen) >= self.budget:
                raise _OutOfBudget
            self.seen[x] = float(self.f(x))
        return self.seen[x]

    def best(self) -> SearchResult:
        """The point of least cost among those measured; a NaN (a failed measurement) is never the best."""
        finite = [x for x, cost in self.seen.items() if math.isfinite(cost)]
        if not finite:
            raise ValueError(f"no point of the search had a finite cost: {self.seen}")
        x = min(finite, key=self.seen.__getitem__)
        return SearchResult(x, self.seen[x], tuple(self.seen.items()))


def golden_section(f: Callable[[float], float], lo: float, hi: float, *, warm_start: float | None = None,
                   tol: float = 0.01, max_evals: int = 32) -> SearchResult:
    """Minimise an approximately unimodal f on [lo, hi] to a bracket narrower than `tol`."""
    _check_search(lo, hi, warm_start, tol, max_evals)
    cost = _CachedCost(f, max_evals)
    try:
        a, b = (lo, hi) if warm_start is None else _shrink_around(cost, lo, hi, warm_start)
        a, b = _narrow(cost, a, b, tol)
        # A monotone curve (loading hidden already at the floor, or never) has its optimum at an end, which the
        # probes only approach; measuring the end itself is one evaluation.
        for end in (lo, hi):
            if end in (a, b):
                cost(end)
    except _OutOfBudget:
        pass
    return cost.best()


def _check_search(lo: float, hi: float, warm_start: float | None, tol: float, max_evals: int) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"lo must be below hi (both finite), got lo={lo}, hi={hi}")
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if max_evals < 1:
        raise ValueError(f"max_evals must be at least 1, got {max_evals}")
    if warm_start is not None and not lo <= warm_start <= hi:
        raise ValueError(f"warm_start must lie in [lo, hi] = [{lo}, {hi}], got {warm_start}")


def _shrink_around(cost: _CachedCost, lo: float, hi: float, r0: float) -> tuple[float, float]:
    """Compare r0 with the golden point on the other half and drop the side a unimodal f cannot have its
    minimum on."""
    other = lo + GOLDEN * (hi - lo) if r0 <= (lo + hi) / 2 else hi - GOLDEN * (hi - lo)
    left, right = sorted((r0, other))
    cost(r0)
    return (lo, right) if cost(left) < cost(right) else (left, hi)


def _narrow(cost: _CachedCost, a: float, b: float, tol: float) -> tuple[float, float]:
    """Textbook golden-section search from fresh probes: one new evaluation per step."""
    x1, x2 = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    f1, f2 = cost(x1), cost(x2)
    while b - a > tol:
        if f1 < f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - GOLDEN * (b - a)
            f1 = cost(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + GOLDEN * (b - a)
            f2 = cost(x2)
    return a, b


def roofline_ratio(t_c: float, t_i: float, floor: float = 0.15, ceiling: float = 1.0) -> float:
    """CacheTune eq. 11: the ratio where recomputing r of the rows takes as long as loading the other 1 - r."""
    if not t_c > 0:
        raise ValueError(f"t_c must be positive seconds per token per layer, got {t_c}")
    if not t_i >= 0:
        raise ValueError(f"t_i must be non-negative seconds per token per layer, got {t_i}")
    _check_floor(floor, ceiling)
    return min(max(t_i / (t_c + t_i), floor), ceiling)


def cacheblend_ratio(load_seconds: float, compute_seconds_at: Callable[[float], float], floor: float = 0.15,
                     *, tol: float = 1e-4) -> float:
    """CacheBlend's rule (paper 001, loading controller): max(the ratio whose recompute time equals the per-layer
    load time, floor). Up to that ratio extra recompute hides behind the load and costs no TTFT.
    `compute_seconds_at(r)`, the per-layer recompute time at ratio r, must rise with r."""
    if not load_seconds >= 0:
        raise ValueError(f"load_seconds must be non-negative, got {load_seconds}")
    _check_floor(floor, 1.0)
    if compute_seconds_at(floor) >= load_seconds:
        return floor
    if compute_seconds_at(1.0) < load_seconds:
        return 1.0
    below, above = floor, 1.0  # compute(below) < load <= compute(above)
    while above - below > tol:
        middle = (below + above) / 2
        below, above = (middle, above) if compute_seconds_at(middle) < load_seconds else (below, middle)
    return below  # the side whose recompute still hides behind the load


def _check_floor(floor: float, ceiling: float) -> None:
    if not 0 <= floor <= ceiling <= 1:
        raise ValueError(f"floor and ceiling must satisfy 0 <= floor <= ceiling <= 1, got {floor}, {ceiling}")
