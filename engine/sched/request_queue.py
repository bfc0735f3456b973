"""Waiting queues: callers take turns; by priority first (lower first) under ``priority``.

A caller is ``SamplingParams.caller`` (the server sets it: the API key's digest, else the
client's connection). Both policies give each caller with requests waiting one admission in
turn, in the order the callers first queued; a caller's own requests go in arrival order. So
one caller's batch of a thousand prompts (or n=128 samples) holds another caller's request
back by at most one admission per caller queued ahead of it, instead of by the whole batch.

- ``fcfs``: round-robin across callers, first come first served within each. With a single
  caller (a server without keys behind one gateway connection, say) that is plain fcfs.
- ``priority``: lower ``priority`` first, always; among requests of the same priority, callers
  take turns, and a caller's own requests go by arrival.

A request put back (preempted, or held back by the scheduler this step) goes in front of its
caller's others, and its caller to the front of the turns: it keeps the place it had.
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

from llmrpc.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def _in_turns(queues: Iterable[list[Request]]) -> Iterator[Request]:
    """The order ``pop`` takes them in: one from each caller in turn."""
    for turn in itertools.zip_longest(*queues):
        yield from (request for request in turn if request is not None)


class FCFSQueue:
    def __init__(self) -> None:
        # Callers in turn (the first is served next, then goes last) -> their requests.
        self._callers: OrderedDict[str, deque[Request]] = OrderedDict()
        self._size = 0

    def add(self, request: Request) -> None:
        self._callers.setdefault(request.params.caller, deque()).append(request)
        self._size += 1

    def add_preempted(self, request: Request) -> None:
        caller = request.params.caller
        self._callers.setdefault(caller, deque()).appendleft(request)
        self._callers.move_to_end(caller, last=False)  # admitted before everyone still waiting
        self._size += 1

    def peek(self) -> Request:
        return next(iter(self._callers.values()))[0]

    def pop(self) -> Request:
        caller, queue = next(iter(self._callers.items()))
        request = queue.popleft()
        self._size -= 1
        if queue:
            self._callers.move_to_end(caller)
        else:
            del self._callers[caller]
        return request

    def remove(self, request: Request) -> None:
        caller = request.params.caller
        queue = self._callers[caller]
        queue.remove(request)
        self._size -= 1
        if not queue:
            del self._callers[caller]

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        return _in_turns([list(queue) for queue in self._callers.values()])

    def __contains__(self, request: Request) -> bool:
        return request in self._callers.get(request.params.caller, ())


# One caller's requests of one priority: a heap of (arrival_time, arrival order, request).
_Entries = list[tuple[float, int, Request]]


class PriorityQueue:
    def __init__(self) -> None:
        # priority -> callers in turn -> their requests
        self._levels: dict[int, OrderedDict[str, _Entries]] = {}
        self._priorities: list[int] = []  # a heap; may hold priorities whose level has emptied
        self._counter = itertools.count()  # keeps equal arrival times in insertion order
        # A request keeps its arrival order when it comes back (preempted, held back).
        self._order: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._size = 0

    def add(self, request: Request, front: bool = False) -> None:
        priority, caller = request.params.priority, request.params.caller
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = OrderedDict()
            heapq.heappush(self._priorities, priority)
        order = self._order.setdefault(request, next(self._counter))
        heapq.heappush(level.setdefault(caller, []), (request.arrival_time, order, request))
        if front:
            level.move_to_end(caller, last=False)
        self._size += 1

    def add_preempted(self, request: Request) -> None:
        self.add(request, front=True)  # its arrival puts it back where it was among its caller's

    def _first_level(self) -> tuple[int, OrderedDict[str, _Entries]]:
        while self._priorities[0] not in self._levels:
            heapq.heappop(self._priorities)
        priority = self._priorities[0]
        return priority, self._levels[priority]

    def peek(self) -> Request:
        return next(iter(self._first_level()[1].values()))[0][2]

    def pop(self) -> Request:
        priority, level = self._first_level()
        caller, entries = next(iter(level.items()))
        request = heapq.heappop(entries)[2]
        self._size -= 1
        if entries:
            level.move_to_end(caller)
        else:
            self._drop_caller(priority, caller)
        return request

    def remove(self, request: Request) -> None:
        priority, caller = request.params.priority, request.params.caller
        entries = self._levels[priority][caller]
        entries[:] = [entry for entry in entries if entry[2] is not request]
        heapq.heapify(entries)
        self._size -= 1
        if not entries:
            self._drop_caller(priority, caller)

    def _drop_caller(self, priority: int, caller: str) -> None:
        level = self._levels[priority]
        del level[caller]
        if not level:
            del self._levels[priority]

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        for priority in sorted(self._levels):
            queues = [[entry[2] for entry in sorted(entries)] for entries in
                      self._levels[priority].values()]  # fmt: skip
            yield from _in_turns(queues)

    def __contains__(self, request: Request) -> bool:
        level = self._levels.get(request.params.priority, {})
        return any(entry[2] is request for entry in level.get(request.params.caller, ()))


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
