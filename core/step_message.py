"""The step as a message: what an executor sends its workers each step.

A `SchedulerOutput` holds live core objects (sequences, the block manager's tables); a
worker in another process or on another machine cannot read those. `StepMessageBuilder`
turns each one into a `StepMessage`: plain lists, ints, strings and dicts, no reference
into the core. Workers keep their own per-sequence state (token ids, block table,
sampling params) and update it from the message, so a step carries O(changes), not
O(context):

  * a request seen for the first time: its sampling params once (`NewRequest`);
  * a sequence seen for the first time: all its known token ids and its whole block
    table once (`NewSeq`; a prompt, a forked sample or beam, a request after restart);
  * a sequence the workers already hold: the token ids appended since it was last sent
    (the token sampled last step) and the blocks appended to its table (`SeqDelta`).
    When its table was replaced rather than grown (resumed after a recompute or swap
    preemption, or copy-on-write swapped its last block) `resumed` is set and
    `new_block_ids` is the whole new table;
  * the batch itself, in order: per scheduled sequence its first new position, number of
    new tokens and number of samples (four parallel int lists: cheap to encode);
  * sequences and requests that left (workers drop their state, before they add this
    message's arrivals: a request id may be reused once its request has finished),
    block swap/copy lists.

The same message type serves every executor (in-process, one process per rank, one Ray
actor per rank). Pure Python: serialization is the executor's business.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from core.outputs import ModelRunnerOutput  # noqa: F401  (the executor's reply travels with the message types)


@dataclass(slots=True)
class NewRequest:
    req_id: str
    params: dict               # SamplingParams fields as plain data
    eos_token_id: int | None


@dataclass(slots=True)
class NewSeq:
    seq_id: int
    req_id: str
    token_ids: list[int]       # every known token (prompt, plus outputs for a fork or a resume)
    num_prompt_tokens: int
    block_ids: list[int]       # the whole block table


@dataclass(slots=True)
class SeqDelta:
    seq_id: int
    new_token_ids: list[int]   # appended since the sequence was last sent
    new_block_ids: list[int]   # appended to the table; the whole table when `resumed`
    resumed: bool = False


@dataclass(slots=True)
class StepMessage:
    step_id: int = 0
    new_requests: list[NewRequest] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    cached_seqs: list[SeqDelta] = field(default_factory=list)
    # The batch, in order: compute tokens [start, start + num_tokens) of seq_ids[i].
    seq_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)   # 0: a mid-prefill chunk
    finished_seq_ids: list[int] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)       # (src, dst)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


def params_to_plain(params) -> dict:
    """A SamplingParams as a dict of plain values (lists stay lists, copied). Its fields are
    scalars and lists of scalars, so a shallow copy is dataclasses.asdict's result at a
    seventh of its cost (asdict deep-copies every value): one per new request."""
    return {f.name: (list(v) if isinstance(v := getattr(params, f.name), list) else v)
            for f in dataclasses.fields(params)}


class _Sent:
    """What the workers hold of one sequence (as of the last message)."""
    __slots__ = ("seq", "table", "num_blocks", "last_block", "num_tokens")

    def __init__(self, seq, table: list[int], num_tokens: int):
        self.seq = seq
        self.table = table                 # the manager's live list the blocks were read from
        self.num_blocks = len(table)
        self.last_block = table[-1] if table else -1
        self.num_tokens = num_tokens


def _left(seq) -> bool:
    """Finished, its request finished or aborted, or dropped from its request (a pruned beam
    is freed and removed without a finished status)."""
    request = seq.request
    if seq.status.finished or request.status.finished:
        return True
    seqs = request.seqs
    return not (seqs and seqs[0] is seq) and seq not in seqs


class StepMessageBuilder:
    """Engine side: remembers what the workers were told, to send only what changed.

    Call `build` on every SchedulerOutput that is executed, in order; all workers must
    receive every message (their state is the running sum of them)."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}
        self._reqs: dict[str, object] = {}    # request id -> the Request the workers hold params of
        self._step = 0

    @property
    def num_tracked_seqs(self) -> int:
        return len(self._sent)

    def build(self, out) -> StepMessage:
        msg = StepMessage(step_id=self._step)
        self._step += 1
        # Departures first, as the workers apply them: a request id reused by a new request
        # must leave (with its params and seeded generator) before the new one arrives.
        self._drop_finished(msg)
        sent = self._sent
        seq_ids, starts, num_tokens, num_samples = msg.seq_ids, msg.starts, msg.num_tokens, msg.num_samples
        for s in out.scheduled:
            seq = s.seq
            sid = seq.seq_id
            table = s.block_table
            seq_ids.append(sid)
            starts.append(s.start)
            num_tokens.append(s.num_tokens)
            num_samples.append(s.num_samples)
            st = sent.get(sid)
            toks = seq.token_ids
            if st is None:
                self._new_seq(msg, seq, table)
                continue
            new_toks = toks[st.num_tokens:] if len(toks) != st.num_tokens else []
            nb = st.num_blocks
            if table is st.table and len(table) >= nb and (nb == 0 or table[nb - 1] == st.last_block):
                if len(table) == nb and not new_toks:
                    continue                     # nothing changed (a chunk of a known prompt)
                msg.cached_seqs.append(SeqDelta(sid, new_toks, table[nb:]))
            else:                                # the table was replaced: send all of it
                msg.cached_seqs.append(SeqDelta(sid, new_toks, list(table), True))
                st.table = table
            st.num_blocks = len(table)
            st.last_block = table[-1] if table else -1
            st.num_tokens = len(toks)
        msg.blocks_to_swap_out = list(out.blocks_to_swap_out)
        msg.blocks_to_swap_in = list(out.blocks_to_swap_in)
        msg.blocks_to_copy = list(out.blocks_to_copy)
        return msg

    def _new_seq(self, msg: StepMessage, seq, table: list[int]) -> None:
        request = seq.request
        rid = request.request_id
        held = self._reqs.get(rid)
        if held is not request:
            if held is not None:   # departures ran first: only a live request can still be held
                raise RuntimeError(f"request id {rid!r} is held by the workers for a live request "
                                   f"and reused by another one")
            self._reqs[rid] = request
            msg.new_requests.append(NewRequest(rid, params_to_plain(request.params), request.eos_token_id))
        msg.new_seqs.append(NewSeq(seq.seq_id, rid, list(seq.token_ids), seq.num_prompt_tokens, list(table)))
        self._sent[seq.seq_id] = _Sent(seq, table, len(seq.token_ids))

    def _drop_finished(self, msg: StepMessage) -> None:
        """Sequences that left (finished, pruned, or their request finished or was aborted)
        and requests that finished, since the last message. Checked here, not read from
        SchedulerOutput.finished_request_ids, because the engine skips empty steps and their
        finished ids with them. A request stays while it is live, even when none of its
        sequences is held (an n > 1 parent that stopped before its forks were sent)."""
        sent = self._sent
        for sid in [sid for sid, st in sent.items() if _left(st.seq)]:
            del sent[sid]
            msg.finished_seq_ids.append(sid)
        done = [rid for rid, request in self._reqs.items() if request.status.finished]
        for rid in done:
            del self._reqs[rid]
        msg.finished_req_ids.extend(done)
