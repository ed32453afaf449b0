"""Beam search on the paged cache: each step forks surviving beams and frees the rest.

Every live beam returns its best 2*width next-token candidates (token, logprob). The
`width` best non-terminal extensions by cumulative logprob survive; a beam with k
surviving children keeps one and forks k - 1 (sharing all its blocks, copy-on-write
on the partial last block), a beam with none is freed. Terminal candidates (EOS /
stop token) become finished hypotheses that hold no KV. Like vLLM's default
(`early_stopping=False`), the search stops once `width` hypotheses are finished and
the best live beam cannot beat the worst of them at its current length.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from core.request import Request, RequestStatus, Sequence

if TYPE_CHECKING:
    from core.scheduler import ScheduledSeq, Scheduler


def beam_score(seq: Sequence, length_penalty: float) -> float:
    """HF/vLLM-style length-normalised score over the generated tokens."""
    return seq.cum_logprob / (max(seq.num_output_tokens, 1) ** length_penalty)


def beam_step(request: Request, group: list["ScheduledSeq"], token_ids: dict, logprobs: dict | None,
              scheduler: "Scheduler") -> None:
    if logprobs is None:
        raise ValueError(f"request {request.request_id!r}: beam search needs logprobs from the executor")
    params = request.params
    width = params.beam_width
    kv = scheduler.kv
    candidates = []
    for order, s in enumerate(group):
        seq = s.seq
        for rank, (tok, lp) in enumerate(zip(token_ids[seq.seq_id], logprobs[seq.seq_id])):
            candidates.append((seq.cum_logprob + lp, order, rank, seq, tok, lp))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))     # deterministic ties

    children: dict[int, list[tuple[int, float]]] = {}
    chosen = 0
    for _, _, _, seq, tok, lp in candidates:
        if chosen == width:
            break
        num_out = seq.num_output_tokens + 1
        terminal = num_out >= params.min_tokens and (
            (tok == request.eos_token_id and not params.ignore_eos) or tok in params.stop_token_ids)
        if terminal:
            hyp = Sequence(request, seq.token_ids + [tok], seq.num_prompt_tokens)
            hyp.cum_logprob = seq.cum_logprob + lp
            hyp.status = RequestStatus.FINISHED_STOPPED
            request.finished_seqs.append(hyp)
            continue
        children.setdefault(seq.seq_id, []).append((tok, lp))
        chosen += 1

    request._forked = True
    for seq in list(request.seqs):
        if seq.seq_id not in children:
            kv.free(seq)                       # pruned beam: its private blocks go back first
            request.seqs.remove(seq)
    for seq in list(request.seqs):
        kids = children[seq.seq_id]
        for tok, lp in kids[1:]:
            child = seq.fork()
            kv.fork(seq, child)
            child.token_ids.append(tok)
            child.cum_logprob += lp
            request.seqs.append(child)
        tok, lp = kids[0]
        seq.token_ids.append(tok)
        seq.cum_logprob += lp

    # Length limits end every live beam at once (they all have the same length).
    if request.seqs:
        seq = request.seqs[0]
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or \
                seq.num_tokens >= scheduler.config.max_model_len:
            for seq in list(request.seqs):
                scheduler._finish_seq(seq, RequestStatus.FINISHED_LENGTH)
            return

    done = [h for h in request.finished_seqs if h.status is RequestStatus.FINISHED_STOPPED]
    if len(done) >= width and request.seqs:
        lp_ = params.length_penalty
        worst_kept = sorted((beam_score(h, lp_) for h in done), reverse=True)[width - 1]
        best_live = max(beam_score(s, lp_) for s in request.seqs)
        if worst_kept >= best_live:
            for seq in list(request.seqs):     # cannot win: drop without adding hypotheses
                kv.free(seq)
            request.seqs.clear()


def finalize_beams(request: Request) -> None:
    """Keep the `beam_width` best hypotheses, best first."""
    lp = request.params.length_penalty
    request.finished_seqs.sort(key=lambda s: beam_score(s, lp), reverse=True)
    del request.finished_seqs[request.params.beam_width:]
