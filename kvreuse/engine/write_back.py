"""Store writes of what requests computed (chunks to compile, prefix blocks), kept off the requests' path.

Alone, an engine runs them on a writer thread of its own. Driven by a scheduler (`between_steps`), it runs them
on the scheduler's engine thread between two steps, for a share of the step's time (`run_for`): then no torch
work runs beside decoding, and the engine thread owns all of it. One write per key is pending or running at a
time, and at most MAX_PENDING wait: past that the oldest is dropped (a chunk computed again when next asked for,
never a request lost), so that traffic the writes cannot keep up with does not grow the queue without end.
While the engine is `behind`, a chunk is written on its second ask, not its first (`submit(second_ask=...)`).
A key whose entry no tier of the store can hold (`unstorable`) is not submitted again: its write would compute
the entry only for the store to refuse it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvreuse.model import native

log = logging.getLogger(__name__)
MAX_PENDING = 4096  # writes waiting; each holds a chunk's or prefix's token ids until it runs
ASKED_ONCE_KEYS = 65536  # keys held back once, remembered for their second ask (64-character keys: ~10 MB)
UNSTORABLE_KEYS = 4096  # keys whose entries the store cannot hold, remembered so that they are not computed again


class WriteBack:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._pending: dict[str, Callable[[], object]] = {}
        self._running: set[str] = set()
        self._clock = clock
        self.dropped = 0  # writes dropped from a full queue, since the start
        self._asked_once: OrderedDict[str, None] = OrderedDict()  # keys held back once while writes were behind
        self.held_back = 0  # writes held back since the start
        self._unstorable: OrderedDict[str, None] = OrderedDict()  # the last UNSTORABLE_KEYS refused for their size
        self.busy: Callable[[], bool] = lambda: False  # whether requests wait for the engine (a scheduler's queue)
        self._cond = threading.Condition()
        self._thread: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-compile")

    @property
    def pending(self) -> int:
        """Writes submitted and not yet started."""
        return len(self._pending)

    @property
    def behind(self) -> bool:
        """Whether writes wait, or requests do (`busy`): the engine's time is short. Then a chunk sent once is not
        worth compiling (with documents that seldom repeat, up to a third of a busy engine's time went to chunks
        no request read again), one sent twice likely is."""
        return bool(self._pending) or self.busy()

    def submit(self, key: str, write: Callable[[], object], *, second_ask: bool = False) -> None:
        """Run write() later, unless a write of `key` is already pending or running. `second_ask`: queue it only
        if its key was asked for before; the first time it is remembered instead (`behind` says when a caller
        should ask so)."""
        with self._cond:
            if key in self._pending or key in self._running or key in self._unstorable:
                return
            if second_ask and self._first_ask(key):
                self.held_back += 1
                return
            if len(self._pending) >= MAX_PENDING:
                del self._pending[next(iter(self._pending))]
                self.dropped += 1
                if self.dropped == 1:  # once: under such traffic every submit drops one
                    log.warning("write-back queue full (%d writes): the oldest are dropped from now on "
                                "(kvreuse_write_back_dropped_total counts them)", MAX_PENDING)
            self._pending[key] = write
            thread = self._thread
        if thread is not None:
            thread.submit(self._run_one_in_background)

    def unstorable(self, key: str) -> None:
        """`key`'s entry is larger than any tier of the store holds: its writes are not submitted from now on."""
        with self._cond:
            self._unstorable[key] = None
            if len(self._unstorable) > UNSTORABLE_KEYS:
                self._unstorable.popitem(last=False)

    def _first_ask(self, key: str) -> bool:
        """Whether `key` is asked for the first time (of the last ASKED_ONCE_KEYS held back); remembers it."""
        if key in self._asked_once:
            del self._asked_once[key]
            return False
        self._asked_once[key] = None
        if len(self._asked_once) > ASKED_ONCE_KEYS:
            self._asked_once.popitem(last=False)
        return True

    def _run_one_in_background(self) -> None:
        """`run_one` on the writer thread, which then releases its idle OpenMP workers: kept, they would slow the
        requests' parallel work on other threads for as long as the engine lives (native.release_idle_threads)."""
        self.run_one()
        native.release_idle_threads()

    def between_steps(self) -> None:
        """From now on, writes wait for `run_one` on the caller's thread (a scheduler's, between its steps)."""
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)  # what it had taken finishes; the rest stays pending

    def in_background(self) -> None:
        """Back to a writer thread of the engine's own, which takes what is pending."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-compile")
            for _ in self._pending:
                self._thread.submit(self._run_one_in_background)

    def run_one(self) -> bool:
        """Run the oldest pending write on this thread; False if none was pending."""
        with self._cond:
            if not self._pending:
                return False
            key = next(iter(self._pending))
            write = self._pending.pop(key)
            self._running.add(key)
        try:
            write()
        except Exception:  # a failed write loses a cache entry, never a request
            log.exception("write-back of %s failed", key)
        finally:
            with self._cond:
                self._running.discard(key)
                self._cond.notify_all()
        return True

    def run_for(self, seconds: float) -> int:
        """Run the oldest pending write, then more while they have taken less than `seconds` in all (a scheduler
        gives them a share of its step's time: one write a step fell behind traffic of many small chunks, each
        cheaper than the prompt steps between them); returns how many ran."""
        started, ran = self._clock(), 0
        while (ran == 0 or self._clock() - started < seconds) and self.run_one():
            ran += 1
        return ran

    def wait(self) -> None:
        """Until every write submitted so far has run (on whichever thread runs them)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending and not self._running)

    def close(self) -> None:
        """Finish what is pending: on the writer thread, or here once no scheduler drives the engine."""
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)
        while self.run_one():
            pass
