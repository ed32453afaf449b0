"""Tiny random Llama checkpoints for model, engine, server and calibration tests."""
from __future__ import annotations

from pathlib import Path


def save_tiny_llama(path: str | Path, *, vocab_size: int | None = None, tokenizer=None, seed: int = 0,
                    **config_overrides):
    """Save a tiny random Llama (2 layers, hidden 64, 4 query / 2 KV heads, fp32) to `path`
    and return the HF model. With `tokenizer`, the vocabulary and BOS/EOS ids are its own
    and its files are saved beside the weights (so the engine can take text prompts)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256)
    if tokenizer is not None:
        settings.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    if vocab_size is not None:
        settings["vocab_size"] = vocab_size
    settings.update(config_overrides)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.float32).eval()
    hf.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return hf


# Tiny sizes shared by the Qwen3 / Phi-3 builders: 2 layers, hidden 64, 4 query / 2 KV heads,
# a 256-token vocabulary, and initializer_range 0.15 (far from uniform attention, so a
# position or norm mistake shows in the logits).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.15, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


def _save_tiny(config, path: str | Path, seed: int, adjust=None, tokenizer=None):
    """Build the HF model for `config` (fp32, seeded), let `adjust(hf)` change weights, save.
    With `tokenizer`, the vocabulary and BOS/EOS ids are its own and its files are saved
    beside the weights (so the engine and the CLI take text prompts)."""
    import torch
    from transformers import AutoModelForCausalLM

    if tokenizer is not None:
        config.vocab_size, config.bos_token_id = len(tokenizer), tokenizer.bos_token_id
        config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if adjust is not None:
        with torch.no_grad():
            adjust(hf)
    hf.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return hf


def save_tiny_qwen3(path: str | Path, *, seed: int = 0, tokenizer=None, **config_overrides):
    """A tiny random Qwen3 (per-head q/k RMSNorm; head_dim 32, so q is 128 wide on a
    64-wide model, as Qwen3's head_dim is its own) saved to `path`; returns the HF model.
    The q/k norm weights are random (HF initializes them to ones, which would hide a
    missing norm's weight)."""
    from transformers import Qwen3Config

    def random_qk_norms(hf):
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)

    config = Qwen3Config(**{**TINY, "head_dim": 32, "tie_word_embeddings": True, **config_overrides})
    return _save_tiny(config, path, seed, random_qk_norms, tokenizer)


def save_tiny_phi3(path: str | Path, *, seed: int = 0, tokenizer=None, **config_overrides):
    """A tiny random Phi-3 (fused qkv_proj and gate_up_proj in the checkpoint; partial
    rotary 0.5: RoPE turns 8 of each head's 16 dims) saved to `path`; returns the HF model."""
    from transformers import Phi3Config

    return _save_tiny(Phi3Config(**{**TINY, "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                                    **config_overrides}), path, seed, tokenizer=tokenizer)


def save_tiny_moe(path: str | Path, family: str = "mixtral", *, seed: int = 0, router_std: float = 0.5,
                  **config_overrides):
    """Save a tiny random mixture of experts (4 experts, top-2, hidden 64, 4 query / 2 KV
    heads, fp32) to `path` and return the HF model. family: "mixtral" (MixtralConfig) or
    "qwen3_moe" (Qwen3MoeConfig: q/k norm, expert width 32, norm_topk_prob False). The
    routers get N(0, router_std) weights so routing is decisive (no near-ties between experts)."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  num_experts_per_tok=2, initializer_range=0.15, tie_word_embeddings=False)
    if family == "mixtral":
        config = MixtralConfig(**{**common, "num_local_experts": 4, **config_overrides})
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(**{**common, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16,
                                   "norm_topk_prob": False, **config_overrides})
    else:
        raise ValueError(f"family must be mixtral or qwen3_moe, got {family!r}")
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
                param.normal_(0, router_std)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1, 0.3)             # not all ones, so a missing q/k norm shows
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def save_tiny_mistral_window(path: str | Path, *, seed: int = 0, sliding_window: int = 5, **config_overrides):
    """A tiny random Mistral whose sliding window (5 by default) is shorter than the test
    prompts, so attending past it changes the logits; saved to `path`, returns the HF model
    (eager attention)."""
    from transformers import MistralConfig

    config = MistralConfig(**{**TINY, "sliding_window": sliding_window, "tie_word_embeddings": False,
                              **config_overrides})
    config._attn_implementation = "eager"
    return _save_tiny(config, path, seed)


def save_tiny_gemma2(path: str | Path, *, seed: int = 0, **config_overrides):
    """A tiny random Gemma 2 saved to `path`; returns the HF model (eager attention: HF's
    sdpa path has no soft cap). Sized so each Gemma 2 feature shows in the logits: layer 0
    local with a window of 5 (shorter than the test prompts), layer 1 global; attention and
    final soft caps of 2 and 3 (the scores and logits of these weights are a few units);
    query_pre_attn_scalar 24 != head_dim 16; and random norm weights (HF initializes them
    to 0, i.e. scale 1 + 0, which would hide a missing `1 +`)."""
    from transformers import Gemma2Config

    def random_norms(hf):
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.3)

    config = Gemma2Config(**{**TINY, "head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 24,
                             "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                             "tie_word_embeddings": True, **config_overrides})
    config._attn_implementation = "eager"
    return _save_tiny(config, path, seed, random_norms)
