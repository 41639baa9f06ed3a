"""Store writes kept off the requests' path (`WriteBack`): on a writer thread of their own, which releases its idle
OpenMP workers after each write; or on a scheduler's thread between its steps, for a time it gives them; at most
MAX_PENDING waiting."""

import threading

from kvreuse.engine import write_back as write_back_module
from kvreuse.engine.write_back import WriteBack


def test_the_writer_thread_runs_each_write_once_and_then_releases_its_idle_workers(monkeypatch):
    released, ran = [], []
    monkeypatch.setattr(write_back_module.native, "release_idle_threads",
                        lambda: released.append(threading.current_thread().name))
    writes = WriteBack()
    try:
        gate = threading.Event()
        writes.submit("a", lambda: gate.wait(10) and ran.append(("a", threading.current_thread().name)))
        writes.submit("a", lambda: ran.append(("a again", "")))  # pending already: not queued twice
        writes.submit("b", lambda: ran.append(("b", threading.current_thread().name)))
        gate.set()
        writes.wait()
    finally:
        writes.close()
    assert [name for name, _ in ran] == ["a", "b"]
    assert all(thread.startswith("kv-compile") for _, thread in ran)
    assert len(released) == 2 and all(thread.startswith("kv-compile") for thread in released)


def test_writes_between_a_scheduler_s_steps_run_on_its_thread_and_keep_its_workers(monkeypatch):
    released = []
    monkeypatch.setattr(write_back_module.native, "release_idle_threads", lambda: released.append(1))
    writes = WriteBack()
    writes.between_steps()
    ran = []
    writes.submit("a", lambda: ran.append(threading.current_thread()))
    assert ran == [] and writes.run_one() and ran == [threading.current_thread()]
    assert not writes.run_one() and released == []  # the engine thread's team is the one that works
    writes.close()


class StepClock:
    """A clock that moves only when a write runs: each takes `seconds`."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def write(self, seconds: float, ran: list, name: str):
        def run():
            self.now += seconds
            ran.append(name)
        return run


def test_writes_run_for_the_time_given_and_one_at_least():
    clock, ran = StepClock(), []
    writes = WriteBack(clock)
    writes.between_steps()
    for i in range(6):
        writes.submit(f"w{i}", clock.write(1.0, ran, f"w{i}"))
    assert writes.run_for(2.5) == 3 and ran == ["w0", "w1", "w2"]  # 0 and 1 s in: under 2.5 s, another runs
    assert writes.run_for(0.0) == 1 and ran[-1] == "w3"  # no time given: the oldest runs anyway
    assert writes.run_for(10.0) == 2 and writes.pending == 0
    assert writes.run_for(10.0) == 0
    writes.close()


def test_a_full_queue_drops_its_oldest_write(monkeypatch, caplog):
    monkeypatch.setattr(write_back_module, "MAX_PENDING", 3)
    ran = []
    writes = WriteBack()
    writes.between_steps()
    for i in range(5):
        writes.submit(f"w{i}", lambda i=i: ran.append(i))
    assert writes.pending == 3 and writes.dropped == 2
    assert caplog.text.count("write-back queue full") == 1
    writes.close()
    assert ran == [2, 3, 4]


def test_a_write_asked_for_the_second_time_is_queued_the_first_remembered():
    writes = WriteBack()
    writes.between_steps()
    writes.submit("a", lambda: None, second_ask=True)
    assert writes.pending == 0 and writes.held_back == 1
    writes.submit("a", lambda: None, second_ask=True)
    assert writes.pending == 1 and writes.held_back == 1 and writes.behind
    writes.close()


def test_an_unstorable_key_is_not_queued_again_while_it_is_remembered(monkeypatch):
    monkeypatch.setattr(write_back_module, "UNSTORABLE_KEYS", 2)
    writes = WriteBack()
    writes.between_steps()
    writes.unstorable("big")
    writes.submit("big", lambda: None)
    assert writes.pending == 0
    writes.unstorable("other")
    writes.unstorable("third")  # past the bound: the oldest is forgotten, and written if asked again
    writes.submit("big", lambda: None)
    writes.submit("third", lambda: None)
    assert writes.pending == 1
    writes.close()
