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
