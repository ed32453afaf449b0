"""`python -m plots`: rerun the PagedAttention experiments and redraw plots/figures/.

    python -m plots                      # full scale (a couple of minutes on 2 cores)
    python -m plots --scale small --out /tmp/figs
    python -m plots --only sharing

See plots/experiments.py for what each experiment runs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from plots.experiments import ROOT, RUNNERS, SCALES, run_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plots", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=list(SCALES), default="full", help="(default: full)")
    p.add_argument("--out", default=str(ROOT / "plots" / "figures"), metavar="DIR",
                   help="figure directory (default: plots/figures)")
    p.add_argument("--results", default=str(ROOT / "results" / "figures"), metavar="DIR",
                   help="where the simulator's CSV/JSON results go (default: results/figures)")
    p.add_argument("--only", default=None, metavar="NAMES", help=f"comma-separated subset of {','.join(RUNNERS)}")
    args = p.parse_args(argv)
    only = [x.strip() for x in args.only.split(",")] if args.only else None
    if only and set(only) - set(RUNNERS):
        p.error(f"--only: unknown experiment(s) {', '.join(sorted(set(only) - set(RUNNERS)))}")
    started = time.perf_counter()
    paths = run_all(args.scale, Path(args.results), Path(args.out), only)
    for path in paths:
        print(f"wrote {path}")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
