"""What to do when the KV pool runs out: preemption mode and victim choice."""
from __future__ import annotations

from core.sched.request import Request


class RecomputeMode:
    """Drop the victim's KV and recompute it later (cheap for single sequences)."""
    name = "recompute"

    def mode_for(self, request: Request) -> str:
        return "recompute"


class SwapMode:
    """Copy the victim's KV to the CPU swap pool (falls back to recompute if it is full)."""
    name = "swap"

    def mode_for(self, request: Request) -> str:
        return "swap"


class AutoMode:
    """vLLM v0's rule: swap multi-sequence groups (n > 1, beams) whose shared blocks
    recompute would duplicate; recompute single sequences."""
    name = "auto"

    def mode_for(self, request: Request) -> str:
        return "swap" if len(request.seqs) > 1 else "recompute"


class NewestVictim:
    """Preempt the most recently arrived running request (vLLM's default)."""
    name = "newest"

    def select(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: r.arrival_index)


class LowestPriorityVictim:
    """Largest priority value first (= least important), newest among equals."""
    name = "lowest-priority"

    def select(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.arrival_index))


class LeastComputedVictim:
    """The request that loses the least work when recomputed."""
    name = "least-computed"

    def select(self, candidates: list[Request]) -> Request:
        return min(candidates, key=lambda r: (sum(s.num_computed_tokens for s in r.seqs), -r.arrival_index))


class RunningTailVictim:
    """The last request of the running list (vLLM v1's FCFS rule: `running.pop()`). The
    list is in admission order, so a preempted request readmitted later is the tail even
    when it arrived first (unlike "newest", which goes by arrival)."""
    name = "tail"

    def select(self, candidates: list[Request]) -> Request:
        # candidates is a suffix of the running list (from the request being scheduled on)
        return candidates[-1]
