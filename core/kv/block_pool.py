"""Physical KV blocks of one device: refcounts, free blocks, and the prefix-cache index.

Struct-of-arrays (plain lists indexed by block id) because this sits on the per-step
hot path and attribute access on per-block objects costs more than list indexing in
CPython. A free block is either *uncached* (in `_free`, handed out first) or *cached*
(it still has a prefix hash and lives in the evictor, reusable until evicted).
"""
from __future__ import annotations

from typing import Iterable

from core.sched.policy_api import Evictor


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, evictor: Evictor | None = None, name: str = "gpu"):
        if num_blocks < 0:
            raise ValueError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # A stack (the most recently freed block is reused first); reversed so that a fresh
        # pool hands out ids 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # evictor None = this pool never caches (e.g. the CPU swap pool, or caching off).
        self.evictor = evictor
        self.cached: dict[int, int] = {}          # prefix hash -> block id
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (uncached free + evictable cached)."""
        return len(self._free) + (len(self.evictor) if self.evictor is not None else 0)

    @property
    def num_uncached_free(self) -> int:
        """Free blocks an allocation can take without evicting a cached block."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def uncached_free_blocks(self) -> list[int]:
        """The free blocks that hold no cached prefix (handed out first, most recent last)."""
        return list(self._free)

    # -- allocation -------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocksError(f"{self.name} pool: need {n} blocks, {self.num_free} free")
        free, ref = self._free, self.ref_cnt
        take = min(n, len(free))
        out = free[-take:][::-1] if take else []
        del free[len(free) - take:]
        for _ in range(n - take):                 # the rest comes from evicting cached blocks
            b = self.evictor.pop()                # type: ignore[union-attr]
            self._drop_hash(b)
            self.num_evictions += 1
            out.append(b)
        for b in out:
            ref[b] = 1
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        ref = self.ref_cnt
        for b in block_ids:
            ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order (= eviction order:
        callers pass a table tail-first so a request's last blocks are evicted first)."""
        ref, evictor, push = self.ref_cnt, self.evictor, self._free.append
        if evictor is None:                       # a pool that never caches: no hash lookup
            for b in block_ids:
                r = ref[b] - 1
                ref[b] = r
                if not r:
                    push(b)
                elif r < 0:
                    ref[b] = 0
                    raise RuntimeError(f"{self.name} pool: double free of block {b}")
            return
        hashes, cache = self.block_hash, evictor.add
        for b in block_ids:
            r = ref[b] - 1
            if r < 0:
                raise RuntimeError(f"{self.name} pool: double free of block {b}")
            ref[b] = r
            if r == 0:
                if hashes[b] is not None:
                    cache(b)
                else:
                    push(b)

    # -- prefix cache -----------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def hit(self, block_id: int) -> None:
        """Take a reference on a cached block found by `lookup`."""
        if self.ref_cnt[block_id] == 0:
            self.evictor.remove(block_id)         # type: ignore[union-attr]
        self.ref_cnt[block_id] += 1
        self.evictor.touch(block_id)              # type: ignore[union-attr]

    def register(self, block_id: int, block_hash: int) -> bool:
        """Publish a full, computed block under its hash (first writer wins)."""
        if self.evictor is None or block_hash in self.cached:
            return False
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def _drop_hash(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.evictor.forget(block_id)         # type: ignore[union-attr]

    def reset_cache(self) -> int:
        """Forget every cached-but-free block (their KV is gone, e.g. after the workers
        slept); returns how many. Blocks in use keep their hashes."""
        if self.evictor is None:
            return 0
        n = 0
        while len(self.evictor):
            b = self.evictor.pop()
            self._drop_hash(b)
            self._free.append(b)
            n += 1
        return n
