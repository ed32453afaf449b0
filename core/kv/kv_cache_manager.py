"""The paged block manager: per-sequence block tables over a GPU pool and a CPU swap pool.
Implements `core.kv.kv_interface.KVManager`.

Protocol with the scheduler, per step:
  * `allocate_slots(seq, n)` makes the sequence's table cover `num_computed_tokens + n`
    slots before the step computes n new tokens. If the write would land in a block
    shared with another table, the block is copied first (copy-on-write) and the
    (src, dst) pair is queued in `pending_copies` for the executor.
  * blocks that will be full after the step are published in the prefix cache at
    schedule time (the step computes them before anyone can read them: every backend
    stores a layer's new K/V before it runs that layer's attention).
  * `fork`, `free`, `swap_out`, `swap_in` keep refcounts == number of tables holding a block.
"""
from __future__ import annotations

from operator import itemgetter

from core.kv.block_hash import DEFAULT_HASH_ALGO, block_hasher
from core.kv.block_pool import BlockPool
from core.kv.kv_interface import KVCacheStats, allocate_checked_group
from core.sched.policy_api import Evictor
from core.sched.request import Request, Sequence


_step_and_index = itemgetter(0, 1)   # (step, batch index) of an advance_decodes allocation


class SwapSpaceExhaustedError(RuntimeError):
    """The CPU swap pool cannot hold a sequence group; the scheduler recomputes instead."""




class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        *,
        enable_prefix_caching: bool = False,
        evictor: Evictor | None = None,
        watermark: float = 0.01,
        hash_algo: str = DEFAULT_HASH_ALGO,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if enable_prefix_caching and evictor is None:
            raise ValueError("prefix caching needs an evictor (see policies.eviction)")
        self.block_size = block_size
        self.hash_block = block_hasher(hash_algo)    # chained over parent key, tokens, salt (core/kv/block_hash.py)
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockPool(num_gpu_blocks, evictor if enable_prefix_caching else None, "gpu")
        self._gpu_ref_cnt = self.gpu.ref_cnt          # the pool's list (never replaced): one lookup on the hot path
        self._last_offset = block_size - 1            # a token here fills its block
        self.cpu = BlockPool(num_cpu_blocks, None, "cpu")
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.tables: dict[int, list[int]] = {}       # seq_id -> GPU block ids
        self.cpu_tables: dict[int, list[int]] = {}   # seq_id -> CPU block ids (swapped out)
        self._num_registered: dict[int, int] = {}     # seq_id -> leading blocks already in the cache index
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- prefix cache -------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Make sure seq.block_hashes covers its first `num_blocks` full blocks."""
        hashes = seq.block_hashes
        bs, toks, salt = self.block_size, seq.token_ids, seq.request.cache_salt
        parent = hashes[-1] if hashes else None
        hash_block = self.hash_block
        for i in range(len(hashes), num_blocks):   # the salt enters the first block; the chain carries it
            parent = hash_block(parent, tuple(toks[i * bs:(i + 1) * bs]), salt if i == 0 else None)
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks for `seq`'s known tokens, always leaving at
        least the last token to compute (its logits are needed). Takes no references."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._extend_hashes(seq, max_blocks)
        found = []
        lookup = self.gpu.lookup
        for i in range(max_blocks):
            b = lookup(hashes[i])
            if b is None:
                break
            found.append(b)
        return found

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # -- capacity checks ----------------------------------------------------------------
    def _fresh_blocks(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> int:
        """New blocks (and copy-on-write copies) `allocate_slots` would allocate."""
        table = self.tables.get(seq.seq_id)
        have = len(table) if table else len(cached)
        computed = seq.num_computed_tokens if table else len(cached) * self.block_size
        need = -(-(computed + num_new_tokens) // self.block_size) - have
        if table and computed % self.block_size and self.gpu.ref_cnt[table[-1]] > 1:
            need += 1                                   # copy-on-write of the shared last block
        return max(need, 0)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> int:
        """GPU blocks `allocate_slots(seq, num_new_tokens, cached)` would take from the free pool."""
        # Reviving a cached block with refcount 0 removes it from the free count.
        revived = sum(1 for b in cached if self.gpu.ref_cnt[b] == 0) if cached else 0
        return self._fresh_blocks(seq, num_new_tokens, cached) + revived

    def can_admit(self, plan: list[tuple[Sequence, int, list[int]]], keep_watermark: bool = True) -> bool:
        """Could this new work be allocated now, leaving the watermark free (unless told
        not to: an idle engine has no growth to protect)? Cached blocks several sequences
        hit (a recomputed n > 1 or beam request) are revived once."""
        if len(plan) == 1 and not plan[0][2]:          # one sequence, no prefix hits: the common case
            seq, n, _ = plan[0]
            need = self._fresh_blocks(seq, n)
        else:
            ref = self.gpu.ref_cnt
            revived = {b for _, _, cached in plan for b in cached if ref[b] == 0}
            need = sum(self._fresh_blocks(seq, n, cached) for seq, n, cached in plan) + len(revived)
        return self._leaves_watermark(need) if keep_watermark else self.gpu.num_free >= need

    def _leaves_watermark(self, num_blocks: int) -> bool:
        """New work must leave the watermark free, so running sequences can still grow."""
        return self.gpu.num_free - num_blocks >= self.watermark_blocks

    def free_blocks(self, evicting: bool = True) -> int:
        return self.gpu.num_free if evicting else self.gpu.num_uncached_free

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Grow `seq`'s table to hold its computed tokens plus `num_new_tokens`.

        `cached` (first allocation only) are prefix-cache hits from `find_cached_prefix`;
        the caller has set seq.num_computed_tokens to cover them. Returns False and
        changes nothing if the pool is short.
        """
        gpu, bs = self.gpu, self.block_size
        table = self.tables.get(seq.seq_id)
        if table is None:
            if self.blocks_needed(seq, num_new_tokens, cached) > gpu.num_free:
                return False
            self.claim_prefix(seq, cached)
            table = self.tables[seq.seq_id]
        computed = seq.num_computed_tokens
        end = computed + num_new_tokens
        need = -(-end // bs) - len(table)
        cow = computed % bs != 0 and gpu.ref_cnt[table[-1]] > 1
        if need + cow > gpu.num_free:
            return False
        if cow:
            # The step writes into the middle of a block another table also holds.
            src = table[-1]
            dst = gpu.allocate(1)[0]
            gpu.free((src,))
            table[-1] = dst
            self.pending_copies.append((src, dst))
        if need > 0:
            table.extend(gpu.allocate(need))
        # A block is published once its every token is known: under async scheduling a
        # step may compute the token a batch in flight samples, and the block it fills then
        # waits for the sequence's next allocation.
        full = min(end, len(seq.token_ids)) // bs
        if self.enable_prefix_caching and full > self._num_registered[seq.seq_id]:
            self._publish(seq, table, full)
        return True

    def claim_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """Start `seq`'s table with its prefix-cache hits `cached`, a reference on each
        (before its first allocation; nothing if it has a table). Admitting several
        sequences (a recomputed n > 1 or beam request: each hits its own blocks), the
        scheduler claims every sequence's hits before any fresh block is taken: a fresh
        block may be a cached one evicted, and it must not be one another sequence of the
        group is about to hit."""
        if seq.seq_id in self.tables:
            return
        for b in cached:
            self.gpu.hit(b)
        self.tables[seq.seq_id] = list(cached)
        self._num_registered[seq.seq_id] = len(cached)

    def allocate_group(self, plan: list[tuple[Sequence, int]]) -> bool:
        if len(plan) == 1:
            seq, n = plan[0]
            return self.allocate_slots(seq, n)
        # All or nothing across the group (the per-sequence estimate is conservative).
        if sum(self.blocks_needed(seq, n) for seq, n in plan) > self.gpu.num_free:
            return False
        return allocate_checked_group(self, plan)

    def decode_table(self, seq: Sequence) -> list[int] | None:
        # One more token that neither starts a block, nor fills one (nothing to publish),
        # nor lands in a shared block.
        offset = seq.num_computed_tokens % self.block_size
        if offset and offset != self._last_offset:
            table = self.tables[seq.seq_id]
            if self._gpu_ref_cnt[table[-1]] == 1:
                return table
        return None

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (refcount +1 each)."""
        table = self.tables[parent.seq_id]
        self.tables[child.seq_id] = list(table)
        self.gpu.incref(table)
        self._num_registered[child.seq_id] = self._num_registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (GPU or swapped CPU); tail blocks become the first
        eviction candidates. Idempotent."""
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            self.gpu.free(reversed(table))
        cpu_table = self.cpu_tables.pop(seq.seq_id, None)
        if cpu_table is not None:
            self.cpu.free(reversed(cpu_table))
        self._num_registered.pop(seq.seq_id, None)

    def drain_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- swapping (whole sequence groups, all or nothing) ---------------------------------
    @staticmethod
    def _distinct_blocks(tables: list[list[int]]) -> int:
        return len({b for t in tables for b in t})

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self._distinct_blocks([self.tables.get(s.seq_id, ()) for s in seqs]) <= self.cpu.num_free

    def can_swap_in(self, seqs: list[Sequence], keep_watermark: bool = True) -> bool:
        need = self._distinct_blocks([self.cpu_tables.get(s.seq_id, ()) for s in seqs])
        return self._leaves_watermark(need) if keep_watermark else self.gpu.num_free >= need

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the group's blocks to the CPU pool; returns (gpu_block, cpu_block) copies."""
        if not self.can_swap_out(seqs):
            raise SwapSpaceExhaustedError(
                f"CPU swap pool has {self.cpu.num_free} free blocks, group needs "
                f"{self._distinct_blocks([self.tables.get(s.seq_id, ()) for s in seqs])}")
        return self._move(seqs, self.tables, self.cpu_tables, self.gpu, self.cpu)

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring a swapped group back; returns (cpu_block, gpu_block) copies."""
        mapping = self._move(seqs, self.cpu_tables, self.tables, self.cpu, self.gpu)
        for s in seqs:
            # Fresh GPU blocks are unpublished; the next allocate re-publishes them
            # (skipping hashes another block already serves).
            if s.seq_id in self.tables:
                self._num_registered[s.seq_id] = 0
        return mapping

    @staticmethod
    def _move(seqs, src_tables, dst_tables, src_pool: BlockPool, dst_pool: BlockPool):
        # Blocks shared inside the group stay shared on the other side.
        mapping: dict[int, int] = {}
        for s in seqs:
            src = src_tables.pop(s.seq_id, None)
            if src is None:
                continue                       # a sequence with nothing cached yet
            dst = []
            for b in src:
                d = mapping.get(b)
                if d is None:
                    d = mapping[b] = dst_pool.allocate(1)[0]
                else:
                    dst_pool.incref((d,))
                dst.append(d)
            dst_tables[s.seq_id] = dst
            src_pool.free(reversed(src))
        return list(mapping.items())

    def worst_case_blocks(self, request: Request, max_model_len: int) -> int:
        """Blocks the request could hold at once if it ran alone to its end (no sharing)."""
        max_tokens = request.params.max_tokens
        longest = max_model_len if max_tokens is None else min(request.num_prompt_tokens + max_tokens, max_model_len)
        return request.params.num_seqs_max * -(-longest // self.block_size)

    def release_request(self, request: Request) -> None:
        """A request left the GPU (finished or recomputed): drop per-request state (none here)."""

    # -- steady decode spans (core.sched.event_skipping) -----------------------------------------
    def writes_into_shared_block(self, seqs: list[Sequence]) -> bool:
        bs, ref, tables = self.block_size, self._gpu_ref_cnt, self.tables
        return any(s.num_computed_tokens % bs and ref[tables[s.seq_id][-1]] > 1 for s in seqs)

    def blocks_to_grow(self, seqs: list[Sequence], num_steps: int) -> int:
        bs, tables = self.block_size, self.tables
        return sum(max(0, -(-(s.num_computed_tokens + num_steps) // bs) - len(tables[s.seq_id])) for s in seqs)

    def decode_block_offsets(self, seqs: list[Sequence]) -> list[int] | None:
        # A sequence with c cached tokens and b blocks takes its next block at step
        # j0 = b * bs - c (0 = the next step), then every bs steps.
        bs, ref, tables = self.block_size, self._gpu_ref_cnt, self.tables
        offsets: list[int] = []
        append = offsets.append
        for s in seqs:
            table = tables[s.seq_id]
            c = s.num_computed_tokens
            if c % bs and ref[table[-1]] > 1:
                return None                               # the next step copies on write
            append(len(table) * bs - c)
        return offsets

    def steps_fitting(self, offsets: list[int], max_steps: int, free: int) -> int:
        bs = self.block_size
        # k steps take ceil((k - j0) / bs) blocks per sequence with j0 < k: at most ceil(k / bs).
        if len(offsets) * -(-max_steps // bs) <= free:
            return max_steps
        need = 0
        for j0 in offsets:
            if j0 < max_steps:
                need += (max_steps - j0 + bs - 1) // bs
        if need <= free:
            return max_steps

        def growth(k: int) -> int:
            return sum((k - j0 + bs - 1) // bs for j0 in offsets if j0 < k)

        lo, hi = 0, max_steps                             # growth(lo) fits, growth(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if growth(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def decode_steps_fitting(self, seqs: list[Sequence], max_steps: int, free: int) -> int:
        offsets = self.decode_block_offsets(seqs)
        return 0 if offsets is None else self.steps_fitting(offsets, max_steps, free)

    def advance_decodes(self, seqs: list[Sequence], num_steps: int, offsets: list[int] | None = None) -> None:
        bs, gpu, tables = self.block_size, self.gpu, self.tables
        caching = self.enable_prefix_caching
        if not caching:
            if offsets is None:
                offsets = [len(tables[seq.seq_id]) * bs - seq.num_computed_tokens for seq in seqs]
            takers = self.decode_allocations(seqs, None, offsets, num_steps)
            if takers:
                self.take_blocks(takers)
            return
        # Step j computes position c + j of each sequence: it needs a new block when that
        # position starts one, and publishes a block when c + j + 1 fills one.
        events: list[list[tuple[Sequence, bool]]] = [[] for _ in range(bs)]
        for seq in seqs:
            c = seq.num_computed_tokens
            events[(-c) % bs].append((seq, True))
            events[(-c - 1) % bs].append((seq, False))
        order = {seq.seq_id: i for i, seq in enumerate(seqs)}
        for ev in events:
            ev.sort(key=lambda e: order[e[0].seq_id])
        registered = self._num_registered
        for j in range(num_steps):
            for seq, is_alloc in events[j % bs]:
                table = tables[seq.seq_id]
                if is_alloc:
                    if len(table) * bs <= seq.num_computed_tokens + j:
                        table.extend(gpu.allocate(1))
                    # A step that starts a block runs allocate_slots, which also publishes
                    # full blocks still unpublished (a swapped-in table whose swap-in step
                    # could not compute it): so here too.
                    if registered[seq.seq_id] < (seq.num_computed_tokens + j + 1) // bs:
                        self._publish(seq, table, (seq.num_computed_tokens + j + 1) // bs)
                else:
                    self._publish(seq, table, (seq.num_computed_tokens + j + 1) // bs)

    def decode_allocations(self, seqs: list[Sequence], counts: list[int] | None, offsets: list[int],
                           num_steps: int = 0) -> list[tuple[int, int, list[int]]] | None:
        # Step j gives a block to each sequence whose next block starts at position c + j,
        # in batch order; a sequence with b blocks and c cached tokens takes them at steps
        # b * bs - c, + bs, ... So the allocations in (step, batch index) order, handed out
        # by one bulk allocate, get the same ids as the single steps' allocations (the free
        # stack pops in the same order).
        if self.enable_prefix_caching:
            return None                                   # allocations publish: advance_decodes
        bs, tables = self.block_size, self.tables
        takers: list[tuple[int, int, list[int]]] = []
        for i, j0 in enumerate(offsets):
            end = num_steps if counts is None else counts[i]
            if j0 < end:
                table = tables[seqs[i].seq_id]
                for j in range(j0, end, bs):
                    takers.append((j, i, table))
        takers.sort(key=_step_and_index)
        return takers

    def take_blocks(self, takers: list[tuple[int, int, list[int]]]) -> None:
        for (_, _, table), block in zip(takers, self.gpu.allocate(len(takers))):
            table.append(block)

    def retract(self, seq: Sequence) -> None:
        """The step that allocated for `seq` will not compute it after all (the scheduler took
        its slice back; seq.num_computed_tokens is back where it was): blocks published for
        that slice leave the prefix-cache index, so no later hit reads KV never written."""
        full = seq.num_computed_tokens // self.block_size
        registered = self._num_registered.get(seq.seq_id, 0)
        table = self.tables.get(seq.seq_id)
        if table is None or registered <= full:
            return
        for b in table[full:registered]:
            self.gpu._drop_hash(b)       # (a block another table published first has no hash here)
        self._num_registered[seq.seq_id] = full

    def _publish(self, seq: Sequence, table: list[int], full: int) -> None:
        """Publish the first `full` blocks of `seq` that are not yet in the cache index."""
        hashes = self._extend_hashes(seq, full)
        registered = self._num_registered
        register = self.gpu.register
        for i in range(registered[seq.seq_id], full):
            register(table[i], hashes[i])
        registered[seq.seq_id] = full

    # -- introspection ------------------------------------------------------------------
    def memory_breakdown(self, running: list[Request], waiting_head: Request | None = None) -> dict[str, int]:
        """Where the GPU KV slots are now (the vLLM paper's Figure 2 categories), in slots.

        Paged memory reserves nothing ahead and has no external fragmentation; its only
        waste is the unfilled tail of each sequence's last block (counted once per block)."""
        bs, tables = self.block_size, self.tables
        # A single-sequence request's partial last block is its own (the prefix cache only
        # shares full blocks): its slack is (-computed) mod block_size. Only forked groups
        # can share a partial block, so they are counted per distinct block.
        internal = 0
        fill: dict[int, int] = {}
        for request in running:
            seqs = request.seqs
            if len(seqs) == 1:
                internal += -seqs[0].num_computed_tokens % bs
                continue
            for seq in seqs:
                table = tables.get(seq.seq_id)
                if table:
                    last = table[-1]
                    f = seq.num_computed_tokens - (len(table) - 1) * bs
                    if f > fill.get(last, 0):
                        fill[last] = f
        internal += sum(bs - f for f in fill.values())
        return {"token_states": self.gpu.num_used * bs - internal, "reserved": 0, "internal_frag": internal,
                "external_frag": 0, "free": self.gpu.num_free * bs}

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_gpu_blocks=self.gpu.num_blocks,
            num_used_gpu_blocks=self.gpu.num_used,
            num_cached_gpu_blocks=self.gpu.num_cached,
            num_cpu_blocks=self.cpu.num_blocks,
            num_used_cpu_blocks=self.cpu.num_used,
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
            num_evictions=self.gpu.num_evictions,
        )
