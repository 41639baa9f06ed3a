"""CacheFlow's batch-aware restoration scheduler: several requests restore at once over shared resources.

Each request keeps its own axis and two pointers (the same spans and claim logic as a lone restoration).
Compute goes in batched steps, as in CacheFlow's Algorithm 1 (line 11: every request's next compute unit in
one step): a step takes the next span of every request it serves and runs them through one `forward`, whose
projections and MLP see all their rows at once while each attends over its own cache. A request whose
positions are all in place joins the step with its remainder (the prompt after the prefix, its last token
included), and its future resolves right after. Each store tier is one I/O channel with one worker; after
every span it gives the channel to the request with the most restoration work left (unclaimed token-layers),
since loading the back of a long prefix saves the most recomputation; on a tier that loads faster than the
machine computes, to the one with the least (auto_priority; other priorities: IO_PRIORITIES).
Requests are admitted and finished independently: one admitted during a step joins the next.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch

from kvreuse.model import native
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore.job import JobAxis, PrefixJob, Run, forward
from kvreuse.restore.restorer import (STRATEGIES, PrefixRestoration, PrefixRestorer, RestoreResult, as_ids,
                                     restore_stats)
from kvreuse.restore.units import DEFAULT_COMPUTE_RUN, Rates, Span, TwoPointer, UnitLog

T = TypeVar("T")


@dataclass(eq=False)
class Restoration:
    """One admitted request's state."""

    job: PrefixJob
    axis: JobAxis
    strategy: str
    future: Future
    compute_run: int = DEFAULT_COMPUTE_RUN
    key_weight: float = 0.0  # see key_weight(): prices attention in remaining_recompute
    prior: Rates = Rates()  # what earlier restorations from its tier achieved
    pointers: TwoPointer = field(init=False)
    log: UnitLog = field(default_factory=UnitLog)
    admitted: float = field(default_factory=time.perf_counter)  # when its admission began
    restored: float = 0.0  # when its prefix was all in place
    busy: bool = False  # in a compute step (its spans are computed in order)
    prefix_only: bool = False  # resolves to a PrefixRestoration once its prefix is in place: no remainder

    def __post_init__(self) -> None:
        self.pointers = TwoPointer(self.axis, self.compute_run, self.prior)

    def remaining_work(self) -> float:
        """Token-layers not yet claimed by either side: its length left to restore."""
        return len(self.pointers.unclaimed()) * self.axis.token_layers

    def remaining_recompute(self) -> float:
        """What recomputing the unclaimed positions would cost, in token-layers of projections and MLP: each row
        also attends over the rows before it, so the back of a long prefix costs the most (superlinear)."""
        rows = self.axis.length // self.axis.positions_per_token  # rows per layer (all of them on the token axis)
        return recompute_cost(self.pointers.unclaimed(), rows, self.key_weight) * self.axis.token_layers

    def next_load_tier(self) -> int | None:
        position = self.pointers.next_back()
        return None if position is None else self.axis.tier(position)


def key_weight(model: LayerwiseModel) -> float:
    """What one key adds to a row's recompute cost, relative to the row's projections and MLP in one layer: the
    FLOPs of its score and weighted value over all query heads over the FLOPs of the layer's weights."""
    return 4 * model.num_q_heads * model.head_dim / (2 * sum(p.numel() for p in model.layers[0].parameters()))


def recompute_cost(span: Span, rows: int, weight: float) -> float:
    """Sum over the positions x of `span` of 1 + weight * (x mod rows): position x is row x mod `rows` of its
    layer, which attends over that many rows before it."""
    cost, x = 0.0, span.start
    while x < span.stop:
        lo = x % rows
        hi = min(rows, lo + span.stop - x)
        cost += (hi - lo) + weight * (hi * (hi - 1) - lo * (lo - 1)) / 2
        x += hi - lo
    return cost


# Who gets a tier's I/O channel next, among the requests whose next span to load lives on it: what is measured,
# and whether the most or the least of it wins.
IO_PRIORITIES: dict[str, tuple[Callable[[Restoration], float], Callable[..., Restoration | None]]] = {
    # CacheFlow: the longest length left to restore, whose loads save the most recomputation
    "most-work": (Restoration.remaining_work, max),
    # CacheFlow's stated measure, the remaining recomputation cost, attention included
    "most-recompute": (Restoration.remaining_recompute, max),
    # not CacheFlow: shortest remaining first, which minimises mean completion when the I/O is the bottleneck
    "least-work": (Restoration.remaining_work, min),
}


AUTO_PRIORITY = "auto"  # per tier, from the measured rates: see auto_priority
IO_PRIORITY_CHOICES = (AUTO_PRIORITY, *IO_PRIORITIES)


def auto_priority(rates: Rates) -> str:
    """CacheFlow's rule assumes compute can finish a short request while the channel serves a long one, which
    holds where compute outpaces loading (a GPU over slow storage). Where this tier loads faster than the
    machine recomputes, the channel does most of the restoring and is the batch's bottleneck; then shortest
    remaining first (SRPT) minimises the mean completion time. Rates not measured yet: CacheFlow's rule."""
    loads = rates.loads()
    if loads and rates.compute and loads[0] > rates.compute:
        return "least-work"
    return "most-work"


def io_turn(requests: Sequence[Restoration], tier: int, priority: str = "most-work",
            rates: Callable[[Restoration], Rates] = lambda r: r.pointers.rates()) -> Restoration | None:
    """The request that gets tier `tier`'s I/O channel next, by `priority` (IO_PRIORITY_CHOICES); `rates`: the
    compute and load rates of a request's restoration, which priority auto decides by."""
    waiting = [r for r in requests if r.next_load_tier() == tier]
    if not waiting:
        return None
    measure, pick = IO_PRIORITIES[resolved_priority(priority, rates(waiting[0]))]
    return pick(waiting, key=measure)


def resolved_priority(priority: str, rates: Rates) -> str:
    """`priority`, with auto replaced by what it picks at these rates."""
    return auto_priority(rates) if priority == AUTO_PRIORITY else priority


def io_wait(requests: Sequence[Restoration], request: Restoration, priority: str = "most-work") -> float:
    """Seconds before `request`'s tier channel turns to it: the loading left of the requests on the same tier
    that `priority` serves first. Its compute side claims by it: a request far back in the channel's queue
    is worth computing even where a lone one would just load."""
    tier = request.next_load_tier()
    if tier is None:
        return 0.0
    measure, pick = IO_PRIORITIES[resolved_priority(priority, request.pointers.rates())]
    mine = measure(request)
    ahead = [r for r in requests if r is not request and r.next_load_tier() == tier
             and (measure(r) > mine if pick is max else measure(r) < mine)]
    return sum(r.pointers.load_seconds() for r in ahead)


class BatchRestorer:
    def __init__(self, restorer: PrefixRestorer, compute_workers: int = 1, io_priority: str = AUTO_PRIORITY):
        """compute_workers: threads running compute steps (one GPU stream: 1). With several, each step takes
        its share of the requests not in a step, so that the workers split the batch between them.
        io_priority: who gets a tier's I/O channel after each span (IO_PRIORITY_CHOICES); by default CacheFlow's
        rule, or shortest remaining first on a tier that loads faster than this machine computes (auto_priority)."""
        if io_priority not in IO_PRIORITY_CHOICES:
            raise ValueError(f"unknown I/O priority {io_priority!r}: expected one of {', '.join(IO_PRIORITY_CHOICES)}")
        self.restorer, self.io_priority = restorer, io_priority
        self._active: list[Restoration] = []
        self._cond = threading.Condition()
        self._closed = False
        self._io_workers: dict[int, threading.Thread] = {}
        self.compute_workers = compute_workers
        self._compute = [threading.Thread(target=self._compute_loop, name=f"restore-compute-{i}", daemon=True)
                         for i in range(compute_workers)]
        self._stepping = 0  # compute workers in a step
        for worker in self._compute:
            worker.start()

    # ---- admission ------------------------------------------------------------------------------------

    def submit(self, token_ids: Sequence[int] | torch.Tensor, strategy: str = "auto",
               cache_capacity: int | None = None) -> Future:
        """Admit a request; the future resolves to its RestoreResult (stats["total_seconds"]: admission to
        first-token logits)."""
        return self._admit(self.restorer, token_ids, strategy, cache_capacity)

    def submit_prefix(self, restorer: PrefixRestorer, token_ids: Sequence[int] | torch.Tensor,
                      strategy: str = "auto", cache_capacity: int | None = None, *, max_tokens: int) -> Future:
        """Admit a request for its stored prefix only, as `PrefixRestorer.restore_prefix` restores it alone
        (whole blocks within `max_tokens`, never the last token), in `restorer`'s key space (a tenant's); the
        future resolves to a PrefixRestoration whose later rows are left to the caller (a fusion plan)."""
        return self._admit(restorer, token_ids, strategy, cache_capacity, max_tokens)

    def _admit(self, restorer: PrefixRestorer, token_ids: Sequence[int] | torch.Tensor, strategy: str,
               cache_capacity: int | None, max_tokens: int | None = None) -> Future:
        admitted = time.perf_counter()  # as PrefixRestorer.restore's clock: the look-up and set-up count
        if strategy == "load" or strategy == "compute":
            raise ValueError("the batch scheduler runs two-pointer strategies: cake, layerwise or auto")
        ids = as_ids(token_ids, restorer.model.device)
        blocks = restorer.blocks_to_restore(ids, max_tokens)
        if not blocks and max_tokens is not None:
            raise ValueError("nothing of this prompt's prefix is stored: there is no prefix to restore")
        strategy = restorer.strategy_for(strategy, blocks)
        job = restorer.new_job(ids, blocks, cache_capacity)
        axis = STRATEGIES[strategy][0](job)
        request = Restoration(job, axis, strategy, Future(), restorer.compute_run, key_weight(restorer.model),
                              restorer.prior_rates(axis, job), prefix_only=max_tokens is not None, admitted=admitted)
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch restorer is closed")
            self._active.append(request)
            for tier in {b.tier for b in blocks} - set(self._io_workers):
                self._io_workers[tier] = threading.Thread(target=self._io_loop, args=(tier,), daemon=True,
                                                          name=f"restore-io-{tier}")
                self._io_workers[tier].start()
            self._cond.notify_all()
        return request.future

    def close(self) -> None:
        """Finish the admitted requests, then stop the workers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._compute + list(self._io_workers.values()):
            worker.join()

    # ---- workers --------------------------------------------------------------------------------------

    def _next_step(self) -> list[tuple[Restoration, Span | None]] | None:
        """The next compute step's work, under the lock: for each request not in a step, its next span, or None
        if all its positions are in place (it is finished in the step). With several workers a step takes its
        share of those requests, those with the least work left first (finishing ones before all), while I/O
        serves the one with the most: the two sides work from the two ends of the batch, as they do from the
        two ends of a prefix."""
        idle = sorted((r for r in self._active if not r.busy),
                      key=lambda r: (not r.pointers.settled, r.remaining_work()))
        share = -(-len(idle) // max(1, self.compute_workers - self._stepping))
        work = []
        for request in idle:
            if len(work) == share:
                break
            span = request.pointers.claim_front(io_wait(self._active, request, self.io_priority))
            if span is not None or request.pointers.settled:
                request.busy = True
                work.append((request, span))
        if not work:
            return None
        self._stepping += 1
        return work

    def _compute_loop(self) -> None:
        with torch.inference_mode():
            while (work := self._wait(self._next_step, lambda: not self._active)) is not None:
                self._step(work)
                with self._cond:
                    self._stepping -= 1
                    for request, _ in work:
                        request.busy = False
                    self._cond.notify_all()

    def _step(self, work: list[tuple[Restoration, Span | None]]) -> None:
        """One batched compute step. A request that fails on its own is dropped and the others go on; if the
        shared forward fails, every request in it fails. A prefix-only request whose prefix is in place resolves
        here, with no run."""
        restored = [request for request, span in work if span is None and request.prefix_only]
        for request in restored:
            self._guarded(request, self._prefix_restored, request)
        runs = [(request, span, run) for request, span in work if request not in restored
                and (run := self._guarded(request, self._run_of, request, span)) is not None]
        if not runs:
            return
        start = time.perf_counter()
        try:
            outputs = self._first_token_logits(runs, forward([run for _, _, run in runs]))
        except BaseException as e:
            for request, _, _ in runs:
                self._drop(request, e)
            return
        seconds = time.perf_counter() - start
        for (request, span, _), output in zip(runs, outputs):
            self._guarded(request, self._took, request, span, output, seconds)

    def _first_token_logits(self, runs: list[tuple[Restoration, Span | None, Run]],
                            outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's outputs, with each remainder's replaced by its first-token logits: the requests finishing
        in one step share one LM-head call, a single read of the largest weight matrix, as their projections
        and MLP share the layers' weights."""
        finishing = [i for i, (_, span, _) in enumerate(runs) if span is None]
        if not finishing:
            return outputs
        logits = self.restorer.model.logits(torch.cat([outputs[i][-1:] for i in finishing]))
        for i, row in zip(finishing, logits):
            outputs[i] = row
        return outputs

    def _guarded(self, request: Restoration, action: Callable[..., T], *args: Any) -> T | None:
        """action(*args); if it raises, `request` fails with the error (the others go on)."""
        try:
            return action(*args)
        except BaseException as e:
            self._drop(request, e)
            return None

    @staticmethod
    def _run_of(request: Restoration, span: Span | None) -> Run:
        """A span's run; for a request whose positions are all in place, its remainder's run, once the spans
        whose load failed are recomputed (on their own: faults are rare, and each needs the rows before it)."""
        if span is not None:
            return request.axis.run(span)
        job = request.job
        request.log.recompute_failed(request.axis)
        request.restored = time.perf_counter()
        return job.run(slice(job.prefix_length, len(job.token_ids)))

    def _io_loop(self, tier: int) -> None:
        def claim() -> tuple[Restoration, Span] | None:
            request = io_turn(self._active, tier, self.io_priority)
            span = None if request is None else request.pointers.claim_back()
            return None if span is None else (request, span)

        with torch.inference_mode():
            while (work := self._wait(claim, lambda: not self._active)) is not None:
                request, span = work
                self._guarded(request, request.log.load, request.axis, request.pointers, span)
                with self._cond:
                    self._cond.notify_all()

    def _wait(self, take, idle):
        """take() under the lock, waiting until it gives work; None once closed and idle. A worker about to wait
        releases its idle OpenMP workers first: kept, they would slow every other thread's parallel work (the
        server's engine thread decoding) for as long as this restorer lives (native.release_idle_threads)."""
        with self._cond:
            while (work := take()) is None:
                if self._closed and idle():
                    return None
                native.release_idle_threads()
                self._cond.wait()
            return work

    def _took(self, request: Restoration, span: Span | None, output: torch.Tensor, seconds: float) -> None:
        """A step's output for `request`: its span's hidden state (the span is in place; it took the step's
        `seconds`), or, for its remainder's run (span None), the first-token logits: the request is done and its
        future resolves."""
        if span is not None:
            request.axis.ran(span, output)
            request.log.settle_computed(request.pointers, span, seconds)
            return
        job, logits = request.job, output
        done = time.perf_counter()
        stats = restore_stats(request.strategy, job, request.axis, request.log,
                              restore=request.restored - request.admitted, total=done - request.admitted)
        self.restorer.remember_rates(request.axis, job, request.pointers.rates())
        self._remove(request)
        request.future.set_result(RestoreResult(logits, job.cache, stats))

    def _prefix_restored(self, request: Restoration) -> None:
        request.log.recompute_failed(request.axis)
        request.restored = time.perf_counter()
        stats = restore_stats(request.strategy, request.job, request.axis, request.log,
                              restore=request.restored - request.admitted)
        self.restorer.remember_rates(request.axis, request.job, request.pointers.rates())
        self._remove(request)
        request.future.set_result(PrefixRestoration(request.job, stats))

    def _drop(self, request: Restoration, error: BaseException) -> None:
        if self._remove(request):
            request.future.set_exception(error)

    def _remove(self, request: Restoration) -> bool:
        with self._cond:
            if request not in self._active:
                return False
            self._active.remove(request)
            self._cond.notify_all()
            return True
