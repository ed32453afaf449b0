"""Which cached-but-unused KV block is evicted when the pool needs a fresh one.

All three keep O(1) (FIFO: amortised O(log n)) operations because they run inside the
allocator. Blocks arrive via `add` in the order their owner released them: a request
releases its table tail-first, so under LRU its deepest prefix blocks go first.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict


class LRUEvictor:
    """Least recently released first (vLLM's free-queue order)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def touch(self, block_id: int) -> None:
        pass

    def pop(self) -> int:
        return self._order.popitem(last=False)[0]

    def forget(self, block_id: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order


class LFUEvictor:
    """Fewest cache hits first; ties broken least-recently-released first.

    Buckets of insertion-ordered dicts keyed by hit count, plus the current minimum
    count, give O(1) add/remove/pop. Hit counts live as long as the block stays cached.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._hits: dict[int, int] = {}                     # block -> hits while cached
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._where: dict[int, int] = {}                    # free block -> its bucket
        self._min = 0

    def add(self, block_id: int) -> None:
        count = self._hits.setdefault(block_id, 0)
        self._buckets.setdefault(count, OrderedDict())[block_id] = None
        self._where[block_id] = count
        if len(self._where) == 1 or count < self._min:
            self._min = count

    def remove(self, block_id: int) -> None:
        count = self._where.pop(block_id)
        bucket = self._buckets[count]
        del bucket[block_id]
        if not bucket:
            del self._buckets[count]

    def touch(self, block_id: int) -> None:
        self._hits[block_id] = self._hits.get(block_id, 0) + 1

    def pop(self) -> int:
        if not self._where:
            raise KeyError("pop from an empty evictor")
        if self._min not in self._buckets:
            self._min = min(self._buckets)   # the min bucket was emptied by remove()
        bucket = self._buckets[self._min]
        block_id, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[self._min]
        del self._where[block_id]
        return block_id

    def forget(self, block_id: int) -> None:
        self._hits.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._where


class FIFOEvictor:
    """Oldest cached content first, regardless of reuse (by time of first release)."""

    name = "fifo"

    def __init__(self) -> None:
        self._born: dict[int, int] = {}          # block -> sequence number when it entered the cache
        self._heap: list[tuple[int, int]] = []
        self._free: set[int] = set()
        self._clock = itertools.count()

    def add(self, block_id: int) -> None:
        born = self._born.setdefault(block_id, next(self._clock))
        self._free.add(block_id)
        heapq.heappush(self._heap, (born, block_id))

    def remove(self, block_id: int) -> None:
        self._free.discard(block_id)             # its heap entry is dropped lazily

    def touch(self, block_id: int) -> None:
        pass

    def pop(self) -> int:
        while self._heap:
            born, b = heapq.heappop(self._heap)
            if b in self._free and self._born.get(b) == born:
                self._free.discard(b)
                return b
        raise KeyError("pop from an empty evictor")

    def forget(self, block_id: int) -> None:
        self._born.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._free)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._free
