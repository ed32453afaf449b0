"""`python -m sim validate TRACE --cost-model profile.json --rate R --num-requests N`:
the same trace slice through the real engine and through the simulator, and how far apart.

Real side (twice, to measure the real engine's own run-to-run noise): a fresh
`python -m realexec serve --step-log LOG` process, loaded by `python -m realexec bench
serve` (HTTP and streaming in the loop; Poisson arrivals at --rate with --seed). Run in
subprocesses: the simulator never imports the real engine.

Sim side: the first real run's step log gives each request's arrival time (when it
reached the server: it may wait there for the step in flight), prompt token ids, output
length and which output token first had text, and the engine's scheduler and cache
configuration; the simulator runs exactly that workload with the fitted cost model. Its
latencies are taken as a streaming client sees them: the first token is the first with
text (the server sends no chunk for a token without text, e.g. a leading special token),
plus the cost model's client delays (`sim calibrate`; 0 without).

Report: output throughput and TTFT, TPOT and E2E latency at median and p90 (client-side,
from bench serve) of every real run, their mean, and the simulator's relative error
against that mean next to the real runs' own spread around it (noise). The step logs
also say how much of its steps' wall time the engine thread ran on a core (the rest it
waited for one: on a shared machine the neighbours, the client and the server's other
threads take it); a profile is fitted in CPU seconds of that thread, so a second
simulation, "sim (contended)", slows every step by the real runs' measured share: the
twin's prediction given the CPU the engine actually got (on an idle machine the two
agree). "sim (runs' speed)" goes further: each real run's steps, priced by the cost model,
against what they measured, is the run's speed (how the host ran that run: on a shared
machine it moves by several % between runs minutes apart); the simulation at each run's
speed, averaged, is an oracle, not a prediction: its error is the model's, and the rest of
the plain sim's error is the host's. Also engine-side latencies from the step log (no
HTTP) and the CPU seconds the server and the client used. Figure: per-request E2E latency, real (step log) vs
simulated (contended when there is that column), and the running batch size over time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from core.metrics import percentile
from core.procs import realexec_server, run_child
from core.cost.step_log import drop_warmup, first_visible_index, load_log, read_log, sample_times, write_record
from sim.config import SimConfig, nonneg_int, positive_float, positive_int
from sim.twin.vllm_serve import add_real_engine_arguments, check_real_engine
from traces.model import Trace, TraceRequest

GiB = 1 << 30
METRICS = ("ttft", "tpot", "e2el")
# Simulations per prediction with step jitter (statistics averaged; the slices are tens of
# requests, so each takes tens of milliseconds). The twin tables draw JITTER_DRAWS per round,
# each round its own seeds, so their mean is over 16 x rounds draws. One validation has no
# rounds to average over, and under queueing a few draws whose backlog never drains decide
# the mean (vLLM's queueing slice: 2 of 16 draws, a Monte Carlo standard error of 13% of the
# median TTFT): `sim validate` draws 4x as many.
JITTER_DRAWS = 16
VALIDATE_JITTER_DRAWS = 64
# A fresh server's first requests pay one-time costs in its front end: on the 2-core host
# vLLM's API server took 40-750 ms more from the engine's first token to the client's for
# its first ~7 requests (5 ms after), ours ~15 ms more for its first. Each real run sends
# this many short requests at once first, and its step log is trimmed of them.
WARMUP_REQUESTS = 4
# Under 16 tokens with its 4 outputs: it fills no KV block of 16 tokens or more, so a
# measured request can hit nothing it left in the prefix cache and the trimmed log
# replays from an empty cache.
WARMUP_PROMPT = "Warm-up request {i}: say hello."
WARMUP_TOKENS = 4


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
    p.add_argument("--skip", type=int, default=0, metavar="K",
                   help="leave out the trace's first K requests (default: %(default)s)")
    p.add_argument("--real-runs", type=positive_int, default=2, metavar="K",
                   help="real runs; runs after the first measure run-to-run noise (default: %(default)s)")
    p.add_argument("--engine-args", default="", metavar="ARGS",
                   help="extra flags for `realexec serve` (or `vllm serve` with --real vllm), e.g. "
                        "\"--num-gpu-blocks 200 --max-num-seqs 16\"")
    add_real_engine_arguments(p, "simulated with the vllm-v1 rules; fit --cost-model on vLLM's steps with "
                                 "`sim calibrate --real vllm`")
    p.add_argument("--baseline-cost-model", default=None, metavar="FILE",
                   help="also simulate with this cost model (e.g. the profile before `sim calibrate`) "
                        "and report its errors next to --cost-model's")
    p.add_argument("--jitter-draws", type=nonneg_int, default=VALIDATE_JITTER_DRAWS, metavar="K",
                   help="with a calibrated --cost-model (`sim calibrate`, its jitter section): average the "
                        "statistics of K simulations with step jitter seeds 0..K-1, and report the simulation "
                        "without jitter next to them, and their Monte Carlo standard error; 0: no jitter (default: "
                        "%(default)s)")
    add_warmup_argument(p)
    p.add_argument("--reuse-real", action="store_true",
                   help="take the real runs already in --out (their step logs and bench results) and only "
                        "simulate again, e.g. with another --cost-model")
    p.add_argument("--out", default="results/validate", metavar="DIR",
                   help="report.json, validate.png, step logs and bench results (default: %(default)s)")


def add_warmup_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup-requests", type=nonneg_int, default=WARMUP_REQUESTS, metavar="K",
                   help="short requests sent at once to each fresh real server before the measured ones, "
                        "and trimmed from its step log (default: %(default)s)")


# -- real side ----------------------------------------------------------------------------------
def write_warmup_trace(path: Path, k: int) -> None:
    from traces.twinserve_json import save_trace

    reqs = [TraceRequest(f"warmup-{i}", 0.0, len(WARMUP_PROMPT.split()) + 1, WARMUP_TOKENS,
                         prompt=WARMUP_PROMPT.format(i=i)) for i in range(k)]
    save_trace(Trace(reqs, "sim validate: warm-up requests"), path)


def trim_warmup(log: Path, k: int) -> None:
    """Drop the first `k` requests from a step log (kept whole beside it as
    *.with-warmup.jsonl)."""
    records = list(read_log(str(log)))
    kept = drop_warmup(records, k)
    log.replace(log.with_name(log.name.replace(".jsonl", ".with-warmup.jsonl")))
    with open(log, "w") as f:
        for r in kept:
            write_record(f, r)


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_real(args, out: Path, run: int) -> tuple[Path, Path, dict]:
    """One served + benchmarked run -> (step log, bench result JSON, machine: CPU seconds
    of the server and of the benchmark client during the benchmark, load averages)."""
    log, result = out / f"real{run}.steps.jsonl", out / f"real{run}.bench.json"
    py = sys.executable
    machine: dict = {}
    if getattr(args, "real", "twinserve") == "vllm":        # vLLM, its steps recorded by its own scheduler
        from sim.twin.vllm_serve import vllm_server
        server_cm = vllm_server(args.vllm_python, args.model_dir, log, out / f"real{run}.server.log",
                                shlex.split(args.engine_args))
    else:
        server_cm = realexec_server(["--step-log", str(log), *shlex.split(args.engine_args)],
                                    out / f"real{run}.server.log")
    warmup = getattr(args, "warmup_requests", WARMUP_REQUESTS)
    with server_cm as server:
        if warmup:
            trace = out / "warmup.json"
            write_warmup_trace(trace, warmup)
            done = run_child([py, "-m", "realexec", "bench", "serve", "--url", server.url, "--trace", str(trace),
                              "--num-requests", str(warmup), "--rate", "inf",
                              "--max-tokens-cap", str(WARMUP_TOKENS)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the warm-up's bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
        machine["loadavg_1m_before"] = os.getloadavg()[0]
        server_cpu0, t0 = _process_cpu_s(server.proc.pid), time.monotonic()
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        bench = run_child([py, "-m", "realexec", "bench", "serve", "--url", server.url, "--trace", args.trace,
                           "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                           "--seed", str(args.seed), "--max-tokens-cap", str(args.max_tokens_cap),
                           "--skip", str(getattr(args, "skip", 0)),
                           "--save-result", str(result)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
        stderr = bench.stderr
        server_cpu1 = _process_cpu_s(server.proc.pid)
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)      # the client, reaped above
        machine.update(wall_s=time.monotonic() - t0, loadavg_1m_after=os.getloadavg()[0],
                       client_cpu_s=(children1.ru_utime + children1.ru_stime)
                       - (children0.ru_utime + children0.ru_stime))
        if server_cpu0 is not None and server_cpu1 is not None:
            machine["server_cpu_s"] = server_cpu1 - server_cpu0
        if bench.returncode != 0:
            raise RuntimeError(f"bench serve failed ({bench.returncode}): {stderr[-2000:]}")
    if warmup:
        trim_warmup(log, warmup)
    return log, result, machine


def client_stats(bench: dict) -> dict[str, float]:
    """Median and p90 of TTFT, TPOT, E2E (seconds) and output throughput from a bench result."""
    ttft = [t for t in bench["ttfts"] if t is not None]
    itls = bench["itls"]
    outs = bench["output_lens"]
    e2e = [t + sum(i) for t, i, e in zip(bench["ttfts"], itls, bench["errors"]) if t is not None and not e]
    tpot = [sum(i) / (n - 1) for i, n, e in zip(itls, outs, bench["errors"]) if n > 1 and not e]
    return _stats({"ttft": ttft, "tpot": tpot, "e2el": e2e}, bench["output_throughput"])


def bench_latencies(bench: dict) -> list[tuple[float, float | None, float] | None]:
    """The client's latencies per request of a bench result, in sending order: (ttft, tpot
    or None for one output token, e2e) seconds, None for a request that failed (for
    statistics over the first requests of a slice)."""
    out = []
    for t, itl, n, err in zip(bench["ttfts"], bench["itls"], bench["output_lens"], bench["errors"]):
        out.append(None if err or t is None else (t, sum(itl) / (n - 1) if n > 1 else None, t + sum(itl)))
    return out


def first_requests_stats(latencies: list, k: int) -> dict[str, float]:
    """Median and p90 of TTFT, TPOT and E2E over the first `k` of per-request latencies
    (`bench_latencies`, `sim_latencies`' values; no throughput)."""
    head = [x for x in latencies[:k] if x is not None]
    return {k_: v for k_, v in _stats({"ttft": [x[0] for x in head], "tpot": [x[1] for x in head if x[1] is not None],
                                       "e2el": [x[2] for x in head]}, float("nan")).items()
            if k_ != "output_throughput"}


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
    # a request arrives when it reached the server (t_arrival); the engine took it at t,
    # once the step in flight ended, and so does the simulator
    for a in arrivals:
        a["t_arrival"] = a.get("t_arrival", a["t"])
    arrivals.sort(key=lambda a: a["t_arrival"])
    t0 = arrivals[0]["t_arrival"]
    reqs = [TraceRequest(a["req_id"], round(a["t_arrival"] - t0, 6), len(a["prompt_token_ids"]),
                         finishes[a["req_id"]]["num_output_tokens"], prompt_token_ids=list(a["prompt_token_ids"]))
            for a in arrivals if a["req_id"] in finishes]
    # engine-side: first token = end of the step that sampled the first token with text (what a
    # streaming client sees first: no chunk goes out for a token without text); last = end of its last step
    times = sample_times(steps)
    visible = {rid: first_visible_index(finishes.get(rid)) for rid in times}
    first = {rid: t[min(visible[rid], len(t) - 1)] for rid, t in times.items()}
    last = {rid: t[-1] for rid, t in times.items()}
    engine = {"arrival": {a["req_id"]: a["t_arrival"] - t0 for a in arrivals},
              "first": {k: v - t0 for k, v in first.items()}, "last": {k: v - t0 for k, v in last.items()},
              "first_visible": visible,
              "batch": [(s["t_start"] - t0, len(s["decision"]["batch"])) for s in steps],
              "cpu_share": cpu_share(steps)}
    return config, Trace(reqs, f"step log {path}"), engine


def cpu_share(steps: list[dict]) -> float | None:
    """The share of its steps' wall time the engine's stepping thread ran on a core (the
    rest it mostly waited for one); None for a log without CPU seconds."""
    wall = sum(s["step_s"] for s in steps)
    if not wall or not all("cpu_s" in s for s in steps):
        return None
    return sum(s["cpu_s"] for s in steps) / wall


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


def sim_config_from_log(config: dict, cost_model: str, jitter_seed: int | None = None) -> SimConfig:
    from core.cost.model import kv_block_bytes
    from core.cost.specs import get_model

    s, c, p = config["scheduler"], config["cache"], config["policies"]
    model = "SmolLM2-135M"
    block_bytes = kv_block_bytes(get_model(model), c["block_size"])
    return SimConfig(model=model, hardware="cpu-2core", num_gpu_blocks=c["num_gpu_blocks"],
                     swap_space=c["num_cpu_blocks"] * block_bytes / GiB, block_size=c["block_size"],
                     max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
                     max_model_len=s["max_model_len"], enable_chunked_prefill=s["enable_chunked_prefill"],
                     enable_prefix_caching=c["enable_prefix_caching"], watermark=c["watermark"],
                     queue_policy=p["queue"], preemption_mode=p["preemption"], victim_policy=p["victim"],
                     eviction_policy=p["eviction"],
                     scheduler=p.get("scheduler", "twinserve"),
                     async_scheduling=bool(s.get("async_scheduling", False)),   # (an async engine's log)
                     cost_model=cost_model, jitter_seed=jitter_seed)


class SimRun(NamedTuple):
    stats: dict[str, float]          # client-side statistics (averaged over the jitter draws)
    e2e: dict[str, float]            # per request id, E2E latency (first draw)
    batch: list                      # (time, running batch size) per step (first draw)
    result: object                   # the simulator's SimResult (first draw)
    latencies: list[list]            # per draw, (ttft, tpot or None, e2e) per request in arrival order
    draw_stats: list[dict[str, float]]   # per draw, its client-side statistics


def run_sim(config: dict, trace: Trace, cost_model: str, first_visible: dict[str, int] | None = None,
            jitter_draws: int = 0, first_seed: int = 0) -> SimRun:
    """Simulate the logged workload; latencies as the client sees them: the engine's (from
    the request reaching the server; the first token is the one at `first_visible[id]`,
    0-based, the first with text in the real run) plus the cost model's client delays for
    the first and the last token (HTTP in and streaming out, from a served calibration).
    jitter_draws > 0 and a model with a jitter section: that many simulations with step
    jitter seeds first_seed, first_seed + 1, ..., their statistics averaged (the twin's
    expected value; rounds that share a model take disjoint seeds, so that their mean
    averages over distinct draws); the
    per-request latencies, the batch timeline and the result are the first draw's. Each
    request reaches the simulated engine the model's intake delay after the server (the
    server's own work on it), latencies still counted from the server."""
    from core.cost.fit import client_delays, intake_delay, jitter_params
    from core.cost.fitted import load_cost_model_file
    from sim.run import simulate

    model = load_cost_model_file(cost_model)
    first_delay, last_delay = client_delays(model, cost_model)
    intake = intake_delay(model, cost_model)
    if intake:              # the engine sees every request `intake` later; its latencies count from the server
        trace = Trace([replace(r, arrival_time=r.arrival_time + intake) for r in trace.requests], trace.source)
        first_delay, last_delay = first_delay + intake, last_delay + intake
    seeds = list(range(first_seed, first_seed + jitter_draws)) if jitter_draws > 0 and jitter_params(model, cost_model) else [None]
    draws = []
    for seed in seeds:
        result = simulate(sim_config_from_log(config, cost_model, seed), trace)
        done = sim_latencies(result.records, first_visible, first_delay, last_delay)
        total_out = sum(r.num_output_tokens for r in result.records)
        stats = _stats({"ttft": [lat[0] for _, lat in done],
                        "tpot": [lat[1] for _, lat in done if lat[1] is not None],
                        "e2el": [lat[2] for _, lat in done]}, total_out / result.sim_time)
        draws.append((stats, done, result))
    stats, done, result = draws[0]
    if len(draws) > 1:
        stats = mean_stats([d[0] for d in draws])
    e2e = {rid: lat[2] for rid, lat in done}
    batch = [(row.time, row.batch_size) for row in result.timeseries]
    return SimRun(stats, e2e, batch, result, [[lat for _, lat in d[1]] for d in draws], [d[0] for d in draws])


def run_sim_scaled(model: dict, factor: float, path: Path, config: dict, trace: Trace,
                   first_visible: dict[str, int] | None, jitter_draws: int = 0, first_seed: int = 0) -> SimRun:
    """`run_sim` with every step of `model` taking `factor` times as long (the scaled model
    is written to `path`, which the simulator reads)."""
    from core.cost.fit import scaled_model

    path.write_text(json.dumps(scaled_model(model, factor)))
    return run_sim(config, trace, str(path), first_visible, jitter_draws, first_seed)


def sim_latencies(records, first_visible: dict[str, int] | None, first_delay: float,
                  last_delay: float) -> list[tuple[str, tuple[float, float | None, float]]]:
    """(request id, (ttft, tpot or None, e2e)) per finished simulated request in arrival
    order, as the client sees them (see `run_sim`)."""
    out = []
    for r in sorted(records, key=lambda r: r.arrival_time):
        if r.first_token_time is None or r.finished_time is None:
            continue
        k = (first_visible or {}).get(r.request_id, 0)
        first_time = r.token_times[k] if 0 < k < len(r.token_times) else r.first_token_time
        first = first_time - r.arrival_time + first_delay
        last = r.finished_time - r.arrival_time + last_delay
        out.append((r.request_id, (first, (last - first) / (r.num_output_tokens - 1) if r.num_output_tokens > 1
                                   else None, last)))
    return out


def rel_errors(got: dict[str, float], ref: dict[str, float]) -> dict[str, float]:
    return {k: (got[k] - ref[k]) / ref[k] if ref[k] else float("nan") for k in ref}


def mean_stats(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def standard_error(groups: list[list[dict[str, float]]]) -> dict[str, float]:
    """Per metric, the standard error of the mean of the groups' means, relative to that
    mean. Groups of several samples (each round's jitter draws): from the spread within
    each group, the simulator's Monte Carlo error. Groups of one (the real runs): from the
    spread across them. NaN where neither can be measured."""
    means = [mean_stats(g) for g in groups]
    grand = mean_stats(means)
    out = {}
    for k in grand:
        if all(len(g) > 1 for g in groups):
            var = sum(statistics.variance([d[k] for d in g]) / len(g) for g in groups) / len(groups) ** 2
        elif len(groups) > 1:
            var = statistics.variance([m[k] for m in means]) / len(groups)
        else:
            var = float("nan")
        out[k] = math.sqrt(var) / abs(grand[k]) if grand[k] else float("nan")
    return out


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 100:.1f}%"


def run_noise(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, how far the real runs lie from their mean (the largest relative
    distance): an error of the simulator against that mean below it is within noise."""
    ref = mean_stats(runs)
    return {k: max(abs(r[k] - ref[k]) for r in runs) / ref[k] if ref[k] else float("nan") for k in ref}


def format_table(rows: dict[str, dict[str, float]], errors: dict[str, dict[str, float]],
                 noise: dict[str, float] | None = None) -> str:
    keys = ["output_throughput"] + [f"{q}_{m}" for m in METRICS for q in ("median", "p90")]
    names = list(rows) + list(errors) + (["noise (±)"] if noise is not None else [])
    widths = [max(14, len(name) + 2) for name in names]
    head = f"{'metric':26s}" + "".join(f"{name:>{w}s}" for name, w in zip(names, widths))
    lines = [head]
    for k in keys:
        scale = 1.0 if k == "output_throughput" else 1e3
        unit = "tok/s" if k == "output_throughput" else "ms"
        line = f"{k + ' (' + unit + ')':26s}" + "".join(f"{r[k] * scale:{w}.1f}" for r, w in zip(rows.values(), widths))
        line += "".join(f"{e[k] * 100:+{w - 1}.1f}%" for e, w in zip(errors.values(), widths[len(rows):]))
        if noise is not None:
            line += f"{noise[k] * 100:{widths[-1] - 1}.1f}%"
        lines.append(line)
    return "\n".join(lines)


def draw(path: Path, real_e2e: dict, sim_e2e: dict, real_batch: list, sim_batch: list,
         sim_label: str = "simulated") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ids = [k for k in real_e2e if k in sim_e2e]
    a.plot(range(len(ids)), [real_e2e[k] for k in ids], "o-", label="real (engine)", ms=3)
    a.plot(range(len(ids)), [sim_e2e[k] for k in ids], "x--", label=sim_label, ms=4)
    a.set_xlabel("request (arrival order)")
    a.set_ylabel("E2E latency (s)")
    a.legend()
    b.step([t for t, _ in real_batch], [n for _, n in real_batch], where="post", label="real")
    b.step([t for t, _ in sim_batch], [n for _, n in sim_batch], where="post", label=sim_label, alpha=0.8)
    b.set_xlabel("time (s)")
    b.set_ylabel("running batch size")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def contention_scale(model: dict, real_share: float | None) -> float | None:
    """How much slower the real runs' steps ran than the profile's time basis says, from
    the CPU share their stepping thread got: 1/share for a CPU-seconds profile, the
    profile's own share over the runs' for a wall-seconds one. None when unknown."""
    if not real_share:
        return None
    prof = model.get("profile", {})
    if prof.get("time_basis") == "cpu":
        return 1.0 / real_share
    own = (prof.get("cpu_share") or {}).get("cpu")
    return own / real_share if own else None


def run_speed(model: dict, log: Path, contention: float | None = None) -> float | None:
    """How much longer a real run's logged steps took than `model` prices them (summed; 1:
    as priced), in the model's time basis; for a CPU-seconds model times the run's
    contention scale, the waits for a core its CPU seconds leave out. None for a log
    without steps."""
    from sim.twin.served_steps import served_ratio

    try:
        measured, priced = served_ratio(model, log)
    except ValueError:          # no executed step
        return None
    cpu = model.get("profile", {}).get("time_basis") == "cpu"
    return measured / priced * (contention if cpu and contention else 1.0)


def cmd_validate(args: argparse.Namespace) -> int:
    from core.cost.fit import jitter_params
    from core.cost.fitted import FittedCostModel, load_cost_model_file

    FittedCostModel.from_file(args.cost_model, None)          # a bad file fails before any server starts
    check_real_engine(args)
    if getattr(args, "baseline_cost_model", None):
        FittedCostModel.from_file(args.baseline_cost_model, None)
    model = load_cost_model_file(args.cost_model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(1, args.real_runs + 1):
        machine_file = out / f"real{k}.machine.json"
        if args.reuse_real:
            log, result = out / f"real{k}.steps.jsonl", out / f"real{k}.bench.json"
            if not (log.exists() and result.exists() and machine_file.exists()):
                raise ValueError(f"--reuse-real: real run {k} is not in {out}/ (run validate there without it first)")
            runs.append((log, result, json.loads(machine_file.read_text())))
            continue
        print(f"real run {k}/{args.real_runs}: serve + bench serve ...", file=sys.stderr, flush=True)
        runs.append(run_real(args, out, k))
        machine_file.write_text(json.dumps(runs[-1][2]))
    config, trace, engine = workload_from_log(runs[0][0])
    real = [client_stats(json.loads(r.read_text())) for _, r, _ in runs]
    shares = [cpu_share(load_log(str(log))[2]) for log, _, _ in runs]
    mean_share = sum(shares) / len(shares) if all(shares) else None
    real_mean, noise = mean_stats(real), run_noise(real)
    draws = args.jitter_draws
    simulated = run_sim(config, trace, args.cost_model, engine["first_visible"], draws)
    sim_stats, sim_e2e, sim_batch = simulated.stats, simulated.e2e, simulated.batch
    eng1, real_e2e = engine_stats(trace, engine)
    rows = {f"real{k} (client)": s for k, s in enumerate(real, 1)}
    rows.update({"real mean": real_mean, "real1 (engine)": eng1, "sim": sim_stats})
    errors = {"sim vs mean": rel_errors(sim_stats, real_mean)}
    jittered = draws > 0 and jitter_params(model, args.cost_model) is not None
    if jittered:
        steady = run_sim(config, trace, args.cost_model, engine["first_visible"]).stats
        rows["sim (no jitter)"] = steady
        errors["sim (no jitter) vs mean"] = rel_errors(steady, real_mean)
    scale = contention_scale(model, mean_share)
    if scale is not None:
        # the same simulation with every step slowed as much as the real runs' stepping
        # thread was kept off its core (the machine's neighbours, the client, the server's
        # own threads): what the twin predicts given the CPU the engine actually got
        contended, sim_e2e, sim_batch, *_ = run_sim_scaled(model, scale, out / "cost_model.contended.json",
                                                             config, trace, engine["first_visible"], draws)
        rows["sim (contended)"] = contended
        errors["sim (contended) vs mean"] = rel_errors(contended, real_mean)
    speeds = [run_speed(model, log, contention_scale(model, share))
              for (log, _, _), share in zip(runs, shares)]
    if all(speeds):
        # the host term: each real run's workload priced at the speed its own logged steps
        # had (an oracle, not a prediction): what remains against the real runs is the model's
        at_speed = [run_sim_scaled(model, speed, out / f"cost_model.real{k}_speed.json", config, trace,
                                   engine["first_visible"], draws, (k - 1) * draws).stats
                    for k, speed in enumerate(speeds, 1)]
        rows["sim (runs' speed)"] = mean_stats(at_speed)
        errors["sim (runs' speed) vs mean"] = rel_errors(rows["sim (runs' speed)"], real_mean)
    if getattr(args, "baseline_cost_model", None):
        baseline = run_sim(config, trace, args.baseline_cost_model, engine["first_visible"]).stats
        rows["sim (baseline)"] = baseline
        errors["sim (baseline) vs mean"] = rel_errors(baseline, real_mean)
    errors["sim vs engine1"] = rel_errors(sim_stats, eng1)
    draw(out / "validate.png", real_e2e, sim_e2e, engine["batch"], sim_batch,
         "simulated (contended)" if scale is not None else "simulated")
    report = {"trace": args.trace, "rate": args.rate, "num_requests": len(trace.requests),
              "jitter_draws": draws if jittered else 0,
              "skip": getattr(args, "skip", 0), "seed": args.seed, "cost_model": args.cost_model,
              "baseline_cost_model": getattr(args, "baseline_cost_model", None), "engine_args": args.engine_args,
              "stats": rows, "errors": errors, "noise": noise, "cpu_share": shares, "contention_scale": scale,
              "run_speed": speeds, "real_se": standard_error([[r] for r in real]),
              "sim_se": standard_error([simulated.draw_stats]),
              "machine": [m for _, _, m in runs], "cpu_count": os.cpu_count(),
              "preemptions_real": sum(1 for r in read_log(str(runs[0][0])) if r["kind"] == "step"
                                      for _ in r["decision"]["preempted"])}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(format_table(rows, errors, noise))
    print(f"real run 1 preempted {report['preemptions_real']} time(s); noise: the real runs' largest distance "
          f"from their mean")
    for k, (share, m) in enumerate(zip(shares, report["machine"]), 1):
        line = f"real run {k}:"
        if share is not None:
            line += f" the engine thread ran {share * 100:.0f}% of its steps' wall time (else mostly waiting for a core);"
        if "server_cpu_s" in m:
            line += f" server {m['server_cpu_s']:.1f} CPU-s, client {m['client_cpu_s']:.1f} CPU-s"
        line += (f" in {m['wall_s']:.1f}s on {os.cpu_count()} CPUs; load average {m['loadavg_1m_before']:.2f}"
                 f" -> {m['loadavg_1m_after']:.2f}")
        print(line)
    if jittered:
        print(f"sim: the mean of {draws} simulations with step jitter (the cost model's jitter section); "
              f"sim (no jitter): one without")
        print("standard errors (real mean / sim's Monte Carlo): " + ", ".join(
            f"{k} {_pct(report['real_se'][k])} / {_pct(report['sim_se'][k])}" for k in report["sim_se"])
            + " (more --real-runs / --jitter-draws narrow them)")
    if scale is not None:
        print(f"sim (contended): every step x{scale:.2f}, the real runs' slowdown from the CPU they got")
    if all(speeds):
        print("sim (runs' speed): each real run's steps cost " + ", ".join(f"x{x:.3f}" for x in speeds)
              + " what the cost model prices them (its host state): the prediction at those speeds, an oracle; "
                "what is left against the real runs is the model's error, the rest of `sim`'s is the host's")
    print(f"report.json and validate.png in {out}/")
    return 0
