"""Routers: which replica of a fleet serves a new request.

A router sees each replica through `ReplicaView` (what a real gateway can know: requests
outstanding, KV usage, how much of a prompt the replica has cached) and returns an
index. Routers are small, deterministic objects; ties always go to the lowest index, so
a fleet run is reproducible.

  round-robin     replica 0, 1, ..., N-1, 0, ... regardless of load
  least-requests  fewest outstanding requests (routed, not yet finished)
  least-kv        lowest KV-cache usage (fraction of GPU blocks in use), then fewest
                  outstanding
  prefix-aware    the replica holding the longest cached prefix of the prompt's block
                  hashes (SGLang's cache-aware router, llm-d / Dynamo KV-aware routing),
                  unless that replica is overloaded: when its outstanding count exceeds
                  the least loaded replica's by more than `abs_threshold` *and* by more
                  than `rel_threshold` times, or when no replica has any of the prompt
                  cached, it falls back to least-requests.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from core.sched.request import Request


class ReplicaView(Protocol):
    """What a router may ask of a replica, as of the moment the request arrives."""

    @property
    def outstanding(self) -> int: ...                       # routed here, not yet finished

    @property
    def kv_usage(self) -> float: ...                        # GPU blocks in use / total

    def cached_prefix_tokens(self, request: Request) -> int: ...   # prompt tokens found cached


class Router(Protocol):
    name: str
    # Whether `choose` reads KV state (usage or the prefix cache); the fleet then brings
    # every replica's KV state up to the arrival instant first (costs time in the sim).
    reads_kv: bool

    def choose(self, request: Request, replicas: Sequence[ReplicaView]) -> int: ...


def _least_outstanding(replicas: Sequence[ReplicaView]) -> int:
    best, best_load = 0, replicas[0].outstanding
    for i in range(1, len(replicas)):
        load = replicas[i].outstanding
        if load < best_load:
            best, best_load = i, load
    return best


class RoundRobinRouter:
    name = "round-robin"
    reads_kv = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        i = self._next % len(replicas)
        self._next = i + 1
        return i


class LeastRequestsRouter:
    name = "least-requests"
    reads_kv = False

    def choose(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return _least_outstanding(replicas)


class LeastKVRouter:
    name = "least-kv"
    reads_kv = True

    def choose(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        keys = [(r.kv_usage, r.outstanding, i) for i, r in enumerate(replicas)]
        return min(keys)[2]


class PrefixAwareRouter:
    name = "prefix-aware"
    reads_kv = True

    def __init__(self, abs_threshold: int = 8, rel_threshold: float = 1.5) -> None:
        if abs_threshold < 0 or rel_threshold < 1:
            raise ValueError("prefix-aware router: abs_threshold >= 0 and rel_threshold >= 1")
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold

    def choose(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        least = _least_outstanding(replicas)
        hits = [r.cached_prefix_tokens(request) for r in replicas]
        best = max(range(len(replicas)), key=lambda i: (hits[i], -replicas[i].outstanding, -i))
        if hits[best] == 0 or self.overloaded(replicas[best].outstanding, replicas[least].outstanding):
            return least
        return best

    def overloaded(self, load: int, min_load: int) -> bool:
        return load - min_load > self.abs_threshold and load > self.rel_threshold * min_load


ROUTERS = {"round-robin": RoundRobinRouter, "least-requests": LeastRequestsRouter, "least-kv": LeastKVRouter,
           "prefix-aware": PrefixAwareRouter}
