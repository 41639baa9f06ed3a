"""What every benchmark of this package shares: variants timed in turns, and the limit a reuse method could reach
(DESIGN.md, "Speed")."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

import torch

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.engine.stats import PrefillStats
from kvreuse.fusion.executor import FusionStats
from kvreuse.fusion.methods import parse_method
from kvreuse.fusion.segments import Request
from kvreuse.store.base import metered

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
NO_TIER = "-"  # full prefill and the peers load nothing from a store


@dataclass(frozen=True)
class PrefillOutcome:
    """What a benchmark keeps of one prefill: not its KV cache, which would pile up over the samples."""

    logits: torch.Tensor
    stats: PrefillStats


def prefill_variant(engine: ReuseEngine, request: Request, method: str) -> Callable[[], PrefillOutcome]:
    def call() -> PrefillOutcome:
        out = engine.prefill(request, method)
        return PrefillOutcome(out.logits, out.stats)

    return call


@dataclass
class Samples(Generic[T]):
    seconds: list[float]
    last: T  # the result of the last call (results are not all kept: each may hold a whole KV cache)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def interleaved_samples(variants: dict[K, Callable[[], T]], repeats: int) -> dict[K, Samples[T]]:
    """Wall seconds of `repeats` calls of each variant after one warm-up call. The variants take turns every
    repeat, so load from elsewhere on the machine falls on all of them alike, in another order each repeat (a
    seeded shuffle), so that no variant always runs after the same one: on a 2-core Xeon, naive right after full
    prefill took 1.36x its time after itself, LegoLink 1.17x (docs/RESULTS.md), and the bench's fixed order had
    put naive after full in every turn."""
    samples = {name: Samples([], fn()) for name, fn in variants.items()}  # warm-up: allocator, kernels, page cache
    order, shuffle = list(variants), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for name in order:
            start = time.perf_counter()
            samples[name].last = variants[name]()
            samples[name].seconds.append(time.perf_counter() - start)
    return samples


def under_its_limit(what: str, seconds: float, limit: float) -> str | None:
    """A warning when a method ran faster than its limit: the limit scales full prefill's time, measured apart from
    the method's runs, so a slow spell then (or a single repeat) lifts it above what the method takes."""
    if seconds >= limit:
        return None
    return (f"warning: {what} took {seconds * 1e3:.1f} ms, under its limit of {limit * 1e3:.1f} ms: full prefill's "
            "time, which the limit scales, was measured slower than it runs; use more --repeats or a quiet machine")


@dataclass
class RequestTimings:
    """One request's variants timed in turns, keyed by (tier, variant): kvreuse's full prefill once under
    NO_TIER (it loads nothing), every other method on every tier, and any other variants (peers) under NO_TIER;
    with each kvreuse variant's limit."""

    samples: dict[tuple[str, str], Samples]
    limits: dict[tuple[str, str], float]

    @property
    def full(self) -> Samples[PrefillOutcome]:
        return self.samples[NO_TIER, "full"]

    def of(self, tier: str, method: str) -> tuple[Samples[PrefillOutcome], float]:
        """A method's samples and limit on a tier (full's, whichever the tier)."""
        key = (NO_TIER, "full") if method == "full" else (tier, method)
        return self.samples[key], self.limits[key]


def time_request(engines: dict[str, ReuseEngine], request: Request, methods: list[str], repeats: int,
                 others: dict[str, Callable[[], object]] | None = None) -> RequestTimings:
    """Compile the request's chunks into every engine's tier (not timed, as in the papers), then time full
    prefill, each method on each tier and the `others` in turns (interleaved_samples)."""
    for tier, engine in engines.items():
        engine.compile(request, methods)
        _check_holds(tier, engine, request, methods)
    reference = next(iter(engines.values()))
    variants: dict[tuple[str, str], Callable[[], object]] = {(NO_TIER, "full"): prefill_variant(reference, request,
                                                                                                "full")}
    variants |= {(tier, method): prefill_variant(engine, request, method)
                 for tier, engine in engines.items() for method in methods if method != "full"}
    variants |= {(NO_TIER, name): fn for name, fn in (others or {}).items()}
    samples = interleaved_samples(variants, repeats)
    full = samples[NO_TIER, "full"]
    limits = {(NO_TIER, "full"): limit_seconds(full.last.stats.fusion, (0.0, 0), full.median, len(request))}
    for tier, engine in engines.items():
        read_all = read_all_seconds(engine, request)
        for method in methods:
            if method != "full":
                stats = samples[tier, method].last.stats.fusion
                limits[tier, method] = limit_seconds(stats, read_all, full.median, len(request))
    return RequestTimings(samples, limits)


def _check_holds(tier: str, engine: ReuseEngine, request: Request, methods: list[str]) -> None:
    """A tier that cannot give back what was just compiled into it (unreachable, too small for one prompt's
    chunks) would time full prefills under the names of reuse methods: refused by name."""
    for method in methods:
        missing = sum(p.key is not None and not p.hit for p in engine.lookup(request, method))
        if missing:
            raise ValueError(f"tier {tier}: {missing} of a prompt's chunks cannot be read back right after they were "
                             f"compiled (its store is unreachable, or too small for one prompt): its {method} "
                             "figures would be full prefill's")


def read_all_seconds(engine: ReuseEngine, request: Request) -> tuple[float, int]:
    """Time to read every stored entry of the request whole from the engine's tier, and their bytes: the
    tier's bandwidth as measured on this very request, the load side of the limit."""
    keys = [p.key for p in engine.lookup(request, parse_method("naive")) if p.hit]
    with metered() as meter:  # the bytes the tier fetched, as a plan's bytes_loaded counts them
        start = time.perf_counter()
        for key in keys:
            engine.store.get(key)
        elapsed = time.perf_counter() - start
    return elapsed, meter.bytes


def limit_seconds(stats: FusionStats, read_all: tuple[float, int], full_seconds: float, prompt_rows: int) -> float:
    """The larger of the time to read the bytes the method loaded (at the tier's measured rate) and the time to
    compute the rows it recomputed (full prefill's time per row and layer, times the rows it computed)."""
    seconds, nbytes = read_all
    load_floor = seconds * stats.bytes_loaded / nbytes if nbytes else 0.0
    compute_floor = full_seconds * stats.computed_rows_mean / prompt_rows
    return max(load_floor, compute_floor)
