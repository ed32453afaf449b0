"""A step-cost model of vLLM fitted on its own steps (`core.cost.step_log` logs written by
`realexec/bench/peers/vllm_recorder.py`: `bench record-vllm` offline, `sim validate` /
`sim calibrate --real vllm` served). Pure: no vLLM, no torch; the fit is
`core.cost.fit.fit_step_cost`'s, as for a profile of our engine."""
from __future__ import annotations


def fit_samples(steps: list[dict], arrivals: list[dict] | None = None) -> list[dict]:
    """Fit samples (core.cost.fit) from a vLLM recording's steps: `execute_s` is the model
    run (schedule() returned -> update_from_output() called), `overhead_s` the rest of the
    step loop: schedule, update, and the gap until the next step's schedule() (output
    processing and detokenization in vLLM's front end: not zero, see issue 30); the steps
    and their loop seconds are `core.cost.step_log.loop_step_seconds`' (no last step, no
    step before an idle gap: one the engine waited in for `arrivals`)."""
    from core.cost.fit import shape_of
    from core.cost.step_log import loop_step_seconds

    out = []
    for rec, seconds in loop_step_seconds(steps, arrivals):
        batch = rec["decision"]["batch"]
        seqs, tokens, context, pairs = shape_of([b[1] for b in batch], [b[2] for b in batch])
        execute = rec["execute_s"]
        out.append({"seqs": seqs, "tokens": tokens, "context": context, "pairs": pairs,
                    "execute_s": max(execute, 1e-9), "overhead_s": max(seconds - execute, 1e-9),
                    "step_s": seconds, "wall_execute_s": execute})
    return out


def fit_logs(paths: list[str], folds: int = 5) -> dict:
    """A `twinserve-step-cost` model (what `sim run --cost-model` reads) fitted on the steps
    of one or more vLLM recordings; ValueError when one is not a vLLM log or a phase
    (prefill, decode) has no steps."""
    from core.cost.fit import PHASES, check_model, fit_step_cost, phase_of
    from core.cost.step_log import load_log

    samples, configs = [], []
    for path in paths:
        config, arrivals, steps, _finishes = load_log(path)
        if config.get("engine") != "vllm":
            raise ValueError(f"{path}: not a vLLM recording (no engine 'vllm' in its config record)")
        samples += fit_samples(steps, arrivals)
        configs.append(config)
    for phase in PHASES:
        n = sum(1 for s in samples if phase_of(s["seqs"], s["tokens"]) == phase)
        if n < folds:
            hint = (" (vLLM took every prompt in one step: record more requests, or smaller prefill steps "
                    "with `-- --max-num-batched-tokens 256`)" if phase == "prefill" else "")
            raise ValueError(f"{', '.join(paths)}: {n} {phase} steps, the fit needs at least {folds}{hint}")
    model = fit_step_cost(samples, k=folds)
    sc, cc, v = configs[0]["scheduler"], configs[0]["cache"], configs[0]["vllm"]
    model["engine"] = {"num_gpu_blocks": cc["num_gpu_blocks"], "block_size": cc["block_size"],
                       "max_model_len": sc["max_model_len"], "max_num_seqs": sc["max_num_seqs"],
                       "max_num_batched_tokens": sc["max_num_batched_tokens"],
                       "enable_chunked_prefill": sc["enable_chunked_prefill"],
                       "enable_prefix_caching": cc["enable_prefix_caching"], "watermark": 0.0, "swap_space": 0.0,
                       "queue_policy": "fcfs", "preemption_mode": "recompute"}
    model["profile"] = {"engine": "vllm", "vllm_version": v.get("version"), "model": v.get("model"),
                        "time_basis": "wall", "fitted_on": [str(p) for p in paths],
                        "commands": [c["vllm"].get("command") for c in configs]}
    model["samples"] = samples
    check_model(model, "the fitted vLLM model")
    return model
