"""A lane of compile threads on which a compile that proves expensive holds up no other.

A grammar's text does not tell its cost: ``{"type": "string", "maxLength": 3000}`` is 40
characters and took 2.8 s to compile with xgrammar here. So a lane runs its compiles in the
order they come on ``width`` threads, and a compile that has run for ``SLOW_S`` stops counting
against that width: another thread (up to ``max_threads`` in all) takes the next one. Cheap
grammars then wait only behind cheap ones, while expensive ones together never take more than
``max_threads`` threads (cores, since a compile runs in native code with the GIL released).

At interpreter exit the lanes start nothing more and wait for their threads to end, the compiles
already running done (``EXIT_WAIT_S`` at most): a thread still running once the interpreter is
being finalized is ended where it next takes the GIL, which inside native code (a compile coming
back, a tensor it frees) is C++ frames that cannot unwind, and the process aborts.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref

logger = logging.getLogger(__name__)

SLOW_S = 0.5  # a compile running this long is an expensive one
_IDLE_EXIT_S = 60.0  # a thread beyond the lane's width, idle this long, ends
EXIT_WAIT_S = 10.0  # at exit, how long the compiles already running may take to end
_lanes: weakref.WeakSet[CompileLane] = weakref.WeakSet()


@atexit.register
def _close_lanes() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for lane in list(_lanes):
        lane.close(max(0.0, deadline - time.monotonic()))


class CompileLane:
    """Runs functions in submission order on ``width`` threads, plus up to ``max_threads -
    width`` more while compiles that have run ``SLOW_S`` hold threads."""

    def __init__(self, name: str, width: int, max_threads: int) -> None:
        self.name = name
        self.width = width
        self.max_threads = max(width, max_threads)
        self._lock = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._began: dict[int, float] = {}  # busy thread -> when its compile began
        self._idle = 0
        self._starting = 0  # started threads yet to look at the queue
        self._numbers = itertools.count()
        self._recheck: threading.Timer | None = None
        self._workers: set[threading.Thread] = set()  # its threads: their count, joined at exit
        self._closed = False
        _lanes.add(self)

    def close(self, timeout: float) -> None:
        """At exit: cancel the queued compiles, end the idle threads and wait up to ``timeout``
        for the busy ones to end, their compiles done; a compile submitted later is cancelled."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            queued = [future for future, _, _ in self._queue]
            self._queue.clear()
            workers = list(self._workers)
            self._lock.notify_all()
        for future in queued:
            future.cancel()
        for worker in workers:  # ended, not only done: a thread's last frame frees its results
            worker.join(max(0.0, deadline - time.monotonic()))
        if running := sum(worker.is_alive() for worker in workers):
            logger.warning("%d grammar compiles still run after %.0f s", running, timeout)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.cancel()
                return future
            self._queue.append((future, fn, args))
            self._lock.notify()
            self._grow()
        return future

    def _grow(self) -> None:
        """Start threads for the queued work that no idle thread will take while fewer than
        ``width`` threads are busy with fast compiles; else look again once the next one turns
        slow."""
        now = time.monotonic()
        fast = [began for began in self._began.values() if now - began < SLOW_S]
        while (
            len(self._queue) > self._idle + self._starting
            and len(fast) + self._starting < self.width
            and len(self._workers) < self.max_threads
        ):
            self._starting += 1
            number = next(self._numbers)
            name = f"{self.name}-{number}"
            worker = threading.Thread(target=self._work, args=(number,), name=name, daemon=True)
            self._workers.add(worker)
            worker.start()
        waiting = len(self._queue) > self._idle + self._starting
        if waiting and fast and len(self._workers) < self.max_threads and self._recheck is None:
            self._recheck = threading.Timer(min(fast) + SLOW_S - now, self._look_again)
            self._recheck.daemon = True
            self._recheck.start()

    def _look_again(self) -> None:
        with self._lock:
            self._recheck = None
            self._grow()

    def _work(self, number: int) -> None:
        with self._lock:
            self._starting -= 1
            while True:
                if self._closed:
                    return
                if not self._queue:
                    self._idle += 1
                    woken = self._lock.wait(_IDLE_EXIT_S)
                    self._idle -= 1
                    if not woken and not self._queue and len(self._workers) > self.width:
                        self._workers.discard(threading.current_thread())
                        return
                    continue
                future, fn, args = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue  # cancelled while it waited
                self._began[number] = time.monotonic()
                self._lock.release()
                try:
                    self._run(future, fn, args)
                finally:
                    self._lock.acquire()
                    del self._began[number]

    @staticmethod
    def _run(future: concurrent.futures.Future, fn, args) -> None:
        try:
            result = fn(*args)
        except BaseException as error:  # noqa: BLE001 - the caller's to see, as an executor does
            future.set_exception(error)
        else:
            future.set_result(result)
