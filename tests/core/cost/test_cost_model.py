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
