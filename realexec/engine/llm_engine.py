"""LLMEngine: the core's EngineCore plus tokenization, detokenization and stop strings.

    engine = LLMEngine(EngineArgs(...))
    engine.add_request("Hello", SamplingParams(max_tokens=32), request_id="a")
    while engine.has_unfinished_requests():
        for out in engine.step():            # RequestOutputs of requests that moved this step
            print(out.outputs[0].text_delta, end="")

A step is the core's three calls (schedule -> executor.execute_model -> update), then,
for each request that got tokens: incremental detokenization of each sequence, stop-
string checks (a match finishes the sequence through `scheduler.finish_sequence`), and
one RequestOutput with the text so far and the delta since the previous step.
With P pipeline stages the core keeps up to P batches in flight: a step sends new batches
while fewer than P fly, then returns the outputs of the oldest. With --async-scheduling
(one stage) two fly: a step schedules and sends step N+1, then lands step N, so the
detokenization and delivery of N's outputs, and N+2's scheduling, run while N+1 computes
on the executor's model thread.
"""
from __future__ import annotations

import atexit
import gc
import itertools
import threading
import time
from dataclasses import dataclass, field, replace

from core import (CacheConfig, EngineCore, InvalidRequestError, Request, RequestStatus, SamplingParams,
                  Scheduler, SchedulerConfig, Sequence)
from core.config import default_max_model_len, default_max_num_batched_tokens
from core.sched.request import RequestMetrics
from policies import PolicySet
from realexec.config import EngineArgs
from realexec.executor.launch import make_executor
from realexec.models.loader import prompt_token_ids

# CPU serving caps an unset max_model_len here (the model's own context can be far longer).
MAX_MODEL_LEN_CAP = 2048


@dataclass
class CompletionOutput:
    index: int                           # sample index (n > 1) or beam rank (beam search, best first)
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None     # set when logprobs were asked for, and for beams
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None     # 'stop' | 'length' | 'abort'; None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    text_delta: str = ""                 # text added since the previous output of this request
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


class _SeqText:
    """Incremental detokenization state of one sequence (offsets index seq.token_ids).

    Decode tokens[prefix_offset:] and tokens[prefix_offset:read_offset]; the new text is
    the difference. A few tokens of left context keep tokenizers that drop a leading space
    honest; a trailing U+FFFD means a multi-byte character is incomplete: wait for more."""
    __slots__ = ("index", "text", "prefix_offset", "read_offset", "sent_chars", "sent_tokens",
                 "stop_reason", "stopped_here")

    def __init__(self, index: int, num_prompt_tokens: int):
        self.index = index
        self.text = ""
        self.prefix_offset = max(0, num_prompt_tokens - 5)
        self.read_offset = num_prompt_tokens
        self.sent_chars = 0
        self.sent_tokens = 0
        self.stop_reason: str | int | None = None
        self.stopped_here = False    # finished by our stop-string check (text already truncated)


class _RequestState:
    __slots__ = ("request", "seqs", "max_stop_len")

    def __init__(self, request: Request):
        self.request = request
        self.seqs: dict[int, _SeqText] = {}
        self.max_stop_len = max((len(s) for s in request.params.stop), default=0)


def decoder_of(tokenizer):
    """The tokenizer's `decode(ids, skip_special_tokens=...)`, called on the Rust tokenizer
    itself where transformers would only forward to it: a fast tokenizer that does not clean
    up spaces returns exactly the Rust decode. Detokenizing is two decodes per sequence and
    step; transformers' wrapper took 4x the Rust call (SmolLM2: 8.3 -> 2.9 us for the two;
    on an H200 detokenization was 20% of a served step's time)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


def freeze_startup_heap() -> int:
    """Move every object alive now (the model, torch, transformers, the web stack: ~350k
    objects) out of the cyclic garbage collector's reach; returns how many. A full
    collection otherwise walks them all, ~0.2 s of CPU inside whichever engine step
    triggers it (SmolLM2 on CPU: one such step per short served run, 1.7-2.5x its usual
    time). Call once the process has loaded everything it keeps; later garbage is still
    collected, and objects freed by reference counting still are too.

    The heap is unfrozen at exit: the interpreter's last collections skip frozen objects,
    so objects only a collection frees (Triton's nanobind IR attributes, held in reference
    cycles) outlived it and nanobind printed ~30 "nanobind: leaked ..." lines after a
    clean exit."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)         # once, however often the heap is frozen
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20          # glibc's largest on 64-bit


def keep_freed_memory() -> bool:
    """Keep the memory a step's tensors free in this process for the next step (glibc: no
    mapping of its own for a block up to 32 MiB, no trimming of the heap's top); True when
    applied (False off glibc). Otherwise each step maps its large activations afresh and
    faults every page in: a 438-token SmolLM2 prefill on CPU takes ~100k minor page faults
    and 1.8-2.2 s of CPU, ~1.5 s without them, and how many a step takes depends on what
    the steps before it freed (the allocator's adaptive threshold): served steps cost
    more, and more unevenly, than the profile's repeats. The process keeps its peak heap.
    Workers of the mp / Ray executors are other processes: this covers the in-process one."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **overrides):
        args = replace(args, **overrides) if args is not None else EngineArgs(**overrides)
        args.validate()
        self.args = args
        self.executor = make_executor(args)
        try:
            self._init_engine(args)
        except BaseException:
            self.executor.shutdown()
            raise

    def _init_engine(self, args: EngineArgs) -> None:
        self.model_config = self.executor.model_config
        self.tokenizer = self.executor.tokenizer
        self._decode = decoder_of(self.tokenizer)

        num_gpu_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
        if args.num_gpu_blocks is not None:
            num_gpu_blocks = args.num_gpu_blocks
        if num_gpu_blocks < 1:
            raise ValueError("no memory left for the KV cache: raise --kv-cache-memory or "
                             "--gpu-memory-utilization")
        self.max_model_len = self._resolve_max_model_len(num_gpu_blocks)
        max_batched = args.max_num_batched_tokens or default_max_num_batched_tokens(
            args.enable_chunked_prefill, self.max_model_len)
        cache_config = CacheConfig(block_size=args.block_size, num_gpu_blocks=num_gpu_blocks,
                                   num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=args.enable_prefix_caching,
                                   watermark=args.watermark, prefix_caching_hash_algo=args.prefix_caching_hash_algo)
        scheduler_config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_batched,
                                           max_model_len=self.max_model_len,
                                           enable_chunked_prefill=args.enable_chunked_prefill,
                                           pipeline_parallel_size=args.pipeline_parallel_size,
                                           async_scheduling=args.async_scheduling)
        self.scheduler = Scheduler(scheduler_config, cache_config, PolicySet.from_names(**args.policy_names()))
        self.executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        # With P pipeline stages, P batches in flight keep every stage busy (the core's batch
        # queue; the executor sends each without waiting for the previous one's tokens).
        # Async scheduling: 2, the next step queued behind the one computing.
        self.core = EngineCore(self.scheduler, self.executor, clock=time.monotonic,
                               max_concurrent_batches=2 if args.async_scheduling else args.pipeline_parallel_size)

        cfg = self.model_config
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else cfg.eos_token_id
        # Extra end-of-sequence ids (Llama 3 instruct has several) become stop tokens.
        self.extra_eos_ids = [e for e in cfg.eos_token_ids if e != self.eos_token_id]
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.step_time = 0.0
        self.detokenize_time = 0.0
        self.sleep_level = 0
        # step() and sleep()/wake_up() may come from different threads (server endpoints).
        self._lock = threading.RLock()
        self.step_recorder = None
        if args.step_log:
            from realexec.twin.step_recorder import StepRecorder
            self.step_recorder = StepRecorder(self, args.step_log, keep=False)

    def _resolve_max_model_len(self, num_gpu_blocks: int) -> int:
        model_max = self.model_config.max_position_embeddings
        wanted = self.args.max_model_len
        if wanted is None:
            return default_max_model_len(model_max, num_gpu_blocks, self.args.block_size, cap=MAX_MODEL_LEN_CAP)
        if wanted > model_max:
            raise ValueError(f"max-model-len {wanted} exceeds the model's max_position_embeddings {model_max}")
        return wanted      # the scheduler config checks it against the cache, with a clear message

    # -- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass prompts as token ids", "prompt")
        return prompt_token_ids(self.tokenizer, prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template, ready for
        the assistant's turn."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template", "messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request; raises InvalidRequestError (a ValueError) if it can never be served.
        `arrival_time` (time.monotonic()) is when the request reached the caller, if earlier
        than now (a server hands requests to the engine thread between steps)."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}",
                                      "sampling_params")
        params.validate()
        if isinstance(prompt, str):
            text = prompt
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            token_ids = self.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[0]!r}",
                                          "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                f"(the prompt plus at least one output token must fit)", "prompt")
        if self.extra_eos_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=list(params.stop_token_ids) + self.extra_eos_ids)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._states:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        now = time.monotonic()
        arrival = now if arrival_time is None else min(arrival_time, now)
        request = Request(request_id, token_ids, params, arrival_time=arrival, priority=priority,
                          eos_token_id=self.eos_token_id, cache_salt=params.cache_salt, prompt=text)
        self.core.add_request(request)
        if request.status is RequestStatus.FINISHED_REJECTED:
            # The prompt itself was checked above: what can still not fit is n (or the beams).
            param = "n" if params.num_seqs_max > 1 else "prompt"
            raise InvalidRequestError(f"request rejected: {request.reject_reason}", param)
        self._states[request_id] = _RequestState(request)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; no further output is produced for it."""
        self._states.pop(request_id, None)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet, or batches still in flight (e.g. holding a request
        aborted meanwhile: stepping returns them and frees its blocks)."""
        return bool(self._states) or self.core.num_in_flight > 0

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; outputs of the requests that progressed or finished.
        While asleep nothing runs: queued requests wait for wake_up()."""
        with self._lock:
            if self.executor.error is not None:
                raise self.executor.error     # a worker failed: this engine is dead
            if self.sleep_level:
                time.sleep(0.01)              # callers that loop on step() do not spin
                return []
            return self._step()

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        result = self.core.step()
        t1 = time.perf_counter()
        outputs = []
        seen = set()
        for request in itertools.chain(result.updated, result.finished):
            state = self._states.get(request.request_id)
            if state is None or request.request_id in seen:
                continue
            seen.add(request.request_id)
            if request.params.beam_width and not request.is_finished:
                continue                      # beams are reshuffled every step: report at the end
            outputs.append(self._make_output(state))
            if request.is_finished:
                del self._states[request.request_id]
        t2 = time.perf_counter()
        self.num_steps += 1
        self.step_time += t2 - t0
        self.detokenize_time += t2 - t1
        return outputs

    def _seq_state(self, state: _RequestState, seq: Sequence, index: int | None = None) -> _SeqText:
        st = state.seqs.get(seq.seq_id)
        if st is None:
            st = state.seqs[seq.seq_id] = _SeqText(len(state.seqs) if index is None else index,
                                                   seq.num_prompt_tokens)
        return st

    def _make_output(self, state: _RequestState) -> RequestOutput:
        request = state.request
        beams = bool(request.params.beam_width)
        if beams:       # final: the ranked hypotheses (finalize_beams sorted them best first)
            seqs = [(seq, self._seq_state(state, seq, rank)) for rank, seq in enumerate(request.finished_seqs)]
        else:
            seqs = [(seq, self._seq_state(state, seq)) for seq in request.all_seqs()]
            seqs.sort(key=lambda p: p[1].index)
        completions = []
        for seq, st in seqs:
            if not st.stopped_here:
                self._detokenize(seq, st)
                if not beams:
                    self._check_stop(seq, st, state)
            completions.append(self._completion(seq, st, state))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.is_finished, request.metrics)

    def _detokenize(self, seq: Sequence, st: _SeqText) -> None:
        decode, ids = self._decode, seq.token_ids
        if decode is None or st.read_offset >= len(ids):
            return
        prefix = decode(ids[st.prefix_offset:st.read_offset], skip_special_tokens=True)
        full = decode(ids[st.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            st.text += full[len(prefix):]
            st.prefix_offset, st.read_offset = st.read_offset, len(ids)

    def _check_stop(self, seq: Sequence, st: _SeqText, state: _RequestState) -> None:
        params = state.request.params
        if not params.stop or seq.num_output_tokens < params.min_tokens:
            return
        # Only a match that ends in the new text can be new.
        search_from = max(0, st.sent_chars - state.max_stop_len)
        text = st.text
        hits = [(i, s) for s in params.stop if (i := text.find(s, search_from)) >= 0]
        if not hits:
            return
        idx, stop = min(hits)
        st.text = text[:idx + len(stop)] if params.include_stop_str_in_output else text[:idx]
        st.stop_reason = stop
        st.stopped_here = True
        if not seq.is_finished:
            self.scheduler.finish_sequence(seq, RequestStatus.FINISHED_STOPPED, detail=stop)

    def _completion(self, seq: Sequence, st: _SeqText, state: _RequestState) -> CompletionOutput:
        params = state.request.params
        finished = seq.is_finished or st.stopped_here
        if st.stopped_here:
            reason = "stop"
        elif finished:
            reason = seq.status.value
            if seq.status is RequestStatus.FINISHED_STOPPED and seq.token_ids:
                last = seq.token_ids[-1]
                st.stop_reason = seq.finish_reason_detail or (last if last != state.request.eos_token_id else None)
        else:
            reason = None
        # While running, hold back a tail that could still become a stop string.
        visible = st.text
        if not finished and state.max_stop_len > 1:
            visible = visible[:max(st.sent_chars, len(visible) - state.max_stop_len + 1)]
        out_ids = seq.output_token_ids
        delta_text, delta_ids = visible[st.sent_chars:], out_ids[st.sent_tokens:]
        st.sent_chars, st.sent_tokens = len(visible), len(out_ids)
        with_logprobs = params.logprobs is not None or params.beam_width
        return CompletionOutput(
            index=st.index, text=visible, token_ids=out_ids,
            cumulative_logprob=seq.cum_logprob if with_logprobs else None,
            logprobs=list(seq.output_logprobs) if seq.output_logprobs is not None else None,
            finish_reason=reason, stop_reason=st.stop_reason,
            text_delta=delta_text, token_ids_delta=delta_ids)

    # -- sleep / wake up, shutdown ------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    def sleep(self, level: int = 1) -> int:
        """Release the workers' device memory (level 1: weights to CPU memory, KV cache
        dropped; level 2: both dropped) -> bytes released over all ranks. Only with no
        request running or swapped (their KV would be lost); waiting requests stay queued
        and run after wake_up(). The prefix cache is reset (its blocks' contents are gone)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._lock:
            if self.sleep_level:
                return 0
            sched = self.scheduler
            if sched.num_running or sched.num_swapped:
                raise RuntimeError(f"cannot sleep with {sched.num_running} running and {sched.num_swapped} "
                                   f"swapped requests: let them finish or abort them first")
            released = self.executor.sleep(level)
            reset = getattr(self.scheduler.kv.gpu, "reset_cache", None)   # contiguous pools cache nothing
            if reset is not None:
                reset()
            self.sleep_level = level
            return released

    def wake_up(self) -> None:
        with self._lock:
            if self.sleep_level:
                self.executor.wake_up()
                self.sleep_level = 0

    def shutdown(self) -> None:
        """Stop the executor's workers (processes, Ray actors); idempotent."""
        if self.step_recorder is not None:
            self.step_recorder.close()
        self.executor.shutdown()

    # -- introspection ------------------------------------------------------------------------
    def timing_stats(self) -> dict[str, float]:
        """Where step time went: the core (schedule + update) is step minus execute minus
        detokenize; input preparation is measured inside the model runner."""
        worker = self.executor.collective_rpc("get_timings")[0]
        execute = self.executor.execute_time
        step = self.step_time
        core = step - execute - self.detokenize_time
        return {"steps": self.num_steps, "step_s": step, "execute_s": execute,
                "prepare_s": worker["prepare_s"], "scheduler_s": core, "detokenize_s": self.detokenize_time,
                "scheduler_share": core / step if step else 0.0,
                "prepare_share": worker["prepare_s"] / step if step else 0.0}
