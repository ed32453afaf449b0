"""The model shape our executor needs, read from a Hugging Face config.json dict.

Accepts both config layouts in the wild: transformers <5 (`rope_theta`, `rope_scaling`,
`torch_dtype`) and transformers >=5 (`rope_parameters`, `dtype`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


# rope_scaling types the rotary table implements (realexec.models.llama.rope_inv_freq).
# "longrope" (Phi-3 128k, Phi-3.5, Phi-4-mini; "su" in old configs) runs in its short regime
# only: see _longrope.
ROPE_TYPES = ("linear", "llama3", "longrope")
_ROPE_HINTS: dict[str, str] = {}
# HF model_type -> architecture, for a config.json without `architectures`.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Architectures whose sliding window is off unless use_sliding_window says so.
_OPT_IN_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Architectures with per-head q/k RMSNorm.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _longrope(d: dict, arch: str, scaling: dict) -> int:
    """LongRoPE turns positions with `short_factor` while the sequence fits the pretraining
    context (original_max_position_embeddings) and with `long_factor` past it, switching
    every cached key's rotation when a sequence crosses it (HF recomputes per forward), which
    a paged KV cache cannot follow. We serve the short regime exactly: the context is capped
    at original_max_position_embeddings (returned, as the model's max_position_embeddings),
    `scaling` gets HF's attention_factor (cos/sin are scaled by it) and keeps short_factor."""
    original = scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if not original or not scaling.get("short_factor"):
        raise ValueError(f"{arch}: LongRoPE rope_scaling needs short_factor and original_max_position_embeddings")
    max_pos = d.get("max_position_embeddings", original)
    factor = scaling.get("factor") or max_pos / original
    if scaling.get("attention_factor") is None:
        scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if max_pos > original:
        logging.getLogger(__name__).warning(
            "%s: LongRoPE runs in its short regime only: context capped at %d tokens "
            "(original_max_position_embeddings; the config says %d)", arch, original, max_pos)
    return min(max_pos, original)


def architecture_of(d: dict) -> str:
    """The HF architecture a config.json dict names: `architectures[0]`, else from
    `model_type` (no model_type at all: Llama, as old exports omit both)."""
    archs = d.get("architectures") or []
    if archs:
        return archs[0]
    model_type = d.get("model_type")
    if model_type is None:
        return "LlamaForCausalLM"
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json names no architectures and model_type {model_type!r} is not one we "
                         f"know (known: {', '.join(sorted(MODEL_TYPES))})")
    return MODEL_TYPES[model_type]


def _first_id(value: Any) -> int | None:
    """Token id fields may be an int, a list of ints, or null."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None, or a dict with "rope_type" in {"linear", "llama3"} and its parameters.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool          # bias on q/k/v projections (Qwen2: always)
    o_proj_bias: bool = False     # bias on the output projection (Llama: = attention_bias)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # All eos ids (Llama 3 instruct has several); eos_token_id is the first.
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype = torch.float32
    # Sliding-window attention (Mistral v0.1, Gemma 2's local layers): a query sees the
    # last sliding_window positions, itself included; which layers: `sliding_window_for`.
    sliding_window: int | None = None
    # Per-layer "sliding_attention" / "full_attention" where layers differ (Gemma 2
    # alternates, Qwen2/3 window only layers >= max_window_layers); () = all alike.
    layer_types: tuple[str, ...] = ()
    # Gemma 2: attention scores and final logits soft-capped (x -> c * tanh(x / c)),
    # attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, MLP
    # activation (HF name: silu, gelu_pytorch_tanh, gelu).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    # Qwen3: an RMSNorm over each query and key head (weights [head_dim]) before RoPE.
    qk_norm: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE; 0 experts: dense): top-k of num_experts
    # SwiGLU experts of width moe_intermediate_size, the k weights renormalized to sum to 1
    # if norm_topk_prob; dense_mlp_layers keep a dense MLP (Qwen3-MoE's mlp_only_layers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_mlp_layers: tuple[int, ...] = ()
    # Phi-3 style partial rotary: RoPE turns the first int(head_dim * factor) dims of each
    # head, the rest pass through.
    partial_rotary_factor: float = 1.0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def sliding_window_for(self, layer: int) -> int | None:
        """The window of (global) decoder layer `layer`, None for full attention."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        arch = architecture_of(d)
        from realexec.models import check_architecture     # the registry imports this module
        check_architecture(arch)
        is_qwen2 = arch == "Qwen2ForCausalLM"

        heads = d["num_attention_heads"]
        rope_params = d.get("rope_parameters") or {}
        if "rope_type" not in rope_params and isinstance(next(iter(rope_params.values()), None), dict):
            raise NotImplementedError("per-layer-type rope_parameters are not supported")
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling") or (rope_params if rope_params else None)
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
            rope_type = rope_scaling.pop("rope_type", rope_scaling.pop("type", "default"))
            rope_type = "longrope" if rope_type == "su" else rope_type      # transformers renames it too
            rope_scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope_scaling}
            if rope_scaling is not None and rope_type not in ROPE_TYPES:
                raise ValueError(f"{arch}: rope_scaling type {rope_type!r} is not supported "
                                 f"(supported: default, {', '.join(ROPE_TYPES)})"
                                 + _ROPE_HINTS.get(rope_type, ""))
        partial_rotary = float(d.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)))

        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),))
        dtype_name = d.get("torch_dtype") or d.get("dtype") or "float32"
        attention_bias = bool(d.get("attention_bias", is_qwen2))
        # Qwen2/Qwen3 declare a window but switch it off with use_sliding_window.
        sliding = d.get("sliding_window") if d.get("use_sliding_window", arch not in _OPT_IN_WINDOW) else None
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=(_longrope(d, arch, rope_scaling) if rope_scaling and
                                     rope_scaling["rope_type"] == "longrope"
                                     else d.get("max_position_embeddings", 2048)),
            # Gemma 2's hub configs omit it; the model ties its head to the embedding.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "Gemma2ForCausalLM")),
            attention_bias=attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=_first_id(d.get("bos_token_id")),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
            torch_dtype=_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
            sliding_window=sliding,
            qk_norm=arch in _QK_NORM,
            partial_rotary_factor=partial_rotary,
            **_moe_fields(d, arch),
            **_attention_fields(d, arch, sliding),
        )


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _attention_fields(d: dict, arch: str, sliding: int | None) -> dict:
    """layer_types, the soft caps, query_pre_attn_scalar and hidden_act (Gemma 2's,
    and Qwen2/3's per-layer window), as transformers 5 derives them when a config.json
    (older exports) lacks `layer_types`."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types:
        if len(types) != n or any(t not in _LAYER_TYPES for t in types):
            raise ValueError(f"{arch}: layer_types must list {n} of {_LAYER_TYPES}, got {types}")
        types = tuple(types)
    elif arch == "Gemma2ForCausalLM":        # local (sliding) first, then global, alternating
        types = tuple(_LAYER_TYPES[i % 2] for i in range(n))
    elif arch in _OPT_IN_WINDOW and sliding is not None:
        first = d.get("max_window_layers", 28)
        types = tuple(_LAYER_TYPES[0] if i >= first else _LAYER_TYPES[1] for i in range(n))
    else:
        types = ()
    if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, int) or sliding < 1):
        raise ValueError(f"{arch}: sliding_window must be a positive integer or null, got {sliding!r}")
    fields = dict(layer_types=types, hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu")
    if arch == "Gemma2ForCausalLM":          # absent keys: transformers' Gemma2Config defaults
        fields.update(attn_logit_softcapping=d.get("attn_logit_softcapping", 50.0),
                      final_logit_softcapping=d.get("final_logit_softcapping", 30.0),
                      query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256))
    return fields


def _moe_fields(d: dict, arch: str) -> dict:
    """The MoE fields of a Mixtral / Qwen3-MoE config.json (transformers 5 writes
    num_local_experts for both; Qwen3-MoE hub configs say num_experts)."""
    # Absent keys take transformers' MixtralConfig / Qwen3MoeConfig defaults.
    if arch == "MixtralForCausalLM":       # experts as wide as intermediate_size, always renormalized
        return dict(num_experts=d.get("num_local_experts", 8), num_experts_per_tok=d.get("num_experts_per_tok", 2),
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
    if arch == "Qwen3MoeForCausalLM":
        experts = d.get("num_experts", d.get("num_local_experts", 128))
        step, dense_only = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(d["num_hidden_layers"])
                      if i in dense_only or not (experts > 0 and (i + 1) % step == 0))
        return dict(num_experts=experts, num_experts_per_tok=d.get("num_experts_per_tok", 8),
                    moe_intermediate_size=d.get("moe_intermediate_size", 768),
                    norm_topk_prob=bool(d.get("norm_topk_prob", False)), dense_mlp_layers=dense)
    return {}
