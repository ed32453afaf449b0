"""The decisions the core delegates (implemented and registered in `policies/`).

The core only depends on these small protocols; `policies/` depends on the core.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol

if TYPE_CHECKING:
    from core.config import CacheConfig
    from core.kv.kv_interface import KVManager
    from core.sched.request import Request


class Evictor(Protocol):
    """Order of the cached-but-unreferenced blocks of one pool (who is evicted next).

    Every block in an evictor has refcount 0 and a prefix hash; all operations O(1)
    (or O(log n)) because they run on the allocation hot path.
    """

    def add(self, block_id: int) -> None: ...        # block became free but stays cached
    def remove(self, block_id: int) -> None: ...     # cache hit revived a free block
    def touch(self, block_id: int) -> None: ...      # any cache hit (LFU counts these)
    def pop(self) -> int: ...                        # choose and remove the victim
    def forget(self, block_id: int) -> None: ...     # block left the cache for good
    def __len__(self) -> int: ...
    def __contains__(self, block_id: int) -> bool: ...


class WaitingQueue(Protocol):
    """Requests waiting for admission, in the order they should be tried."""

    def add(self, request: "Request") -> None: ...
    def add_preempted(self, request: "Request") -> None: ...   # goes back ahead of later arrivals
    def peek(self) -> "Request": ...
    def pop(self) -> "Request": ...
    def remove(self, request: "Request") -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator["Request"]: ...


class QueuePolicy(Protocol):
    name: str

    def make_queue(self) -> WaitingQueue: ...


class PreemptionModePolicy(Protocol):
    name: str

    def mode_for(self, request: "Request") -> str: ...   # "recompute" or "swap"


class VictimPolicy(Protocol):
    name: str

    def select(self, candidates: list["Request"]) -> "Request": ...


class SchedulingRules(Protocol):
    """Engine-wide scheduling rules that differ between the engines the core reproduces
    (policies.scheduling: "twinserve", the default, and "vllm-v1"). Plain flags, read once
    when the Scheduler is built."""
    name: str
    # The long-prefill threshold is lifted while only one request is running or waiting
    # (nobody to starve); False: it always applies.
    long_prefill_cap_needs_company: bool
    # Admission needs free blocks for every known token of the request (beyond its prefix
    # hits), not only for the first chunk: chunked prefill cannot over-admit and thrash.
    admission_reserves_full_sequence: bool
    # The victim policy chooses among all running requests, not only those the step has not
    # scheduled yet; a victim already scheduled gives its slice (and tokens) back.
    victim_from_whole_running: bool


class AllocationPolicy(Protocol):
    """How KV memory is handed out: builds the scheduler's KV manager."""
    name: str

    def make_kv_manager(self, cache: "CacheConfig", max_model_len: int,
                        evictor: "Callable[[], Evictor]") -> "KVManager": ...


class PolicyBundle(Protocol):
    """What the Scheduler is built with (policies.PolicySet is the implementation)."""

    queue: QueuePolicy
    preemption: PreemptionModePolicy
    victim: VictimPolicy
    # (optional) rules: SchedulingRules; a bundle without it schedules as "twinserve"

    def eviction(self) -> Evictor: ...
    def make_kv_manager(self, cache: "CacheConfig", max_model_len: int) -> "KVManager": ...
