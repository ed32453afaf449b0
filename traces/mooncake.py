"""Mooncake (FAST'25) JSONL traces, with synthetic token ids that honour their
prefix sharing.

A record is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
[...]}`` with one hash id per 512-token block of the prompt; equal ids mean equal
blocks (a shared prefix). We give every hash id its own fixed pseudo-random block of
token ids, so requests whose ``hash_ids`` start alike really share their first token
ids, and a prefix cache sees the hits the trace describes.

The token ids are generated on demand (``HashedBlockTokens``): materialized for a
whole trace they would take gigabytes (12k requests x 12k tokens).
"""
from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from .model import Trace, TraceError, TraceRequest, finalize, iter_lines, parse_float, parse_length, where

DEFAULT_BLOCK_SIZE = 512
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's vocabulary


@functools.lru_cache(maxsize=None)
def _vocab(vocab_size: int) -> list[int]:
    return list(range(vocab_size))  # shared int objects keep cached blocks small


@functools.lru_cache(maxsize=4096)
def block_token_ids(hash_id: int, block_size: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    """The token ids of the full block named ``hash_id``: a pure function of its
    arguments (string-seeded RNG), so equal across requests, runs and processes."""
    rng = random.Random(f"mooncake-block:{seed}:{hash_id}")
    return tuple(rng.choices(_vocab(vocab_size), k=block_size))


class HashedBlockTokens(Sequence):
    """A prompt's token ids, block by block from ``hash_ids``; the last block is cut
    to ``length``. Read-only and lazy: use ``list(...)`` to materialize."""

    __slots__ = ("hash_ids", "length", "block_size", "vocab_size", "seed")

    def __init__(self, hash_ids: Sequence[int], length: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0):
        if len(hash_ids) != math.ceil(length / block_size):
            raise ValueError(f"{len(hash_ids)} hash ids for {length} tokens in blocks of {block_size}")
        self.hash_ids = tuple(hash_ids)
        self.length, self.block_size, self.vocab_size, self.seed = length, block_size, vocab_size, seed

    def spec(self) -> dict:
        """What the twinserve JSON stores instead of the ids ("prompt_blocks")."""
        return {"hash_ids": list(self.hash_ids), "block_size": self.block_size,
                "vocab_size": self.vocab_size, "seed": self.seed}

    def blocks(self) -> Iterator[tuple[int, ...]]:
        """Each block's token ids (the last one possibly partial)."""
        for i, hash_id in enumerate(self.hash_ids):
            block = block_token_ids(hash_id, self.block_size, self.vocab_size, self.seed)
            yield block[: self.length - i * self.block_size]

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        for block in self.blocks():
            yield from block

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError("token index out of range")
        block, offset = divmod(index, self.block_size)
        return block_token_ids(self.hash_ids[block], self.block_size, self.vocab_size, self.seed)[offset]

    def __eq__(self, other) -> bool:
        if isinstance(other, HashedBlockTokens) and self.spec() == other.spec() and len(self) == len(other):
            return True
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # compares like a list, so unhashable like one

    def __repr__(self) -> str:
        return (f"HashedBlockTokens(len={self.length}, blocks={len(self.hash_ids)}, "
                f"block_size={self.block_size}, vocab_size={self.vocab_size}, seed={self.seed})")


def parse_hash_ids(value: object, at: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                              for h in value):
        raise TraceError(f"{at}: hash_ids: expected a list of non-negative integers")
    return value


def load_mooncake(path: str | Path, *, limit: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                  vocab_size: int = DEFAULT_VOCAB_SIZE, token_seed: int = 0) -> Trace:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids``; prompt_token_ids are ``HashedBlockTokens`` (see the module doc)."""
    requests = []
    for line_no, line in enumerate(iter_lines(path), 1):
        if not line.strip():
            continue
        if limit is not None and len(requests) >= limit:
            break
        at = where(path, line_no)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{at}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{at}: expected a JSON object, got {type(record).__name__}")
        missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in record]
        if missing:
            raise TraceError(f"{at}: missing field(s) {', '.join(missing)}")
        input_len = parse_length(record["input_length"], "input_length", at)
        hash_ids = parse_hash_ids(record["hash_ids"], at)
        if len(hash_ids) != math.ceil(input_len / block_size):
            raise TraceError(f"{at}: {len(hash_ids)} hash_ids, but input_length {input_len} needs "
                             f"{math.ceil(input_len / block_size)} blocks of {block_size} tokens")
        requests.append(TraceRequest(
            request_id=f"mooncake-{len(requests)}",
            arrival_time=parse_float(record["timestamp"], "timestamp", at) / 1000.0,
            prompt_len=input_len,
            output_len=parse_length(record["output_length"], "output_length", at),
            prompt_token_ids=HashedBlockTokens(hash_ids, input_len, block_size, vocab_size, token_seed),
        ))
    source = (f"mooncake {path}; prompt_token_ids synthesized per hash id "
              f"({block_size}-token blocks, vocab {vocab_size}, seed {token_seed})")
    return finalize(requests, source if limit is None else f"{source}, first {limit} requests")
