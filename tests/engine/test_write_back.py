"""Store writes kept off the requests' path (`WriteBack`): on a writer thread of their own, which releases its idle
OpenMP workers after each write; or on a scheduler's thread between its steps."""

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
