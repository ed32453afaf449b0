"""The model registry: which Hugging Face `architectures` run, with which class, and which
are refused and why. One line per architecture; to add a family, add its class to
MODEL_REGISTRY (and drop its REFUSED line, if any).

ModelConfig (realexec.models.config) carries the differences that do not warrant a class
of their own: Mistral is Llama (with its sliding window, if the config sets one); Qwen2 is Llama
with q/k/v biases; Qwen3 is Llama with per-head q/k RMSNorm and its own head_dim; Phi-3 is
Llama with fused qkv/gate_up tensors in the checkpoint and partial rotary.
"""
from __future__ import annotations

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .gemma2 import Gemma2ForCausalLM
from .moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,      # realexec.models.moe
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,        # realexec.models.gemma2
}

# Architectures users ask for that we refuse, with the reason (shown in the error).
REFUSED: dict[str, str] = {
    "Phi3SmallForCausalLM": "not supported (Phi-3-small's block-sparse attention and GeGELU MLP differ "
                            "from Phi-3-mini/medium's Phi3ForCausalLM)",
}


def check_architecture(architecture: str) -> None:
    """Raise ValueError unless `architecture` runs: naming it, the reason when we know one,
    and the supported list."""
    if architecture in MODEL_REGISTRY:
        return
    reason = REFUSED.get(architecture)
    what = f"{architecture}: {reason}" if reason else f"unsupported architecture {architecture!r}"
    raise ValueError(f"{what}; supported: {', '.join(sorted(MODEL_REGISTRY))}")


def get_model_class(architecture: str) -> type:
    check_architecture(architecture)
    return MODEL_REGISTRY[architecture]


__all__ = ["ModelConfig", "LlamaForCausalLM", "MODEL_REGISTRY", "REFUSED", "check_architecture",
           "get_model_class"]
