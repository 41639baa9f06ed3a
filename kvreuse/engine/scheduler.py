"""Continuous batching: generation jobs queue, are admitted up to a running limit, and decode together.

One engine thread owns all torch work. Each iteration it runs the calls handed to it (cache compilation), ends
cancelled and timed-out jobs, admits waiting jobs (their prefill goes through ReuseEngine, so the exact prefix
and stored chunks are reused), steps every running sequence's decode as one batch, then runs pending store
writes of what requests computed (`engine.write_back`: chunks to compile, prefix blocks), one at least and more
while they have taken less than WRITE_BACK_SHARE of the step's time. Up to `max_prefill_batch` jobs are admitted
per iteration: when several wait, their stored prefixes are restored together, as CacheFlow restores a batch
(`ReuseEngine.prefill_batch`), and the running sequences take a decoding step between two of the batch's
prompts, so that a token waits for one prompt, not the batch. With `max_token_gap` set, they also take one
between two layers of a prompt once they have waited that long for a token (a prompt whose job is cancelled
stops there either way). Each decoding step outside the engine's own steps is followed by store writes, as those
are, for a share of the time since the last ones. A running sequence's KV lives in a slot of the scheduler's
`KVPool`, so that each decoding step attends every sequence in one call per layer (a sequence the pool cannot
hold decodes from its own cache). A job of several choices (OpenAI's `n`) has its prompt computed once; each
choice then decodes from its own copy of that KV and holds a running slot. Jobs report through a callback they
supply, called on the engine thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvreuse.engine.generate import Generation, TextStream, eos_token_ids
from kvreuse.engine.reuse import FusedPrefill, ReuseEngine
from kvreuse.engine.sampling import Sampler, SamplingParams, TokenLogprob
from kvreuse.engine.stats import PrefillStats
from kvreuse.fusion.segments import Request
from kvreuse.model.kv_cache import KVCache
from kvreuse.model import native
from kvreuse.model.kv_pool import KVPool

log = logging.getLogger(__name__)
IDLE_WAIT_SECONDS = 0.05  # how often an idle engine thread looks at deadlines
DEFAULT_POOL_BYTES = 4 << 30  # the running sequences' KV pool: SmolLM2 in fp32 holds 8 x 11K rows in it
# Store writes may take this share of the engine's time since they last ran (a third of a busy engine's time).
# One write a step fell behind prompts of many small documents, each write far cheaper than a step of prompts
# (docs/RESULTS.md, "Store writes by the step's time").
WRITE_BACK_SHARE = 0.5


class QueueFull(RuntimeError):
    """Admission control: the waiting queue is at its limit."""


class JobTimeout(TimeoutError):
    pass


class JobCancelled(RuntimeError):
    pass


class ShuttingDown(JobCancelled):
    """The server stopped before the job finished."""


@dataclass
class JobEvent:
    choice: int = 0  # which of the job's choices the text, log-probabilities and result are of
    text: str = ""  # text settled since the previous event
    logprobs: list[TokenLogprob] | None = None  # of the tokens taken since the previous event, when asked for
    result: Generation | None = None  # set on the last event of a finished choice
    error: BaseException | None = None  # set on the last event of a failed, timed-out or cancelled job (once)


@dataclass(eq=False)  # jobs are compared by identity: two clients may send the very same request
class GenerationJob:
    request: Request
    sampling: SamplingParams
    on_event: Callable[[JobEvent], None]  # called on the engine thread
    method: str | None = None
    timeout: float | None = None  # seconds from arrival, queueing included
    choices: int = 1  # sequences sampled from the one prompt (OpenAI's n); choice i draws with seed + i
    arrived: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop at the next step (thread-safe); the job then reports JobCancelled, unless it finished first."""
        self._cancelled.set()

    def failure(self, now: float) -> BaseException | None:
        if self._cancelled.is_set():
            return JobCancelled("cancelled by the client")
        if self.timeout is not None and now - self.arrived > self.timeout:
            return JobTimeout(f"request timed out after {self.timeout:g} s")
        return None


@dataclass(eq=False)
class _Sequence:
    job: GenerationJob
    choice: int
    cache: KVCache
    sampler: Sampler
    stream: TextStream
    stats: PrefillStats
    ttft: float = 0.0
    last_token: int = -1


def _given_up(abandoned: threading.Event | None, _now: float) -> BaseException | None:
    """A call's failure between two of its layers: its caller gave up on it (gone or timed out)."""
    if abandoned is not None and abandoned.is_set():
        return JobCancelled("its caller gave up (gone or timed out) while it ran")
    return None


class Scheduler:
    def __init__(self, engine: ReuseEngine, max_running: int = 8, max_waiting: int = 128,
                 on_decode_step: Callable[[int], None] | None = None, max_prefill_batch: int = 4,
                 pool_bytes: int = DEFAULT_POOL_BYTES, max_token_gap: float | None = None):
        if max_running < 1 or max_waiting < 0 or max_prefill_batch < 1:
            raise ValueError(f"max_running and max_prefill_batch must be >= 1 and max_waiting >= 0, got "
                             f"{max_running}, {max_prefill_batch}, {max_waiting}")
        if max_token_gap is not None and not max_token_gap >= 0:
            raise ValueError(f"max_token_gap must be >= 0 seconds (or None), got {max_token_gap}")
        self.engine, self.max_running, self.max_waiting = engine, max_running, max_waiting
        self.max_prefill_batch, self.max_token_gap = max_prefill_batch, max_token_gap
        self._last_decode = 0.0  # when the last decoding step ended (perf_counter)
        self._step_started = self._writes_ended = 0.0  # when the engine step began, the last store writes ended
        self.on_decode_step = on_decode_step
        self._eos_ids = eos_token_ids(engine.loaded)
        self._waiting: deque[GenerationJob] = deque()
        self._running: list[_Sequence] = []
        # The choices of jobs taken from the queue whose prompts are being computed: they hold running slots before
        # they join `_running` (a long prompt takes seconds), for admission and for the gauges alike.
        self._prefilling = 0
        self.pool = KVPool.for_model(engine.model, max_running, pool_bytes)
        self._calls: deque[tuple[Callable[[], Any], Future, threading.Event | None]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._ending: BaseException | None = None  # end_all's error, until the engine thread has ended everything
        self._thread = threading.Thread(target=self._loop, name="kv-engine", daemon=True)
        # torch's thread count is the calling thread's setting (OpenMP's, per thread): the engine thread takes it
        self._threads = torch.get_num_threads()

    # ---- the caller's side (any thread) ------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; called on the thread that loaded the engine, which then leaves torch work to
        it (native.release_idle_threads: its idle OpenMP workers would halve the engine thread's speed)."""
        self.engine.write_back.between_steps()  # store writes run on the engine thread too, between steps
        self.engine.write_back.busy = lambda: bool(self._waiting or self._running)  # chunks then wait for a second ask
        native.release_idle_threads()
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
            self.engine.write_back.in_background()  # the engine goes on alone
            self.engine.write_back.busy = lambda: False

    def end_all(self, error: BaseException) -> None:
        """Fail every job, waiting or running, and every call not yet run with `error`, at the engine thread's
        next step, ahead of the calls queued (thread-safe)."""
        with self._lock:
            self._ending = error
        self._wake.set()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Sequences decoding or having their prompt computed (a job of n choices counts n)."""
        return len(self._running) + self._prefilling

    def submit(self, job: GenerationJob) -> None:
        """Queue `job`, unless more than max_waiting jobs would then wait for running slots (QueueFull)."""
        self.submit_all([job])

    def submit_all(self, jobs: list[GenerationJob]) -> None:
        """Queue all of `jobs` (a request of several prompts), in their order, or none of them (QueueFull)."""
        for job in jobs:
            if not 1 <= job.choices <= self.max_running:  # more could never be admitted
                raise ValueError(f"a job's choices must be in [1, max_running={self.max_running}], "
                                 f"got {job.choices}")
        with self._lock:
            if self._beyond_free_slots([*self._waiting, *jobs]) > self.max_waiting:
                raise QueueFull(f"the server is at capacity: {self.running} sequences are running and "
                                f"{len(self._waiting)} requests waiting")
            self._waiting.extend(jobs)
        self._wake.set()

    def _beyond_free_slots(self, jobs: list[GenerationJob]) -> int:
        """How many of `jobs`, admitted in their order, would find too few free running slots for their choices
        and wait (with one choice each: those past the free slots)."""
        free = self.max_running - self.running
        for i, job in enumerate(jobs):
            if job.choices > free:
                return len(jobs) - i
            free -= job.choices
        return 0

    def call(self, fn: Callable[[], Any], abandoned: threading.Event | None = None) -> Future:
        """Run `fn` on the engine thread between two steps (torch work that must not race the decode). Layers it
        runs (a context cache compiled: a prompt's time) pause as a prompt's do: running sequences take their
        decoding steps by max_token_gap, and once `abandoned` is set (its caller gone or timed out) it stops at
        the next layer with JobCancelled."""
        future: Future = Future()
        with self._lock:
            self._calls.append((fn, future, abandoned))
        self._wake.set()
        return future

    @contextlib.contextmanager
    def held(self, timeout: float = 60.0) -> Iterator[None]:
        """Hold the engine thread between two steps for the block: the jobs submitted inside are admitted
        together when it ends (up to max_prefill_batch), as a burst of requests arriving at once would be."""
        reached, release = threading.Event(), threading.Event()
        self.call(lambda: reached.set() or release.wait())
        try:
            if not reached.wait(timeout):
                raise TimeoutError(f"the engine thread did not reach a step's end within {timeout:g} s")
            yield
        finally:
            release.set()

    # ---- the engine thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        while not self._stopped:
            try:
                self._step()
            except Exception as e:  # a bug must fail the jobs in flight, not leave their clients hanging
                log.exception("engine step failed")
                self._fail_running(e)
        self._fail_all(ShuttingDown("the server is shutting down"))

    def _step(self) -> None:
        self._step_started = time.perf_counter()
        if self._ending is not None:
            self._end_everything()
        called = self._run_call()
        self._end_failed_jobs()
        admitted = self._admit()
        if self._running:
            self._decode_step()
        wrote = self._write_back()
        if not (self._running or admitted or wrote or called):
            self._wake.wait(IDLE_WAIT_SECONDS)
            self._wake.clear()

    def _run_call(self) -> bool:
        """Run the oldest call, if any: one a step, so that running sequences decode between calls that each
        take a prompt's time (a context cache compiled)."""
        with self._lock:
            if not self._calls:
                return False
            fn, future, abandoned = self._calls.popleft()
        if future.set_running_or_notify_cancel():
            try:
                with self.engine.model.between_layers(functools.partial(self._between_layers,
                                                                        functools.partial(_given_up, abandoned))):
                    future.set_result(fn())
            except Exception as e:  # handed to the caller, who decides what it means
                future.set_exception(e)
        return True

    def _end_everything(self) -> None:
        with self._lock:
            error, self._ending = self._ending, None
            calls = list(self._calls)
            self._calls.clear()
        self._fail_all(error)
        for _, future, _ in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _end_failed_jobs(self) -> None:
        now = time.perf_counter()
        with self._lock:
            failed = [(job, error) for job in self._waiting if (error := job.failure(now))]
            for job, _ in failed:
                self._waiting.remove(job)
        for job, error in failed:
            job.on_event(JobEvent(error=error))
        for job in {seq.job: None for seq in self._running}:
            if error := job.failure(now):
                self._end_job(job, error)

    def _admit(self) -> bool:
        """Prefill up to max_prefill_batch waiting jobs, in their order, as many as the free running slots hold
        (a job of n choices takes n), as one batch; each joins the running sequences (and streams its first
        token) as soon as its own prefill is done."""
        with self._lock:
            free, jobs = self.max_running - len(self._running), []
            while self._waiting and len(jobs) < self.max_prefill_batch and self._waiting[0].choices <= free:
                jobs.append(self._waiting.popleft())
                free -= jobs[-1].choices
            self._prefilling = sum(job.choices for job in jobs)
        if not jobs:
            return False
        admitted = time.perf_counter()
        prefills = self.engine.prefill_batch([(job.request, job.method, job.sampling.max_tokens) for job in jobs])
        reported = 0
        try:
            for job in jobs:
                if reported:  # the streams' token waits for one prompt, not for the whole batch
                    self._decode_outside_steps(self.max_token_gap or 0.0)
                with self.engine.model.between_layers(functools.partial(self._between_layers, job.failure)):
                    fused = next(prefills)
                reported += 1
                self._start(job, fused, queued=admitted - job.arrived)
        except Exception as e:  # a bug in the batch itself: its jobs fail, the engine and running sequences go on
            log.exception("batch prefill failed")
            for job in jobs[reported:]:
                job.on_event(JobEvent(error=e))
        finally:
            with self._lock:
                self._prefilling = 0
        return True

    def _between_layers(self, failure: Callable[[float], BaseException | None]) -> None:
        """Between two layers of a job's prompt or of a call (a context cache compiled), computed on the engine
        thread (`LayerwiseModel.between_layers`):

        - work whose `failure` (at the time now) names an error stops there: a job cancelled or timed out meanwhile
          (its error, raised through its prefill, is what the batch reports for it: a client gone during a long
          prompt frees the engine at its next layer), a call its caller abandoned; and all of it once `end_all`
          was asked (a server stopping: the prompts of an admission batch would otherwise run to their end, past
          its shutdown timeout);
        - with max_token_gap set, the running sequences take a decoding step once they have waited that long for a
          token: a long prompt no longer stops every stream for its whole prefill (seconds here), at the cost of
          those steps in the new request's TTFT. Layers, not chunks of tokens, are the unit, so that every
          method's plan pauses alike (a stored prefix restored by compute and I/O threads side by side runs on
          those threads, without pauses)."""
        if error := self._ending or failure(time.perf_counter()):  # the server stopping ends it here too
            raise error
        if self.max_token_gap is not None:
            self._decode_outside_steps(self.max_token_gap)

    def _decode_outside_steps(self, gap: float) -> None:
        """A decoding step of the running sequences, if they have waited `gap` seconds for a token, between two
        prompts of an admission batch or two layers of a prompt; store writes follow it, as between engine steps:
        while prompts keep arriving the engine's own steps are few, and with writes only there the chunks to
        compile would pile up unwritten (docs/RESULTS.md, "The server under a long prompt")."""
        if not self._running or time.perf_counter() - self._last_decode < gap:
            return
        try:
            self._decode_step()
        except Exception as e:  # as in _loop: the running sequences fail, the prompts under way go on
            log.exception("decoding step between prompts or their layers failed")
            self._fail_running(e)
        self._write_back()

    def _write_back(self) -> bool:
        """Pending store writes, one at least, for WRITE_BACK_SHARE of the time since this engine step began or
        the last writes ended (not of an idle wait before the step); whether any ran."""
        worked = time.perf_counter() - max(self._step_started, self._writes_ended)
        ran = self.engine.write_back.run_for(WRITE_BACK_SHARE * worked)
        self._writes_ended = time.perf_counter()
        return ran > 0

    def _start(self, job: GenerationJob, fused: FusedPrefill | Exception, queued: float) -> None:
        """A prefilled job joins the running sequences and streams its first token; a failed one reports. Its
        slot passes from prefilling to running at once, so that the count of running jobs never counts it twice."""
        if isinstance(fused, Exception):  # one job's failure must not stop the engine
            self._prefilled(job)
            if not isinstance(fused, (JobCancelled, JobTimeout)):  # those stopped between two layers: no fault
                log.error("prefill failed", exc_info=fused)
            job.on_event(JobEvent(error=fused))
        elif error := job.failure(time.perf_counter()):  # cancelled or timed out while it was prefilled
            self._prefilled(job)
            job.on_event(JobEvent(error=error))
        else:
            try:
                seqs = [self._sequence(job, choice, fused, queued) for choice in range(job.choices)]
            except Exception as e:  # no first token (the logits hold NaN): this job fails, not the batch's others
                self._prefilled(job)
                log.error("the first token could not be drawn", exc_info=e)
                job.on_event(JobEvent(error=e))
                return
            self._prefilled(job, seqs)
            for seq in seqs:
                self._advance(seq, seq.last_token)
            self._own_caches([seq for seq in seqs if seq in self._running], fused.cache, job.sampling.max_tokens)

    def _own_caches(self, seqs: list[_Sequence], prompt: KVCache, max_tokens: int) -> None:
        """After their first tokens, which a pool's first allocation must not delay, each of a job's running
        choices gets KV of its own: a slot of the pool, else the prompt's cache itself for one, a copy for others."""
        kept = False
        for seq in seqs:
            pooled = self.pool.adopt(prompt, prompt.length + max_tokens)
            seq.cache = pooled or (prompt.clone() if kept else prompt)
            kept = kept or pooled is None

    def _prefilled(self, job: GenerationJob, seqs: Iterable[_Sequence] = ()) -> None:
        """A job's prompt is done: its choices leave the prefilling count, and join the running sequences as
        `seqs`."""
        with self._lock:
            self._prefilling -= job.choices
            self._running.extend(seqs)

    def _sequence(self, job: GenerationJob, choice: int, fused: FusedPrefill, queued: float) -> _Sequence:
        """Choice `choice` of the job, its first token drawn from the prompt's logits; it reads the prompt's cache
        until _start gives it its own."""
        sampling = job.sampling
        if choice and sampling.seed is not None:  # vLLM's seeds for the choices of one request
            sampling = replace(sampling, seed=(sampling.seed + choice) % 2**64)  # a seed torch.Generator takes
        sampler = Sampler(sampling, job.request.token_ids, self._eos_ids)
        seq = _Sequence(job, choice, fused.cache, sampler,
                        TextStream(self.engine.tokenizer, sampling, self._eos_ids),
                        replace(fused.stats, queue_seconds=queued))
        seq.last_token = sampler(fused.logits)
        seq.ttft = time.perf_counter() - job.arrived
        return seq

    def _decode_step(self) -> None:
        batch = list(self._running)
        logits = self.engine.model.decode_batch([s.last_token for s in batch], [s.cache for s in batch])
        if self.on_decode_step:
            self.on_decode_step(len(batch))
        for seq, row in zip(batch, logits):
            self._advance(seq, seq.sampler(row))
        self._last_decode = time.perf_counter()

    def _advance(self, seq: _Sequence, token: int) -> None:
        """Feed the sampled `token` to the sequence's text; report it, and end the sequence if it is done."""
        seq.last_token = token
        finished = seq.stream.add(token, seq.sampler.last_logprob)
        text = seq.stream.new_text()
        if not finished:
            if text:  # tokens whose text waits (a possible stop string) send their log-probabilities with it
                seq.job.on_event(JobEvent(seq.choice, text, seq.stream.new_logprobs()))
            return
        self._retire(seq)
        result = seq.stream.generation(len(seq.job.request), seq.ttft, time.perf_counter() - seq.job.arrived)
        result.stats = seq.stats
        seq.job.on_event(JobEvent(seq.choice, text, seq.stream.new_logprobs(), result=result))

    def _retire(self, seq: _Sequence) -> None:
        """The sequence stops running: its slot of the pool is free for the next one."""
        self._running.remove(seq)
        if seq.cache.pool is self.pool:
            self.pool.release(seq.cache)

    def _end_job(self, job: GenerationJob, error: BaseException) -> None:
        """Stop the job's running choices; each sends the text it had settled, and the job its error, once."""
        seqs = [seq for seq in self._running if seq.job is job]
        for seq in seqs:
            self._retire(seq)
        for seq in seqs[:-1]:
            if text := seq.stream.new_text():
                job.on_event(JobEvent(seq.choice, text))
        job.on_event(JobEvent(seqs[-1].choice, seqs[-1].stream.new_text(), error=error))

    def _fail_running(self, error: BaseException) -> None:
        for job in {seq.job: None for seq in self._running}:
            self._end_job(job, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        self._fail_running(error)
        for job in waiting:
            job.on_event(JobEvent(error=error))
