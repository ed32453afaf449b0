"""Result files of a simulation run, and the summary table printed after it.

    requests.csv     one row per request (Vidur's column names where they exist)
    summary.json     aggregates (vLLM `bench serve` names) + KV/queue stats + config echo;
                     no wall-clock numbers, so equal inputs give byte-identical files
    timeseries.csv   one row per engine step (per skipped span with event skipping,
                     per idle gap), see SimResult.TIMESERIES_COLUMNS
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from core.metrics import RequestRecord, summarize
from sim.engine import SimResult

REQUEST_COLUMNS = (
    # Vidur (vidur/metrics/constants.py, entities/request.py)
    "request_id", "arrived_at", "scheduled_at", "prefill_completed_at", "completed_at",
    "request_num_prefill_tokens", "request_num_decode_tokens", "request_num_tokens",
    "request_scheduling_delay", "prefill_e2e_time", "prefill_time_execution_plus_preemption",
    "request_e2e_time", "request_e2e_time_normalized", "request_execution_plus_preemption_time",
    "request_execution_time", "request_preemption_time", "decode_time_execution_plus_preemption_normalized",
    "request_num_restarts",
    # twinserve
    "status", "num_output_tokens", "ttft", "tpot", "normalized_latency", "queue_time",
    "num_cached_prompt_tokens", "num_swaps", "reject_reason",
)

# Kinds of rejection, by the start of the reason core.sched.scheduler (`_never_fits`) gives;
# summary.json counts them, the printed summary says what to change for each.
REJECT_KINDS = (
    ("prompt_too_long", "prompt has "),                    # prompt >= max_model_len
    ("too_many_sequences", "request needs "),              # n / beam width > max_num_seqs
    ("kv_cache_too_small", "its "),                        # worst case > all KV blocks
    ("prompt_exceeds_cache", "prompt needs more KV blocks"),
)


def reject_kind(reason: str | None) -> str:
    """The kind of a rejection reason (the reason itself when it is of no known kind)."""
    for kind, start in REJECT_KINDS:
        if reason and reason.startswith(start):
            return kind
    return reason or "unknown"


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _div(a: float | None, b: float) -> float | None:
    return None if a is None or not b else a / b


def request_row(rec: RequestRecord, requested_output: int) -> list:
    """One requests.csv row. Execution vs preemption time: a request is 'executing'
    from its first scheduling to its finish except while back in the waiting queue after
    a recompute preemption (queue time after the first admission)."""
    delay = _sub(rec.first_scheduled_time, rec.arrival_time)
    exec_plus = _sub(rec.finished_time, rec.first_scheduled_time)
    preempted = None if delay is None else max(0.0, rec.queue_time - delay)
    return [
        rec.request_id, rec.arrival_time, rec.first_scheduled_time, rec.first_token_time, rec.finished_time,
        rec.num_prompt_tokens, requested_output, rec.num_prompt_tokens + requested_output,
        delay, rec.ttft, _sub(rec.first_token_time, rec.first_scheduled_time),
        rec.e2el, _div(rec.e2el, rec.num_output_tokens), exec_plus,
        _sub(exec_plus, preempted), preempted,
        _div(_sub(rec.finished_time, rec.first_token_time), rec.num_output_tokens),
        rec.num_preemptions,
        rec.status, rec.num_output_tokens, rec.ttft, rec.tpot, rec.normalized_latency, rec.queue_time,
        rec.num_cached_prompt_tokens, rec.num_swaps, rec.reject_reason,
    ]


def _clean(value):
    """JSON-safe: NaN/inf -> None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def reject_reasons(records) -> dict:
    """{kind: {count, example (the first such request's reason), max_prompt_tokens}} over
    the rejected records, most frequent kind first."""
    out: dict[str, dict] = {}
    for r in records:
        if r.status != "rejected":
            continue
        kind = reject_kind(r.reject_reason)
        entry = out.get(kind)
        if entry is None:
            entry = out[kind] = {"count": 0, "example": r.reject_reason, "max_prompt_tokens": 0}
        entry["count"] += 1
        entry["max_prompt_tokens"] = max(entry["max_prompt_tokens"], r.num_prompt_tokens)
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["count"], kv[0])))


def build_summary(result: SimResult) -> dict:
    """summary.json's content: deterministic for equal inputs (no wall-clock times)."""
    s = summarize(result.records)
    s = {"num_requests": len(result.records), **s}
    s["reject_reasons"] = reject_reasons(result.records)
    s["num_preemptions"] = result.num_preemptions      # the scheduler's count (= sum over requests)
    s["num_swaps"] = result.num_swaps
    s["num_swapped_blocks"] = result.num_swapped_blocks
    s["swap_time"] = result.swap_time
    s["sim_time"] = result.sim_time
    s["num_steps"] = result.num_steps
    s.update(result.kv_stats)
    s.update(result.time_weighted)
    s["memory_breakdown"] = result.memory_breakdown
    s["kv_sharing"] = result.kv_sharing
    if result.pipeline:
        s["pipeline"] = result.pipeline
    if result.async_scheduling:
        s["async_scheduling"] = result.async_scheduling
    s["trace"] = result.trace_source
    s["config"] = result.config.echo()
    return _clean(s)


def write_results(result: SimResult, out_dir: str | Path) -> dict:
    """Write requests.csv, summary.json and timeseries.csv; returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = build_summary(result)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for rec, req_out in zip(result.records, result.requested_output_lens):
            w.writerow(["" if v is None else v for v in request_row(rec, req_out)])
    with open(out / "timeseries.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(result.TIMESERIES_COLUMNS)
        w.writerows(result.timeseries)
    return summary


def reject_lines(summary: dict) -> list[str]:
    """The rejections by kind, each with what to change to admit them."""
    reasons = summary.get("reject_reasons") or {}
    c = summary["config"]
    lines = []
    for kind, r in reasons.items():
        lines.append(f"{'rejected':12} {r['count']:,} {kind}, longest prompt {r['max_prompt_tokens']:,} tokens "
                     f"(e.g. {r['example']})")
        lines.append(f"{'':12} -> {_reject_hint(kind, r, c)}")
    return lines


def _reject_hint(kind: str, r: dict, c: dict) -> str:
    from core.cost.specs import MODELS
    cache_tokens = c["num_gpu_blocks"] * c["block_size"]
    more_kv = "more KV cache (--hardware with more memory, --tp, --gpu-memory-utilization, --num-gpu-blocks)"
    if kind == "prompt_too_long":
        need = r["max_prompt_tokens"] + 1                          # the prompt and one output token
        want = -(-need // 1024) * 1024
        model = MODELS.get(c["model"])
        context = model.max_model_len if model else c["max_model_len"]
        if need <= context:
            want = min(want, context)
            if need <= cache_tokens:
                return f"--max-model-len {want:,} (now {c['max_model_len']:,}; {c['model']}'s context is {context:,})"
            return (f"--max-model-len {want:,} with {more_kv}: the cache holds {cache_tokens:,} tokens, "
                    f"which caps max_model_len at {c['max_model_len']:,}")
        longer = sorted((m for m in MODELS.values() if m.max_model_len >= need), key=lambda m: m.max_model_len)
        if not longer:
            top = max(MODELS.values(), key=lambda m: m.max_model_len)
            return (f"{c['model']}'s context is {context:,} tokens and no built-in model's reaches {need:,} "
                    f"(the longest: --model {top.name}, {top.max_model_len:,}); those prompts cannot be served")
        names = " or ".join(f"--model {m.name} (context {m.max_model_len:,})" for m in longer[:2])
        return (f"{c['model']}'s context is {context:,} tokens; use a longer-context model: {names}, whose "
                f"max_model_len defaults to its context if the KV cache holds it (else give --max-model-len "
                f"{min(want, longer[0].max_model_len):,} and more KV memory)")
    if kind == "too_many_sequences":
        return f"--max-num-seqs at least the request's sequences (--n / --beam-width; now {c['max_num_seqs']})"
    if kind in ("kv_cache_too_small", "prompt_exceeds_cache"):
        return f"{more_kv}, or a smaller --max-model-len (now {c['max_model_len']:,})"
    return "see the reason in requests.csv's reject_reason column"


def sharing_text(saving: float) -> str:
    """The sharing saving in words. It is negative when blocks are held outside every block
    table (e.g. a prefill replica's KV kept for its transfer), which is no saving at all."""
    if saving >= 0.0005:
        return f"sharing saves {saving:.1%} of the blocks"
    if saving > -0.0005:
        return "no blocks shared"
    return (f"no blocks shared; {-saving:.1%} more blocks in use than the block tables hold (KV kept outside "
            f"them, e.g. for a transfer)")


def format_summary(summary: dict) -> str:
    """A short human-readable table of the key numbers."""
    c = summary["config"]

    def ms(key: str) -> str:
        v = summary.get(key)
        return "-" if v is None else f"{v * 1e3:,.1f}"

    pp, tp = c.get("pipeline_parallel_size", 1), c["tensor_parallel_size"]
    gpus = f"{tp}x" if pp == 1 else f"{tp * pp}x (TP{tp} x PP{pp})"
    hardware = c["hardware"]
    if c.get("replicas", 1) > 1 or c.get("disaggregate"):          # a fleet (sim.cluster.fleet.fleet_summary)
        per = tp * pp
        split = c.get("disaggregate")
        what = (f"{split.split(':')[0]} prefill + {split.split(':')[1]} decode replicas" if split
                else f"{c['replicas']} replicas")
        gpus = f"{summary.get('num_gpus', per * c['replicas'])}x"
        hardware += f" ({what} of {per} GPU{'s' if per > 1 else ''}), each"
    lines = [
        f"{c['model']} on {gpus} {hardware}: {c['num_gpu_blocks']:,} KV blocks of {c['block_size']} "
        f"tokens, max_num_seqs={c['max_num_seqs']}, max_num_batched_tokens={c['max_num_batched_tokens']}, "
        f"policies {c.get('allocation', 'paged')}/{c['queue_policy']}/{c['preemption_mode']}/{c['victim_policy']}"
        f"{'/prefix-cache ' + c['eviction_policy'] if c['enable_prefix_caching'] else ''}",
        f"requests     {summary['completed']:,} completed, {summary['rejected']:,} rejected "
        f"of {summary['num_requests']:,}; simulated {summary['sim_time']:,.1f} s in {summary['num_steps']:,} steps",
        f"throughput   {summary['request_throughput']:,.2f} req/s, {summary['output_throughput']:,.0f} output tok/s, "
        f"{summary['total_token_throughput']:,.0f} total tok/s",
        f"{'':12} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10}",
    ]
    for name, label in (("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("itl", "ITL ms"), ("e2el", "E2EL ms"),
                        ("normalized_latency", "norm ms/tok")):
        lines.append(f"{label:12} {ms('mean_' + name):>10} {ms('median_' + name):>10} "
                     f"{ms('p90_' + name):>10} {ms('p99_' + name):>10}")
    lines.append(
        f"KV cache     usage mean {summary['kv_usage_mean']:.1%}, max {summary['kv_usage_max']:.1%}; "
        f"preemptions {summary['num_preemptions']:,} (swaps {summary['num_swaps']:,}); "
        f"prefix hit rate {summary['prefix_cache_hit_rate']:.1%}")
    pipe = summary.get("pipeline")
    if pipe:
        lines.append(f"pipeline     stages of {'/'.join(map(str, pipe['stage_layers']))} layers, busy "
                     f"{' / '.join(f'{b:.0%}' for b in pipe['stage_busy'])}; "
                     f"{pipe['batches_in_flight_mean']:.2f} batches in flight on average")
    overlap = summary.get("async_scheduling")
    if overlap:
        lines.append(f"async        host busy {overlap['host_busy']:.0%}, device busy {overlap['device_busy']:.0%} "
                     f"(scheduled while the step before computes); "
                     f"{overlap['batches_in_flight_mean']:.2f} batches in flight on average")
    shares = summary.get("memory_breakdown", {}).get("shares")
    if shares:
        lines.append(
            f"KV memory    of the memory in use (time-averaged): token states {shares['token_states']:.1%}, "
            f"reservation {shares['reserved']:.1%}, internal frag. {shares['internal_frag']:.1%}, "
            f"external frag. {shares['external_frag']:.1%}"
            + (f"; {sharing_text(summary['kv_sharing']['saving'])}" if c.get("allocation", "paged") == "paged"
               else ""))
    return "\n".join(lines)
