"""The profile grid as a workload: requests laid out so that an engine's steps cover every
decode batch size and a spread of prefill sizes, for engines we can only drive from the
outside (vLLM: `realexec bench profile-vllm` offline, and served runs of `sim.twin.tables
--real vllm`). Our own engine is profiled on its executor directly (`realexec profile`).

Why a grid and not just served traffic: an engine's step cost on CPU is not smooth in the
batch size (the matmul library picks its kernel by the row count: vLLM's CPU backend
decodes 3-6 sequences ~15% faster than 1, and 2 slowest), so a cost model must see every
batch size it will price; a trace slice at one load visits a few.

Pure: token ids in, request dicts out ({"prompt_token_ids", "max_tokens", "at_step"}).
"""
from __future__ import annotations

from typing import Iterable

PREFILL_LENGTHS = (8, 16, 32, 64, 128, 256, 512, 1024)


def staircase_prompts(n: int, max_prompt: int = 512) -> list[int]:
    """Prompt lengths of the staircase's n requests: geometric from 8 to max_prompt tokens."""
    if max_prompt < 1:
        raise ValueError(f"max_prompt must be >= 1, got {max_prompt}")
    lo = min(8, max_prompt)
    return [max(lo, round(lo * (max_prompt / lo) ** (i / max(1, n - 1)))) for i in range(n)]


def staircase(pool: list[int], n: int, steps_per_size: int, max_prompt: int = 512) -> list[dict]:
    """n requests, all at step 0, with prompts of spread lengths (`staircase_prompts`, each
    a different window of `pool`, so no prefix-cache hits) and staggered outputs: after
    their prefills the decode batch holds n, n - 1, ..., 1 sequences for `steps_per_size`
    steps each, over growing contexts (the longest prompt decodes longest). ValueError
    when `pool` is too short."""
    if n < 1 or steps_per_size < 1:
        raise ValueError(f"the staircase needs n >= 1 and steps_per_size >= 1, got {n} and {steps_per_size}")
    lengths = staircase_prompts(n, max_prompt)
    windows = _windows(pool, lengths)
    return [{"prompt_token_ids": w, "max_tokens": steps_per_size * (i + 1) + 1, "at_step": 0}
            for i, w in enumerate(windows)]


def grid_tokens(n: int, prefill_lengths: Iterable[int] = PREFILL_LENGTHS, max_prompt: int = 512) -> int:
    """Prompt tokens `profile_workload` takes from its pool."""
    return sum(staircase_prompts(n, max_prompt)) + 3 * sum(set(prefill_lengths))


def profile_workload(pool: list[int], n: int, steps_per_size: int,
                     prefill_lengths: Iterable[int] = PREFILL_LENGTHS, max_prompt: int = 512) -> list[dict]:
    """The staircase (`staircase`) and prefill probes:
    * each length twice into the running staircase, spread over its batch sizes (once
      longest first): mixed steps; one output token (a probe leaves at its prefill step);
    * each length once alone after it, two output tokens (the decode that follows ends the
      prefill step's loop time: `core.cost.step_log.loop_step_seconds` drops a step the
      engine idled after).
    Each request has "at_step": the engine step before which it enters."""
    lengths = sorted(set(int(x) for x in prefill_lengths))
    if not lengths or lengths[0] < 1:
        raise ValueError(f"prefill lengths must be >= 1 tokens, got {lengths}")
    need = grid_tokens(n, lengths, max_prompt)
    if len(pool) < need:
        raise ValueError(f"the token pool has {len(pool)} tokens, the grid needs {need} (use a longer trace slice)")
    out = staircase(pool, n, steps_per_size, max_prompt)
    used = sum(len(r["prompt_token_ids"]) for r in out)
    probes = lengths + lengths[::-1]
    windows = _windows(pool[used:], probes + lengths)
    first = 2 + used // 256                      # past the staircase's prefill (chunks of >= 256 tokens)
    stair_steps = steps_per_size * n             # the staircase's decode steps
    for j, w in enumerate(windows[:len(probes)]):
        out.append({"prompt_token_ids": w, "max_tokens": 1, "at_step": first + (j * stair_steps) // len(probes)})
    end = first + stair_steps + len(probes) + 4
    for j, w in enumerate(windows[len(probes):]):  # an idle engine jumps to each
        out.append({"prompt_token_ids": w, "max_tokens": 2, "at_step": end + 3 * j})
    return out


def _windows(pool: list[int], lengths: list[int]) -> list[list[int]]:
    if len(pool) < sum(lengths):
        raise ValueError(f"the token pool has {len(pool)} tokens, {sum(lengths)} needed")
    out, at = [], 0
    for length in lengths:
        out.append([int(t) for t in pool[at:at + length]])
        at += length
    return out
