"""Benchmarks of `serve --simulate` (issue 32), each one command:

    python -m realexec bench simulate-vs-real   # the real server vs the simulated one on one trace slice
    python -m realexec bench simulate-cpu       # CPU a simulated replica takes at a request rate

`simulate-vs-real`: per load (a name and a Poisson rate), serve the same trace slice
(`bench serve`: the first --num-requests requests, arrival seed 0, streamed, ignore_eos,
temperature 0) to `realexec serve` (the real engine, SmolLM2 on this CPU) and then to
`realexec serve --simulate COST_MODEL` with the same engine flags (those of the cost
model's `engine` section: the engine it profiled). Prints one table (median and p90
TTFT/TPOT, throughput; the simulated server's error against the real one) and writes it
with both runs' summaries under --out. The cost model defaults to results/profile.json,
made by `python -m realexec profile --quick --time-basis wall` first when it is missing.

`simulate-cpu`: one simulated replica (default: Llama-3-8B on an H100, roofline) under
`bench serve` at --rate requests/s with short prompts and outputs; the server process's
CPU seconds (utime + stime from /proc) per wall second while the requests run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_PROFILE = "results/profile.json"
DEFAULT_LOADS = "light=0.3,queueing=2"
# The rows of the table: (label, bench-serve summary key, the target error)
ROWS = (("median TTFT (ms)", "median_ttft_ms", 0.05), ("median TPOT (ms)", "median_tpot_ms", 0.05),
        ("output throughput (tok/s)", "output_throughput", 0.05),
        ("request throughput (req/s)", "request_throughput", 0.05),
        ("p90 TTFT (ms)", "p90_ttft_ms", 0.10), ("p90 TPOT (ms)", "p90_tpot_ms", 0.10))
WARMUP_REQUESTS = 4          # short requests sent at once to each fresh server before the measured ones
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls")   # saved per run as LOAD-KIND.requests.json
# the profile's engine section -> the serve flags both servers get
_ENGINE_FLAGS = ("block_size", "max_num_batched_tokens", "max_num_seqs", "num_gpu_blocks", "max_model_len")


def _parse_loads(text: str) -> list[tuple[str, float]]:
    loads = []
    for item in text.split(","):
        name, sep, rate = item.partition("=")
        try:
            value = float(rate)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or not value > 0:
            raise ValueError(f"--loads: expected name=rate pairs with rates > 0 (e.g. {DEFAULT_LOADS}), got {item!r}")
        loads.append((name.strip(), value))
    return loads


def add_vs_real_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--cost-model", default=DEFAULT_PROFILE,
                        help=f"the fitted cost model the simulated server prices steps with [{DEFAULT_PROFILE}; "
                             f"made with `python -m realexec profile --quick` when missing]")
    parser.add_argument("--trace", default="traces/sharegpt.json", help="trace file [traces/sharegpt.json]")
    parser.add_argument("--num-requests", type=int, default=20, help="requests per run [20]")
    parser.add_argument("--max-tokens-cap", type=int, default=32, help="cap each request's max_tokens [32]")
    parser.add_argument("--loads", default=DEFAULT_LOADS,
                        help=f"name=rate (req/s) pairs, one pair of runs each [{DEFAULT_LOADS}]")
    parser.add_argument("--engine-args", default="", help="more serve flags for both servers (one string)")
    parser.add_argument("--sim-args", default="",
                        help="more serve flags for the simulated server only (one string), e.g. "
                             "'--sim-first-token-no-text 0.2'")
    parser.add_argument("--real-runs", type=int, default=1,
                        help="runs of the slice on the real server per load, back to back: the table compares "
                             "with their mean and shows their spread (the host's noise) [1]")
    parser.add_argument("--match-first-token", action="store_true",
                        help="the simulated server starts without text exactly the requests the real one did "
                             "(--sim-first-token-no-text-prompts with the real run's, written as "
                             "LOAD-silent-prompts.json): compares the step timing alone, not which requests "
                             "a share's draw picked")
    parser.add_argument("--out", default="results/simulate_vs_real", help="output directory [results/simulate_vs_real]")
    return parser


# `simulate-cpu --floor`: (result key, sse_floor.py's extra arguments, what it is)
FLOORS = (("floor", (), "sse_floor.py: uvloop + httptools, one SSE event per token every {step_ms:.1f} ms, "
                        "no framework, no engine"),
          ("framework_floor", ("--fastapi",), "sse_floor.py --fastapi: the same events from a bare FastAPI "
                                              "handler under uvicorn, no engine"))


def add_cpu_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second [100]")
    parser.add_argument("--num-requests", type=int, default=1000, help="requests sent [1000]")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request [8]")
    parser.add_argument("--replicas", type=int, default=1,
                        help="serve from this many simulated replicas of one process (serve --replicas N), "
                             "the rate and the requests split evenly over them [1]")
    parser.add_argument("--simulate", default="roofline", help="the server's --simulate [roofline]")
    parser.add_argument("--sim-model", default="Llama-3-8B", help="the server's --sim-model [Llama-3-8B]")
    parser.add_argument("--sim-hardware", default="H100", help="the server's --sim-hardware [H100]")
    parser.add_argument("--out", default=None, metavar="OUT.json", help="write the measurement here")
    parser.add_argument("--floor", action="store_true",
                        help="also serve the same load from realexec/bench/sse_floor.py, raw (uvloop + httptools, "
                             "one SSE event per token at the simulated server's median TPOT, no framework, no "
                             "engine) and --fastapi (the same events from a bare FastAPI handler), and print the "
                             "simulated server's CPU per request against both")
    return parser


# ----------------------------------------------------------------------------- helpers

def _bench(url: str, trace: str, num_requests: int, rate: float, max_tokens_cap: int | None) -> dict:
    """One `bench serve` run in this process; its summary (vLLM's keys, p50/p90/p99)."""
    return _bench_many([url], trace, num_requests, rate, max_tokens_cap)[0]


def _bench_many(urls: list[str], trace: str, num_requests: int, rate: float,
                max_tokens_cap: int | None) -> list[dict]:
    """One `bench serve` run per URL, all at once in this process (the i-th with arrival
    seed i, so replicas do not get their requests at the same instants); their summaries."""
    from realexec.bench import serve as bench_serve

    runs = []
    for seed, url in enumerate(urls):
        argv = ["--url", url, "--trace", trace, "--num-requests", str(num_requests), "--rate", f"{rate:g}",
                "--metric-percentiles", "90,99", "--seed", str(seed)]
        if max_tokens_cap is not None:
            argv += ["--max-tokens-cap", str(max_tokens_cap)]
        args = bench_serve.add_arguments(argparse.ArgumentParser()).parse_args(argv)
        bench_serve._check_args(args)
        runs.append((args, bench_serve.build_requests(args)))

    async def run_all():
        return await asyncio.gather(*(bench_serve.benchmark(args, requests) for args, requests in runs))

    summaries = [summary for summary, _ in asyncio.run(run_all())]
    for url, summary in zip(urls, summaries):
        if summary["failed"]:
            errors = [e for e in summary["errors"] if e]
            raise RuntimeError(f"bench serve against {url}: {summary['failed']} request(s) failed: {errors[0]}")
    return summaries


def slice_prompts(trace: str, num_requests: int) -> list[str | list[int]]:
    """The prompts `bench serve` sends for the slice, in sending order."""
    from realexec.bench import serve as bench_serve

    args = bench_serve.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--trace", trace, "--num-requests", str(num_requests), "--seed", "0"])
    return [req.prompt for req in bench_serve.build_requests(args)]


def first_token_silent(url: str, prompts: list[str | list[int]]) -> list[int]:
    """Which of `prompts` (0-based) the server at `url` starts with a token that has no
    text: each prompt once more, greedy, one token, not streamed. A streaming client sees
    such a request's first text a step later, so the TTFT of these requests is one decode
    step longer; the simulated server draws its share of them per prompt
    (`--sim-first-token-no-text`), the real one follows the model. Counting both says how
    much of a TTFT error is that draw and not the step prices."""
    import httpx

    with httpx.Client(base_url=url, timeout=120.0) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        silent = []
        for i, prompt in enumerate(prompts):
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
            answer = client.post("/v1/completions", json=body).raise_for_status().json()
            if answer["usage"]["completion_tokens"] == 1 and not answer["choices"][0]["text"]:
                silent.append(i)
    return silent


def _short_trace(path: Path, n: int, max_tokens: int, source: str) -> Path:
    """A trace of `n` 14-word prompts (under 16 tokens: none fills a KV block) asking for
    `max_tokens` tokens each."""
    from traces import Trace, TraceRequest, save_trace

    words = "the quick brown fox jumps over a lazy dog while".split()
    save_trace(Trace([TraceRequest(f"short-{i}", 0.0, 16, max_tokens,
                                   " ".join(words[(i + j) % len(words)] for j in range(14))) for i in range(n)],
                     source), path)
    return path


def _cpu_seconds(pid: int | str) -> float:
    """utime + stime of a process (or "PID/task/TID": a thread), in seconds (/proc/.../stat
    fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_seconds(pid: int) -> dict[int, float]:
    """utime + stime of each thread of a process, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = _cpu_seconds(f"{pid}/task/{task.name}")
        except (OSError, ValueError):       # the thread ended meanwhile
            pass
    return out


def _engine_flags(cost_model: str) -> list[str]:
    from core.cost.fitted import load_cost_model_file

    engine = load_cost_model_file(cost_model).get("engine") or {}
    flags = []
    for name in _ENGINE_FLAGS:
        if isinstance(engine.get(name), int):
            flags += ["--" + name.replace("_", "-"), str(engine[name])]
    return flags


def _error(sim: float, real: float) -> float | None:
    return (sim - real) / real if real else None


def mean_summary(summaries: list[dict]) -> dict:
    """One run's summary as it is; several runs': the first's keys with each table row's
    value the runs' mean, `noise` per row (the runs' largest distance from their mean,
    relative to it) and every run's summary under `runs`."""
    if len(summaries) == 1:
        return dict(summaries[0])
    out = dict(summaries[0])
    out["noise"] = {}
    for _, key, _ in ROWS:
        values = [s[key] for s in summaries]
        mean = sum(values) / len(values)
        out[key] = mean
        out["noise"][key] = max(abs(v - mean) for v in values) / mean if mean else 0.0
    out["runs"] = summaries
    return out


def comparison_table(runs: dict[str, dict[str, dict]]) -> str:
    """Markdown: per load and row, the real value (the mean of the real runs, with their
    noise when there were several), the simulated one and the relative error."""
    lines = ["| load | metric | real | real runs' noise (±) | simulated | error | target |",
             "|---|---|---|---|---|---|---|"]
    for load, pair in runs.items():
        noise = pair["real"].get("noise")
        for label, key, target in ROWS:
            real, sim = pair["real"][key], pair["simulated"][key]
            err = _error(sim, real)
            mark = "" if err is None else ("ok" if abs(err) <= target else "missed")
            err_text = "n/a" if err is None else f"{err:+.1%}"
            noise_text = f"{noise[key]:.1%}" if noise else "one run"
            lines.append(f"| {load} | {label} | {real:.2f} | {noise_text} | {sim:.2f} | {err_text} | "
                         f"±{target:.0%} {mark} |")
        silent = [pair[kind].get("first_token_silent") for kind in ("real", "simulated")]
        if None not in silent:
            both = len(set(silent[0]) & set(silent[1]))
            lines.append(f"| {load} | requests whose first token has no text | {len(silent[0])} | | "
                         f"{len(silent[1])} | {both} in both | |")
    return "\n".join(lines)


def _load_avg() -> list[float]:
    return list(os.getloadavg())


# ----------------------------------------------------------------------------- runners

def run_vs_real(args) -> int:
    from core.procs import realexec_server, run_child

    loads = _parse_loads(args.loads)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.real_runs < 1:
        raise ValueError(f"--real-runs must be >= 1, got {args.real_runs}")
    if not Path(args.trace).is_file():
        raise FileNotFoundError(f"--trace {args.trace}: no such file")
    cost_model = Path(args.cost_model)
    if not cost_model.exists():
        # wall time: the simulated server waits in wall time; a CPU-time profile of a shared
        # host predicts a step's CPU seconds, not how long it takes there
        cmd = [sys.executable, "-m", "realexec", "profile", "--quick", "--time-basis", "wall", "--out", str(cost_model)]
        print(f"simulate-vs-real: {cost_model} is missing: profiling first ({' '.join(cmd[1:])})", flush=True)
        done = run_child(cmd)
        if done.returncode != 0:
            raise RuntimeError(f"simulate-vs-real: profiling failed ({done.returncode}): {' '.join(cmd[1:])}")
    flags = _engine_flags(str(cost_model)) + shlex.split(args.engine_args) + ["--log-level", "warning"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, dict]] = {}
    env = {"OMP_NUM_THREADS": "1"}
    warmup = _short_trace(out / "warmup.json", WARMUP_REQUESTS, 4, "simulate-vs-real: warm-up")
    prompts = slice_prompts(args.trace, args.num_requests)
    for load, rate in loads:
        runs[load] = {}
        for kind in ("real", "simulated"):
            extra = []
            if kind == "simulated":
                extra = ["--simulate", str(cost_model)] + shlex.split(args.sim_args)
                if args.match_first_token:
                    listed = out / f"{load}-silent-prompts.json"
                    listed.write_text(json.dumps([prompts[i] for i in runs[load]["real"]["first_token_silent"]]))
                    extra += ["--sim-first-token-no-text-prompts", str(listed)]
            print(f"simulate-vs-real: {load} ({rate:g} req/s), {kind} server: serve {' '.join(flags + extra)}",
                  flush=True)
            # the real server's runs differ with the host's state; the simulated one repeats itself
            repeats = args.real_runs if kind == "real" else 1
            summaries = []
            with realexec_server(flags + extra, out / f"{load}-{kind}.log", env=env, ready_timeout=300,
                                 stop_timeouts=(30, 10)) as server:
                # a fresh server's first requests pay one-time costs (imports, first calls): a
                # burst of short ones first, as sim validate does
                _bench(server.url, str(warmup), WARMUP_REQUESTS, float("inf"), None)
                for i in range(repeats):
                    load_before = _load_avg()
                    summary = _bench(server.url, args.trace, args.num_requests, rate, args.max_tokens_cap)
                    # per request (prompt and output lengths, TTFT, inter-token gaps), to see
                    # which requests an error comes from; the comparison keeps the summaries
                    name = f"{load}-{kind}" + (f"-{i + 1}" if i else "")
                    (out / f"{name}.requests.json").write_text(json.dumps({k: summary[k] for k in PER_REQUEST_KEYS}))
                    summary = {k: v for k, v in summary.items() if not isinstance(v, list)}
                    summary["loadavg"] = [load_before, _load_avg()]
                    summaries.append(summary)
                silent = first_token_silent(server.url, prompts)
            runs[load][kind] = mean_summary(summaries)
            runs[load][kind]["first_token_silent"] = silent
    table = comparison_table(runs)
    print(table)
    meta = {"cost_model": str(cost_model), "trace": args.trace, "num_requests": args.num_requests,
            "max_tokens_cap": args.max_tokens_cap, "loads": dict(loads), "serve_flags": flags,
            "sim_flags": shlex.split(args.sim_args), "match_first_token": args.match_first_token,
            "real_runs": args.real_runs}
    (out / "comparison.json").write_text(json.dumps({**meta, "runs": runs}, indent=1))
    (out / "comparison.md").write_text(table + "\n")
    print(f"saved {out / 'comparison.md'} and {out / 'comparison.json'}")
    return 0


def _measure_cpu(urls: list[str], pid: int, trace: str, args) -> dict:
    """Serve the measured load from the servers at `urls` (all in process `pid`; the rate
    and the requests split evenly over them) after a warm-up: the bench summary (one
    server's, or the replicas' combined: summed throughput, mean of their medians) and the
    process's CPU seconds, per thread too, over the run."""
    n = len(urls)
    _bench_many(urls, trace, max(2, 20 // n), 20.0 / n, None)     # warm-up (first requests, imports)
    load_before = _load_avg()
    threads0, cpu0, t0 = _thread_cpu_seconds(pid), _cpu_seconds(pid), time.monotonic()
    summaries = _bench_many(urls, trace, args.num_requests // n, args.rate / n, None)
    threads1, cpu1, t1 = _thread_cpu_seconds(pid), _cpu_seconds(pid), time.monotonic()
    # where it went: the busiest threads (the event loop's HTTP work, an engine thread, ...)
    by_thread = sorted(((threads1[t] - threads0.get(t, 0.0)) for t in threads1), reverse=True)
    summary = dict(summaries[0])
    if n > 1:
        for key in ("median_ttft_ms", "median_tpot_ms"):
            summary[key] = sum(s[key] for s in summaries) / n
        for key in ("request_throughput", "output_throughput", "completed"):
            summary[key] = sum(s[key] for s in summaries)
    return {"summary": summary, "cpu_s": cpu1 - cpu0, "wall_s": t1 - t0, "threads": by_thread,
            "loadavg": [load_before, _load_avg()]}


def run_cpu(args) -> int:
    from core.procs import free_port, free_ports, realexec_server, serve_process, wait_healthy

    if not args.rate > 0 or args.num_requests < 1 or args.max_tokens < 1:
        raise ValueError("--rate must be > 0, --num-requests and --max-tokens >= 1")
    if not 1 <= args.replicas <= args.num_requests:
        raise ValueError(f"--replicas must be from 1 to --num-requests ({args.num_requests}), got {args.replicas}")
    flags = ["--simulate", args.simulate, "--log-level", "warning"]
    if args.replicas > 1:
        flags += ["--replicas", str(args.replicas)]
    if args.simulate == "roofline":
        flags += ["--sim-model", args.sim_model, "--sim-hardware", args.sim_hardware]
    floors = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = _short_trace(Path(tmp) / "short.json", args.num_requests, args.max_tokens,
                             "simulate-cpu: short prompts")
        port = free_ports(args.replicas)
        with realexec_server(flags, Path(tmp) / "server.log", port=port, ready_timeout=300) as server:
            urls = [f"http://127.0.0.1:{port + i}" for i in range(args.replicas)]
            for url in urls[1:]:
                wait_healthy(url, server.proc, server.log, timeout=60)
            m = _measure_cpu(urls, server.proc.pid, str(trace), args)
        if args.floor:
            step_s = max(m["summary"]["median_tpot_ms"] / 1e3, 0.001)    # the simulated server's pace
            for name, extra, _ in FLOORS:
                port = free_port()
                cmd = [sys.executable, str(Path(__file__).with_name("sse_floor.py")), str(port), f"{step_s:.6f}", *extra]
                with serve_process(cmd, port, Path(tmp) / f"{name}.log", ready_timeout=60) as server:
                    floors[name] = _measure_cpu([server.url], server.proc.pid, str(trace), args)
                floors[name]["step_s"] = step_s
    summary, wall, cpu = m["summary"], m["wall_s"], m["cpu_s"]
    share = cpu / wall
    result = {"rate": args.rate, "achieved_request_throughput": summary["request_throughput"],
              "num_requests": args.num_requests, "max_tokens": args.max_tokens, "replicas": args.replicas,
              "server_flags": flags,
              "server_cpu_s": cpu, "wall_s": wall, "cores": share,
              "thread_cpu_s": [round(x, 3) for x in m["threads"] if x > 0],
              "cpu_ms_per_request": cpu / args.num_requests * 1e3,
              "median_ttft_ms": summary["median_ttft_ms"], "median_tpot_ms": summary["median_tpot_ms"],
              "loadavg": m["loadavg"]}
    over = f" over {args.replicas} replicas" if args.replicas > 1 else ""
    print(f"simulate-cpu: {summary['request_throughput']:.1f} req/s served{over} ({args.rate:g} offered, "
          f"{args.max_tokens} output tokens each): the server process used {cpu:.2f} CPU s in "
          f"{wall:.2f} s = {share:.1%} of a core, {cpu / args.num_requests * 1e3:.2f} ms per request; "
          f"busiest threads {', '.join(f'{x:.2f}' for x in m['threads'][:3])} s (load {m['loadavg'][0][0]:.2f})")
    for name, _, what in FLOORS:
        if name not in floors:
            continue
        floor = floors[name]
        f_cpu, f_wall = floor["cpu_s"], floor["wall_s"]
        result[name] = {"cpu_s": f_cpu, "wall_s": f_wall, "cores": f_cpu / f_wall, "step_s": floor["step_s"],
                        "cpu_ms_per_request": f_cpu / args.num_requests * 1e3,
                        "achieved_request_throughput": floor["summary"]["request_throughput"],
                        "loadavg": floor["loadavg"]}
        result[f"vs_{name}"] = cpu / f_cpu if f_cpu > 0 else None
        what = what.format(step_ms=floor["step_s"] * 1e3)
        print(f"{name} ({what}): {floor['summary']['request_throughput']:.1f} req/s, {f_cpu:.2f} CPU s = "
              f"{f_cpu / f_wall:.1%} of a core, {f_cpu / args.num_requests * 1e3:.2f} ms per request; the simulated "
              f"server costs {cpu / f_cpu:.1f}x this floor" if f_cpu > 0 else f"{name}: no CPU time measured")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0
