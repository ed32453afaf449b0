"""A served run's logged steps against a cost model: the rows a served calibration fits
(`sim.twin.calibrate`) and how fast a whole run went against its price (`sim.twin.validate`,
`sim.twin.tables`). Reads step logs; serves and simulates nothing."""
from __future__ import annotations

from pathlib import Path

from core.cost.fit import ServedStep, StepCostEvaluator, calibrated_seconds, phase_of, shape_of, wake_params
from core.cost.step_log import is_vllm_log, load_log, loop_step_seconds, steps_since_idle


def step_rows(steps: list[dict], evaluator: StepCostEvaluator, basis: str, vllm: bool = False,
              arrivals: list[dict] | None = None) -> list[ServedStep]:
    """(phase, seqs, tokens, grid model's prediction, logged seconds, place after idle) per
    logged step: CPU seconds of the stepping thread for a CPU-basis profile, else wall
    seconds; of a vLLM log (`vllm`), a step's seconds run to the next step's schedule(), as
    `bench fit-vllm` fits them (core.cost.step_log.loop_step_seconds; `arrivals` tell its
    idle gaps, and every log's steps' places after idle: steps_since_idle)."""
    key = "cpu_s" if basis == "cpu" else "step_s"
    if vllm and key != "step_s":
        raise ValueError("a vLLM log has wall seconds only: its cost model is a wall-basis one")
    places = steps_since_idle(steps, arrivals)
    place = {id(s): k for s, k in zip(steps, places)}
    timed = loop_step_seconds(steps, arrivals, places) if vllm else [(s, s.get(key)) for s in steps]
    rows = []
    for s, seconds in timed:
        batch = s["decision"]["batch"]
        if not batch:
            continue
        if seconds is None:
            raise ValueError(f"step {s.get('step')}: no {key} in the step log (a {basis}-basis profile needs it)")
        seqs, tokens, context, pairs = shape_of([b[1] for b in batch], [b[2] for b in batch])
        predicted = evaluator.grid_step_time(seqs, tokens, context, pairs)
        rows.append(ServedStep(phase_of(seqs, tokens), seqs, tokens, predicted, seconds, place[id(s)]))
    return rows


def log_step_rows(log: Path | str, evaluator: StepCostEvaluator, basis: str) -> list[ServedStep]:
    """`step_rows` of a step log file, vLLM's or ours."""
    config, arrivals, steps, _ = load_log(str(log))
    return step_rows(steps, evaluator, basis, vllm=is_vllm_log(config), arrivals=arrivals)


def served_ratio(model: dict, log: Path) -> tuple[float, float]:
    """(logged over grid-predicted seconds, the calibrated model's over the grid's) summed
    over a run's steps: how much slower than the profile the run was, and how much slower
    the calibrated model prices exactly those steps. Their quotient is the run's speed
    against the calibrated model: its host state (1: the steps cost what they are priced)."""
    grid = StepCostEvaluator({k: v for k, v in model.items() if k not in ("served", "client")})
    rows = log_step_rows(log, grid, model.get("profile", {}).get("time_basis", "wall"))
    factors, wake = model.get("served", {}).get("factors", {}), wake_params(model, str(log))
    g = sum(r.predicted for r in rows)
    if not g:
        raise ValueError(f"{log}: no executed step to price")
    return sum(r.measured for r in rows) / g, sum(calibrated_seconds(r, factors, wake) for r in rows) / g
