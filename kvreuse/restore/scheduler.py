"""CacheFlow's batch-aware restoration scheduler: several requests restore at once over shared resources.

Each request keeps its own axis and two pointers (the same spans and claim logic as a lone restoration). One
compute worker serves every request, a span at a time in turn. Each store tier is one I/O channel with one
worker; after every span it gives the channel to the request with the most restoration work left (unclaimed
token-layers), since loading the back of a long prefix saves the most recomputation. Requests are admitted
and finished independently: a request's future resolves as soon as its own prefix is in place and its
remainder computed.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvreuse.restore.job import PrefixJob
from kvreuse.restore.restorer import STRATEGIES, PrefixRestorer, RestoreResult, _as_ids, restore_stats
from kvreuse.restore.units import DEFAULT_COMPUTE_RUN, Axis, Span, TwoPointer, UnitLog


@dataclass(eq=False)
class Restoration:
    """One admitted request's state."""

    job: PrefixJob
    axis: Axis
    strategy: str
    future: Future
    compute_run: int = DEFAULT_COMPUTE_RUN
    pointers: TwoPointer = field(init=False)
    log: UnitLog = field(default_factory=UnitLog)
    admitted: float = field(default_factory=time.perf_counter)
    busy: bool = False  # a compute worker is on one of its spans (they are computed in order)

    def __post_init__(self) -> None:
        self.pointers = TwoPointer(self.axis, self.compute_run, by_rates=False)

    def remaining_work(self) -> int:
        """Token-layers not yet claimed by either side."""
        return self.pointers.unclaimed() * self.axis.token_layers

    def next_load_tier(self) -> int | None:
        position = self.pointers.next_back()
        return None if position is None else self.axis.tier(position)


def most_remaining(requests: Sequence[Restoration], tier: int) -> Restoration | None:
    """The request that gets tier `tier`'s I/O channel next: the one with the most work left among those whose
    next span to load lives on that tier."""
    waiting = [r for r in requests if r.next_load_tier() == tier]
    return max(waiting, key=Restoration.remaining_work, default=None)


class BatchRestorer:
    def __init__(self, restorer: PrefixRestorer, compute_workers: int = 1):
        """compute_workers: threads computing spans, each of another request (one GPU stream: 1; a CPU may
        give each core one)."""
        self.restorer = restorer
        self._active: list[Restoration] = []
        self._cond = threading.Condition()
        self._closed = False
        self._io_workers: dict[int, threading.Thread] = {}
        self._compute = [threading.Thread(target=self._compute_loop, name=f"restore-compute-{i}", daemon=True)
                         for i in range(compute_workers)]
        for worker in self._compute:
            worker.start()

    # ---- admission ------------------------------------------------------------------------------------

    def submit(self, token_ids: Sequence[int] | torch.Tensor, strategy: str = "auto",
               cache_capacity: int | None = None) -> Future:
        """Admit a request; the future resolves to its RestoreResult (stats["total_seconds"]: admission to
        first-token logits)."""
        if strategy == "load" or strategy == "compute":
            raise ValueError("the batch scheduler runs two-pointer strategies: cake, layerwise or auto")
        restorer = self.restorer
        ids = _as_ids(token_ids, restorer.model.device)
        blocks = restorer.plan(ids)
        strategy = restorer.choose(strategy, blocks)
        job = restorer.new_job(ids, blocks, cache_capacity)
        request = Restoration(job, STRATEGIES[strategy][0](job), strategy, Future(), restorer.compute_run)
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

    def _next_compute(self) -> tuple[Restoration, Span | None] | None:
        """A request whose positions are all settled is finished first (span None); else a span of the request
        with the least restoration work left, while I/O serves the one with the most: the two sides work
        from the two ends of the batch, as they do from the two ends of a prefix."""
        idle = [r for r in self._active if not r.busy]
        for request in sorted(idle, key=lambda r: (not r.pointers.settled, r.remaining_work())):
            span = request.pointers.claim_front()
            if span is not None or request.pointers.settled:
                request.busy = True
                return request, span
        return None

    def _compute_loop(self) -> None:
        with torch.inference_mode():
            while (work := self._wait(self._next_compute, lambda: not self._active)) is not None:
                request, span = work
                try:
                    if span is None:
                        self._finish(request)
                    else:
                        request.log.compute(request.axis, request.pointers, span)
                except BaseException as e:  # that request fails; the others go on
                    self._drop(request, e)
                with self._cond:
                    request.busy = False
                    self._cond.notify_all()

    def _io_loop(self, tier: int) -> None:
        def claim() -> tuple[Restoration, Span] | None:
            request = most_remaining(self._active, tier)
            span = None if request is None else request.pointers.claim_back()
            return None if span is None else (request, span)

        with torch.inference_mode():
            while (work := self._wait(claim, lambda: not self._active)) is not None:
                request, span = work
                try:
                    request.log.load(request.axis, request.pointers, span)
                except BaseException as e:
                    self._drop(request, e)
                with self._cond:
                    self._cond.notify_all()

    def _wait(self, take, idle):
        """take() under the lock, waiting until it gives work; None once closed and idle."""
        with self._cond:
            while (work := take()) is None:
                if self._closed and idle():
                    return None
                self._cond.wait()
            return work

    def _finish(self, request: Restoration) -> None:
        job = request.job
        request.log.recompute_failed(request.axis)
        restored = time.perf_counter()
        hidden = job.compute_rows(slice(job.prefix_length, len(job.token_ids)))
        logits = job.model.logits(hidden[-1:])[0]
        done = time.perf_counter()
        stats = restore_stats(request.strategy, job, request.axis, request.log, restore=restored - request.admitted,
                              total=done - request.admitted)
        self._remove(request)
        request.future.set_result(RestoreResult(logits, job.cache, stats))

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
