"""PP vs TP in the simulator: Llama-2-70B on 8 A100-80G GPUs split as TP8, TP4 x PP2,
TP2 x PP4 and PP8 (every split fits in memory), ShareGPT at several Poisson rates.

    python -m plots.pipeline                    # plots/figures/pp_vs_tp.{png,json}, ~2 minutes
    python -m plots.pipeline --scale small --out /tmp/figs

Each point is one `python -m sim run` (in a subprocess, like plots/experiments.py); the
figure and a JSON of the points' key numbers go to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from plots import figures
from plots.experiments import ROOT, sim

TRACE = "traces/sharegpt.json"
DEPLOYMENT = ["--model", "Llama-2-70B", "--hardware", "A100-80G"]
LAYOUTS = ((8, 1), (4, 2), (2, 4), (1, 8))          # (tp, pp): 8 GPUs each
SCALES = {"small": {"num_requests": 150, "rates": [2, 8]},
          "full": {"num_requests": 2000, "rates": [2, 4, 8, 12, 16, 24]}}
KEYS = ("request_throughput", "output_throughput", "median_ttft", "p90_ttft", "median_tpot", "p90_tpot",
        "num_gpu_blocks", "num_preemptions", "running_mean")


def layout_name(tp: int, pp: int) -> str:
    return f"TP{tp}" if pp == 1 else (f"PP{pp}" if tp == 1 else f"TP{tp} x PP{pp}")


def run(scale: str, results: Path, log=print) -> list[dict]:
    """One `sim run` per layout and rate; rows of their summaries' key numbers."""
    p = SCALES[scale]
    rows = []
    for tp, pp in LAYOUTS:
        for rate in p["rates"]:
            out = Path(results) / f"tp{tp}_pp{pp}" / f"rate{rate:g}"
            started = time.perf_counter()
            sim("run", TRACE, *DEPLOYMENT, "--tensor-parallel-size", tp, "--pipeline-parallel-size", pp, "--rate", rate, "--num-requests",
                p["num_requests"], "--quiet", "--overwrite", "--out", out)
            summary = json.loads((out / "summary.json").read_text())
            row = {"layout": layout_name(tp, pp), "tp": tp, "pp": pp, "rate": rate,
                   **{k: summary[k] for k in KEYS}}
            if "pipeline" in summary:
                row["stage_busy"] = summary["pipeline"]["stage_busy"]
            rows.append(row)
            if log:
                log(f"{row['layout']:<10} rate {rate:>4g}: {row['output_throughput']:>7,.0f} tok/s, "
                    f"TTFT p50/p90 {row['median_ttft'] * 1e3:,.0f}/{row['p90_ttft'] * 1e3:,.0f} ms, TPOT p50/p90 "
                    f"{row['median_tpot'] * 1e3:.1f}/{row['p90_tpot'] * 1e3:.1f} ms "
                    f"({time.perf_counter() - started:.1f} s)")
    return rows


def draw(rows: list[dict], out: Path, num_requests: int) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "pp_vs_tp.json"
    figures.write_json(data, rows)
    png = figures.pp_vs_tp(rows, out / "pp_vs_tp.png",
                           title=f"Llama-2-70B on 8x A100-80G (NVLink), ShareGPT x{num_requests}, Poisson arrivals")
    return [png, data]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m plots.pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="full", help="(default: full)")
    ap.add_argument("--out", default=str(ROOT / "plots" / "figures"), metavar="DIR",
                    help="figure directory (default: plots/figures)")
    ap.add_argument("--results", default=str(ROOT / "results" / "pp_vs_tp"), metavar="DIR",
                    help="where the simulator's results go (default: results/pp_vs_tp)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rows = run(args.scale, Path(args.results))
    for path in draw(rows, Path(args.out), SCALES[args.scale]["num_requests"]):
        print(f"wrote {path}")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
