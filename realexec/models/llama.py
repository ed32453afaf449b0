"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) on our paged attention.

One flat batch per step: `input_ids`/`positions` are [T] (the new tokens of every
scheduled sequence, concatenated); attention reads/writes the paged KV cache through
`AttentionMetadata`. Projections are fused (qkv, gate+up); `load_weights` stacks the
separate Hugging Face tensors into them.

Tensor parallelism (Megatron style) over a `TPGroup` of `tp` ranks: qkv and gate+up are
column-parallel (each rank holds num_heads/tp query heads, num_kv_heads/tp KV heads and
intermediate/tp MLP columns; its KV cache holds only its KV heads), o_proj and down_proj
are row-parallel (partial sums, all-reduced, bias added once), the embedding and the LM
head are vocab-parallel (each rank holds vocab/tp rows; embeddings all-reduced, logits
gathered on the driver). `load_weights` cuts each rank's slice from the full checkpoint.

Pipeline parallelism over a `PPGroup`: a stage builds only its decoder layers (a
contiguous range; `layers[i]` is global layer `pp.layers.start + i`); the first stage
also owns the embedding, the last the final norm and the LM head (for tied embeddings
the last stage keeps its own copy of the embedding matrix as the head). `forward` takes
the previous stage's hidden state instead of token ids on later stages and returns the
un-normed hidden state on earlier ones. Checkpoint tensors of other stages are skipped.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from realexec.attention import AttentionMetadata, get_attention_backend
from realexec.distributed import PPGroup, TPGroup
from . import cpu_ops
from .config import ModelConfig
from .linear import Linear, packed_parameter, project

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, scale in the model dtype (same rounding as the HF reference);
        # one fused C++ pass on the CPU in fp32 (realexec.models.cpu_ops).
        return cpu_ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, self(h + delta)): the residual add and this norm in one pass on the CPU."""
        return cpu_ops.add_rms_norm(h, delta, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
        # between them interpolated smoothly.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":
        # Its short regime (realexec.models.config._longrope), in HF's order of operations.
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_position, computed once (fp32)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self, device=None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        freqs = torch.arange(self.max_position, dtype=torch.float32, device=device)[:, None] * inv_freq
        scale = (self.scaling or {}).get("attention_factor", 1.0)     # LongRoPE scales cos and sin
        return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)    # [max_position, head_dim]

    def reset_table(self) -> None:
        """Recompute the table in place (after the module was materialized from meta)."""
        self.cos_sin = self._table(self.cos_sin.device).to(self.cos_sin.dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin[positions].to(dtype).chunk(2, dim=-1)   # [T, D/2] each
        return cos[:, None, :], sin[:, None, :]


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input features are split over ranks."""

    projects = True     # pack_weights packs this module's weight

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_parameter("weight_packed", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return project(x, self.weight, self.bias, self.weight_packed)
        y = self.tp.all_reduce(project(x, self.weight, None, self.weight_packed))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank + 1) * V/tp) of the (padded) vocabulary on each rank."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, tp: TPGroup, layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads // tp.size, cfg.num_key_value_heads // tp.size, cfg.head_dim)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # This layer's window / soft cap, passed to the backend only when set.
        self.attn_opts = {k: v for k, v in (("sliding_window", cfg.sliding_window_for(layer_idx)),
                                            ("logits_soft_cap", cfg.attn_logit_softcapping)) if v is not None}
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(self.q_size * tp.size, cfg.hidden_size, cfg.o_proj_bias, tp)
        self.backend = backend
        # Qwen3: RMSNorm over each head's dims (one weight shared by all heads) before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    # Three pieces, callable apart (realexec.worker.piecewise_graph captures qkv and o_proj
    # in CUDA graphs and runs attend eagerly between them): forward = o_proj(attend(qkv)).
    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> q [T, heads, D], k and v [T, kv_heads, D]: the projection, Qwen3's
        q/k norm and the rotary embedding."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = cpu_ops.apply_rotary_qk(q, k, cos, sin)     # apply_rotary to both (one C++ call on the CPU)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache | None,
               md: AttentionMetadata) -> torch.Tensor:
        """The backend's paged attention (writes k, v to the cache) -> [T, q_size], before o_proj."""
        k_cache, v_cache = kv_cache if kv_cache is not None else (None, None)
        out = self.backend.forward(q, k, v, k_cache, v_cache, md, self.scale, **self.attn_opts)
        return out.reshape(q.shape[0], self.q_size)

    def forward(self, x, cos, sin, kv_cache: KVCache | None, md: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(*self.qkv(x, cos, sin), kv_cache, md))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        width = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(cpu_ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, tp: TPGroup, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    # The layer around its attention call, in two halves (realexec.worker.piecewise_graph
    # captures them; `forward` is the one path through them).
    def pre_attention(self, h, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream h [T, hidden] -> (q, k, v) of attention's input norm(h)."""
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def post_attention(self, h, attn: torch.Tensor) -> torch.Tensor:
        """h and attention's output [T, q_size] (before o_proj) -> the layer's output stream."""
        # h = h + o_proj(attn); x = post_norm(h): the add and the norm fused on the CPU
        h, x = self.post_attention_layernorm.add_forward(h, self.self_attn.o_proj(attn))
        return h + self.mlp(x)

    def forward(self, h, cos, sin, kv_cache, md):
        q, k, v = self.pre_attention(h, cos, sin)
        return self.post_attention(h, self.self_attn.attend(q, k, v, kv_cache, md))


# HF checkpoint name -> (our fused parameter, shard index) for the stacked projections.
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls = DecoderLayer
    norm_cls = RMSNorm

    def __init__(self, cfg: ModelConfig, attn_backend: str | object = "torch", max_position: int | None = None,
                 tp: TPGroup | None = None, pp: PPGroup | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPGroup()
        self.pp = pp = pp or PPGroup(layers=range(cfg.num_hidden_layers))
        backend = get_attention_backend(attn_backend) if isinstance(attn_backend, str) else attn_backend
        vocab = lambda: VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)  # noqa: E731
        self.embed_tokens = vocab() if pp.is_first else None
        # decoder_layer_cls / norm_cls: hooks for families with other layers (Gemma 2)
        self.layers = nn.ModuleList(self.decoder_layer_cls(cfg, backend, tp, i) for i in pp.layers)
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last else None
        self.rotary_emb = RotaryEmbedding(cfg.rotary_dim, max_position or cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_scaling)
        # Tied models have no lm_head (logits use the embedding matrix), unless the
        # embedding lives on another stage: then the last stage loads its own copy.
        untied_head = not cfg.tie_word_embeddings or not pp.is_first
        self.lm_head = vocab() if pp.is_last and untied_head else None
        self.register_parameter("head_packed", None)      # the LM head packed for the CPU (pack_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache] | None, attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]: final-norm on the last
        stage, the residual stream to hand on elsewhere. Later stages start from the
        previous stage's `hidden_states` (input_ids unused). kv_caches: one (k_cache,
        v_cache) per layer of this stage, or None for a cache-less run over whole prompts."""
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden_states
        cos, sin = self.rotary_emb(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_caches[i] if kv_caches is not None else None, attn_metadata)
        return self.norm(h) if self.norm is not None else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (usually one row per sequence) -> fp32 logits [N, vocab]
        (under tensor parallelism: on the driver rank; None on the others). Last stage only."""
        if not self.pp.is_last:
            raise RuntimeError(f"pipeline stage {self.pp.rank} has no LM head (only the last stage samples)")
        logits = self.tp.gather_last_dim(project(hidden, self.head_weight(), None, self.head_packed).float())
        if logits is not None and logits.shape[-1] != self.config.vocab_size:
            logits = logits[:, :self.config.vocab_size]      # the padding rows of the last shard
        return logits

    def head_weight(self) -> torch.Tensor | None:
        """The LM head's dense rows (the embedding table of a tied model); None off the last stage."""
        if not self.pp.is_last:
            return None
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_head(self, min_rows: int, gemm: str = "onednn") -> int:
        """Add the LM head's copy packed by `gemm` for the CPU (realexec.models.linear), used
        from `min_rows` rows; -> bytes added."""
        self.head_packed = packed_parameter(self.head_weight(), min_rows, gemm)
        return self.head_packed.numel() * self.head_packed.element_size()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...) into our
        parameters; raises if any parameter (or fused shard) was left unset."""
        params = dict(self.named_parameters())
        expected = {name: 1 for name in params}
        for name in params:
            if ".qkv_proj." in name:
                expected[name] = 3
            elif ".gate_up_proj." in name:
                expected[name] = 2
        seen: dict[str, set] = {}
        for hf_name, tensor in self._unfused(weights):
            name = self._local_name(hf_name.removeprefix("model."))
            if name is None:
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in _STACKED:
                fused, shard = _STACKED[parts[-2]]
                name = ".".join(parts[:-2] + [fused, parts[-1]])
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            dest = params[name]
            if shard is not None:
                dest = self._shard(dest, name, shard)
            tensor = self._rank_slice(name, shard, tensor)
            if name in ("embed_tokens.weight", "lm_head.weight") and dest.shape[0] != tensor.shape[0]:
                dest[tensor.shape[0]:].zero_()                   # vocab padding rows of the last shard
                dest = dest[:tensor.shape[0]]
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            dest.copy_(tensor)
            seen.setdefault(name, set()).add(shard)
        missing = [n for n, count in expected.items() if len(seen.get(n, ())) != count]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoints that store qkv_proj / gate_up_proj fused (Phi-3) as the separate
        q/k/v and gate/up tensors, so that tensor parallelism cuts each one's rows."""
        cfg = self.config
        for hf_name, tensor in weights:
            module, _, kind = hf_name.rpartition(".")          # kind: weight | bias
            prefix, _, proj = module.rpartition(".")
            if proj == "qkv_proj":
                sizes, names = [cfg.q_size, cfg.kv_size, cfg.kv_size], ("q_proj", "k_proj", "v_proj")
            elif proj == "gate_up_proj":
                sizes, names = [cfg.intermediate_size] * 2, ("gate_proj", "up_proj")
            else:
                yield hf_name, tensor
                continue
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} has {tensor.shape[0]} rows, "
                                 f"expected {' + '.join(map(str, sizes))}")
            for part, piece in zip(names, tensor.split(sizes, dim=0)):
                yield f"{prefix}.{part}.{kind}", piece

    def holds(self, hf_name: str) -> bool:
        """Whether this rank keeps checkpoint tensor `hf_name` (the loader skips the others
        without reading them)."""
        return self._local_name(hf_name.removeprefix("model.")) is not None

    def _local_name(self, name: str) -> str | None:
        """A checkpoint name as this stage's parameter name (layers renumbered from the
        stage's first); None for a tensor this stage does not hold."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            local = int(index) - self.pp.layers.start
            return f"layers.{local}.{rest}" if 0 <= local < len(self.pp.layers) else None
        if name == "embed_tokens.weight":
            if self.embed_tokens is None and self.lm_head is not None and self.config.tie_word_embeddings:
                return "lm_head.weight"            # the last stage's copy of a tied embedding
            return name if self.embed_tokens is not None else None
        if name == "lm_head.weight":
            return name if self.lm_head is not None and not self.config.tie_word_embeddings else None
        if name.startswith("norm."):
            return name if self.norm is not None else None
        return name

    def _shard(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """The rows of a fused parameter that hold one stacked projection (this rank's part)."""
        cfg, tp = self.config, self.tp.size
        if ".qkv_proj." in name:
            sizes = [cfg.q_size // tp, cfg.kv_size // tp, cfg.kv_size // tp]
        else:
            sizes = [cfg.intermediate_size // tp] * 2
        return param.split(sizes, dim=0)[shard]

    def _rank_slice(self, name: str, shard: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor: output rows of column-parallel
        projections (per stacked projection), input columns of row-parallel weights, vocab
        rows of the embedding and LM head; norms and row-parallel biases are whole."""
        tp, rank = self.tp.size, self.tp.rank
        if tp == 1:
            return tensor
        if shard is not None:
            rows = tensor.shape[0] // tp
            return tensor[rank * rows:(rank + 1) * rows]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            cols = tensor.shape[1] // tp
            return tensor[:, rank * cols:(rank + 1) * cols]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            rows = -(-self.config.vocab_size // tp)
            return tensor[rank * rows:(rank + 1) * rows]
        return tensor

