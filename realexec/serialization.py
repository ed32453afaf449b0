"""Wire format of the step message and of the executor's replies.

The step message (core.step_message.StepMessage, plain dataclasses) is encoded with
msgspec's MessagePack encoder and decoded into the same typed dataclasses; replies and
collective_rpc calls (rare, arbitrary Python values) use pickle protocol 5.
Measured by `python -m realexec bench executors` (README): msgspec encodes+decodes a
step message several times faster than pickle and produces smaller bytes.
"""
from __future__ import annotations

import pickle

import msgspec

from core.step_message import StepMessage

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepMessage)


def encode_step(msg: StepMessage) -> bytes:
    return _encoder.encode(msg)


def decode_step(data: bytes | memoryview) -> StepMessage:
    return _decoder.decode(data)


def encode_step_pickle(msg: StepMessage) -> bytes:
    return pickle.dumps(msg, protocol=5)


def decode_step_pickle(data: bytes) -> StepMessage:
    return pickle.loads(data)


def dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


def loads(data: bytes):
    return pickle.loads(data)
