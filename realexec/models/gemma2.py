"""Gemma 2 (`Gemma2ForCausalLM`) on the Llama-family stack.

What differs from Llama (transformers' modeling_gemma2 is the reference):
- attention scale query_pre_attn_scalar ** -0.5, scores soft-capped (c * tanh(s / c),
  c = attn_logit_softcapping) and every other layer local: layers 0, 2, ... attend to the
  last sliding_window positions, the others to everything (ModelConfig.layer_types);
  the attention backends do both (realexec.attention), llama.Attention passes them;
- GeGLU MLP: gelu (tanh approximation, `gelu_pytorch_tanh`) instead of silu;
- four RMSNorms per layer: before and after attention, before and after the MLP (the
  "post" norms apply to the sublayer's output before the residual add);
- RMSNorm scales by (1 + weight), in fp32, then casts (Gemma's zero-centred weights);
- embeddings multiplied by sqrt(hidden_size) (rounded to the model dtype, as HF does);
- final logits soft-capped with final_logit_softcapping; the LM head is tied to the
  embedding (hub configs omit tie_word_embeddings; ModelConfig defaults it to true).

Tensor and pipeline parallelism, loading and the paged cache are LlamaForCausalLM's; the
checkpoint names are HF's (`pre_feedforward_layernorm`, `post_feedforward_layernorm`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from realexec.attention import AttentionMetadata
from realexec.distributed import PPGroup, TPGroup
from .config import ModelConfig
from .llama import MLP, Attention, KVCache, LlamaForCausalLM

# HF activation name -> F.gelu's `approximate`
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and cast back (HF Gemma2RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GeGLUMLP(MLP):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__(cfg, tp)
        if cfg.hidden_act not in _GELU:
            raise ValueError(f"{cfg.architecture}: hidden activation {cfg.hidden_act!r} is not supported "
                             f"(supported: {', '.join(_GELU)})")
        self.approximate = _GELU[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, tp: TPGroup, layer_idx: int = 0):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, backend, tp, layer_idx)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GeGLUMLP(cfg, tp)
        self.post_feedforward_layernorm = norm()

    def forward(self, h, cos, sin, kv_cache, md):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, md))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma2DecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, attn_backend: str | object = "torch", max_position: int | None = None,
                 tp: TPGroup | None = None, pp: PPGroup | None = None):
        if cfg.attention_bias or cfg.mlp_bias:
            raise ValueError(f"{cfg.architecture}: attention or MLP biases are not supported")
        super().__init__(cfg, attn_backend=attn_backend, max_position=max_position, tp=tp, pp=pp)
        self._embed_scale: dict[torch.dtype, float] = {}

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded to `dtype` (HF multiplies by a tensor of the weights' dtype)."""
        if dtype not in self._embed_scale:
            self._embed_scale[dtype] = float(torch.tensor(self.config.hidden_size ** 0.5, dtype=dtype))
        return self._embed_scale[dtype]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache] | None, attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """LlamaForCausalLM.forward with the embeddings scaled by sqrt(hidden_size)."""
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids)
            h = h * self.embed_scale(h.dtype)
        else:
            h = hidden_states
        cos, sin = self.rotary_emb(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_caches[i] if kv_caches is not None else None, attn_metadata)
        return self.norm(h) if self.norm is not None else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Llama's logits (fp32), soft-capped by final_logit_softcapping."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


__all__ = ["Gemma2ForCausalLM", "GemmaRMSNorm"]
