"""Pipeline stages in the simulator: how the layers split, what each stage costs and holds.

The layout (P stages of tp ranks, layers per stage, the stage-to-stage link), each stage's
roofline price and the inter-stage transfer, and the KV capacity (the minimum over stages).
`sim.engine.resolve` sizes a deployment with these; `sim.cluster.pipeline_parallel` runs batches through them.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.config import pipeline_stage_layers
from core.kv.kv_capacity import kv_block_bytes_per_rank, kv_blocks_per_pipeline
from core.cost.model import BatchShape, RooflineCostModel, activation_peak_bytes, check_tp
from core.cost.specs import GiB, HardwareSpec, ModelSpec

GPUS_PER_NODE = 8
INTER_NODE_BANDWIDTH = 25e9        # bytes/s per direction: one 200 Gb/s InfiniBand NIC per GPU
INTER_STAGE_LATENCY_S = 10e-6      # one point-to-point send/recv (NCCL, small-message regime)


@dataclass(frozen=True)
class PipelineLayout:
    """How a model is split: P stages of tp ranks, layers per stage, the stage-to-stage link."""
    pp: int
    tp: int
    stage_layers: tuple[int, ...]
    link_bandwidth: float                  # bytes/s per direction
    link_latency_s: float = INTER_STAGE_LATENCY_S

    @property
    def gpus(self) -> int:
        return self.pp * self.tp

    @classmethod
    def of(cls, model: ModelSpec, hw: HardwareSpec, tp: int, pp: int, partition: str | None = None,
           link_gbps: float | None = None) -> PipelineLayout:
        check_tp(model, tp)
        layers = pipeline_stage_layers(model.num_layers, pp, partition)
        if link_gbps is not None:
            bandwidth = link_gbps * 1e9
        else:
            bandwidth = hw.interconnect_bandwidth if pp * tp <= GPUS_PER_NODE else INTER_NODE_BANDWIDTH
        return cls(pp, tp, tuple(layers), bandwidth)

    def activation_bytes(self, model: ModelSpec, num_tokens: int) -> int:
        """What one stage sends the next for a batch: hidden state + residual per token."""
        return 2 * model.hidden_size * model.dtype_bytes * num_tokens

    def transfer_time(self, model: ModelSpec, num_tokens: int) -> float:
        return self.link_latency_s + self.activation_bytes(model, num_tokens) / self.link_bandwidth


# -- memory -------------------------------------------------------------------------------------

def stage_weight_bytes(model: ModelSpec, layers: int, first: bool, last: bool, tp: int) -> float:
    """Weights one rank of a stage holds: its layers, the embedding on the first stage, the
    final norm and LM head on the last (a tied LM head is a second copy of the embedding)."""
    if first and last:
        return model.weight_bytes() / tp
    h = model.hidden_size
    params = layers * model.params_per_layer()
    if first:
        params += model.vocab_size * h + model.learned_pos_embeddings * h
    if last:
        params += (2 * h if model.linear_bias else h) + model.lm_head_params()
    return params * model.dtype_bytes / tp


def pipeline_kv_capacity_blocks(model: ModelSpec, hw: HardwareSpec, block_size: int, gpu_memory_utilization: float,
                                layout: PipelineLayout, max_num_batched_tokens: int) -> int:
    """KV blocks of the pipeline: the minimum over stages of (memory * utilization - the
    stage's weights - activation peak) // the stage's block bytes per rank. Raises
    ValueError naming the stage whose weights do not fit."""
    budget = hw.mem_bytes * gpu_memory_utilization
    act = activation_peak_bytes(model, max_num_batched_tokens, layout.tp)
    free = []
    last = layout.pp - 1
    for k, layers in enumerate(layout.stage_layers):
        weights = stage_weight_bytes(model, layers, k == 0, k == last, layout.tp)
        if weights > budget:
            raise ValueError(f"stage {k} of {model.name} ({layers} layers) needs {weights / GiB:.1f} GiB of weights "
                             f"per rank at tp={layout.tp}, but {hw.name} offers {budget / GiB:.1f} GiB at "
                             f"gpu_memory_utilization={gpu_memory_utilization}; raise tp or pp")
        free.append(budget - weights - act)
    return kv_blocks_per_pipeline(free, block_size, list(layout.stage_layers), model.num_kv_heads, model.head_dim,
                                  model.dtype_bytes, layout.tp)


def pipeline_block_bytes(model: ModelSpec, block_size: int, layout: PipelineLayout) -> int:
    """Bytes of one KV block on a rank of the largest stage (what that stage swaps per block)."""
    return kv_block_bytes_per_rank(block_size, max(layout.stage_layers), model.num_kv_heads, model.head_dim,
                                   model.dtype_bytes, layout.tp)


# -- time ---------------------------------------------------------------------------------------

class PipelineCostModel:
    """Per-stage step times and the inter-stage transfer. `step_time` (the CostModel
    protocol) is one batch's latency through the whole pipeline with nothing else in it."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, layout: PipelineLayout):
        self.model, self.layout = model, layout
        last = layout.pp - 1
        self.stages = [RooflineCostModel(model, hw, layout.tp, num_layers=layers, last_stage=k == last,
                                         **({} if k == 0 else {"step_overhead_s": 0.0}))
                       for k, layers in enumerate(layout.stage_layers)]

    def stage_times(self, batch: BatchShape) -> list[float]:
        return [stage.step_time(batch) for stage in self.stages]

    def transfer_time(self, num_tokens: int) -> float:
        return self.layout.transfer_time(self.model, num_tokens)

    def step_time(self, batch: BatchShape) -> float:
        if batch.num_seqs == 0:
            return 0.0
        return sum(self.stage_times(batch)) + (self.layout.pp - 1) * self.transfer_time(batch.num_new_tokens)

    def swap_time(self, num_blocks: int, block_bytes: int) -> float:
        return self.stages[0].swap_time(num_blocks, block_bytes)
