"""What one scheduler step hands the executor, and what comes back.

`SchedulerOutput` (from `Scheduler.schedule`) lists per scheduled sequence the token
range to compute and its block table, plus the step's block copies and swaps.
`ModelRunnerOutput` is the executor's answer; `StepResult` is what `Scheduler.update`
reports to the engine loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from core.sched.request import Request, Sequence


class ScheduledSeq:
    """One sequence's work in a step: compute tokens [start, start + num_tokens)."""

    __slots__ = ("seq", "start", "num_tokens", "num_samples", "block_table")

    def __init__(self, seq: Sequence, start: int, num_tokens: int, num_samples: int, block_table: list[int]):
        self.seq = seq
        self.start = start
        self.num_tokens = num_tokens
        self.num_samples = num_samples      # 0: mid-prefill chunk, nothing to sample
        self.block_table = block_table      # the manager's live list: read it, never mutate

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def request(self) -> Request:
        return self.seq.request

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens]

    @property
    def context_len(self) -> int:
        """Tokens already in the cache before this step."""
        return self.start

    def __repr__(self) -> str:
        return (f"ScheduledSeq(seq={self.seq.seq_id}, tokens=[{self.start}, {self.start + self.num_tokens}), "
                f"samples={self.num_samples})")


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0          # tokens of slices longer than one token
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)       # (src, dst) on GPU
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    # Requests that left the engine since the previous step (runners drop their state).
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do: no slice to compute and no block to move or
        copy (a step whose only work is a swap-in still moves the blocks)."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What an executor returns for the sequences that sampled (num_samples > 0).

    token_ids[seq_id]: num_samples tokens (n > 1 before the fork: one per child; beam
    search: the beam's best candidates, best first). logprobs aligned with token_ids
    (required for beam search). top_logprobs: per token, {token_id: logprob} of the
    top-k alternatives when a request asks for logprobs.
    """
    token_ids: dict[int, list[int]]
    logprobs: dict[int, list[float]] | None = None
    top_logprobs: dict[int, list[dict[int, float]]] | None = None


@dataclass
class StepResult:
    updated: list[Request]       # requests that produced tokens this step
    finished: list[Request]      # requests that left the engine (finished, aborted, rejected)
