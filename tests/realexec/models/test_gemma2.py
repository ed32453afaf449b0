"""Gemma 2 against transformers.

A tiny random Gemma2Config checkpoint (tests/tiny_models.py: layer 0 local with window 5,
layer 1 global, attention / final soft caps 2 and 3, query_pre_attn_scalar 24, random
norm weights) saved with save_pretrained: our paged model's logits agree with HF's eager
attention within fp32 tolerance in one batch, in chunked prefills mixed with decodes and
after a prefix-cache hit, greedy tokens equal HF `generate`, with each attention backend
(Triton under TRITON_INTERPRET=1) and through the engine, also with TP=2 on `mp`.
"""
import json
import os

INTERPRET = os.environ.get("TWINSERVE_TRITON_GPU_TESTS") != "1"   # these models run on the CPU
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see tests/realexec/kernels)

import pytest  # noqa: E402
import torch  # noqa: E402

from realexec.models import ModelConfig  # noqa: E402
from realexec.models.gemma2 import Gemma2ForCausalLM  # noqa: E402
from realexec.models.linear import pack_weights  # noqa: E402
from realexec.models.loader import load_model, read_model_config  # noqa: E402
from tests.realexec.models.hf_parity import (  # noqa: E402
    check_chunks_decodes_prefix_hit, check_engine, check_greedy, check_prefill_batch)
from tests.realexec.models.test_model import ATOL, PagedKV, hf_logits, random_prompts, run_step  # noqa: E402
from tests.tiny_models import save_tiny_gemma2  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = ("torch", "cpu") + (("triton",) if INTERPRET else ())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma2")
    return path, save_tiny_gemma2(path)


@pytest.fixture(scope="module", params=BACKENDS)
def tiny(request, checkpoint):
    path, hf = checkpoint
    ours, cfg, _ = load_model(path, dtype=torch.float32, attn_backend=request.param)
    if request.param == "cpu":         # the CPU engine's path: the kernel and packed projections
        pack_weights(ours, "packed")
    assert isinstance(ours, Gemma2ForCausalLM) and ours.layers[0].self_attn.backend.name == request.param
    return ours, hf


def test_config_reads_gemma2_fields(checkpoint):
    cfg = read_model_config(checkpoint[0])
    assert cfg.architecture == "Gemma2ForCausalLM"
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert [cfg.sliding_window_for(i) for i in range(2)] == [5, None]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar, cfg.hidden_act,
            cfg.tie_word_embeddings) == (2.0, 3.0, 24, "gelu_pytorch_tanh", True)


def test_hub_style_config_gets_transformers_defaults():
    """A config.json as on the hub (transformers 4.42: no layer_types, no
    tie_word_embeddings, hidden_act beside hidden_activation) reads as transformers 5 reads it."""
    hub = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
           "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
           "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf(hub)
    assert cfg.tie_word_embeddings
    assert [cfg.sliding_window_for(i) for i in range(4)] == [4096, None, 4096, None]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar) == (50.0, 30.0, 256)
    with pytest.raises(ValueError, match="layer_types must list 4"):
        ModelConfig.from_hf({**hub, "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ValueError, match="layer_types must list 4"):
        ModelConfig.from_hf({**hub, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_hf({**hub, "sliding_window": 0})


def test_unknown_activation_is_refused(tmp_path, checkpoint):
    path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    config["hidden_activation"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match="Gemma2ForCausalLM: hidden activation 'relu' is not supported"):
        load_model(tmp_path)


def test_prefill_batch_matches_hf(tiny):
    check_prefill_batch(*tiny)


def test_chunked_prefill_decodes_and_prefix_hit_match_hf(tiny):
    check_chunks_decodes_prefix_hit(*tiny)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_hf_generate(backend, checkpoint):
    path, hf = checkpoint
    ours, _, _ = load_model(path, dtype=torch.float32, attn_backend=backend)
    check_greedy(ours, hf)


def test_engine_greedy_matches_hf_generate(checkpoint):
    check_engine(*checkpoint)


def test_tp2_mp_greedy_matches_hf_generate(checkpoint):
    """Tensor parallelism on the mp executor (2 ranks, a KV head each): the scaled
    vocab-parallel embedding, the post-norms over all-reduced sublayer outputs and the
    final soft cap on the gathered logits give HF's greedy tokens."""
    check_engine(*checkpoint, tensor_parallel_size=2, distributed_executor_backend="mp")


def test_no_cache_prefill_matches_hf(checkpoint):
    """kv_caches=None (the profiling run before the cache exists) windows and caps too."""
    from tests.realexec.models.test_model import make_metadata

    path, hf = checkpoint
    ours, _, _ = load_model(path, dtype=torch.float32)
    prompts = random_prompts(2, [3, 13])
    md = make_metadata([([0, 1, 2, 3], 0, len(p)) for p in prompts], 4)
    md.slot_mapping.fill_(-1)
    with torch.no_grad():
        h = ours(torch.tensor(sum(prompts, [])), torch.tensor([i for p in prompts for i in range(len(p))]), None, md)
        got = ours.compute_logits(h).split([len(p) for p in prompts])
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)


def test_bf16_close_to_fp32(checkpoint):
    """Half precision end to end stays near fp32 (the fp32 norm math, rounded embed scale)."""
    path, _ = checkpoint
    ours, _, _ = load_model(path, dtype=torch.float32)
    half, _, _ = load_model(path, dtype=torch.bfloat16)
    prompt = random_prompts(1, [12])[0]
    (ref,) = run_step(ours, PagedKV(ours.config, 8, 4), [("x", prompt, 0)])
    (got,) = run_step(half, PagedKV(ours.config, 8, 4, dtype=torch.bfloat16), [("x", prompt, 0)])
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
