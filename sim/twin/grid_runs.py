"""Served grid runs: the staircase of `core.cost.grid_workload` sent at once to a real
server (`sim.twin.validate.run_real`), so that its logged steps cover every decode batch
size up to the deployment's sequence limit, in the served regime.

`sim.twin.tables --real vllm` serves one per scenario before its calibration runs and fits
vLLM's step costs on them and the calibration runs together: a trace slice at one load
visits a few batch sizes (the queueing load's calibration runs decoded 1-4 and 8 sequences
but not 5-7, which its validation runs did, and vLLM's CPU backend decodes 5-6 sequences
~20% faster than 8: priced as 8, the queueing load's median TTFT came out +17-26%).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple


class Grid(NamedTuple):
    """A staircase: decode batches of `max_seqs` down to 1 sequences, `steps_per_size` steps
    each, prompts of 8..`max_prompt` tokens (small enough that the deployment's KV pool holds
    every request at once: a grid run should not preempt)."""
    max_seqs: int
    steps_per_size: int
    max_prompt: int


def write_grid_trace(path: Path, grid: Grid, pool: list[int]) -> int:
    """The staircase as a trace file (every request at t=0); returns its request count."""
    from core.cost.grid_workload import staircase
    from traces import Trace, TraceRequest, save_trace

    reqs = staircase(pool, grid.max_seqs, grid.steps_per_size, grid.max_prompt)
    save_trace(Trace([TraceRequest(f"grid-{i}", 0.0, len(r["prompt_token_ids"]), r["max_tokens"],
                                   prompt_token_ids=r["prompt_token_ids"]) for i, r in enumerate(reqs)],
                     f"served grid: a staircase of {grid.max_seqs} sequences, {grid.steps_per_size} steps each"),
               path)
    return len(reqs)


def grid_args(grid: Grid, trace: Path, engine_args: str, real: str, vllm_python: str | None,
              model_dir: str | None) -> argparse.Namespace:
    """`run_real`'s arguments for a grid run: all at once, outputs uncapped."""
    return argparse.Namespace(trace=str(trace), rate=float("inf"), num_requests=grid.max_seqs, engine_args=engine_args,
                              max_tokens_cap=grid.steps_per_size * grid.max_seqs + 1, skip=0, seed=0, real=real,
                              vllm_python=vllm_python, model_dir=model_dir)


def serve_grid(folder: Path, grid: Grid, source_trace: str, engine_args: str, real: str,
               vllm_python: str | None = None, model_dir: str | None = None, skip: int = 0):
    """Serve the grid once into `folder` -> run_real's (step log, bench result, machine)."""
    from core.cost.grid_workload import staircase_prompts
    from sim.twin.validate import run_real
    from traces import TraceError
    from traces.build import prompt_token_pool

    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / "grid.json"
    try:
        pool = prompt_token_pool(source_trace, sum(staircase_prompts(grid.max_seqs, grid.max_prompt)), skip)
    except TraceError as e:
        raise ValueError(f"the grid run's prompts: {e}") from None
    write_grid_trace(trace, grid, pool)
    return run_real(grid_args(grid, trace, engine_args, real, vllm_python, model_dir), folder, 1)
