"""What the scheduler needs from a KV memory manager (and nothing more).

Two implementations: `core.kv.kv_cache_manager.KVCacheManager` (paged blocks, prefix
caching, copy-on-write, swapping: the point of this project) and
`core.kv.contiguous.ContiguousKVCacheManager` (the vLLM paper's Orca baselines: one
contiguous region per sequence). `policies.allocation` names them; the scheduler
builds whichever the policy bundle asks for and only calls what is declared here.

A "plan" is a list of (sequence, tokens to compute this step[, prefix-cache hits]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from core.sched.request import Request, Sequence


@dataclass
class KVCacheStats:
    num_gpu_blocks: int
    num_used_gpu_blocks: int
    num_cached_gpu_blocks: int
    num_cpu_blocks: int
    num_used_cpu_blocks: int
    prefix_cache_queries: int      # prompt tokens looked up
    prefix_cache_hits: int         # of which found cached
    num_evictions: int

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - self.num_used_gpu_blocks

    @property
    def gpu_usage(self) -> float:
        return self.num_used_gpu_blocks / self.num_gpu_blocks if self.num_gpu_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class KVManager(Protocol):
    block_size: int
    enable_prefix_caching: bool
    watermark_blocks: int          # blocks new admissions must leave free

    # -- admission --------------------------------------------------------------------
    def worst_case_blocks(self, request: "Request", max_model_len: int) -> int:
        """Blocks the request could hold at once if it ran alone to its end."""
    def find_cached_prefix(self, seq: "Sequence") -> list[int]:
        """Cached blocks covering `seq`'s leading full blocks (always leaves a token to compute)."""
    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None: ...
    def can_admit(self, plan: list[tuple["Sequence", int, list[int]]], keep_watermark: bool = True) -> bool:
        """Could new work (sequences without KV yet, with their prefix hits) be allocated now,
        leaving the watermark free (`keep_watermark=False`: the engine is idle, nothing to protect)?"""

    # -- allocation -------------------------------------------------------------------
    def claim_prefix(self, seq: "Sequence", cached: list[int]) -> None:
        """Start a table-less `seq`'s table with its prefix hits (references taken), so that
        no fresh allocation evicts them before the sequence's own allocate_slots."""
    def allocate_slots(self, seq: "Sequence", num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Make `seq`'s table cover its computed tokens plus `num_new_tokens`; False (and no
        change) if memory is short."""
    def allocate_group(self, plan: list[tuple["Sequence", int]]) -> bool:
        """`allocate_slots` for every entry, all or nothing."""
    def decode_table(self, seq: "Sequence") -> list[int] | None:
        """The hot path: `seq`'s block table if computing one more token needs no new block,
        no copy and no cache update; else None (use `allocate_slots`)."""
    def block_table(self, seq: "Sequence") -> list[int]:
        """`seq`'s live block table (read it, never mutate)."""
    def fork(self, parent: "Sequence", child: "Sequence") -> None: ...
    def free(self, seq: "Sequence") -> None: ...
    def release_request(self, request: "Request") -> None:
        """The request left the GPU (finished or recomputed): drop what it still holds."""
    def drain_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies queued since the last call (copy-on-write, forks)."""

    # -- swapping (whole sequence groups) ---------------------------------------------------
    def can_swap_out(self, seqs: list["Sequence"]) -> bool: ...
    def swap_out(self, seqs: list["Sequence"]) -> list[tuple[int, int]]: ...
    def can_swap_in(self, seqs: list["Sequence"], keep_watermark: bool = True) -> bool: ...
    def swap_in(self, seqs: list["Sequence"]) -> list[tuple[int, int]]: ...

    # -- steady decode spans (core.sched.event_skipping) -------------------------------------------
    def writes_into_shared_block(self, seqs: list["Sequence"]) -> bool:
        """Would the next token of any of `seqs` land in a block another table holds (so
        the step copies on write)?"""
    def blocks_to_grow(self, seqs: list["Sequence"], num_steps: int) -> int:
        """Blocks `num_steps` more decode tokens per sequence would take from the free pool."""
    def free_blocks(self, evicting: bool = True) -> int:
        """Blocks an allocation can take now; `evicting=False`: without evicting a cached block."""
    def decode_block_offsets(self, seqs: list["Sequence"]) -> list[int] | None:
        """Per sequence, the decode step (0 = the next) at which it first needs a block it
        does not hold (paged: then every block_size steps; contiguous: never, steps past
        it cannot run); None if `writes_into_shared_block(seqs)`. After k steps an offset
        j becomes j - k if k <= j, else (j - k) mod block_size."""
    def steps_fitting(self, offsets: list[int], max_steps: int, free: int) -> int:
        """The largest k <= max_steps such that k more decode tokens per sequence (at these
        `decode_block_offsets`) take at most `free` blocks."""
    def decode_steps_fitting(self, seqs: list["Sequence"], max_steps: int, free: int) -> int:
        """The largest k <= max_steps such that k more decode tokens per sequence take at
        most `free` blocks (`blocks_to_grow` is monotone in k); 0 if
        `writes_into_shared_block(seqs)`. One pass where it can."""
    def advance_decodes(self, seqs: list["Sequence"], num_steps: int, offsets: list[int] | None = None) -> None:
        """Allocate (and publish) for `num_steps` decode steps of `seqs` exactly as that many
        single steps would, in the same order (`offsets`: their current
        `decode_block_offsets`, when the caller has them). The caller advances
        num_computed_tokens."""

    def decode_allocations(self, seqs: list["Sequence"], counts: list[int] | None, offsets: list[int],
                           num_steps: int = 0) -> list[tuple[int, int, list[int]]] | None:
        """The blocks single steps would allocate when each of `seqs` (at these
        `decode_block_offsets`) decodes counts[i] more steps (None: num_steps each), in
        their order: (step, batch index, the table it joins), for `take_blocks`; None when
        allocating also publishes to the prefix cache or the manager never grows a table
        (use `advance_decodes`)."""
    def take_blocks(self, takers: list[tuple[int, int, list[int]]]) -> None:
        """Allocate one block onto the table of each of `takers`, in order (`decode_allocations`)."""

    # -- introspection ------------------------------------------------------------------------
    def memory_breakdown(self, running: list["Request"], waiting_head: "Request | None") -> dict[str, int]: ...
    def stats(self) -> KVCacheStats: ...


def allocate_checked_group(kv: "KVManager", plan: list[tuple["Sequence", int]]) -> bool:
    """Allocate every slice of `plan` after the manager's all-or-nothing capacity check
    passed: a failure here is a bug in that check, not a lack of blocks."""
    for seq, n in plan:
        ok = kv.allocate_slots(seq, n)
        assert ok, "group allocation failed after a successful capacity check"
    return True
