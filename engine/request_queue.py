"""Waiting queues: first come first served, or by priority (lower first, ties by arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from llmrpc.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)  # it was admitted before everyone still waiting

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __contains__(self, request: Request) -> bool:
        return request in self._queue


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # keeps equal keys in insertion order

    def add(self, request: Request) -> None:
        key = (request.params.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, key)

    add_preempted = add  # its priority and arrival time put it back where it belongs

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __contains__(self, request: Request) -> bool:
        return any(entry[3] is request for entry in self._heap)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
