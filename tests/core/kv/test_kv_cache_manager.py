"""The block manager against a shadow model of what every KV slot holds.

The state machine plays the executor: after each allocation it "writes" what a step
would compute into a shadow copy of the cache (applying copy-on-write and swap copies
first), and asserts the paged-memory invariants after every rule.

A real KV entry depends on its token *and everything before it*, and a cache salt
isolates tenants, so a slot's shadow value is (salt, the whole prefix up to and
including that slot). A prefix-cache hit whose hash ignored the parent block or the
salt then reads back a value that differs from what the sequence would compute.
"""
from __future__ import annotations

import pytest
from hypothesis import assume, given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core import KVCacheManager, Request, SamplingParams
from core.kv.block_pool import BlockPool
from policies.eviction import FIFOEvictor, LFUEvictor, LRUEvictor

BS = 4
EVICTORS = {"lru": LRUEvictor, "lfu": LFUEvictor, "fifo": FIFOEvictor}
# A few shared prefixes so that prompts really hit the prefix cache. The block [9, 9, 9, 9]
# follows different contexts (or none), so a hash without its parent would collide.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], [5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6], [],
            [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 9, 9, 9, 9, 1, 2, 3, 4]]
SALTS = [None, None, "tenant-a", "tenant-b"]


def slot_value(seq, pos):
    """What slot `pos` of `seq` holds once computed: it depends on the whole prefix."""
    return (seq.request.cache_salt, tuple(seq.token_ids[:pos + 1]))


class KVManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_gpu=st.integers(4, 24), num_cpu=st.integers(0, 16), caching=st.booleans(),
        evictor=st.sampled_from(sorted(EVICTORS)), watermark=st.sampled_from([0.0, 0.0, 0.2]),
    )
    def setup(self, num_gpu, num_cpu, caching, evictor, watermark):
        self.kv = KVCacheManager(BS, num_gpu, num_cpu, enable_prefix_caching=caching,
                                 evictor=EVICTORS[evictor]() if caching else None, watermark=watermark)
        self.shadow_gpu: dict[int, list[int | None]] = {}
        self.shadow_cpu: dict[int, list[int | None]] = {}
        self.groups: list[Request] = []          # resident on GPU
        self.swapped: list[Request] = []
        self.expected_hash_contents: dict[int, tuple] = {}    # prefix hash -> the block's slot values
        self.n = 0

    # -- helpers: the "executor" ---------------------------------------------------------
    def _apply_copies(self):
        for src, dst in self.kv.drain_copies():
            self.shadow_gpu[dst] = list(self.shadow_gpu.get(src, [None] * BS))

    def _compute(self, seq, n):
        """Write tokens [computed, computed+n) through the table, as a forward pass would."""
        self._apply_copies()
        table = self.kv.tables[seq.seq_id]
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = table[pos // BS]
            # Never write a block another table (or the cache index) still relies on.
            assert self.kv.gpu.ref_cnt[block] == 1, f"write into shared block {block}"
            self.shadow_gpu.setdefault(block, [None] * BS)[pos % BS] = slot_value(seq, pos)
        seq.num_computed_tokens += n
        for i, h in enumerate(seq.block_hashes[: seq.num_computed_tokens // BS]):
            self.expected_hash_contents[h] = tuple(slot_value(seq, p) for p in range(i * BS, (i + 1) * BS))

    def _grow(self, seq, n):
        if self.kv.allocate_slots(seq, n):
            self._compute(seq, n)
            return True
        return False

    # -- rules ---------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.lists(st.integers(0, 20), max_size=9),
          chunk=st.integers(1, 24), salt=st.sampled_from(SALTS))
    def add_prompt(self, prefix, tail, chunk, salt):
        tokens = PREFIXES[prefix] + tail
        assume(tokens)
        req = Request(f"r{self.n}", tokens, SamplingParams(max_tokens=64), cache_salt=salt)
        self.n += 1
        seq = req.seqs[0]
        cached = self.kv.find_cached_prefix(seq)
        assert len(cached) * BS <= seq.num_tokens - 1, "must leave the last token to compute"
        seq.num_computed_tokens = len(cached) * BS
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if self.kv.allocate_slots(seq, n, cached):
            self._compute(seq, n)
            self.groups.append(req)
        else:
            assert seq.seq_id not in self.kv.tables, "failed allocation must change nothing"

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), new_token=st.integers(0, 20))
    def step(self, data, new_token):
        """One step for one sequence: continue its prefill, or decode one token."""
        req = data.draw(st.sampled_from(self.groups))
        seq = data.draw(st.sampled_from(req.seqs))
        pending = seq.num_tokens - seq.num_computed_tokens
        if pending == 0:
            seq.token_ids.append(new_token)
            pending = 1
        n = data.draw(st.integers(1, pending))
        used_before = self.kv.gpu.num_used
        if not self._grow(seq, n):
            assert self.kv.gpu.num_used == used_before

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def fork(self, data):
        req = data.draw(st.sampled_from(self.groups))
        parent = data.draw(st.sampled_from(req.seqs))
        assume(parent.num_computed_tokens == parent.num_tokens)
        child = parent.fork()
        self.kv.fork(parent, child)
        req.seqs.append(child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free_seq(self, data):
        req = data.draw(st.sampled_from(self.groups))
        seq = data.draw(st.sampled_from(req.seqs))
        self.kv.free(seq)
        req.seqs.remove(seq)
        if not req.seqs:
            self.groups.remove(req)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def swap_out(self, data):
        req = data.draw(st.sampled_from(self.groups))
        if not self.kv.can_swap_out(req.seqs):
            return
        for g, c in self.kv.swap_out(req.seqs):
            self.shadow_cpu[c] = list(self.shadow_gpu[g])
        self.groups.remove(req)
        self.swapped.append(req)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        req = data.draw(st.sampled_from(self.swapped))
        if not self.kv.can_swap_in(req.seqs):
            return
        for c, g in self.kv.swap_in(req.seqs):
            self.shadow_gpu[g] = list(self.shadow_cpu[c])
        # Swapping in is new work: it must leave the watermark free.
        assert self.kv.stats().num_free_gpu_blocks >= self.kv.watermark_blocks
        self.swapped.remove(req)
        self.groups.append(req)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data):
        req = data.draw(st.sampled_from(self.swapped))
        for seq in req.seqs:
            self.kv.free(seq)
        self.swapped.remove(req)

    # -- invariants ------------------------------------------------------------------------
    def _check_pool(self, pool: BlockPool, tables: dict[int, list[int]]):
        holders = [0] * pool.num_blocks
        for t in tables.values():
            for b in t:
                holders[b] += 1
        assert holders == pool.ref_cnt, f"{pool.name}: refcounts differ from table membership"
        free = pool.uncached_free_blocks()
        evictable = [b for b in range(pool.num_blocks) if pool.evictor is not None and b in pool.evictor]
        assert len(set(free)) == len(free)
        assert not set(free) & set(evictable)
        for b in free + evictable:
            assert pool.ref_cnt[b] == 0, f"{pool.name}: block {b} is free but referenced"
        used = sum(1 for r in pool.ref_cnt if r > 0)
        assert used + pool.num_free == pool.num_blocks
        assert pool.num_used == used
        if pool.evictor is not None:
            assert len(pool.evictor) == len(evictable)
            for b in evictable:
                assert pool.block_hash[b] is not None, "evictable blocks are cached blocks"

    @invariant()
    def pools_consistent(self):
        if not hasattr(self, "kv"):
            return
        self._check_pool(self.kv.gpu, self.kv.tables)
        self._check_pool(self.kv.cpu, self.kv.cpu_tables)

    @invariant()
    def tables_sized_to_tokens(self):
        if not hasattr(self, "kv"):
            return
        for req in self.groups:
            for seq in req.seqs:
                n = seq.num_computed_tokens
                table = self.kv.tables.get(seq.seq_id, [])
                assert len(table) == -(-n // BS), f"{seq}: {len(table)} blocks for {n} tokens"
        for req in self.swapped:
            for seq in req.seqs:
                assert seq.seq_id not in self.kv.tables
                assert len(self.kv.cpu_tables.get(seq.seq_id, [])) == -(-seq.num_computed_tokens // BS)

    @invariant()
    def contents_match_tokens(self):
        """Every resident or swapped sequence reads back exactly what it would compute itself
        (its own prefix under its own salt), wherever its blocks came from."""
        if not hasattr(self, "kv"):
            return
        for reqs, tables, shadow in ((self.groups, self.kv.tables, self.shadow_gpu),
                                     (self.swapped, self.kv.cpu_tables, self.shadow_cpu)):
            for req in reqs:
                for seq in req.seqs:
                    table = tables.get(seq.seq_id, [])
                    got = [shadow[table[p // BS]][p % BS] for p in range(seq.num_computed_tokens)]
                    want = [slot_value(seq, p) for p in range(seq.num_computed_tokens)]
                    assert got == want, f"{seq} reads KV computed for another context or salt"

    @invariant()
    def cache_index_matches_contents(self):
        if not hasattr(self, "kv"):
            return
        pool = self.kv.gpu
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h
            assert tuple(self.shadow_gpu[b]) == self.expected_hash_contents[h], "hash maps to wrong contents"


TestKVManagerMachine = KVManagerMachine.TestCase


def test_cow_emits_copy_before_write():
    kv = KVCacheManager(BS, 8, 0)
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams())
    parent = req.seqs[0]
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    parent.token_ids.append(7)
    child = parent.fork()
    kv.fork(parent, child)
    shared_last = kv.tables[parent.seq_id][-1]
    assert kv.gpu.ref_cnt[shared_last] == 2
    assert kv.allocate_slots(child, 1)
    (src, dst), = kv.drain_copies()
    assert src == shared_last and kv.tables[child.seq_id][-1] == dst != src
    assert kv.tables[child.seq_id][0] == kv.tables[parent.seq_id][0]  # full block still shared
    # The parent is now the sole owner of the old block: no copy for it.
    assert kv.allocate_slots(parent, 1) and kv.drain_copies() == []


def test_prefix_hit_leaves_last_token_and_tail_evicted_first():
    kv = KVCacheManager(BS, 6, 0, enable_prefix_caching=True, evictor=LRUEvictor(), watermark=0.0)
    a = Request("a", list(range(12)), SamplingParams()).seqs[0]
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    blocks = list(kv.tables[a.seq_id])
    kv.free(a)
    # Same 12-token prompt: only two blocks may be reused, the last token is recomputed.
    b = Request("b", list(range(12)), SamplingParams()).seqs[0]
    assert kv.find_cached_prefix(b) == blocks[:2]
    # Eviction order after free: the tail block first.
    assert kv.gpu.allocate(4) == [3, 4, 5, blocks[2]]


def test_swap_out_fails_cleanly_when_cpu_pool_full():
    from core import SwapSpaceExhaustedError
    kv = KVCacheManager(BS, 8, 1)
    s = Request("a", list(range(8)), SamplingParams()).seqs[0]
    assert kv.allocate_slots(s, 8)
    assert not kv.can_swap_out([s])
    with pytest.raises(SwapSpaceExhaustedError, match="CPU swap pool has 1 free blocks, group needs 2"):
        kv.swap_out([s])
    assert len(kv.tables[s.seq_id]) == 2 and kv.cpu.num_used == 0


@given(st.lists(st.sampled_from(["add", "remove", "pop", "touch"]), max_size=60), st.sampled_from(sorted(EVICTORS)))
def test_evictors_behave_like_a_set(ops, name):
    ev = EVICTORS[name]()
    live: set[int] = set()
    nxt = 0
    for op in ops:
        if op == "add":
            ev.add(nxt)
            live.add(nxt)
            nxt += 1
        elif op == "remove" and live:
            b = min(live)
            ev.remove(b)
            live.discard(b)
        elif op == "pop" and live:
            b = ev.pop()
            assert b in live
            live.discard(b)
            ev.forget(b)
        elif op == "touch" and live:
            ev.touch(max(live))
        assert len(ev) == len(live)
        assert all(b in ev for b in live)


def test_lru_lfu_fifo_orders():
    lru, lfu, fifo = LRUEvictor(), LFUEvictor(), FIFOEvictor()
    for ev in (lru, lfu, fifo):
        for b in (1, 2, 3):
            ev.add(b)
    # Block 1 is hit (revived and released again); block 2 hit twice.
    for ev in (lru, lfu, fifo):
        for block in (1, 2, 2):
            ev.remove(block)
            ev.touch(block)
            ev.add(block)
    assert lru.pop() == 3          # least recently released
    assert lfu.pop() == 3          # never hit
    assert lfu.pop() == 1          # one hit, before two hits
    assert fifo.pop() == 1         # first to enter the cache


def test_prefix_hits_need_the_same_context_and_salt():
    kv = KVCacheManager(BS, 16, 0, enable_prefix_caching=True, evictor=LRUEvictor(), watermark=0.0)
    first = Request("a", [1, 2, 3, 4, 9, 9, 9, 9, 0], SamplingParams(), cache_salt="s").seqs[0]
    assert kv.allocate_slots(first, 9)
    # The same block after a different first block, and the same prompt under another salt,
    # find nothing; the same prompt under the same salt finds both blocks.
    other_context = Request("b", [9, 9, 9, 9, 0], SamplingParams(), cache_salt="s").seqs[0]
    other_salt = Request("c", [1, 2, 3, 4, 9, 9, 9, 9, 0], SamplingParams(), cache_salt="t").seqs[0]
    same = Request("d", [1, 2, 3, 4, 9, 9, 9, 9, 0], SamplingParams(), cache_salt="s").seqs[0]
    assert kv.find_cached_prefix(other_context) == []
    assert kv.find_cached_prefix(other_salt) == []
    assert kv.find_cached_prefix(same) == kv.tables[first.seq_id][:2]


def test_admission_revives_a_shared_cached_prefix_once():
    """Regression (found by the scheduler machine once it drew a watermark): a recomputed
    n = 2 request whose samples hit the same cached blocks was charged for reviving them
    twice, could never pass the admission check, and waited forever."""
    kv = KVCacheManager(BS, 7, 0, enable_prefix_caching=True, evictor=LRUEvictor(), watermark=0.15)
    assert kv.watermark_blocks == 1
    first = Request("a", list(range(17)), SamplingParams()).seqs[0]
    assert kv.allocate_slots(first, 17)
    kv.free(first)                                   # 4 full blocks stay cached, refcount 0
    samples = [Request(f"s{i}", list(range(17)), SamplingParams()).seqs[0] for i in range(2)]
    plan = []
    for seq in samples:
        cached = kv.find_cached_prefix(seq)
        assert len(cached) == 4
        seq.num_computed_tokens = 16
        plan.append((seq, 1, cached))
    # 4 revived + 1 new block each = 6 of 7, leaving the 1-block watermark.
    assert kv.can_admit(plan)
    for seq, n, cached in plan:
        assert kv.allocate_slots(seq, n, cached)
    assert kv.stats().num_free_gpu_blocks == 1
