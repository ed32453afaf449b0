"""`python -m sim.twin_tables`: the twin's error tables in one command (~7 min on 2 idle cores).

1. Profiles the real engine (`python -m realexec profile`, full grid; or takes --profile).
2. Calibrates it on served steps (`python -m sim calibrate`): each scenario's load and
   engine flags, served once on a calibration slice of the trace (requests from
   --calibration-skip on, arrival seed 1), disjoint from the validation slice (the trace's
   first requests, seed 0).
3. Validates the calibrated model at the two loads the README reports (`python -m sim
   validate`, each served and benchmarked twice), the uncalibrated profile beside it:
  * light: 10 ShareGPT requests at 0.5 req/s, default engine (no queueing);
  * queueing: 20 requests at 4 req/s on 40 KV blocks of 16 tokens and at most 8
    sequences (requests queue, and the KV pool runs out: preemptions).
Writes `tables.md` (both tables, the real runs' noise and CPU share, the machine's load
average) and each scenario's report and figure under --out. Real engine work runs in
subprocesses: the simulator never imports it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# name: (rate, requests, `realexec serve` flags); every scenario caps outputs at MAX_TOKENS
SCENARIOS = {
    "light": (0.5, 10, ""),
    "queueing": (4.0, 20, "--num-gpu-blocks 40 --max-num-seqs 8"),
}
MAX_TOKENS = 16
CALIBRATION_SKIP, CALIBRATION_SEED = 100, 1


def validate_args(name: str) -> list[str]:
    rate, n, engine = SCENARIOS[name]
    return ["--rate", str(rate), "--num-requests", str(n), "--max-tokens-cap", str(MAX_TOKENS)] \
        + (["--engine-args", engine] if engine else [])
ROWS = ["output_throughput"] + [f"{q}_{m}" for m in ("ttft", "tpot", "e2el") for q in ("median", "p90")]


def _run(cmd: list[str], log: Path) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[2]} failed ({r.returncode}); see {log}")


def markdown(name: str, report: dict) -> str:
    errors, noise, stats = report["errors"], report["noise"], report["stats"]
    contended = "sim (contended) vs mean" in errors
    baseline = "sim (baseline) vs mean" in errors
    head = ["metric", "real mean", "sim", "sim vs mean"] + (["sim (contended) vs mean"] if contended else []) \
        + (["uncalibrated profile vs mean"] if baseline else []) + ["noise (±)"]
    lines = [f"**{name}**: {report['num_requests']} requests at {report['rate']} req/s"
             + (f", `{report['engine_args']}`" if report["engine_args"] else "")
             + f", {report['preemptions_real']} preemption(s) in real run 1",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in ROWS:
        scale, unit = (1.0, "tok/s") if k == "output_throughput" else (1e3, "ms")
        cells = [f"{k} ({unit})", f"{stats['real mean'][k] * scale:.1f}", f"{stats['sim'][k] * scale:.1f}",
                 f"{errors['sim vs mean'][k] * 100:+.1f}%"]
        if contended:
            cells.append(f"{errors['sim (contended) vs mean'][k] * 100:+.1f}%")
        if baseline:
            cells.append(f"{errors['sim (baseline) vs mean'][k] * 100:+.1f}%")
        cells.append(f"{noise[k] * 100:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    shares = ", ".join(f"{s * 100:.0f}%" for s in report["cpu_share"] if s is not None)
    loads = ", ".join(f"{m['loadavg_1m_before']:.2f}->{m['loadavg_1m_after']:.2f}" for m in report["machine"])
    lines += ["", f"engine thread on a core, per real run: {shares or 'n/a'}"
              + (f" (contended sim: steps x{report['contention_scale']:.2f})" if report.get("contention_scale") else "")
              + f"; load average (1 min) per run: {loads} on {report['cpu_count']} CPUs", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.twin_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="traces/sharegpt.json", help="trace (default: %(default)s)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="use this `realexec profile` output instead of profiling first")
    p.add_argument("--repeats", type=int, default=2, help="profile repeats (default: %(default)s)")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--no-calibration", action="store_true",
                   help="validate the profile as it is (skip `sim calibrate` on served steps)")
    p.add_argument("--calibration-skip", type=int, default=CALIBRATION_SKIP, metavar="K",
                   help="calibration requests start at the trace's K-th (default: %(default)s; must be past "
                        "every validation slice)")
    p.add_argument("--out", default="results/twin", help="output folder (default: %(default)s)")
    args = p.parse_args(argv)
    largest = max(SCENARIOS[name][1] for name in args.scenarios)
    if not args.no_calibration and args.calibration_skip < largest:
        p.error(f"--calibration-skip {args.calibration_skip} overlaps the validation slices "
                f"(the trace's first {largest} requests)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py, t0 = sys.executable, time.monotonic()
    profile = args.profile
    if profile is None:
        profile = str(out / "profile.json")
        _run([py, "-m", "realexec", "profile", "--repeats", str(args.repeats), "--out", profile],
             out / "profile.log")
    cost_model, extra = profile, []
    if not args.no_calibration:
        cost_model, extra = str(out / "calibrated.json"), ["--baseline-cost-model", profile]
        loads = []
        for name in args.scenarios:
            rate, n, engine = SCENARIOS[name]
            loads += ["--load", f"{rate}:{n}" + (f":{engine}" if engine else "")]
        _run([py, "-m", "sim", "calibrate", args.trace, "--cost-model", profile, "--out", cost_model,
              "--work", str(out / "calibration"), "--skip", str(args.calibration_skip),
              "--seed", str(CALIBRATION_SEED), "--max-tokens-cap", str(MAX_TOKENS), *loads], out / "calibrate.log")
    parts = [f"# twin validation ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, profile {profile}"
             + ("" if args.no_calibration else f", calibrated on served steps: {cost_model} (trace requests "
                f"from #{args.calibration_skip}, seed {CALIBRATION_SEED}; validation: the first ones, seed 0)")
             + ")", ""]
    if not args.no_calibration:
        parts += ["```", (out / "calibrate.log").read_text().strip(), "```", ""]
    for name in args.scenarios:
        _run([py, "-m", "sim", "validate", args.trace, "--cost-model", cost_model, "--out", str(out / name),
              *validate_args(name), *extra], out / f"{name}.log")
        parts.append(markdown(name, json.loads((out / name / "report.json").read_text())))
    parts.append(f"took {time.monotonic() - t0:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    text = "\n".join(parts) + "\n"
    (out / "tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
