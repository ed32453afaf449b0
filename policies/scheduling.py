"""Engine-wide scheduling rules (core.sched.policy_api.SchedulingRules), by engine name.

"twinserve" is the core's own behaviour. "vllm-v1" reproduces vLLM v1's scheduler
(vllm/v1/core/sched/scheduler.py, release 0.32) where it differs: the per-step token
budget, running-then-waiting order, preempted-to-the-front requeue, recompute and
full-block prefix hashing are already the core's; these rules add the rest, and
`ENGINE_DEFAULTS` holds the knobs vLLM v1 runs with unless told otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulingRules:
    name: str
    long_prefill_cap_needs_company: bool = False
    admission_reserves_full_sequence: bool = False
    victim_from_whole_running: bool = False
    # the victim policy this engine uses with each queue policy (None: the caller's choice)
    victims: tuple[tuple[str, str], ...] = ()

    def victim_for(self, queue: str) -> str | None:
        return dict(self.victims).get(queue)


TWINSERVE = SchedulingRules("twinserve")

# vLLM v1: the long-prefill threshold is not applied when the request is alone (running +
# waiting == 1); admission checks that the whole known sequence fits the free blocks
# (SchedulerConfig.scheduler_reserve_full_isl, default on); the victim is running[-1]
# (FCFS) or the running request with the largest (priority, arrival) (priority policy), even
# one the step has already scheduled (its slice is taken back).
VLLM_V1 = SchedulingRules("vllm-v1", long_prefill_cap_needs_company=True, admission_reserves_full_sequence=True,
                          victim_from_whole_running=True, victims=(("fcfs", "tail"), ("priority", "lowest-priority")))

SCHEDULERS = {"twinserve": TWINSERVE, "vllm-v1": VLLM_V1}

# What vLLM v1 runs with by default (config/scheduler.py, config/cache.py, platforms/cpu.py)
# where twinserve's defaults differ: prefix caching on, no admission watermark; the CPU
# platform makes blocks 128 tokens (GPUs: 16). The rest equals twinserve's defaults:
# chunked prefill on, recompute preemption (v1 has no swap: check_vllm_v1), LRU eviction
# over the free-block queue, no long-prefill cap.
ENGINE_DEFAULTS = {
    "vllm-v1": {"enable_prefix_caching": True, "watermark": 0.0},
}
VLLM_V1_CPU_BLOCK_SIZE = 128


def scheduling_rules(name: str) -> SchedulingRules:
    try:
        return SCHEDULERS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose from: {', '.join(SCHEDULERS)}") from None


def check_vllm_v1(*, chunked_prefill: bool, preemption: str, allocation: str = "paged",
                  pipeline_parallel_size: int = 1) -> None:
    """ValueError naming the setting vLLM v1's scheduler has no equivalent of."""
    if not chunked_prefill:
        raise ValueError("--scheduler vllm-v1 always chunks prefills (vLLM v1 has no other mode): "
                         "drop --no-enable-chunked-prefill")
    if preemption.lower() != "recompute":
        raise ValueError(f"--scheduler vllm-v1 preempts by recompute only (v1 has no swap space); "
                         f"got --preemption-mode {preemption}")
    if allocation.lower() != "paged":
        raise ValueError(f"--scheduler vllm-v1 allocates paged blocks; got --allocation {allocation}")
    if pipeline_parallel_size != 1:
        raise ValueError("--scheduler vllm-v1 reproduces one batch in flight at a time "
                         f"(pipeline-parallel-size 1); got {pipeline_parallel_size}")
