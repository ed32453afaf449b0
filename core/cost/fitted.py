"""FittedCostModel: step times from a `realexec profile` file (`--cost-model profile.json`).

The file is plain JSON (format in `core.cost.fit`): per phase, the executor's time and
the engine's per-step overhead (scheduling, update, detokenization) as non-negative
linear models of the batch's sums. A simulated step costs their sum, so the simulated
clock advances like the real engine's step loop. Swap copies cost the profile's fitted
swap time (fixed + per block, scaled by the block size); a profile without one (older
files, no swap pool) falls back to another model (the roofline's PCIe term).

With `jitter_seed` (`sim run --jitter-seed S`), a calibrated model's "jitter" section
(`sim calibrate`) multiplies each step's time by the next factor of a seeded
`core.cost.fit.StepJitter`: one draw per step, in step order, so the engine must run
step by step (the simulator turns event skipping off; spans would price steps whose
draws a cut discards).

A calibrated model's "wake" section prices the first steps after the engine sat idle
apart: the engine calls `engine_idle()` when it waits for work, and the next steps cost
the section's factors (place 1 first) on top of the served calibration. The simulator
starts no event-skipping span while such steps are pending (`waking`).
"""
from __future__ import annotations

import json

from core.cost.fit import StepCostEvaluator, StepJitter, jitter_params, swap_seconds, wake_params
from core.cost.model import BatchShape, CostModel


def load_cost_model_file(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"cost model {path}: not JSON ({e.msg} at line {e.lineno})") from None
    except OSError as e:
        raise ValueError(f"cost model {path}: cannot read it ({e.strerror or e})") from None


class FittedCostModel:
    """CostModel from a fitted profile; `swap_fallback` prices swaps."""

    def __init__(self, model: dict, swap_fallback: CostModel, where: str = "cost model",
                 jitter_seed: int | None = None):
        self.evaluator = StepCostEvaluator(model, where)
        self.jitter = None
        if jitter_seed is not None:
            params = jitter_params(model, where)
            if params is None:
                raise ValueError(f"{where}: --jitter-seed needs a jitter section (a `sim calibrate` output)")
            self.jitter = StepJitter(*params, seed=jitter_seed)
        self.wake = wake_params(model, where)
        self._place = 0                  # the engine starts idle: the next step is place 1
        self.profile = model.get("profile", {})
        # "cpu": step times are the stepping thread's CPU seconds (a core of its own), else wall seconds
        self.time_basis = self.profile.get("time_basis", "wall")
        self.held_out_step = model.get("held_out_step", {})
        self._swap_fallback = swap_fallback

    @classmethod
    def from_file(cls, path: str, swap_fallback: CostModel, jitter_seed: int | None = None) -> FittedCostModel:
        return cls(load_cost_model_file(path), swap_fallback, where=path, jitter_seed=jitter_seed)

    def step_time(self, batch: BatchShape) -> float:
        t = self.evaluator.step_time(batch.num_seqs, batch.num_new_tokens, batch.context_sum, batch.attn_pairs)
        if t > 0 and self._place < len(self.wake):
            t *= self.wake[self._place]
            self._place += 1
        return t * self.jitter.next() if self.jitter is not None and t > 0 else t

    def engine_idle(self) -> None:
        """The engine sat idle: its next steps are the wake section's."""
        self._place = 0

    @property
    def waking(self) -> bool:
        """Whether the next step still gets a wake factor."""
        return self._place < len(self.wake)

    def host_time(self, batch: BatchShape) -> float:
        """The profile's fitted engine overhead (scheduling, update, detokenization) of this
        batch: the host's share of step_time, by the grid model (no calibration or jitter)."""
        if batch.num_seqs <= 0:
            return 0.0
        return max(0.0, self.evaluator.part_time("overhead", batch.num_seqs, batch.num_new_tokens,
                                                 batch.context_sum, batch.attn_pairs))

    def swap_time(self, num_blocks: int, block_bytes: int) -> float:
        swap = self.evaluator.model.get("swap")
        if swap is not None:
            return swap_seconds(swap, num_blocks, block_bytes)
        return self._swap_fallback.swap_time(num_blocks, block_bytes)

    def decode_step_times(self, num_seqs: int, context_sum: int, k: int) -> list[float]:
        """Element j is step_time(BatchShape.decode(num_seqs, context_sum + j*num_seqs)), the
        same floats (same evaluator call), for event skipping."""
        if self.jitter is not None:
            raise RuntimeError("jittered step times are drawn one step at a time: run without event skipping")
        if self.waking:
            raise RuntimeError("the first steps after idle are priced one at a time: no span while `waking`")
        step = self.evaluator.step_time
        n = num_seqs
        return [step(n, n, ctx, ctx + n) for ctx in range(context_sum, context_sum + k * n, n)] if n > 0 \
            else [0.0] * max(k, 0)
