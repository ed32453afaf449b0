"""Qwen3 and Phi-3 against transformers, and the registry's refusals.

Tiny random-weight checkpoints built with transformers' own config classes
(tests/tiny_models.py) and saved with save_pretrained: our paged model's logits agree with
HF's within fp32 tolerance (one batch, chunked prefill mixed with decodes, a prefix-cache
hit), and greedy tokens equal HF `generate`, in the model and through the engine (LLM).
TP=2 on the `mp` executor equals TP=1 for Phi-3 (its fused qkv/gate_up tensors are cut per
rank). Architectures we do not run are refused with an error that names them and says why.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from realexec.models import MODEL_REGISTRY, REFUSED, ModelConfig, check_architecture
from realexec.models.linear import pack_weights
from realexec.models.loader import load_model, read_model_config
from tests.realexec.models.hf_parity import (ENGINE, PROMPTS, check_chunks_decodes_prefix_hit, check_greedy,
                                             check_prefill_batch, engine_run, hf_greedy)
from tests.realexec.models.test_model import ATOL, PagedKV, hf_logits, random_prompts, run_step
from tests.tiny_models import save_tiny_phi3, save_tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUILDERS = {"qwen3": save_tiny_qwen3, "phi3": save_tiny_phi3}
ARCHS = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (checkpoint dir, HF model)}, built once per module."""
    out = {}
    for kind, build in BUILDERS.items():
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        out[kind] = (path, build(path))
    return out


@pytest.fixture(scope="module", params=[(kind, backend) for backend in ("torch", "cpu") for kind in BUILDERS],
                ids=lambda p: "-".join(p))
def tiny(request, checkpoints):
    """(our model, HF model): ours runs the torch reference attention or the CPU kernel."""
    kind, backend = request.param
    path, hf = checkpoints[kind]
    ours, cfg, _ = load_model(path, dtype=torch.float32, attn_backend=backend)
    if backend == "cpu":         # the CPU engine's path: the kernel and packed projections
        pack_weights(ours, "packed")
    assert cfg.architecture == ARCHS[kind] == type(hf).__name__
    return ours, hf


# ----------------------------------------------------------------------------- config

def test_family_configs_read_from_hf(checkpoints):
    """What each family's config.json says reaches ModelConfig: Qwen3's own head_dim (q is
    wider than the model) and q/k norm, Phi-3's partial rotary; the defaults stay off."""
    q3 = read_model_config(checkpoints["qwen3"][0])
    p3 = read_model_config(checkpoints["phi3"][0])
    assert (q3.head_dim, q3.q_size, q3.qk_norm, q3.rotary_dim, q3.attention_bias, q3.sliding_window) == (
        32, 128, True, 32, False, None)
    assert (p3.head_dim, p3.qk_norm, p3.partial_rotary_factor, p3.rotary_dim, p3.attention_bias) == (
        16, False, 0.5, 8, False)
    # A config.json without `architectures` (hand-written, some exports) names its family by model_type.
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert ModelConfig.from_hf({**base, "model_type": "qwen3"}).qk_norm
    # Qwen3 (as Qwen2) declares a window that is off unless use_sliding_window says so
    # (HF's default for an absent key is False); Mistral's is on.
    assert ModelConfig.from_hf({**base, "model_type": "qwen3", "sliding_window": 4096}).sliding_window is None
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    assert ModelConfig.from_hf({**base, "model_type": "phi3", "hidden_size": 16,
                                "partial_rotary_factor": 0.75}).rotary_dim == 6
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not one we know"):
        ModelConfig.from_hf({**base, "model_type": "gpt_neox"})


# ----------------------------------------------------------------------------- logits and greedy vs HF

def test_prefill_batch_matches_hf(tiny):
    check_prefill_batch(*tiny)


def test_chunked_prefill_decodes_and_prefix_hit_match_hf(tiny):
    check_chunks_decodes_prefix_hit(*tiny)


def test_greedy_matches_hf_generate(tiny):
    check_greedy(*tiny)


def test_phi3_sliding_window_matches_hf(tmp_path):
    """Phi-3's config carries a sliding window (Phi-3-mini-4k: 2047) that HF applies on
    every layer; a window of 5, shorter than the prompts, gives HF's logits (eager
    attention, which applies it) in one batch, in chunks and decodes, and on a prefix hit."""
    hf = save_tiny_phi3(tmp_path, sliding_window=5)
    hf.set_attn_implementation("eager")
    ours, cfg, _ = load_model(tmp_path, dtype=torch.float32)
    assert [cfg.sliding_window_for(i) for i in range(cfg.num_hidden_layers)] == [5, 5]
    check_prefill_batch(ours, hf)
    check_chunks_decodes_prefix_hit(ours, hf)


# ----------------------------------------------------------------------------- through the engine

@pytest.mark.parametrize("kind", list(BUILDERS))
def test_engine_greedy_matches_hf_generate(kind, checkpoints):
    """LLM with chunked prefill and prefix caching gives HF's greedy tokens."""
    from realexec import LLM

    path, hf = checkpoints[kind]
    out, hits = engine_run(LLM(model=str(path), **ENGINE))
    assert hits > 0
    assert out == [hf_greedy(hf, p, 20) for p in PROMPTS]


def test_phi3_tp2_mp_matches_tp1(checkpoints):
    """Tensor parallelism on the mp executor: each rank cuts its q/k/v and gate/up rows out
    of Phi-3's fused checkpoint tensors; greedy tokens equal TP=1's."""
    from realexec import LLM

    path = str(checkpoints["phi3"][0])
    reference = engine_run(LLM(model=path, **ENGINE))
    llm = LLM(model=path, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    try:
        assert engine_run(llm) == reference
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_tp_that_does_not_divide_the_heads_is_refused(kind, checkpoints):
    from realexec.distributed import check_tensor_parallel

    cfg = read_model_config(checkpoints[kind][0])
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match=r"tensor-parallel-size 4 must divide the model's 4 query heads and 2 KV "
                                         r"heads .* valid sizes: 1, 2"):
        check_tensor_parallel(cfg, 4)


# ----------------------------------------------------------------------------- refusals

def _config_dir(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_refused_architectures_name_themselves_and_the_supported_list(tmp_path, monkeypatch):
    """Loading a family we do not run fails before any weight is read: the architecture,
    the reason, and what does run."""
    # Phi-3-small (trust_remote_code on the hub; transformers has no config class for it).
    small = dict(architectures=["Phi3SmallForCausalLM"], model_type="phi3small", vocab_size=64, hidden_size=32,
                 intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    supported = ", ".join(sorted(MODEL_REGISTRY))
    with pytest.raises(ValueError) as info:
        load_model(_config_dir(tmp_path / "phi3small", small))
    assert str(info.value) == f"Phi3SmallForCausalLM: {REFUSED['Phi3SmallForCausalLM']}; supported: {supported}"
    assert "block-sparse attention" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)

    # An architecture nobody listed: named, with the supported list.
    with pytest.raises(ValueError, match=r"^unsupported architecture 'FalconForCausalLM'; supported: .*"
                                         r"Phi3ForCausalLM.*Qwen3ForCausalLM"):
        read_model_config(_config_dir(tmp_path / "falcon", {**small, "architectures": ["FalconForCausalLM"]}))
    # No `architectures`, the model_type of a refused family: the same refusal as by name
    # (Gemma 2 as it was before it was registered).
    monkeypatch.delitem(MODEL_REGISTRY, "Gemma2ForCausalLM", raising=False)
    monkeypatch.setitem(REFUSED, "Gemma2ForCausalLM", "not supported yet (logit soft-capping)")
    untagged = {k: v for k, v in small.items() if k != "architectures"} | {"model_type": "gemma2"}
    with pytest.raises(ValueError, match=r"^Gemma2ForCausalLM: not supported yet \(logit soft-capping\); "):
        read_model_config(_config_dir(tmp_path / "gemma2-untagged", untagged))
    for arch in REFUSED:
        with pytest.raises(ValueError, match=rf"^{arch}: "):
            check_architecture(arch)
    monkeypatch.undo()
    for arch in MODEL_REGISTRY:
        check_architecture(arch)


def longrope_phi3(tmp_path):
    """A tiny Phi-3 with LongRoPE (as Phi-3.5-mini / Phi-4-mini): pretraining context 64,
    declared context 256, distinct short and long factors."""
    short = torch.linspace(1.0, 3.0, 4).tolist()                  # head_dim 16, partial 0.5: 4 pairs
    return save_tiny_phi3(tmp_path, max_position_embeddings=256, original_max_position_embeddings=64,
                          rope_scaling={"rope_type": "longrope", "short_factor": short,
                                        "long_factor": [5.0, 6.0, 7.0, 8.0]})


def test_phi3_longrope_short_regime_matches_hf(tmp_path, caplog):
    """LongRoPE runs in its short regime (HF's short_factor and attention_factor while a
    sequence fits the pretraining context): the context is capped there, with a warning,
    and within it the logits are HF's (batch, chunks, decodes, prefix hit)."""
    hf = longrope_phi3(tmp_path)
    with caplog.at_level("WARNING"):
        ours, cfg, _ = load_model(tmp_path, dtype=torch.float32)
    assert "LongRoPE runs in its short regime only: context capped at 64 tokens" in caplog.text
    assert cfg.max_position_embeddings == 64 and cfg.rope_scaling["attention_factor"] == pytest.approx(
        (1 + np.log(4) / np.log(64)) ** 0.5)
    check_prefill_batch(ours, hf)
    check_chunks_decodes_prefix_hit(ours, hf)
    prompt = random_prompts(1, [60], seed=9)[0]                     # near the cap
    (got,) = run_step(ours, PagedKV(cfg, 16, 4), [("x", prompt, 0)])
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_phi3_longrope_old_su_layout_and_the_cap_in_the_engine(tmp_path):
    """Old configs call LongRoPE 'su' (same factors); the engine refuses a longer context."""
    from realexec import LLM

    longrope_phi3(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    factors = {k: v for k, v in d.pop("rope_parameters").items() if k.endswith("_factor") and k != "partial_rotary_factor"}
    d["rope_scaling"] = {"type": "su", **factors}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = read_model_config(tmp_path)
    assert (cfg.rope_scaling["rope_type"], cfg.rope_scaling["short_factor"], cfg.max_position_embeddings) == (
        "longrope", factors["short_factor"], 64)
    with pytest.raises(ValueError, match="max-model-len 128 exceeds the model's max_position_embeddings 64"):
        LLM(model=str(tmp_path), max_model_len=128, num_gpu_blocks=64, block_size=4)


def test_unsupported_rope_scaling_is_refused_up_front(tmp_path):
    """A rope_scaling type our rotary table does not implement is refused when the config
    is read (not at the first long prompt), naming the architecture and the types we run."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 64}).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM: rope_scaling type 'yarn' is not supported "
                                         r"\(supported: default, linear, llama3, longrope\)"):
        load_model(_config_dir(tmp_path, cfg))


# ----------------------------------------------------------------------------- the CLI

@pytest.mark.parametrize("kind", list(BUILDERS))
def test_cli_generate_runs_each_family_from_a_local_hf_dir(kind, tmp_path, capsys):
    """`python -m realexec generate --model DIR` (in process) streams HF's greedy text."""
    from transformers import AutoTokenizer

    from realexec.bench.throughput import model_dir
    from realexec.cli import main

    tok = AutoTokenizer.from_pretrained(model_dir(None))          # SmolLM2's, shipped with the package
    hf = BUILDERS[kind](tmp_path, tokenizer=tok)
    prompt = "The sea is"
    assert main(["generate", "--model", str(tmp_path), "--prompt", prompt, "--max-tokens", "8",
                 "--ignore-eos", "--num-gpu-blocks", "64"]) == 0
    text, finish = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert finish == "[finish_reason: length, 8 tokens (cut off: raise --max-tokens for more)]"
    assert text == tok.decode(hf_greedy(hf, tok(prompt).input_ids, 8))


# ----------------------------------------------------------------------------- GGUF

# HF tensor name (after "model.layers.N.") -> GGUF name (after "blk.N."), as llama.cpp's
# convert_hf_to_gguf writes Qwen3 (no q/k permutation, q/k norms) and Phi-3 (fused qkv;
# ffn_up holds gate and up stacked).
_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
            "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_tiny_gguf(hf, path, arch: str, long_rope: bool = False) -> None:
    import gguf

    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue                                    # llama.cpp writes no output tensor when tied
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_TO_GGUF[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        w.add_tensor(gname, t.numpy().copy())
    if long_rope:
        w.add_tensor("rope_factors_long.weight", np.ones(head_dim // 2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_gguf_of_each_family_matches_hf(kind, checkpoints, tmp_path):
    """A GGUF laid out as llama.cpp writes Qwen3 / Phi-3 converts to a checkpoint with HF's logits."""
    hf = checkpoints[kind][1]
    write_tiny_gguf(hf, tmp_path / f"{kind}.gguf", kind)
    ours, cfg, _ = load_model(tmp_path / f"{kind}.gguf", cache_dir=tmp_path / "cache")
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm, cfg.rotary_dim, cfg.tie_word_embeddings) == (
        ARCHS[kind], hf.config.head_dim if kind == "qwen3" else 16, kind == "qwen3", 32 if kind == "qwen3" else 8,
        hf.config.tie_word_embeddings)
    prompt = random_prompts(1, [11])[0]
    (got,) = run_step(ours, PagedKV(ours.config, 8, 4), [("x", prompt, 0)])
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_gguf_with_long_rope_factors_is_refused(checkpoints, tmp_path):
    write_tiny_gguf(checkpoints["phi3"][1], tmp_path / "long.gguf", "phi3", long_rope=True)
    with pytest.raises(ValueError, match=r"long\.gguf: GGUF rope_factors \(LongRoPE.*not supported; load the Hugging Face"):
        load_model(tmp_path / "long.gguf", cache_dir=tmp_path / "cache")
