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

from core import SamplingParams
from realexec.models import MODEL_REGISTRY, REFUSED, ModelConfig, check_architecture
from realexec.models.loader import load_model, read_model_config
from tests.realexec.models.test_model import ATOL, PagedKV, greedy_generate, hf_logits, random_prompts, run_step
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
    ours, hf = tiny
    prompts = random_prompts(3, [5, 8, 13])
    got = run_step(ours, PagedKV(ours.config, num_blocks=32, block_size=4), [(f"p{i}", p, 0)
                                                                            for i, p in enumerate(prompts)])
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)


def test_chunked_prefill_decodes_and_prefix_hit_match_hf(tiny):
    """Chunks mixed with decodes, then a sequence that reuses another's first two blocks
    (a prefix-cache hit) and computes only its suffix: HF's full-prefill logits throughout."""
    ours, hf = tiny
    B = 4
    a, b = random_prompts(2, [14, 15], seed=2)
    c = a[:2 * B] + random_prompts(1, [6], seed=3)[0]
    ref_a, ref_b, ref_c = (hf_logits(hf, s) for s in (a, b, c))
    kv = PagedKV(ours.config, num_blocks=48, block_size=B, seed=5)
    la, lb = run_step(ours, kv, [("a", a[:9], 0), ("b", b[:5], 0)])
    torch.testing.assert_close(la, ref_a[:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[:5], atol=ATOL, rtol=0)
    la, lb = run_step(ours, kv, [("a", a[9:10], 9), ("b", b[5:], 5)])
    torch.testing.assert_close(la, ref_a[9:10], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[5:], atol=ATOL, rtol=0)
    for pos in range(10, 14):
        (la,) = run_step(ours, kv, [("a", a[pos:pos + 1], pos)])
        torch.testing.assert_close(la, ref_a[pos:pos + 1], atol=ATOL, rtol=0)
    kv.share_prefix("c", "a", 2)
    (lc,) = run_step(ours, kv, [("c", c[2 * B:], 2 * B)])
    torch.testing.assert_close(lc, ref_c[2 * B:], atol=ATOL, rtol=0)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy tokens, never stopping at EOS (as our runs with ignore_eos)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=-1)          # a token that never comes
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      generation_config=config)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_hf_generate(tiny):
    ours, hf = tiny
    prompts = random_prompts(2, [6, 11], seed=4)
    got = greedy_generate(ours, PagedKV(ours.config, num_blocks=64, block_size=4, seed=7), prompts, 24)
    assert got == [hf_greedy(hf, p, 24) for p in prompts]


def test_phi3_sliding_window_matches_hf(tmp_path):
    """Phi-3's config carries a sliding window (Phi-3-mini-4k: 2047) that HF applies on
    every layer; a window of 5, shorter than the prompts, gives HF's logits (eager
    attention, which applies it) in one batch, in chunks and decodes, and on a prefix hit."""
    hf = save_tiny_phi3(tmp_path, sliding_window=5)
    hf.set_attn_implementation("eager")
    ours, cfg, _ = load_model(tmp_path, dtype=torch.float32)
    assert [cfg.sliding_window_for(i) for i in range(cfg.num_hidden_layers)] == [5, 5]
    test_prefill_batch_matches_hf((ours, hf))
    test_chunked_prefill_decodes_and_prefix_hit_match_hf((ours, hf))


# ----------------------------------------------------------------------------- through the engine

SHARED = list(range(40, 56))                        # 4 full blocks of 4: prefix-cache hits
PROMPTS = [SHARED + [3, 4, 5], SHARED + [6, 7, 8, 9, 10], list(range(100, 131)), [9, 8, 7, 6, 5]]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
# Chunks of 16 tokens (the 31-token prompt prefills in two), prefix caching on.
ENGINE = dict(block_size=4, num_gpu_blocks=128, swap_space=0.002, max_num_batched_tokens=16,
              enable_prefix_caching=True)


def engine_run(llm):
    """(greedy tokens of PROMPTS, prefix-hit tokens): the shared prompts run after the
    first finishes, so they hit its cached blocks."""
    hits0 = llm.engine.scheduler.kv.stats().prefix_cache_hits
    first = llm.generate(PROMPTS[:1], GREEDY)
    rest = llm.generate(PROMPTS[1:], GREEDY)
    out = [o.outputs[0].token_ids for o in first + rest]
    return out, llm.engine.scheduler.kv.stats().prefix_cache_hits - hits0


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
    test_prefill_batch_matches_hf((ours, hf))
    test_chunked_prefill_decodes_and_prefix_hit_match_hf((ours, hf))
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
