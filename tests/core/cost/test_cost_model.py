"""Tests for core.cost.specs and core.cost.model (pure arithmetic: fast)."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from core.cost.model import (
    BatchShape,
    CostModel,
    RooflineCostModel,
    kv_block_bytes,
    kv_cache_capacity_blocks,
    sum_decode_steps,
)
from core.cost.specs import HARDWARE, MODELS, HardwareSpec, get_hardware, get_model

LLAMA13 = get_model("Llama-2-13B")
A100_80 = get_hardware("A100-80G")
A100_40 = get_hardware("A100-40G")


@pytest.fixture(scope="module")
def cm13():
    return RooflineCostModel(LLAMA13, A100_80)


# --- specs -------------------------------------------------------------------------


def test_param_counts_match_published_sizes():
    assert get_model("SmolLM2-135M").num_params() == 134_515_008  # exact, from the GGUF
    for name, billions in [("Llama-2-7B", 6.74), ("Llama-2-13B", 13.02), ("Llama-2-70B", 68.98),
                           ("Llama-3-8B", 8.03), ("OPT-13B", 12.85), ("OPT-66B", 65.7)]:
        assert get_model(name).num_params() / 1e9 == pytest.approx(billions, rel=0.005), name


def test_kv_bytes_per_token():
    assert LLAMA13.kv_bytes_per_token() == 2 * 40 * 40 * 128 * 2
    assert get_model("Llama-2-70B").kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2  # GQA
    assert LLAMA13.weight_bytes() == 2 * LLAMA13.num_params()


def test_registry_lookup_is_case_insensitive_and_accepts_hf_ids():
    assert get_model("llama-2-13b") is MODELS["Llama-2-13B"]
    assert get_model("meta-llama/Llama-2-13b-hf") is MODELS["Llama-2-13B"]
    assert get_model(" SMOLLM2-135M ") is MODELS["SmolLM2-135M"]
    assert get_hardware("h100") is HARDWARE["H100"]


def test_registry_error_lists_the_choices():
    with pytest.raises(ValueError, match="unknown model 'GPT-5'") as err:
        get_model("GPT-5")
    assert all(name in str(err.value) for name in MODELS)
    with pytest.raises(ValueError, match="unknown hardware") as err:
        get_hardware("TPU")
    assert all(name in str(err.value) for name in HARDWARE)


# --- BatchShape --------------------------------------------------------------------


def test_batch_shape_constructors_agree():
    new, ctx = [5, 1, 1], [0, 10, 20]
    b = BatchShape.from_lists(new, ctx)
    assert b == BatchShape.from_pairs(zip(new, ctx))
    assert b == BatchShape.prefill(5) + BatchShape.decode(2, 30)
    assert (b.num_seqs, b.num_new_tokens, b.context_sum) == (3, 7, 30)
    assert b.attn_pairs == 15 + 11 + 21  # 5*6/2 causal, then ctx + 1 per decode


def test_batch_shape_rejects_bad_input():
    with pytest.raises(ValueError):
        BatchShape.from_lists([1, 1], [3])
    with pytest.raises(ValueError):
        BatchShape.from_lists([-1], [3])


# --- roofline behaviour ------------------------------------------------------------


def test_roofline_is_a_cost_model(cm13):
    assert isinstance(cm13, CostModel)
    assert cm13.step_time(BatchShape()) == 0.0


def test_small_decode_batch_is_memory_bound(cm13):
    bd = cm13.breakdown(BatchShape.decode(8, 8 * 512))
    assert bd.bound == "memory"
    assert bd.memory_s > 5 * bd.compute_s
    assert cm13.step_time(BatchShape.decode(8, 8 * 512)) == pytest.approx(bd.total_s)


def test_long_prefill_is_compute_bound(cm13):
    bd = cm13.breakdown(BatchShape.prefill(2048))
    assert bd.bound == "compute"
    assert bd.compute_s > 5 * bd.memory_s


def test_prefill_attention_is_quadratic(cm13):
    n = 1024
    f1, f2 = cm13.flops(BatchShape.prefill(n)), cm13.flops(BatchShape.prefill(2 * n))
    m = LLAMA13
    quadratic = 4 * m.num_layers * m.num_heads * m.head_dim * n * n
    lm_head_row = 2 * m.lm_head_params()  # one sampled row per sequence, not per token
    assert f2 - 2 * f1 == pytest.approx(quadratic - lm_head_row)
    # compute-bound, so time (less the fixed per-step cost) is super-linear too
    fixed = cm13.step_overhead_s
    t1, t2 = (cm13.step_time(BatchShape.prefill(x)) - fixed for x in (n, 2 * n))
    assert t2 > 2 * t1


def test_tensor_parallel_speeds_up_a_step():
    tp1, tp2 = RooflineCostModel(LLAMA13, A100_80), RooflineCostModel(LLAMA13, A100_80, tp=2)
    for batch in (BatchShape.decode(32, 32 * 1024), BatchShape.prefill(1024)):
        assert tp2.step_time(batch) < tp1.step_time(batch)
        assert tp2.breakdown(batch).allreduce_s > 0 == tp1.breakdown(batch).allreduce_s


def test_tensor_parallel_must_split_heads():
    with pytest.raises(ValueError, match="does not split"):
        RooflineCostModel(get_model("SmolLM2-135M"), A100_80, tp=2)  # 9 heads


def test_step_time_grows_with_batch_and_context(cm13):
    by_batch = [cm13.step_time(BatchShape.decode(n, n * 512)) for n in (1, 8, 64, 256)]
    by_context = [cm13.step_time(BatchShape.decode(8, 8 * c)) for c in (0, 512, 2048, 4096)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == 4
    assert by_context == sorted(by_context) and len(set(by_context)) == 4


def test_swap_time_scales_with_blocks(cm13):
    block = kv_block_bytes(LLAMA13, 16)
    assert cm13.swap_time(0, block) == 0.0
    one, ten = cm13.swap_time(1, block), cm13.swap_time(10, block)
    latency = cm13.swap_latency_s
    assert ten - latency == pytest.approx(10 * (one - latency))
    assert ten == pytest.approx(latency + 10 * block / (A100_80.pcie_bandwidth * 0.8))


# --- closed-form decode sum --------------------------------------------------------


def _loop_sum(cm, num_seqs, context_sum, k):
    return sum(cm.step_time(BatchShape.decode(num_seqs, context_sum + j * num_seqs))
               for j in range(k))


def _toy_hardware(flops_per_byte):
    return HardwareSpec("toy", 1e12 * flops_per_byte, 1e12, 80 * 2**30, 300e9, 32e9)


@settings(max_examples=150, deadline=None)
@given(
    model=st.sampled_from(sorted(MODELS)),
    flops_per_byte=st.floats(0.05, 2000),  # spans both "compute slope > memory slope" and not
    num_seqs=st.integers(1, 512),
    mean_context=st.integers(0, 8192),
    k=st.integers(0, 300),
)
def test_decode_steps_time_equals_loop(model, flops_per_byte, num_seqs, mean_context, k):
    cm = RooflineCostModel(get_model(model), _toy_hardware(flops_per_byte))
    context_sum = num_seqs * mean_context
    assert math.isclose(cm.decode_steps_time(num_seqs, context_sum, k),
                        _loop_sum(cm, num_seqs, context_sum, k), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("hw, model, num_seqs, k", [
    # memory-bound first, then the GQA attention FLOPs overtake (compute slope steeper)
    (_toy_hardware(5.0), "Llama-2-70B", 2, 2000),
    # compute-bound first (big batch), then KV reads overtake (memory slope steeper)
    (A100_80, "Llama-2-13B", 256, 100),
])
def test_decode_steps_time_across_a_crossover(hw, model, num_seqs, k):
    """Start k/2 steps before compute and memory time cross, so the bound switches."""
    cm = RooflineCostModel(get_model(model), hw)
    a, b = (cm.breakdown(BatchShape.decode(num_seqs, c)) for c in (0, 10**6))
    slope_gap = (b.compute_s - a.compute_s - b.memory_s + a.memory_s) / 10**6
    crossing = (a.memory_s - a.compute_s) / slope_gap  # context sum where they meet
    start = int(crossing) - num_seqs * (k // 2)
    assert start >= 0
    first = cm.breakdown(BatchShape.decode(num_seqs, start)).bound
    last = cm.breakdown(BatchShape.decode(num_seqs, start + (k - 1) * num_seqs)).bound
    assert first != last
    assert cm.decode_steps_time(num_seqs, start, k) == pytest.approx(
        _loop_sum(cm, num_seqs, start, k), rel=1e-12)


def test_sum_decode_steps_falls_back_to_a_loop(cm13):
    class StepOnly:  # a minimal fitted model: just the protocol
        def step_time(self, batch):
            return cm13.step_time(batch)

        def swap_time(self, num_blocks, block_bytes):
            return 0.0

    assert sum_decode_steps(StepOnly(), 8, 4096, 50) == pytest.approx(
        sum_decode_steps(cm13, 8, 4096, 50), rel=1e-9)


# --- KV cache capacity ---------------------------------------------------------------


def test_kv_capacity_llama13b_a100_40g_matches_vllm_paper():
    # vLLM paper, Fig. 1: 13B on A100-40GB leaves ~12 GB for KV, i.e. ~15k tokens.
    blocks = kv_cache_capacity_blocks(LLAMA13, A100_40, block_size=16, gpu_memory_utilization=0.9)
    assert 8_000 <= blocks * 16 <= 25_000


def test_kv_capacity_grows_with_utilization_and_tp():
    low = kv_cache_capacity_blocks(LLAMA13, A100_80, 16, gpu_memory_utilization=0.5)
    high = kv_cache_capacity_blocks(LLAMA13, A100_80, 16, gpu_memory_utilization=0.9)
    tp2 = kv_cache_capacity_blocks(LLAMA13, A100_80, 16, gpu_memory_utilization=0.9, tp=2)
    assert 0 < low < high < tp2


def test_kv_capacity_is_zero_not_negative_when_only_weights_fit():
    # 26 GB of weights fit in 27 GB, but a 64k-token profiling run leaves no room
    assert kv_cache_capacity_blocks(LLAMA13, A100_40, 16, gpu_memory_utilization=0.68,
                                    max_num_batched_tokens=65536) == 0


def test_weights_too_big_is_a_clear_error():
    with pytest.raises(ValueError, match=r"OPT-175B weights need .* A100-40G"):
        kv_cache_capacity_blocks(get_model("OPT-175B"), A100_40, block_size=16)


# --- mixtures of experts ---------------------------------------------------------------

MIXTRAL = get_model("Mixtral-8x7B")
QWEN_MOE = get_model("Qwen3-30B-A3B")
H200 = get_hardware("H200")


def test_moe_flops_count_the_active_experts_only():
    """Per new token: attention, the router and k of the E experts (2 FLOPs a weight)."""
    cm = RooflineCostModel(MIXTRAL, H200)
    m = MIXTRAL
    active = m.attn_params_per_layer() + m.hidden_size * 8 + 2 * 3 * m.hidden_size * m.intermediate_size
    n = 512
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * (n * (n + 1) // 2)
    assert cm.flops(BatchShape.prefill(n)) == pytest.approx(
        2 * m.num_layers * active * n + 2 * m.lm_head_params() + attention, rel=1e-12)
    # about 13B of the 47B parameters work per token
    assert cm._flops_per_token / 2 / 1e9 == pytest.approx(12.88 - 2 * 0.131, abs=0.01)


def test_moe_reads_the_experts_its_batch_touches():
    """Weight bytes of a step: the non-expert weights, plus per layer one expert's bytes
    times E * (1 - (1 - k/E)^B) for B new tokens."""
    m = QWEN_MOE
    cm = RooflineCostModel(m, H200)
    rest = (m.num_params() - m.vocab_size * m.hidden_size  # embedding: gathered, not streamed
            - m.num_layers * m.num_experts * m.expert_params()) * 2
    expert = m.num_layers * m.expert_params() * 2
    assert cm.weight_bytes_read(1) == pytest.approx(rest + 8 * expert)           # one token: its top-8
    for b in (2, 16, 64):
        touched = 128 * (1 - (1 - 8 / 128) ** b)
        assert cm.weight_bytes_read(b) == pytest.approx(rest + touched * expert)
        assert cm.bytes_moved(BatchShape.decode(b, 0)) == pytest.approx(
            rest + touched * expert + cm._kv_bytes * 2 * b)
    # a big batch reads every expert: all the streamed weights
    assert cm.weight_bytes_read(4096) == pytest.approx(rest + 128 * expert)
    # so a MoE decode step gets dearer with the batch well before a dense one would
    small, big = (cm.breakdown(BatchShape.decode(b, 0)).memory_s for b in (1, 32))
    assert big > 5 * small


def test_moe_memory_holds_every_expert():
    """KV capacity is what all experts' weights leave: Qwen3-30B-A3B (57 GiB) does not fit
    an A100-40G, and on an A100-80G it leaves ~15 GiB."""
    with pytest.raises(ValueError, match=r"Qwen3-30B-A3B weights need 56\.9 GiB"):
        kv_cache_capacity_blocks(QWEN_MOE, A100_40, 16)
    blocks = kv_cache_capacity_blocks(QWEN_MOE, A100_80, 16, max_num_batched_tokens=2048)
    budget = 0.9 * 80 * 2**30 - 2 * QWEN_MOE.num_params()
    activation = 2048 * (2 * 2048 + 3 * 768 * 8) * 2  # the top-8 experts' intermediates per token
    assert blocks == int((budget - activation) // (16 * QWEN_MOE.kv_bytes_per_token()))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_expert_parallel_all_to_all(tp):
    """EP = tp: two all-to-alls per layer of B*hidden*2 bytes*(ep-1)/ep, one all-reduce
    per layer (attention) instead of two; the same FLOPs and weight bytes per rank."""
    m, b = MIXTRAL, BatchShape.prefill(1024)
    plain, ep = RooflineCostModel(m, H200, tp=tp), RooflineCostModel(m, H200, tp=tp, ep=tp)
    a2a = 2 * m.num_layers * (10e-6 + 1024 * m.hidden_size * 2 * (tp - 1) / tp / H200.interconnect_bandwidth)
    assert ep.breakdown(b).alltoall_s == pytest.approx(a2a)
    assert plain.breakdown(b).alltoall_s == 0.0
    assert ep.breakdown(b).allreduce_s == pytest.approx(plain.breakdown(b).allreduce_s / 2)
    assert ep.flops(b) == plain.flops(b) and ep.bytes_moved(b) == plain.bytes_moved(b)
    assert ep.step_time(b) == pytest.approx(ep.breakdown(b).total_s)


def test_all_to_all_grows_with_ep_and_tokens():
    b_small, b_big = BatchShape.decode(8, 0), BatchShape.decode(256, 0)
    by_ep = [RooflineCostModel(MIXTRAL, H200, tp=e, ep=e).breakdown(b_big).alltoall_s for e in (2, 4, 8)]
    assert by_ep == sorted(by_ep) and len(set(by_ep)) == 3
    cm = RooflineCostModel(MIXTRAL, H200, tp=4, ep=4)
    assert cm.breakdown(b_big).alltoall_s > cm.breakdown(b_small).alltoall_s > 0


@pytest.mark.parametrize("model, tp, ep, match", [
    ("Llama-3-8B", 2, 2, "needs a mixture of experts"),
    ("Mixtral-8x7B", 4, 2, "must equal the tensor-parallel size 4"),
    ("Qwen3-30B-A3B", 1, 0, "must be >= 1"),
])
def test_expert_parallel_is_checked(model, tp, ep, match):
    with pytest.raises(ValueError, match=match):
        RooflineCostModel(get_model(model), H200, tp=tp, ep=ep)


def test_expert_parallel_must_divide_the_experts():
    from dataclasses import replace
    six = replace(MIXTRAL, name="Mixtral-6x7B", num_experts=6)
    with pytest.raises(ValueError, match="does not divide Mixtral-6x7B's 6 experts"):
        RooflineCostModel(six, H200, tp=4, ep=4)


@pytest.mark.parametrize("model, tp, ep", [("Qwen3-30B-A3B", 1, 1), ("Mixtral-8x7B", 2, 2),
                                           ("Qwen3-30B-A3B", 4, 4)])
def test_moe_decode_spans_equal_step_by_step(model, tp, ep):
    """The simulator's skip-ahead (decode_steps_time, decode_step_times) prices a MoE
    step, its all-to-all and its batch-dependent expert reads like step_time does."""
    cm = RooflineCostModel(get_model(model), H200, tp=tp, ep=ep)
    for n, ctx, k in [(1, 0, 50), (7, 7 * 300, 40), (200, 200 * 900, 30)]:
        loop = [cm.step_time(BatchShape.decode(n, ctx + j * n)) for j in range(k)]
        assert cm.decode_step_times(n, ctx, k) == loop          # bit for bit
        assert cm.decode_steps_time(n, ctx, k) == pytest.approx(sum(loop), rel=1e-12)


def test_dense_models_price_as_before():
    """Adding MoE and EP left dense pricing alone: Llama-2-13B's terms, written out."""
    cm, b = RooflineCostModel(LLAMA13, A100_80, tp=2), BatchShape.decode(16, 16 * 700)
    m = LLAMA13
    flops = (2 * 40 * m.matmul_params_per_layer() / 2 * 16 + 2 * m.lm_head_params() / 2 * 16
             + 4 * 40 * 20 * 128 * b.attn_pairs)
    streamed = (40 * m.params_per_layer() + m.hidden_size + m.lm_head_params()) * 2 / 2
    nbytes = streamed + 2 * 40 * 20 * 128 * 2 * (b.context_sum + 2 * 16)
    allreduce = 80 * 10e-6 + 80 * (2 * 0.5 * 5120 * 2) * 16 / A100_80.interconnect_bandwidth
    assert cm.flops(b) == pytest.approx(flops, rel=1e-12)
    assert cm.bytes_moved(b) == pytest.approx(nbytes, rel=1e-12)
    assert cm.step_time(b) == pytest.approx(
        max(flops / (312e12 * 0.6), nbytes / (2039e9 * 0.75)) + allreduce + 2e-3, rel=1e-12)


# --- sliding-window layers -------------------------------------------------------------

GEMMA9 = get_model("Gemma-2-9B")


def test_sliding_window_layers_read_at_most_the_window():
    """Gemma-2-9B: 21 local layers (window 4096), 21 global. A decode batch of 4 sequences
    at 6000 tokens reads 4 * 4096 tokens of KV in the local layers and 4 * 6001 in the
    global ones; its attention pairs split the same way."""
    cm, b = RooflineCostModel(GEMMA9, H200), BatchShape.decode(4, 4 * 6000)
    per_layer_token = 2 * 8 * 256 * 2
    kv = per_layer_token * (21 * (24_000 + 8) + 21 * (4 * 4096 + 4))    # reads + the 4 new tokens' writes
    assert cm.bytes_moved(b) - cm.weight_bytes_read(4) == kv
    per_layer_pair = 4 * 16 * 256
    attention = per_layer_pair * (21 * 24_004 + 21 * 4 * 4096)
    assert cm.flops(b) == pytest.approx(cm.flops(BatchShape.decode(4, 0)) - per_layer_pair * 42 * 4 + attention,
                                        rel=1e-12)


def test_within_the_window_local_layers_cost_what_global_ones_do():
    from dataclasses import replace
    full = replace(GEMMA9, name="Gemma-2-9B-full", sliding_window=0, num_sliding_layers=0)
    windowed, unwindowed = RooflineCostModel(GEMMA9, H200), RooflineCostModel(full, H200)
    inside, past = BatchShape.decode(8, 8 * 3000), BatchShape.decode(8, 8 * 7000)
    assert windowed.step_time(inside) == unwindowed.step_time(inside)
    assert windowed.bytes_moved(past) < unwindowed.bytes_moved(past)
    assert windowed.flops(past) < unwindowed.flops(past)


@pytest.mark.parametrize("model, n, start, k", [
    ("Gemma-2-9B", 4, 4 * 4000, 300),       # crosses the 4096 window after ~95 steps
    ("Mistral-7B-v0.1", 32, 32 * 4090, 20),  # every layer local
    ("Phi-3-mini-4k", 1, 0, 4000),           # window 2047, from an empty context
    ("Gemma-2-9B", 4, 4 * 5000, 50),         # already past it
])
def test_decode_spans_across_the_window_equal_step_by_step(model, n, start, k):
    cm = RooflineCostModel(get_model(model), _toy_hardware(40.0))
    loop = [cm.step_time(BatchShape.decode(n, start + j * n)) for j in range(k)]
    assert cm.decode_step_times(n, start, k) == loop        # bit for bit
    assert cm.decode_steps_time(n, start, k) == pytest.approx(sum(loop), rel=1e-12)
