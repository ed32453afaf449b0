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
