"""Worker: owns one device (one rank: a tensor-parallel shard of one pipeline stage), its
weights and its paged KV cache (its stage's layers, its share of the KV heads).

Lifecycle (driven by an executor through collective_rpc):
  init_device -> load_model -> determine_num_available_blocks -> initialize_cache
  -> execute_model(StepMessage) per step (block swaps/copies first, then the model runner)
  -> sleep(level) / wake_up() when the device is lent to someone else.
The worker reads only step messages (core.step_message), never scheduler objects, so the
same code runs in the engine's process, in a worker process, or in a Ray actor.
"""
from __future__ import annotations

import ctypes
import gc
import sys
import time
from itertools import accumulate

import torch

from core.kv.kv_capacity import kv_block_bytes_per_rank, kv_blocks_per_rank, kv_heads_per_rank
from core.step_message import ModelRunnerOutput, StepMessage
from realexec.attention.torch_backend import TorchAttentionBackend
from realexec.config import EngineArgs
from realexec.kernels.block_ops import copy_blocks, swap_blocks
from realexec.models.linear import compute_dtype, pack_weights, set_parameter
from realexec.models.loader import load_model
from realexec.worker.model_runner import ModelRunner
from realexec.distributed import ParallelLayout, check_tensor_parallel, init_distributed, stage_layer_ranges
from realexec.worker.sampler import Sampler

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_GIB = 1.0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto`: CUDA device `local_rank` when CUDA is available, else the CPU."""
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def release_freed_host_memory() -> None:
    """Hand memory that was freed back to the OS. glibc keeps freed heap chunks (such as
    per-layer KV tensors below its mmap threshold) for reuse; malloc_trim returns them,
    so a sleeping engine's memory is really available to the next tenant."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):       # not glibc (e.g. musl): nothing to trim
            pass


class Worker:
    def __init__(self, args: EngineArgs, rank: int = 0, world_size: int = 1, local_rank: int | None = None,
                 distributed_init_method: str | None = None, with_tokenizer: bool = True):
        self.args = args
        self.with_tokenizer = with_tokenizer      # executors with remote workers load their own
        self.rank = rank
        self.world_size = world_size
        self.local_rank = rank if local_rank is None else local_rank
        self.distributed_init_method = distributed_init_method
        self.layout = ParallelLayout(args.pipeline_parallel_size, world_size // args.pipeline_parallel_size)
        if self.layout.world_size != world_size:
            raise ValueError(f"world size {world_size} is not a multiple of pipeline-parallel-size "
                             f"{args.pipeline_parallel_size}")
        self.tp = None
        self.pp = None
        self.device: torch.device | None = None
        self.model = None
        self.model_config = None
        self.tokenizer = None
        self.weight_format: dict | None = None     # CPU: what pack_weights did
        self.runner: ModelRunner | None = None
        self.gpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cache_blocks = (0, 0)
        self.sleep_level = 0                 # 0 awake; 1 weights offloaded, KV dropped; 2 both dropped
        self._offloaded: dict[str, torch.Tensor] = {}
        self.execute_time = 0.0              # seconds inside execute_model (the worker's own share of a step)

    # -- setup ----------------------------------------------------------------------------
    def init_device(self) -> None:
        self.device = resolve_device(self.args.device, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(self.args.cpu_threads)
        torch.manual_seed(self.args.seed)
        from realexec.models.loader import read_model_config
        stages = stage_layer_ranges(read_model_config(self.args.model).num_hidden_layers, self.layout.pp,
                                    self.args.pp_layer_partition)
        self.tp, self.pp = init_distributed(self.rank, self.world_size, self.distributed_init_method or "",
                                            self.device, self.layout, stages)

    @property
    def is_output_rank(self) -> bool:
        """This rank samples and answers each step (the last stage's TP driver)."""
        return self.rank == self.layout.output_rank

    def _backend(self):
        backend = self.args.attention_backend or ("triton" if self.device.type == "cuda" else "cpu")
        if backend == "cpu" and self.args.attention_backend is None:
            from realexec.attention.cpu_backend import default_cpu_backend
            return default_cpu_backend()      # the torch reference, with a warning, if the kernel cannot build
        return TorchAttentionBackend() if backend == "torch" else backend

    def load_model(self):
        """-> the ModelConfig (the tokenizer stays on the worker: `self.tokenizer`)."""
        args = self.args
        self.model, self.model_config, self.tokenizer = self._load(with_tokenizer=self.with_tokenizer)
        check_tensor_parallel(self.model_config, self.layout.tp)
        sampler = Sampler(self.device, args.seed) if self.is_output_rank else None
        self.runner = ModelRunner(self.model, self.device, args.block_size, sampler, self.tp, self.pp,
                                  provisional_tokens=args.async_scheduling)
        return self.model_config

    def _load(self, with_tokenizer: bool):
        """(model, config, tokenizer) of this rank, its projections packed on the CPU."""
        args = self.args
        loaded = load_model(args.model, args.dtype, self.device, attn_backend=self._backend(), tp=self.tp,
                            pp=self.pp, with_tokenizer=with_tokenizer)
        if self.device.type == "cpu":
            self.weight_format = pack_weights(loaded[0], args.cpu_weight_format, args.cpu_packed_min_rows,
                                              args.cpu_gemm)
        return loaded

    @property
    def kv_dtype(self) -> torch.dtype:
        return compute_dtype(self.model)

    def _kv_geometry(self) -> dict:
        cfg = self.model_config
        return dict(block_size=self.args.block_size, num_layers=len(self.pp.layers),
                    num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    dtype_bytes=torch.empty((), dtype=self.kv_dtype).element_size(), tp=self.layout.tp)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(GPU-pool blocks, CPU swap-pool blocks) this rank can hold (its stage's layers and its
        own KV heads only); the executor takes the minimum over ranks, hence over stages."""
        if self.args.kv_cache_memory is not None:
            budget = self.args.kv_cache_memory * GiB
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = DEFAULT_CPU_KV_CACHE_GIB * GiB
        geometry = self._kv_geometry()
        return kv_blocks_per_rank(budget, **geometry), kv_blocks_per_rank(self.args.swap_space * GiB, **geometry)

    def bytes_per_block(self) -> int:
        return kv_block_bytes_per_rank(**self._kv_geometry())

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
        dev = self.device
        md = self._whole_prompts_metadata(lens, table_width=1)
        starts = list(accumulate(lens, initial=0))
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        received = None if self.pp.is_first else torch.zeros(
            num_tokens, self.model_config.hidden_size, dtype=self.kv_dtype, device=dev)
        hidden = self.model(ids, positions, None, md, received)
        logits = None
        if self.pp.is_last:
            logits = self.model.compute_logits(hidden[torch.tensor(starts[1:], device=dev) - 1])
        if logits is not None:                      # None on non-driver tensor-parallel ranks
            logits.log_softmax(-1).topk(2, dim=-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del hidden, logits
        torch.cuda.empty_cache()
        return max(0.0, free * args.gpu_memory_utilization - peak)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        cfg = self.model_config
        shape = (self.args.block_size, kv_heads_per_rank(cfg.num_key_value_heads, self.layout.tp), cfg.head_dim)
        dtype = self.kv_dtype
        self.gpu_cache = [
            (torch.zeros(num_gpu_blocks, *shape, dtype=dtype, device=self.device),
             torch.zeros(num_gpu_blocks, *shape, dtype=dtype, device=self.device))
            for _ in self.pp.layers]                    # this stage's layers only
        # The swap pool is only read after a swap-out wrote it: no need to zero it.
        pin = self.device.type == "cuda"
        self.cpu_cache = [
            (torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin),
             torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin))
            for _ in self.pp.layers] if num_cpu_blocks else []
        self.runner.kv_caches = self.gpu_cache
        self._cache_blocks = (num_gpu_blocks, num_cpu_blocks)
        self._maybe_capture_decode_graphs(num_gpu_blocks)
        if self.device.type == "cuda" and self._backend() == "triton" and self.layout.pp == 1:
            self.warm_up_prefill_kernels()

    def warm_up_prefill_kernels(self) -> None:
        """Compile the Triton store and prefill kernels for this cache now, not on the first
        request: on an H200 the first 17 requests of a 16 req/s ShareGPT run waited 0.4-1.2 s
        for them. One forward of a 2-block prompt over the real cache that writes nothing
        (slots -1) and reads block 0 (the output is dropped); decode kernels compile when the
        graphs are captured, or on the first eager decode. (Tensor-parallel ranks all run it:
        its all-reduces pair up.)"""
        dev, n = self.device, self.args.block_size + 1
        md = self._whole_prompts_metadata([n], table_width=2)
        with torch.inference_mode():
            self.model(torch.zeros(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev), self.gpu_cache, md)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def _whole_prompts_metadata(self, lens: list[int], table_width: int):
        """Attention metadata of dummy whole prompts (context 0) that write no KV (slots -1)
        and whose block tables point at block 0: for forwards whose output is dropped."""
        from realexec.attention import AttentionMetadata
        dev, starts = self.device, list(accumulate(lens, initial=0))
        return AttentionMetadata(
            slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(len(lens), table_width, dtype=torch.int32, device=dev),
            block_size=self.args.block_size, max_query_len=max(lens), max_seq_len=max(lens),
            query_lens_cpu=lens, seq_lens_cpu=lens)

    def _maybe_capture_decode_graphs(self, num_gpu_blocks: int) -> None:
        """On CUDA with a shape-only attention backend, decode replays captured graphs (one
        stage only: a captured graph cannot wait on another stage's hidden state). Other steps
        of up to 2048 tokens (mixed prefill + decode) replay piecewise graphs around eager
        attention (any backend; --no-mixed-step-graphs, or a model whose layers are not split
        around attention, runs them eagerly)."""
        args, cfg = self.args, self.model_config
        if self.device.type != "cuda" or args.enforce_eager or self.layout.pp > 1:
            return
        if args.mixed_step_graphs:
            from realexec.worker.piecewise_graph import build_mixed_step_runner
            try:
                self.runner.mixed_graph_runner = build_mixed_step_runner(
                    self.model, max_tokens=args.max_num_batched_tokens or 2048, device=self.device, capture=True)
            except Exception as e:        # a server still starts: those steps then run eagerly
                import warnings
                self.runner.mixed_graph_runner = None
                warnings.warn(f"rank {self.rank}: capturing the mixed-step piecewise graphs failed "
                              f"({type(e).__name__}: {e}); those steps run eagerly (--no-mixed-step-graphs "
                              f"skips the attempt)", RuntimeWarning, stacklevel=2)
        backend = args.attention_backend or "triton"
        if backend != "triton":
            return
        from realexec.worker.cuda_graph import DecodeGraphRunner
        max_len = min(cfg.max_position_embeddings, num_gpu_blocks * args.block_size)

        def captured(forward) -> DecodeGraphRunner:
            runner = DecodeGraphRunner(
                forward, self.gpu_cache, block_size=args.block_size, max_batch=min(args.max_num_seqs, 256),
                max_blocks_per_seq=-(-max_len // args.block_size), max_seq_len=max_len, device=self.device,
                capture=True)
            runner.capture()
            return runner

        from realexec.worker.compilation import capture_with_fallback
        self.runner.graph_runner = capture_with_fallback(captured, self.model, args.compile_decode,
                                                         where=f"rank {self.rank}")

    # -- per step ---------------------------------------------------------------------------
    def execute_model(self, msg: StepMessage) -> ModelRunnerOutput | None:
        """The driver's sampled tokens; None on the other ranks."""
        if self.sleep_level:
            raise RuntimeError(f"rank {self.rank} is asleep (level {self.sleep_level}): wake_up first")
        t0 = time.perf_counter()
        # Order matters: a swapped-out block may be reused by a swap-in or a copy this step.
        if msg.blocks_to_swap_out:
            self.swap_out(msg.blocks_to_swap_out)
        if msg.blocks_to_swap_in:
            self.swap_in(msg.blocks_to_swap_in)
        if msg.blocks_to_copy:
            self.copy_blocks(msg.blocks_to_copy)
        result = self.runner.execute_model(msg)
        self.execute_time += time.perf_counter() - t0
        return result

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

    # -- sleep / wake up ----------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Free this rank's device memory for someone else; returns the bytes released.

        Level 1: the weights move to (pinned) CPU memory, the KV cache is dropped. Level 2:
        both are dropped; wake_up reloads the weights from the checkpoint. Either way the
        cache's contents are gone (the engine resets its prefix cache) and the runner's
        per-sequence state is cleared (the engine sleeps only with nothing running).
        On CPU, level 1 keeps the weights where they are (they already are in CPU memory)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_level:
            return 0
        released = sum(t.numel() * t.element_size() for pair in self.gpu_cache for t in pair)
        self._set_cache([])
        params = dict(self.model.named_parameters())
        if level == 2 or self.device.type != "cpu":
            for name, p in params.items():
                if level == 1:
                    self._offloaded[name] = p.data.to("cpu", copy=True).pin_memory()
                released += p.numel() * p.element_size()
                set_parameter(self.model, name, torch.empty(0, dtype=p.dtype, device=p.device))
        self.runner.reset_states()
        gc.collect()                     # tensors caught in reference cycles go now, not later
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_host_memory()
        self.sleep_level = level
        return released

    def wake_up(self) -> None:
        if not self.sleep_level:
            return
        if self.sleep_level == 2:
            fresh, _, _ = self._load(with_tokenizer=False)
            sources = dict(fresh.named_parameters())
        else:
            sources = self._offloaded
        for name, _ in list(self.model.named_parameters()):
            if name in sources:       # level 2: the fresh tensors are already on the device
                src = sources[name]
                set_parameter(self.model, name, src if self.sleep_level == 2 else src.to(self.device, copy=True))
        self._offloaded = {}
        self.sleep_level = 0
        self.initialize_cache(*self._cache_blocks)

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    def _set_cache(self, cache) -> None:
        self.gpu_cache = cache
        self.runner.kv_caches = cache
        if self.runner.graph_runner is not None:
            self.runner.graph_runner = None         # captured against the dropped cache
        self.runner.mixed_graph_runner = None       # (its graph pool and buffers go with it)

    # -- introspection ---------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def get_timings(self) -> dict[str, float]:
        r = self.runner
        return {"prepare_s": r.prepare_time, "forward_s": r.forward_time, "execute_s": self.execute_time,
                "steps": r.num_steps, "recv_wait_s": self.pp.recv_wait_s, "send_wait_s": self.pp.send_wait_s}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in weights and in its device KV cache."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = sum(t.numel() * t.element_size() for pair in self.gpu_cache for t in pair)
        return {"weights": weights, "kv_cache": kv}

    def cpu_weight_format(self) -> dict | None:
        """What `pack_weights` did on this rank (format, library, min_rows, ...); None off the CPU."""
        return self.weight_format

    def num_tracked_seqs(self) -> int:
        return len(self.runner.seqs)

    def ping(self) -> int:
        return self.rank

    def stage(self) -> dict:
        """Where this rank sits: its (pp, tp) coordinates and the global layers it holds."""
        return {"rank": self.rank, "pp_rank": self.pp.rank, "tp_rank": self.tp.rank,
                "layers": [self.pp.layers.start, self.pp.layers.stop],
                "has_embedding": self.model.embed_tokens is not None, "has_head": self.pp.is_last}


def call_on_worker(worker: Worker, method, args: tuple = (), kwargs: dict | None = None):
    """What collective_rpc runs on each rank: a Worker method by name, or a function (picklable
    by reference) called with the worker first, e.g. a benchmark's instrumentation."""
    fn = getattr(worker, method) if isinstance(method, str) else (lambda *a, **k: method(worker, *a, **k))
    return fn(*args, **(kwargs or {}))
