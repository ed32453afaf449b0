"""`python -m sim calibrate TRACE --cost-model profile.json --out served.json`: calibrate a
profile on served steps.

The profile (`python -m realexec profile`) times steps back to back on an idle engine.
Served steps cost more CPU for the same batch sums (SmolLM2 on CPU: 1.1-1.4x; HTTP and
streaming threads on the other core, a new shape every step, decode batches of mixed
context lengths), and a client sees its tokens later than the engine makes them. This
command serves a calibration slice of the trace (`--skip` requests in, another arrival
seed: keep it disjoint from any validation slice) at one or more loads, through the same
`realexec serve --step-log` + `realexec bench serve` runs as `sim validate`, and writes a
copy of the profile with two more sections:
  * `served`: per phase (or phase and batch-size or prefill-size bucket) the ratio of the
    logged steps' seconds to the profile's prediction for the same shapes; the family is chosen by
    k-fold held-out error of the total time (`core.cost.fit.fit_served_scale`), printed;
  * `jitter`: how much served steps scatter around that prediction within a run (sd of
    the log ratio, step-to-step correlation), drawn per step by `--jitter-seed`, and how
    much whole runs do (`run_sigma`: sd of the runs' mean log ratios; reported, not drawn);
  * `client`: the median extra seconds between the engine making a request's first / last
    token (measured from when the request reached the server) and the client receiving
    it (HTTP in, streaming out); `sim validate` adds them to the simulated latencies; and
    `intake_s`, the median seconds from a request reaching the server to reaching the
    engine, over the requests that found the engine idle (a busy engine hides them in
    its step in flight): `sim validate` hands each request to the engine that much later;
  * `wake`: what the first steps after the engine sat idle cost on top of the served
    factors (which are fitted on the other steps).

With `--real vllm --vllm-python PATH --model-dir DIR` the calibration runs are `vllm serve`'s
(its scheduler's steps recorded; --load's flags are vllm serve's), and without
--cost-model vLLM's step costs are first fitted on those served steps
(`core.cost.vllm_fit`), then calibrated as above. `--grid` adds served grid runs to that
fit (`sim.twin.grid_runs`: a staircase of requests sent at once, so that the fit sees every
decode batch size up to a limit, which a trace slice at one load does not visit).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from core.cost.fit import StepCostEvaluator, check_model, fit_served_and_wake, fit_step_jitter, summarize_errors
from core.cost.step_log import first_visible_index, intake_seconds, is_vllm_log, load_log, sample_times
from sim.config import positive_int
from sim.twin.served_steps import step_rows
from sim.twin.vllm_serve import add_real_engine_arguments, check_real_engine

DEFAULT_PROFILE = "results/profile.json"
DEFAULT_SKIP = 100          # calibration requests start here: past every validation slice in the README
DEFAULT_LOADS = ["0.5:30", "4:20:--num-gpu-blocks 40 --max-num-seqs 8"]     # twin_tables' two scenarios


def parse_load(text: str) -> dict:
    """'RATE:N' or 'RATE:N:ENGINE ARGS' -> {'rate', 'num_requests', 'engine_args'}."""
    parts = text.split(":", 2)
    try:
        rate, n = float(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"--load {text!r}: expected RATE:N[:ENGINE ARGS], e.g. "
                                         f"'4:20:--num-gpu-blocks 40'") from None
    if not rate > 0 or n < 1:
        raise argparse.ArgumentTypeError(f"--load {text!r}: the rate must be > 0 and N >= 1")
    return {"rate": rate, "num_requests": n, "engine_args": parts[2] if len(parts) > 2 else ""}


def parse_grid(text: str) -> dict:
    """'SEQS:STEPS:MAX_PROMPT[:ENGINE ARGS]' -> {'grid': Grid, 'engine_args'}."""
    from sim.twin.grid_runs import Grid

    parts = text.split(":", 3)
    try:
        grid = Grid(int(parts[0]), int(parts[1]), int(parts[2]))
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"--grid {text!r}: expected SEQS:STEPS:MAX_PROMPT[:ENGINE ARGS], e.g. "
                                         f"'8:4:24:--block-size 32'") from None
    if min(grid) < 1:
        raise argparse.ArgumentTypeError(f"--grid {text!r}: SEQS, STEPS and MAX_PROMPT must be >= 1")
    return {"grid": grid, "engine_args": parts[3] if len(parts) > 3 else ""}


def add_parser(sub) -> None:
    from sim.twin.validate import add_warmup_argument

    p = sub.add_parser("calibrate", help="scale a profile to served steps (serve a calibration slice, fit)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("trace", metavar="TRACE", help="trace file (any traces format)")
    p.add_argument("--cost-model", default=None, metavar="FILE",
                   help=f"`python -m realexec profile` output (default: {DEFAULT_PROFILE}, where profile writes "
                        f"it); with --real vllm a `realexec bench fit-vllm` model, and by default none: vLLM's step "
                        f"costs are fitted on the calibration runs' own steps")
    p.add_argument("--out", default="results/calibrated.json", metavar="FILE",
                   help="write the calibrated cost model here (JSON; default: %(default)s)")
    p.add_argument("--load", type=parse_load, action="append", metavar="RATE:N[:ENGINE ARGS]",
                   help="a calibration run: N requests at RATE req/s, optional `realexec serve` flags; "
                        "repeat for several loads (default: 0.5:30 and 4:20:--num-gpu-blocks 40 --max-num-seqs 8)")
    p.add_argument("--grid", type=parse_grid, action="append", default=[],
                   metavar="SEQS:STEPS:MAX_PROMPT[:ENGINE ARGS]",
                   help="--real vllm, no --cost-model: also serve a grid run (SEQS requests at once with prompts "
                        "of 8..MAX_PROMPT tokens, decoding SEQS..1 sequences for STEPS steps each; size it so "
                        "that the deployment's KV pool holds them all) and fit on its steps too; repeatable")
    p.add_argument("--skip", type=int, default=DEFAULT_SKIP, metavar="K",
                   help="leave out the trace's first K requests (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="arrival seed (default: %(default)s)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=16, metavar="N",
                   help="cap each request's output tokens (default: %(default)s)")
    p.add_argument("--folds", type=positive_int, default=5, help="cross-validation folds (default: %(default)s)")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="step logs and bench results of the calibration runs (default: OUT's name + .runs/)")
    p.add_argument("--reuse-real", action="store_true", help="fit on the runs already in --work")
    add_warmup_argument(p)
    add_real_engine_arguments(p, "--cost-model is then a `realexec bench fit-vllm` model, and --load's engine "
                                 "args are vllm serve flags")


def client_delay_samples(log: tuple, bench: dict) -> list[tuple[float, float]]:
    """(first, last) per request of a loaded step log (`load_log`'s tuple): seconds from the
    engine's first / last token (the end of the step that sampled it; the first is the first
    token with text, as a streaming client sees it; from the request reaching the server) to
    the client's. The bench result lists requests in sending order, the log by arrival at
    the server: they are paired in that order, and a pair whose prompt lengths differ is
    left out."""
    _, arrivals, steps, finishes = log
    arrivals = sorted(arrivals, key=lambda a: a.get("t_arrival", a["t"]))
    times = sample_times(steps)
    out = []
    for a, ttft, itl, n_in, err in zip(arrivals, bench["ttfts"], bench["itls"], bench["input_lens"], bench["errors"]):
        rid = a["req_id"]
        if err or ttft is None or rid not in times or len(a["prompt_token_ids"]) != n_in:
            continue
        t0, t = a.get("t_arrival", a["t"]), times[rid]
        first = t[min(first_visible_index(finishes.get(rid)), len(t) - 1)]
        out.append((ttft - (first - t0), ttft + sum(itl) - (t[-1] - t0)))
    return out


def calibrate(model: dict, runs: list[tuple[Path, dict]], folds: int = 5) -> dict:
    """The profile `model` with `served` and `client` sections fitted on the calibration
    runs: (step log, bench result) each."""
    check_model(model)
    evaluator = StepCostEvaluator({k: v for k, v in model.items() if k not in ("served", "client")})
    basis = model.get("profile", {}).get("time_basis", "wall")
    per_run, delays, intakes = [], [], []
    for log, bench in runs:
        loaded = config, arrivals, steps, _ = load_log(str(log))
        per_run.append(step_rows(steps, evaluator, basis, vllm=is_vllm_log(config), arrivals=arrivals))
        delays += client_delay_samples(loaded, bench)
        intakes += intake_seconds(steps, arrivals)
    rows = [r for run in per_run for r in run]
    if not delays:
        raise ValueError("no request of the calibration runs could be paired with its bench result")
    out = dict(model)
    # the served factors price a busy engine's steps; the wake section the first few after idle
    out["served"], out["wake"] = fit_served_and_wake(rows, k=folds)
    out["served"]["rows"] = [list(r) for r in rows]
    out["client"] = {"first_token_s": statistics.median(d[0] for d in delays),
                     "last_token_s": statistics.median(d[1] for d in delays), "n": len(delays),
                     "intake_s": max(0.0, statistics.median(intakes)) if intakes else 0.0, "intake_n": len(intakes),
                     "first_token": summarize_errors([d[0] for d in delays]),
                     "last_token": summarize_errors([d[1] for d in delays])}
    out["jitter"] = fit_step_jitter(per_run, out["served"]["factors"], out["wake"]["factors"])
    check_model(out)
    return out


def jitter_scales(jitter: dict) -> str:
    """A jitter section's time scales in words: the fast part's lag-1 correlation, and the
    slow part's share of the variance and correlation where it has one."""
    text = f"lag-1 correlation {jitter['phi']:.2f}"
    if jitter.get("slow_share"):
        text += (f", {jitter['slow_share'] * 100:.0f}% of the variance slow "
                 f"(lag-1 correlation {jitter['slow_phi']:.2f})")
    return text


def format_report(model: dict) -> str:
    served, client = model["served"], model["client"]
    rows = served["rows"]
    lines = [f"served calibration on {served['n']} logged steps "
             f"(grid model predicts {sum(r[3] for r in rows):.2f}s, logged {sum(r[4] for r in rows):.2f}s):",
             "held-out relative error (k-fold over the steps): all folds' total | fold total mean | "
             "fold strata | single steps median, per family"]
    for fam, e in served["held_out"].items():
        mark = "*" if fam == served["family"] else " "
        strata = e.get("strata", {}).get("mean", float("nan"))
        lines.append(f"  {mark} {fam:12s} pooled {e.get('pooled', float('nan')) * 100:5.1f}% | total "
                     f"{e['total']['mean'] * 100:5.1f}% | per stratum {strata * 100:5.1f}% | step median "
                     f"{e['step']['median'] * 100:5.1f}%  (n={e['step']['n']})")
    lines.append("factors: " + (", ".join(f"{k} x{v:.3f}" for k, v in sorted(served["factors"].items())) or "none"))
    wake = model.get("wake")
    if wake:
        counts = wake.get("n") or [None] * len(wake["factors"])
        lines.append("first steps after the engine sat idle (wake): " + ", ".join(
            f"{i + 1}. x{f:.3f}" + (f" ({n} steps)" if n is not None else "")
            for i, (f, n) in enumerate(zip(wake["factors"], counts))))
    jitter = model.get("jitter")
    if jitter:
        lines.append(f"step jitter within a run (--jitter-seed): sd {jitter['sigma'] * 100:.1f}% of a step's time, "
                     f"{jitter_scales(jitter)} ({jitter['n']} steps of {jitter['runs']} runs); "
                     f"whole runs differ by sd {jitter.get('run_sigma', 0.0) * 100:.1f}% (host state; not drawn)")
    lines.append(f"client delay (median over {client['n']} requests): first token +{client['first_token_s'] * 1e3:.1f} ms, "
                 f"last token +{client['last_token_s'] * 1e3:.1f} ms after the engine made it")
    if client.get("intake_n"):
        lines.append(f"intake (median over the {client['intake_n']} requests that found the engine idle): a request "
                     f"reaches the engine +{client['intake_s'] * 1e3:.1f} ms after the server")
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from core.cost.fitted import load_cost_model_file
    from sim.twin.validate import run_real

    if args.cost_model is None and args.real == "twinserve":
        args.cost_model = DEFAULT_PROFILE
    model = None                  # --real vllm without --cost-model: fitted on the calibration runs below
    if args.cost_model is not None:
        if not Path(args.cost_model).exists():
            how = ("python -m realexec bench fit-vllm" if args.real == "vllm" else "python -m realexec profile")
            raise ValueError(f"--cost-model {args.cost_model}: no such file; write it with `{how} "
                             f"--out {args.cost_model}`")
        model = load_cost_model_file(args.cost_model)
        check_model(model, args.cost_model)
    if args.skip < 0:
        raise ValueError(f"--skip must be >= 0, got {args.skip}")
    check_real_engine(args)
    if args.real == "vllm" and not args.load:
        raise ValueError("--real vllm: give the calibration loads (--load RATE:N[:VLLM SERVE FLAGS]); the "
                         "default loads' flags are realexec serve's")
    if args.grid and (args.real != "vllm" or model is not None):
        raise ValueError("--grid serves runs for fitting vLLM's step costs: it needs --real vllm and no --cost-model "
                         "(our engine's grid is `python -m realexec profile`)")
    loads = args.load or [parse_load(t) for t in DEFAULT_LOADS]
    work = Path(args.work or f"{args.out}.runs")
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, load in enumerate(loads, 1):
        log, result = work / f"real{i}.steps.jsonl", work / f"real{i}.bench.json"
        if args.reuse_real:
            if not (log.exists() and result.exists()):
                raise ValueError(f"--reuse-real: calibration run {i} is not in {work}/")
        else:
            print(f"calibration run {i}/{len(loads)}: {load['num_requests']} requests (from #{args.skip}) at "
                  f"{load['rate']} req/s {shlex.quote(load['engine_args']) if load['engine_args'] else ''}",
                  file=sys.stderr, flush=True)
            run_args = argparse.Namespace(trace=args.trace, seed=args.seed, skip=args.skip,
                                          max_tokens_cap=args.max_tokens_cap, real=args.real,
                                          warmup_requests=args.warmup_requests,
                                          vllm_python=args.vllm_python, model_dir=args.model_dir, **load)
            log, result, _ = run_real(run_args, work, i)
        runs.append((log, json.loads(result.read_text())))
    if model is None:
        from core.cost.vllm_fit import fit_logs
        from sim.twin.grid_runs import serve_grid

        grid_logs = []
        for i, g in enumerate(args.grid, 1):
            folder = work / f"grid{i}"
            if args.reuse_real:
                if not (folder / "real1.steps.jsonl").exists():
                    raise ValueError(f"--reuse-real: grid run {i} is not in {folder}/")
            else:
                print(f"grid run {i}/{len(args.grid)}: {g['grid'].max_seqs} requests at once "
                      f"{shlex.quote(g['engine_args']) if g['engine_args'] else ''}", file=sys.stderr, flush=True)
                serve_grid(folder, g["grid"], args.trace, g["engine_args"], "vllm", args.vllm_python, args.model_dir,
                           args.skip + max(load["num_requests"] for load in loads))
            grid_logs.append(str(folder / "real1.steps.jsonl"))
        model = fit_logs(grid_logs + [str(log) for log, _ in runs], args.folds)
        print(f"fitted vLLM's step costs on {len(model['samples'])} served steps of the "
              + (f"{len(grid_logs)} grid and " if grid_logs else "") + "calibration runs", flush=True)
    out = calibrate(model, runs, folds=args.folds)
    out["calibration"] = {"real": args.real, "trace": args.trace, "skip": args.skip, "seed": args.seed,
                          "max_tokens_cap": args.max_tokens_cap, "loads": loads,
                          "grids": [dict(g, grid=g["grid"]._asdict()) for g in args.grid],
                          "profile": args.cost_model or "fitted on the calibration runs"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(format_report(out))
    print(f"wrote the calibrated cost model to {args.out}")
    return 0
