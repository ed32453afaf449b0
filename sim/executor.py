"""The simulator's executor: charges modelled time for a step and "samples" tokens.

It implements the core's `Executor` protocol (`execute_model`) like the real backend,
but instead of running a model it
  * prices the step with a `CostModel` (`step_time`): one `BatchShape` built from the
    scheduled slices (new tokens = slice length, context = slice start), plus PCIe
    time for the blocks swapped out and in;
  * returns deterministic token ids: `token_id(seq, position)` is a cheap arithmetic
    function of the sequence (relative to the run's first sequence id, so it does not
    depend on what ran before in the process) and the position; it is never the
    simulator's EOS id. Requests end at their traced length through `max_tokens` with
    `ignore_eos=True` (see `sim.engine`);
  * for beam search, returns 2*width distinct candidates per beam with strictly
    descending log-probabilities from a seeded random model (documented in
    `beam_candidates`).
"""
from __future__ import annotations

import math
from operator import attrgetter

from core import ModelRunnerOutput, SchedulerOutput, Sequence
from core.cost.model import BatchShape, CostModel

# Sampled and prompt ids never use this id, so EOS never stops a simulated request.
SIM_EOS_TOKEN_ID = 0
# Sampled ids lie in [1, TOKEN_MODULUS]; a prime modulus makes (seq, position) -> id
# injective over any window of TOKEN_MODULUS positions of one sequence.
TOKEN_MODULUS = 65521
_SEQ_STRIDE = 40503
_TOKEN_TABLE = list(range(1, TOKEN_MODULUS + 1))     # _TOKEN_TABLE[i] == i + 1

_MASK64 = (1 << 64) - 1
_start = attrgetter("start")


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: a fast, well-mixed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SimExecutor:
    """Prices steps with a cost model and returns deterministic tokens.

    `seq_id_base` is the id of the first sequence the run creates: token ids use
    `seq.seq_id - seq_id_base`, so two runs of the same configuration in one process
    produce the same tokens (the core's sequence counter is process-global).
    """

    def __init__(self, cost_model: CostModel, block_bytes: int, seed: int = 0):
        self.cost_model = cost_model
        self.block_bytes = block_bytes
        self.seed = seed
        self.seq_id_base = 0
        self._step_time = cost_model.step_time
        self._swap_time = cost_model.swap_time
        self._decode_step_times = getattr(cost_model, "decode_step_times", None)
        self._engine_idle = getattr(cost_model, "engine_idle", None)
        self.swap_seconds = 0.0         # total PCIe time charged for swaps
        self.num_swapped_blocks = 0     # blocks copied out + in
        self.fast_tokens = True         # every request n == 1 without beam search (set by the engine)

    # -- time ---------------------------------------------------------------------------
    def step_time(self, out: SchedulerOutput, decodes: int = 0, decode_context: int = 0) -> float:
        """Seconds the step takes: compute (roofline of the batch) + swap copies.
        `decodes` more sequences with `decode_context` cached tokens in all decode one
        token each besides `out.scheduled` (core.sched.event_skipping.SteadyStep)."""
        scheduled = out.scheduled
        dt = 0.0
        if scheduled or decodes:
            n = len(scheduled) + decodes
            ctx = sum(map(_start, scheduled)) + decode_context
            if out.num_prefill_tokens:
                pairs = decode_context + decodes
                for s in scheduled:
                    t = s.num_tokens
                    pairs += t * s.start + t * (t + 1) // 2
            else:                                   # all decodes: one token each
                pairs = ctx + n
            dt = self._step_time(BatchShape(n, out.num_batched_tokens + decodes, ctx, pairs))
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            dt += self._swaps(out)
        return dt

    def engine_idle(self) -> None:
        """The engine waits for work: tell the cost model (its first steps after idle)."""
        if self._engine_idle is not None:
            self._engine_idle()

    @property
    def waking(self) -> bool:
        """Whether the cost model still prices the next steps as after idle (no span then)."""
        return self._engine_idle is not None and self.cost_model.waking

    def _swaps(self, out: SchedulerOutput) -> float:
        """PCIe time of the step's swap-outs and swap-ins (one transfer each way)."""
        secs = 0.0
        for blocks in (out.blocks_to_swap_out, out.blocks_to_swap_in):
            if blocks:
                secs += self._swap_time(len(blocks), self.block_bytes)
                self.num_swapped_blocks += len(blocks)
        self.swap_seconds += secs
        return secs

    def decode_step_times(self, num_seqs: int, context_sum: int, k: int) -> list[float]:
        """k consecutive pure-decode steps: element j is the float `step_time` gives for
        BatchShape.decode(num_seqs, context_sum + j * num_seqs) (the cost model's
        vectorised `decode_step_times` when it has one)."""
        if self._decode_step_times is not None:
            return self._decode_step_times(num_seqs, context_sum, k)
        step, decode = self._step_time, BatchShape.decode
        return [step(decode(num_seqs, context_sum + j * num_seqs)) for j in range(k)]

    # -- tokens ---------------------------------------------------------------------------
    def token_id(self, seq: Sequence, position: int) -> int:
        """The token sampled for `seq` at `position` (0-based index in its token list)."""
        return ((seq.seq_id - self.seq_id_base) * _SEQ_STRIDE + position) % TOKEN_MODULUS + 1

    def token_ids(self, seq: Sequence, first_position: int, count: int):
        """`token_id(seq, p)` for p in [first_position, first_position + count) as a
        list: the `token_fn` of `core.sched.event_skipping.fast_forward`, no per-token Python
        work (slices of one table of the ids: no int object is created per token)."""
        mod = TOKEN_MODULUS
        start = ((seq.seq_id - self.seq_id_base) * _SEQ_STRIDE + first_position) % mod
        if start + count <= mod:
            return _TOKEN_TABLE[start:start + count]
        out: list[int] = []
        while count > 0:
            run = min(count, mod - start)
            out += _TOKEN_TABLE[start:start + run]
            count -= run
            start = 0
        return out

    def extend_tokens(self, seqs: list[Sequence], count: int) -> None:
        """Append `token_ids(seq, len(seq.token_ids), count)` to every sequence of `seqs`
        (`core.sched.event_skipping.fast_forward`'s `extend_tokens`)."""
        base, table, mod = self.seq_id_base, _TOKEN_TABLE, TOKEN_MODULUS
        for seq in seqs:
            tokens = seq.token_ids
            start = ((seq.seq_id - base) * _SEQ_STRIDE + len(tokens)) % mod
            if start + count <= mod:
                tokens += table[start:start + count]
            else:
                tokens += self.token_ids(seq, len(tokens), count)

    def beam_candidates(self, seq: Sequence, position: int, count: int) -> tuple[list[int], list[float]]:
        """The random beam model: `count` distinct tokens, best first. Candidate j has
        logprob -(E_0 + ... + E_j) / 2 with E_i ~ Exp(1) drawn from
        SplitMix64(seed, relative seq id, position, i): strictly descending, seeded,
        and independent of the schedule (a pure function of the beam's history)."""
        base = self.token_id(seq, position) - 1
        rel = seq.seq_id - self.seq_id_base
        key = _splitmix64(_splitmix64(_splitmix64(self.seed) ^ rel) ^ position)
        toks, lps, acc = [], [], 0.0
        for j in range(count):
            toks.append((base + j * 7919) % TOKEN_MODULUS + 1)
            u = (_splitmix64(key ^ j) >> 11) * (1.0 / (1 << 53))        # [0, 1)
            acc += -math.log1p(-u) * 0.5 + 1e-9                          # > 0: strictly descending
            lps.append(-acc)
        return toks, lps

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Token ids for every sequence that samples this step (num_samples > 0)."""
        base, stride, mod = self.seq_id_base, _SEQ_STRIDE, TOKEN_MODULUS
        if self.fast_tokens:                           # one sample per sequence
            tokens = {}
            for s in out.scheduled:
                if s.num_samples:
                    sid = s.seq.seq_id
                    tokens[sid] = [((sid - base) * stride + s.start + s.num_tokens) % mod + 1]
            return ModelRunnerOutput(token_ids=tokens)
        tokens = {}
        logprobs: dict[int, list[float]] | None = None
        for s in out.scheduled:
            k = s.num_samples
            if not k:
                continue
            seq = s.seq
            position = s.start + s.num_tokens          # index of the token being sampled
            if seq.request.params.beam_width:
                if logprobs is None:
                    logprobs = {}
                tokens[seq.seq_id], logprobs[seq.seq_id] = self.beam_candidates(seq, position, k)
            elif k == 1:
                tokens[seq.seq_id] = [((seq.seq_id - base) * stride + position) % mod + 1]
            else:                                      # n > 1: one token per future child
                first = ((seq.seq_id - base) * stride + position) % mod
                tokens[seq.seq_id] = [(first + j * 7919) % mod + 1 for j in range(k)]
        return ModelRunnerOutput(token_ids=tokens, logprobs=logprobs)
