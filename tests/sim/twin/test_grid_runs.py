"""sim.twin.grid_runs: the served grid run's workload, and what it is for: its staircase
makes a scheduler decode every batch size from the limit down to 1 for the same number of
steps (checked through our own vLLM-v1 policy, which takes vLLM's decisions step for step:
tests/sim/twin/test_vllm_logs.py)."""
from __future__ import annotations

import argparse
import collections

import pytest

from core.cost.grid_workload import staircase, staircase_prompts
from sim.config import SimConfig
from sim.run import simulate
from sim.twin.grid_runs import Grid, grid_args, write_grid_trace
from sim.twin.tables import VLLM_GRIDS, VLLM_SCENARIOS, serve_grids
from traces import Trace, TraceRequest, load_trace

POOL = list(range(1000, 60_000))


def _decode_batches(grid: Grid, **config) -> collections.Counter:
    reqs = staircase(POOL, grid.max_seqs, grid.steps_per_size, grid.max_prompt)
    trace = Trace([TraceRequest(f"g{i}", 0.0, len(r["prompt_token_ids"]), r["max_tokens"],
                                prompt_token_ids=r["prompt_token_ids"]) for i, r in enumerate(reqs)], "grid")
    cfg = SimConfig(model="SmolLM2-135M", hardware="cpu-2core", scheduler="vllm-v1", enable_chunked_prefill=True,
                    max_num_seqs=grid.max_seqs, event_skipping=False, **config)
    result = simulate(cfg, trace)
    assert all(r.num_preemptions == 0 for r in result.records)
    return collections.Counter(row.batch_size for row in result.timeseries
                               if row.steps and row.batch_tokens == row.batch_size)


@pytest.mark.parametrize("scenario", list(VLLM_GRIDS))
def test_the_staircase_decodes_every_batch_size_for_steps_per_size_steps(scenario):
    """The tables' grids on their scenarios' KV pools: decode batches of every size from the
    limit down to 1, steps_per_size steps each, without preemption. (The light grid's
    prompts, 2,090 tokens, overrun one step's 2,048-token budget: the longest prompt's last
    chunk rides with the others' first decode, and that request then decodes one step
    after the others: one step moves from the full batch to the single sequence.)"""
    grid = VLLM_GRIDS[scenario]
    k, n = grid.steps_per_size, grid.max_seqs
    config = {"block_size": 32, "num_gpu_blocks": 20, "max_model_len": 640} if scenario == "queueing" else {}
    counts = _decode_batches(grid, **config)
    overrun = sum(staircase_prompts(n, grid.max_prompt)) > 2048
    want = {size: k for size in range(1, n + 1)}
    if overrun:
        want[n], want[1] = k - 1, k + 1
    assert counts == want


def test_the_queueing_grid_fits_the_queueing_deployments_kv_pool():
    """Its 8 requests hold at most 20 blocks of 32 tokens at once (vLLM's pool in the queueing
    scenario's flags: --num-gpu-blocks-override 21, one the null block)."""
    assert "--block-size 32 --num-gpu-blocks-override 21" in VLLM_SCENARIOS["queueing"][2]
    grid = VLLM_GRIDS["queueing"]
    reqs = staircase(POOL, grid.max_seqs, grid.steps_per_size, grid.max_prompt)
    assert sum(-(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // 32) for r in reqs) <= 20


def test_the_grid_trace_carries_the_exact_prompts_and_lengths(tmp_path):
    grid = Grid(4, 3, 16)
    n = write_grid_trace(tmp_path / "g.json", grid, POOL)
    trace = load_trace(tmp_path / "g.json")
    want = staircase(POOL, 4, 3, 16)
    assert n == 4 and len(trace.requests) == 4
    for r, w in zip(trace.requests, want):
        assert list(r.prompt_token_ids) == w["prompt_token_ids"] and r.output_len == w["max_tokens"]
        assert r.arrival_time == 0.0
    args = grid_args(grid, tmp_path / "g.json", "--enforce-eager", "vllm", "/py", "/m")
    assert args.rate == float("inf") and args.num_requests == 4
    assert args.max_tokens_cap >= max(w["max_tokens"] for w in want)      # outputs uncapped


def test_reusing_runs_without_their_grid_runs_says_which_is_missing(tmp_path):
    args = argparse.Namespace(scenarios=["light"], reuse_real=True)
    with pytest.raises(ValueError, match=r"--reuse-real: grid run .*grid-light is missing \(or give --profile\)"):
        serve_grids(args, tmp_path)
    (tmp_path / "grid-light").mkdir()
    (tmp_path / "grid-light" / "real1.steps.jsonl").write_text("")
    assert serve_grids(args, tmp_path) == [tmp_path / "grid-light" / "real1.steps.jsonl"]

