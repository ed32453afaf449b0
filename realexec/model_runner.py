"""ModelRunner: one SchedulerOutput -> one flat forward pass -> sampled tokens.

Every scheduled sequence contributes its slice of new tokens [start, start + num_tokens)
(a whole prompt, a prefill chunk after a cached prefix, or one decode token) to a single
flat batch. Inputs are built as plain Python lists and turned into tensors once each:
  input_ids, positions       [T]      the new tokens and their positions
  slot_mapping               [T]      block_table[pos // block_size] * block_size + pos % block_size
  block_tables               [S, W]   int32, padded with 0 to the longest table
  seq_lens                   [S]      start + num_tokens (context after the step)
  query_start_loc            [S + 1]  row offsets of each sequence's new tokens
Logits are computed only for the last new row of each sequence that samples
(num_samples > 0); mid-prefill chunks sample nothing.
"""
from __future__ import annotations

import time

import torch

from core import ModelRunnerOutput, SchedulerOutput
from realexec.attention import AttentionMetadata
from realexec.sampler import Sampler


class ModelRunner:
    def __init__(self, model, device: torch.device, block_size: int, sampler: Sampler):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.sampler = sampler
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.graph_runner = None       # a DecodeGraphRunner on CUDA (see worker), else None
        self.prepare_time = 0.0        # seconds spent building inputs (host side)
        self.num_steps = 0

    def prepare_inputs(self, out: SchedulerOutput):
        """-> (input_ids, positions, AttentionMetadata, rows to sample, their logits row indices)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        starts = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers = []
        width = 1
        for s in out.scheduled:
            start, n, table = s.start, s.num_tokens, s.block_table
            end = start + n
            if n == 1:                                     # decode: no ranges needed
                ids.append(s.seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(s.seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_lens.append(n)
            starts.append(starts[-1] + n)
            tables.append(table)
            if len(table) > width:
                width = len(table)
            if s.num_samples:
                sample_rows.append(starts[-1] - 1)
                samplers.append(s)
        flat_tables = []
        for t in tables:
            flat_tables.extend(t)
            if len(t) < width:
                flat_tables.extend([0] * (width - len(t)))

        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(flat_tables, dtype=torch.int32, device=dev).view(len(tables), width),
            block_size=bs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return input_ids, pos, md, samplers, sample_rows

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.finished_request_ids:
            self.sampler.forget(out.finished_request_ids)
        if not out.scheduled:
            return ModelRunnerOutput(token_ids={})
        t0 = time.perf_counter()
        input_ids, positions, md, rows, row_index = self.prepare_inputs(out)
        self.prepare_time += time.perf_counter() - t0
        self.num_steps += 1
        graphs = self.graph_runner
        if graphs is not None and md.is_decode_only and md.num_seqs <= graphs.max_batch:
            hidden = graphs.run(input_ids, positions, md.slot_mapping, md.seq_lens, md.block_tables,
                                md.seq_lens_cpu)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, md)
        if not rows:
            return ModelRunnerOutput(token_ids={})
        if len(row_index) < hidden.shape[0]:
            hidden = hidden[torch.tensor(row_index, device=self.device)]
        logits = self.model.compute_logits(hidden)
        return self.sampler(logits, rows)
