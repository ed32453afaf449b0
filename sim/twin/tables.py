"""`python -m sim.twin.tables`: the twin's error tables in one command (~14 min on 2 idle cores).

1. Profiles the real engine (`python -m realexec profile`, full grid; or takes --profile).
2. Serves, per scenario, --rounds validation runs (the trace's first requests, arrival
   seed 0) interleaved with calibration runs (requests from --calibration-skip on, seed 1,
   the same load and engine flags): C0 V0 C1 V1 ... CR, the scenarios' rounds alternating
   (`sim.twin.rounds`). Each a fresh `realexec serve --step-log` process loaded by `realexec
   bench serve` (HTTP and streaming in the loop), in subprocesses: the simulator never
   imports the real engine.
3. Predicts every validation run with the profile calibrated (`sim calibrate`'s fit) on
   the calibration runs on either side of it, simulating that run's logged workload (the
   mean of JITTER_DRAWS simulations with the calibration runs' step jitter, and one
   without), and compares with the client's numbers. The scenarios:
  * light: 30 ShareGPT requests at 0.5 req/s, default engine (no queueing; 30, not 10,
    so that a p90 is not one request: `sim.twin.spread` measures it);
  * queueing: 20 requests at 4 req/s on 40 KV blocks of 16 tokens and at most 8
    sequences (requests queue, and the KV pool runs out: preemptions).
With `--real vllm --vllm-python PATH --model-dir DIR` the same design runs against `vllm
serve` (the loads in vLLM's flags: VLLM_SCENARIOS), and the profile is vLLM's step costs
fitted (`core.cost.vllm_fit`) on the served steps of a grid run per scenario, served first
(`sim.twin.grid_runs`: decode batches of every size up to the scenario's limit, which a
trace slice does not visit), and of every calibration run (or --profile, a `realexec bench
fit-vllm` / `profile-vllm` model); each round's calibration scales it.
Writes `tables.md` (per scenario: the error of the mean prediction against the mean real
run, the same at each validation run's own speed (the host term's oracle: the model priced
at what the run's logged steps measured), each round's error, the same with one
calibration made before everything and with the uncalibrated profile, the real runs'
spread; the factors per round, the held-out check of the pairing, load averages), each
scenario's `report.json`, calibrated models and per-round figures, and the runs under
`runs/`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from core.procs import run_child
from sim.twin.grid_runs import Grid
from sim.twin.rounds import (CALIBRATION, DESIGNS, PAIRINGS, VALIDATION, Slot, calibration_for, choose_pairing,
                        interior_calibration_runs, pairing_check, schedule)
from sim.twin.validate import JITTER_DRAWS
from sim.twin.vllm_serve import add_real_engine_arguments, check_real_engine

# name: (rate, requests, `realexec serve` flags); every scenario caps outputs at MAX_TOKENS
SCENARIOS = {
    "light": (0.5, 30, ""),
    "queueing": (4.0, 20, "--num-gpu-blocks 40 --max-num-seqs 8"),
}
# The same loads against `vllm serve` (--real vllm): the queueing one's small KV pool in
# vLLM's flags (20 usable blocks of 32 tokens; the CPU backend wants multiples of 32, and a
# max_model_len the pool can hold). Eager: no compile, as the recordings.
VLLM_SCENARIOS = {
    "light": (0.5, 30, "--enforce-eager"),
    "queueing": (4.0, 20, "--enforce-eager --block-size 32 --num-gpu-blocks-override 21 --max-model-len 640 "
                          "--max-num-seqs 8"),
}
# --real vllm: per scenario, one served grid run before the others (sim.twin.grid_runs): its
# decode batches of every size up to the scenario's sequence limit (queueing: 8 sequences, 16
# blocks of its 20 at once, no preemption), fitted together with the calibration runs.
VLLM_GRIDS = {"light": Grid(16, 6, 512), "queueing": Grid(8, 4, 24)}
GRID_SKIP = 300          # the grid's prompts: trace requests from here on (disjoint from both slices)
MAX_TOKENS = 16
CALIBRATION_SKIP, CALIBRATION_SEED = 100, 1


ROWS = ["output_throughput"] + [f"{q}_{m}" for m in ("ttft", "tpot", "e2el") for q in ("median", "p90")]
ROUNDS = 3


def _run(cmd: list[str], log: Path) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    with open(log, "w") as f:
        r = run_child(cmd, stdout=f, stderr=f)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[2]} failed ({r.returncode}); see {log}")


def parse_sizes(texts: list[str]) -> dict[str, int]:
    """--num-requests values 'SCENARIO=N' -> {scenario: N} (the scenarios' defaults for the rest)."""
    sizes = {name: n for name, (_, n, _) in SCENARIOS.items()}
    for text in texts:
        name, _, n = text.partition("=")
        if name not in SCENARIOS:
            raise ValueError(f"--num-requests {text!r}: unknown scenario {name!r} (one of {', '.join(SCENARIOS)})")
        try:
            sizes[name] = int(n)
        except ValueError:
            raise ValueError(f"--num-requests {text!r}: expected SCENARIO=N, e.g. light=30") from None
        if sizes[name] < 1:
            raise ValueError(f"--num-requests {text!r}: N must be >= 1")
    return sizes


def serve_args(slot: Slot, trace: str, calibration_skip: int, sizes: dict[str, int] | None = None,
               real: str = "twinserve", vllm_python: str | None = None,
               model_dir: str | None = None) -> argparse.Namespace:
    """`run_real`'s arguments for a slot: the scenario's load and engine flags (`real`'s:
    twinserve's or vLLM's), on the calibration slice (requests from `calibration_skip`,
    seed 1) or the validation one, both of `sizes[scenario]` requests (default: the
    scenario's)."""
    rate, n, engine = (VLLM_SCENARIOS if real == "vllm" else SCENARIOS)[slot.scenario]
    n = (sizes or {}).get(slot.scenario, n)
    cal = slot.role == CALIBRATION
    return argparse.Namespace(trace=trace, rate=rate, num_requests=n, engine_args=engine, max_tokens_cap=MAX_TOKENS,
                              skip=calibration_skip if cal else 0, seed=CALIBRATION_SEED if cal else 0,
                              real=real, vllm_python=vllm_python, model_dir=model_dir)


def serve_all(slots: list[Slot], serve, runs_dir: Path, reuse: bool = False) -> dict[Slot, tuple[Path, dict, dict]]:
    """Serve every slot in time order with `serve(slot, folder) -> (step log, bench result
    file, machine)` (or, with `reuse`, take the runs already in `runs_dir`):
    slot -> (step log, bench result, machine)."""
    runs = {}
    for i, slot in enumerate(slots):
        d = runs_dir / f"{i:02d}-{slot.name}"
        machine_file = d / "real1.machine.json"
        if reuse:
            if not machine_file.exists():
                raise ValueError(f"--reuse-real: run {d} is missing")
            log, result, machine = d / "real1.steps.jsonl", d / "real1.bench.json", json.loads(machine_file.read_text())
        else:
            d.mkdir(parents=True, exist_ok=True)
            print(f"[{time.strftime('%H:%M:%S')}] serving {i + 1}/{len(slots)}: {slot.name}", file=sys.stderr, flush=True)
            log, result, machine = serve(slot, d)
            machine_file.write_text(json.dumps(machine))
        runs[slot] = (log, json.loads(result.read_text()), machine)
    return runs


def serve_grids(args: argparse.Namespace, runs_dir: Path) -> list[Path]:
    """--real vllm: serve each scenario's grid run (VLLM_GRIDS) into runs_dir/grid-<scenario>
    (with --reuse-real, take the ones there); their step logs."""
    from sim.twin.grid_runs import serve_grid

    logs = []
    for name in args.scenarios:
        d = runs_dir / f"grid-{name}"
        if args.reuse_real:
            if not (d / "real1.steps.jsonl").exists():
                raise ValueError(f"--reuse-real: grid run {d} is missing (or give --profile)")
        else:
            print(f"[{time.strftime('%H:%M:%S')}] serving grid-{name}", file=sys.stderr, flush=True)
            serve_grid(d, VLLM_GRIDS[name], args.trace, VLLM_SCENARIOS[name][2], "vllm", args.vllm_python,
                       args.model_dir, GRID_SKIP)
        logs.append(d / "real1.steps.jsonl")
    return logs


def session_rows(slots: list[Slot], runs: dict, profile: dict):
    """slot -> its calibration rows (ServedStep per logged step), cached."""
    from core.cost.fit import StepCostEvaluator
    from sim.twin.served_steps import log_step_rows

    grid, basis, cache = StepCostEvaluator(profile), profile.get("profile", {}).get("time_basis", "wall"), {}

    def rows(slot: Slot):
        if slot not in cache:
            cache[slot] = log_step_rows(runs[slot][0], grid, basis)
        return cache[slot]
    return rows


def pick_pairing(slots: list[Slot], runs: dict, profile: dict, requested: str = "auto") -> tuple[str, dict]:
    """(pairing, held-out check): `requested`, or for "auto" the pairing whose fits predict
    left-out calibration runs best (validation runs play no part)."""
    check = pairing_check(slots, session_rows(slots, runs, profile))
    return (choose_pairing(check) if requested == "auto" else requested), check


def scenario_report(name: str, slots: list[Slot], runs: dict, profile: dict, profile_path: str,
                    out: Path, pairing: str | None, scenarios: dict = SCENARIOS) -> dict:
    """Per validation round of one scenario: the profile calibrated on the calibration runs
    `pairing` names (None: uncalibrated), the simulation of the round's logged workload,
    the real client's numbers (and per request the real and simulated latencies, in
    arrival order: `sim.twin.spread` computes statistics over the first requests)."""
    from core.cost.step_log import load_log
    from sim.twin.calibrate import calibrate
    from sim.twin.served_steps import served_ratio
    from sim.twin.validate import (bench_latencies, client_stats, cpu_share, draw, engine_stats, mean_stats,
                              rel_errors, run_noise, run_sim, run_sim_scaled, standard_error, workload_from_log)

    out.mkdir(parents=True, exist_ok=True)
    vals = [s for s in slots if s.role == VALIDATION and s.scenario == name]
    cals = [s for s in slots if s.role == CALIBRATION and s.scenario == name]
    once_path, calibrate_runs = None, pairing is not None
    if calibrate_runs:
        once_path = out / "calibrated.once.json"          # one calibration before everything: C0 alone
        once_path.write_text(json.dumps(calibrate(profile, [runs[cals[0]][:2]])))
    rounds, real, sim, once, base, steady, at_speed, sim_draws = [], [], [], [], [], [], [], []
    for i, v in enumerate(vals):
        log, bench, machine = runs[v]
        # each round its own jitter seeds: rounds fitted on the same runs share a model,
        # and their mean then averages len(vals) * JITTER_DRAWS distinct simulations
        seed = i * JITTER_DRAWS
        config, trace, engine = workload_from_log(log)
        real.append(client_stats(bench))
        steps = load_log(str(log))[2]
        entry = {"round": v.round, "machine": machine, "cpu_share": cpu_share(steps),
                 "preemptions": sum(len(s["decision"]["preempted"]) for s in steps)}
        path = profile_path
        if calibrate_runs:
            fed = calibration_for(slots, v, pairing)
            model = calibrate(profile, [runs[c][:2] for c in fed])
            path = str(out / f"calibrated.r{v.round}.json")
            Path(path).write_text(json.dumps(model))
            base.append(run_sim(config, trace, profile_path, engine["first_visible"]).stats)
            once.append(run_sim(config, trace, str(once_path), engine["first_visible"]).stats)
            steady.append(run_sim(config, trace, path, engine["first_visible"]).stats)
            actual, priced = served_ratio(model, log)
            entry.update(fed=[c.name for c in fed], family=model["served"]["family"],
                         factors=model["served"]["factors"], wake=model.get("wake"), client=model["client"],
                         validation_ratio=actual, predicted_ratio=priced,
                         calibration_ratios=[served_ratio(model, runs[c][0])[0] for c in fed])
            # the host term: the same model at the speed this run's steps actually had
            # (an oracle, not a prediction; what is left against the real run is the model's)
            at_speed.append(run_sim_scaled(model, actual / priced, out / f"calibrated.r{v.round}.run_speed.json",
                                           config, trace, engine["first_visible"], JITTER_DRAWS, seed).stats)
            entry["errors_at_run_speed"] = rel_errors(at_speed[-1], real[-1])
        # calibrated: the mean of JITTER_DRAWS simulations with the calibration runs' step jitter
        simulated = run_sim(config, trace, path, engine["first_visible"], JITTER_DRAWS if calibrate_runs else 0, seed)
        stats, sim_e2e, sim_batch, draws = simulated.stats, simulated.e2e, simulated.batch, simulated.latencies
        sim.append(stats)
        sim_draws.append(simulated.draw_stats)
        entry["latencies"] = {"real": bench_latencies(bench), "sim": draws[0], "sim_draws": draws}
        if calibrate_runs:
            entry["jitter"] = model.get("jitter")
        _, real_e2e = engine_stats(trace, engine)
        draw(out / f"round{v.round}.png", real_e2e, sim_e2e, engine["batch"], sim_batch)
        entry["errors"] = rel_errors(sim[-1], real[-1])
        rounds.append(entry)
    real_mean = mean_stats(real)
    errors = {"sim vs mean": rel_errors(mean_stats(sim), real_mean)}
    if calibrate_runs:
        errors["at the run's speed vs mean"] = rel_errors(mean_stats(at_speed), real_mean)
        errors["no jitter vs mean"] = rel_errors(mean_stats(steady), real_mean)
        errors["calibrated once vs mean"] = rel_errors(mean_stats(once), real_mean)
        errors["uncalibrated vs mean"] = rel_errors(mean_stats(base), real_mean)
    rate, _, engine_args = scenarios[name]
    n = len(runs[vals[0]][1]["ttfts"])               # the validation slice's requests
    report = {"scenario": name, "rate": rate, "num_requests": n, "engine_args": engine_args,
              "real": real, "sim": sim, "at_run_speed": at_speed, "no_jitter": steady, "once": once,
              "uncalibrated": base, "real mean": real_mean,
              "errors": errors, "noise": run_noise(real), "rounds": rounds, "pairing": pairing,
              # how far the two means could move by chance: the real runs' standard error,
              # and the simulator's Monte Carlo one over its jitter draws (NaN without them)
              "real_se": standard_error([[r] for r in real]), "sim_se": standard_error(sim_draws),
              "cpu_count": os.cpu_count()}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def markdown(report: dict) -> str:
    errors, noise, rounds = report["errors"], report["noise"], report["rounds"]
    per_round = [f"round {r['round'] + 1}" for r in rounds]
    cols = list(errors)
    real_se, sim_se = report.get("real_se"), report.get("sim_se")
    ses = ["real mean's SE (±)", "sim's Monte Carlo SE (±)"] if real_se and sim_se else []
    head = ["metric", "real mean"] + cols + per_round + ["noise (±)"] + ses
    lines = [f"**{report['scenario']}**: {report['num_requests']} requests at {report['rate']} req/s"
             + (f", `{report['engine_args']}`" if report["engine_args"] else "")
             + f", {len(rounds)} rounds; preemptions per round: " + ", ".join(str(r["preemptions"]) for r in rounds),
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in ROWS:
        scale, unit = (1.0, "tok/s") if k == "output_throughput" else (1e3, "ms")
        cells = [f"{k} ({unit})", f"{report['real mean'][k] * scale:.1f}"]
        cells += [f"{errors[c][k] * 100:+.1f}%" for c in cols]
        cells += [f"{r['errors'][k] * 100:+.1f}%" for r in rounds]
        cells.append(f"{noise[k] * 100:.1f}%")
        if ses:
            cells += [f"{real_se[k] * 100:.1f}%", "-" if math.isnan(sim_se[k]) else f"{sim_se[k] * 100:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if rounds and "factors" in rounds[0]:
        lines += ["| round | fitted on | family | factors | first steps after idle | "
                  "step jitter sd / corr. (+ slow part's share / corr.) | "
                  "client delay first/last, intake (ms) | calibration runs' served/profile | validation run's served/profile "
                  "| calibrated model on its steps |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rounds:
            factors = ", ".join(f"{k} x{v:.2f}" for k, v in sorted(r["factors"].items()))
            fed = " + ".join(r["fed"]) if len(r["fed"]) <= 2 else f"all {len(r['fed'])} calibration runs"
            jitter = r.get("jitter") or {}
            jitter_cell = f"{jitter['sigma'] * 100:.1f}% / {jitter['phi']:.2f}" if jitter else "-"
            if jitter.get("slow_share"):
                jitter_cell += f" + {jitter['slow_share'] * 100:.0f}% slow / {jitter['slow_phi']:.2f}"
            wake = " ".join(f"x{f:.2f}" for f in (r.get("wake") or {}).get("factors", [])) or "-"
            lines.append(f"| {r['round'] + 1} | {fed} | {r['family']} | {factors} | {wake} | {jitter_cell} | "
                         f"{r['client']['first_token_s'] * 1e3:.1f} / {r['client']['last_token_s'] * 1e3:.1f}, "
                         f"{r['client'].get('intake_s', 0.0) * 1e3:.1f} | "
                         + ", ".join(f"x{x:.3f}" for x in r["calibration_ratios"])
                         + f" | x{r['validation_ratio']:.3f} | x{r['predicted_ratio']:.3f} |")
        lines.append("")
    shares = ", ".join(f"{r['cpu_share'] * 100:.0f}%" for r in rounds if r["cpu_share"] is not None)
    loads = ", ".join(f"{r['machine']['loadavg_1m_before']:.2f}->{r['machine']['loadavg_1m_after']:.2f}" for r in rounds)
    lines += [f"engine thread on a core, per validation run: {shares or 'n/a'}; load average (1 min) per "
              f"validation run: {loads} on {report['cpu_count']} CPUs", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.twin.tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="traces/sharegpt.json", help="trace (default: %(default)s)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="use this `realexec profile` output instead of profiling first (with --real vllm: a "
                        "`realexec bench fit-vllm` model; by default vLLM's step costs are fitted on a served "
                        "grid run per scenario and all the calibration runs' steps, and each round's calibration "
                        "scales that fit)")
    add_real_engine_arguments(p, "the same loads in vLLM's flags")
    p.add_argument("--repeats", type=int, default=2, help="profile repeats (default: %(default)s)")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--num-requests", action="append", default=[], metavar="SCENARIO=N",
                   help="requests per run of a scenario, its calibration and validation slices alike (default: "
                        + ", ".join(f"{k}={v[1]}" for k, v in SCENARIOS.items()) + "); repeatable")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="validation runs per scenario (default: %(default)s)")
    p.add_argument("--design", choices=DESIGNS, default="interleaved",
                   help="interleaved: C0 V0 C1 V1 .. CR per scenario; sequential: every calibration run first "
                        "(default: %(default)s)")
    p.add_argument("--pairing", choices=("auto",) + PAIRINGS, default="auto",
                   help="which calibration runs a validation run's prediction is fitted on (sim.twin.rounds); auto: the "
                        "one whose fit predicts left-out calibration runs best (default: %(default)s)")
    p.add_argument("--no-calibration", action="store_true",
                   help="serve the validation runs only and validate the profile as it is")
    p.add_argument("--calibration-skip", type=int, default=CALIBRATION_SKIP, metavar="K",
                   help="calibration requests start at the trace's K-th (default: %(default)s; must be past "
                        "every validation slice)")
    p.add_argument("--reuse-real", action="store_true", help="take the served runs already in OUT/runs and only fit "
                                                             "and simulate again")
    p.add_argument("--out", default="results/twin", help="output folder (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        sizes = parse_sizes(args.num_requests)
    except ValueError as e:
        p.error(str(e))
    largest = max(sizes[name] for name in args.scenarios)
    if not args.no_calibration and args.calibration_skip < largest:
        p.error(f"--calibration-skip {args.calibration_skip} overlaps the validation slices "
                f"(the trace's first {largest} requests)")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.real == "vllm":
        if args.no_calibration and args.profile is None:
            p.error("--real vllm --no-calibration needs --profile (a `realexec bench fit-vllm` model): without "
                    "calibration runs there are no served steps to fit vLLM's step costs on")
    try:
        check_real_engine(args)
    except ValueError as e:
        p.error(str(e))
    from core.cost.fitted import load_cost_model_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py, t0 = sys.executable, time.monotonic()
    profile = args.profile
    if profile is None and args.real == "twinserve":
        profile = str(out / "profile.json")
        if not args.reuse_real:
            _run([py, "-m", "realexec", "profile", "--repeats", str(args.repeats), "--out", profile],
                 out / "profile.log")
    slots = schedule(args.scenarios, args.rounds, args.design, calibrate=not args.no_calibration)
    from sim.twin.validate import run_real

    def serve(slot: Slot, folder: Path):
        return run_real(serve_args(slot, args.trace, args.calibration_skip, sizes, args.real, args.vllm_python,
                                   args.model_dir), folder, 1)
    grid_logs = []
    if profile is None:            # vLLM: a served grid run per scenario first
        grid_logs = serve_grids(args, out / "runs")
    runs = serve_all(slots, serve, out / "runs", args.reuse_real)
    if profile is None:            # vLLM: its step costs fitted on the grid runs' and every calibration run's steps
        from core.cost.vllm_fit import fit_logs

        profile = str(out / "vllm-fit.json")
        fitted = fit_logs([str(log) for log in grid_logs] + [str(runs[s][0]) for s in slots if s.role == CALIBRATION])
        Path(profile).write_text(json.dumps(fitted))
    model = load_cost_model_file(profile)
    pairing, check = (None, {}) if args.no_calibration else pick_pairing(slots, runs, model, args.pairing)
    parts = [f"# twin validation{' of vLLM' if args.real == 'vllm' else ''} "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, profile {profile}, "
             f"{args.rounds} rounds, {args.design if pairing else 'uncalibrated'}"
             + (f", pairing: {pairing}" if pairing else "") + ")", "",
             "served in this order: " + " ".join([f"grid-{name}" for name in args.scenarios if grid_logs]
                                                 + [s.name for s in slots]), ""]
    if pairing:
        held = [s.name for s in interior_calibration_runs(slots)]
        parts += [f"Calibration slice: trace requests from #{args.calibration_skip}, seed {CALIBRATION_SEED}; "
                  "validation: the first ones, seed 0. Held-out check of the pairings on calibration runs alone "
                  f"(each of {', '.join(held)} left out and its total step time predicted by a fit on):", ""]
        parts += [f"    {name:10s} " + " ".join(f"{e * 100:+6.1f}%" for e in errs)
                  + (f"   mean |error| {sum(map(abs, errs)) / len(errs) * 100:.1f}%" if errs else "")
                  + ("   <- chosen" if name == pairing else "") for name, errs in check.items()]
        parts += ["", "`sim vs mean`: the mean of the rounds' predictions against the mean of the real runs (each "
                  f"prediction the mean of {JITTER_DRAWS} simulations with the calibration runs' step jitter, each round "
                  "its own jitter seeds); "
                  "`at the run's speed`: the same prediction with every step scaled so that the validation run's "
                  "own steps cost what they measured (its host state; an oracle, not a prediction: the rest of "
                  "the error is the model's, the difference from `sim` is the host's); "
                  "`no jitter`: the same calibrated model without jitter; "
                  "`round r`: that round's prediction against its own real run; `calibrated once`: fitted on the "
                  "scenario's first calibration run only (one calibration before the validation runs, as before "
                  "rounds); noise: the real runs' largest distance from their mean; the real mean's SE: its "
                  "standard error (the real runs' sd over the square root of their number); the sim's Monte Carlo "
                  "SE: the same for the mean prediction over its jitter draws. A difference within about twice "
                  "their combined SE is not resolved by this many runs.", ""]
    for name in args.scenarios:
        report = scenario_report(name, slots, runs, model, profile, out / name, pairing,
                                 VLLM_SCENARIOS if args.real == "vllm" else SCENARIOS)
        parts.append(markdown(report))
    parts.append(f"took {time.monotonic() - t0:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    text = "\n".join(parts) + "\n"
    (out / "tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
