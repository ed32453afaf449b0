"""KV allocation: paged (on demand, block by block) or a contiguous-reservation baseline.
Each allocation policy builds the scheduler's KV manager (`core.kv.kv_interface.KVManager`).

The baselines are the vLLM paper's stand-ins for pre-paging systems (Orca): each
sequence reserves one contiguous region at admission. They differ in how much they
reserve (the simulator knows each request's real output length through max_tokens):
  orca-max     max_model_len slots, whatever the request
  orca-pow2    the next power of two >= the real total length (prompt + output)
  orca-oracle  exactly the real total length
"""
from __future__ import annotations

from typing import Callable

from core.config import CacheConfig
from core.kv.contiguous import ContiguousKVCacheManager, ReservationRule
from core.kv.kv_cache_manager import KVCacheManager
from core.sched.policy_api import Evictor
from core.sched.request import Request


def _total(request: Request, max_model_len: int) -> int:
    out = request.params.max_tokens if request.params.max_tokens is not None else max_model_len
    return min(request.num_prompt_tokens + out, max_model_len)


def reserve_max(request: Request, max_model_len: int) -> int:
    return max_model_len


def reserve_pow2(request: Request, max_model_len: int) -> int:
    return min(1 << (_total(request, max_model_len) - 1).bit_length(), max_model_len)


def reserve_oracle(request: Request, max_model_len: int) -> int:
    return _total(request, max_model_len)


class PagedAllocation:
    """Blocks on demand, shared by forks and the prefix cache (vLLM's PagedAttention)."""
    name = "paged"

    def make_kv_manager(self, cache: CacheConfig, max_model_len: int,
                        evictor: Callable[[], Evictor]) -> KVCacheManager:
        caching = cache.enable_prefix_caching
        return KVCacheManager(cache.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks,
                              enable_prefix_caching=caching, evictor=evictor() if caching else None,
                              watermark=cache.watermark, hash_algo=cache.prefix_caching_hash_algo)


class ContiguousAllocation:
    """One region per sequence, sized by `reserve` (no prefix cache, no swap space)."""

    def __init__(self, name: str, reserve: ReservationRule):
        self.name = name
        self.reserve = reserve

    def make_kv_manager(self, cache: CacheConfig, max_model_len: int,
                        evictor: Callable[[], Evictor]) -> ContiguousKVCacheManager:
        return ContiguousKVCacheManager(cache.block_size, cache.num_gpu_blocks, self.reserve, max_model_len)


ALLOCATIONS = {
    "paged": PagedAllocation,
    "orca-max": lambda: ContiguousAllocation("orca-max", reserve_max),
    "orca-pow2": lambda: ContiguousAllocation("orca-pow2", reserve_pow2),
    "orca-oracle": lambda: ContiguousAllocation("orca-oracle", reserve_oracle),
}
