"""ModelRunner: one StepMessage -> one flat forward pass -> sampled tokens.

The runner keeps its own state of every sequence the engine placed on the workers
(`SeqState`: token ids, block table, its request's sampling params), built and updated
from the step messages only (see core/step_message.py); it never sees a scheduler object.

Every scheduled sequence contributes its slice of new tokens [start, start + num_tokens)
(a whole prompt, a prefill chunk after a cached prefix, or one decode token) to a single
flat batch. Inputs are built as plain Python lists and turned into tensors once each:
  input_ids, positions       [T]      the new tokens and their positions
  slot_mapping               [T]      block_table[pos // block_size] * block_size + pos % block_size
  block_tables               [S, W]   int32, padded with 0 to the longest table
  seq_lens                   [S]      start + num_tokens (context after the step)
  query_start_loc            [S + 1]  row offsets of each sequence's new tokens
Logits are computed only for the last new row of each sequence that samples
(num_samples > 0); mid-prefill chunks sample nothing. Under tensor parallelism every
rank runs the forward and its share of the logits; only the driver (rank 0) samples.
Under pipeline parallelism every stage builds the same inputs from the same message; a
stage after the first takes the previous stage's hidden state instead of the embedding,
a stage before the last hands its hidden state on and returns None: only the last
stage's TP driver samples.

Token ids are addressed by position. Under async scheduling (`provisional_tokens`) a step
may decode the token the step before it sampled, which the engine has not confirmed yet:
the driver writes each token it samples at its position right away (provisional; under
tensor parallelism it broadcasts them and every rank does), and a message's new token ids
confirm positions from the sequence's confirmed count on. A provisional token the engine
drops (the samples of an n > 1 request preempted before it forked) is cut before that
position is sampled again.
"""
from __future__ import annotations

import time

import torch

from core.sampling_params import SamplingParams

from core.step_message import ModelRunnerOutput, StepMessage
from realexec.attention import AttentionMetadata
from realexec.models.linear import compute_dtype
from realexec.worker.sampler import Sampler


class RequestState:
    """What the sampler reads of a request (duck-compatible with core.Request)."""
    __slots__ = ("request_id", "params", "eos_token_id", "num_seqs")

    def __init__(self, request_id: str, params: SamplingParams, eos_token_id: int | None):
        self.request_id = request_id
        self.params = params
        self.eos_token_id = eos_token_id
        self.num_seqs = 0


class SeqState:
    """One sequence as the workers know it (duck-compatible with core.Sequence for the sampler)."""
    __slots__ = ("seq_id", "request", "token_ids", "num_prompt_tokens", "block_ids", "num_confirmed")

    def __init__(self, seq_id: int, request: RequestState, token_ids: list[int], num_prompt_tokens: int,
                 block_ids: list[int]):
        self.seq_id = seq_id
        self.request = request
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.block_ids = block_ids
        self.num_confirmed = len(token_ids)     # tokens the engine sent; any beyond are provisional

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class SampleRow:
    """One sequence that samples this step (what the sampler reads: .seq, .num_samples);
    `end`: the position its sampled token takes."""
    __slots__ = ("seq", "num_samples", "end")

    def __init__(self, seq: SeqState, num_samples: int, end: int = 0):
        self.seq = seq
        self.num_samples = num_samples
        self.end = end

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


class ModelRunner:
    def __init__(self, model, device: torch.device, block_size: int, sampler: Sampler | None,
                 tp_group=None, pp_group=None, provisional_tokens: bool = False):
        self.model = model
        # Async scheduling: keep each sampled token (see the module docstring).
        self.provisional_tokens = provisional_tokens
        self.device = device
        self.block_size = block_size
        self.sampler = sampler            # None except on the last stage's TP driver
        self.tp_group = tp_group
        self.pp_group = pp_group          # None: one stage
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.graph_runner = None       # a DecodeGraphRunner on CUDA (see worker), else None
        self.mixed_graph_runner = None  # a PiecewiseGraphRunner on CUDA for other steps (see worker), else None
        self.prepare_time = 0.0        # seconds spent building inputs (host side)
        self.forward_time = 0.0        # seconds in forward + logits + sampling
        self.num_steps = 0
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[int, SeqState] = {}

    # -- persistent state ---------------------------------------------------------------
    def update_states(self, msg: StepMessage) -> None:
        """Apply a message's state changes: departures first, then arrivals and deltas."""
        seqs, requests = self.seqs, self.requests
        for sid in msg.finished_seq_ids:
            seq = seqs.pop(sid, None)
            if seq is not None:
                seq.request.num_seqs -= 1
        if msg.finished_req_ids:
            for rid in msg.finished_req_ids:
                requests.pop(rid, None)
            if self.sampler is not None:
                self.sampler.forget(msg.finished_req_ids)
        for r in msg.new_requests:
            requests[r.req_id] = RequestState(r.req_id, SamplingParams(**r.params), r.eos_token_id)
        for s in msg.new_seqs:
            request = requests[s.req_id]
            request.num_seqs += 1
            seqs[s.seq_id] = SeqState(s.seq_id, request, list(s.token_ids), s.num_prompt_tokens,
                                      list(s.block_ids))
        for d in msg.cached_seqs:
            seq = seqs[d.seq_id]
            if d.new_token_ids:
                n0, k = seq.num_confirmed, len(d.new_token_ids)
                seq.token_ids[n0:n0 + k] = d.new_token_ids      # (over provisional tokens, if any)
                seq.num_confirmed = n0 + k
            if d.resumed:
                seq.block_ids = list(d.new_block_ids)
            elif d.new_block_ids:
                seq.block_ids.extend(d.new_block_ids)

    def reset_states(self) -> None:
        self.requests.clear()
        self.seqs.clear()

    def _keep_provisional(self, rows: list[SampleRow], result: ModelRunnerOutput | None) -> None:
        """Every rank keeps the driver's tokens: under tensor parallelism the other ranks embed
        them next step too, so the driver broadcasts them (one small collective per step)."""
        firsts = [result.token_ids[row.seq_id][0] for row in rows] if result is not None else None
        tp = self.tp_group
        if tp is not None and tp.size > 1:
            tokens = (torch.tensor(firsts, dtype=torch.int64, device=self.device) if tp.is_driver
                      else torch.empty(len(rows), dtype=torch.int64, device=self.device))
            firsts = tp.broadcast_from_driver(tokens).tolist()
        self.keep_sampled(rows, firsts)

    @staticmethod
    def keep_sampled(rows: list[SampleRow], tokens: list[int]) -> None:
        """Write each row's sampled token at its position (provisional until a message
        confirms it; for n > 1 and beams the first sample, which the engine's update keeps
        for that sequence or overwrites by the next message)."""
        for row, token in zip(rows, tokens):
            row.seq.token_ids[row.end:] = [token]

    # -- one step ------------------------------------------------------------------------
    def prepare_inputs(self, msg: StepMessage):
        """-> (input_ids, positions, AttentionMetadata, rows to sample, their logits row indices)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers: list[SampleRow] = []
        width = 1
        seqs = self.seqs
        for sid, start, n, k in zip(msg.seq_ids, msg.starts, msg.num_tokens, msg.num_samples):
            seq = seqs[sid]
            table = seq.block_ids
            end = start + n
            if n == 1:                                     # decode: no ranges needed
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            tables.append(table)
            if len(table) > width:
                width = len(table)
            if k:
                sample_rows.append(starts[-1] - 1)
                samplers.append(SampleRow(seq, k, end))
                if len(seq.token_ids) > end:
                    del seq.token_ids[end:]       # a provisional token the engine dropped: not history
        flat_tables = []
        for t in tables:
            flat_tables.extend(t)
            if len(t) < width:
                flat_tables.extend([0] * (width - len(t)))

        dev = self.device
        query_lens = msg.num_tokens
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(flat_tables, dtype=torch.int32, device=dev).view(len(tables), width),
            block_size=bs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return input_ids, pos, md, samplers, sample_rows

    @torch.inference_mode()
    def execute_model(self, msg: StepMessage) -> ModelRunnerOutput | None:
        """Sampled tokens on the driver; None on other ranks (they only join the collectives)."""
        self.update_states(msg)
        if not msg.seq_ids:
            return ModelRunnerOutput(token_ids={}) if self.sampler is not None else None
        t0 = time.perf_counter()
        input_ids, positions, md, rows, row_index = self.prepare_inputs(msg)
        t1 = time.perf_counter()
        self.prepare_time += t1 - t0
        self.num_steps += 1
        graphs = self.graph_runner
        pp = self.pp_group
        if graphs is not None and md.is_decode_only and md.num_seqs <= graphs.max_batch:
            hidden = graphs.run(input_ids, positions, md.slot_mapping, md.seq_lens, md.block_tables,
                                md.seq_lens_cpu)
        elif self.mixed_graph_runner is not None and input_ids.shape[0] <= self.mixed_graph_runner.max_tokens:
            # mixed prefill + decode (or prefill, or a decode batch above the decode graphs'):
            # piecewise graphs around eager attention (one stage only, see worker)
            hidden = self.mixed_graph_runner.run(input_ids, positions, self.kv_caches, md)
        elif pp is None or pp.size == 1:
            hidden = self.model(input_ids, positions, self.kv_caches, md)
        else:
            received = None
            if not pp.is_first:
                received = pp.recv(input_ids.shape[0], self.model.config.hidden_size,
                                   compute_dtype(self.model), self.device)
            hidden = self.model(input_ids, positions, self.kv_caches, md, received)
            if not pp.is_last:
                pp.send(hidden)
                self.forward_time += time.perf_counter() - t1
                return None
        result = ModelRunnerOutput(token_ids={}) if self.sampler is not None else None
        if rows:
            if len(row_index) < hidden.shape[0]:
                hidden = hidden[torch.tensor(row_index, device=self.device)]
            logits = self.model.compute_logits(hidden)       # full vocab on the driver, None elsewhere
            if self.sampler is not None:
                result = self.sampler(logits, rows)
            if self.provisional_tokens:
                self._keep_provisional(rows, result)
        self.forward_time += time.perf_counter() - t1
        return result
