"""A deterministic executor for core tests: the next token is a pure function of the
sequence's tokens (and, for the n-way fork, of the sample index), so any schedule
(chunked, preempted, swapped) must produce exactly the same outputs."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from core import ModelRunnerOutput, SchedulerOutput

VOCAB = 50


def next_token(history: list[int], k: int = 0) -> int:
    h = 0
    for t in history[-6:]:
        h = (h * 31 + t + 7) % 1_000_003
    return (h + 13 * k) % VOCAB


def candidate_logprobs(history: list[int], count: int) -> tuple[list[int], list[float]]:
    """Beam candidates: distinct tokens, logprobs descending, deterministic."""
    base = next_token(history)
    toks = [(base + 3 * j) % VOCAB for j in range(count)]
    lps = [-(0.1 + ((base * 7 + j * 11) % 17) / 10.0) - j * 0.01 for j in range(count)]
    lps.sort(reverse=True)
    return toks, lps


class ToyExecutor:
    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        tokens, logprobs = {}, {}
        for s in out.scheduled:
            if not s.num_samples:
                continue
            history = s.seq.token_ids[:s.start + s.num_tokens]
            if s.seq.request.params.beam_width:
                tokens[s.seq_id], logprobs[s.seq_id] = candidate_logprobs(history, s.num_samples)
            else:
                tokens[s.seq_id] = [next_token(history, k) for k in range(s.num_samples)]
                logprobs[s.seq_id] = [-1.0] * s.num_samples
        return ModelRunnerOutput(token_ids=tokens, logprobs=logprobs)


class _RunsOnResult(Future):
    """A future whose work runs when its result is first asked for: the batch 'computes'
    while later batches are scheduled, deterministically (no thread)."""

    def __init__(self, work):
        super().__init__()
        self._work = work

    def result(self, timeout=None):
        if not self.done():
            try:
                self.set_result(self._work())
            except BaseException as e:   # noqa: BLE001  (handed to the caller through the future)
                self.set_exception(e)
        return super().result(timeout)


class AsyncToyExecutor(ToyExecutor):
    """`execute_model_async` for pipelined engines. The batch's inputs (each scheduled
    slice's token ids and block table) are copied at submission and must be unchanged
    when the batch computes: the scheduler may not touch a request that is in flight.
    `threaded=True` computes on a worker thread (submission order) instead of lazily."""

    def __init__(self, threaded: bool = False) -> None:
        super().__init__()
        self.submitted = 0
        self.max_in_flight = 0
        self._pending = 0
        self._pool = ThreadPoolExecutor(max_workers=1) if threaded else None

    def execute_model_async(self, out: SchedulerOutput) -> Future:
        inputs = [(s.seq.token_ids[:s.start + s.num_tokens], list(s.block_table)) for s in out.scheduled]
        self.submitted += 1
        self._pending += 1
        self.max_in_flight = max(self.max_in_flight, self._pending)

        def work() -> ModelRunnerOutput:
            now = [(s.seq.token_ids[:s.start + s.num_tokens], list(s.block_table)) for s in out.scheduled]
            assert now == inputs, "a batch's inputs changed while it was in flight"
            self._pending -= 1
            return self.execute_model(out)

        if self._pool is not None:
            return self._pool.submit(work)
        return _RunsOnResult(work)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def reference_outputs(prompt: list[int], max_tokens: int, n: int, eos: int | None, ignore_eos: bool,
                      max_model_len: int) -> list[list[int]]:
    """What an unpreempted run must produce for a non-beam request."""
    outs = []
    for k in range(n):
        toks = list(prompt)
        out = []
        while True:
            t = next_token(toks, k if not out else 0)
            toks.append(t)
            out.append(t)
            if (t == eos and not ignore_eos) or len(out) >= max_tokens or len(toks) >= max_model_len:
                break
        outs.append(out)
    return outs
