"""Requests and their sequences: the state the scheduler and the block manager share.

A `Request` (a sequence group) starts with one `Sequence` holding the prompt. Parallel
sampling (n > 1) and beam search fork more sequences from it after the prompt's
prefill; they share the prompt's KV blocks. Token bookkeeping is the unified
vLLM-v1 view: each sequence has `num_tokens` known tokens of which
`num_computed_tokens` have KV in the cache; a step computes some of the rest.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from core.sampling_params import InvalidRequestError, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"        # EOS, stop token or stop string
    FINISHED_LENGTH = "length"       # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"   # could never be served (too long, too big for the pool)

    @property
    def finished(self) -> bool:
        # by value: a member's hash is Enum.__hash__, a Python call, and this is asked
        # dozens of times per request and step
        return self._value_ in _FINISHED_VALUES


_FINISHED_VALUES = frozenset(s.value for s in (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_REJECTED,
))

_seq_ids = itertools.count()


class Sequence:
    """One token stream with its own KV block table (held by the KV cache manager)."""

    __slots__ = (
        "seq_id", "request", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "block_hashes", "status", "cum_logprob", "output_logprobs", "finish_reason_detail",
    )

    def __init__(self, request: "Request", token_ids: list[int], num_prompt_tokens: int):
        self.seq_id: int = next(_seq_ids)
        self.request = request
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        # Chained hashes of this sequence's full blocks, filled lazily by the KV manager.
        self.block_hashes: list[int] = []
        self.status = RequestStatus.WAITING
        self.cum_logprob = 0.0
        # Per output token: a {token_id: logprob} dict of the top-k alternatives (if asked).
        self.output_logprobs: list[dict[int, float]] | None = None
        self.finish_reason_detail: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def fork(self) -> "Sequence":
        child = Sequence(self.request, list(self.token_ids), self.num_prompt_tokens)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.cum_logprob = self.cum_logprob
        if self.output_logprobs is not None:
            child.output_logprobs = list(self.output_logprobs)
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")


@dataclass
class RequestMetrics:
    """Timestamps stamped by the caller's clock (the core itself has none)."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # One entry per step that produced output for this request (ITL = diffs).
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_swaps: int = 0
    num_cached_prompt_tokens: int = 0   # prompt tokens served from the prefix cache at admission
    queue_time: float = 0.0             # time spent waiting (incl. after preemption)
    _queued_since: float | None = None


class Request:
    """A sequence group: the unit that is admitted, preempted, swapped and finished."""

    __slots__ = (
        "request_id", "prompt_token_ids", "params", "priority", "arrival_time", "eos_token_id",
        "seqs", "finished_seqs", "status", "metrics", "reject_reason", "cache_salt",
        "arrival_index", "prompt", "user_data", "_forked",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        eos_token_id: int | None = None,
        cache_salt: str | int | None = None,
        prompt: str | None = None,
        user_data: object = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params if params is not None else SamplingParams()
        self.priority = priority              # lower value = served first (vLLM convention)
        self.arrival_time = arrival_time
        self.eos_token_id = eos_token_id
        # Mixed into block hashes: isolates caches. One value: the params' salt unless given
        # here too, and then the two must agree (a silent pick would leak prefixes across tenants).
        salt = self.params.cache_salt
        if cache_salt is None:
            cache_salt = salt
        elif salt is not None and salt != cache_salt:
            raise InvalidRequestError(f"request {request_id!r}: cache_salt={cache_salt!r} differs from its "
                                      f"SamplingParams.cache_salt={salt!r}; set one of them", "cache_salt")
        self.cache_salt = cache_salt
        self.prompt = prompt
        self.user_data = user_data            # opaque to the core (backends attach state here)
        self.arrival_index = 0                # set by the scheduler: FCFS tie-break
        self.status = RequestStatus.WAITING
        self.seqs: list[Sequence] = [Sequence(self, list(self.prompt_token_ids), len(self.prompt_token_ids))]
        self.finished_seqs: list[Sequence] = []   # finished beams/samples, in finish order
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.reject_reason: str | None = None
        self._forked = False                  # n>1 / beam: children created after prefill

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def all_seqs(self) -> list[Sequence]:
        return self.seqs + self.finished_seqs

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, seqs={len(self.seqs)}, {self.status.value})"
