"""Pluggable scheduling decisions, by name.

Every CLI flag and sweep names policies through `REGISTRY`; `PolicySet.from_names`
builds the bundle the core's Scheduler consumes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from core.config import CacheConfig
from core.kv.kv_interface import KVManager
from core.sched.policy_api import Evictor, PreemptionModePolicy, QueuePolicy, VictimPolicy
from policies.eviction import FIFOEvictor, LFUEvictor, LRUEvictor
from policies.preemption import (AutoMode, LeastComputedVictim, LowestPriorityVictim, NewestVictim,
                                 RecomputeMode, RunningTailVictim, SwapMode)
from policies.allocation import ALLOCATIONS
from policies.queue import FCFSPolicy, LongestPrefixMatchPolicy, PriorityPolicy, ShortestJobFirstPolicy
from policies.router import ROUTERS
from policies.scheduling import SCHEDULERS, TWINSERVE, SchedulingRules, scheduling_rules

REGISTRY: dict[str, dict[str, Callable[[], object]]] = {
    "queue": {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "sjf": ShortestJobFirstPolicy,
              "lpm": LongestPrefixMatchPolicy},
    "preemption": {"recompute": RecomputeMode, "swap": SwapMode, "auto": AutoMode},
    "victim": {"newest": NewestVictim, "lowest-priority": LowestPriorityVictim,
               "least-computed": LeastComputedVictim, "tail": RunningTailVictim},
    "eviction": {"lru": LRUEvictor, "lfu": LFUEvictor, "fifo": FIFOEvictor},
    "allocation": ALLOCATIONS,
    "router": ROUTERS,                  # fleets (sim.cluster.fleet): which replica serves a request
    "scheduler": {name: (lambda r=r: r) for name, r in SCHEDULERS.items()},   # engine-wide rules
}


def make(kind: str, name: str):
    try:
        choices = REGISTRY[kind]
    except KeyError:
        raise ValueError(f"unknown policy kind {kind!r}; kinds: {', '.join(REGISTRY)}") from None
    try:
        return choices[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown {kind} policy {name!r}; choose from: {', '.join(choices)}") from None


@dataclass
class PolicySet:
    queue: QueuePolicy = field(default_factory=FCFSPolicy)
    preemption: PreemptionModePolicy = field(default_factory=RecomputeMode)
    victim: VictimPolicy = field(default_factory=NewestVictim)
    eviction: Callable[[], Evictor] = LRUEvictor     # a factory: one evictor per pool
    allocation: str = "paged"                        # or a contiguous baseline: orca-max/-pow2/-oracle
    rules: SchedulingRules = TWINSERVE               # engine-wide rules: "twinserve" or "vllm-v1"

    def make_kv_manager(self, cache: CacheConfig, max_model_len: int) -> KVManager:
        """The KV manager the allocation policy names (paged, or an Orca baseline)."""
        return make("allocation", self.allocation).make_kv_manager(cache, max_model_len, self.eviction)

    @classmethod
    def from_names(cls, queue: str = "fcfs", preemption: str = "recompute", victim: str | None = None,
                   eviction: str = "lru", allocation: str = "paged", scheduler: str = "twinserve") -> "PolicySet":
        """`scheduler` names the engine-wide rules (policies.scheduling). Its engine's own
        victim rule for `queue` (vllm-v1: "tail" for fcfs) replaces `victim` when that is
        None or the default "newest"; any other victim name is kept."""
        make("eviction", eviction)   # validate the names now
        make("allocation", allocation)
        rules = scheduling_rules(scheduler)
        if victim is None or victim.lower() == "newest":
            victim = rules.victim_for(queue.lower()) or "newest"
        return cls(queue=make("queue", queue), preemption=make("preemption", preemption),
                   victim=make("victim", victim), eviction=REGISTRY["eviction"][eviction.lower()],
                   allocation=allocation.lower(), rules=rules)

    def describe(self) -> dict[str, str]:
        return {"queue": self.queue.name, "preemption": self.preemption.name, "victim": self.victim.name,
                "eviction": getattr(self.eviction, "name", str(self.eviction)), "allocation": self.allocation,
                "scheduler": self.rules.name}
