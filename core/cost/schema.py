"""The cost-model file's schema (`realexec profile` writes it, `sim calibrate` adds its
sections, `--cost-model` reads it): msgspec Structs instead of hand-written checks.

A bad file is refused with what is wrong and where, as a field path:
`p.json: Expected `float` >= 0.0 - at `$.parts.execute.decode.coef[0]``. Checks that
need the fit's vocabulary (feature names, served bucket keys) stay in
`core.cost.fit.check_model`, on the decoded Structs.

Unknown fields are allowed (held-out errors, fitted rows and reports ride along).
"""
from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

NonNegative = Annotated[float, msgspec.Meta(ge=0)]      # NaN fails a bound too
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
Correlation = Annotated[float, msgspec.Meta(ge=0, lt=1)]
TokenCount = Annotated[int, msgspec.Meta(ge=1)]


def _finite(name: str, *values: float) -> None:
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be finite, got {list(values) if len(values) > 1 else values[0]}")


def _finite_items(name: str, values) -> None:
    for i, v in enumerate(values):
        _finite(f"{name}[{i}]", v)


class PartModel(msgspec.Struct):
    """One part (execute or overhead) of one phase: a linear model of the batch's sums
    (`features`, `coef`: non-negative), with bumps `k:<tokens>` at interior knots (either
    sign: a table of corrections at the profiled token counts)."""
    features: list[str]
    coef: list[float]
    knots: list[TokenCount] = []

    def __post_init__(self) -> None:
        _finite_items("coef", self.coef)
        for i, (f, c) in enumerate(zip(self.features, self.coef)):
            if c < 0 and not f.startswith("k:"):
                raise ValueError(f"coef[{i}] ({f}) must be >= 0, got {c!r} (only the k:<tokens> bumps may be negative)")
        if any(a >= b for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError(f"knots must be increasing token counts >= 1, got {self.knots}")
        if len(self.features) != len(self.coef):
            raise ValueError(f"features and coef must be equal-length lists, got {len(self.features)} features "
                             f"and {len(self.coef)} coefficients")


class Phases(msgspec.Struct):
    prefill: PartModel
    decode: PartModel


class Parts(msgspec.Struct):
    execute: Phases
    overhead: Phases


class Swap(msgspec.Struct):
    """Seconds of one swap copy: coef = (fixed, per block) at `block_bytes` per block."""
    coef: tuple[NonNegative, NonNegative]
    block_bytes: Annotated[int, msgspec.Meta(gt=0)]

    def __post_init__(self) -> None:
        _finite_items("coef", self.coef)


class Served(msgspec.Struct):
    """`sim calibrate`: the served/profiled step-time ratio per phase (or phase:bucket)."""
    factors: dict[str, float]

    def __post_init__(self) -> None:
        for key, f in self.factors.items():        # here, to name the key (a path would say [...])
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"factor {key!r} must be finite and > 0, got {f!r}")


class Client(msgspec.Struct):
    """Seconds a client sees its first / last token after the engine produced it, and
    (intake_s) after reaching the server a request reaches the engine."""
    first_token_s: float
    last_token_s: float
    intake_s: NonNegative = 0.0

    def __post_init__(self) -> None:
        _finite("first_token_s and last_token_s", self.first_token_s, self.last_token_s)


class Wake(msgspec.Struct):
    """The first steps after the engine sat idle: one factor per place (core.cost.fit.fit_wake)."""
    factors: list[float]
    n: list[int] | None = None

    def __post_init__(self) -> None:
        for i, f in enumerate(self.factors):        # here, to name the place
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"wake factor {i + 1} must be finite and > 0, got {f!r}")


class Jitter(msgspec.Struct):
    """Step-to-step spread of served steps around the model (core.cost.fit.StepJitter)."""
    sigma: NonNegative
    phi: Correlation
    slow_share: Fraction = 0.0
    slow_phi: Correlation = 0.0
    run_sigma: NonNegative = 0.0                    # reported, not drawn

    def __post_init__(self) -> None:
        _finite("sigma and run_sigma", self.sigma, self.run_sigma)


class Engine(msgspec.Struct):
    """The engine configuration the profile was measured on (the field names SimConfig and
    EngineArgs share); None or absent: not recorded."""
    num_gpu_blocks: TokenCount | None = None
    block_size: TokenCount | None = None
    max_model_len: TokenCount | None = None
    max_num_seqs: TokenCount | None = None
    max_num_batched_tokens: TokenCount | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    watermark: Fraction | None = None
    swap_space: NonNegative | None = None
    queue_policy: str | None = None
    preemption_mode: str | None = None
    victim_policy: str | None = None
    eviction_policy: str | None = None


# The engine section's keys before sim and realexec shared vLLM's names (files written then).
OLD_ENGINE_KEYS = {"swap_space_gib": "swap_space", "queue": "queue_policy", "preemption": "preemption_mode",
                   "victim": "victim_policy", "eviction": "eviction_policy"}


class CostModelFile(msgspec.Struct):
    """A `twinserve-step-cost` file (format and version are checked first, with their own
    message, by `core.cost.fit.check_model`)."""
    format: str
    version: int
    parts: Parts
    swap: Swap | None = None
    served: Served | None = None
    client: Client | None = None
    jitter: Jitter | None = None
    wake: Wake | None = None
    engine: Engine | None = None


def decode(model: Any, where: str, schema: type = CostModelFile, path: str = "") -> Any:
    """`model` (decoded JSON) as `schema`; ValueError '<where>: <what> - at `$.<path>`'."""
    if schema is CostModelFile and isinstance(model, dict) and isinstance(model.get("engine"), dict):
        model = {**model, "engine": engine_with_new_keys(model["engine"])}
    try:
        return msgspec.convert(model, schema, strict=True)
    except msgspec.ValidationError as e:
        text = str(e)
        if path:             # a section decoded alone: its paths start at the section
            text = text.replace("at `$", f"at `${path}") if " - at `$" in text else f"{text} - at `${path}`"
        raise ValueError(f"{where}: {text}") from None


def engine_with_new_keys(engine: dict) -> dict:
    """An engine section with the old key names (swap_space_gib, queue, ...) renamed."""
    return {OLD_ENGINE_KEYS.get(k, k): v for k, v in engine.items()}


def engine_settings(model: Any, where: str) -> dict[str, Any]:
    """The engine section's recorded settings, checked, by field name ({} without one)."""
    engine = model.get("engine") if isinstance(model, dict) else None
    if engine is None:
        return {}
    if isinstance(engine, dict):
        engine = engine_with_new_keys(engine)
    section = decode(engine, where, Engine, path=".engine")
    return {f: getattr(section, f) for f in section.__struct_fields__ if getattr(section, f) is not None}
