"""Model and hardware descriptions for the simulator's cost model.

Pure data plus the few derived sizes the cost model needs (parameter counts,
weight bytes, KV bytes per token). Built-in specs live in ``MODELS`` and
``HARDWARE``; look them up with ``get_model`` / ``get_hardware`` (case-insensitive).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by its published config.

    ``gated_mlp=True`` is a SwiGLU MLP (gate, up, down: 3 matrices of
    hidden x intermediate); ``False`` is OPT's fc1/fc2 (2 matrices).
    ``linear_bias`` adds OPT's biases and LayerNorm shifts (~0.1% of the
    parameters, kept so ``num_params`` matches the published totals).
    ``learned_pos_embeddings`` is the size of OPT's position table (0 for RoPE).

    Family extras (the defaults describe Llama/OPT, so older specs are unchanged):
    ``qk_norm`` is Qwen3's RMSNorm over every head's q and k (2 * head_dim weights
    per layer); ``norms_per_layer`` counts the block's RMSNorms (Gemma 2 has 4: before
    and after attention and the MLP). ``sliding_window`` > 0 is local attention over
    that many tokens in ``num_sliding_layers`` of the layers (Gemma 2: every other
    layer; Mistral-7B-v0.1: all): their KV stops growing at the window (``kv_bytes``).
    ``num_experts`` > 0 makes every layer's MLP a mixture of experts: a router
    (hidden x num_experts) picks ``num_experts_per_tok`` experts per token, and each
    expert is a gated MLP of width ``intermediate_size``. Memory holds all experts
    (``num_params``); a token computes only its top-k (``num_active_params``).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2
    gated_mlp: bool = True
    tie_embeddings: bool = False
    linear_bias: bool = False
    learned_pos_embeddings: int = 0
    hf_id: str = ""  # Hugging Face repo id, also accepted by get_model
    qk_norm: bool = False
    norms_per_layer: int = 2
    sliding_window: int = 0  # 0: every layer attends to the whole context
    num_sliding_layers: int = 0
    num_experts: int = 0  # 0: a dense MLP
    num_experts_per_tok: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.sliding_window < 0 or not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(
                f"{self.name}: sliding_window={self.sliding_window} and num_sliding_layers="
                f"{self.num_sliding_layers} must be >= 0, the latter at most num_layers={self.num_layers}"
            )
        if bool(self.sliding_window) != bool(self.num_sliding_layers):
            raise ValueError(
                f"{self.name}: sliding_window={self.sliding_window} needs num_sliding_layers > 0 "
                f"(and num_sliding_layers={self.num_sliding_layers} a window), or both 0"
            )
        if self.num_experts or self.num_experts_per_tok:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"{self.name}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if not self.gated_mlp or self.linear_bias:
                raise ValueError(f"{self.name}: experts are gated MLPs without biases")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # --- parameter counts -------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attn_params_per_layer(self) -> int:
        """q, k, v and o projections (Phi-3's fused qkv has the same count)."""
        h = self.hidden_size
        return h * self.q_size + 2 * h * self.kv_size + self.q_size * h

    def expert_params(self) -> int:
        """One MLP: the dense one, or one expert of an MoE layer."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts

    def matmul_params_per_layer(self) -> int:
        """Weights of the linear layers in one block (every expert's: what memory holds)."""
        experts = self.num_experts if self.is_moe else 1
        return self.attn_params_per_layer() + self.router_params_per_layer() + experts * self.expert_params()

    def active_matmul_params_per_layer(self) -> int:
        """The linear weights one token multiplies by: attention, the router and its
        top-k experts (the whole block for a dense model)."""
        if not self.is_moe:
            return self.matmul_params_per_layer()
        return (self.attn_params_per_layer() + self.router_params_per_layer()
                + self.num_experts_per_tok * self.expert_params())

    def norm_params_per_layer(self) -> int:
        if self.linear_bias:  # LayerNorm weight + bias
            return 2 * 2 * self.hidden_size
        return self.norms_per_layer * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def params_per_layer(self) -> int:
        n = self.matmul_params_per_layer() + self.norm_params_per_layer()
        h = self.hidden_size
        if self.linear_bias:  # a bias per linear output
            n += self.q_size + 2 * self.kv_size + h  # q, k, v, o biases
            n += self.intermediate_size * (2 if self.gated_mlp else 1) + h  # mlp biases
        return n

    def lm_head_params(self) -> int:
        """The logits projection; it is a GEMM even when tied to the embedding."""
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        h = self.hidden_size
        embed = self.vocab_size * h + self.learned_pos_embeddings * h
        lm_head = 0 if self.tie_embeddings else self.lm_head_params()
        final_norm = 2 * h if self.linear_bias else h
        return self.num_layers * self.params_per_layer() + embed + lm_head + final_norm

    def num_active_params(self) -> int:
        """Parameters one token uses: num_params less the experts it is not routed to."""
        idle = self.num_experts - self.num_experts_per_tok if self.is_moe else 0
        return self.num_params() - self.num_layers * idle * self.expert_params()

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Distinct experts one MoE layer runs for a batch of ``num_tokens`` tokens, in
        expectation under uniform routing: E * (1 - (1 - k/E)^B). Each token picks k of
        the E experts, so a given expert is missed by one token with probability 1 - k/E
        (treating tokens as independent). 0 for a dense model."""
        if not self.is_moe or num_tokens <= 0:
            return 0.0
        e = self.num_experts
        return e * (1.0 - (1.0 - self.num_experts_per_tok / e) ** num_tokens)

    # --- bytes --------------------------------------------------------------

    def weight_bytes(self) -> int:
        return self.num_params() * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype_bytes.
        This is a token's cost while the context is within any sliding window (and
        what a paged allocator that keeps every block reserves per token)."""
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes

    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes of one sequence of ``num_tokens`` tokens, sliding-window layers
        holding at most their window: per layer 2 * kv_heads * head_dim * dtype_bytes
        * min(num_tokens, window) (the whole num_tokens for global layers)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        per_layer_token = 2 * self.kv_size * self.dtype_bytes
        local = self.num_sliding_layers
        return per_layer_token * ((self.num_layers - local) * num_tokens
                                  + local * min(num_tokens, self.sliding_window))


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (one TP rank). Bandwidths in bytes/s, FLOP/s dense (no sparsity).

    ``peak_flops`` is the dense fp16/bf16 tensor-core peak; ``interconnect_bandwidth``
    is NVLink per direction (what a ring all-reduce step uses); ``pcie_bandwidth``
    is host<->device per direction (what KV swapping uses). Figures are datasheet
    peaks: the cost model's efficiency factors turn them into achieved rates.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: int
    interconnect_bandwidth: float
    pcie_bandwidth: float
    notes: str = ""


# --- built-in models ---------------------------------------------------------
# OPT: Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models",
# Table 1, and the facebook/opt-* configs (ffn_dim = 4h, vocab 50272, 2048 positions,
# position table has 2 extra rows, tied lm_head, biases everywhere).
# Llama 2: Touvron et al. 2023 and the meta-llama/Llama-2-*-hf configs.
# Llama 3: meta-llama/Meta-Llama-3-8B config.json.
# SmolLM2: HuggingFaceTB/SmolLM2-135M config.json (also the GGUF we ship:
# 134,515,008 parameters, which num_params() reproduces exactly).


def _opt(name: str, layers: int, hidden: int, heads: int, hf_id: str) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=4 * hidden,
        vocab_size=50272, max_model_len=2048, gated_mlp=False, tie_embeddings=True,
        linear_bias=True, learned_pos_embeddings=2048 + 2, hf_id=hf_id,
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int,
           intermediate: int, vocab: int, max_len: int, hf_id: str,
           tie: bool = False) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
        vocab_size=vocab, max_model_len=max_len, tie_embeddings=tie, hf_id=hf_id,
    )


def _hf(name: str, hf_id: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
        intermediate: int, vocab: int, max_len: int, **extra) -> ModelSpec:
    """A spec written as the HF config's fields (head_dim explicit: Gemma's is not hidden/heads)."""
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab, max_model_len=max_len,
        hf_id=hf_id, **extra,
    )


# The families added for issue 31. Each row is the repo's config.json (bf16 weights), in
# _hf's argument order: num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, head_dim (hidden/heads where the config has none), intermediate_size
# (MoE: moe_intermediate_size for Qwen3-MoE, intermediate_size for Mixtral: one expert's
# width), vocab_size, max_position_embeddings; then tie_word_embeddings, sliding_window
# (+ which layers use it) and num_experts / num_local_experts, num_experts_per_tok.
# tests/core/cost/test_specs.py rebuilds each config with transformers' config class and
# counts the parameters of the model it builds (on the meta device): num_params() equals it.
_FAMILIES = (
    # Qwen/Qwen3-8B, Qwen/Qwen3-32B: q/k RMSNorm per head, untied, no biases.
    _hf("Qwen3-8B", "Qwen/Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, 40960, qk_norm=True),
    _hf("Qwen3-32B", "Qwen/Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, 40960, qk_norm=True),
    # Qwen/Qwen3-30B-A3B: 128 experts of moe_intermediate_size 768, top-8, every layer sparse
    # (decoder_sparse_step 1, mlp_only_layers []), so the config's dense intermediate_size
    # (6144) is unused; no shared expert.
    _hf("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 768, 151936, 40960,
        qk_norm=True, num_experts=128, num_experts_per_tok=8),
    # google/gemma-2-9b, google/gemma-2-27b: head_dim 256 / 128, tied embeddings, 4 norms a
    # layer, sliding_window 4096 on every other layer (layer_types: even layers local).
    # Logit soft-capping (attn 50, final 30), GeGLU and the embedding scale add no
    # parameters and only elementwise work: left out of the cost.
    _hf("Gemma-2-9B", "google/gemma-2-9b", 42, 3584, 16, 8, 256, 14336, 256000, 8192,
        tie_embeddings=True, norms_per_layer=4, sliding_window=4096, num_sliding_layers=21),
    _hf("Gemma-2-27B", "google/gemma-2-27b", 46, 4608, 32, 16, 128, 36864, 256000, 8192,
        tie_embeddings=True, norms_per_layer=4, sliding_window=4096, num_sliding_layers=23),
    # microsoft/Phi-3-mini-4k-instruct: fused qkv_proj and gate_up_proj (same counts as
    # separate matrices), sliding_window 2047 on all layers, 3,821,079,552 parameters.
    _hf("Phi-3-mini-4k", "microsoft/Phi-3-mini-4k-instruct", 32, 3072, 32, 32, 96, 8192, 32064, 4096,
        sliding_window=2047, num_sliding_layers=32),
    # mistralai/Mistral-7B-v0.1: sliding_window 4096 on all layers; v0.3: no window
    # (sliding_window null), vocab 32768.
    _hf("Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, 32768,
        sliding_window=4096, num_sliding_layers=32),
    _hf("Mistral-7B-v0.3", "mistralai/Mistral-7B-v0.3", 32, 4096, 32, 8, 128, 14336, 32768, 32768),
    # mistralai/Mixtral-8x7B-v0.1: num_local_experts 8, top-2, experts of width 14336,
    # sliding_window null.
    _hf("Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, 32768,
        num_experts=8, num_experts_per_tok=2),
)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _opt("OPT-13B", 40, 5120, 40, "facebook/opt-13b"),
        _opt("OPT-66B", 64, 9216, 72, "facebook/opt-66b"),
        _opt("OPT-175B", 96, 12288, 96, ""),  # weights by request only, no HF repo
        _llama("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000, 4096, "meta-llama/Llama-2-7b-hf"),
        _llama("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000, 4096, "meta-llama/Llama-2-13b-hf"),
        _llama("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000, 4096, "meta-llama/Llama-2-70b-hf"),
        _llama("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192, "meta-llama/Meta-Llama-3-8B"),
        # Llama 3.1: the same network with a 128K context (meta-llama/Llama-3.1-8B config.json);
        # long-prompt traces (Mooncake) need it.
        _llama("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072, "meta-llama/Llama-3.1-8B"),
        _llama("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, "HuggingFaceTB/SmolLM2-135M",
               tie=True),
        *_FAMILIES,
    )
}

# --- built-in hardware (SXM parts) --------------------------------------------
# Sources: NVIDIA A100 datasheet (312 TFLOPS bf16 dense; 1,555 GB/s for 40GB,
# 2,039 GB/s for 80GB; NVLink3 600 GB/s total = 300 GB/s per direction; PCIe Gen4
# x16 = 32 GB/s per direction), H100 SXM datasheet (989 TFLOPS bf16 dense,
# 3.35 TB/s, NVLink4 900 GB/s total = 450 per direction, PCIe Gen5 = 64 GB/s),
# H200 datasheet (same compute as H100, 4.8 TB/s, 141 GB). HBM capacities are
# binary sizes (torch reports slightly less, the driver keeps ~0.5-1 GiB).

HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec("A100-40G", 312e12, 1555e9, 40 * GiB, 300e9, 32e9),
        HardwareSpec("A100-80G", 312e12, 2039e9, 80 * GiB, 300e9, 32e9),
        HardwareSpec("H100", 989e12, 3.35e12, 80 * GiB, 450e9, 64e9, notes="SXM5"),
        HardwareSpec("H200", 989e12, 4.8e12, 141 * GiB, 450e9, 64e9, notes="SXM"),
        # Rough: the 2-vCPU AMD EPYC (Zen 3, AVX2, no native bf16) dev/CI box,
        # measured with numpy: fp32 SGEMM ~195 GFLOP/s, copy ~37 GB/s (read+write).
        # Torch bf16/fp16 on this CPU is slower than fp32, so run the real model in
        # fp32 (dataclasses.replace(spec, dtype_bytes=4)) when comparing. mem_bytes
        # is a budget for the engine on a shared 24 GiB box, not the RAM size;
        # "interconnect" and "PCIe" are both plain memcpy here.
        HardwareSpec("cpu-2core", 2e11, 30e9, 8 * GiB, 15e9, 15e9,
                     notes="rough; measured order of magnitude only"),
    )
}


def _lookup(kind: str, registry: dict, name: str, aliases: dict[str, str]):
    key = name.strip().lower()
    for canonical, spec in registry.items():
        if key == canonical.lower():
            return spec
    if key in aliases:
        return registry[aliases[key]]
    raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(registry)}")


def get_model(name: str) -> ModelSpec:
    """Built-in model by name (case-insensitive) or Hugging Face repo id."""
    hf_ids = {m.hf_id.lower(): m.name for m in MODELS.values() if m.hf_id}
    return _lookup("model", MODELS, name, hf_ids)


def get_hardware(name: str) -> HardwareSpec:
    """Built-in hardware by name (case-insensitive)."""
    return _lookup("hardware", HARDWARE, name, {})
