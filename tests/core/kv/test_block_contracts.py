"""Block pool and block manager contracts the state machine does not reach: double frees,
the evictor's view of hits and evictions, cache resets, republishing after a swap-in,
the decode fast path's shared-block check, and the decode-span arithmetic of event skipping.
Each test here was written against a mutation no other core test caught."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from core import KVCacheManager, Request, SamplingParams
from core.kv.block_pool import BlockPool
from policies.eviction import FIFOEvictor, LFUEvictor, LRUEvictor

BS = 4


def seq_of(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams()).seqs[0]


def computed(kv: KVCacheManager, seq, n: int):
    """Allocate and 'compute' n more tokens of seq (as a step would)."""
    assert kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    return seq


@pytest.mark.parametrize("evictor", [None, LRUEvictor])
def test_a_double_free_raises_and_leaves_the_pool_as_it_was(evictor):
    pool = BlockPool(4, evictor() if evictor else None)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(RuntimeError, match=f"gpu pool: double free of block {a}"):
        pool.free([a])
    assert pool.ref_cnt[a] == 0 and pool.ref_cnt[b] == 1
    assert pool.num_free == 3 and pool.uncached_free_blocks().count(a) == 1


def _cached_free_blocks(pool: BlockPool, hashes):
    """Blocks published under `hashes` and released, in that order: all in the evictor."""
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes):
        assert pool.register(b, h)
    pool.free(blocks)
    return blocks


def test_hits_taken_through_the_pool_order_lfu_eviction():
    pool = BlockPool(3, LFUEvictor())
    a, b, c = _cached_free_blocks(pool, [101, 102, 103])
    for block, hits in ((a, 2), (b, 1)):
        for _ in range(hits):
            assert pool.lookup({a: 101, b: 102}[block]) == block
            pool.hit(block)
            pool.free([block])
    assert pool.allocate(3) == [c, b, a]       # fewest hits first
    assert pool.num_evictions == 3


def test_an_evicted_block_enters_the_cache_again_as_new():
    """LFU's hit count and FIFO's age belong to the cached content, not the block id."""
    for evictor in (LFUEvictor(), FIFOEvictor()):
        pool = BlockPool(2, evictor)
        a, b = _cached_free_blocks(pool, [1, 2])     # a: the older content
        for _ in range(3):                           # ... and the more popular one
            pool.hit(a)
            pool.free([a])
        assert sorted(pool.allocate(2)) == sorted([a, b]) and pool.num_cached == 0   # both evicted
        # New contents: b's gets a hit, a's none; a's is released last (the younger).
        assert pool.register(b, 20) and pool.register(a, 10)
        pool.free([b])
        pool.hit(b)
        pool.free([b])
        pool.free([a])
        if isinstance(evictor, LFUEvictor):
            assert pool.allocate(1) == [a], "a re-published block kept its old content's hits"
        else:
            assert pool.allocate(1) == [b], "a re-published block kept its old content's age"


def test_reset_cache_hands_every_cached_free_block_back_uncached():
    pool = BlockPool(4, LRUEvictor())
    blocks = _cached_free_blocks(pool, [7, 8, 9])
    held = pool.allocate(1)                    # the uncached one: stays in use
    assert pool.reset_cache() == 3
    assert pool.num_cached == 0 and pool.num_free == 3 and pool.num_uncached_free == 3
    assert sorted(pool.allocate(3)) == sorted(blocks) and pool.num_evictions == 0
    assert pool.ref_cnt[held[0]] == 1


def test_evictions_show_in_the_managers_stats():
    kv = KVCacheManager(BS, 3, 0, enable_prefix_caching=True, evictor=LRUEvictor(), watermark=0.0)
    first = computed(kv, seq_of(range(9), "a"), 9)          # 2 full blocks published + 1
    kv.free(first)
    assert kv.stats().num_evictions == 0
    computed(kv, seq_of([50 + i for i in range(12)], "b"), 12)   # needs all 3: evicts the 2 cached
    assert kv.stats().num_evictions == 2 and kv.gpu.num_cached == 3      # b's three full blocks


def test_a_swapped_in_sequence_publishes_its_blocks_again():
    kv = KVCacheManager(BS, 3, 4, enable_prefix_caching=True, evictor=LRUEvictor(), watermark=0.0)
    a = computed(kv, seq_of(range(8), "a"), 8)               # blocks for tokens 0-3 and 4-7, published
    kv.swap_out([a])
    # Another sequence takes the whole pool, evicting a's cached GPU copies, and leaves.
    b = computed(kv, seq_of([90 + i for i in range(11)], "b"), 11)
    kv.free(b)
    kv.swap_in([a])                                           # fresh GPU blocks, not in the index
    a.token_ids.append(8)
    computed(kv, a, 1)                                        # its next step publishes them
    probe = seq_of(list(range(8)) + [8, 99], "c")
    assert kv.find_cached_prefix(probe) == kv.tables[a.seq_id][:2]


def _forked_pair(kv: KVCacheManager, n_tokens: int):
    parent = computed(kv, seq_of(range(n_tokens), "p"), n_tokens)
    parent.token_ids.append(77)
    child = parent.fork()
    kv.fork(parent, child)
    return parent, child


def test_the_decode_fast_path_refuses_a_shared_last_block():
    kv = KVCacheManager(BS, 8, 0)
    parent, child = _forked_pair(kv, 6)                       # last block half full, shared
    assert kv.decode_table(parent) is None and kv.decode_table(child) is None
    assert kv.writes_into_shared_block([parent]) and kv.writes_into_shared_block([child])
    computed(kv, child, 1)                                    # the child copies on write
    kv.drain_copies()
    assert kv.decode_table(parent) == kv.tables[parent.seq_id]   # now the parent's alone
    assert not kv.writes_into_shared_block([parent, child])


def test_a_forked_group_swaps_out_into_its_distinct_blocks():
    kv = KVCacheManager(BS, 8, 2)
    parent, child = _forked_pair(kv, 8)                       # two full blocks, both shared
    assert kv.can_swap_out([parent, child])
    kv.swap_out([parent, child])
    assert kv.cpu.num_used == 2 and kv.cpu_tables[parent.seq_id] == kv.cpu_tables[child.seq_id]


@given(offsets=st.lists(st.integers(0, 12), max_size=6), max_steps=st.integers(0, 40), free=st.integers(0, 30))
def test_steps_fitting_is_the_longest_span_whose_growth_fits(offsets, max_steps, free):
    kv = KVCacheManager(BS, 1, 0)

    def growth(k):         # blocks taken by k steps: one per sequence at j0, j0 + BS, ... < k
        return sum(len(range(j0, k, BS)) for j0 in offsets)

    want = max(k for k in range(max_steps + 1) if growth(k) <= free)
    assert kv.steps_fitting(offsets, max_steps, free) == want
