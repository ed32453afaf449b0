"""A worker that checks the paged KV cache as a model would use it (the state machines'
executor): every slot a step writes holds the fingerprint of the token prefix it encodes,
and every slot a step's attention reads (positions [0, end) through the sequence's block
table) must hold its own prefix's, so a block freed, reused, published, swapped or hit too
early shows up as a wrong read. It runs the real ModelRunner's state code on the step
messages (provisional tokens on: under async scheduling a step may reach past the tokens
the engine knows), computes each step the moment it is submitted, and samples tokens that
are a pure function of the history (tests/core/toy_executor.py), so every request must end
with exactly the tokens of an unpreempted one-batch-at-a-time run.
"""
from __future__ import annotations

from concurrent.futures import Future

from core import ModelRunnerOutput
from core.step_message import StepMessageBuilder
from realexec.worker.model_runner import ModelRunner
from tests.core.toy_executor import candidate_logprobs, next_token

def fingerprint(prefix: list[int]) -> int:
    return hash(tuple(prefix))


class KVCheckingExecutor:
    """Computes each step at submission on a message-fed worker state, checking the KV cache."""

    def __init__(self, kv):
        self.kv = kv                          # the scheduler's: free GPU blocks are recorded per step
        self.bs = kv.block_size
        self.builder = StepMessageBuilder()
        self.runner = ModelRunner(None, "cpu", kv.block_size, None, provisional_tokens=True)
        self.gpu: dict[int, int] = {}         # slot -> fingerprint of the prefix its KV encodes
        self.cpu: dict[int, int] = {}
        self.steps = []                       # SchedulerOutputs, in submission order
        self.free_during: list[int] = []
        self.placeholders = 0                 # slices that reached past the engine's known tokens

    def execute_model_async(self, out) -> Future:
        self.steps.append(out)
        self.free_during.append(self.kv.stats().num_free_gpu_blocks)
        self.placeholders += sum(s.start + s.num_tokens > len(s.seq.token_ids) for s in out.scheduled)
        future: Future = Future()
        future.set_result(self._run(self.builder.build(out)))
        return future

    def execute_model(self, out) -> ModelRunnerOutput:
        return self.execute_model_async(out).result()

    def _move(self, src: dict, dst: dict, pairs) -> None:
        bs = self.bs
        for a, b in pairs:
            for off in range(bs):
                value = src.get(a * bs + off)
                if value is None:
                    dst.pop(b * bs + off, None)
                else:
                    dst[b * bs + off] = value

    def _run(self, msg) -> ModelRunnerOutput:
        # The worker's order: swap out, swap in, copy, then the model.
        self._move(self.gpu, self.cpu, msg.blocks_to_swap_out)
        self._move(self.cpu, self.gpu, msg.blocks_to_swap_in)
        self._move(self.gpu, self.gpu, msg.blocks_to_copy)
        runner, bs = self.runner, self.bs
        runner.update_states(msg)
        if not msg.seq_ids:
            return ModelRunnerOutput(token_ids={})
        rows = runner.prepare_inputs(msg)[3]
        batch = [(runner.seqs[sid], start, start + n) for sid, start, n in zip(msg.seq_ids, msg.starts, msg.num_tokens)]
        for seq, start, end in batch:                       # the step writes its K/V first ...
            toks, table = seq.token_ids, seq.block_ids
            assert len(toks) >= end, (f"seq {seq.seq_id} computes [{start}, {end}) but the worker knows "
                                      f"{len(toks)} of its tokens")
            for p in range(start, end):
                self.gpu[table[p // bs] * bs + p % bs] = fingerprint(toks[:p + 1])
        for seq, _, end in batch:                           # ... then attention reads the context
            toks, table = seq.token_ids, seq.block_ids
            for p in range(end):
                slot = table[p // bs] * bs + p % bs
                assert self.gpu.get(slot) == fingerprint(toks[:p + 1]), (
                    f"seq {seq.seq_id} reads position {p} from block {table[p // bs]}, which holds other KV")
        tokens, logprobs = {}, {}
        for row in rows:
            history = row.seq.token_ids        # all of it, as a sampler's penalties read it
            assert len(history) == row.end, f"seq {row.seq_id} samples with {len(history) - row.end} stale tokens"
            k = row.num_samples
            if row.seq.request.params.beam_width:
                tokens[row.seq_id], logprobs[row.seq_id] = candidate_logprobs(history, k)
            else:
                tokens[row.seq_id] = [next_token(history, j) for j in range(k)]
                logprobs[row.seq_id] = [-1.0] * k
        result = ModelRunnerOutput(token_ids=tokens, logprobs=logprobs)
        runner.keep_sampled(rows, [tokens[row.seq_id][0] for row in rows])
        return result
