"""Where the KV memory goes, time-weighted: the vLLM paper's Figure 2 breakdown and the
blocks saved by sharing.

Per engine step the simulator takes one `MemorySample` of the state *during* the step
(after `schedule()` allocated the step's slots) and weights it by the step's duration:

  token_states   slots holding a computed token's K/V
  reserved       slots a contiguous (orca-*) region holds for tokens its sequence will
                 still produce (0 for paged allocation: it reserves nothing ahead)
  internal_frag  allocated slots no token will ever fill (the unfilled tail of a paged
                 sequence's last block; an orca region's slots past the request's end)
  external_frag  free slots that cannot be used: the next waiting request would fit in
                 the free total but no free gap is large enough (contiguous only)
  free           the rest of the pool
  physical       GPU blocks in use (refcount > 0)
  logical        sum over GPU block tables of their lengths: the blocks the same
                 sequences would hold if none were shared (no fork, no prefix cache)

Shares are of the memory *in use* (the four first categories), as in the paper. The
sharing saving is `1 - physical / logical` over the run (both time-integrated): the
counterfactual "every sample, beam and prompt owns a copy of its blocks" on the very
same schedule, i.e. what the paper's Figure 15 compares.

Event skipping (steady decode spans) needs no per-step scan: in such a span every
running sequence writes exactly one token per step into memory only it holds, so with
N running sequences and the state before the span (`SpanModel`):
  token_states(i) = T + (i + 1) N                    (step i = 0, 1, ... of the span)
  reserved(i)     = R - (i + 1) N   (contiguous: the new tokens use reserved slots)
                  = 0               (paged)
  free(i)         = F - block_size * (used(i) - used_before)
  external_frag   constant (no allocation, admission or free happens in the span)
  internal_frag   = the rest (paged: used(i) * block_size - token_states(i))
  logical(i)      = L + used(i) - used_before (each new block joins one table)
The values are the same integers the step-by-step mode reads from the core, added in
the same order, so both modes produce bit-identical sums (tested).
"""
from __future__ import annotations

from typing import NamedTuple

from core.kv.contiguous import ContiguousKVCacheManager
from core.sched.event_skipping import memory_breakdown
from core.kv.kv_cache_manager import KVCacheManager

CATEGORIES = ("token_states", "reserved", "internal_frag", "external_frag")


class MemorySample(NamedTuple):
    """The fields above: slot counts (the first five) and block counts (the last two) in a
    sample; the same fields times seconds in `MemoryAccumulator.integrals()`."""
    token_states: float
    reserved: float
    internal_frag: float
    external_frag: float
    free: float
    physical: float
    logical: float


def sample(scheduler) -> MemorySample:
    """The memory sample of the core's state now."""
    b = memory_breakdown(scheduler)
    kv = scheduler.kv
    return MemorySample(b["token_states"], b["reserved"], b["internal_frag"], b["external_frag"], b["free"],
                        kv.gpu.num_used, sum(map(len, kv.tables.values())))


class SpanModel:
    """The memory sample of each step of a steady decode span, from the state before it."""

    __slots__ = ("tok", "res", "internal", "ext", "free", "used", "logical", "n", "bs", "reserves", "total")

    def __init__(self, scheduler, num_seqs: int, starts: list[int] | None = None, late: dict | None = None,
                 offsets: list[int] | None = None):
        kv = scheduler.kv
        if starts is not None and not late and type(kv) is KVCacheManager and num_seqs == len(scheduler.running):
            # Paged, one sequence per request, tables covering their tokens exactly: a
            # sequence's unfilled tail is the j0 of `block_growth_steps` (what
            # KVCacheManager.memory_breakdown adds up; `offsets`: the j0 themselves), so the
            # sample needs no second scan.
            bs = kv.block_size
            used = kv.gpu.num_used
            internal = sum(offsets) if offsets is not None else sum(j * count for j, count in enumerate(starts) if count)
            tok, res, ext, free = used * bs - internal, 0, 0, kv.gpu.num_free * bs
            logical = sum(map(len, kv.tables.values()))
        else:
            tok, res, internal, ext, free, used, logical = sample(scheduler)
        self.tok, self.res, self.internal, self.ext, self.free = tok, res, internal, ext, free
        self.used, self.logical, self.n = used, logical, num_seqs
        self.bs = scheduler.cache_config.block_size
        self.total = tok + res + internal + ext + free
        self.reserves = isinstance(scheduler.kv, ContiguousKVCacheManager)

    def at(self, i: int, used: int) -> MemorySample:
        """The sample during step i of the span, when `used` blocks are in use."""
        grown = (i + 1) * self.n
        tok = self.tok + grown
        res = self.res - grown if self.reserves else self.res
        free = self.free - self.bs * (used - self.used)
        internal = self.total - tok - res - self.ext - free
        return MemorySample(tok, res, internal, self.ext, free, used, self.logical + used - self.used)


class MemoryAccumulator:
    """Time integrals (value x seconds) of each `MemorySample` field, added step by step
    (event skipping adds a span's steps itself, reading and writing `integrals()`)."""

    __slots__ = ("block_size", "num_blocks", *MemorySample._fields)

    FIELDS = MemorySample._fields

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.set(MemorySample(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))

    def add(self, dt: float, s: MemorySample) -> None:
        self.token_states += s[0] * dt
        self.reserved += s[1] * dt
        self.internal_frag += s[2] * dt
        self.external_frag += s[3] * dt
        self.free += s[4] * dt
        self.physical += s[5] * dt
        self.logical += s[6] * dt

    def integrals(self) -> MemorySample:
        return MemorySample(self.token_states, self.reserved, self.internal_frag, self.external_frag, self.free,
                            self.physical, self.logical)

    def set(self, integrals: MemorySample) -> None:
        (self.token_states, self.reserved, self.internal_frag, self.external_frag, self.free, self.physical,
         self.logical) = integrals

    def summary(self, total_time: float) -> tuple[dict, dict]:
        """(memory_breakdown, kv_sharing) entries of summary.json."""
        w = self.integrals()._asdict()
        in_use = sum(w[c] for c in CATEGORIES)
        breakdown = {
            "shares": {c: (w[c] / in_use if in_use > 0 else 0.0) for c in CATEGORIES},
            "slot_seconds": {c: w[c] for c in (*CATEGORIES, "free")},
            "mean_slots": {c: (w[c] / total_time if total_time > 0 else 0.0) for c in (*CATEGORIES, "free")},
            "total_slots": self.num_blocks * self.block_size,
        }
        phys, logical = w["physical"], w["logical"]
        sharing = {
            "physical_block_seconds": phys,
            "logical_block_seconds": logical,
            "mean_physical_blocks": phys / total_time if total_time > 0 else 0.0,
            "mean_logical_blocks": logical / total_time if total_time > 0 else 0.0,
            "saving": 1.0 - phys / logical if logical > 0 else 0.0,
        }
        return breakdown, sharing


def block_growth_steps(sched, block_size: int, seqs=None) -> tuple[list[int], dict[int, int]]:
    """When the running sequences take new blocks during a steady decode span: a sequence
    with c cached tokens and a table of b blocks takes one at steps j0 = b * block_size - c,
    j0 + block_size, ... Returns (starts, late): starts[j] counts sequences with j0 = j <
    block_size (paged tables); late maps a j0 past the first block (a contiguous region
    covers its sequence's whole life) to its count. `seqs`: the running sequences in batch
    order, when the caller has them (`core.sched.event_skipping.SteadyDecode.seqs`)."""
    starts = [0] * block_size
    late: dict[int, int] = {}
    tables = sched.kv.tables
    if seqs is None:
        seqs = [seq for request in sched.running for seq in request.seqs]
    for seq in seqs:
        j0 = len(tables[seq.seq_id]) * block_size - seq.num_computed_tokens
        if j0 < block_size:
            starts[j0] += 1
        else:
            late[j0] = late.get(j0, 0) + 1
    return starts, late


def blocks_at_finish(cached: int, offset: int, step: int, block_size: int) -> int:
    """The blocks a paged sequence holds after span step `step` (0-based), when it had
    `cached` tokens and took its next block at step `offset` (its j0) before the span:
    what it frees if it finishes in that step."""
    grown = (step - offset) // block_size + 1 if offset <= step else 0
    return (cached + offset) // block_size + grown


def growth_from_offsets(offsets: list[int], block_size: int) -> tuple[list[int], dict[int, int]]:
    """`block_growth_steps` from the sequences' `KVManager.decode_block_offsets` (their j0)."""
    starts = [0] * block_size
    late: dict[int, int] = {}
    for j0 in offsets:
        if j0 < block_size:
            starts[j0] += 1
        else:
            late[j0] = late.get(j0, 0) + 1
    return starts, late
