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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    # --- parameter counts -------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def matmul_params_per_layer(self) -> int:
        """Weights of the linear layers in one block (what the GEMMs multiply by)."""
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h  # q, k, v, o
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return attn + mlp

    def params_per_layer(self) -> int:
        n = self.matmul_params_per_layer()
        h = self.hidden_size
        if self.linear_bias:  # LayerNorm weight + bias, and a bias per linear output
            n += 2 * 2 * h
            n += self.q_size + 2 * self.kv_size + h  # q, k, v, o biases
            n += self.intermediate_size * (2 if self.gated_mlp else 1) + h  # mlp biases
        else:  # RMSNorm weight only
            n += 2 * h
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

    # --- bytes --------------------------------------------------------------

    def weight_bytes(self) -> int:
        return self.num_params() * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes


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
