"""EngineArgs: every knob of the real engine, and the argparse flags the CLIs share.

Each dataclass field is one `--flag` (underscores become dashes); `add_engine_args`
builds them from the fields and their help strings, so adding a knob is one line here.
"""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from core import block_hasher, register_block_hasher
from core.cli_args import add_dataclass_args, dataclass_from_args, knob
from core.cost.model import RooflineCostModel
from core.cost.specs import get_hardware, get_model
from core.kv.block_hash import make_digest_hasher

try:                                 # the core imports only the stdlib: faster hashes come from here
    import xxhash
except ImportError:                  # pragma: no cover - xxhash is in the real extra
    xxhash = None
else:
    register_block_hasher("xxhash", make_digest_hasher(xxhash.xxh3_128_digest))

from policies import REGISTRY


def _names(kind: str) -> str:
    return " | ".join(REGISTRY[kind])


def _arg(default, help: str, **knob_kwargs):
    """An EngineArgs field and its flag (core.cli_args.knob: the generator sim's SimConfig uses too)."""
    return knob(default, help, group="engine", **knob_kwargs)


# --dtype values (fp32, fp16, half, bf16: aliases); realexec.models.loader maps them to torch dtypes.
DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "half", "bf16")


@dataclass
class EngineArgs:
    model: str | None = _arg(None, "HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    dtype: str = _arg("auto", "auto | float32 | float16 | bfloat16 (auto: fp32 on CPU, else the checkpoint's half type)",
                      choices=DTYPE_NAMES, metavar="DTYPE")
    device: str = _arg("auto", "auto | cpu | cuda | cuda:N (auto: cuda when available)")
    attention_backend: str | None = _arg(
        None, "cpu | torch | triton (default: triton on CUDA; on CPU the batched C++ kernel (cpu), built on "
              "first use, or torch (the reference) when no C++ compiler is found)")
    block_size: int = _arg(16, "tokens per KV block")
    max_num_seqs: int = _arg(256, "most sequences in one step")
    max_num_batched_tokens: int | None = _arg(
        None, "most tokens computed in one step (default 2048; without chunked prefill at least max_model_len)")
    max_model_len: int | None = _arg(
        None, "prompt + output tokens of one sequence (default: min(model max positions, 2048), "
              "capped by what the KV cache holds)")
    kv_cache_memory: float | None = _arg(
        None, "GiB for the KV cache (CPU default 1; CUDA default: profiled from --gpu-memory-utilization)")
    gpu_memory_utilization: float = _arg(0.9, "CUDA: fraction of free memory the engine may use")
    num_gpu_blocks: int | None = _arg(None, "force the KV cache size in blocks (overrides the memory budget)")
    swap_space: float = _arg(1.0, "GiB of CPU memory for swapped-out KV blocks (0 disables swapping)")
    enable_prefix_caching: bool = _arg(False, "reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over several steps")
    watermark: float = _arg(0.01, "fraction of KV blocks new admissions must leave free")
    queue_policy: str = _arg("fcfs", f"waiting-queue order: {_names('queue')}")
    preemption_mode: str = _arg("recompute", f"preemption mode: {_names('preemption')}")
    victim_policy: str = _arg("newest", f"preemption victim: {_names('victim')}")
    eviction_policy: str = _arg("lru", f"cached-block eviction: {_names('eviction')}")
    scheduler: str = _arg("twinserve", "scheduling rules: twinserve | vllm-v1 (vLLM v1's decisions: victim 'tail' "
                                       "for fcfs, full-sequence admission check; to match vLLM on CPU also pass "
                                       "--enable-prefix-caching --watermark 0 --block-size 128)")
    prefix_caching_hash_algo: str = _arg(
        "sha256", "prefix-cache block key: sha256 (collision-resistant: one tenant's prompt cannot be made to "
                  "hit another's cached KV) | xxhash (XXH3-128: faster, not cryptographic) | builtin "
                  "(Python's 64-bit hash: fastest, collisions are easy to forge; trusted prompts only)")
    seed: int = _arg(0, "seed of the sampler's generator for requests without their own seed")
    cpu_threads: int = _arg(1, "torch intra-op threads on CPU (more than the free cores is much slower)")
    cpu_weight_format: str = _arg(
        "auto", "CPU: the projections' weight layout: packed (--cpu-gemm's packed layout in place of the "
                "dense weights: oneDNN's 1.1-2.8x faster GEMMs from 4 rows up, no extra memory) | both (packed, plus the dense weights for steps under "
                "--cpu-packed-min-rows rows, where MKL is faster on Intel: twice the projections' memory) | "
                "dense (as loaded) | auto (packed where --cpu-packed-min-rows is 1; else both up to 2 GiB of "
                "projections, else packed)", choices=("auto", "dense", "packed", "both"))
    cpu_gemm: str = _arg(
        "auto", "CPU: the library that packs the projections' weights and runs their GEMMs: mkl (MKL's packed "
                "GEMM: on the Intel dev host 1.2-1.3x oneDNN's at 32-64 rows, the decode steps; its buffers take "
                "~10 MB more per matrix, SmolLM2-135M's projections 1.75 GB instead of 0.42) | onednn | auto (mkl "
                "on Intel CPUs where torch's build exports it, onednn elsewhere: MKL runs generic kernels on AMD)",
        choices=("auto", "onednn", "mkl"))
    cpu_packed_min_rows: int | None = _arg(
        None, "CPU: the fewest rows (tokens) a step needs to run on the packed weights; smaller steps use "
              "the dense weights (MKL). Default: 1 with --cpu-gemm mkl; with onednn 4 on Intel (MKL's GEMV "
              "wins below 4 rows there), 1 on AMD (oneDNN's packed GEMM wins at every row count: SmolLM2 decodes of 2-3 sequences "
              "2-3x faster than with MKL)")
    enforce_eager: bool = _arg(False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs")
    compile_decode: bool = _arg(
        True, "CUDA: torch.compile the decode forward (attention left eager) before capturing its graphs: "
              "fuses each layer's elementwise kernels (SmolLM2 decode step on an H100: 2.4x faster than the "
              "uncompiled graphs); compiles once per batch bucket at start-up (~5 s each), falls back to "
              "uncompiled graphs if compiling fails")
    mixed_step_graphs: bool = _arg(
        True, "CUDA: run steps that mix prefill chunks and decodes (up to 2048 tokens) through piecewise CUDA "
              "graphs: each layer's work between attention calls is captured per token-count bucket (16 to "
              "2048), attention runs eagerly between the pieces (Llama-family dense models; --enforce-eager "
              "turns these off too)")
    tensor_parallel_size: int = _arg(1, "tensor-parallel ranks (one worker each; must divide the query and KV heads)",
                                     aliases=("-tp",))
    pipeline_parallel_size: int = _arg(
        1, "pipeline stages: the decoder layers split into this many contiguous stages, each on "
           "tensor-parallel-size ranks (world size = stages x tensor-parallel size); up to this many "
           "batches are in flight at once", aliases=("-pp",))
    pp_layer_partition: str | None = _arg(
        None, "decoder layers per pipeline stage, comma-separated (e.g. 10,10,10: one positive entry per "
              "stage, summing to the model's layer count; default: an even split, earlier stages take "
              "the remainder)")
    async_scheduling: bool = _arg(
        False, "schedule step N+1 while step N computes (one pipeline stage): "
               "scheduling, input building, detokenization and output streaming hide behind the model's work; "
               "a sequence's next decode takes the token N samples, filled in on the worker. A token computed "
               "after a sequence's end is dropped; greedy outputs are unchanged")
    distributed_executor_backend: str | None = _arg(
        None, "uni | mp | ray: one in-process worker, one process per rank, one Ray actor per rank "
              "(default: uni for one rank, else mp)")
    ray_address: str | None = _arg(None, "ray: address of an existing Ray cluster (default: start a local one)")
    ray_cpus_per_worker: float | None = _arg(
        None, "ray: CPUs each rank's placement-group bundle reserves (default: the cluster's CPUs / ranks, "
              "at most 1, so that any tensor-parallel size fits on a small machine)")
    enable_sleep_mode: bool = _arg(
        False, "serve: expose POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (development endpoints)")
    step_log: str | None = _arg(
        None, "write each step's scheduling decision and timestamps to this JSON-lines file "
              "(python -m sim replay LOG checks the simulator's core decides the same)")
    worker_timeout: float = _arg(
        120.0, "mp/ray: seconds a step or RPC may wait on a worker before it is declared hung")
    simulate: str | None = _arg(
        None, "serve a simulated engine: load no weights, take each step for as long as this cost model "
              "prices it (a JSON file from `python -m realexec profile` / `python -m sim calibrate`, or "
              "'roofline' with --sim-model and --sim-hardware) and answer with seeded tokens; the scheduler, "
              "KV accounting, limits and metrics are the real ones", metavar="COST_MODEL")
    sim_model: str | None = _arg(
        None, "--simulate roofline: the model spec to price (e.g. Llama-3-8B, Llama-2-70B, SmolLM2-135M; "
              "default SmolLM2-135M). Text comes from --model's tokenizer: the embedded SmolLM2 one is fine "
              "for any spec'd model")
    sim_hardware: str | None = _arg(
        None, "--simulate roofline: the hardware to price it on (e.g. H100, H200, A100-80G; default H100); "
              "--tensor-parallel-size is the priced tp, KV blocks come from its memory "
              "(--gpu-memory-utilization)")
    simulate_output: str = _arg(
        "random", "--simulate: the tokens answered: random (seeded draws from the tokenizer's vocabulary, "
                  "no special tokens) | echo (the prompt's tokens, repeated)", choices=("random", "echo"))
    sim_first_token_no_text: float = _arg(
        0.0, "--simulate, random output: the share of requests (seeded per request) whose first token is a "
             "special token without text, as a real model's end-of-turn token that ignore_eos runs past: "
             "their first streamed chunk comes one step later, as from the real server (SmolLM2 on the "
             "ShareGPT completions: about 0.2) [0]", metavar="SHARE")
    sim_first_token_no_text_prompts: str | None = _arg(
        None, "--simulate, random output: instead of a share, exactly the requests whose prompt is in this "
              "JSON list (prompt texts as sent to /v1/completions, or token-id lists) start with that "
              "text-less token: a recorded run's silent starts replayed (`bench simulate-vs-real "
              "--match-first-token` writes the list from the real server)", metavar="FILE")

    def validate(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {value}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_gpu_blocks", "cpu_threads", "tensor_parallel_size", "pipeline_parallel_size"):
            positive(name)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv-cache-memory must be > 0 GiB, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise ValueError(f"swap-space must be >= 0 GiB, got {self.swap_space}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.simulate is not None or self.sim_model is not None or self.sim_hardware is not None \
                or self.sim_first_token_no_text or self.sim_first_token_no_text_prompts is not None:
            check_simulate_args(self)      # a simulated engine runs no workers: no backend to check
        elif self.executor_backend() == "uni" and self.world_size > 1:
            raise ValueError(f"distributed-executor-backend uni runs one worker; tensor-parallel-size "
                             f"{self.tensor_parallel_size} x pipeline-parallel-size "
                             f"{self.pipeline_parallel_size} needs mp or ray")
        if self.async_scheduling:
            if self.pipeline_parallel_size > 1:
                raise ValueError(f"async-scheduling overlaps the steps of one pipeline stage; pipeline-parallel-size "
                                 f"{self.pipeline_parallel_size} already keeps that many batches in flight: drop one "
                                 f"of the two")
            if self.step_log:
                raise ValueError("step-log records one batch per step; with async-scheduling two are in "
                                 "flight: drop one of the two")
            if self.simulate is not None:
                raise ValueError("async-scheduling is not supported by --simulate (its steps have no host "
                                 "work of their own to hide)")
        if self.step_log and self.pipeline_parallel_size > 1:
            raise ValueError("step-log records one batch per step; with pipeline-parallel-size > 1 several "
                             "batches are in flight: drop --step-log or use one stage")
        if self.ray_cpus_per_worker is not None and self.ray_cpus_per_worker <= 0:
            raise ValueError(f"ray-cpus-per-worker must be > 0, got {self.ray_cpus_per_worker}")
        if isinstance(self.dtype, str) and self.dtype not in DTYPE_NAMES:     # (or a torch.dtype)
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if isinstance(self.device, str) and not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.worker_timeout <= 0:
            raise ValueError(f"worker-timeout must be > 0 seconds, got {self.worker_timeout}")
        if self.attention_backend not in (None, "torch", "cpu", "triton"):
            raise ValueError(f"attention-backend must be cpu, torch or triton, got {self.attention_backend!r}")
        if self.cpu_weight_format not in ("auto", "dense", "packed", "both"):
            raise ValueError(f"cpu-weight-format must be auto, dense, packed or both, got {self.cpu_weight_format!r}")
        if self.cpu_gemm not in ("auto", "onednn", "mkl"):
            raise ValueError(f"cpu-gemm must be auto, onednn or mkl, got {self.cpu_gemm!r}")
        if self.cpu_packed_min_rows is not None and self.cpu_packed_min_rows < 1:
            raise ValueError(f"cpu-packed-min-rows must be >= 1, got {self.cpu_packed_min_rows}")
        from policies import PolicySet
        PolicySet.from_names(**self.policy_names())     # an unknown policy name fails here, before any load
        if self.scheduler.lower() == "vllm-v1":
            from policies.scheduling import check_vllm_v1
            check_vllm_v1(chunked_prefill=self.enable_chunked_prefill, preemption=self.preemption_mode,
                          pipeline_parallel_size=self.pipeline_parallel_size)
        block_hasher(self.prefix_caching_hash_algo)

    @property
    def world_size(self) -> int:
        """Ranks (workers): pipeline stages x tensor-parallel ranks per stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def executor_backend(self) -> str:
        backend = self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")
        if backend not in ("uni", "mp", "ray"):
            raise ValueError(f"distributed-executor-backend must be uni, mp or ray, got {backend!r}")
        return backend

    def policy_names(self) -> dict[str, str]:
        return {"queue": self.queue_policy, "preemption": self.preemption_mode,
                "victim": self.victim_policy, "eviction": self.eviction_policy, "scheduler": self.scheduler}


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one --flag per EngineArgs field to `parser` (in an "engine" group; types from
    the annotations, core.cli_args)."""
    add_dataclass_args(parser, EngineArgs)
    return parser


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return dataclass_from_args(EngineArgs, ns)


# -- serve --simulate (realexec.executor.simulated): the flags' own checks, kept with the flags
ROOFLINE = "roofline"
DEFAULT_SIM_MODEL = "SmolLM2-135M"
DEFAULT_SIM_HARDWARE = "H100"
OUTPUT_MODES = ("random", "echo")


def check_simulate_args(args: EngineArgs) -> None:
    """Flag checks that need no tokenizer or file contents (EngineArgs.validate calls it)."""
    if args.simulate is None:
        for flag in ("sim_model", "sim_hardware"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} only applies with --simulate roofline")
        if args.sim_first_token_no_text:
            raise ValueError("--sim-first-token-no-text only applies with --simulate")
        if args.sim_first_token_no_text_prompts is not None:
            raise ValueError("--sim-first-token-no-text-prompts only applies with --simulate")
        return
    if not 0.0 <= args.sim_first_token_no_text <= 1.0:
        raise ValueError(f"--sim-first-token-no-text is a share of requests: it must be in [0, 1], "
                         f"got {args.sim_first_token_no_text}")
    if args.sim_first_token_no_text and args.sim_first_token_no_text_prompts is not None:
        raise ValueError("give --sim-first-token-no-text (a share of requests) or --sim-first-token-no-text-prompts "
                         "(which requests), not both")
    if args.simulate_output not in OUTPUT_MODES:
        raise ValueError(f"simulate-output must be one of {', '.join(OUTPUT_MODES)}, got {args.simulate_output!r}")
    if args.pipeline_parallel_size > 1:
        raise ValueError("--simulate prices one engine: pipeline-parallel-size must be 1")
    if args.distributed_executor_backend not in (None, "uni"):
        raise ValueError(f"--simulate runs no workers: drop --distributed-executor-backend "
                         f"{args.distributed_executor_backend}")
    if args.simulate == ROOFLINE:
        model = get_model(args.sim_model or DEFAULT_SIM_MODEL)           # ValueError naming the choices
        get_hardware(args.sim_hardware or DEFAULT_SIM_HARDWARE)
        RooflineCostModel(model, get_hardware(args.sim_hardware or DEFAULT_SIM_HARDWARE),
                          args.tensor_parallel_size)                     # tp must split the heads
        return
    if args.sim_model is not None or args.sim_hardware is not None:
        raise ValueError(f"--sim-model / --sim-hardware price a roofline; --simulate {args.simulate} is a "
                         f"fitted cost model of the engine it profiled (use --simulate roofline, or drop them)")
    if args.tensor_parallel_size > 1:
        raise ValueError(f"--simulate {args.simulate}: a fitted cost model prices the engine it profiled; "
                         f"tensor-parallel-size {args.tensor_parallel_size} applies to roofline only")
    if not os.path.isfile(args.simulate):
        raise ValueError(f"--simulate {args.simulate!r}: no such file (a cost-model JSON from "
                         f"`python -m realexec profile`, or 'roofline')")
