"""Run independent simulation points serially or as Ray tasks, with a progress bar.

    results = run_points(fn, [args1, args2, ...], use_ray=True, ray_address=None, desc="sweep")

`fn` must be a module-level function (Ray pickles it by reference). Results come back
in the order of the arguments in both modes, and equal the serial ones: every point is
a deterministic simulation that shares nothing with the others. The bar shows points
done / total with an ETA (tqdm) in both modes. A Ray runtime this function starts
(local cores by default, or the cluster at `ray_address`) is shut down before it
returns; one that was already running is left alone.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[2]


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="pt", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                mininterval=0.2)


def run_points(fn: Callable[..., Any], points: Sequence[tuple], *, use_ray: bool = False,
               ray_address: str | None = None, desc: str = "points", progress: bool = True) -> list:
    if not use_ray:
        out = []
        with _bar(len(points), desc, progress) as bar:
            for args in points:
                out.append(fn(*args))
                bar.update(1)
        return out
    # Ray refuses to start a local cluster on macOS/Windows without this; harmless elsewhere.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray_address and "ray" not in sys.modules:
        # Ray 2.60 turns token auth on for a new local cluster and warns that it did unless
        # RAY_AUTH_MODE is set: the same mode, chosen explicitly. Read at `import ray`.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    started = not ray.is_initialized()
    if started:
        kwargs: dict = {"include_dashboard": False, "log_to_driver": False}
        if ray_address:
            kwargs["address"] = ray_address
        else:   # local workers import the project from this checkout
            kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": str(ROOT)}}
        ray.init(**kwargs)
    try:
        task = ray.remote(fn)
        # Large shared arguments (traces) go to the object store once.
        shared: dict[int, Any] = {}

        def put(value):
            if isinstance(value, (int, float, str, bool, type(None))):
                return value
            key = id(value)
            if key not in shared:
                shared[key] = ray.put(value)
            return shared[key]

        refs = [task.remote(*[put(a) for a in args]) for args in points]
        with _bar(len(refs), desc + " (ray)", progress) as bar:
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.update(len(done))
        return ray.get(refs)
    finally:
        if started:
            ray.shutdown()
