"""The pre-paging baselines of the vLLM paper (Orca-Max / Orca-Pow2 / Orca-Oracle).

Each sequence reserves ONE contiguous region of the KV memory at admission, sized by a
reservation rule, and keeps it until it finishes. Regions are placed first-fit over
the same block-id space the paged manager uses, so reservation waste, internal
fragmentation (reserved slots never used) and external fragmentation (free memory in
gaps too small for the next request) are real, not assumed. There is no sharing:
parallel samples and beams each get their own region, and a fork copies the parent's
computed blocks into the child's region. No prefix caching and no swapping (the
scheduler falls back to recompute, which these baselines never need: a region covers
its sequence's whole life).
"""
from __future__ import annotations

import bisect
from typing import Callable

from core.kv.block_pool import BlockPool, NoFreeBlocksError
from core.kv.kv_cache_manager import SwapSpaceExhaustedError
from core.kv.kv_interface import KVCacheStats, allocate_checked_group
from core.sched.request import Request, RequestStatus, Sequence

# How many token slots a sequence reserves, given its request.
ReservationRule = Callable[[Request, int], int]   # (request, max_model_len) -> tokens


class ContiguousBlockPool(BlockPool):
    """Block ids handed out as contiguous runs, first fit; free runs merge back."""

    def __init__(self, num_blocks: int, name: str = "gpu"):
        super().__init__(num_blocks, None, name)
        self._free.clear()
        self._starts: list[int] = [0] if num_blocks else []   # sorted gap starts
        self._ends: dict[int, int] = {0: num_blocks} if num_blocks else {}
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def gaps(self) -> list[tuple[int, int]]:
        """Free runs as [start, end) block ranges, in address order."""
        return [(s, self._ends[s]) for s in self._starts]

    def largest_gap(self) -> int:
        return max((self._ends[s] - s for s in self._starts), default=0)

    def fits(self, sizes: list[int]) -> bool:
        """Would first-fit place all these runs (in order) right now?"""
        gaps = [[s, self._ends[s]] for s in self._starts]
        for n in sizes:
            for g in gaps:
                if g[1] - g[0] >= n:
                    g[0] += n
                    break
            else:
                return False
        return True

    def allocate(self, n: int) -> list[int]:
        for i, s in enumerate(self._starts):
            e = self._ends[s]
            if e - s >= n:
                del self._ends[s]
                if e - s == n:
                    del self._starts[i]
                else:
                    self._starts[i] = s + n
                    self._ends[s + n] = e
                for b in range(s, s + n):
                    self.ref_cnt[b] = 1
                self._num_free -= n
                return list(range(s, s + n))
        raise NoFreeBlocksError(f"{self.name} pool: no contiguous run of {n} blocks "
                                f"({self._num_free} free, largest run {self.largest_gap()})")

    def free(self, block_ids) -> None:
        released = []
        for b in block_ids:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"{self.name} pool: double free of block {b}")
            if self.ref_cnt[b] == 0:
                released.append(b)
        for b in sorted(released):
            self._insert_gap(b, b + 1)
        self._num_free += len(released)

    def _insert_gap(self, s: int, e: int) -> None:
        i = bisect.bisect_left(self._starts, s)
        if i > 0 and self._ends[self._starts[i - 1]] == s:      # merge with the gap before
            i -= 1
            s = self._starts[i]
            del self._starts[i]
        if i < len(self._starts) and self._starts[i] == e:       # merge with the gap after
            e2 = self._ends.pop(e)
            del self._starts[i]
            e = e2
        self._starts.insert(i, s)
        self._ends[s] = e


class ContiguousKVCacheManager:
    """Implements `core.kv.kv_interface.KVManager` with one contiguous region per sequence."""

    enable_prefix_caching = False
    watermark_blocks = 0        # a region covers its sequence's whole life: nothing grows later

    def __init__(self, block_size: int, num_gpu_blocks: int, reserve: ReservationRule, max_model_len: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.gpu = ContiguousBlockPool(num_gpu_blocks)
        self.cpu = BlockPool(0, None, "cpu")               # no swapping
        self.reserve = reserve
        self.max_model_len = max_model_len
        self.tables: dict[int, list[int]] = {}              # seq_id -> its region's block ids
        self.cpu_tables: dict[int, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self._spares: dict[str, list[list[int]]] = {}       # request id -> reserved, unused regions
        self.prefix_queries = 0

    def _region_blocks(self, request: Request) -> int:
        tokens = min(max(self.reserve(request, self.max_model_len), 1), self.max_model_len)
        return -(-tokens // self.block_size)

    def _regions_to_reserve(self, seq: Sequence) -> list[int]:
        """Region sizes a first allocation for `seq` reserves: before the fork, one per
        sequence the request may hold (the spares are what its children fork into)."""
        request = seq.request
        k = request.params.num_seqs_max if not request._forked else 1
        return [self._region_blocks(request)] * k

    def _fits_plan(self, plan) -> bool:
        sizes = []
        for seq, n, *_ in plan:
            table = self.tables.get(seq.seq_id)
            if table is None:
                sizes += self._regions_to_reserve(seq)
            elif seq.num_computed_tokens + n > len(table) * self.block_size:
                return False                                 # a region never grows
        return self.gpu.fits(sizes)

    # -- admission ------------------------------------------------------------------------
    def worst_case_blocks(self, request: Request, max_model_len: int) -> int:
        return request.params.num_seqs_max * self._region_blocks(request)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        return []

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens

    def can_admit(self, plan, keep_watermark: bool = True) -> bool:   # no watermark: see above
        return self._fits_plan(plan)

    # -- allocation -----------------------------------------------------------------------
    def claim_prefix(self, seq: Sequence, cached: list[int]) -> None:
        if cached:                  # find_cached_prefix finds none: regions are never shared
            raise ValueError("contiguous allocation has no prefix cache to hit")

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached=()) -> bool:
        table = self.tables.get(seq.seq_id)
        end = seq.num_computed_tokens + num_new_tokens
        if table is not None:
            return end <= len(table) * self.block_size     # a region never grows
        sizes = self._regions_to_reserve(seq)
        if sizes[0] * self.block_size < end or not self.gpu.fits(sizes):
            return False
        regions = [self.gpu.allocate(r) for r in sizes]
        self.tables[seq.seq_id] = regions[0]
        if len(regions) > 1:
            self._spares.setdefault(seq.request.request_id, []).extend(regions[1:])
        return True

    def allocate_group(self, plan: list[tuple[Sequence, int]]) -> bool:
        if not self._fits_plan(plan):
            return False
        return allocate_checked_group(self, plan)

    def decode_table(self, seq: Sequence) -> list[int] | None:
        table = self.tables[seq.seq_id]
        return table if seq.num_computed_tokens < len(table) * self.block_size else None

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        spares = self._spares.get(parent.request.request_id)
        if not spares:
            raise NoFreeBlocksError(f"request {parent.request.request_id!r}: no reserved region left to fork into")
        region = spares.pop()
        src = self.tables[parent.seq_id]
        used = -(-parent.num_computed_tokens // self.block_size)
        self.pending_copies.extend(zip(src[:used], region[:used]))
        self.tables[child.seq_id] = region

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, None)
        if table is None:
            return
        request = seq.request
        if request.status is RequestStatus.RUNNING and seq.status is RequestStatus.RUNNING:
            # A pruned beam: its region stays reserved for the request's next fork.
            self._spares.setdefault(request.request_id, []).append(table)
        else:
            self.gpu.free(table)

    def release_request(self, request: Request) -> None:
        for region in self._spares.pop(request.request_id, []):
            self.gpu.free(region)

    def spare_regions(self) -> list[list[int]]:
        """Regions reserved for forks that have not happened yet."""
        return [r for regions in self._spares.values() for r in regions]

    def drain_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- no swapping (the scheduler recomputes instead) ------------------------------------------
    def can_swap_out(self, seqs) -> bool:
        return False

    def can_swap_in(self, seqs, keep_watermark: bool = True) -> bool:
        return False

    def swap_out(self, seqs):
        raise SwapSpaceExhaustedError("contiguous allocation has no swap space")

    def swap_in(self, seqs):
        raise SwapSpaceExhaustedError("contiguous allocation has no swap space")

    # -- steady decode spans -----------------------------------------------------------------
    def writes_into_shared_block(self, seqs: list[Sequence]) -> bool:
        return False                                        # no sharing: a fork copies

    def blocks_to_grow(self, seqs: list[Sequence], num_steps: int) -> int:
        slots = self.block_size
        for s in seqs:
            if s.num_computed_tokens + num_steps > len(self.tables[s.seq_id]) * slots:
                return self.gpu.num_blocks + 1              # past a region's end: impossible
        return 0

    def free_blocks(self, evicting: bool = True) -> int:
        return self.gpu.num_free

    def decode_block_offsets(self, seqs: list[Sequence]) -> list[int] | None:
        """The room left in each region (a region never grows: steps past it cannot run)."""
        slots, tables = self.block_size, self.tables
        return [len(tables[s.seq_id]) * slots - s.num_computed_tokens for s in seqs]

    def steps_fitting(self, offsets: list[int], max_steps: int, free: int) -> int:
        """Regions never grow: as far as the fullest region lets every sequence go."""
        return max(min(max_steps, min(offsets, default=max_steps)), 0)

    def decode_steps_fitting(self, seqs: list[Sequence], max_steps: int, free: int) -> int:
        return self.steps_fitting(self.decode_block_offsets(seqs), max_steps, free)

    def advance_decodes(self, seqs: list[Sequence], num_steps: int, offsets: list[int] | None = None) -> None:
        """Nothing to allocate: the regions already cover the span (`blocks_to_grow` is 0)."""

    def decode_allocations(self, seqs: list[Sequence], counts: list[int] | None, offsets: list[int],
                           num_steps: int = 0) -> None:
        return None                                       # regions never grow

    def take_blocks(self, takers: list) -> None:
        raise RuntimeError("contiguous regions never take blocks one by one")

    # -- introspection ------------------------------------------------------------------------
    def memory_breakdown(self, running: list[Request], waiting_head: Request | None) -> dict[str, int]:
        bs = self.block_size
        tokens = reserved = internal = 0
        for request in running:
            final = min(request.num_prompt_tokens + (request.params.max_tokens or self.max_model_len),
                        self.max_model_len)
            for seq in request.seqs:
                table = self.tables.get(seq.seq_id)
                if table is None:
                    continue
                slots = len(table) * bs
                will_use = min(slots, final)
                tokens += seq.num_computed_tokens
                reserved += will_use - seq.num_computed_tokens
                internal += slots - will_use
            for region in self._spares.get(request.request_id, []):
                slots = len(region) * bs
                reserved += min(slots, final)
                internal += slots - min(slots, final)
        free = self.gpu.num_free * bs
        external = 0
        if waiting_head is not None:
            need = self._region_blocks(waiting_head)
            k = waiting_head.params.num_seqs_max
            if self.gpu.num_free >= need * k and not self.gpu.fits([need] * k):
                external = free          # free memory exists, but no gap can take the request
        return {"token_states": tokens, "reserved": reserved, "internal_frag": internal,
                "external_frag": external, "free": free - external}

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_gpu_blocks=self.gpu.num_blocks, num_used_gpu_blocks=self.gpu.num_used, num_cached_gpu_blocks=0,
            num_cpu_blocks=0, num_used_cpu_blocks=0, prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=0, num_evictions=0)
