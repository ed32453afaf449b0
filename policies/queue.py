"""Waiting-queue orders: which waiting request the scheduler tries to admit next."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable, Iterator

from core.sched.request import Request


class FCFSQueue:
    """Arrival order; preempted requests go back to the front (they are the oldest)."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        # Victims are preempted newest-first, so pushing each to the front restores age order.
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class KeyedQueue:
    """A heap ordered by key(request), ties by arrival order (FCFS within a key)."""

    def __init__(self, key: Callable[[Request], object]) -> None:
        self._key = key
        self._heap: list[tuple[object, int, int, Request]] = []
        self._live: dict[int, Request] = {}          # id(request) -> request
        self._tie = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request.arrival_index, next(self._tie), request))
        self._live[id(request)] = request

    add_preempted = add   # the key already places it ahead of later arrivals

    def _clean(self) -> None:
        heap = self._heap
        while heap and id(heap[0][3]) not in self._live:
            heapq.heappop(heap)

    def peek(self) -> Request:
        self._clean()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._clean()
        request = heapq.heappop(self._heap)[3]
        del self._live[id(request)]
        return request

    def remove(self, request: Request) -> None:
        del self._live[id(request)]                  # heap entry dropped lazily

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(r for *_, r in sorted(e for e in self._heap if id(e[3]) in self._live))


class FCFSPolicy:
    name = "fcfs"

    def make_queue(self) -> FCFSQueue:
        return FCFSQueue()


class PriorityPolicy:
    """Lower `priority` value first (vLLM's convention), FCFS within a priority."""
    name = "priority"

    def make_queue(self) -> KeyedQueue:
        return KeyedQueue(lambda r: r.priority)


class ShortestJobFirstPolicy:
    """Shortest prompt first: a cheap proxy for shortest job (output length is unknown)."""
    name = "sjf"

    def make_queue(self) -> KeyedQueue:
        return KeyedQueue(lambda r: (r.priority, len(r.seqs[0].token_ids)))


class LongestPrefixMatchQueue(FCFSQueue):
    """Waiting requests with the most prompt blocks already in the prefix cache first
    (ties FCFS); past `max_scan` waiting requests it degrades to FCFS, so the cost of a
    peek stays bounded under overload (SGLang's LPM makes the same trade)."""

    def __init__(self, max_scan: int = 128) -> None:
        super().__init__()
        self._kv = None
        self.max_scan = max_scan

    def bind(self, kv) -> None:
        self._kv = kv                        # the scheduler's KV manager, for cache lookups

    def peek(self) -> Request:
        q = self._q
        if self._kv is None or len(q) > self.max_scan or len(q) == 1:
            return q[0]
        return min(q, key=lambda r: (-len(self._kv.find_cached_prefix(r.seqs[0])), r.arrival_index))

    def pop(self) -> Request:
        best = self.peek()
        self._q.remove(best)
        return best


class LongestPrefixMatchPolicy:
    name = "lpm"

    def make_queue(self) -> LongestPrefixMatchQueue:
        return LongestPrefixMatchQueue()
