"""Beam search on the paged cache: one step's decision as a plan the scheduler applies.

Every live beam returns its best 2*width next-token candidates (token, logprob). The
`width` best non-terminal extensions by cumulative logprob survive; a beam with k
surviving children keeps one and forks k - 1 (sharing all its blocks, copy-on-write
on the partial last block), a beam with none is freed. Terminal candidates (EOS /
stop token) become finished hypotheses that hold no KV. Like vLLM's default
(`early_stopping=False`), the search stops once `width` hypotheses are finished and
the best live beam cannot beat the worst of them at its current length.

`plan_beam_step` only decides (it touches no KV and no scheduler state); the
scheduler applies the `BeamPlan` (frees, forks, appends, finishes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from core.sched.request import Request, RequestStatus, Sequence
from core.sched.stop import STOPPED, stop_status


def beam_score(seq: Sequence, length_penalty: float) -> float:
    """HF/vLLM-style length-normalised score over the generated tokens."""
    return _score(seq.cum_logprob, seq.num_output_tokens, length_penalty)


def _score(cum_logprob: float, num_output_tokens: int, length_penalty: float) -> float:
    return cum_logprob / (max(num_output_tokens, 1) ** length_penalty)


@dataclass
class BeamPlan:
    """One beam-search step for a request, in the order the scheduler applies it:
    1. `hypotheses` join the request's finished sequences (they hold no KV);
    2. live beams missing from `extensions` are freed (pruned);
    3. each beam in `extensions` appends its first (token, logprob) and forks one child
       per further pair;
    4. then every live beam finishes with `finish_live` (a length limit), or, if
       `drop_live`, is freed without becoming a hypothesis (it cannot win)."""
    hypotheses: list[Sequence] = field(default_factory=list)
    extensions: dict[int, list[tuple[int, float]]] = field(default_factory=dict)   # seq_id -> children
    finish_live: RequestStatus | None = None
    drop_live: bool = False


def plan_beam_step(request: Request, beams: list[Sequence], token_ids: dict, logprobs: dict | None,
                   max_model_len: int) -> BeamPlan:
    """Decide one step for `beams` (the request's live beams that sampled, in batch order)."""
    if logprobs is None:
        raise ValueError(f"request {request.request_id!r}: beam search needs logprobs from the executor")
    params = request.params
    width = params.beam_width
    eos = request.eos_token_id
    candidates = []
    for order, seq in enumerate(beams):
        for rank, (tok, lp) in enumerate(zip(token_ids[seq.seq_id], logprobs[seq.seq_id])):
            candidates.append((seq.cum_logprob + lp, order, rank, seq, tok, lp))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))     # deterministic ties

    plan = BeamPlan()
    chosen = 0
    live_scores = []
    for cum, _, _, seq, tok, lp in candidates:
        if chosen == width:
            break
        num_out = seq.num_output_tokens + 1
        if stop_status(params, eos, tok, num_out, seq.num_tokens + 1, max_model_len) is STOPPED:
            hyp = Sequence(request, seq.token_ids + [tok], seq.num_prompt_tokens)
            hyp.cum_logprob = cum
            hyp.status = STOPPED
            plan.hypotheses.append(hyp)
            continue
        plan.extensions.setdefault(seq.seq_id, []).append((tok, lp))
        live_scores.append(_score(cum, num_out, params.length_penalty))
        chosen += 1

    if not live_scores:
        return plan
    # Every live beam has the same length after this step: the length limits end them all.
    some = beams[0]
    plan.finish_live = stop_status(params, eos, None, some.num_output_tokens + 1, some.num_tokens + 1,
                                   max_model_len)
    if plan.finish_live is None:
        done = [h for h in request.finished_seqs + plan.hypotheses if h.status is STOPPED]
        if len(done) >= width:
            worst_kept = sorted((beam_score(h, params.length_penalty) for h in done), reverse=True)[width - 1]
            plan.drop_live = worst_kept >= max(live_scores)
    return plan


def finalize_beams(request: Request) -> None:
    """Keep the `beam_width` best hypotheses, best first."""
    lp = request.params.length_penalty
    request.finished_seqs.sort(key=lambda s: beam_score(s, lp), reverse=True)
    del request.finished_seqs[request.params.beam_width:]
