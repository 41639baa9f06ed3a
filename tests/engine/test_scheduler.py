"""The scheduler on the tiny model: batched jobs decode as they would alone; admission, cancellation, timeouts."""

import dataclasses
import queue
import threading
import time

import pytest

from kvreuse.engine import scheduler as scheduler_module
from kvreuse.engine.sampling import SamplingParams
from kvreuse.engine.scheduler import GenerationJob, JobCancelled, JobTimeout, QueueFull, Scheduler, ShuttingDown
from kvreuse.fusion.segments import Request, Segment, SegmentKind
from kvreuse.model.resolved_step import OneQueryEach

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def job_for(engine, question: str, events: queue.Queue, **options) -> GenerationJob:
    request = engine.build_request(["A reusable passage about " + question], question)
    return GenerationJob(request, options.pop("sampling", GREEDY), events.put, method="full", **options)


def outcome(events: queue.Queue):
    """The streamed text and the last event of a job."""
    text = ""
    while True:
        event = events.get(timeout=60)
        text += event.text
        if event.result or event.error:
            return text, event


def start_with_a_decoding_sequence(scheduler: Scheduler, engine) -> queue.Queue:
    """Start `scheduler` with one long sequence; returns its events once its first token is out."""
    events = queue.Queue()
    scheduler.submit(job_for(engine, "a sequence that is decoding?", events,
                             sampling=SamplingParams(max_tokens=400, ignore_eos=True)))
    scheduler.start()
    events.get(timeout=60)
    return events


def batch_of(engine, size: int, label: str) -> list[tuple[GenerationJob, queue.Queue]]:
    return [(job_for(engine, f"prompt {i} of {label}?", events), events)
            for i, events in enumerate(queue.Queue() for _ in range(size))]


@pytest.fixture
def scheduler(tiny_chat_engine):
    batch_sizes = []
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=8, on_decode_step=batch_sizes.append)
    scheduler.batch_sizes = batch_sizes
    yield scheduler
    scheduler.stop()


def test_concurrent_jobs_decode_together_as_they_would_alone(tiny_chat_engine, scheduler, monkeypatch):
    pooled_calls = []  # the sequences of each attention call over the pool, from the general step or the resolved one
    attend, resolved = scheduler.pool.attend_one_each, OneQueryEach.attend
    monkeypatch.setattr(scheduler.pool, "attend_one_each", lambda *a: pooled_calls.append(len(a[1])) or attend(*a))
    monkeypatch.setattr(OneQueryEach, "attend", lambda self, *a: pooled_calls.append(self.sequences)
                        or resolved(self, *a))
    questions = ["first question?", "a second, longer question about something?", "third?"]
    streams = [queue.Queue() for _ in questions]
    jobs = [job_for(tiny_chat_engine, q, s) for q, s in zip(questions, streams)]
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    for job, events in zip(jobs, streams):
        text, last = outcome(events)
        alone = tiny_chat_engine.generate(job.request, "full", GREEDY)
        assert last.result.token_ids == alone.token_ids and text == last.result.text == alone.text
        assert last.result.finish_reason == "length" and 0 < last.result.ttft <= last.result.total_seconds
    assert max(scheduler.batch_sizes) == len(questions)
    assert max(pooled_calls) == len(questions)  # one attention call per layer for the whole batch
    assert scheduler.pool.members == []  # every finished sequence gave its slot back


def test_a_sequence_joins_the_pool_only_after_its_first_token_is_sent(tiny_chat_engine, scheduler, monkeypatch):
    events = queue.Queue()
    adopt = scheduler.pool.adopt
    seen_before_adoption = []
    monkeypatch.setattr(scheduler.pool, "adopt", lambda *a: seen_before_adoption.append(events.qsize()) or adopt(*a))
    scheduler.submit(job_for(tiny_chat_engine, "first token first?", events))
    scheduler.start()
    assert outcome(events)[1].result.finish_reason == "length"
    assert seen_before_adoption == [1]  # the first token's event, and nothing else yet


@pytest.mark.parametrize("gap", [0.0, 60.0, None])
def test_running_sequences_decode_between_the_layers_of_a_new_prompt(tiny_chat_engine, monkeypatch, gap):
    """max_token_gap 0: a running sequence takes a decoding step between every two layers of a prompt admitted
    beside it, each followed by a pending store write (one each with no share of their time given to writes), and
    both generate what each would alone; a minute: its last step was too recent for one; None: prompts are
    computed whole."""
    monkeypatch.setattr(scheduler_module, "WRITE_BACK_SHARE", 0.0)
    steps, prefills, writes = [], [], []
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=8, max_token_gap=gap,
                          on_decode_step=lambda n: steps.append(time.perf_counter()))
    real_prefill = tiny_chat_engine.prefill

    def timed_prefill(*args, **kwargs):
        if prefills:  # the new prompt's: writes wait that the engine thread runs when it can
            for i in range(tiny_chat_engine.model.num_layers):
                tiny_chat_engine.write_back.submit(f"write {i}", lambda: writes.append(time.perf_counter()))
        start = time.perf_counter()
        result = real_prefill(*args, **kwargs)
        prefills.append((start, time.perf_counter()))
        return result

    monkeypatch.setattr(tiny_chat_engine, "prefill", timed_prefill)
    running_events, new_events = queue.Queue(), queue.Queue()
    long_sampling = SamplingParams(max_tokens=400, ignore_eos=True)
    running = job_for(tiny_chat_engine, "a sequence that is decoding?", running_events, sampling=long_sampling)
    new = job_for(tiny_chat_engine, "a new prompt, " + "much longer than the first, " * 20, new_events)
    try:
        scheduler.submit(running)
        scheduler.start()
        first = running_events.get(timeout=60)  # its first token: it is decoding
        tiny_chat_engine.wait_for_write_back()  # its own writes are done
        scheduler.submit(new)
        new_text, new_last = outcome(new_events)
        running_text, running_last = outcome(running_events)
        running_text = first.text + running_text
    finally:
        scheduler.stop()
    start, end = prefills[1]
    between = [t for t in steps if start < t < end]
    writes_between = [t for t in writes if start < t < end]
    assert len(between) == len(writes_between) == (tiny_chat_engine.model.num_layers - 1 if gap == 0.0 else 0)
    for job, text, last in ((new, new_text, new_last), (running, running_text, running_last)):
        alone = tiny_chat_engine.generate(job.request, "full", job.sampling)
        assert last.result.token_ids == alone.token_ids and text == alone.text


def test_running_sequences_decode_between_the_prompts_of_an_admission_batch(tiny_chat_engine, monkeypatch):
    """Prompts computed whole (no max_token_gap): a running sequence still takes a decoding step, and a store write
    runs (one, with no share of their time given to writes), between two prompts admitted together, so its token
    waits for one prompt, not for the batch."""
    monkeypatch.setattr(scheduler_module, "WRITE_BACK_SHARE", 0.0)
    steps, prefills, writes = [], [], []
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=8, max_prefill_batch=3,
                          on_decode_step=lambda n: steps.append(time.perf_counter()))
    real_prefill = tiny_chat_engine.prefill

    def timed_prefill(*args, **kwargs):
        start = time.perf_counter()
        result = real_prefill(*args, **kwargs)
        prefills.append((start, time.perf_counter()))
        for i in range(2):  # writes wait: there is one to run after each prompt
            tiny_chat_engine.write_back.submit(f"after prefill {len(prefills)}, {i}", lambda: None)
        return result

    def timed_write():
        ran = run_one()
        if ran:
            writes.append(time.perf_counter())
        return ran

    monkeypatch.setattr(tiny_chat_engine, "prefill", timed_prefill)
    run_one = tiny_chat_engine.write_back.run_one
    monkeypatch.setattr(tiny_chat_engine.write_back, "run_one", timed_write)
    batch_sizes, prefill_batch = [], tiny_chat_engine.prefill_batch
    monkeypatch.setattr(tiny_chat_engine, "prefill_batch", lambda jobs: batch_sizes.append(len(jobs))
                        or prefill_batch(jobs))
    batch = batch_of(tiny_chat_engine, 3, "a batch")
    try:
        start_with_a_decoding_sequence(scheduler, tiny_chat_engine)
        with scheduler.held():
            for job, _ in batch:
                scheduler.submit(job)
        results = [outcome(events) for _, events in batch]
    finally:
        scheduler.stop()
    ends = [end for _, end in prefills[1:]]
    starts = [start for start, _ in prefills[1:]]
    assert batch_sizes == [1, 3] and len(prefills) == 4  # the running sequence's prompt, then the batch
    for end, next_start in zip(ends, starts[1:]):
        assert len([t for t in steps if end < t < next_start]) == 1
        assert len([t for t in writes if end < t < next_start]) == 1
    for (job, _), (text, last) in zip(batch, results):
        alone = tiny_chat_engine.generate(job.request, "full", job.sampling)
        assert last.result.token_ids == alone.token_ids and text == alone.text


def test_store_writes_far_cheaper_than_a_step_run_several_after_it(tiny_chat_engine):
    """A backlog of small writes (prompts of many short documents) drains in a few decoding steps: writes run for
    a share of each step's time, where one a step left it growing under traffic."""
    scheduler = Scheduler(tiny_chat_engine, max_running=2, max_waiting=2,
                          on_decode_step=lambda n: time.sleep(0.02))  # a step of 20 ms at least
    written, backlog, steps = [], 30, 8
    try:
        events = start_with_a_decoding_sequence(scheduler, tiny_chat_engine)
        tiny_chat_engine.wait_for_write_back()  # its own writes are done
        for i in range(backlog):  # each far cheaper than a step
            tiny_chat_engine.write_back.submit(f"small write {i}", lambda i=i: time.sleep(0.001) or written.append(i))
        for _ in range(steps):
            events.get(timeout=60)
        assert len(written) == backlog  # one write a step would have run `steps` of them
    finally:
        scheduler.stop()


def test_holding_an_engine_thread_that_does_not_run_times_out(tiny_chat_engine):
    scheduler = Scheduler(tiny_chat_engine, max_running=1, max_waiting=1)  # never started
    with pytest.raises(TimeoutError, match="did not reach a step's end"):
        with scheduler.held(timeout=0.05):
            pass


def test_a_full_queue_refuses_the_job(tiny_chat_engine):
    scheduler = Scheduler(tiny_chat_engine, max_running=1, max_waiting=1)  # not started: nothing leaves the queue
    for question in ["one?", "two?"]:  # one for the free running slot, one waiting
        scheduler.submit(job_for(tiny_chat_engine, question, queue.Queue()))
    with pytest.raises(QueueFull, match="0 sequences are running and 2 requests waiting"):
        scheduler.submit(job_for(tiny_chat_engine, "three?", queue.Queue()))


def test_a_request_s_jobs_are_queued_all_or_none(tiny_chat_engine):
    scheduler = Scheduler(tiny_chat_engine, max_running=1, max_waiting=1)  # not started: nothing leaves the queue
    jobs = [job_for(tiny_chat_engine, f"prompt {i}?", queue.Queue()) for i in range(3)]
    with pytest.raises(QueueFull):
        scheduler.submit_all(jobs)
    assert scheduler.waiting == 0
    scheduler.submit_all(jobs[:2])
    assert scheduler.waiting == 2


def test_the_queue_bound_counts_the_slots_a_job_s_choices_need(tiny_chat_engine):
    """With no room to wait, jobs of 2 choices enter while the free slots hold all of them; the next would wait."""
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=0)  # not started: nothing leaves the queue
    for question in ["one?", "two?"]:
        scheduler.submit(job_for(tiny_chat_engine, question, queue.Queue(), choices=2))
    with pytest.raises(QueueFull, match="0 sequences are running and 2 requests waiting"):
        scheduler.submit(job_for(tiny_chat_engine, "three?", queue.Queue()))
    waiting = Scheduler(tiny_chat_engine, max_running=4, max_waiting=1)
    for question in ["one?", "two?"]:  # the first takes 3 slots, the second waits for 3
        waiting.submit(job_for(tiny_chat_engine, question, queue.Queue(), choices=3))
    with pytest.raises(QueueFull):  # one free slot, but a job waits before it: it would wait too
        waiting.submit(job_for(tiny_chat_engine, "three?", queue.Queue()))


def test_a_job_whose_prompt_is_being_computed_holds_its_running_slot(tiny_chat_engine, monkeypatch):
    """Out of the queue and not yet decoding, a job being prefilled counts as running: admission leaves its slot
    taken (the server let in one request more than its limits per prompt under way) and the gauges show it."""
    scheduler = Scheduler(tiny_chat_engine, max_running=2, max_waiting=2)
    computing, release, real_run = threading.Event(), threading.Event(), tiny_chat_engine.executor.run

    def held_run(*args, **kwargs):
        computing.set()
        release.wait(60)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(tiny_chat_engine.executor, "run", held_run)
    outcomes = [queue.Queue() for _ in range(4)]
    scheduler.submit(job_for(tiny_chat_engine, "a long prompt?", outcomes[0]))
    scheduler.start()
    try:
        assert computing.wait(60)
        assert (scheduler.running, scheduler.waiting) == (1, 0)
        for i, events in enumerate(outcomes[1:]):  # one for the free running slot, two waiting
            scheduler.submit(job_for(tiny_chat_engine, f"short {i}?", events))
        with pytest.raises(QueueFull, match="1 sequences are running and 3 requests waiting"):
            scheduler.submit(job_for(tiny_chat_engine, "one too many?", queue.Queue()))
        release.set()
        assert all(outcome(events)[1].result.finish_reason == "length" for events in outcomes)
    finally:
        release.set()
        scheduler.stop()
    assert scheduler.running == scheduler.waiting == 0


def test_cancelled_and_timed_out_jobs_end_with_their_reason(tiny_chat_engine, scheduler):
    endless = SamplingParams(max_tokens=8000, ignore_eos=True)
    cancelled, timed_out = queue.Queue(), queue.Queue()
    job = job_for(tiny_chat_engine, "cancel me?", cancelled, sampling=endless)
    scheduler.submit(job)
    scheduler.submit(job_for(tiny_chat_engine, "too slow?", timed_out, sampling=endless, timeout=0.5))
    scheduler.start()
    cancelled.get(timeout=60)  # it is streaming
    job.cancel()
    assert isinstance(outcome(cancelled)[1].error, JobCancelled)
    assert isinstance(outcome(timed_out)[1].error, JobTimeout)
    assert scheduler.running == scheduler.waiting == 0
    assert scheduler.pool.members == []


def test_calls_run_on_the_engine_thread(scheduler):
    scheduler.start()
    assert scheduler.call(lambda: threading.current_thread().name).result(timeout=10) == "kv-engine"
    with pytest.raises(ZeroDivisionError):
        scheduler.call(lambda: 1 / 0).result(timeout=10)


def test_running_sequences_decode_between_two_calls(tiny_chat_engine, scheduler):
    events = start_with_a_decoding_sequence(scheduler, tiny_chat_engine)
    with scheduler.held():  # three calls queued at once, as three cache creations arriving together
        calls = [scheduler.call(lambda: len(scheduler.batch_sizes)) for _ in range(3)]
    steps_before = [call.result(timeout=60) for call in calls]
    assert steps_before[0] < steps_before[1] < steps_before[2], steps_before
    assert outcome(events)[1].result is not None


def compile_call(engine, text: str, layers_run: list[int], after_layer=lambda layer: None):
    """A call that compiles `text` as the server compiles a context cache (one chunk, nothing else), recording
    the layers its prompt runs."""
    request = Request([Segment(SegmentKind.CHUNK, engine.tokenizer.encode(text))])

    def run() -> int:
        step = engine.model.step

        def recorded(layer, *args):
            layers_run.append(layer)
            result = step(layer, *args)
            after_layer(layer)
            return result

        engine.model.step = recorded
        try:
            return engine.compile(request, ["naive"])
        finally:
            del engine.model.step

    return request, run


def test_a_call_abandoned_while_it_runs_stops_at_the_next_layer(tiny_chat_engine, scheduler):
    """A context cache whose client left (or timed out) once its compilation started: it stops between two
    layers, as a prompt does, instead of holding the engine for all of them; nothing is stored."""
    abandoned, layers_run = threading.Event(), []
    request, run = compile_call(tiny_chat_engine, "a long text nobody waits for any more", layers_run,
                                lambda layer: abandoned.set())
    scheduler.start()
    with pytest.raises(JobCancelled, match="gave up"):
        scheduler.call(run, abandoned).result(timeout=60)
    assert layers_run == [0] and tiny_chat_engine.model.num_layers > 1
    assert not any(p.hit for p in tiny_chat_engine.lookup(request, "naive") if p.key)
    assert scheduler.call(lambda: "the engine goes on").result(timeout=60) == "the engine goes on"


@pytest.mark.parametrize("gap", [0.0, None])
def test_running_sequences_decode_between_the_layers_of_a_call(tiny_chat_engine, gap):
    """max_token_gap 0: a running sequence takes a decoding step between every two layers of a call that computes
    (a context cache compiled), as between a prompt's; None: calls run whole, as prompts do."""
    steps = []
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=8, max_token_gap=gap,
                          on_decode_step=steps.append)
    try:
        events = start_with_a_decoding_sequence(scheduler, tiny_chat_engine)
        _, compile_run = compile_call(tiny_chat_engine, "a text to compile beside a stream", [])

        def run() -> int:
            before = len(steps)
            compile_run()
            return len(steps) - before

        assert scheduler.call(run).result(timeout=60) == (tiny_chat_engine.model.num_layers - 1 if gap == 0.0 else 0)
        assert outcome(events)[1].result is not None
    finally:
        scheduler.stop()


def test_ending_everything_goes_ahead_of_the_calls_queued(tiny_chat_engine, scheduler):
    running = start_with_a_decoding_sequence(scheduler, tiny_chat_engine)
    waiting = queue.Queue()
    ran = []
    with scheduler.held():
        queued = scheduler.call(lambda: ran.append("call"))
        scheduler.submit(job_for(tiny_chat_engine, "a job still waiting?", waiting))
        scheduler.end_all(ShuttingDown("the server is shutting down"))
    for events in (running, waiting):
        assert isinstance(outcome(events)[1].error, ShuttingDown)
    with pytest.raises(ShuttingDown):
        queued.result(timeout=60)
    assert ran == [] and scheduler.running == scheduler.waiting == 0
    assert scheduler.call(lambda: "goes on").result(timeout=60) == "goes on"


def test_a_failing_step_fails_the_jobs_in_flight_and_the_engine_goes_on(tiny_chat_engine, scheduler, monkeypatch):
    events = queue.Queue()
    real_decode = tiny_chat_engine.model.decode_batch

    def broken_once(*args):
        monkeypatch.setattr(tiny_chat_engine.model, "decode_batch", real_decode)
        raise RuntimeError("device lost")

    monkeypatch.setattr(tiny_chat_engine.model, "decode_batch", broken_once)
    scheduler.submit(job_for(tiny_chat_engine, "doomed?", events))
    scheduler.start()
    assert "device lost" in str(outcome(events)[1].error)
    assert scheduler.call(lambda: scheduler.pool.members).result(timeout=10) == []
    scheduler.submit(job_for(tiny_chat_engine, "next?", events))
    assert outcome(events)[1].result.finish_reason == "length"


def test_a_failing_step_between_a_batch_s_prompts_fails_the_running_sequences_only(tiny_chat_engine, monkeypatch):
    """The running sequences fail (the batch's first prompt has joined them with its first token); the prompt
    still to come is computed and generates what it would alone."""
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=8, max_prefill_batch=2)
    real_decode = tiny_chat_engine.model.decode_batch

    def broken_once(*args):
        monkeypatch.setattr(tiny_chat_engine.model, "decode_batch", real_decode)
        raise RuntimeError("device lost")

    batch = batch_of(tiny_chat_engine, 2, "a failing batch")
    try:
        running_events = start_with_a_decoding_sequence(scheduler, tiny_chat_engine)
        with scheduler.held():  # no decoding step until the batch is queued
            for job, _ in batch:
                scheduler.submit(job)
            monkeypatch.setattr(tiny_chat_engine.model, "decode_batch", broken_once)
        (_, running_last), (_, first_last), (second_text, second_last) = [
            outcome(events) for events in (running_events, batch[0][1], batch[1][1])]
    finally:
        scheduler.stop()
    assert "device lost" in str(running_last.error) and "device lost" in str(first_last.error)
    alone = tiny_chat_engine.generate(batch[1][0].request, "full", GREEDY)
    assert second_last.result.token_ids == alone.token_ids and second_text == alone.text


def test_identical_requests_in_flight_each_finish_as_they_would_alone(tiny_chat_engine, scheduler):
    """Two clients send the very same prompt at once; the one admitted later finishes first (fewer tokens), which
    must end only its own sequence, and a third identical one cancelled while queued ends only itself."""
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    streams = [queue.Queue() for _ in range(3)]
    jobs = [job_for(tiny_chat_engine, "the same question?", streams[0]),
            job_for(tiny_chat_engine, "the same question?", streams[1], sampling=short),
            job_for(tiny_chat_engine, "the same question?", streams[2])]
    for job in jobs:
        scheduler.submit(job)
    jobs[2].cancel()
    scheduler.start()
    alone = {n: tiny_chat_engine.generate(jobs[0].request, "full", SamplingParams(max_tokens=n, ignore_eos=True))
             for n in (2, 8)}
    assert outcome(streams[1])[1].result.token_ids == alone[2].token_ids
    assert outcome(streams[0])[1].result.token_ids == alone[8].token_ids
    assert isinstance(outcome(streams[2])[1].error, JobCancelled)
    assert scheduler.running == scheduler.waiting == 0


def test_a_job_cancelled_in_the_queue_ends_and_the_running_one_goes_on(tiny_chat_engine):
    scheduler = Scheduler(tiny_chat_engine, max_running=1, max_waiting=4)
    try:
        running, queued = queue.Queue(), queue.Queue()
        scheduler.submit(job_for(tiny_chat_engine, "the same question?", running))
        waiting = job_for(tiny_chat_engine, "the same question?", queued)
        scheduler.submit(waiting)
        scheduler.start()
        running.get(timeout=60)  # the first is decoding, the second waits for its slot
        waiting.cancel()
        assert isinstance(outcome(queued)[1].error, JobCancelled)
        assert outcome(running)[1].result.finish_reason == "length"
        assert scheduler.running == scheduler.waiting == 0
    finally:
        scheduler.stop()


@pytest.mark.parametrize("phase", ["planning", "prefilling"])
def test_a_job_cancelled_while_its_prompt_is_computed_ends_without_a_token(tiny_chat_engine, scheduler, monkeypatch,
                                                                           phase):
    """The cancel arrives while the engine thread splits the prompt's stored prefix or runs its fusion plan: the
    job ends with JobCancelled before any token, frees its slot, and the next job is served."""
    target, name = (tiny_chat_engine, "split_prefix") if phase == "planning" else (tiny_chat_engine.executor, "run")
    real = getattr(target, name)
    events = queue.Queue()
    job = job_for(tiny_chat_engine, "cancel me mid-prefill?", events)
    job.method = "naive"  # a reuse method: its prompt's exact prefix is split before its plan runs

    def cancel_during(*args, **kwargs):
        job.cancel()
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, cancel_during)
    scheduler.submit(job)
    scheduler.start()
    text, last = outcome(events)
    assert isinstance(last.error, JobCancelled) and text == ""
    monkeypatch.setattr(target, name, real)
    scheduler.submit(job_for(tiny_chat_engine, "next?", events))
    assert outcome(events)[1].result.finish_reason == "length"
    assert scheduler.running == scheduler.waiting == 0


def test_a_job_cancelled_while_its_prompt_is_computed_stops_at_the_next_layer(tiny_chat_engine, scheduler,
                                                                              monkeypatch):
    """The prompt's layers stop between two layers once its job is cancelled, not after the last one."""
    events, layers_run = queue.Queue(), []
    job = job_for(tiny_chat_engine, "stop me at the next layer?", events)
    model, real_run = tiny_chat_engine.model, tiny_chat_engine.executor.run
    step = model.step

    def cancel_then_run(*args, **kwargs):
        job.cancel()
        monkeypatch.setattr(model, "step", lambda layer, *a: layers_run.append(layer) or step(layer, *a))
        try:
            return real_run(*args, **kwargs)
        finally:
            monkeypatch.setattr(model, "step", step)

    monkeypatch.setattr(tiny_chat_engine.executor, "run", cancel_then_run)
    scheduler.submit(job)
    scheduler.start()
    text, last = outcome(events)
    assert isinstance(last.error, JobCancelled) and text == ""
    assert layers_run == [0] and model.num_layers > 1


def test_while_sequences_run_the_engine_counts_as_busy_for_its_writes(tiny_chat_engine, scheduler):
    """Then a chunk is compiled on its second request (WriteBack.behind): with documents that seldom repeat, the
    compiles of chunks sent once took the time of the prompts waiting."""
    assert not tiny_chat_engine.write_back.behind
    start_with_a_decoding_sequence(scheduler, tiny_chat_engine)
    tiny_chat_engine.wait_for_write_back()  # no write waits: the running sequence alone makes it busy
    assert tiny_chat_engine.write_back.behind
    scheduler.stop()
    assert not tiny_chat_engine.write_back.behind  # alone again: every chunk is written


def test_ending_everything_stops_the_prompts_under_way_at_their_next_layer(tiny_chat_engine, monkeypatch):
    """A server stopping while an admission batch's prompts are computed: each stops between two layers with the
    error end_all was given, instead of running to its end past the shutdown timeout."""
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=8, max_prefill_batch=2)
    model, step, layers_run = tiny_chat_engine.model, tiny_chat_engine.model.step, []

    def end_all_at_the_first_layer(layer, *args):
        layers_run.append(layer)
        scheduler.end_all(ShuttingDown("the server is shutting down"))
        return step(layer, *args)

    batch = batch_of(tiny_chat_engine, 2, "a batch under way")
    try:
        scheduler.start()
        with scheduler.held():
            for job, _ in batch:
                scheduler.submit(job)
            monkeypatch.setattr(model, "step", end_all_at_the_first_layer)
        for _, events in batch:
            assert isinstance(outcome(events)[1].error, ShuttingDown)
        monkeypatch.setattr(model, "step", step)
        assert layers_run == [0, 0] and model.num_layers > 1  # each prompt stopped after its first layer
        assert scheduler.call(lambda: "goes on").result(timeout=60) == "goes on"
    finally:
        scheduler.stop()


def test_store_writes_run_on_the_engine_thread_between_steps(tiny_chat_engine):
    """No torch work beside decoding: what a request computed is compiled and stored by the engine thread."""
    writers = []
    put = tiny_chat_engine.store.put
    tiny_chat_engine.store.put = lambda *args, **kw: writers.append(threading.current_thread().name) or put(*args, **kw)
    scheduler = Scheduler(tiny_chat_engine, max_running=2, max_waiting=2)
    try:
        scheduler.start()
        events = queue.Queue()
        job = job_for(tiny_chat_engine, "where writes run?", events)
        job.request = tiny_chat_engine.build_request(["A passage nobody has stored yet, about write-back."],
                                                     "where writes run?")
        scheduler.submit(job)
        outcome(events)
        tiny_chat_engine.wait_for_write_back()
        assert writers and set(writers) == {"kv-engine"}
    finally:
        scheduler.stop()
        del tiny_chat_engine.store.put
    request = tiny_chat_engine.build_request(["Another passage, stored once the scheduler has stopped."], "alone?")
    tiny_chat_engine.generate(request, "naive", GREEDY)
    tiny_chat_engine.wait_for_write_back()  # alone again, the engine writes on its own thread


def test_the_engine_thread_starts_with_the_caller_s_threads_and_without_its_idle_workers(tiny_chat_engine,
                                                                                         monkeypatch):
    """The thread that starts the scheduler releases its idle OpenMP workers first (beside the engine thread's
    own they would make every parallel region wait for sleeping workers), and the engine thread runs torch with
    the caller's thread count, which OpenMP keeps per thread."""
    import torch

    from kvreuse.engine import scheduler as scheduler_module

    released = []
    monkeypatch.setattr(scheduler_module.native, "release_idle_threads",
                        lambda: released.append(threading.current_thread()))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scheduler = Scheduler(tiny_chat_engine, max_running=1, max_waiting=1)
    finally:
        torch.set_num_threads(before)
    try:
        scheduler.start()
        assert released == [threading.current_thread()]
        assert scheduler.call(torch.get_num_threads).result(timeout=60) == 1
    finally:
        scheduler.stop()


def choices_outcome(events: queue.Queue, choices: int) -> tuple[dict[int, str], dict[int, object]]:
    """Each choice's streamed text and result, until the job's last choice has finished."""
    texts, results = {}, {}
    while len(results) < choices:
        event = events.get(timeout=60)
        assert event.error is None, event.error
        texts[event.choice] = texts.get(event.choice, "") + event.text
        if event.result:
            results[event.choice] = event.result
    return texts, results


@pytest.mark.parametrize("pool_bytes", [scheduler_module.DEFAULT_POOL_BYTES, 1])  # 1: no choice fits the pool
def test_a_job_of_several_choices_computes_its_prompt_once_and_each_choice_draws_with_its_own_seed(
        tiny_chat_engine, monkeypatch, pool_bytes):
    """vLLM's n: choice i samples as a request of seed + i would alone (so each decodes from its own copy of the
    prompt's KV, whether the pool holds it or not), and the prompt is computed once."""
    prompts = []
    prefill_batch = tiny_chat_engine.prefill_batch
    monkeypatch.setattr(tiny_chat_engine, "prefill_batch", lambda batch: prompts.extend(batch) or prefill_batch(batch))
    sampling = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=2**64 - 2)  # choice 2 wraps to 0
    events = queue.Queue()
    job = job_for(tiny_chat_engine, "which of several answers?", events, sampling=sampling, choices=3)
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=8, pool_bytes=pool_bytes)
    try:
        scheduler.submit(job)
        scheduler.start()
        texts, results = choices_outcome(events, 3)
        assert scheduler.call(lambda: scheduler.pool.members).result(timeout=10) == []
    finally:
        scheduler.stop()
    assert len(prompts) == 1
    monkeypatch.undo()
    for choice, seed in enumerate([2**64 - 2, 2**64 - 1, 0]):
        alone = tiny_chat_engine.generate(job.request, "full", dataclasses.replace(sampling, seed=seed))
        assert results[choice].token_ids == alone.token_ids and texts[choice] == results[choice].text
    assert len({tuple(r.token_ids) for r in results.values()}) > 1


def test_a_job_waits_until_the_running_slots_hold_all_its_choices(tiny_chat_engine):
    scheduler = Scheduler(tiny_chat_engine, max_running=2, max_waiting=4)
    try:
        with pytest.raises(ValueError, match=r"choices must be in \[1, max_running=2\], got 3"):
            scheduler.submit(job_for(tiny_chat_engine, "too many?", queue.Queue(), choices=3))
        running = queue.Queue()
        long_job = job_for(tiny_chat_engine, "a long answer?", running,
                           sampling=SamplingParams(max_tokens=400, ignore_eos=True))
        scheduler.submit(long_job)
        scheduler.start()
        running.get(timeout=60)
        events = queue.Queue()
        scheduler.submit(job_for(tiny_chat_engine, "two answers?", events, choices=2))
        def counts() -> tuple[int, int]:
            return scheduler.running, scheduler.waiting

        scheduler.call(counts).result(timeout=10)  # a step's admission has seen the job since
        assert scheduler.call(counts).result(timeout=10) == (1, 1)  # one slot is free, the job needs two
        assert events.empty()
        long_job.cancel()
        assert outcome(running)[1].error is not None
        assert sorted(choices_outcome(events, 2)[1]) == [0, 1]
    finally:
        scheduler.stop()


def test_a_cancelled_job_of_several_choices_ends_each_and_reports_once(tiny_chat_engine):
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=4)
    events = queue.Queue()
    job = job_for(tiny_chat_engine, "many long answers?", events, choices=3,
                  sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    try:
        scheduler.submit(job)
        scheduler.start()
        decoding = set()
        while len(decoding) < 3:  # each choice's first text is out
            decoding.add(events.get(timeout=60).choice)
        assert scheduler.call(lambda: scheduler.running).result(timeout=10) == 3  # a slot each
        job.cancel()
        assert outcome(events)[1].error is not None
        assert scheduler.call(lambda: (scheduler.running, scheduler.pool.members)).result(timeout=10) == (0, [])
        leftover = [events.get_nowait() for _ in range(events.qsize())]
        assert not any(event.error or event.result for event in leftover)  # one error for the whole job
    finally:
        scheduler.stop()


def test_a_job_whose_first_token_cannot_be_drawn_fails_alone(tiny_chat_engine, monkeypatch):
    """First-token logits holding NaN fail that job with the sampler's error; the batch's other job goes on."""
    prefill_batch = tiny_chat_engine.prefill_batch

    def first_poisoned(jobs):
        for i, fused in enumerate(prefill_batch(jobs)):
            yield dataclasses.replace(fused, logits=fused.logits * float("nan")) if i == 0 else fused

    monkeypatch.setattr(tiny_chat_engine, "prefill_batch", first_poisoned)
    scheduler = Scheduler(tiny_chat_engine, max_running=4, max_waiting=4, max_prefill_batch=2)
    (doomed, doomed_events), (fine, fine_events) = batch_of(tiny_chat_engine, 2, "a poisoned batch")
    try:
        scheduler.start()
        with scheduler.held():
            scheduler.submit(doomed)
            scheduler.submit(fine)
        assert "NaN" in str(outcome(doomed_events)[1].error)
        assert outcome(fine_events)[1].result.finish_reason == "length"
        assert scheduler.call(lambda: scheduler.running).result(timeout=10) == 0
    finally:
        scheduler.stop()


def test_while_a_batch_s_next_prompt_is_computed_the_jobs_before_it_count_each_choice_once(tiny_chat_engine,
                                                                                          monkeypatch):
    """A job of 2 choices prefilled first in a batch decodes while the batch's next job is computed: the running
    count is its 2 sequences and that job's 1, not more."""
    scheduler = Scheduler(tiny_chat_engine, max_running=3, max_waiting=2, max_prefill_batch=2)
    computing, release, real_run, calls = threading.Event(), threading.Event(), tiny_chat_engine.executor.run, []

    def second_held(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            computing.set()
            release.wait(60)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(tiny_chat_engine.executor, "run", second_held)
    first, second = queue.Queue(), queue.Queue()
    try:
        scheduler.start()
        with scheduler.held():
            scheduler.submit(job_for(tiny_chat_engine, "two answers first?", first, choices=2))
            scheduler.submit(job_for(tiny_chat_engine, "then one?", second))
        assert computing.wait(60)
        assert scheduler.running == 3
        release.set()
        assert sorted(choices_outcome(first, 2)[1]) == [0, 1]
        assert outcome(second)[1].result.finish_reason == "length"
    finally:
        release.set()
        scheduler.stop()
