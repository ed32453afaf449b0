"""The step log: what the engine decided at each step, as JSON lines.

Both backends reduce a `SchedulerOutput` to the same plain `decision` (here), so a
real run's log can be replayed through the simulator's copy of the core and compared
step by step (`python -m sim replay`). Records, one JSON object per line, `kind` first:

  {"kind": "config", ...}       the scheduler and cache knobs the engine ran with
  {"kind": "arrival", "req_id", "step", "t", "t_arrival", "prompt_token_ids", "max_tokens", ...}
                                a request entered the engine (at `t`) before executed step
                                `step`; it reached the server at `t_arrival` (<= t: a server
                                hands requests over between steps)
  {"kind": "step", "step", "t_start", "t_end", "step_s", "execute_s", "cpu_s", "runq_s", ...,
   "decision": {...}}           one executed step (empty steps run nothing and are left out);
                                wall seconds, and the stepping thread's CPU and run-queue
                                seconds (realexec.twin.step_recorder)
  {"kind": "finish", "req_id", "num_output_tokens", "status", "first_text_token"}
                                first_text_token: output tokens when its text first showed
                                (a streaming client's first chunk); absent/None: unknown

Times are seconds since the log started (monotonic clock).
"""
from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from typing import IO, Iterator

LOG_FORMAT = "twinserve-step-log"
# A gap between two of vLLM's steps over this long is the engine sitting idle, not its loop.
MAX_LOOP_GAP_S = 1.0


def step_decision(out, kv) -> dict:
    """The scheduling decision of one step: per scheduled slice [request id, start,
    tokens, samples, blocks in its table], the requests preempted, block moves, and the
    GPU blocks in use once the step was scheduled."""
    return {
        "batch": [[s.seq.request.request_id, s.start, s.num_tokens, s.num_samples, len(s.block_table)]
                  for s in out.scheduled],
        "preempted": [r.request_id for r in out.preempted],
        "swap_out": len(out.blocks_to_swap_out),
        "swap_in": len(out.blocks_to_swap_in),
        "copy": len(out.blocks_to_copy),
        "used_gpu_blocks": kv.stats().num_used_gpu_blocks,
    }


def config_record(scheduler, policy_names: dict[str, str]) -> dict:
    """What a replay needs to rebuild the same scheduler (policies by registry name)."""
    sc, cc = scheduler.config, scheduler.cache_config
    return {"kind": "config", "format": LOG_FORMAT,
            "scheduler": {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
                          "max_model_len": sc.max_model_len, "enable_chunked_prefill": sc.enable_chunked_prefill},
            "cache": {"block_size": cc.block_size, "num_gpu_blocks": cc.num_gpu_blocks,
                      "num_cpu_blocks": cc.num_cpu_blocks, "enable_prefix_caching": cc.enable_prefix_caching,
                      "watermark": cc.watermark},
            "policies": dict(policy_names)}


def write_record(f: IO[str], record: dict) -> None:
    f.write(json.dumps(record, separators=(",", ":")) + "\n")


def read_log(path: str) -> Iterator[dict]:
    """The records of a step log; ValueError naming the line when one is not JSON."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or "kind" not in rec:
                raise ValueError(f"{path}:{lineno}: a step-log record is an object with a 'kind'")
            yield rec


def load_log(path: str) -> tuple[dict, list[dict], list[dict], dict[str, dict]]:
    """(config, arrivals, steps, finishes by request id) of a step log; ValueError when it
    has no config record of this format."""
    config, arrivals, steps, finishes = None, [], [], {}
    for rec in read_log(path):
        kind = rec["kind"]
        if kind == "config":
            config = rec
        elif kind == "arrival":
            arrivals.append(rec)
        elif kind == "step":
            steps.append(rec)
        elif kind == "finish":
            finishes[rec["req_id"]] = rec
    if config is None or config.get("format") != LOG_FORMAT:
        raise ValueError(f"{path}: not a {LOG_FORMAT} file (no config record)")
    return config, arrivals, steps, finishes


def sample_times(steps: list[dict]) -> dict[str, list[float]]:
    """Per request, the end time of the step that sampled each of its output tokens (one
    entry per token: a step's slice samples `samples` tokens)."""
    times: dict[str, list[float]] = {}
    for s in steps:
        for rid, _start, _n, samples, _blocks in s["decision"]["batch"]:
            if samples:
                times.setdefault(rid, []).extend([s["t_end"]] * samples)
    return times


def drop_warmup(records: list[dict], num_requests: int) -> list[dict]:
    """The records of a log without its first `num_requests` requests (by arrival): a
    warm-up served and finished before the measured requests came. Their arrivals, steps
    and finishes go; the remaining steps are renumbered from 0 (steps and the arrivals'
    `step` / `landed` counts), times are kept. ValueError when a measured request arrived
    before the warm-up's last step or shared a step with it."""
    if num_requests <= 0:
        return list(records)
    arrivals = sorted((r for r in records if r["kind"] == "arrival"), key=lambda r: r.get("t_arrival", r["t"]))
    if len(arrivals) <= num_requests:
        raise ValueError(f"the log has {len(arrivals)} requests: none left after a warm-up of {num_requests}")
    warm = {r["req_id"] for r in arrivals[:num_requests]}
    steps = [r for r in records if r["kind"] == "step"]
    warm_steps = [s["step"] for s in steps if any(b[0] in warm for b in s["decision"]["batch"])]
    cut = max(warm_steps) + 1 if warm_steps else 0          # steps before this one are the warm-up's
    for s in steps:
        if s["step"] < cut and any(b[0] not in warm for b in s["decision"]["batch"]):
            raise ValueError(f"step {s['step']} ran a measured request with the warm-up's")
    for a in arrivals[num_requests:]:
        if a["step"] < cut:
            raise ValueError(f"request {a['req_id']} arrived before the warm-up's last step {cut - 1}")
    out = []
    for r in records:
        kind = r["kind"]
        if kind in ("arrival", "finish") and r["req_id"] in warm or kind == "step" and r["step"] < cut:
            continue
        if kind == "step" or kind == "arrival":
            r = {**r, "step": r["step"] - cut}
            if "landed" in r:
                r["landed"] = r["landed"] - cut
        out.append(r)
    return out


def is_vllm_log(config: dict) -> bool:
    """A log of vLLM's scheduler (`bench record-vllm`, `sim validate --real vllm`)."""
    return config.get("engine") == "vllm"


def loop_step_seconds(steps: list[dict], arrivals: list[dict] | None = None,
                      places: list[int] | None = None) -> list[tuple[dict, float]]:
    """(step, seconds) for a vLLM log: the step's schedule-to-update time plus the gap until
    the next step's schedule() (the engine core's output processing and hand-off to its
    front end: not zero, and a cost model of vLLM prices it as the step's overhead). Left
    out: the last step (no next one), a step followed by a negative gap or one over
    MAX_LOOP_GAP_S, and one after which the engine sat idle (the next step is the first
    after idle, `steps_since_idle`: with `arrivals`, its requests all reached the server
    after this step ended; a light load's idle gaps were 6-8% of its logged time). `places`:
    that list where the caller has it already."""
    place = steps_since_idle(steps, arrivals) if places is None else places
    out = []
    for i, (rec, nxt) in enumerate(zip(steps, steps[1:])):
        gap = nxt["t_start"] - rec["t_end"]
        if gap < 0 or gap > MAX_LOOP_GAP_S or place[i + 1] == 1:
            continue
        out.append((rec, rec["step_s"] + gap))
    return out


def steps_since_idle(steps: list[dict], arrivals: list[dict] | None = None) -> list[int]:
    """Per step (in log order), its place in the stretch the engine has been busy: 1 for the
    first step after the engine sat idle (the log's first step; a step each of whose
    requests reached the server after the previous step ended, so that the engine ran out
    of work and waited, or, without `arrivals`, one after a gap over MAX_LOOP_GAP_S), 2
    for the next one, and so on. (A request that reached the server during the previous
    step and is handed over as it ends kept the engine busy.) A cost model's `wake`
    section prices the first few apart (core.cost.fit.fit_wake)."""
    reached = ({a["req_id"]: a.get("t_arrival", a["t"]) for a in arrivals} if arrivals is not None else None)
    out: list[int] = []
    for i, rec in enumerate(steps):
        if i == 0:
            out.append(1)
            continue
        prev_end = steps[i - 1]["t_end"]
        if reached is not None:
            batch = rec["decision"]["batch"]
            woke = bool(batch) and all(reached.get(b[0], -1.0) > prev_end for b in batch)
        else:
            woke = rec["t_start"] - prev_end > MAX_LOOP_GAP_S
        out.append(1 if woke else out[-1] + 1)
    return out


def intake_seconds(steps: list[dict], arrivals: list[dict]) -> list[float]:
    """Per request that found the engine idle (its last step ended before the request
    reached the server, and none started before the engine took it), the seconds from
    reaching the server (t_arrival) to entering the engine (t): the server's own work on a
    request and the hand-off, which a request joining a busy engine hides in the step in
    flight. Arrival order."""
    ends = sorted(s["t_end"] for s in steps)
    starts = sorted(s["t_start"] for s in steps)
    out = []
    for a in sorted(arrivals, key=lambda a: a.get("t_arrival", a["t"])):
        t_arrival, t = a.get("t_arrival", a["t"]), a["t"]
        # a step that started before t and ended after t_arrival: the engine was busy
        busy = bisect_left(starts, t) - bisect_right(ends, t_arrival)
        if busy <= 0:
            out.append(t - t_arrival)
    return out


def first_visible_index(finish: dict | None) -> int:
    """0-based index of the output token a streaming client sees first (the first with
    text); 0 when the log does not say."""
    k = (finish or {}).get("first_text_token")
    return k - 1 if isinstance(k, int) and k >= 1 else 0
