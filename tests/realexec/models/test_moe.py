"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against transformers, on CPU in fp32.

Tiny random checkpoints built with transformers' own config classes (4 experts, top-2,
hidden 64; the routers' weights scaled up so routing is decisive): logits of a batched
prefill, of chunked prefill mixed with decodes and of a prefix-cache hit equal HF's
within fp32 tolerance, and greedy tokens equal HF `generate`. The Qwen3-MoE checkpoint
has one dense layer (mlp_only_layers) and does not renormalize its top-k weights; Mixtral
always does. The MoE block's two compute paths (grouped by expert, and the graph-safe
all-experts one) equal a per-token reference. TP=2 and PP=2 on `mp` give TP=1's tokens
and logprobs.
"""
from __future__ import annotations

import json

import pytest
import torch

from core import SamplingParams
from realexec.distributed import TPGroup, check_tensor_parallel
from realexec.models import ModelConfig
from realexec.models import moe as moe_module
from realexec.models.linear import pack_weights
from realexec.models.loader import load_model
from realexec.models.moe import SparseMoeBlock
from tests.realexec.models.hf_parity import check_chunks_decodes_prefix_hit, check_prefill_batch
from tests.realexec.models.test_model import (ATOL, PagedKV, greedy_generate, hf_logits, make_metadata, random_prompts,
                                              run_step)
from tests.tiny_models import save_tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3-MoE: 3 layers, the middle one dense (its MLP of intermediate_size 96).
FAMILIES = {"mixtral": {}, "qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1])}


@pytest.fixture(scope="module", params=[("mixtral", "torch"), ("mixtral", "cpu"), ("qwen3_moe", "torch")],
                ids=lambda p: "-".join(p))
def tiny(request, tmp_path_factory):
    family, backend = request.param
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    hf = save_tiny_moe(path, family, **FAMILIES[family])
    ours, cfg, _ = load_model(path, dtype=torch.float32, attn_backend=backend)
    if backend == "cpu":         # the CPU engine's path: the kernel and packed projections
        pack_weights(ours, "packed")
    assert cfg.architecture == type(hf).__name__ and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    return ours, hf


def test_prefill_batch_matches_hf(tiny):
    check_prefill_batch(*tiny)


def test_chunked_prefill_decode_and_prefix_hit_match_hf(tiny):
    check_chunks_decodes_prefix_hit(*tiny)


def test_greedy_matches_hf_generate(tiny):
    ours, hf = tiny
    prompts = random_prompts(2, [6, 11], seed=4)
    got = greedy_generate(ours, PagedKV(ours.config, num_blocks=32, block_size=4, seed=1), prompts, 12)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert g == ref[0, len(p):].tolist()


def test_graph_safe_path_matches_hf(tiny, monkeypatch):
    """The all-experts path (what CUDA graphs and torch.compile run) through the whole model."""
    ours, hf = tiny
    monkeypatch.setattr(moe_module, "_graph_safe", lambda x: True)
    prompts = random_prompts(2, [7, 10], seed=6)
    got = run_step(ours, PagedKV(ours.config, num_blocks=16, block_size=4), [(f"q{i}", p, 0)
                                                                             for i, p in enumerate(prompts)])
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- the MoE block

def block_config(**moe) -> ModelConfig:
    return ModelConfig(architecture="MixtralForCausalLM", vocab_size=8, hidden_size=16, intermediate_size=8,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                       rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=16,
                       tie_word_embeddings=False, attention_bias=False,
                       **{"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 8, **moe})


@torch.no_grad()
def per_token_reference(block: SparseMoeBlock, x: torch.Tensor, k: int, renormalize: bool) -> torch.Tensor:
    """The textbook definition, one token at a time."""
    rows = []
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight @ x[t], dim=-1)
        top = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:k]
        total = sum(float(probs[e]) for e in top) if renormalize else 1.0
        rows.append(sum(float(probs[e]) / total * block.experts[e](x[t:t + 1])[0] for e in top))
    return torch.stack(rows)


@pytest.mark.parametrize("k,renormalize", [(1, True), (2, True), (3, False), (6, True)])
def test_block_paths_equal_per_token_reference(k, renormalize):
    torch.manual_seed(k)
    block = SparseMoeBlock(block_config(num_experts_per_tok=k, norm_topk_prob=renormalize), TPGroup(), False)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.5)
    x = torch.randn(9, 16)
    ref = per_token_reference(block, x, k, renormalize)
    with torch.no_grad():
        weights, ids = block.route(x)
        grouped, dense = block.grouped(x, weights, ids), block.all_experts(x, weights, ids)
        routed = block(x)
    torch.testing.assert_close(grouped, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(routed, grouped)


def test_config_fields_from_hub_layouts():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2)
    # Qwen3-30B-A3B's config.json names num_experts; every 2nd layer sparse except layer 3
    q = ModelConfig.from_hf({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                             "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                             "decoder_sparse_step": 2, "mlp_only_layers": [3], "sliding_window": 4096,
                             "use_sliding_window": False})
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob,
            q.dense_mlp_layers, q.qk_norm, q.sliding_window) == (128, 8, 768, True, (0, 2, 3), True, None)
    m = ModelConfig.from_hf({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                             "num_experts_per_tok": 2})
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob,
            m.dense_mlp_layers) == (8, 2, 16, True, ())
    dense = ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"]})
    assert dense.num_experts == 0


def test_bad_moe_configs_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"tensor-parallel-size 2 must divide the expert MLP width 9"):
        check_tensor_parallel(block_config(moe_intermediate_size=9), 2)
    with pytest.raises(ValueError, match=r"num_experts_per_tok <= num_experts, got 4 experts, top-5"):
        moe_module.MixtralForCausalLM(block_config(num_experts=4, num_experts_per_tok=5))


def test_transformers5_fused_expert_tensors_load(tmp_path):
    """A checkpoint saved with transformers 5's fused expert tensors ([E, 2I, H] gate_up,
    [E, H, I] down) loads to the same logits as the per-expert one."""
    hf = save_tiny_moe(tmp_path / "split", "qwen3_moe")
    hf.save_pretrained(tmp_path / "fused", safe_serialization=True, save_original_format=False)
    from safetensors import safe_open
    with safe_open(tmp_path / "fused" / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    fused, _, _ = load_model(tmp_path / "fused", dtype=torch.float32)
    prompt = random_prompts(1, [9], seed=8)[0]
    (got,) = run_step(fused, PagedKV(fused.config, 8, 4), [("x", prompt, 0)])
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_no_cache_profile_run(tiny):
    """kv_caches=None (the workers' profiling forward) runs the MoE layers too."""
    ours, hf = tiny
    prompt = random_prompts(1, [6], seed=9)[0]
    md = make_metadata([([0, 1], 0, len(prompt))], 4)
    md.slot_mapping.fill_(-1)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(len(prompt)), None, md))
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- TP and PP on mp

def test_tp2_and_pp2_on_mp_match_tp1(tmp_path):
    """TP=2 shards every expert's intermediate dimension (one all-reduce per layer); PP=2
    splits the layers (Qwen3-MoE's dense middle layer included). Greedy tokens equal one
    rank's, logprobs agree within fp32 tolerance, over prefix hits and chunked prefill."""
    from realexec import LLM
    path = tmp_path / "qwen3-moe"
    save_tiny_moe(path, "qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1], bos_token_id=1, eos_token_id=2)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    shared = list(range(40, 56))
    prompts = [shared + [3, 4, 5], shared + [6, 7], list(range(100, 131)), [9, 8, 7, 6, 5]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    engine = dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16, enable_prefix_caching=True)

    def run(**parallel):
        llm = LLM(model=str(path), **engine, **parallel)
        try:
            outs = llm.generate(prompts, params)
            hits = llm.engine.scheduler.kv.stats().prefix_cache_hits
        finally:
            llm.shutdown()
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], hits

    ref_tokens, ref_logprobs, hits = run()
    assert hits > 0
    for parallel in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        toks, logprobs, _ = run(**parallel, distributed_executor_backend="mp")
        assert toks == ref_tokens, parallel
        for ref_seq, seq in zip(ref_logprobs, logprobs):
            for ref_top, top in zip(ref_seq, seq):
                assert ref_top.keys() == top.keys()
                assert max(abs(ref_top[t] - top[t]) for t in top) < 1e-4, parallel


def test_bf16_close_to_fp32(tiny, tmp_path):
    """Half precision end to end (weights, routing weights, activations, KV cache) stays
    near fp32: routing in bf16 picks the same experts for these tokens."""
    ours, hf = tiny
    hf.save_pretrained(tmp_path, safe_serialization=True)
    half, _, _ = load_model(tmp_path, dtype=torch.bfloat16)
    prompt = random_prompts(1, [9], seed=10)[0]
    (ref,) = run_step(ours, PagedKV(ours.config, 8, 4), [("x", prompt, 0)])
    (got,) = run_step(half, PagedKV(ours.config, 8, 4, dtype=torch.bfloat16), [("x", prompt, 0)])
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
