"""Prefix-cache keys: salts isolate tenants, the chain isolates contexts, and the default
hash cannot be made to collide the way Python's tuple hash can.

Requests go through the real Scheduler (prefix caching on); what two requests share is
read from the block tables the scheduler hands the executor.
"""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import example, given, strategies as st

from core import CacheConfig, ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig
from core.kv.block_hash import ROOT, block_hasher, encode_block, hash_algorithms, sha256_block_hash
from policies import PolicySet

BS = 4


def scheduler(hash_algo: str = "sha256") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128),
                     CacheConfig(block_size=BS, num_gpu_blocks=128, enable_prefix_caching=True,
                                 prefix_caching_hash_algo=hash_algo, watermark=0.0),
                     PolicySet())


def prefill(sched: Scheduler, name: str, tokens: list[int], salt: str | None = None) -> list[int]:
    """Add a request, run its prefill; return the block table it was computed into (the
    request stays running, so its blocks stay allocated and published)."""
    sched.add_request(Request(name, tokens, SamplingParams(max_tokens=50, ignore_eos=True, cache_salt=salt),
                              cache_salt=salt))
    out = sched.schedule()
    (mine,) = [s for s in out.scheduled if s.seq.request.request_id == name]
    table = list(mine.block_table)
    sched.update(out, ModelRunnerOutput(token_ids={s.seq.seq_id: [7] for s in out.scheduled if s.num_samples}))
    return table


def full_blocks(table: list[int], num_tokens: int) -> set[int]:
    return set(table[:num_tokens // BS])


tokens_st = st.lists(st.integers(0, 50_000), min_size=BS + 1, max_size=40)
salt_st = st.one_of(st.none(), st.text(min_size=1, max_size=12))


@given(tokens=tokens_st, salts=st.lists(salt_st, min_size=2, max_size=2, unique=True))
def test_different_salts_never_share_blocks(tokens, salts):
    sched = scheduler()
    a = prefill(sched, "a", tokens, salts[0])
    b = prefill(sched, "b", tokens, salts[1])
    assert not set(a) & set(b)
    c = prefill(sched, "c", tokens, salts[0])           # control: the same salt does share
    assert full_blocks(c, len(tokens) - 1) == full_blocks(a, len(tokens) - 1) != set()


@given(first=st.lists(st.integers(0, 99), min_size=BS, max_size=BS),
       other=st.lists(st.integers(0, 99), min_size=BS, max_size=BS), rest=tokens_st)
def test_a_block_is_keyed_by_its_whole_prefix(first, other, rest):
    if first == other:
        other = [t + 1 for t in other]
    sched = scheduler()
    a = prefill(sched, "a", first + rest)
    b = prefill(sched, "b", other + rest)                # same later blocks, different context
    assert not set(a) & set(b)


def test_salt_enters_only_the_first_block():
    sched = scheduler()
    tokens = list(range(100, 113))                       # 3 full blocks
    sched.add_request(Request("s", tokens, SamplingParams(max_tokens=4), cache_salt="tenant"))
    sched.schedule()
    seq = sched.requests["s"].seqs[0]
    h = seq.block_hashes
    assert h[0] == sha256_block_hash(None, tuple(tokens[:4]), "tenant")
    assert h[1] == sha256_block_hash(h[0], tuple(tokens[4:8]), None)
    assert h[2] == sha256_block_hash(h[1], tuple(tokens[8:12]), None)


def test_forged_builtin_collision_shares_blocks_only_under_builtin():
    # Python hashes ints modulo 2**61 - 1, so a tuple holding 2**61 hashes like one holding 1:
    # two different prompts get the same 64-bit key, and the second reads the first's KV.
    victim = [1, 2, 3, 4, 5]
    forged = [2**61, 2, 3, 4, 5]
    assert hash((None, tuple(victim[:4]), None)) == hash((None, tuple(forged[:4]), None))
    sched = scheduler("builtin")
    a, b = prefill(sched, "victim", victim), prefill(sched, "forged", forged)
    assert a[0] == b[0]                                  # the vulnerability the default closes
    sched = scheduler("sha256")
    a, b = prefill(sched, "victim", victim), prefill(sched, "forged", forged)
    assert not set(a) & set(b)


@given(x=st.tuples(st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
                   st.lists(st.integers(-2**63, 2**63 - 1), max_size=6), st.one_of(st.none(), st.text(), st.integers())),
       y=st.tuples(st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
                   st.lists(st.integers(-2**63, 2**63 - 1), max_size=6), st.one_of(st.none(), st.text(), st.integers())))
# Without the token count, one token whose bytes spell a salt's length + text would collide with it.
@example(x=(None, [int.from_bytes(b"\x04\x00\x00\x00s:ab", "little", signed=True)], None), y=(None, [], "ab"))
def test_canonical_encoding_is_injective(x, y):
    def norm(t):          # None parent is ROOT by definition
        return (ROOT if t[0] is None else t[0], tuple(t[1]), t[2])
    if norm(x) != norm(y):
        assert encode_block(x[0], tuple(x[1]), x[2]) != encode_block(y[0], tuple(y[1]), y[2])
    assert sha256_block_hash(x[0], tuple(x[1]), x[2]) == hashlib.sha256(encode_block(x[0], tuple(x[1]), x[2])).digest()


def test_algorithm_names():
    import realexec.config  # noqa: F401 - registers xxhash from outside the core

    assert {"sha256", "builtin", "xxhash"} <= set(hash_algorithms())
    h = block_hasher("xxhash")(None, (1, 2, 3, 4), "s")
    assert isinstance(h, bytes) and len(h) == 16
    with pytest.raises(ValueError, match="unknown prefix-caching hash algorithm 'md5'"):
        CacheConfig(prefix_caching_hash_algo="md5", num_gpu_blocks=4).validate()
