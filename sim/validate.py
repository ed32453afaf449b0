"""`python -m sim validate TRACE --cost-model profile.json --rate R --num-requests N`:
the same trace slice through the real engine and through the simulator, and how far apart.

Real side (twice, to measure the real engine's own run-to-run noise): a fresh
`python -m realexec serve --step-log LOG` process, loaded by `python -m realexec bench
serve` (HTTP and streaming in the loop; Poisson arrivals at --rate with --seed). Run in
subprocesses: the simulator never imports the real engine.

Sim side: the first real run's step log gives each request's arrival time (at the
engine), prompt token ids and output length, and the engine's scheduler and cache
configuration; the simulator runs exactly that workload with the fitted cost model.

Report: relative error of the simulator against real run 1 for output throughput and for
TTFT, TPOT and E2E latency at median and p90 (client-side, from bench serve), the same
numbers for real run 2 against run 1 (noise), and engine-side latencies from the step
log (no HTTP). Figure: per-request E2E latency, real (step log) vs simulated, and the
running batch size over time of both.
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from core.metrics import percentile
from core.step_log import load_log, read_log
from sim.config import SimConfig, positive_float, positive_int
from traces.model import Trace, TraceRequest

GiB = 1 << 30
METRICS = ("ttft", "tpot", "e2el")


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="real engine (served, benchmarked twice) vs the simulator on one trace slice",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("trace", metavar="TRACE", help="trace file (any traces format)")
    p.add_argument("--cost-model", required=True, metavar="FILE", help="`python -m realexec profile` output")
    p.add_argument("--rate", type=positive_float, required=True, metavar="R", help="request rate (req/s)")
    p.add_argument("--num-requests", type=positive_int, default=20, metavar="N", help="requests (default: %(default)s)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=32, metavar="N",
                   help="cap each request's output tokens (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="arrival seed (default: %(default)s)")
    p.add_argument("--real-runs", type=positive_int, default=2, metavar="K",
                   help="real runs; runs after the first measure run-to-run noise (default: %(default)s)")
    p.add_argument("--engine-args", default="", metavar="ARGS",
                   help="extra flags for `realexec serve`, e.g. \"--num-gpu-blocks 200 --max-num-seqs 16\"")
    p.add_argument("--out", default="results/validate", metavar="DIR",
                   help="report.json, validate.png, step logs and bench results (default: %(default)s)")


# -- real side ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f}s")


def run_real(args, out: Path, run: int) -> tuple[Path, Path]:
    """One served + benchmarked run -> (step log, bench result JSON)."""
    log, result = out / f"real{run}.steps.jsonl", out / f"real{run}.bench.json"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    py = sys.executable
    with open(out / f"real{run}.server.log", "w") as server_out:
        server = subprocess.Popen([py, "-m", "realexec", "serve", "--port", str(port), "--step-log", str(log),
                                   *shlex.split(args.engine_args)], stdout=server_out, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, server)
            bench = subprocess.run([py, "-m", "realexec", "bench", "serve", "--url", url, "--trace", args.trace,
                                    "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                                    "--seed", str(args.seed), "--max-tokens-cap", str(args.max_tokens_cap),
                                    "--save-result", str(result)], capture_output=True, text=True)
            if bench.returncode != 0:
                raise RuntimeError(f"bench serve failed ({bench.returncode}): {bench.stderr[-2000:]}")
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return log, result


def client_stats(bench: dict) -> dict[str, float]:
    """Median and p90 of TTFT, TPOT, E2E (seconds) and output throughput from a bench result."""
    ttft = [t for t in bench["ttfts"] if t is not None]
    itls = bench["itls"]
    outs = bench["output_lens"]
    e2e = [t + sum(i) for t, i, e in zip(bench["ttfts"], itls, bench["errors"]) if t is not None and not e]
    tpot = [sum(i) / (n - 1) for i, n, e in zip(itls, outs, bench["errors"]) if n > 1 and not e]
    return _stats({"ttft": ttft, "tpot": tpot, "e2el": e2e}, bench["output_throughput"])


def _stats(series: dict[str, list[float]], throughput: float) -> dict[str, float]:
    out = {"output_throughput": throughput}
    for name, values in series.items():
        v = sorted(values)
        out[f"median_{name}"] = percentile(v, 50) if v else float("nan")
        out[f"p90_{name}"] = percentile(v, 90) if v else float("nan")
    return out


# -- the step log as a workload and as engine-side measurements --------------------------------
def workload_from_log(path: Path) -> tuple[dict, Trace, dict]:
    """(config record, trace of the logged requests, engine-side per-request timings)."""
    config, arrivals, steps, finishes = load_log(str(path))
    if not arrivals:
        raise ValueError(f"{path}: no requests in the step log")
    arrivals.sort(key=lambda a: a["t"])
    t0 = arrivals[0]["t"]
    reqs = [TraceRequest(a["req_id"], round(a["t"] - t0, 6), len(a["prompt_token_ids"]),
                         finishes[a["req_id"]]["num_output_tokens"], prompt_token_ids=list(a["prompt_token_ids"]))
            for a in arrivals if a["req_id"] in finishes]
    # engine-side: first token = end of the first step that sampled for it; last = end of its last step
    first, last = {}, {}
    for s in steps:
        for rid, _start, _n, samples, _blocks in s["decision"]["batch"]:
            if samples:
                first.setdefault(rid, s["t_end"])
                last[rid] = s["t_end"]
    engine = {"arrival": {a["req_id"]: a["t"] - t0 for a in arrivals},
              "first": {k: v - t0 for k, v in first.items()}, "last": {k: v - t0 for k, v in last.items()},
              "batch": [(s["t_start"] - t0, len(s["decision"]["batch"])) for s in steps]}
    return config, Trace(reqs, f"step log {path}"), engine


def engine_stats(trace: Trace, engine: dict) -> tuple[dict[str, float], dict[str, float]]:
    ttft, tpot, e2e = [], [], {}
    for r in trace.requests:
        a, f, l_ = engine["arrival"][r.request_id], engine["first"].get(r.request_id), engine["last"].get(r.request_id)
        if f is None:
            continue
        ttft.append(f - a)
        e2e[r.request_id] = l_ - a
        if r.output_len > 1:
            tpot.append((l_ - f) / (r.output_len - 1))
    span = max(engine["last"].values())
    return _stats({"ttft": ttft, "tpot": tpot, "e2el": list(e2e.values())},
                  sum(r.output_len for r in trace.requests) / span), e2e


def sim_config_from_log(config: dict, cost_model: str) -> SimConfig:
    from sim.cost_model import kv_block_bytes
    from sim.specs import get_model

    s, c, p = config["scheduler"], config["cache"], config["policies"]
    model = "SmolLM2-135M"
    block_bytes = kv_block_bytes(get_model(model), c["block_size"])
    return SimConfig(model=model, hardware="cpu-2core", num_gpu_blocks=c["num_gpu_blocks"],
                     swap_space_gib=c["num_cpu_blocks"] * block_bytes / GiB, block_size=c["block_size"],
                     max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
                     max_model_len=s["max_model_len"], enable_chunked_prefill=s["enable_chunked_prefill"],
                     enable_prefix_caching=c["enable_prefix_caching"], watermark=c["watermark"],
                     queue=p["queue"], preemption=p["preemption"], victim=p["victim"], eviction=p["eviction"],
                     cost_model=cost_model)


def run_sim(config: dict, trace: Trace, cost_model: str):
    from sim.engine import simulate

    result = simulate(sim_config_from_log(config, cost_model), trace)
    ttft, tpot, e2e = [], [], {}
    for r in result.records:
        if r.first_token_time is None or r.finished_time is None:
            continue
        ttft.append(r.first_token_time - r.arrival_time)
        e2e[r.request_id] = r.finished_time - r.arrival_time
        if r.num_output_tokens > 1:
            tpot.append((r.finished_time - r.first_token_time) / (r.num_output_tokens - 1))
    total_out = sum(r.num_output_tokens for r in result.records)
    stats = _stats({"ttft": ttft, "tpot": tpot, "e2el": list(e2e.values())}, total_out / result.sim_time)
    cols = result.TIMESERIES_COLUMNS
    ti, bi = cols.index("time"), cols.index("batch_size")
    batch = [(row[ti], row[bi]) for row in result.timeseries]
    return stats, e2e, batch, result


def rel_errors(got: dict[str, float], ref: dict[str, float]) -> dict[str, float]:
    return {k: (got[k] - ref[k]) / ref[k] if ref[k] else float("nan") for k in ref}


def format_table(rows: dict[str, dict[str, float]], errors: dict[str, dict[str, float]]) -> str:
    keys = ["output_throughput"] + [f"{q}_{m}" for m in METRICS for q in ("median", "p90")]
    widths = [max(14, len(name) + 2) for name in list(rows) + list(errors)]
    head = f"{'metric':26s}" + "".join(f"{name:>{w}s}" for name, w in zip(list(rows) + list(errors), widths))
    lines = [head]
    for k in keys:
        scale = 1.0 if k == "output_throughput" else 1e3
        unit = "tok/s" if k == "output_throughput" else "ms"
        line = f"{k + ' (' + unit + ')':26s}" + "".join(f"{r[k] * scale:{w}.1f}" for r, w in zip(rows.values(), widths))
        line += "".join(f"{e[k] * 100:+{w - 1}.1f}%" for e, w in zip(errors.values(), widths[len(rows):]))
        lines.append(line)
    return "\n".join(lines)


def draw(path: Path, real_e2e: dict, sim_e2e: dict, real_batch: list, sim_batch: list) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ids = [k for k in real_e2e if k in sim_e2e]
    a.plot(range(len(ids)), [real_e2e[k] for k in ids], "o-", label="real (engine)", ms=3)
    a.plot(range(len(ids)), [sim_e2e[k] for k in ids], "x--", label="simulated", ms=4)
    a.set_xlabel("request (arrival order)")
    a.set_ylabel("E2E latency (s)")
    a.legend()
    b.step([t for t, _ in real_batch], [n for _, n in real_batch], where="post", label="real")
    b.step([t for t, _ in sim_batch], [n for _, n in sim_batch], where="post", label="simulated", alpha=0.8)
    b.set_xlabel("time (s)")
    b.set_ylabel("running batch size")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_validate(args: argparse.Namespace) -> int:
    from sim.fitted_cost import FittedCostModel

    FittedCostModel.from_file(args.cost_model, None)          # a bad file fails before any server starts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(1, args.real_runs + 1):
        print(f"real run {k}/{args.real_runs}: serve + bench serve ...", file=sys.stderr, flush=True)
        runs.append(run_real(args, out, k))
    config, trace, engine = workload_from_log(runs[0][0])
    sim_stats, sim_e2e, sim_batch, _ = run_sim(config, trace, args.cost_model)
    real = [client_stats(json.loads(r.read_text())) for _, r in runs]
    eng1, real_e2e = engine_stats(trace, engine)
    rows = {"real1 (client)": real[0]}
    rows.update({f"real{k + 1} (client)": s for k, s in enumerate(real[1:], 1)})
    rows.update({"real1 (engine)": eng1, "sim": sim_stats})
    errors = {"sim vs real1": rel_errors(sim_stats, real[0]), "sim vs engine1": rel_errors(sim_stats, eng1)}
    for k, s in enumerate(real[1:], 2):
        errors[f"real{k} vs real1"] = rel_errors(s, real[0])
    draw(out / "validate.png", real_e2e, sim_e2e, engine["batch"], sim_batch)
    report = {"trace": args.trace, "rate": args.rate, "num_requests": len(trace.requests),
              "cost_model": args.cost_model, "engine_args": args.engine_args, "stats": rows, "errors": errors,
              "preemptions_real": sum(1 for r in read_log(str(runs[0][0])) if r["kind"] == "step"
                                      for _ in r["decision"]["preempted"])}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(format_table(rows, errors))
    print(f"real run 1 preempted {report['preemptions_real']} time(s); report.json and validate.png in {out}/")
    return 0

