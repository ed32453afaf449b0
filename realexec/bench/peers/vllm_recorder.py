"""Record vLLM v1's scheduling decisions and step times as a twinserve step log.

Run by vLLM's own interpreter (vLLM is not a twinserve dependency), by path:

    VLLM_CPU_OMP_THREADS_BIND=0-1 /path/to/vllm-venv/bin/python realexec/bench/peers/vllm_recorder.py \
        --model HF_DIR --requests requests.json --out LOG [--num-gpu-blocks N] [--max-num-seqs N] ...

(`python -m realexec bench record-vllm` writes requests.json from a trace and runs this.)
Imports only vllm and the stdlib, and vllm only inside `main`: twinserve's tests import
this module for `step_record` without vLLM installed.

How: vLLM's offline `LLM` engine runs with its engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), and vLLM's v1 `Scheduler` class is patched before the
engine is built: `add_request` logs an arrival, `_preempt_request` notes each victim in
order, `schedule` logs the decision (read from its SchedulerOutput before the model runs),
`update_from_output` closes the step (its wall time) and logs the requests it finished,
each with `first_text_token` (after how many output tokens its text first showed, decoded
with the model's tokenizer, which the patched `__init__` loads: a streaming client's TTFT
is that token's, and SmolLM2 starts a quarter of ShareGPT completions with a silent
`<|im_end|>`).
A warm-up generate() runs first, unrecorded, then the prefix cache is reset, so the log
starts from an empty cache like a replay does.

The log is `core/cost/step_log.py`'s format: a config record (the knobs our core takes,
plus a "vllm" section: version, the raw block count, chunked prefill, prefix caching,
long-prefill thresholds, async scheduling, the exact command), arrivals, steps, finishes.
Each step's "decision" is the same plain dict our engines log: per scheduled request
[id, start (tokens already computed, prefix-cache hits included), tokens scheduled,
samples (1 when the slice reaches the end of the request's tokens), blocks in its table]
in vLLM's scheduling order (running requests, then waiting ones), the ids vLLM preempted
in this step in the order it chose them, swaps/copies (always 0: vLLM v1 recomputes), and
the KV blocks held (vLLM's blocks minus its reserved null block minus the free queue;
cached-but-free prefix blocks count as free, as in vLLM). The step record's "vllm" part
adds: new requests, their prefix-cache hits, resumed ones, the ids finished, free blocks.
`cache.num_gpu_blocks` is vLLM's usable count (its total minus the null block).

requests.json: {"requests": [{"prompt_token_ids": [...], "max_tokens": N, "req_id": optional,
"at_step": optional}]}. Every request is greedy with EOS ignored, so it generates exactly
max_tokens tokens. Without "at_step" all are submitted at once (one generate() call, an
offline batch); with it (on every request) the engine is stepped here and a request enters
before the engine's step number at_step (0-based; an idle engine skips ahead to the next
arrival): how `bench profile-vllm` lays out its grid (decodes at every batch size,
prefills alone and into running batches).

Exit status: 0 done; 2 bad arguments or requests file (one line on stderr); 3 vllm
cannot be imported by this interpreter.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

LOG_FORMAT = "twinserve-step-log"        # core.cost.step_log.LOG_FORMAT (not imported: vLLM's venv)


# ----------------------------------------------------------------------------- pure conversion

def step_decision(so, num_tokens: dict[str, int], blocks: dict[str, int], preempted: list[str],
                  used_blocks: int) -> dict:
    """Our step-log decision from a vLLM SchedulerOutput `so`, read right after schedule():
    `num_tokens[rid]` is the request's tokens (prompt + outputs) when it was scheduled,
    `blocks[rid]` its block-table length after scheduling, `preempted` the victims in order."""
    start: dict[str, int] = {}
    for new in so.scheduled_new_reqs:
        start[new.req_id] = new.num_computed_tokens
    cached = so.scheduled_cached_reqs
    for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
        start[rid] = computed
    batch = []
    for rid, n in so.num_scheduled_tokens.items():    # insertion order = vLLM's scheduling order
        if rid not in start:
            raise ValueError(f"vLLM scheduled request {rid!r} but it is neither a new nor a cached request")
        s = start[rid]
        batch.append([rid, s, n, 1 if s + n >= num_tokens[rid] else 0, blocks[rid]])
    return {"batch": batch, "preempted": list(preempted), "swap_out": 0, "swap_in": 0, "copy": 0,
            "used_gpu_blocks": used_blocks}


def step_extra(so, num_free_blocks: int) -> dict:
    """The vLLM-only facts of a step (kept out of `decision`, which replay compares)."""
    cached = so.scheduled_cached_reqs
    return {"new": [r.req_id for r in so.scheduled_new_reqs],
            "prefix_hits": {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs if r.num_computed_tokens},
            "resumed": sorted(getattr(cached, "resumed_req_ids", ()) or ()),
            "num_free_blocks": num_free_blocks}


def first_text_token(decode, output_ids) -> int | None:
    """How many output tokens the request had when its text first showed, as a streaming
    client sees it (the decoded tokens so far, special tokens skipped, are not empty and do
    not end in an incomplete character: bench serve's TTFT is that chunk); None: never.
    `decode(ids) -> str` skips special tokens."""
    for k in range(1, len(output_ids) + 1):
        text = decode(output_ids[:k])
        if text and not text.endswith("\ufffd"):
            return k
    return None


def finish_status(status) -> str:
    """Our finish status for vLLM's RequestStatus (FINISHED_LENGTH_CAPPED -> "length", ...)."""
    name = getattr(status, "name", str(status)).upper()
    for key, ours in (("LENGTH", "length"), ("STOPPED", "stop"), ("ABORTED", "abort"), ("IGNORED", "abort")):
        if key in name:
            return ours
    return name.lower()


# ----------------------------------------------------------------------------- the recorder

class Recorder:
    """Collects the records; `install(Scheduler)` patches vLLM's scheduler class to feed it."""

    def __init__(self, live_path: str | None = None, command: str = "", decode=None):
        self.t0 = time.monotonic()
        # decode(ids) -> text, special tokens skipped: a finish's first_text_token. Loaded from
        # the model's tokenizer when the scheduler is built (engine start-up, not a step).
        self.decode, self._decode_tried = decode, decode is not None
        self.on = live_path is not None
        self.records: list[dict] = []
        self.scheduler = None
        self.step = 0                          # steps updated (landed) while recording
        self.scheduled = 0                     # steps scheduled while recording (more under async scheduling)
        self._pending: dict[int, tuple] = {}   # id(SchedulerOutput) -> the step scheduled, not yet updated
        self._preempted: list[str] = []
        # live mode (`vllm serve`, killed at the end): every record is written and flushed as
        # it happens, the config record first (at the first schedule(), when the engine is known)
        self.live_path, self.command, self._live = live_path, command, None

    def emit(self, record: dict) -> None:
        if self.live_path is None:
            self.records.append(record)
            return
        if self._live is None:
            import vllm          # loaded already: the scheduler being recorded is vLLM's
            self._live = open(self.live_path, "w", buffering=1)
            model = self.scheduler.vllm_config.model_config.model
            self._live.write(json.dumps(self.config_record(getattr(vllm, "__version__", "unknown"),
                                                           shlex.split(self.command), model)) + "\n")
        self._live.write(json.dumps(record, separators=(",", ":")) + "\n")

    def now(self) -> float:
        return time.monotonic() - self.t0

    def load_tokenizer(self, scheduler) -> None:
        """`decode` from the tokenizer of the scheduler's model (transformers, in vLLM's venv);
        a tokenizer that cannot be loaded leaves first_text_token unknown (None), said once."""
        if self._decode_tried:
            return
        self._decode_tried = True
        model_config = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
        path = getattr(model_config, "tokenizer", None) or getattr(model_config, "model", None)
        if path is None:
            return
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:      # any failure inside transformers: record without it
            print(f"twinserve vLLM recorder: no tokenizer from {path} ({type(e).__name__}: {e}): "
                  f"finish records carry first_text_token null", file=sys.stderr, flush=True)
            return
        self.decode = lambda ids: tok.decode(ids, skip_special_tokens=True)

    def install(self, scheduler_cls) -> None:
        rec = self
        orig_init = scheduler_cls.__init__
        orig_add, orig_preempt = scheduler_cls.add_request, scheduler_cls._preempt_request

        def __init__(self, *a, **kw):
            orig_init(self, *a, **kw)
            rec.load_tokenizer(self)
        orig_schedule, orig_update = scheduler_cls.schedule, scheduler_cls.update_from_output

        def add_request(self, request):
            rec.scheduler = self
            if rec.on:
                t = rec.now()
                waited = max(0.0, time.time() - request.arrival_time)   # arrival_time: epoch seconds
                sp = request.sampling_params
                # step / landed: batches scheduled / updated before it came (they differ under
                # async scheduling, where a step is scheduled before the previous one lands)
                rec.emit({"kind": "arrival", "req_id": request.request_id, "step": rec.scheduled,
                                    "landed": rec.step, "t": t,
                                    "t_arrival": max(0.0, t - waited),
                                    "prompt_token_ids": list(request.prompt_token_ids),
                                    "max_tokens": sp.max_tokens if sp is not None else None})
            return orig_add(self, request)

        def _preempt_request(self, request, *a, **kw):
            if rec.on:
                rec._preempted.append(request.request_id)
            return orig_preempt(self, request, *a, **kw)

        def schedule(self, *a, **kw):
            rec.scheduler = self
            t_start = rec.now()
            num_tokens = {rid: r.num_tokens for rid, r in self.requests.items()}
            rec._preempted = []
            so = orig_schedule(self, *a, **kw)
            if rec.on and so.total_num_scheduled_tokens > 0:
                kvm = self.kv_cache_manager
                blocks = {rid: len(kvm.get_block_ids(rid)[0]) for rid in so.num_scheduled_tokens}
                free = kvm.block_pool.get_num_free_blocks()
                used = self.kv_cache_config.num_blocks - 1 - free        # block 0 is vLLM's null block
                rec._pending[id(so)] = (so, t_start, rec.now(),
                                        step_decision(so, num_tokens, blocks, rec._preempted, used),
                                        step_extra(so, free))
                rec.scheduled += 1
            return so

        def update_from_output(self, scheduler_output, *a, **kw):
            pending = rec._pending.pop(id(scheduler_output), None)
            if pending is not None and pending[0] is not scheduler_output:
                pending = None                     # an id reused by a newer object
            t_update = rec.now()
            before = set(self.requests)
            result = orig_update(self, scheduler_output, *a, **kw)
            if pending is not None:
                _, t_start, t_sched, decision, extra = pending
                t_end = rec.now()
                finished = [rid for rid in before if rid not in self.requests]
                extra["finished"] = finished
                rec.emit({"kind": "step", "step": rec.step, "t_start": t_start, "t_end": t_end,
                                    "step_s": t_end - t_start, "schedule_s": t_sched - t_start,
                                    "execute_s": t_update - t_sched, "update_s": t_end - t_update,
                                    "decision": decision, "vllm": extra})
                rec.step += 1
            return result

        def _free_request(self, request, *a, **kw):
            if rec.on:
                out_ids = getattr(request, "output_token_ids", None)
                first = first_text_token(rec.decode, list(out_ids)) if rec.decode and out_ids else None
                rec.emit({"kind": "finish", "req_id": request.request_id,
                                    "num_output_tokens": request.num_output_tokens,
                                    "status": finish_status(request.status), "first_text_token": first})
            return orig_free(self, request, *a, **kw)

        orig_free = scheduler_cls._free_request
        scheduler_cls.__init__ = __init__
        scheduler_cls.add_request = add_request
        scheduler_cls._preempt_request = _preempt_request
        scheduler_cls.schedule = schedule
        scheduler_cls.update_from_output = update_from_output
        scheduler_cls._free_request = _free_request

    def config_record(self, vllm_version: str, command: list[str], model: str) -> dict:
        s = self.scheduler
        if s is None:
            raise RuntimeError("vLLM's scheduler was never called: nothing was recorded")
        sc, cc = s.scheduler_config, s.cache_config
        num_blocks = s.kv_cache_config.num_blocks
        return {"kind": "config", "format": LOG_FORMAT, "engine": "vllm",
                "scheduler": {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
                              "max_model_len": getattr(sc, "max_model_len", None)
                              or s.vllm_config.model_config.max_model_len,
                              "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
                              **({"async_scheduling": True} if getattr(sc, "async_scheduling", False) else {})},
                "cache": {"block_size": cc.block_size, "num_gpu_blocks": num_blocks - 1, "num_cpu_blocks": 0,
                          "enable_prefix_caching": bool(cc.enable_prefix_caching), "watermark": 0.0},
                "policies": {"queue": "fcfs", "preemption": "recompute", "victim": "tail", "eviction": "lru",
                             "scheduler": "vllm-v1"},
                "vllm": {"version": vllm_version, "num_blocks": num_blocks,
                         "scheduler_cls": f"{type(s).__module__}.{type(s).__qualname__}",
                         "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
                         "long_prefill_token_threshold": getattr(sc, "long_prefill_token_threshold", 0),
                         "max_num_partial_prefills": getattr(sc, "max_num_partial_prefills", 1),
                         "max_long_partial_prefills": getattr(sc, "max_long_partial_prefills", 1),
                         "scheduler_watermark": getattr(sc, "watermark", 0.0),
                         "policy": str(getattr(sc, "policy", "fcfs")),
                         "model": model, "command": shlex.join(command),
                         "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
                         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}}

    def write(self, path: str, config: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            for r in [config] + self.records:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        os.replace(tmp, path)


def install_on_import(path: str, command: str = "") -> Recorder:
    """Live recording to `path` for a `vllm serve` process tree (called from the
    sitecustomize that sim/twin/vllm_serve.py puts on PYTHONPATH): vLLM's v1 Scheduler class
    is patched as soon as its module is imported, in whichever process that happens."""
    import importlib.abc
    import importlib.util

    target = "vllm.v1.core.sched.scheduler"
    rec = Recorder(path, command)
    if target in sys.modules:
        rec.install(sys.modules[target].Scheduler)
        return rec

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, import_path, target_module=None):
            if name != target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                rec.install(module.Scheduler)
            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Hook())
    return rec


def read_requests(path: str) -> list[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the requests file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    items = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected {{\"requests\": [{{\"prompt_token_ids\": [...], \"max_tokens\": N}}, ...]}}")
    for i, r in enumerate(items):
        ids = r.get("prompt_token_ids") if isinstance(r, dict) else None
        m = r.get("max_tokens") if isinstance(r, dict) else None
        if (not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids)
                or not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"{path}: request {i}: expected a non-empty 'prompt_token_ids' list of token ids "
                             f"and an integer 'max_tokens' >= 1")
        k = r.get("at_step")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"{path}: request {i}: 'at_step' must be an integer >= 0, got {k!r}")
    timed = sum(1 for r in items if r.get("at_step") is not None)
    if timed not in (0, len(items)):
        raise ValueError(f"{path}: {timed} of {len(items)} requests have 'at_step': give it to every request or none")
    return items


def arrival_plan(requests: list[dict]) -> list[tuple[int, list[int]]]:
    """[(step, indices of the requests entering before it)] in step order (requests with
    "at_step"; file order within a step)."""
    plan: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        plan.setdefault(r["at_step"], []).append(i)
    return sorted(plan.items())


def run_stepped(engine, requests: list[dict], params) -> int:
    """Step vLLM's LLMEngine by hand, adding each request before its step (an engine with
    nothing to do jumps to the next arrival); returns the steps run."""
    plan = arrival_plan(requests)
    step = nxt = 0
    while nxt < len(plan) or engine.has_unfinished_requests():
        if nxt < len(plan) and not engine.has_unfinished_requests():
            step = max(step, plan[nxt][0])
        while nxt < len(plan) and plan[nxt][0] <= step:
            for i in plan[nxt][1]:
                r = requests[i]
                engine.add_request(str(r.get("req_id", i)), {"prompt_token_ids": r["prompt_token_ids"]},
                                   params([r])[0])
            nxt += 1
        engine.step()
        step += 1
    return step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory vLLM loads")
    p.add_argument("--requests", required=True, help="requests JSON file")
    p.add_argument("--out", required=True, help="step log to write (JSON lines)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="vLLM's num_gpu_blocks_override")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--async-scheduling", action="store_true",
                   help="vLLM's async scheduling (default off: steps are recorded one after the other)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recorded-by", default=None, metavar="CMD",
                   help="the command that made the requests file (kept in the log's config record)")
    args = p.parse_args(argv)
    try:
        requests = read_requests(args.requests)
        if not os.path.isdir(args.model):
            raise ValueError(f"--model {args.model}: not a directory")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "block_size"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the engine core in this process: patchable
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception as e:   # ImportError, or a broken install failing inside vllm
        print(f"error: cannot import vllm with {sys.executable}: {type(e).__name__}: {e}", file=sys.stderr)
        return 3

    rec = Recorder()
    rec.install(Scheduler)          # its tokenizer loads when the engine builds the scheduler
    kwargs = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                ("max_num_batched_tokens", args.max_num_batched_tokens),
                                ("num_gpu_blocks_override", args.num_gpu_blocks),
                                ("block_size", args.block_size)) if v is not None}
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager,
              seed=args.seed, max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
              async_scheduling=args.async_scheduling, **kwargs)

    def params(reqs):
        return [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]

    if not args.no_warmup:    # prompts of the same lengths, other content; then an empty prefix cache
        warm = [{"prompt_token_ids": list(reversed(r["prompt_token_ids"])), "max_tokens": min(r["max_tokens"], 8)}
                for r in requests[:4]]
        llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in warm], params(warm), use_tqdm=False)
        llm.reset_prefix_cache()
    load_before = os.getloadavg()[0]
    rec.t0 = time.monotonic()
    rec.on = True
    if requests[0].get("at_step") is None:
        llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params(requests), use_tqdm=False)
    else:
        run_stepped(llm.llm_engine, requests, params)
    rec.on = False
    command = [sys.executable, os.path.abspath(__file__)] + argv
    config = rec.config_record(getattr(vllm, "__version__", "unknown"), command, args.model)
    config["vllm"]["loadavg_1m"] = [load_before, os.getloadavg()[0]]     # how shared the machine was
    if args.recorded_by:
        config["vllm"]["recorded_by"] = args.recorded_by
    rec.write(args.out, config)
    steps = sum(1 for r in rec.records if r["kind"] == "step")
    preempted = sum(len(r["decision"]["preempted"]) for r in rec.records if r["kind"] == "step")
    print(f"recorded {len(requests)} requests, {steps} steps, {preempted} preemptions -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
