"""`python -m sim replay LOG`: the real engine's step log through the simulator's core.

A step log (`--step-log PATH` on the real engine; format in `core.cost.step_log`) holds the
scheduler and cache configuration, each request's arrival (its prompt ids and the number
of steps the engine had executed when it arrived), each executed step's decision and
timestamps, and each request's output length. Replay rebuilds the same core scheduler,
adds each request before the same step, ends each after the same number of output tokens
(`max_tokens`, EOS ignored: the simulator's tokens are not the model's), and compares the
decisions step by step: which requests, which token ranges, samples and block-table
lengths, preemptions, swaps and copies, and GPU blocks in use. Same core, same inputs:
any difference is a bug in how one backend drives the core.

It also prices every replayed step with the simulator's cost model (`--cost-model`, or
the roofline of --model on --hardware) and reports the error against the logged step
times (the CPU seconds of the stepping thread when the profile was fitted on them, else
wall seconds): how well the twin's clock matches on exactly the real schedule. It also
splits the logged wall time into CPU, waiting for a core and blocked.
"""
from __future__ import annotations

import argparse
from concurrent.futures import Future
from dataclasses import dataclass, field

from core import CacheConfig, EngineCore, Request, SamplingParams, Scheduler, SchedulerConfig
from core.cost.fit import phase_of, shape_of, summarize_errors
from core.cost.step_log import load_log, step_decision
from policies import PolicySet
from core.cost.model import RooflineCostModel
from sim.executor import SIM_EOS_TOKEN_ID, SimExecutor
from core.cost.specs import get_hardware, get_model


@dataclass
class ReplayReport:
    num_logged_steps: int
    num_replayed_steps: int
    num_equal_steps: int
    first_divergence: dict | None           # {"step", "real", "sim"} of the first different decision
    step_time_error: dict = field(default_factory=dict)   # per phase: relative error summary
    time_basis: str = "wall"                 # what the step times were compared with ("cpu": cpu_s)
    totals: dict = field(default_factory=dict)   # seconds over the steps: logged wall/cpu/runq, predicted
    engine: str = ""                         # who wrote the log, which rules replayed it (_engine_line)

    @property
    def equal(self) -> bool:
        return self.first_divergence is None and self.num_replayed_steps == self.num_logged_steps


class _Tap:
    """Executor wrapper: records each step's decision (and its priced time) before running it."""

    def __init__(self, inner: SimExecutor, scheduler: Scheduler):
        self.inner, self.scheduler = inner, scheduler
        self.decisions: list[dict] = []
        self.times: list[float] = []

    def execute_model(self, out):
        self.decisions.append(step_decision(out, self.scheduler.kv))
        self.times.append(self.inner.step_time(out))
        return self.inner.execute_model(out)

    def execute_model_async(self, out) -> Future:
        future: Future = Future()
        future.set_result(self.execute_model(out))
        return future


def _parse(path: str) -> tuple[dict, list[dict], list[dict], dict[str, dict]]:
    """The log's records, checked to be what replay covers."""
    config, arrivals, steps, finishes = load_log(path)
    for a in arrivals:
        rid = a["req_id"]
        if a.get("n", 1) != 1 or a.get("beam_width", 0):
            raise ValueError(f"{path}: request {rid} has n={a.get('n')}, beam_width={a.get('beam_width')}: "
                             f"replay covers single-sequence requests")
        fin = finishes.get(rid)
        if fin is None:
            raise ValueError(f"{path}: request {rid} never finished in the log (stop the engine after it drains)")
        if fin["status"] not in ("stop", "length"):
            raise ValueError(f"{path}: request {rid} ended {fin['status']}: replay needs requests that ran to "
                             f"completion (an abort depends on timing the log does not capture)")
    arrivals.sort(key=lambda a: a["step"])          # stable: same-step arrivals keep their order
    return config, arrivals, steps, finishes


def replay(path: str, cost_model=None, scheduler: str | None = None) -> ReplayReport:
    """`scheduler`: the core's scheduling rules (policies.scheduling) instead of the log's."""
    config, arrivals, steps, finishes = _parse(path)
    sched_cfg = SchedulerConfig(**config["scheduler"])
    cache_cfg = CacheConfig(**config["cache"])
    policy_names = dict(config["policies"])
    if scheduler is not None:
        policy_names["scheduler"] = scheduler
    elif config.get("engine") == "vllm":        # vLLM's own log (realexec bench record-vllm): its rules
        policy_names.setdefault("scheduler", "vllm-v1")
    policies = PolicySet.from_names(**policy_names)
    scheduler = Scheduler(sched_cfg, cache_cfg, policies)
    if cost_model is None:
        cost_model = RooflineCostModel(get_model("SmolLM2-135M"), get_hardware("cpu-2core"))
    executor = SimExecutor(cost_model, block_bytes=1)
    tap = _Tap(executor, scheduler)
    clock = [0.0]
    # Async scheduling (a log of an engine that schedules step N+1 while N computes): two
    # batches in flight, and a request's "step" counts the batches scheduled before it came,
    # so arrivals are added before each schedule() call rather than before each core step.
    is_async = sched_cfg.async_scheduling
    core = EngineCore(scheduler, tap, clock=lambda: clock[0], max_concurrent_batches=2 if is_async else 1)
    next_arrival = [0]
    n_arrivals = len(arrivals)

    def add_arrivals() -> None:
        executed = len(tap.decisions)
        landed = executed - core.num_in_flight      # (an async log's arrival also says how many landed)
        ai = next_arrival[0]
        while ai < n_arrivals and arrivals[ai]["step"] <= executed and arrivals[ai].get("landed", -1) <= landed:
            a = arrivals[ai]
            n_out = finishes[a["req_id"]]["num_output_tokens"]
            params = SamplingParams(max_tokens=max(1, n_out), ignore_eos=True)
            req = Request(a["req_id"], list(a["prompt_token_ids"]), params, arrival_time=a.get("t_arrival", a["t"]),
                          priority=a.get("priority", 0), eos_token_id=SIM_EOS_TOKEN_ID)
            core.add_request(req)
            ai += 1
        next_arrival[0] = ai

    if is_async:
        schedule = scheduler.schedule

        def schedule_after_arrivals(now=0.0):
            add_arrivals()
            return schedule(now)

        scheduler.schedule = schedule_after_arrivals

    stalled = 0
    limit = len(steps) + 1
    while next_arrival[0] < n_arrivals or scheduler.has_unfinished_requests() or core.num_in_flight:
        executed = len(tap.decisions)
        add_arrivals()
        ai = next_arrival[0]
        if not scheduler.has_unfinished_requests() and not core.num_in_flight:
            if ai < n_arrivals:          # nothing runnable yet the log says no step ran in between
                raise ValueError(f"{path}: request {arrivals[ai]['req_id']} arrives before step "
                                 f"{arrivals[ai]['step']} but only {executed} steps ran and the engine was idle")
            break
        if executed < len(steps):
            clock[0] = steps[executed]["t_start"]
        core.step()
        if len(tap.decisions) > limit:
            break
        # Nothing ran although requests are unfinished and none arrives before the next
        # step: the core is stuck (it would stay so: no time passes in replay); stop and
        # report the divergence rather than spin.
        stalled = stalled + 1 if len(tap.decisions) == executed else 0
        if stalled >= 3:
            break
    basis = getattr(cost_model, "time_basis", "wall")
    if basis == "cpu" and not all("cpu_s" in s for s in steps):
        basis = "wall"                  # an older log without CPU seconds
    evaluator = getattr(cost_model, "evaluator", None)
    grid = evaluator.grid_step_time if evaluator is not None and "served" in evaluator.model else None
    report = _compare(steps, tap, basis, grid)
    report.engine = _engine_line(config, policy_names.get("scheduler", "twinserve"))
    return report


def _engine_line(config: dict, scheduler: str) -> str:
    """For a vLLM recording: its engine and which core rules replayed it ("" for our logs)."""
    v = config.get("vllm")
    if not isinstance(v, dict):
        return ""
    c = config["cache"]
    return (f"log: vLLM {v.get('version', '?')} ({c['num_gpu_blocks']} usable blocks of {c['block_size']}, "
            f"prefix caching {'on' if c.get('enable_prefix_caching') else 'off'}, async scheduling "
            f"{'on' if v.get('async_scheduling') else 'off'}); replayed with the {scheduler} rules")


def _compare(steps: list[dict], tap: _Tap, basis: str = "wall", grid_time=None) -> ReplayReport:
    """`grid_time(seqs, tokens, context, pairs)`: a calibrated model's uncalibrated
    prediction, summed beside the calibrated one (None: not calibrated)."""
    equal, first = 0, None
    for i, (real, sim) in enumerate(zip(steps, tap.decisions)):
        if real["decision"] == sim:
            equal += 1
        elif first is None:
            first = {"step": i, "real": real["decision"], "sim": sim}
    if first is None and len(steps) != len(tap.decisions):
        i = min(len(steps), len(tap.decisions))
        first = {"step": i, "real": steps[i]["decision"] if i < len(steps) else None,
                 "sim": tap.decisions[i] if i < len(tap.decisions) else None}
    key = "cpu_s" if basis == "cpu" else "step_s"
    errs: dict[str, list[float]] = {"prefill": [], "decode": []}
    totals = dict.fromkeys(("wall", "cpu", "runq", "predicted"), 0.0)
    for real, t in zip(steps, tap.times):
        batch = real["decision"]["batch"]
        if not batch or not real.get(key):
            continue
        shape = shape_of([b[1] for b in batch], [b[2] for b in batch])
        errs[phase_of(shape[0], shape[1])].append(abs(t - real[key]) / real[key])
        if grid_time is not None:
            totals["predicted_grid"] = totals.get("predicted_grid", 0.0) + grid_time(*shape)
        totals["wall"] += real["step_s"]
        totals["cpu"] += real.get("cpu_s", float("nan"))
        totals["runq"] += real.get("runq_s", float("nan"))
        totals["predicted"] += t
    return ReplayReport(len(steps), len(tap.decisions), equal, first,
                        {phase: summarize_errors(e) for phase, e in errs.items() if e}, basis, totals)


def format_report(report: ReplayReport) -> str:
    lines = [report.engine] if report.engine else []
    lines.append(f"steps: {report.num_logged_steps} logged, {report.num_replayed_steps} replayed, "
                 f"{report.num_equal_steps} with equal decisions")
    if report.equal:
        lines.append("decisions: identical at every step")
    else:
        d = report.first_divergence
        lines.append(f"decisions: DIVERGE at step {d['step']}")
        real, sim = d["real"] or {}, d["sim"] or {}
        for key in sorted(set(real) | set(sim)):
            if real.get(key) != sim.get(key):
                lines.append(f"  {key}: real {real.get(key)!r}")
                lines.append(f"  {' ' * len(key)}  sim  {sim.get(key)!r}")
    what = "CPU seconds" if report.time_basis == "cpu" else "wall seconds"
    for phase, e in report.step_time_error.items():
        lines.append(f"step time, cost model vs logged {what}, {phase:7s}: median {e['median'] * 100:.1f}%  "
                     f"p90 {e['p90'] * 100:.1f}%  mean {e['mean'] * 100:.1f}%  (n={e['n']})")
    t = report.totals
    if t.get("wall") and t["cpu"] != t["cpu"]:          # NaN: a log without CPU seconds (vLLM's)
        lines.append(f"sum over the steps: logged wall {t['wall']:.2f}s; predicted {t['predicted']:.2f}s")
    elif t.get("wall"):
        lines.append(f"sum over the steps: logged wall {t['wall']:.2f}s = CPU {t['cpu']:.2f}s + waiting for a core "
                     f"{t['runq']:.2f}s + blocked {t['wall'] - t['cpu'] - t['runq']:.2f}s; predicted {t['predicted']:.2f}s"
                     + (f" (before the served calibration: {t['predicted_grid']:.2f}s)" if "predicted_grid" in t else ""))
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a real engine's step log through the simulator's core",
                       description="Feed a step log's arrivals and output lengths (from the real engine's "
                                   "--step-log) to the simulator's core and check it takes the same decision "
                                   "at every step; also price the steps and compare with the logged times. "
                                   "Exit status 1 when the decisions differ.")
    p.add_argument("log", metavar="LOG", help="step log (JSON lines) written with --step-log")
    p.add_argument("--cost-model", default=None, metavar="FILE",
                   help="price steps with this `realexec profile` file (default: the roofline of --model on --hardware)")
    p.add_argument("--model", default="SmolLM2-135M", help="model spec for the roofline (default: %(default)s)")
    p.add_argument("--hardware", default="cpu-2core", help="hardware for the roofline (default: %(default)s)")
    p.add_argument("--scheduler", default=None, metavar="NAME",
                   help="scheduling rules of the core: twinserve | vllm-v1 (default: the log's; vllm-v1 for a log of `realexec bench record-vllm`; else twinserve)")


def cmd_replay(args: argparse.Namespace) -> int:
    roofline = RooflineCostModel(get_model(args.model), get_hardware(args.hardware))
    cost_model = roofline
    if args.cost_model:
        from core.cost.fitted import FittedCostModel
        cost_model = FittedCostModel.from_file(args.cost_model, roofline)
    try:
        report = replay(args.log, cost_model, scheduler=args.scheduler)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{args.log}: malformed step log ({type(e).__name__}: {e})") from None
    print(format_report(report))
    return 0 if report.equal else 1
