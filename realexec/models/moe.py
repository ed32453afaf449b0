"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE on the Llama-family stack.

Each sparse layer replaces the dense MLP with a router (a linear map to one logit per
expert; softmax in fp32, the top-k experts by probability, their weights renormalized to
sum to 1 where the family does: Mixtral always, Qwen3-MoE per `norm_topk_prob`) and E
experts, each a SwiGLU MLP. Everything else (attention, Qwen3's q/k norm, rotary, norms,
embeddings, TP/PP) is LlamaForCausalLM's.

Compute, grouped by expert: the (token, expert) pairs are sorted by expert, each expert
that got any runs once over its contiguous rows, and one index_add sums the weighted
outputs back per token (a loop over the experts hit, none over tokens). That needs the
per-expert counts on the host, which a captured CUDA graph or a torch.compile trace
cannot have; there (decode) every expert runs over every token and the routing weights,
zero for the experts not chosen, mask the sum: more FLOPs, the same weight reads once a
batch hits every expert, and no host sync.

Tensor parallelism shards each expert's intermediate dimension: gate/up are
column-parallel (rank r holds rows [r*I/tp, (r+1)*I/tp) of each), down is row-parallel
(the matching columns). The router is replicated (every rank sees the same hidden state
after the attention all-reduce, so all route alike), each rank sums its partial expert
outputs locally, and the layer does one all-reduce, like the dense MLP.

Checkpoint names (HF safetensors): Qwen3-MoE `mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`
are ours; Mixtral's `block_sparse_moe.gate`, `block_sparse_moe.experts.N.{w1,w3,w2}` are
renamed to them. transformers 5's fused expert tensors (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]) are split per expert.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from realexec.distributed import PPGroup, TPGroup
from . import cpu_ops
from .config import ModelConfig
from .linear import Linear
from .llama import LlamaForCausalLM


class Expert(nn.Module):
    """One SwiGLU expert (this rank's slice of its intermediate dimension); its down
    projection is not reduced here: the MoE block all-reduces the sum over experts once."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * width, bias=False)
        self.down_proj = Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(cpu_ops.silu_and_mul(self.gate_up_proj(x)))    # fused on the CPU in fp32


def _graph_safe(x: torch.Tensor) -> bool:
    """Inside a torch.compile trace or a CUDA graph capture (no host syncs allowed)."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, weights_in_model_dtype: bool):
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k, self.norm_topk_prob = (
            cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        # Mixtral multiplies expert outputs by fp32 weights; Qwen3-MoE casts the weights to
        # the model dtype first (the same in fp32; the reference's rounding in half precision).
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size // tp.size)
                                     for _ in range(cfg.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k]): the top-k experts of each token."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_model_dtype else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.all_experts(x, weights, ids) if _graph_safe(x) else self.grouped(x, weights, ids)
        return self.tp.all_reduce(out)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert over just the tokens routed to it (one host sync for the counts)."""
        flat = ids.reshape(-1)                                  # [T*k] expert of each pair
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k                             # token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                ys[start:start + count] = expert(xs[start:start + count])
                start += count
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, masked by its routing weight (0 where not chosen):
        fixed shapes, no host sync (CUDA graphs, torch.compile)."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * dense[:, e:e + 1]).to(x.dtype)
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose sparse layers' MLP is a SparseMoeBlock (`layer.mlp`; dense
    layers, Qwen3-MoE's mlp_only_layers, keep the Llama MLP of `intermediate_size`)."""

    weights_in_model_dtype = False

    def __init__(self, cfg: ModelConfig, attn_backend: str | object = "torch", max_position: int | None = None,
                 tp: TPGroup | None = None, pp: PPGroup | None = None):
        if cfg.num_experts < 1 or not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"{cfg.architecture}: needs num_experts >= 1 and 1 <= num_experts_per_tok <= "
                             f"num_experts, got {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}")
        if cfg.mlp_bias:
            raise ValueError(f"{cfg.architecture}: expert MLPs with biases are not supported")
        super().__init__(cfg, attn_backend=attn_backend, max_position=max_position, tp=tp, pp=pp)
        for index, layer in zip(self.pp.layers, self.layers):
            if index not in cfg.dense_mlp_layers:
                layer.mlp = SparseMoeBlock(cfg, self.tp, self.weights_in_model_dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors under our names, fused expert tensors split per expert."""
        for name, tensor in weights:
            name = self.hf_to_ours(name)
            fused = _FUSED.search(name)
            if fused is None:
                yield name, tensor
                continue
            base, kind = name[:fused.start()], fused.group(1)
            if tensor.dim() != 3 or tensor.shape[0] != self.config.num_experts:
                raise ValueError(f"{name}: expected [num_experts={self.config.num_experts}, ...], "
                                 f"got shape {tuple(tensor.shape)}")
            for e in range(tensor.shape[0]):
                if kind == "gate_up_proj":       # [2I, H]: gate rows, then up rows
                    gate, up = tensor[e].chunk(2, dim=0)
                    yield f"{base}.experts.{e}.gate_proj.weight", gate
                    yield f"{base}.experts.{e}.up_proj.weight", up
                else:
                    yield f"{base}.experts.{e}.down_proj.weight", tensor[e]

    @staticmethod
    def hf_to_ours(name: str) -> str:
        return name

    def _shard(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if ".experts." in name:                  # an expert's gate_up_proj: [gate; up] rows
            return param.chunk(2, dim=0)[shard]
        return super()._shard(param, name, shard)


# A transformers-5 fused expert tensor: "<layer>.mlp.experts.gate_up_proj" (no ".weight").
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_W = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(MoEForCausalLM):
    weights_in_model_dtype = False

    @staticmethod
    def hf_to_ours(name: str) -> str:
        name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_MIXTRAL_W[m.group(2)]}.", name)
        return name.replace(".block_sparse_moe.", ".mlp.")


class Qwen3MoeForCausalLM(MoEForCausalLM):
    weights_in_model_dtype = True
