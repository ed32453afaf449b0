"""KV allocation: paged (on demand, block by block) or a contiguous-reservation baseline.

The baselines are the vLLM paper's stand-ins for pre-paging systems (Orca): each
sequence reserves one contiguous region at admission. They differ in how much they
reserve (the simulator knows each request's real output length through max_tokens):
  orca-max     max_model_len slots, whatever the request
  orca-pow2    the next power of two >= the real total length (prompt + output)
  orca-oracle  exactly the real total length
"""
from __future__ import annotations

from core.request import Request


def _total(request: Request, max_model_len: int) -> int:
    out = request.params.max_tokens if request.params.max_tokens is not None else max_model_len
    return min(request.num_prompt_tokens + out, max_model_len)


def reserve_max(request: Request, max_model_len: int) -> int:
    return max_model_len


def reserve_pow2(request: Request, max_model_len: int) -> int:
    return min(1 << (_total(request, max_model_len) - 1).bit_length(), max_model_len)


def reserve_oracle(request: Request, max_model_len: int) -> int:
    return _total(request, max_model_len)


# make("allocation", name) returns the reservation rule, or None for paged allocation.
ALLOCATIONS = {
    "paged": lambda: None,
    "orca-max": lambda: reserve_max,
    "orca-pow2": lambda: reserve_pow2,
    "orca-oracle": lambda: reserve_oracle,
}
