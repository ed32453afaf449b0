"""How long one engine iteration takes, for the simulator's clock.

``CostModel`` is the whole interface the simulator needs (step time and swap
time), so a table fitted from ``realexec profile`` output can plug in later.
``RooflineCostModel`` is the analytic default: per iteration, the slower of
compute (FLOPs / achieved FLOP/s) and memory traffic (bytes / achieved bandwidth),
plus a fixed per-step overhead and the tensor-parallel all-reduces.

All sizes are per TP rank: ranks run in lockstep, so one rank's time is the
step's time.

Mixtures of experts (``ModelSpec.num_experts`` > 0): a token computes attention, the
router and its top-k experts (``active_matmul_params_per_layer``); memory holds every
expert, and a step reads the weights of the experts its batch touches, in expectation
E * (1 - (1 - k/E)^B) per layer for B tokens (``ModelSpec.expected_experts_touched``).
With expert parallelism (``ep`` = tp: whole experts spread over the tp GPUs instead of a
1/tp slice of each) every MoE layer adds a dispatch and a combine all-to-all of
B * hidden * dtype_bytes * (ep - 1) / ep bytes per rank each, over the interconnect, in
place of the MLP's all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

from core.kv.kv_capacity import kv_block_bytes_per_rank, kv_blocks_per_rank
from core.cost.specs import HardwareSpec, ModelSpec

# --- defaults (datasheet peaks are never reached; these turn them into achieved rates)
# Large bf16 GEMMs and FlashAttention reach ~50-70% of tensor-core peak end to end.
DEFAULT_COMPUTE_EFFICIENCY = 0.6
# Decode kernels stream weights and KV at ~70-85% of HBM peak.
DEFAULT_MEMORY_EFFICIENCY = 0.75
# CPU-side scheduling, input preparation, sampling and kernel launches per step
# (vLLM-era engines with CUDA graphs spend ~1-3 ms of this per iteration).
DEFAULT_STEP_OVERHEAD_S = 2e-3
# Fixed cost of one small NCCL all-reduce over NVLink (latency-bound regime).
DEFAULT_ALLREDUCE_LATENCY_S = 10e-6
# Pinned host<->device copies reach ~80% of the PCIe link; each swap call pays
# a launch/sync latency on top.
DEFAULT_SWAP_EFFICIENCY = 0.8
DEFAULT_SWAP_LATENCY_S = 20e-6


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one iteration computes, reduced to the sums the cost depends on.

    Per scheduled sequence i with ``n_i`` new tokens and ``c_i`` tokens already in
    its KV cache before this step:
      num_new_tokens = sum n_i               (rows through the linear layers)
      context_sum    = sum c_i               (KV tokens read besides the new ones)
      attn_pairs     = sum n_i*c_i + n_i*(n_i+1)/2   (causal query-key pairs)
    Keeping sums (not lists) makes the cost O(1) and lets batches be added.
    """

    num_seqs: int = 0
    num_new_tokens: int = 0
    context_sum: int = 0
    attn_pairs: int = 0

    @classmethod
    def from_lists(cls, new_tokens: Sequence[int], context_lens: Sequence[int]) -> BatchShape:
        if len(new_tokens) != len(context_lens):
            raise ValueError(
                f"new_tokens has {len(new_tokens)} entries, context_lens {len(context_lens)}"
            )
        if new_tokens and (min(new_tokens) < 0 or min(context_lens) < 0):
            raise ValueError("token counts must be >= 0")
        return cls(
            num_seqs=len(new_tokens),
            num_new_tokens=sum(new_tokens),
            context_sum=sum(context_lens),
            attn_pairs=sum(n * c + n * (n + 1) // 2 for n, c in zip(new_tokens, context_lens)),
        )

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, int]]) -> BatchShape:
        """From (num_new, num_context) per sequence."""
        pairs = list(pairs)
        return cls.from_lists([n for n, _ in pairs], [c for _, c in pairs])

    @classmethod
    def decode(cls, num_seqs: int, context_sum: int) -> BatchShape:
        """Pure decode: one new token per sequence."""
        return cls(num_seqs, num_seqs, context_sum, context_sum + num_seqs)

    @classmethod
    def prefill(cls, num_tokens: int, context: int = 0) -> BatchShape:
        """One sequence computing ``num_tokens`` prompt tokens after ``context`` cached ones."""
        return cls.from_lists([num_tokens], [context])

    def __add__(self, other: BatchShape) -> BatchShape:
        return BatchShape(
            self.num_seqs + other.num_seqs,
            self.num_new_tokens + other.num_new_tokens,
            self.context_sum + other.context_sum,
            self.attn_pairs + other.attn_pairs,
        )


@runtime_checkable
class CostModel(Protocol):
    """All the simulator asks of a cost model. Times are in seconds."""

    def step_time(self, batch: BatchShape) -> float: ...

    def swap_time(self, num_blocks: int, block_bytes: int) -> float: ...

    # Optional: `host_time(batch) -> float`, the part of step_time the host spends (scheduling,
    # input preparation, output processing), which async scheduling overlaps with the device's
    # work on the step before (sim.async_scheduling); a model without it hides nothing.


@dataclass(frozen=True)
class StepBreakdown:
    """The terms behind one step time, for tests, plots and sanity checks."""

    flops: float
    bytes_moved: float
    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float
    alltoall_s: float = 0.0  # expert parallelism's dispatch + combine (0 without EP)

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.allreduce_s + self.alltoall_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


# --- tensor-parallel sizing -------------------------------------------------------


def check_tp(model: ModelSpec, tp: int) -> None:
    """The splits vLLM accepts: heads divide evenly; KV heads divide or are replicated."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    kv = model.num_kv_heads
    if model.num_heads % tp or (kv % tp and tp % kv):
        raise ValueError(
            f"tp={tp} does not split {model.name}'s {model.num_heads} heads / {kv} KV heads"
        )


def check_ep(model: ModelSpec, tp: int, ep: int) -> None:
    """Expert parallelism spreads a MoE model's whole experts over the tp GPUs (vLLM's
    --enable-expert-parallel without data parallelism: EP size = TP size)."""
    if ep < 1:
        raise ValueError(f"expert-parallel size must be >= 1, got {ep}")
    if ep == 1:
        return
    if not model.is_moe:
        raise ValueError(f"expert parallelism needs a mixture of experts; {model.name} is dense")
    if ep != tp:
        raise ValueError(f"expert-parallel size {ep} must equal the tensor-parallel size {tp} "
                         f"(the experts are spread over the same GPUs)")
    if model.num_experts % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide {model.name}'s "
                         f"{model.num_experts} experts")


def kv_bytes_per_token_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """KV bytes one rank stores per token; KV heads are replicated when tp > kv_heads."""
    return kv_block_bytes_per_rank(1, model.num_layers, model.num_kv_heads, model.head_dim, model.dtype_bytes, tp)


def kv_block_bytes(model: ModelSpec, block_size: int, tp: int = 1) -> int:
    """Bytes of one KV block on one rank (what a swap of that block moves)."""
    return block_size * kv_bytes_per_token_per_rank(model, tp)


# --- the roofline model -----------------------------------------------------------


class RooflineCostModel:
    """step time = max(FLOPs / (peak * eff_c), bytes / (bw * eff_m)) + overhead + all-reduce.

    FLOPs (per rank): 2 * linear params per token for every new token, the lm_head
    for one row per sequence (the sampled one), and causal attention
    4 * layers * heads * head_dim per query-key pair (QK^T and PV).
    Bytes (per rank): every weight streamed once (the input embedding is only
    gathered, so it is left out unless tied to the lm_head), KV read for context and
    new tokens, KV written for new tokens. Activations are left out: they are a few
    percent of decode traffic, and prefill is compute-bound anyway.
    TP: two ring all-reduces per layer of num_tokens * hidden values.
    MoE: FLOPs count the active experts only; bytes stream the non-expert weights plus
    one expert's weights per layer times the expected number of distinct experts the
    step's new tokens touch. EP (``ep`` = tp > 1): one all-reduce per layer (attention)
    and a dispatch + combine all-to-all of num_tokens * hidden values * (ep-1)/ep each.

    A pipeline stage (sim.cluster.pipeline_parallel) is priced by the same model over its own layers:
    `num_layers` of them, the LM head only if `last_stage` (the input embedding is only
    gathered, so the first stage streams no more than its layers; a tied LM head is
    streamed by the last stage, which holds its own copy). The defaults are the whole model.
    """

    def __init__(
        self,
        model: ModelSpec,
        hw: HardwareSpec,
        tp: int = 1,
        compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
        memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY,
        step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
        allreduce_latency_s: float = DEFAULT_ALLREDUCE_LATENCY_S,
        swap_efficiency: float = DEFAULT_SWAP_EFFICIENCY,
        swap_latency_s: float = DEFAULT_SWAP_LATENCY_S,
        *,
        num_layers: int | None = None,
        last_stage: bool = True,
        ep: int = 1,
    ) -> None:
        check_tp(model, tp)
        check_ep(model, tp, ep)
        for name, eff in [("compute_efficiency", compute_efficiency),
                          ("memory_efficiency", memory_efficiency),
                          ("swap_efficiency", swap_efficiency)]:
            if not 0 < eff <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {eff}")
        self.model, self.hw, self.tp, self.ep = model, hw, tp, ep
        self.step_overhead_s = step_overhead_s
        self.swap_latency_s = swap_latency_s

        # Per-rank coefficients, so a step is a handful of multiply-adds.
        L = model.num_layers if num_layers is None else num_layers
        if L < 1:
            raise ValueError(f"a stage needs at least one layer, got {L}")
        self.num_layers = L
        self._flops_per_token = 2 * L * model.active_matmul_params_per_layer() / tp
        self._flops_per_seq = 2 * model.lm_head_params() / tp if last_stage else 0.0
        self._flops_per_pair = 4 * L * (model.num_heads // tp) * model.head_dim
        # Streamed weights: the layers, and on the last stage the final norm and the LM head
        # (for the whole model: every parameter but the gathered-only input embedding).
        streamed = L * model.params_per_layer()
        if model.is_moe:  # the experts are read per step, as many as the batch touches
            streamed -= L * model.num_experts * model.expert_params()
        if last_stage:
            streamed += (2 if model.linear_bias else 1) * model.hidden_size + model.lm_head_params()
        self._weight_bytes = streamed * model.dtype_bytes / tp
        # One expert in every layer, per rank: a 1/tp slice of each expert, or under EP whole
        # experts, E/ep of them per rank: the same expected bytes when ep == tp.
        self._expert_bytes = L * model.expert_params() * model.dtype_bytes / tp if model.is_moe else 0.0
        self._kv_bytes = kv_block_bytes_per_rank(1, L, model.num_kv_heads, model.head_dim, model.dtype_bytes, tp)
        # Sliding-window layers (a pipeline stage gets its share) attend to at most `window`
        # tokens: their pairs and KV reads are capped (see flops / bytes_moved).
        local = model.num_sliding_layers * L // model.num_layers
        self._window = model.sliding_window if local else 0
        self._fpp_local = 4 * local * (model.num_heads // tp) * model.head_dim
        self._fpp_global = self._flops_per_pair - self._fpp_local
        self._kv_local = kv_block_bytes_per_rank(1, local, model.num_kv_heads, model.head_dim, model.dtype_bytes, tp)
        self._kv_global = self._kv_bytes - self._kv_local
        self._s_per_flop = 1.0 / (hw.peak_flops * compute_efficiency)
        self._s_per_byte = 1.0 / (hw.mem_bandwidth * memory_efficiency)
        self._s_per_swap_byte = 1.0 / (hw.pcie_bandwidth * swap_efficiency)
        # Under EP the MoE output comes back by the combine all-to-all, not an all-reduce.
        num_allreduces = (L if ep > 1 else 2 * L) if tp > 1 else 0
        self._allreduce_fixed_s = num_allreduces * allreduce_latency_s
        ring_bytes_per_token = 2 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes
        self._allreduce_s_per_token = (num_allreduces * ring_bytes_per_token
                                       / hw.interconnect_bandwidth)
        # Dispatch + combine per MoE layer: each sends a token's hidden state to the rank of
        # its expert, (ep-1)/ep of them off this rank under uniform routing.
        num_alltoalls = 2 * L if ep > 1 else 0
        self._alltoall_fixed_s = num_alltoalls * allreduce_latency_s
        self._alltoall_s_per_token = (num_alltoalls * (ep - 1) / ep * model.hidden_size * model.dtype_bytes
                                      / hw.interconnect_bandwidth)

    # --- per step --------------------------------------------------------------

    def flops(self, b: BatchShape) -> float:
        if self._window:
            # local layers: at most `window` keys per query. min(pairs, queries * window) is
            # exact when every query is inside its window or every one is past it, and an
            # upper bound for a mix (sum of min <= min of sums); the same for the KV reads.
            return (self._flops_per_token * b.num_new_tokens + self._flops_per_seq * b.num_seqs
                    + self._fpp_global * b.attn_pairs
                    + self._fpp_local * min(b.attn_pairs, b.num_new_tokens * self._window))
        return (self._flops_per_token * b.num_new_tokens + self._flops_per_seq * b.num_seqs
                + self._flops_per_pair * b.attn_pairs)

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes one rank reads in a step over ``num_tokens`` new tokens: all of a
        dense model's; for MoE the rest plus the experts the tokens touch (expected)."""
        if not self._expert_bytes:
            return self._weight_bytes
        return self._weight_bytes + self._expert_bytes * self.model.expected_experts_touched(num_tokens)

    def bytes_moved(self, b: BatchShape) -> float:
        # read KV of context + new tokens, write KV of new tokens
        if self._window:  # local layers read at most `window` tokens a sequence
            read = min(b.context_sum + b.num_new_tokens, b.num_seqs * self._window)
            return (self.weight_bytes_read(b.num_new_tokens) + self._kv_global * (b.context_sum + 2 * b.num_new_tokens)
                    + self._kv_local * (read + b.num_new_tokens))
        return self.weight_bytes_read(b.num_new_tokens) + self._kv_bytes * (b.context_sum + 2 * b.num_new_tokens)

    def _allreduce_s(self, num_tokens: int) -> float:
        return self._allreduce_fixed_s + self._allreduce_s_per_token * num_tokens

    def _alltoall_s(self, num_tokens: int) -> float:
        if not self._alltoall_fixed_s:
            return 0.0
        return self._alltoall_fixed_s + self._alltoall_s_per_token * num_tokens

    def _fixed_s(self, num_tokens: int) -> float:
        """What a step pays besides the roofline: collectives and the per-step overhead."""
        return self._allreduce_s(num_tokens) + self._alltoall_s(num_tokens) + self.step_overhead_s

    def breakdown(self, b: BatchShape) -> StepBreakdown:
        flops, nbytes = self.flops(b), self.bytes_moved(b)
        return StepBreakdown(
            flops=flops,
            bytes_moved=nbytes,
            compute_s=flops * self._s_per_flop,
            memory_s=nbytes * self._s_per_byte,
            allreduce_s=self._allreduce_s(b.num_new_tokens),
            overhead_s=self.step_overhead_s,
            alltoall_s=self._alltoall_s(b.num_new_tokens),
        )

    def host_time(self, batch: BatchShape) -> float:
        """The per-step overhead: the host's share of step_time (the device's is the rest)."""
        return self.step_overhead_s if batch.num_seqs else 0.0

    def step_time(self, batch: BatchShape) -> float:
        if batch.num_seqs == 0:
            return 0.0
        compute_s = self.flops(batch) * self._s_per_flop
        memory_s = self.bytes_moved(batch) * self._s_per_byte
        return max(compute_s, memory_s) + self._fixed_s(batch.num_new_tokens)

    def swap_time(self, num_blocks: int, block_bytes: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.swap_latency_s + num_blocks * block_bytes * self._s_per_swap_byte

    # --- many decode steps at once ------------------------------------------------

    def decode_steps_time(self, num_seqs: int, context_sum: int, k: int) -> float:
        """Total time of k consecutive pure-decode steps, in O(1).

        Step j (0-based) is ``BatchShape.decode(num_seqs, context_sum + j * num_seqs)``.
        Its compute and memory times are both affine in j, so the max switches side
        at most once; each side is an arithmetic series. With sliding-window layers the
        slopes drop once the local layers reach their window: two such spans.
        """
        if k <= 0 or num_seqs <= 0:
            return 0.0
        per_step_fixed = self._fixed_s(num_seqs)
        if not self._window:
            return self._roofline_sum(num_seqs, context_sum, k, self._flops_per_pair, self._kv_bytes) \
                + k * per_step_fixed
        # the local layers are capped from the first step whose context_sum + n exceeds n * window
        n, w = num_seqs, self._window
        capped = 0 if context_sum + n > n * w else min(k, (n * w - n - context_sum) // n + 1)
        roofline = 0.0
        if capped:
            roofline += self._roofline_sum(n, context_sum, capped, self._flops_per_pair, self._kv_bytes)
        if capped < k:
            roofline += self._roofline_sum(n, context_sum + capped * n, k - capped, self._fpp_global,
                                           self._kv_global)
        return roofline + k * per_step_fixed

    def _roofline_sum(self, num_seqs: int, context_sum: int, k: int, flops_per_pair: float,
                      kv_bytes: float) -> float:
        """Sum over k decode steps of max(compute, memory), both affine in the step: the
        pairs and KV reads grow by num_seqs a step at these per-pair and per-token rates."""
        first = self.breakdown(BatchShape.decode(num_seqs, context_sum))
        # per-step growth: n more context tokens -> n more pairs and n more KV reads
        compute_slope = flops_per_pair * num_seqs * self._s_per_flop
        memory_slope = kv_bytes * num_seqs * self._s_per_byte
        c0, m0 = first.compute_s, first.memory_s

        # steps [0, split) take one side, [split, k) the other
        if compute_slope == memory_slope:
            split, early_compute = k, c0 >= m0
        else:
            crossing = (m0 - c0) / (compute_slope - memory_slope)  # where compute == memory
            if compute_slope > memory_slope:  # compute wins from the crossing onwards
                split, early_compute = math.ceil(crossing), False
            else:  # compute wins up to the crossing
                split, early_compute = math.floor(crossing) + 1, True
            split = min(max(split, 0), k)

        def series(start: float, slope: float, lo: int, hi: int) -> float:
            count = hi - lo
            return count * start + slope * (lo + hi - 1) * count / 2

        early = (c0, compute_slope) if early_compute else (m0, memory_slope)
        late = (m0, memory_slope) if early_compute else (c0, compute_slope)
        return series(*early, 0, split) + series(*late, split, k)

    def decode_step_times(self, num_seqs: int, context_sum: int, k: int) -> list[float]:
        """Each of k consecutive pure-decode steps: element j is
        ``step_time(BatchShape.decode(num_seqs, context_sum + j * num_seqs))`` bit for bit
        (the same float operations in the same order), without building the shapes.
        For simulators that skip ahead but must stamp every step's end time exactly as
        step-by-step runs would."""
        if k <= 0:
            return []
        if num_seqs <= 0:
            return [0.0] * k
        n = num_seqs
        fpp, spf, spb = self._flops_per_pair, self._s_per_flop, self._s_per_byte
        wb, kvb = self.weight_bytes_read(n), self._kv_bytes
        head_flops = self._flops_per_token * n + self._flops_per_seq * n   # flops() left to right
        fixed_s = self._fixed_s(n)
        out = []
        append = out.append
        if self._window:  # flops() and bytes_moved() with local layers, term by term
            fpg, fpl, kvg, kvl, nw = self._fpp_global, self._fpp_local, self._kv_global, self._kv_local, n * self._window
            for ctx in range(context_sum, context_sum + k * n, n):
                local = min(ctx + n, nw)
                compute_s = (head_flops + fpg * (ctx + n) + fpl * local) * spf
                memory_s = (wb + kvg * (ctx + 2 * n) + kvl * (local + n)) * spb
                append((compute_s if compute_s >= memory_s else memory_s) + fixed_s)
            return out
        for ctx in range(context_sum, context_sum + k * n, n):
            compute_s = (head_flops + fpp * (ctx + n)) * spf
            memory_s = (wb + kvb * (ctx + 2 * n)) * spb
            append((compute_s if compute_s >= memory_s else memory_s) + fixed_s)
        return out


def sum_decode_steps(cost_model: CostModel, num_seqs: int, context_sum: int, k: int) -> float:
    """k decode steps with any cost model: closed form when offered, else a loop."""
    closed_form = getattr(cost_model, "decode_steps_time", None)
    if closed_form is not None:
        return closed_form(num_seqs, context_sum, k)
    return sum(cost_model.step_time(BatchShape.decode(num_seqs, context_sum + j * num_seqs))
               for j in range(k))


# --- KV cache capacity --------------------------------------------------------------


def activation_peak_bytes(model: ModelSpec, num_tokens: int, tp: int = 1) -> int:
    """Rough peak of live activations in a forward pass over ``num_tokens`` tokens.

    The MLP is the peak: residual and normed hidden states (2h) plus the MLP
    intermediates (gate_up and activation output for SwiGLU: 3f; fc1 and
    activation output for OPT: 2f), the latter split across TP ranks. A MoE token
    holds those of each of its top-k experts.
    """
    mlp = (3 if model.gated_mlp else 2) * model.intermediate_size * max(1, model.num_experts_per_tok) // tp
    return num_tokens * (2 * model.hidden_size + mlp) * model.dtype_bytes


def kv_cache_capacity_blocks(
    model: ModelSpec,
    hw: HardwareSpec,
    block_size: int,
    gpu_memory_utilization: float = 0.9,
    tp: int = 1,
    max_num_batched_tokens: int | None = None,
) -> int:
    """KV blocks, as vLLM sizes its cache after a profiling run:
    (memory * utilization - weights / tp - activation peak) // block bytes per rank.
    Every rank holds its heads' slice of every block, so this is also the engine's
    block count at any tp.

    ``max_num_batched_tokens`` is the profiling run's size; pass the scheduler's.
    The default, max(max_model_len, 2048), is vLLM's without chunked prefill.
    Raises ValueError when the weights alone exceed the memory budget.
    """
    check_tp(model, tp)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(model.max_model_len, 2048)
    budget = hw.mem_bytes * gpu_memory_utilization
    weights = model.weight_bytes() / tp
    if weights > budget:
        gib = 1024**3
        raise ValueError(
            f"{model.name} weights need {weights / gib:.1f} GiB per rank at tp={tp}, but "
            f"{hw.name} offers {budget / gib:.1f} GiB at gpu_memory_utilization="
            f"{gpu_memory_utilization}; raise tp or pick larger hardware"
        )
    free = budget - weights - activation_peak_bytes(model, max_num_batched_tokens, tp)
    return kv_blocks_per_rank(free, block_size, model.num_layers, model.num_kv_heads, model.head_dim,
                              model.dtype_bytes, tp)
