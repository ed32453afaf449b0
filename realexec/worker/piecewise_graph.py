"""Mixed prefill+decode steps through piecewise CUDA graphs, attention eager between the pieces.

A step that mixes prefill chunks and decodes cannot replay one whole-model graph: the
attention kernels' launches depend on the batch's sequence layout (how many sequences,
their query lengths), which changes every step. Everything else in a decoder layer is
row-wise (projections, norms, rotary, MLP) and depends only on the token count. So the
model is cut at its attention calls into L + 1 pieces, captured once per token-count
bucket:

    piece 0      embedding, rotary cos/sin lookup, layer 0's pre-attention (norm, qkv, rotary)
    piece i      layer i-1's post-attention (o_proj, add + norm, MLP, residual), then layer
                 i's pre-attention; the last piece ends with the final norm instead

and a step of n tokens runs: copy ids/positions into static buffers padded to the bucket
b >= n (padding rows: token 0, position 0), replay piece 0, then per layer attention
eagerly over the first n rows only with the step's real metadata (so padding rows never
reach the KV cache and need no slots or sequences of their own), its output copied into
a static buffer whose rows n:b are zero, then replay the next piece. Each piece reads and
writes only static buffers (sized for the largest bucket, shared by all buckets), so the
pieces' intermediates live in one shared graph pool and are dead between replays.

On CPU, or without capture (`enforce_eager`), the very same padded, segmented path runs
eagerly, so the logic is tested everywhere; only capture/replay is CUDA-only. Decode-only
steps keep their full graphs (realexec.worker.cuda_graph), attention included.

Only models whose forward is LlamaForCausalLM's and whose layers are split around
attention (DecoderLayer.pre_attention / post_attention) and use a dense MLP get a runner
(`piecewise_unsupported` says why another does not): Gemma 2 overrides the forward and its
layers; a mixture-of-experts block would run every expert over every token under capture.
"""
from __future__ import annotations

import torch

from realexec.models.llama import MLP, LlamaForCausalLM

# The largest bucket: the engine's default token budget per step. Above it a step's GEMMs
# dwarf its kernel launches, and each bucket costs L + 1 captured graphs.
MAX_GRAPH_TOKENS = 2048


def token_buckets(max_tokens: int, cap: int = MAX_GRAPH_TOKENS) -> list[int]:
    """16, 32, 64, 128, 256, then steps of 256, up to min(max_tokens, cap) (always included)."""
    top = max(1, min(max_tokens, cap))
    sizes = [16, 32, 64, 128, 256] + list(range(512, top, 256))
    return sorted({s for s in sizes if s < top} | {top})


def piecewise_unsupported(model) -> str | None:
    """Why `model` cannot run piecewise (None: it can). The runner replays its own copy of
    LlamaForCausalLM.forward's structure, so it takes only models that run exactly that."""
    name = type(model).__name__
    if getattr(type(model), "forward", None) is not LlamaForCausalLM.forward:
        return f"{name}'s forward is not LlamaForCausalLM's"
    if model.pp.size != 1:
        return "pipeline parallelism (a stage's pieces would wait on another stage)"
    for layer in model.layers:
        if not (hasattr(layer, "pre_attention") and hasattr(layer, "post_attention")):
            return f"{name}'s {type(layer).__name__} is not split around attention"
        if not isinstance(layer.mlp, MLP):
            # e.g. SparseMoeBlock: routes with a host sync, or (under capture) runs every expert
            return f"{name}'s {type(layer.mlp).__name__} is not a dense MLP"
    return None


class PiecewiseGraphRunner:
    """Runs any step of up to `max_tokens` tokens (mixed, prefill or decode) through per-bucket
    piecewise graphs; `run` has the model's forward signature."""

    def __init__(self, model, *, max_tokens: int, device: torch.device, capture: bool,
                 buckets: list[int] | None = None):
        reason = piecewise_unsupported(model)
        if reason is not None:
            raise ValueError(f"no piecewise graphs: {reason}")
        self.model = model
        self.layers = list(model.layers)
        # `buckets` (benchmarks, tests): only these token counts instead of token_buckets'.
        self.buckets = sorted(set(buckets)) if buckets else token_buckets(max_tokens)
        self.device = device
        t = self.buckets[-1]
        attn = self.layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype
        zeros = lambda *shape, dtype=dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = zeros(t, dtype=torch.int64)
        self.positions = zeros(t, dtype=torch.int64)
        half = model.rotary_emb(self.positions[:1], dtype)[0].shape[-1]      # cos/sin width
        self.cos, self.sin = zeros(t, 1, half), zeros(t, 1, half)
        self.hidden = zeros(t, model.config.hidden_size)         # residual stream between pieces
        self.q = zeros(t, attn.num_heads, attn.head_dim)
        self.k = zeros(t, attn.num_kv_heads, attn.head_dim)
        self.v = zeros(t, attn.num_kv_heads, attn.head_dim)
        self.attn = zeros(t, attn.q_size)                        # attention output, rows n:b zero
        self.out = zeros(t, model.config.hidden_size)            # final-normed hidden states
        self.capture_enabled = capture and device.type == "cuda"
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"step of {n} tokens exceeds the largest piecewise bucket {self.max_tokens}")

    # -- the pieces: static buffers in, static buffers out ----------------------------------
    def _pre_attention(self, i: int, h: torch.Tensor, b: int) -> None:
        self.hidden[:b].copy_(h)
        q, k, v = self.layers[i].pre_attention(h, self.cos[:b], self.sin[:b])
        self.q[:b].copy_(q)
        self.k[:b].copy_(k)
        self.v[:b].copy_(v)

    def _piece(self, p: int, b: int) -> None:
        """Piece p over the first b rows of the buffers."""
        model = self.model
        if p == 0:
            h = model.embed_tokens(self.input_ids[:b])
            cos, sin = model.rotary_emb(self.positions[:b], h.dtype)
            self.cos[:b].copy_(cos)
            self.sin[:b].copy_(sin)
        else:
            h = self.layers[p - 1].post_attention(self.hidden[:b], self.attn[:b])
        if p < len(self.layers):
            self._pre_attention(p, h, b)
        else:
            self.out[:b].copy_(model.norm(h))

    # -- capture and run ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture each bucket's pieces (largest bucket first, one shared pool)."""
        if not self.capture_enabled:
            return
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            for _ in range(2):                      # settle the allocator and lazy inits
                for p in range(self.num_pieces):
                    self._piece(p, b)
            torch.cuda.synchronize()
            graphs = []
            for p in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(p, b)
                graphs.append(graph)
            self.graphs[b] = graphs
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, md) -> torch.Tensor:
        """The model's final-normed hidden states [n, H] for a step of n <= max_tokens tokens.
        kv_caches, md: as for the model's forward (md describes the n real rows only). The
        result is a view of a static buffer: valid until the next run."""
        n = input_ids.shape[0]
        if sum(md.query_lens_cpu) != n:
            raise ValueError(f"metadata covers {sum(md.query_lens_cpu)} tokens, the step has {n}")
        b = self.bucket_for(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            # Attention never writes rows n:b; zero them so the padding rows' pieces compute
            # the same finite values every step (no stale rows from an earlier, larger step).
            self.attn[n:b].zero_()
        graphs = self.graphs.get(b)
        for p in range(self.num_pieces):
            if p:
                i = p - 1
                out = self.layers[i].self_attn.attend(self.q[:n], self.k[:n], self.v[:n],
                                                      kv_caches[i] if kv_caches is not None else None, md)
                self.attn[:n].copy_(out)
            if graphs is not None:
                graphs[p].replay()
            else:
                self._piece(p, b)
        return self.out[:n]


def build_mixed_step_runner(model, *, max_tokens: int, device: torch.device, capture: bool,
                            buckets: list[int] | None = None) -> PiecewiseGraphRunner | None:
    """A captured (on CUDA, with `capture`) runner for `model`, or None when the model cannot
    run piecewise (it then runs its plain forward)."""
    if piecewise_unsupported(model) is not None:
        return None
    runner = PiecewiseGraphRunner(model, max_tokens=max_tokens, device=device, capture=capture, buckets=buckets)
    runner.capture()
    return runner
