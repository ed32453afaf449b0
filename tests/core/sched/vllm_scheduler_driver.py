"""Drive vLLM v1's own Scheduler (no model) through a scenario and write its decisions as a
twinserve step log: the ground truth for tests/core/sched/test_vllm_v1.py.

Runs under vLLM's python, never under twinserve's (CI does not install vLLM):

    /work/peers/vllm-venv/bin/python tests/core/sched/vllm_scheduler_driver.py \
        SCENARIO.json... --model /work/peers/smollm2-135m-fp32 --out-dir DIR   # DIR/SCENARIO.jsonl

SCENARIO.json: {"block_size", "num_blocks" (usable blocks, vLLM's null block not counted),
"max_num_seqs", "max_num_batched_tokens", "max_model_len", "long_prefill_token_threshold"
(optional), "enable_prefix_caching" (optional, default true), "requests": [{"id", "prompt"
(token ids), "max_tokens", "step" (steps executed before it arrives), "priority"
(optional)}], "async_scheduling" (optional, default false)}. Each step samples token 7 for
every request that reaches its end (the model is never loaded: only its config is read); a
request finishes at max_tokens.

With "async_scheduling" the driver runs vLLM's AsyncScheduler the way its engine core's
batch queue does (`EngineCore.step_with_batch_queue`, 2 batches): schedule and queue while
fewer than 2 fly and the schedule is not empty, else update with the oldest batch's output.
A request's "step" is then the number of batches scheduled before it arrives, and its
"landed" the number of them updated by then (the two place an arrival between a schedule
and an update).

`python -m sim replay LOG --scheduler vllm-v1` then checks our core decides the same.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import deque

SAMPLED_TOKEN = 7


def build(scenario: dict, model: str):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams  # noqa: F401  (import check)
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager
    import torch

    bs = scenario["block_size"]
    max_len = scenario["max_model_len"]
    model_config = ModelConfig(model=model, max_model_len=max_len, dtype="float32", skip_tokenizer_init=True)
    sched_config = SchedulerConfig(
        max_num_seqs=scenario["max_num_seqs"], max_num_batched_tokens=scenario["max_num_batched_tokens"],
        max_model_len=max_len, enable_chunked_prefill=True,
        long_prefill_token_threshold=scenario.get("long_prefill_token_threshold", 0),
        policy=scenario.get("policy", "fcfs"), is_encoder_decoder=False)
    caching = scenario.get("enable_prefix_caching", True)
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=caching)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=sched_config, cache_config=cache_config)
    is_async = bool(scenario.get("async_scheduling", False))
    vllm_config.scheduler_config.async_scheduling = is_async
    vllm_config.cache_config.num_gpu_blocks = scenario["num_blocks"] + 1       # + vLLM's null block
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=scenario["num_blocks"] + 1,       # + vLLM's null block
                              kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])
    scheduler = (AsyncScheduler if is_async else Scheduler)(vllm_config=vllm_config, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=bs,
                          log_stats=False)
    hasher = None
    if caching:
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(bs, hash_fn)
    return scheduler, hasher


def run(scenario: dict, model: str, out) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler, hasher = build(scenario, model)
    kv = scheduler.kv_cache_manager
    usable = scenario["num_blocks"]

    def emit(rec):
        out.write(json.dumps(rec, separators=(",", ":")) + "\n")

    emit({"kind": "config", "format": "twinserve-step-log", "source": "vllm-scheduler-driver",
          "scheduler": {"max_num_seqs": scenario["max_num_seqs"],
                        "max_num_batched_tokens": scenario["max_num_batched_tokens"],
                        "max_model_len": scenario["max_model_len"], "enable_chunked_prefill": True,
                        "long_prefill_token_threshold": scenario.get("long_prefill_token_threshold", 0),
                        **({"async_scheduling": True} if scenario.get("async_scheduling") else {})},
          "cache": {"block_size": scenario["block_size"], "num_gpu_blocks": usable, "num_cpu_blocks": 0,
                    "enable_prefix_caching": scenario.get("enable_prefix_caching", True), "watermark": 0.0},
          "policies": {"queue": scenario.get("policy", "fcfs"), "preemption": "recompute", "eviction": "lru",
                       "scheduler": "vllm-v1"}})
    pending = sorted(scenario["requests"], key=lambda r: r["step"])
    preempted: list[str] = []              # this step's victims, in preemption order
    inner = scheduler._preempt_request

    def preempt(request, *args, **kwargs):
        preempted.append(request.request_id)
        return inner(request, *args, **kwargs)

    scheduler._preempt_request = preempt
    is_async = bool(scenario.get("async_scheduling"))
    depth = 2 if is_async else 1             # batches in flight (vLLM's batch queue)
    flying: deque = deque()                  # (SchedulerOutput, ids that sample), oldest first
    outputs: dict[str, int] = {}             # tokens each request got, arrival order
    finished: set[str] = set()
    scheduled = 0                            # batches scheduled (a request's "step" counts these)
    t = 0.0
    while pending or scheduler.has_unfinished_requests() or flying:
        if pending and not scheduler.has_unfinished_requests() and not flying and pending[0]["step"] > scheduled:
            pending[0] = dict(pending[0], step=scheduled)    # an idle engine takes the next arrival now
        while pending and pending[0]["step"] <= scheduled:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
            scheduler.add_request(Request(r["id"], list(r["prompt"]), params, None,
                                          arrival_time=t + len(outputs) * 1e-6, priority=r.get("priority", 0),
                                          block_hasher=hasher))
            outputs[r["id"]] = 0
            landed = {"landed": scheduled - len(flying)} if is_async else {}
            emit({"kind": "arrival", "req_id": r["id"], "step": scheduled, **landed, "t": t,
                  "prompt_token_ids": list(r["prompt"]), "max_tokens": r["max_tokens"],
                  "priority": r.get("priority", 0)})
        if len(flying) < depth and scheduler.has_unfinished_requests():
            preempted.clear()
            so = scheduler.schedule()
            if so.total_num_scheduled_tokens > 0:
                decision, sampled_ids = _decision(scheduler, kv, usable, so, preempted)
                emit({"kind": "step", "step": scheduled, "t_start": t, "t_end": t + 0.001, "step_s": 0.001,
                      "decision": decision})
                flying.append((so, sampled_ids))
                scheduled += 1
                t += 0.001
                if len(flying) < depth:
                    continue
        if not flying:
            if pending:
                continue
            raise RuntimeError("nothing scheduled and nothing in flight with requests unfinished")
        so, sampled_ids = flying.popleft()
        req_ids = list(so.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[[SAMPLED_TOKEN] if r in sampled_ids else [] for r in req_ids])
        scheduler.update_from_output(so, mro)
        for rid in sampled_ids:
            outputs[rid] += 1
            if rid not in finished and (rid not in scheduler.requests or scheduler.requests[rid].is_finished()):
                finished.add(rid)
                emit({"kind": "finish", "req_id": rid, "num_output_tokens": outputs[rid], "status": "length"})
        if scheduled > 100000:
            raise RuntimeError("scenario does not drain")


def _decision(scheduler, kv, usable, so, preempted):
    """(our step decision, the ids that sample) of a vLLM SchedulerOutput read right after
    schedule(). A request's start is its computed tokens before the step; it samples when
    its slice reaches its known tokens (or past them: a decode of a placeholder)."""
    computed_before = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        computed_before[rid] = cached.num_computed_tokens[i]
    batch, sampled_ids = [], []
    for rid, n in so.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        start = computed_before[rid]
        samples = 1 if start + n >= req.num_tokens else 0
        batch.append((rid, start, n, samples, len(kv.get_blocks(rid).blocks[0])))
        if samples:
            sampled_ids.append(rid)
    used = usable - kv.block_pool.get_num_free_blocks()
    return {"batch": [list(b) for b in batch], "preempted": list(preempted), "swap_out": 0, "swap_in": 0,
            "copy": 0, "used_gpu_blocks": used}, sampled_ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", nargs="+", help="scenario JSON file(s); each writes NAME.jsonl under --out-dir")
    p.add_argument("--model", required=True, help="an HF model directory (only its config is read)")
    p.add_argument("--out-dir", default=".")
    a = p.parse_args(argv)
    import os
    for path in a.scenario:
        with open(path) as f:
            scenario = json.load(f)
        name = os.path.splitext(os.path.basename(path))[0]
        with open(os.path.join(a.out_dir, name + ".jsonl"), "w") as out:
            run(scenario, a.model, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
