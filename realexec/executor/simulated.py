"""The simulated executor (`serve --simulate COST_MODEL`): the twin behind the real engine.

`SimulatedExecutor` implements the same executor interface as `UniprocExecutor`
(realexec/executor/base.py), so LLMEngine, the core's scheduler and KV accounting, the
AsyncEngine and the HTTP server run unchanged on top of it. Per step it
  * builds the same StepMessage the real workers get and keeps the same per-sequence
    state a worker keeps (core/step_message.py: deltas only), without a model;
  * prices the step with a core CostModel: one BatchShape from the scheduled slices (new
    tokens = slice length, context = slice start), built the way `sim/executor.py` does,
    plus the cost model's swap time for blocks swapped out and in;
  * waits until `step start + price` on its clock (real time when serving; tests swap in
    a FakeClock, which the wait advances by exactly the price). The price is the whole
    engine step, overhead included (a fitted profile's overhead part, the roofline's
    per-step term): the engine's own work since the previous step returned (the real code
    runs here too) is charged inside it, up to the overhead the model prices;
  * returns sampled tokens: a pure function of (the request's seed, every token of the
    sequence so far, the sample index), drawn from the tokenizer's vocabulary minus its
    special tokens (so EOS never ends a simulated request: it runs to max_tokens, a stop
    string or a stop token id), or with `--simulate-output echo` the prompt's tokens
    repeated. Greedy requests ignore the seed, seeded requests depend only on their seed,
    unseeded random ones also on the server's --seed and their arrival order. With
    `--sim-first-token-no-text SHARE` that share of requests (a seeded draw per sequence)
    starts with a special token that has no text (not EOS), as a real chat model often
    starts a raw completion with its end-of-turn token: their first streamed chunk comes a
    step later, as from the real server (a systematic part of the TTFT gap without it);
    `--sim-first-token-no-text-prompts FILE` names those requests instead (a recorded run's
    silent starts: which requests they are moves a small slice's TTFT percentiles).
Logprobs, n > 1 and beam search get well-formed answers from a seeded random model
(candidates best first with strictly descending log-probabilities; greedy picks the best).

Cost models (`--simulate`):
  * `roofline` with `--sim-model` and `--sim-hardware` (any core.cost.specs model and
    hardware; --tensor-parallel-size is the roofline's tp): KV blocks from the hardware
    budget as vLLM sizes them (`kv_cache_capacity_blocks`, --gpu-memory-utilization);
  * a cost-model JSON file (`python -m realexec profile`, `python -m sim calibrate`):
    a FittedCostModel of the engine that was profiled; KV blocks from the file's engine
    section (the profiled engine's), else --kv-cache-memory over the tokenizer model's KV
    geometry, as the real CPU worker sizes its cache.
--num-gpu-blocks overrides either. The tokenizer (and, for a fitted model, the vocabulary
and context length) comes from --model: the embedded SmolLM2 by default, which is fine
for any spec'd model (only text and token counts depend on it).
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from math import gcd, log1p
from pathlib import Path

from core.cost.fitted import FittedCostModel, load_cost_model_file
from core.cost.model import (BatchShape, CostModel, RooflineCostModel, kv_block_bytes, kv_cache_capacity_blocks)
from core.cost.specs import ModelSpec, get_hardware, get_model
from core.kv.kv_capacity import kv_block_bytes_per_rank, kv_blocks_per_rank
from core.sampling_params import SAMPLING_EPS
from core.step_message import ModelRunnerOutput, StepMessage
from realexec.config import (DEFAULT_SIM_HARDWARE, DEFAULT_SIM_MODEL, ROOFLINE, EngineArgs,
                             check_simulate_args)
from realexec.executor.base import UniprocExecutor

GiB = 1 << 30
# A fitted model's swaps fall back to the roofline's PCIe term on this hardware (as `sim run`).
FITTED_SWAP_HARDWARE = "cpu-2core"
DEFAULT_CPU_KV_CACHE_GIB = 1.0         # the real CPU worker's default KV budget
_FP32_NAMES = ("auto", "float32", "fp32")   # --dtype values the real CPU engine runs in fp32

_MASK64 = (1 << 64) - 1
_GREEDY_KEY = 0x67726565647921        # greedy rows ignore seeds: one fixed stream
_SEEDED_SALT = 0x5EEDED
_UNSEEDED_SALT = 0xF00D
_NO_TEXT_SALT = 0x7E87


def _mix(x: int) -> int:
    """SplitMix64's finalizer: a well-mixed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _fold(h: int, tokens) -> int:
    """The running hash of a sequence's tokens, one token at a time (so it does not depend
    on how the tokens were split over messages)."""
    for t in tokens:
        h = hash((h, t))
    return h


class RealClock:
    """Wall time: a step's wait is a real sleep."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def wait(start: float, seconds: float) -> float:
        """Return at `start + seconds` (at once if that has passed); -> the time it returned."""
        delay = start + seconds - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return time.monotonic()


class DeferredClock:
    """Wall time without blocking: a step's wait only records when the step ends (`due`)
    and returns it, and the caller hands the step's outputs over at that time (the
    server's LoopEngine, on a loop timer). Until then `now()` reads `due`, so what the
    engine stamps after a wait (token and finish times) is the step's end, as with a
    RealClock, and the next step's start is anchored to it."""

    def __init__(self):
        self.due = float("-inf")
        self._resume: float | None = None

    def now(self) -> float:
        if self._resume is not None:
            return self._resume
        return max(time.monotonic(), self.due)

    def resume_at(self, t: float | None) -> None:
        """Until the next wait, `now()` reads t: the step that follows a step at once
        starts at that step's end (`due`), not at the moment the caller got to it.
        None: wall time again."""
        self._resume = t

    def wait(self, start: float, seconds: float) -> float:
        self._resume = None
        self.due = max(start + seconds, self.now())
        return self.due


class FakeClock:
    """A clock that only moves when a step waits on it (tests: exact step durations)."""

    def __init__(self, start: float = 0.0):
        self.t = start
        self.waits: list[float] = []          # each wait's length, in step order

    def now(self) -> float:
        return self.t

    def wait(self, start: float, seconds: float) -> float:
        self.waits.append(seconds)
        self.t = max(self.t, start + seconds)
        return self.t


# ------------------------------------------------------------------------------ the deployment

@dataclasses.dataclass
class SimulatedDeployment:
    """What `--simulate` prices: the cost model, a KV block's bytes (swap pricing), the KV
    pool sizes, and the name the server reports by default."""
    cost_model: CostModel
    block_bytes: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    name: str
    description: str                    # for the server's start-up line
    spec: ModelSpec | None = None       # roofline: the model spec priced


def build_deployment(args: EngineArgs, model_config) -> SimulatedDeployment:
    """The cost model and KV pool of `args` (checked by check_simulate_args). `model_config`
    is the tokenizer model's ModelConfig (a fitted model's KV geometry)."""
    check_simulate_args(args)
    if args.simulate == ROOFLINE:
        spec = get_model(args.sim_model or DEFAULT_SIM_MODEL)
        hw = get_hardware(args.sim_hardware or DEFAULT_SIM_HARDWARE)
        tp = args.tensor_parallel_size
        block_bytes = kv_block_bytes(spec, args.block_size, tp)
        gpu = kv_cache_capacity_blocks(spec, hw, args.block_size, args.gpu_memory_utilization, tp,
                                       args.max_num_batched_tokens)
        cpu = int(args.swap_space * GiB // block_bytes)
        what = f"roofline: {spec.name} on {hw.name}" + (f", tp {tp}" if tp > 1 else "")
        return SimulatedDeployment(RooflineCostModel(spec, hw, tp), block_bytes, gpu, cpu, spec.name, what, spec)
    cfg = model_config
    dtype_bytes = 4 if args.dtype in _FP32_NAMES else 2
    geometry = dict(block_size=args.block_size, num_layers=cfg.num_hidden_layers,
                    num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype_bytes=dtype_bytes, tp=1)
    block_bytes = kv_block_bytes_per_rank(**geometry)
    data = load_cost_model_file(args.simulate)
    fallback = RooflineCostModel(get_model(DEFAULT_SIM_MODEL), get_hardware(FITTED_SWAP_HARDWARE))
    cost_model = FittedCostModel(data, fallback, where=args.simulate)
    engine = data.get("engine") if isinstance(data.get("engine"), dict) else {}
    measured_block = engine.get("block_size")
    if isinstance(measured_block, int) and measured_block != args.block_size:
        raise ValueError(f"--simulate {args.simulate}: it was profiled with --block-size {measured_block}, "
                         f"not {args.block_size}")
    gpu = engine.get("num_gpu_blocks")
    if not isinstance(gpu, int) or gpu < 1:
        gpu = kv_blocks_per_rank((args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_GIB) * GiB, **geometry)
    cpu = kv_blocks_per_rank(args.swap_space * GiB, **geometry)
    name = data.get("profile", {}).get("model") or "simulated"
    return SimulatedDeployment(cost_model, block_bytes, gpu, cpu, str(name), f"fitted: {args.simulate}")


# ------------------------------------------------------------------------------ the worker

class _Req:
    __slots__ = ("key", "greedy", "logprobs", "beam", "min_tokens", "stop_ids")

    def __init__(self, key: int, params: dict):
        self.key = key
        self.greedy = params["temperature"] < SAMPLING_EPS or params["top_k"] == 1
        self.logprobs = params["logprobs"]
        self.beam = bool(params["beam_width"])
        self.min_tokens = params["min_tokens"]
        self.stop_ids = frozenset(params["stop_token_ids"])


class _Seq:
    __slots__ = ("req", "h", "num_prompt", "echo", "prompt_key")

    def __init__(self, req: _Req, token_ids: list[int], num_prompt: int, echo: list[int] | None):
        self.req = req
        self.num_prompt = num_prompt
        # the prompt hashed whole (always sent whole), outputs one by one
        self.prompt_key = hash(tuple(token_ids[:num_prompt]))
        self.h = _fold(self.prompt_key, token_ids[num_prompt:])
        self.echo = echo


class SimulatedWorker:
    """A worker without a model: the worker RPCs the engine and server call, sequence
    state from step messages, a priced wait per step, and seeded tokens."""

    def __init__(self, args: EngineArgs, clock=None):
        self.args = args
        self.clock = clock if clock is not None else RealClock()
        self.tokenizer = None
        self.model_config = None
        self.deployment: SimulatedDeployment | None = None
        self.requests: dict[str, _Req] = {}
        self.seqs: dict[int, _Seq] = {}
        self._num_requests = 0
        self.num_steps = 0
        self.priced_s = 0.0              # sum of every step's price
        self.prepare_time = 0.0          # our own bookkeeping per step (state, pricing, tokens)
        self.last_shape: BatchShape | None = None
        self.last_price = 0.0
        self._last_end: float | None = None     # clock time the previous step returned
        self.sleep_level = 0
        self.no_text_token: int | None = None
        self.no_text_share = 0.0
        self.no_text_prompts: frozenset[int] | None = None      # prompt keys that start silent

    # -- setup (the Worker lifecycle) ---------------------------------------------------------
    def init_device(self) -> None:
        pass

    def load_model(self):
        from realexec.models.loader import load_tokenizer, read_model_config, resolve_model_dir

        args = self.args
        path = resolve_model_dir(args.model)
        self.tokenizer = load_tokenizer(path)
        if self.tokenizer is None:
            raise ValueError(f"--simulate needs a tokenizer: {path} has no tokenizer files (pass --model "
                             f"a directory or .gguf with one, e.g. the default embedded SmolLM2)")
        cfg = read_model_config(args.model)
        vocab = max(len(self.tokenizer), 1)
        cfg = dataclasses.replace(cfg, vocab_size=vocab)       # ids must decode with this tokenizer
        self.deployment = build_deployment(args, cfg)
        spec = self.deployment.spec
        if spec is not None:      # the spec'd model's shape and context; the tokenizer's vocabulary
            cfg = dataclasses.replace(cfg, num_hidden_layers=spec.num_layers, hidden_size=spec.hidden_size,
                                      intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
                                      num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                      max_position_embeddings=spec.max_model_len,
                                      tie_word_embeddings=spec.tie_embeddings)
        self.model_config = cfg
        special = set(getattr(self.tokenizer, "all_special_ids", ())) | set(cfg.eos_token_ids)
        if cfg.eos_token_id is not None:
            special.add(cfg.eos_token_id)
        self.special = frozenset(special)
        # --sim-first-token-no-text: a special token that is not an end of sequence (EOS would
        # end a request that does not ignore it) and detokenizes to no text
        eos = set(cfg.eos_token_ids) | ({cfg.eos_token_id} if cfg.eos_token_id is not None else set())
        silent = sorted(t for t in special - eos
                        if 0 <= t < vocab and not self.tokenizer.decode([t], skip_special_tokens=True))
        self.no_text_token = silent[0] if silent else None
        self.no_text_share = args.sim_first_token_no_text
        self.no_text_prompts = (None if args.sim_first_token_no_text_prompts is None
                                else self._read_no_text_prompts(args.sim_first_token_no_text_prompts))
        if (self.no_text_share or self.no_text_prompts) and self.no_text_token is None:
            raise ValueError("--sim-first-token-no-text: the tokenizer has no special token besides its "
                             "end-of-sequence token(s) to answer without text")
        self.vocab = [t for t in range(vocab) if t not in special]
        n = len(self.vocab)
        stride = max(1, n // 3)
        while gcd(stride, n) != 1:       # candidates (x + j * stride) % n are distinct for j < n
            stride += 1
        self._stride = stride
        return cfg

    def _read_no_text_prompts(self, path: str) -> frozenset[int]:
        """The prompt keys (hash of the token ids, as _Seq.prompt_key) of the JSON list of
        prompts in `path`: texts tokenized as the server tokenizes a completion prompt, or
        token-id lists."""
        import json

        from realexec.models.loader import prompt_token_ids

        flag = "--sim-first-token-no-text-prompts"
        try:
            prompts = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
        except ValueError as e:
            raise ValueError(f"{flag} {path}: not JSON ({e})") from None
        if not isinstance(prompts, list):
            raise ValueError(f"{flag} {path}: expected a JSON list of prompts, got {type(prompts).__name__}")
        keys = set()
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids = prompt_token_ids(self.tokenizer, p)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids = p
            else:
                raise ValueError(f"{flag} {path}: item {i} is neither a prompt text nor a non-empty list of "
                                 f"token ids: {str(p)[:80]}")
            keys.add(hash(tuple(ids)))
        return frozenset(keys)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.deployment.num_gpu_blocks, self.deployment.num_cpu_blocks

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    # -- per step -----------------------------------------------------------------------------
    def update_states(self, msg: StepMessage) -> None:
        """Departures first, then arrivals and deltas (as the real model runner)."""
        seqs, requests = self.seqs, self.requests
        for sid in msg.finished_seq_ids:
            seqs.pop(sid, None)
        for rid in msg.finished_req_ids:
            requests.pop(rid, None)
        for r in msg.new_requests:
            p = r.params
            self._num_requests += 1
            if p["temperature"] < SAMPLING_EPS or p["top_k"] == 1:
                key = _GREEDY_KEY
            elif p["seed"] is not None:
                key = _mix(p["seed"] ^ _SEEDED_SALT)
            else:
                key = _mix(_mix(self.args.seed ^ _UNSEEDED_SALT) ^ self._num_requests)
            requests[r.req_id] = _Req(key, p)
        echo = self.args.simulate_output == "echo"
        for s in msg.new_seqs:
            prompt = [t for t in s.token_ids[:s.num_prompt_tokens] if t not in self.special] if echo else None
            seqs[s.seq_id] = _Seq(requests[s.req_id], s.token_ids, s.num_prompt_tokens, prompt or None)
        for d in msg.cached_seqs:
            if d.new_token_ids:
                seq = seqs[d.seq_id]
                seq.h = _fold(seq.h, d.new_token_ids)

    def price(self, msg: StepMessage) -> float:
        """Seconds the step takes: the cost model's time of its batch, plus its swaps."""
        starts, num_tokens = msg.starts, msg.num_tokens
        if num_tokens:
            new = sum(num_tokens)
            ctx = sum(starts)
            pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(num_tokens, starts))
            shape = BatchShape(len(num_tokens), new, ctx, pairs)
            dt = self.deployment.cost_model.step_time(shape)
        else:
            shape, dt = BatchShape(), 0.0
        swap_time = self.deployment.cost_model.swap_time
        for blocks in (msg.blocks_to_swap_out, msg.blocks_to_swap_in):
            if blocks:
                dt += swap_time(len(blocks), self.deployment.block_bytes)
        self.last_shape, self.last_price = shape, dt
        return dt

    def overhead(self, shape: BatchShape) -> float:
        """The engine's own per-step time inside a step's price: a fitted model's overhead
        part, the roofline's per-step overhead."""
        cm = self.deployment.cost_model
        if isinstance(cm, FittedCostModel):
            if not shape.num_seqs:
                return 0.0
            return cm.evaluator.part_time("overhead", shape.num_seqs, shape.num_new_tokens, shape.context_sum,
                                          shape.attn_pairs)
        return getattr(cm, "step_overhead_s", 0.0)

    def execute_model(self, msg: StepMessage) -> ModelRunnerOutput:
        if self.sleep_level:
            raise RuntimeError(f"the simulated worker is asleep (level {self.sleep_level}): wake_up first")
        clock = self.clock
        start = clock.now()
        t0 = time.perf_counter()
        self.update_states(msg)
        price = self.price(msg)
        out = self.sample(msg)
        self.prepare_time += time.perf_counter() - t0
        self.num_steps += 1
        self.priced_s += price
        # The price is the whole engine step, the engine's own overhead included (a fitted
        # profile's overhead part, the roofline's per-step term): the real engine code runs
        # here too, so its time since the previous step returned (update, detokenization,
        # scheduling) is charged inside the price, up to the overhead the model prices. More
        # than that was idle time (no request), which a step does not absorb.
        last = self._last_end
        if last is not None:
            start = max(last, start - min(price, self.overhead(self.last_shape)))
        self._last_end = clock.wait(start, price)
        return out

    # -- tokens ---------------------------------------------------------------------------------
    def _candidates(self, x: int, count: int, req: _Req, num_outputs: int) -> list[int]:
        """`count` distinct vocabulary tokens for key x, best first; below min_tokens none is a
        stop token id."""
        vocab, n, stride = self.vocab, len(self.vocab), self._stride
        blocked = req.stop_ids if num_outputs < req.min_tokens else ()
        out, j = [], 0
        while len(out) < count and j < n:
            t = vocab[(x + j * stride) % n]
            if t not in blocked:
                out.append(t)
            j += 1
        return out

    def _no_text_first(self, x: int, seq: _Seq) -> bool:
        """Whether a sequence whose first output has key x starts with the silent special
        token: its prompt is listed (--sim-first-token-no-text-prompts), or a seeded draw
        like its tokens (--sim-first-token-no-text)."""
        if self.no_text_token in seq.req.stop_ids:
            return False
        if self.no_text_prompts is not None:
            return seq.prompt_key in self.no_text_prompts
        share = self.no_text_share
        return bool(share) and (_mix(x ^ _NO_TEXT_SALT) >> 11) * (1.0 / (1 << 53)) < share

    @staticmethod
    def _logprobs(x: int, count: int) -> list[float]:
        """Strictly descending log-probabilities: -(E_0 + ... + E_j) / 2, E_i ~ Exp(1) from x."""
        acc, out = 0.0, []
        for j in range(count):
            u = (_mix(x ^ ((j + 1) * 0x9E3779B97F4A7C15 & _MASK64)) >> 11) * (1.0 / (1 << 53))
            acc += -log1p(-u) * 0.5 + 1e-6
            out.append(-acc)
        return out

    def sample(self, msg: StepMessage) -> ModelRunnerOutput:
        token_ids: dict[int, list[int]] = {}
        logprobs: dict[int, list[float]] = {}
        top: dict[int, list[dict[int, float]]] = {}
        seqs = self.seqs
        for sid, start, n, k in zip(msg.seq_ids, msg.starts, msg.num_tokens, msg.num_samples):
            if not k:
                continue
            seq = seqs[sid]
            req = seq.req
            num_outputs = start + n - seq.num_prompt          # outputs before the one sampled now
            x = _mix((seq.h ^ req.key) & _MASK64)
            want = req.logprobs
            if req.beam:                      # k candidates, best first, with their logprobs
                toks = self._candidates(x, k, req, num_outputs)
                logprobs[sid] = self._logprobs(x, len(toks))
                token_ids[sid] = toks
                continue
            width = k if want is None else max(k, want)
            cands = self._candidates(x, 1 if req.greedy and want is None else width, req, num_outputs)
            if seq.echo is not None:
                t = seq.echo[num_outputs % len(seq.echo)]
                if not (num_outputs < req.min_tokens and t in req.stop_ids):
                    cands = [t] + [c for c in cands if c != t]
            elif num_outputs == 0 and self._no_text_first(x, seq):
                cands = [self.no_text_token] + cands[:-1]
            toks = [cands[0]] * k if req.greedy or seq.echo is not None else cands[:k]
            token_ids[sid] = toks
            if want is not None:
                lps = self._logprobs(x, len(cands))
                by_token = dict(zip(cands, lps))
                base = dict(zip(cands[:want], lps[:want]))
                logprobs[sid] = [by_token[t] for t in toks]
                top[sid] = [{**base, t: by_token[t]} for t in toks]
        return ModelRunnerOutput(token_ids=token_ids, logprobs=logprobs or None, top_logprobs=top or None)

    # -- sleep / introspection --------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.requests.clear()
        self.seqs.clear()
        self.sleep_level = level
        return 0                      # no device memory is held

    def wake_up(self) -> None:
        self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    def get_tokenizer(self):
        return self.tokenizer

    def get_timings(self) -> dict[str, float]:
        return {"prepare_s": self.prepare_time, "forward_s": self.priced_s, "execute_s": self.priced_s,
                "steps": self.num_steps, "recv_wait_s": 0.0, "send_wait_s": 0.0}

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": 0, "kv_cache": 0}

    def num_tracked_seqs(self) -> int:
        return len(self.seqs)

    def ping(self) -> int:
        return 0


class SimulatedExecutor(UniprocExecutor):
    """UniprocExecutor's in-process calls with a SimulatedWorker as the one worker."""
    backend = "sim"

    def __init__(self, args: EngineArgs, clock=None):
        self._clock = clock
        super().__init__(args)

    def _init_workers(self) -> None:
        self.driver = SimulatedWorker(self.args, self._clock)
        self.workers = [self.driver]

    @property
    def clock(self):
        return self.driver.clock

    @clock.setter
    def clock(self, clock) -> None:
        self.driver.clock = clock

    @property
    def deployment(self) -> SimulatedDeployment:
        return self.driver.deployment

    def can_defer_waits(self) -> bool:
        """Whether steps wait on the wall clock (serving), so a driver may defer the waits."""
        return isinstance(self.driver.clock, (RealClock, DeferredClock))

    def defer_waits(self) -> DeferredClock:
        """Steps stop blocking: each returns at once and the caller waits until the
        returned clock's `due` before it hands the step's outputs over."""
        if not self.can_defer_waits():
            raise RuntimeError(f"the simulated worker's clock is a {type(self.driver.clock).__name__}; "
                               f"only a real-time one can be deferred")
        if not isinstance(self.driver.clock, DeferredClock):
            self.driver.clock = DeferredClock()
        return self.driver.clock

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        fn = getattr(self.driver, method) if isinstance(method, str) else (
            lambda *a, **k: method(self.driver, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def execute_model_async(self, scheduler_output) -> Future:
        future: Future = Future()
        future.set_result(self.execute_model(scheduler_output))
        return future
