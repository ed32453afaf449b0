"""Model classes by Hugging Face `architectures` name."""
from __future__ import annotations

from .config import ModelConfig
from .llama import LlamaForCausalLM

# Mistral is Llama (its optional sliding window is not applied); Qwen2 is Llama with q/k/v
# biases. ModelConfig carries the differences, so one class serves all three.
MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}") from None


__all__ = ["ModelConfig", "LlamaForCausalLM", "MODEL_REGISTRY", "get_model_class"]
