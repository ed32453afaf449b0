"""Engine configuration shared by the simulator and the real executor."""
from __future__ import annotations

from dataclasses import dataclass

from core.kv.block_hash import block_hasher
# Defaults both backends derive the same way (the simulator's `resolve`, the real engine).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def default_max_num_batched_tokens(enable_chunked_prefill: bool, max_model_len: int) -> int:
    """The step's token budget when none is given: chunked prefill splits long prompts, so a
    fixed budget works; without it one step must hold a whole max_model_len prompt."""
    if enable_chunked_prefill:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)


def default_max_model_len(model_max_len: int, num_gpu_blocks: int, block_size: int, cap: int | None = None) -> int:
    """max_model_len when none is given: the model's context, capped at what the KV cache
    holds (one sequence must fit), and at `cap` if the backend sets one."""
    length = min(model_max_len, num_gpu_blocks * block_size)
    return length if cap is None else min(length, cap)


def pipeline_stage_layers(num_layers: int, pp: int, partition: list[int] | str | None = None) -> list[int]:
    """Decoder layers per pipeline stage, first stage first: contiguous, an even split by
    default (the first `num_layers % pp` stages take one more), or `partition` (e.g.
    "10,10,10" or [10, 10, 10]) when given. Raises ValueError naming what is wrong."""
    if pp < 1:
        raise ValueError(f"pipeline-parallel size must be >= 1, got {pp}")
    if partition is None or partition == "":
        if num_layers < pp:
            raise ValueError(f"{num_layers} layers cannot be split over {pp} pipeline stages (each needs >= 1)")
        base, extra = divmod(num_layers, pp)
        return [base + (1 if i < extra else 0) for i in range(pp)]
    if isinstance(partition, str):
        try:
            counts = [int(x) for x in partition.split(",")]
        except ValueError:
            raise ValueError(f"layer partition {partition!r}: expected comma-separated integers, e.g. "
                             f"'10,10,10'") from None
    else:
        counts = [int(x) for x in partition]
    if len(counts) != pp:
        raise ValueError(f"layer partition {counts} has {len(counts)} stages; pipeline-parallel size is {pp}")
    if any(c < 1 for c in counts):
        raise ValueError(f"layer partition {counts}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ValueError(f"layer partition {counts} covers {sum(counts)} layers; the model has {num_layers}")
    return counts


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int = 0          # set by the backend (profiling / cost model) or by hand
    num_cpu_blocks: int = 0          # swap space; 0 disables swapping (swap falls back to recompute)
    enable_prefix_caching: bool = False
    watermark: float = 0.01          # fraction of GPU blocks new admissions must leave free
    prefix_caching_hash_algo: str = "sha256"   # block keys: sha256 | builtin | registered (core/kv/block_hash.py)

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        block_hasher(self.prefix_caching_hash_algo)     # raises for an unknown name


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256              # running sequences at once
    max_num_batched_tokens: int = 2048   # tokens computed per step (prefill + decode)
    max_model_len: int = 2048            # prompt + output tokens of one sequence
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: cap on one sequence's prefill chunk per step
    # Pipeline stages P: up to P batches are in flight at once (see Scheduler). The budgets
    # above apply per batch, so up to P * max_num_seqs sequences may be running.
    pipeline_parallel_size: int = 1
    # Async scheduling (one stage): step N+1 is scheduled while step N computes; a request
    # whose token from N is still unknown gets its next decode with that token as a
    # placeholder the workers fill in. Up to 2 batches are in flight (see Scheduler).
    async_scheduling: bool = False

    def validate(self, cache: CacheConfig) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.async_scheduling and self.pipeline_parallel_size > 1:
            raise ValueError(f"async scheduling overlaps the steps of one pipeline stage; with "
                             f"pipeline_parallel_size={self.pipeline_parallel_size} the stages already keep "
                             f"{self.pipeline_parallel_size} batches in flight: turn one of the two off")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            # The cap splits long prompts into chunks; without chunking such a prompt could
            # never be scheduled (it would wait forever).
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} caps a prompt's chunk per "
                f"step, which needs chunked prefill: enable chunked prefill or set the threshold to 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled")
        blocks_per_seq = -(-self.max_model_len // cache.block_size)
        if blocks_per_seq > cache.num_gpu_blocks:
            raise ValueError(
                f"the KV cache has {cache.num_gpu_blocks} blocks of {cache.block_size} tokens "
                f"({cache.num_gpu_blocks * cache.block_size} tokens) but one sequence of max_model_len="
                f"{self.max_model_len} needs {blocks_per_seq} blocks: lower max_model_len or give the "
                f"cache more memory")
