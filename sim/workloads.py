"""Workloads the simulator expresses on top of a loaded trace (vLLM paper, Section 6).

The trace fixes each request's arrival time, prompt length and output length; these
workloads change what the requests *share*:

Parallel sampling (`--n N`, `SimConfig.n`): each request returns N samples. The prompt
is prefilled once; after it the prompt's sequence forks N - 1 children that share all
its KV blocks (copy-on-write on the partial last block). Every sample runs to the
request's traced output length (`max_tokens`, `ignore_eos`).

Beam search (`--beam-width K`, `SimConfig.beam_width`): K beams per request. Each step
the simulated executor gives every live beam 2K candidate tokens whose log-probabilities
are random (`SimExecutor.beam_candidates`: cumulative Exp(1)/2 decrements, seeded by
`--seed` and the beam's history); the core keeps the K best extensions by cumulative
log-probability. Which beams survive -- and so how many blocks stay shared and how
often a beam forks (copy-on-write of its last block) or dies (its blocks freed) -- is
therefore random, as in the paper's Figure 8, and reproducible for a seed. Beams never
emit EOS, so a request ends at its traced output length with K finished beams.

Shared prefix (`--shared-prefix-len L`, `shared_prefix_len`): the same L-token system
prompt is prepended to every request (to every conversation's first turn with
`--multi-turn`); its token ids are identical across requests (`SYSTEM_PROMPT_BASE + k`,
k < L), the request's own prompt follows (its trace token ids, or the simulator's
unique synthetic ids). With `--enable-prefix-caching` the L // block_size full blocks of
the system prompt are computed once and shared. The paper used 80 (one-shot) and 341
(five-shot) token prefixes.

Multi-turn chat (`--multi-turn`, `multi_turn`): consecutive trace requests are grouped
into conversations of 2..`max_turns` turns (sizes drawn uniformly with `random.Random
(seed)`); a turn whose conversation would outgrow `max_model_len` (projected from the
traced lengths, the shared prefix included) starts a new conversation instead. Turn
k+1's prompt is the whole token list of turn k as it finished -- its prompt (which
already holds the earlier turns) plus its output tokens, the very ids the simulated
executor produced -- followed by turn k+1's own prompt. A user answers only after
reading the answer, so turn k+1 arrives at max(its traced arrival time, the time turn k
finished + `think_time`); the engine builds its prompt at that moment
(`ConversationTrace.parents` names each turn's previous turn). Consequences, by design:
a follow-up never waits in the queue while its predecessor still generates the tokens
it will reuse; its `arrival_time`, TTFT and latency count from that effective arrival;
`prompt_len` in the trace is the turn's own new message only.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from itertools import chain

from sim.engine import synthetic_prompt
from traces import HashedBlockTokens, Trace, TraceRequest

# First id of the shared system prompt (the simulator's synthetic prompts start at 1 << 24
# and sampled ids stay below 65522, so none of them is ever one of these).
SYSTEM_PROMPT_BASE = 1 << 25


@dataclass
class ConversationTrace(Trace):
    """A trace whose requests form conversations (see the module doc)."""
    parents: list[int] = field(default_factory=list)   # previous turn's trace index, -1 = first turn
    think_time: float = 0.0                            # seconds from a turn's finish to the next turn

    def conversations(self) -> list[list[int]]:
        """Trace indices of each conversation's turns, in order."""
        convs: list[list[int]] = []
        where: dict[int, int] = {}
        for i, p in enumerate(self.parents):
            if p < 0:
                where[i] = len(convs)
                convs.append([i])
            else:
                where[i] = where[p]
                convs[where[p]].append(i)
        return convs


def system_prompt(length: int) -> list[int]:
    """The shared system prompt's token ids (identical for every request)."""
    return [SYSTEM_PROMPT_BASE + k for k in range(length)]


def own_prompt_ids(request: TraceRequest, index: int) -> list[int]:
    """A request's prompt ids: its trace's, or the ids the simulator would synthesize."""
    ids = request.prompt_token_ids
    if ids is not None and len(ids):
        return list(chain.from_iterable(ids.blocks())) if isinstance(ids, HashedBlockTokens) else list(ids)
    return synthetic_prompt(index, max(1, request.prompt_len))


def group_conversations(trace: Trace, *, max_turns: int = 4, seed: int = 0, max_model_len: int | None = None,
                        first_turn_extra: int = 0) -> list[int]:
    """parents[i]: the previous turn of request i in its conversation, or -1 (see the module doc).
    `first_turn_extra` tokens (a shared prefix) are counted in the projected context."""
    if max_turns < 1:
        raise ValueError(f"max-turns must be >= 1, got {max_turns}")
    rng = random.Random(seed)
    reqs = trace.requests
    n = len(reqs)
    parents = [-1] * n
    i = 0
    while i < n:
        size = rng.randint(min(2, max_turns), max_turns)
        context = first_turn_extra + reqs[i].prompt_len + max(1, reqs[i].output_len)
        j, turns = i + 1, 1
        while j < n and turns < size:
            need = context + reqs[j].prompt_len + max(1, reqs[j].output_len)
            if max_model_len is not None and need > max_model_len:
                break
            parents[j] = j - 1
            context, turns, j = need, turns + 1, j + 1
        i = j
    return parents


def apply_workload(trace: Trace, *, shared_prefix_len: int = 0, multi_turn: bool = False, max_turns: int = 4,
                   think_time: float = 0.0, seed: int = 0, max_model_len: int | None = None) -> Trace:
    """`trace` with a shared system prompt and/or grouped into conversations (module doc).
    Apply it last, to the trace exactly as it will be simulated (after re-timing)."""
    if shared_prefix_len < 0:
        raise ValueError(f"shared-prefix-len must be >= 0, got {shared_prefix_len}")
    if not think_time >= 0:
        raise ValueError(f"think-time must be >= 0, got {think_time}")
    if not shared_prefix_len and not multi_turn:
        return trace
    parents = (group_conversations(trace, max_turns=max_turns, seed=seed, max_model_len=max_model_len,
                                   first_turn_extra=shared_prefix_len)
               if multi_turn else [-1] * len(trace))
    requests = list(trace.requests)
    notes = []
    if shared_prefix_len:
        system = system_prompt(shared_prefix_len)
        for i, r in enumerate(requests):
            if parents[i] < 0:
                ids = system + own_prompt_ids(r, i)
                requests[i] = replace(r, prompt_len=len(ids), prompt_token_ids=ids)
        notes.append(f"a shared system prompt of {shared_prefix_len} tokens (identical ids) prepended to "
                     f"every {'conversation' if multi_turn else 'request'}")
    if not multi_turn:
        return Trace(requests, f"{trace.source}; workload: {notes[0]}")
    num_convs = parents.count(-1)
    notes.append(f"multi-turn: {len(requests)} requests grouped into {num_convs} conversations of 2..{max_turns} "
                 f"consecutive turns (seed {seed}); a turn's prompt = the previous turn's prompt + output + its "
                 f"own prompt; it arrives at max(traced time, previous finish + {think_time:g} s)")
    return ConversationTrace(requests, f"{trace.source}; workload: {'; '.join(notes)}", parents=parents,
                             think_time=think_time)
