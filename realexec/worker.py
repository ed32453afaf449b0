"""Worker: owns one device, the model weights and the paged KV cache on it.

Lifecycle (driven by an executor through collective_rpc):
  init_device -> load_model -> determine_num_available_blocks -> initialize_cache
  -> execute_model per step (block swaps/copies first, then the model runner).
"""
from __future__ import annotations

from itertools import accumulate

import torch

from core import ModelRunnerOutput, SchedulerOutput
from realexec.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from realexec.config import EngineArgs
from realexec.kernels.block_ops import copy_blocks, swap_blocks
from realexec.loader import load_model
from realexec.model_runner import ModelRunner
from realexec.sampler import Sampler

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_GIB = 1.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


class LengthBucketedTorchBackend(TorchAttentionBackend):
    """The torch reference backend with decode rows grouped by context length.

    The reference decode path gathers every decoding sequence's cache padded to the
    longest context in the batch; with ShareGPT-like lengths (median ~100, max ~1000)
    most of that gather and of the masked SDPA is padding (4x of a CPU decode step at 64
    sequences). Here decode rows are sorted by length and run as one SDPA per group whose
    lengths are within 2x; prefill rows use the reference per-sequence path.
    (Belongs in realexec/attention/torch_backend.py; kept here until its owner takes it.)
    """

    def __init__(self) -> None:
        self._md = None
        self._plan: tuple[list, list[int]] = ([], [])

    def _step_plan(self, md):
        """([(token rows, sequence rows, max_len) per decode group], prefill sequence ids),
        computed once per step (the metadata object is shared by all layers)."""
        if md is not self._md:
            qlens, lens = md.query_lens_cpu, md.seq_lens_cpu
            starts = list(accumulate(qlens, initial=0))
            decode = sorted((i for i, n in enumerate(qlens) if n == 1), key=lens.__getitem__)
            groups: list[list[int]] = []
            for i in decode:
                if not groups or lens[i] > 2 * max(lens[groups[-1][0]], md.block_size):
                    groups.append([])
                groups[-1].append(i)
            device = md.seq_lens.device
            buckets = [(torch.tensor([starts[i] for i in g], device=device), torch.tensor(g, device=device),
                        lens[g[-1]]) for g in groups]
            self._plan = (buckets, [i for i, n in enumerate(qlens) if n > 1])
            self._md = md
        return self._plan

    def forward(self, q, k, v, k_cache, v_cache, md, scale):
        if k_cache is None:
            return super().forward(q, k, v, k_cache, v_cache, md, scale)
        buckets, prefills = self._step_plan(md)
        if len(buckets) == 1 and not prefills and q.shape[0] == md.num_seqs:
            return super().forward(q, k, v, k_cache, v_cache, md, scale)    # one group: as is
        write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
        out = torch.zeros_like(q)
        for token_rows, seq_rows, max_len in buckets:
            out[token_rows] = self._decode(q[token_rows], k_cache, v_cache, md.block_tables[seq_rows],
                                           md.seq_lens[seq_rows], max_len, md.block_size, scale)
        if prefills:
            self._per_sequence(q, k, v, k_cache, v_cache, md, scale, prefills, out)
        return out


class Worker:
    def __init__(self, args: EngineArgs, rank: int = 0):
        self.args = args
        self.rank = rank
        self.device: torch.device | None = None
        self.model = None
        self.model_config = None
        self.tokenizer = None
        self.runner: ModelRunner | None = None
        self.gpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- setup ----------------------------------------------------------------------------
    def init_device(self) -> None:
        self.device = resolve_device(self.args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(self.args.cpu_threads)
        torch.manual_seed(self.args.seed)

    def load_model(self):
        """-> the ModelConfig (the tokenizer stays on the worker: `self.tokenizer`)."""
        args = self.args
        backend = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        if backend == "torch":
            backend = LengthBucketedTorchBackend()
        self.model, self.model_config, self.tokenizer = load_model(
            args.model, args.dtype, self.device, attn_backend=backend)
        self.runner = ModelRunner(self.model, self.device, args.block_size, Sampler(self.device, args.seed))
        return self.model_config

    @property
    def kv_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        cfg = self.model_config
        elems = self.args.block_size * cfg.num_key_value_heads * cfg.head_dim
        return 2 * cfg.num_hidden_layers * elems * torch.empty((), dtype=self.kv_dtype).element_size()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(GPU-pool blocks, CPU swap-pool blocks) this worker can hold."""
        per_block = self.bytes_per_block()
        if self.args.kv_cache_memory is not None:
            budget = self.args.kv_cache_memory * GiB
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = DEFAULT_CPU_KV_CACHE_GIB * GiB
        return int(budget // per_block), int(self.args.swap_space * GiB // per_block)

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> float:
        """Free memory * utilization minus the peak a worst-case step needs: run one forward
        of max_num_batched_tokens prompt tokens (no cache yet) plus the logits of
        max_num_seqs rows, and measure the allocator's peak above the weights."""
        args = self.args
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = args.max_num_batched_tokens or 2048
        num_seqs = max(1, min(args.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        from realexec.attention import AttentionMetadata
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32, device=dev),
            block_size=args.block_size, max_query_len=max(lens), max_seq_len=max(lens),
            query_lens_cpu=lens, seq_lens_cpu=lens)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden = self.model(ids, positions, None, md)
        logits = self.model.compute_logits(hidden[torch.tensor(starts[1:], device=dev) - 1])
        logits.log_softmax(-1).topk(2, dim=-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del hidden, logits
        torch.cuda.empty_cache()
        return max(0.0, free * args.gpu_memory_utilization - peak)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        cfg = self.model_config
        shape = (self.args.block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype = self.kv_dtype
        self.gpu_cache = [
            (torch.zeros(num_gpu_blocks, *shape, dtype=dtype, device=self.device),
             torch.zeros(num_gpu_blocks, *shape, dtype=dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)]
        # The swap pool is only read after a swap-out wrote it: no need to zero it.
        pin = self.device.type == "cuda"
        self.cpu_cache = [
            (torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin),
             torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin))
            for _ in range(cfg.num_hidden_layers)] if num_cpu_blocks else []
        self.runner.kv_caches = self.gpu_cache
        self._maybe_capture_decode_graphs(num_gpu_blocks)

    def _maybe_capture_decode_graphs(self, num_gpu_blocks: int) -> None:
        """On CUDA with a shape-only attention backend, decode replays captured graphs."""
        args, cfg = self.args, self.model_config
        backend = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        if self.device.type != "cuda" or args.enforce_eager or backend != "triton":
            return
        from realexec.cuda_graph import DecodeGraphRunner
        max_len = min(cfg.max_position_embeddings, num_gpu_blocks * args.block_size)
        self.runner.graph_runner = DecodeGraphRunner(
            self.model, self.gpu_cache, block_size=args.block_size, max_batch=min(args.max_num_seqs, 256),
            max_blocks_per_seq=-(-max_len // args.block_size), max_seq_len=max_len, device=self.device,
            capture=True)
        self.runner.graph_runner.capture()

    # -- per step ---------------------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Order matters: a swapped-out block may be reused by a swap-in or a copy this step.
        if out.blocks_to_swap_out:
            self.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.swap_in(out.blocks_to_swap_in)
        if out.blocks_to_copy:
            self.copy_blocks(out.blocks_to_copy)
        return self.runner.execute_model(out)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs: device pool -> swap pool."""
        for (gk, gv), (ck, cv) in zip(self.gpu_cache, self.cpu_cache):
            swap_blocks(gk, ck, mapping)
            swap_blocks(gv, cv, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs: swap pool -> device pool."""
        for (gk, gv), (ck, cv) in zip(self.gpu_cache, self.cpu_cache):
            swap_blocks(ck, gk, mapping)
            swap_blocks(cv, gv, mapping)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) pairs inside the device pool (copy-on-write)."""
        copy_blocks(self.gpu_cache, pairs)

    def get_tokenizer(self):
        return self.tokenizer

    def get_timings(self) -> dict[str, float]:
        return {"prepare_s": self.runner.prepare_time, "steps": self.runner.num_steps}
