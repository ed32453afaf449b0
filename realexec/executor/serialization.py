"""Wire format of the step message and of the executor's replies.

The step message (core.step_message.StepMessage: dataclasses, so the core needs no
msgspec) is sent as MessagePack arrays, not maps: each record is encoded positionally
and decoded by msgspec straight into array-like Structs with the same field names, which
is all a worker reads (attributes). Field names would otherwise be most of a decode
step's bytes: 2.8 KB instead of 14 KB for 256 sequences, at the same encode+decode time
(the map encoding of the dataclasses is kept for the benchmark). pickle protocol 5 is
smaller than maps but 2-4x slower to encode+decode (`python -m realexec bench executors`).
Replies and collective_rpc calls (rare, arbitrary Python values) use pickle protocol 5.
"""
from __future__ import annotations

import pickle

import msgspec

from core.step_message import StepMessage


class WireNewRequest(msgspec.Struct, array_like=True):
    req_id: str
    params: dict
    eos_token_id: int | None


class WireNewSeq(msgspec.Struct, array_like=True):
    seq_id: int
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]


class WireSeqDelta(msgspec.Struct, array_like=True):
    seq_id: int
    new_token_ids: list[int]
    new_block_ids: list[int]
    resumed: bool = False


class WireStepMessage(msgspec.Struct, array_like=True):
    """core.step_message.StepMessage as it arrives at a worker (same field names and order)."""
    step_id: int
    new_requests: list[WireNewRequest]
    new_seqs: list[WireNewSeq]
    cached_seqs: list[WireSeqDelta]
    seq_ids: list[int]
    starts: list[int]
    num_tokens: list[int]
    num_samples: list[int]
    finished_seq_ids: list[int]
    finished_req_ids: list[str]
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WireStepMessage)
_map_decoder = msgspec.msgpack.Decoder(StepMessage)


def _positional(m) -> tuple:
    return (m.step_id,
            [(r.req_id, r.params, r.eos_token_id) for r in m.new_requests],
            [(s.seq_id, s.req_id, s.token_ids, s.num_prompt_tokens, s.block_ids) for s in m.new_seqs],
            [(d.seq_id, d.new_token_ids, d.new_block_ids, d.resumed) for d in m.cached_seqs],
            m.seq_ids, m.starts, m.num_tokens, m.num_samples, m.finished_seq_ids, m.finished_req_ids,
            m.blocks_to_swap_out, m.blocks_to_swap_in, m.blocks_to_copy)


def encode_step(msg: StepMessage | WireStepMessage) -> bytes:
    return _encoder.encode(_positional(msg))


def decode_step(data: bytes | memoryview) -> WireStepMessage:
    return _decoder.decode(data)


def encode_step_map(msg: StepMessage) -> bytes:
    """msgspec's own encoding of the dataclasses (maps with field names): for comparison."""
    return _encoder.encode(msg)


def decode_step_map(data: bytes) -> StepMessage:
    return _map_decoder.decode(data)


def encode_step_pickle(msg: StepMessage) -> bytes:
    return pickle.dumps(msg, protocol=5)


def decode_step_pickle(data: bytes) -> StepMessage:
    return pickle.loads(data)


def dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


def loads(data: bytes):
    return pickle.loads(data)
