"""Turn one step's logits into tokens (and logprobs) for the core's `update()`.

Rows are the sequences that sample this step (one logits row each). Per row, by the
request's SamplingParams:
  * beam search: the top `num_samples` (= 2 * beam_width) tokens by log-softmax,
    best first, with their logprobs (core.beam_search.plan_beam_step ranks them);
  * greedy (temperature below core.sampling_params.SAMPLING_EPS, or top_k 1): argmax,
    repeated `num_samples` times;
  * random: logits / temperature, top-k and top-p masks, then `num_samples`
    independent draws by the exponential-race trick (argmax of probs / Exp(1) noise).
    A request with a seed draws its noise from its own torch.Generator, created on its
    first sample and advanced by exactly num_samples * vocab values per sampling step,
    so its tokens do not depend on what else is in the batch. Unseeded rows share the
    sampler's generator (seeded by EngineArgs.seed).
Before any of that, a row whose sequence has fewer than `min_tokens` outputs gets its
stop tokens (EOS unless ignore_eos, and stop_token_ids) masked to -inf, so it cannot
emit them (the scheduler's stop check alone would let EOS through and keep going).
Logprobs (when a request asks, and always for beam search) are the log-softmax of the
logits after that mask, before temperature and top-k/top-p. The all-greedy batch is one argmax.
"""
from __future__ import annotations

import torch

from core.step_message import ModelRunnerOutput
from realexec.models.cpu_ops import argmax_rows


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus.

    logits [N, V]; top_k [N] long (V = disabled); top_p [N] float (1.0 = disabled).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)             # ascending
    if top_k is not None:
        first_kept = (vocab - top_k.clamp(1, vocab))[:, None]
        position = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits.masked_fill_(position < first_kept, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p)[:, None]                # the low-probability tail
        drop[:, -1] = False                                 # always keep the best token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def mask_stop_tokens_below_min(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """`logits` with each row's stop-token ids at -inf while its sequence has fewer than
    min_tokens outputs (a copy when anything is masked; the input is left alone)."""
    masked = None
    for i, s in enumerate(rows):
        params = s.seq.request.params
        if not params.min_tokens or s.seq.num_output_tokens >= params.min_tokens:
            continue
        ids = list(params.stop_token_ids)
        eos = s.seq.request.eos_token_id
        if eos is not None and not params.ignore_eos:
            ids.append(eos)
        if ids:
            if masked is None:
                masked = logits.clone()
            masked[i, ids] = float("-inf")
    return logits if masked is None else masked


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids) -> None:
        """Drop the per-request generators of requests that left the engine."""
        for rid in request_ids:
            self._request_generators.pop(rid, None)

    def _generator_for(self, request) -> torch.Generator:
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(request.params.seed)
            self._request_generators[request.request_id] = gen
        return gen

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list) -> ModelRunnerOutput:
        """logits [len(rows), V] fp32; rows: the sequences that sample (`.seq`, `.num_samples`)."""
        logits = mask_stop_tokens_below_min(logits, rows)
        greedy, random, beam, want_logprobs = [], [], [], []
        for i, s in enumerate(rows):
            params = s.seq.request.params
            if params.beam_width:
                beam.append(i)
            elif params.is_greedy:                 # temperature < SAMPLING_EPS, or top_k = 1
                greedy.append(i)
            else:
                random.append(i)
            if params.logprobs is not None:
                want_logprobs.append(i)

        if len(greedy) == len(rows) and not want_logprobs and all(s.num_samples == 1 for s in rows):
            best = argmax_rows(logits).tolist()               # the common case: one argmax
            return ModelRunnerOutput(token_ids={s.seq.seq_id: [t] for s, t in zip(rows, best)})

        chosen: list[list[int]] = [[] for _ in rows]
        beam_logprobs: dict[int, list[float]] = {}
        if greedy:
            best = argmax_rows(logits[greedy]).tolist()
            for i, t in zip(greedy, best):
                chosen[i] = [t] * rows[i].num_samples
        if random:
            self._sample_random(logits, rows, random, chosen)
        if beam:
            k_max = max(rows[i].num_samples for i in beam)
            lp, ids = logits[beam].log_softmax(dim=-1).topk(k_max, dim=-1)   # sorted, best first
            lp, ids = lp.tolist(), ids.tolist()
            for j, i in enumerate(beam):
                k = rows[i].num_samples
                chosen[i] = ids[j][:k]
                beam_logprobs[i] = lp[j][:k]

        token_ids = {s.seq.seq_id: chosen[i] for i, s in enumerate(rows)}
        if not want_logprobs and not beam:
            return ModelRunnerOutput(token_ids=token_ids)
        logprobs = {rows[i].seq.seq_id: v for i, v in beam_logprobs.items()}
        top = self._logprobs(logits, rows, want_logprobs, chosen, logprobs) if want_logprobs else None
        return ModelRunnerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    def _sample_random(self, logits, rows, idx: list[int], chosen: list[list[int]]) -> None:
        # Unseeded rows first (one noise draw for all of them), then each seeded row.
        idx = sorted(idx, key=lambda i: rows[i].seq.request.params.seed is not None)
        params = [rows[i].seq.request.params for i in idx]
        device = logits.device
        x = logits[idx] / torch.tensor([p.temperature for p in params], device=device)[:, None]
        vocab = x.shape[-1]
        top_k = top_p = None
        if any(p.top_k for p in params):
            top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        if top_k is not None or top_p is not None:
            x = apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)

        counts = [rows[i].num_samples for i in idx]
        noise = torch.empty(sum(counts), vocab, device=device)
        unseeded = sum(c for c, p in zip(counts, params) if p.seed is None)
        if unseeded:
            noise[:unseeded].exponential_(generator=self.generator)
        start = unseeded
        for i, c, p in zip(idx, counts, params):
            if p.seed is not None:
                noise[start:start + c].exponential_(generator=self._generator_for(rows[i].seq.request))
                start += c
        draws = probs.repeat_interleave(torch.tensor(counts, device=device), dim=0).div_(noise)
        tokens = draws.argmax(dim=-1).tolist()
        start = 0
        for i, c in zip(idx, counts):
            chosen[i] = tokens[start:start + c]
            start += c

    @staticmethod
    def _logprobs(logits, rows, idx: list[int], chosen, logprobs_out: dict) -> dict:
        """Fill logprobs_out[seq_id] (each chosen token's logprob) for rows `idx`; return
        top_logprobs: per chosen token, {token: logprob} of the top-k plus the chosen one."""
        lp = logits[idx].log_softmax(dim=-1)
        k_max = max(rows[i].seq.request.params.logprobs for i in idx)
        top_vals, top_ids = (lp.topk(k_max, dim=-1) if k_max else (None, None))
        top_out = {}
        for j, i in enumerate(idx):
            seq_id = rows[i].seq.seq_id
            k = rows[i].seq.request.params.logprobs
            toks = chosen[i]
            picked = lp[j, toks].tolist()
            base = dict(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist())) if k else {}
            dicts = []
            for t, v in zip(toks, picked):
                d = dict(base)
                d[t] = v
                dicts.append(d)
            if seq_id not in logprobs_out:       # beam rows already carry theirs
                logprobs_out[seq_id] = picked
            top_out[seq_id] = dicts
        return top_out
