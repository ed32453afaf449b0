"""timeseries.csv: one row per engine step, per steady-decode span (or phase of one), and
per idle gap, in the units the file has (`kv_usage`: fraction of the GPU blocks; the four
memory columns: fraction of all KV slots, see `sim.memory`)."""
from __future__ import annotations

from typing import NamedTuple

from sim.memory import MemorySample


class TimeseriesRow(NamedTuple):
    time: float              # when the step, span or gap started (s)
    duration: float          # its length (s)
    steps: int               # engine steps in it (0: idle; pipelined: batches that landed)
    kv_usage: float          # GPU blocks in use / all GPU blocks (a span's time mean)
    running: int
    waiting: int
    swapped: int
    batch_size: int          # sequences in the batch
    batch_tokens: int        # tokens computed in the step
    preempted: int
    token_states: float
    reserved: float
    internal_frag: float
    external_frag: float


COLUMNS = TimeseriesRow._fields


class Timeseries:
    """An engine's rows, divided into the file's units as they are made."""

    __slots__ = ("rows", "num_blocks", "num_slots")

    def __init__(self, num_blocks: int, block_size: int):
        self.rows: list[TimeseriesRow] = []
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * block_size

    def step(self, start: float, duration: float, blocks_in_use: int, running: int, waiting: int, swapped: int,
             batch_size: int, batch_tokens: int, preempted: int, mem: MemorySample, steps: int = 1) -> None:
        """A step (or, pipelined, the batches that landed in `duration`), sampled during it."""
        slots = self.num_slots
        self.rows.append(TimeseriesRow(start, duration, steps, blocks_in_use / self.num_blocks, running, waiting,
                                       swapped, batch_size, batch_tokens, preempted, mem[0] / slots,
                                       mem[1] / slots, mem[2] / slots, mem[3] / slots))

    def idle(self, start: float, duration: float, blocks_in_use: int, running: int, waiting: int, swapped: int,
             mem: MemorySample) -> None:
        """A gap without a step (the engine waits for an arrival or a wake-up)."""
        self.step(start, duration, blocks_in_use, running, waiting, swapped, 0, 0, 0, mem, steps=0)

    def span(self, start: float, end: float, steps: int, block_seconds: float, running: int, waiting: int,
             swapped: int, num_seqs: int, in_use: tuple, in_use_before: tuple) -> None:
        """A steady-decode span (or a phase of one), as time means: `block_seconds` is the
        blocks-in-use integral over it, `in_use`/`in_use_before` the four in-use memory
        integrals (slot-seconds) at its end and start."""
        span = end - start
        slots = self.num_slots
        self.rows.append(TimeseriesRow(
            start, span, steps, block_seconds / span / self.num_blocks, running, waiting, swapped, num_seqs,
            num_seqs, 0, (in_use[0] - in_use_before[0]) / span / slots, (in_use[1] - in_use_before[1]) / span / slots,
            (in_use[2] - in_use_before[2]) / span / slots, (in_use[3] - in_use_before[3]) / span / slots))
