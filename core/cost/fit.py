"""Fitted step-cost models: the math both `realexec profile` (which fits) and the
simulator (which evaluates) use, on plain JSON. Pure Python: no numpy, no torch.

A step is described by four sums over its scheduled slices (new tokens n_i after c_i
cached ones): seqs, tokens = sum n_i, context = sum c_i, pairs = sum n_i*c_i + n_i(n_i+1)/2
(causal query-key pairs). Its time is split in two parts, fitted separately:
  * "execute": inside the executor (input preparation, forward, sampling, RPC);
  * "overhead": the rest of the engine step (scheduling, update, detokenization).
Each part has one linear model per phase ("prefill": any slice longer than one token,
mixed batches included; "decode": one token per sequence), on a family of features
chosen by held-out error (k-fold cross-validation of the relative error): the fewest
features that reach near the best error win, so a term is kept only if it predicts.
The richest family adds a table over the token count (bumps on the profiled counts,
TABLE_FAMILY), still linear in its coefficients.

A served calibration (`fit_served_scale`, section "served") scales the whole step by a
measured served/profiled ratio per phase (or phase and batch-size or prefill-size
bucket); a "client" section holds the delays a streaming client adds to the first and
last token; a "jitter" section (`fit_step_jitter`) how served steps scatter around their
calibrated prediction within a run, for a twin that reproduces that spread
(`StepJitter`); a "wake" section (`fit_served_and_wake`) what the first steps after the
engine sat idle cost on top.

Coefficients are fitted by relative-error least squares (weights 1/y^2: a 2 ms decode
step counts as much as a 200 ms prefill) and the linear terms kept non-negative (more
context never makes a step faster): a non-negative least squares fit (`fit_nonneg`,
Lawson-Hanson), in which the table's bumps alone may take either sign (`fit_family`).
"""
from __future__ import annotations

import math
import operator
import random
from bisect import bisect_right
from typing import Iterable, NamedTuple, Sequence

from core.cost import schema
from core.metrics import percentile

FORMAT = "twinserve-step-cost"
VERSION = 2
READABLE_VERSIONS = (1, 2)         # version 1: linear families only
PHASES = ("prefill", "decode")
PARTS = ("execute", "overhead")
FEATURES = ("one", "seqs", "tokens", "context", "pairs")
# Candidate families, simplest first (each a tuple of FEATURES names).
FAMILIES: dict[str, tuple[str, ...]] = {
    "const": ("one",),
    "tokens": ("one", "tokens"),
    "tokens+seqs": ("one", "tokens", "seqs"),
    "tokens+seqs+context": ("one", "tokens", "seqs", "context"),
    "tokens+seqs+pairs": ("one", "tokens", "seqs", "pairs"),
    "full": ("one", "tokens", "seqs", "context", "pairs"),
}
# The richest family: "full" plus a bump at each interior token count of the profiled grid
# (a hat function: 1 at that count, 0 at its neighbours; see `hat`), of either sign. On CPU
# the dense layers' cost is not linear, nor even monotone, in the rows they multiply (the
# matmul library picks its kernel by the row count): SmolLM2 fp32 in our engine, a 2- or
# 3-sequence decode step costs 1.6-2x a 1-sequence one and a 4-sequence step less than a
# 3-sequence one; in vLLM's CPU backend, a 3- to 6-sequence decode step costs ~15% less
# than a 1-sequence one. The bumps model that; outside the grid the model is the line.
TABLE_FAMILY = "full+tokens-table"
MAX_KNOTS = 24
# A simpler family wins unless a richer one cuts the held-out error by more than this
# fraction of it (guards against chasing noise with extra terms).
SIMPLER_TOLERANCE = 0.02


def phase_of(seqs: int, tokens: int) -> str:
    """'prefill' when some slice has more than one token (tokens > seqs), else 'decode'."""
    return "prefill" if tokens > seqs else "decode"


def feature_values(seqs: int, tokens: int, context: int, pairs: int, knots: Sequence[int] = ()) -> dict[str, float]:
    """The linear features, and with `knots` a hat feature "k:<t>" per interior knot t."""
    v = {"one": 1.0, "seqs": float(seqs), "tokens": float(tokens), "context": float(context), "pairs": float(pairs)}
    for i in range(1, len(knots) - 1):
        v[f"k:{knots[i]}"] = hat(knots, i, tokens)
    return v


def hat(knots: Sequence[int], i: int, tokens: float) -> float:
    """Piecewise-linear bump of interior knot i: 1 at knots[i], falling to 0 at knots[i-1]
    and knots[i+1], 0 outside."""
    lo, mid, hi = knots[i - 1], knots[i], knots[i + 1]
    if tokens <= lo or tokens >= hi:
        return 0.0
    return (tokens - lo) / (mid - lo) if tokens <= mid else (hi - tokens) / (hi - mid)


def table_knots(token_counts: Iterable[int]) -> list[int]:
    """The token counts the bumps sit on: the grid's distinct counts (at most MAX_KNOTS,
    spread over them)."""
    values = sorted(set(int(t) for t in token_counts))
    if len(values) <= MAX_KNOTS:
        return values
    return [values[j] for j in sorted({round(i * (len(values) - 1) / (MAX_KNOTS - 1)) for i in range(MAX_KNOTS)})]


def families(knots: Sequence[int]) -> dict[str, tuple[str, ...]]:
    """The candidate families, simplest first; the table family when there are interior knots."""
    fams = dict(FAMILIES)
    if len(knots) > 2:
        fams[TABLE_FAMILY] = FAMILIES["full"] + tuple(f"k:{t}" for t in knots[1:-1])
    return fams


def shape_of(starts: Sequence[int], num_tokens: Sequence[int]) -> tuple[int, int, int, int]:
    """(seqs, tokens, context, pairs) of a batch given per slice its start and length."""
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(num_tokens, starts))
    return len(starts), sum(num_tokens), sum(starts), pairs


# -- least squares --------------------------------------------------------------------------
_EPS = 2.220446049250313e-16     # float64 machine epsilon
# A column whose part outside the span of the columns already in the fit is below this
# fraction of its norm is (numerically) a combination of them and stays at 0: decode steps
# have seqs == tokens and pairs == context + seqs exactly.
_DEPENDENT = 1e-10


def _dot(u: Sequence[float], v: Sequence[float]) -> float:
    return sum(map(operator.mul, u, v))


def _householder(cols: list[list[float]], rhs: list[float]) -> int:
    """In place, Householder QR of the matrix whose columns are `cols` (each n long),
    applied to `rhs` too: afterwards the first p = min(n, len(cols)) entries of each
    column are R's column (zeros below the diagonal) and of `rhs` are Q^T rhs's. Returns p."""
    n = len(rhs)
    p = min(n, len(cols))
    for j in range(p):
        v = cols[j][j:]
        alpha = math.sqrt(_dot(v, v))
        if alpha == 0.0:                       # already zero below the diagonal
            continue
        beta = -alpha if v[0] >= 0 else alpha  # the sign that avoids cancellation in v[0]
        v[0] -= beta
        vv = _dot(v, v)
        for other in cols[j + 1:] + [rhs]:
            seg = other[j:]
            f = 2.0 * _dot(v, seg) / vv
            if f:
                other[j:] = [s - f * vi for s, vi in zip(seg, v)]
        cols[j][j:] = [beta] + [0.0] * (n - j - 1)
    return p


def _least_squares(cols: Sequence[Sequence[float]], rhs: Sequence[float],
                   norms: Sequence[float]) -> list[float] | None:
    """argmin_z ||sum_i z_i cols[i] - rhs|| for a few short columns; None when a column is
    (numerically) a combination of the ones before it (norms: each column's norm)."""
    work = [list(c) for c in cols]
    q = list(rhs)
    p = _householder(work, q)
    m = len(work)
    if p < m or any(abs(work[i][i]) <= _DEPENDENT * norms[i] for i in range(m)):
        return None
    z = [0.0] * m
    for i in range(m - 1, -1, -1):
        z[i] = (q[i] - sum(work[k][i] * z[k] for k in range(i + 1, m))) / work[i][i]
    return z


def fit_nonneg(rows: Sequence[Sequence[float]], y: Sequence[float], signed: Iterable[int] = ()) -> list[float]:
    """Non-negative coefficients b minimising sum(((y - x.b) / y)^2): the non-negative least
    squares solution (Lawson & Hanson's active-set algorithm, "Solving Least Squares
    Problems", 1974, ch. 23), in pure Python for the core's few features. A column that is
    all zeros, or a combination of the columns in the fit, gets coefficient 0. The columns
    in `signed` may take either sign (each enters as itself and its negation, b = b+ - b-).

    The weighted problem (rows / y against ones, columns scaled to unit max) is reduced by
    one Householder QR to its k x k triangle, on which the active-set steps run, so a step
    costs k^3, not n k^2, and the fit keeps QR's accuracy (no normal equations)."""
    if not rows:
        raise ValueError("no samples to fit")
    if len(rows) != len(y):
        raise ValueError(f"fit_nonneg: {len(rows)} rows but {len(y)} step times")
    k = len(rows[0])
    signed = sorted(set(signed))
    if any(not 0 <= j < k for j in signed):
        raise ValueError(f"fit_nonneg: signed columns {signed} out of range for {k} features")
    for i, (r, t) in enumerate(zip(rows, y)):
        if len(r) != k:
            raise ValueError(f"fit_nonneg: row {i} has {len(r)} features, row 0 has {k}")
        if not all(map(math.isfinite, r)):
            raise ValueError(f"fit_nonneg: row {i} has a non-finite feature: {list(r)}")
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"step times must be > 0 to fit (and finite): sample {i} has {t!r}")
    # weighted columns, scaled to unit max (all-zero ones left out); a signed column's
    # negation goes last (with sign -1), so QR meets it after the column itself
    cols, scale, live = [], [], []
    for j, sign in [(j, 1.0) for j in range(k)] + [(j, -1.0) for j in signed]:
        c = [sign * r[j] / t for r, t in zip(rows, y)]
        s = max(map(abs, c))
        if not math.isfinite(s):
            raise ValueError(f"fit_nonneg: feature {j} divided by its step time overflows (max {s})")
        if s > 0:
            cols.append([v / s for v in c])
            scale.append(sign * s)
            live.append(j)
    coef = [0.0] * k
    if not cols:
        return coef
    rhs = [1.0] * len(y)
    p = _householder(cols, rhs)
    # ||A x - 1||^2 == ||R x - d||^2 + (the part of 1 outside A's range): fit the triangle
    x = _nnls([c[:p] for c in cols], rhs[:p])
    for i, j in enumerate(live):
        coef[j] += x[i] / scale[i]          # a signed column's two parts add up
    return coef


def _nnls(cols: list[list[float]], d: list[float]) -> list[float]:
    """Lawson-Hanson: argmin ||sum_j x_j cols[j] - d|| over x >= 0 (cols: m columns, p long)."""
    m = len(cols)
    norms = [math.sqrt(_dot(c, c)) for c in cols]
    dnorm = math.sqrt(_dot(d, d))
    x = [0.0] * m
    passive: list[int] = []              # the free columns, in the order they entered
    refused: set[int] = set()            # columns that cannot enter until the passive set changes
    max_steps = 10 * (m + 10)
    steps = 0
    while True:
        r = list(d)
        for j in passive:
            xj = x[j]
            r = [ri - xj * cj for ri, cj in zip(r, cols[j])]
        # a gradient entry this small is rounding (|error| <~ m eps |col| (|d| + sum |col_i| x_i))
        slack = 16 * max(m, len(d)) * _EPS * (dnorm + sum(norms[j] * x[j] for j in passive))
        best, best_w = -1, 0.0
        for j in range(m):
            if norms[j] and j not in refused and j not in passive:
                w = _dot(cols[j], r)
                if w > slack * norms[j] and w > best_w:
                    best, best_w = j, w
        if best < 0:
            return x
        trial = passive + [best]
        z = _least_squares([cols[j] for j in trial], d, [norms[j] for j in trial])
        if z is None or z[-1] <= 0:          # dependent on the passive columns, or rounding
            refused.add(best)
            continue
        passive, refused = trial, set()
        while True:
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"fit_nonneg: the active-set iteration did not converge in {max_steps} "
                                   f"steps ({m} features)")
            if min(z) > 0:
                break
            # step from x towards z until the first passive coefficient reaches 0; drop it
            alpha, first = min((x[j] / (x[j] - zj) if x[j] > zj else 0.0, j)
                               for j, zj in zip(passive, z) if zj <= 0)
            for j, zj in zip(passive, z):
                x[j] = max(0.0, x[j] + alpha * (zj - x[j]))
            x[first] = 0.0
            passive = [j for j in passive if x[j] > 0]
            if not passive:
                z = []
                break
            z = _least_squares([cols[j] for j in passive], d, [norms[j] for j in passive])
            if z is None:                     # cannot happen: a subset of independent columns
                raise RuntimeError("fit_nonneg: lost the rank of the passive columns")
        x = [0.0] * m
        for j, zj in zip(passive, z):
            x[j] = zj


def fit_family(rows: Sequence[dict[str, float]], y: Sequence[float], features: Sequence[str]) -> list[float]:
    """Coefficients of `features` on feature rows: the linear terms non-negative, the
    table's bumps (k:<tokens>) of either sign, a fit with a bump pulling some sample's
    prediction to <= 0 refitted with non-negative bumps (a step never costs nothing)."""
    x = [[r[f] for f in features] for r in rows]
    signed = [i for i, f in enumerate(features) if f.startswith("k:")]
    coef = fit_nonneg(x, y, signed)
    if signed and any(predict_linear(features, coef, r) <= 0 for r in rows):
        coef = fit_nonneg(x, y)
    return coef


def predict_linear(features: Sequence[str], coef: Sequence[float], values: dict[str, float]) -> float:
    return sum(c * values[f] for f, c in zip(features, coef))


def relative_errors(pred: Iterable[float], y: Iterable[float]) -> list[float]:
    return [abs(p - t) / t for p, t in zip(pred, y)]


def summarize_errors(errs: Sequence[float]) -> dict[str, float]:
    if not errs:
        return {"n": 0, "mean": float("nan"), "median": float("nan"), "p90": float("nan")}
    s = sorted(errs)
    return {"n": len(s), "mean": sum(s) / len(s), "median": percentile(s, 50), "p90": percentile(s, 90)}


def _splits(n: int, k: int, seed: int):
    """(train, held) index lists of k-fold cross-validation over n samples (2 <= k <= n),
    in a seeded random order; folds that would leave nothing to train on are skipped."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = max(2, min(k, n))
    for held in (order[i::k] for i in range(k)):
        held_set = set(held)
        train = [i for i in range(n) if i not in held_set]
        if train:
            yield train, held


def cross_validate(rows: list[dict[str, float]], y: list[float], features: Sequence[str],
                   k: int = 5, seed: int = 0) -> list[float]:
    """Held-out relative error of every sample: each fold is predicted by a fit on the others."""
    errs: list[float] = []
    for train, held in _splits(len(rows), k, seed):
        coef = fit_family([rows[i] for i in train], [y[i] for i in train], features)
        errs += relative_errors([max(0.0, predict_linear(features, coef, rows[i])) for i in held],
                                [y[i] for i in held])
    return errs


def choose_family(rows: list[dict[str, float]], y: list[float], k: int = 5, seed: int = 0,
                  candidates: dict[str, tuple[str, ...]] | None = None) -> tuple[str, dict[str, dict[str, float]]]:
    """The family to use and every family's held-out error summary (candidates: FAMILIES)."""
    candidates = FAMILIES if candidates is None else candidates
    report = {name: summarize_errors(cross_validate(rows, y, feats, k, seed)) for name, feats in candidates.items()}
    best = min(report[name]["mean"] for name in candidates)
    for name in candidates:                  # simplest first
        if report[name]["mean"] <= best * (1 + SIMPLER_TOLERANCE) + 1e-12:
            return name, report
    raise AssertionError("unreachable")


# -- the model file -------------------------------------------------------------------------
def fit_step_cost(samples: Sequence[dict], k: int = 5, seed: int = 0) -> dict:
    """Fit a step-cost model from profiled samples; each sample has seqs, tokens, context,
    pairs and per part a time in seconds (`execute_s`, `overhead_s`). Returns the JSON-ready
    model: per part and phase the chosen family, its coefficients and every family's
    held-out error, plus the held-out error of the whole step time."""
    model: dict = {"format": FORMAT, "version": VERSION, "features": list(FEATURES), "parts": {}}
    for part in PARTS:
        model["parts"][part] = {}
        for phase in PHASES:
            chosen = [s for s in samples if phase_of(s["seqs"], s["tokens"]) == phase]
            if not chosen:
                continue
            knots = table_knots(s["tokens"] for s in chosen)
            rows = [feature_values(s["seqs"], s["tokens"], s["context"], s["pairs"], knots) for s in chosen]
            y = [max(s[f"{part}_s"], 1e-9) for s in chosen]
            candidates = families(knots)
            family, report = choose_family(rows, y, k, seed, candidates)
            feats = candidates[family]
            coef = fit_family(rows, y, feats)
            entry = {"family": family, "features": list(feats), "coef": coef, "held_out": report}
            if family == TABLE_FAMILY:
                entry["knots"] = knots
            model["parts"][part][phase] = entry
    model["held_out_step"] = held_out_step_error(samples, model, k, seed)
    model["repeat_noise"] = repeat_noise(samples)
    return model


def held_out_step_error(samples: Sequence[dict], model: dict, k: int = 5, seed: int = 0) -> dict:
    """Held-out relative error of the whole step (execute + overhead), per phase, with each
    part's chosen family refitted on the other folds."""
    out = {}
    for phase in PHASES:
        chosen = [s for s in samples if phase_of(s["seqs"], s["tokens"]) == phase]
        if not chosen:
            continue
        knots = table_knots(s["tokens"] for s in chosen)
        rows = [feature_values(s["seqs"], s["tokens"], s["context"], s["pairs"], knots) for s in chosen]
        errs: list[float] = []
        for train, held in _splits(len(chosen), k, seed):
            pred = [0.0] * len(held)
            for part in PARTS:
                feats = model["parts"][part][phase]["features"]
                coef = fit_family([rows[i] for i in train], [max(chosen[i][f"{part}_s"], 1e-9) for i in train],
                                  feats)
                for j, i in enumerate(held):
                    pred[j] += max(0.0, predict_linear(feats, coef, rows[i]))
            errs += relative_errors(pred, [chosen[i]["execute_s"] + chosen[i]["overhead_s"] for i in held])
        out[phase] = summarize_errors(errs)
    return out


def repeat_noise(samples: Sequence[dict]) -> dict:
    """The error floor the machine sets: per phase, the relative error of predicting each
    step's time by the mean of the other steps of exactly the same shape (repeats). A
    model of the shape alone cannot beat it on average; compare it with `held_out_step`."""
    groups: dict[tuple, list[float]] = {}
    for s in samples:
        key = (s["seqs"], s["tokens"], s["context"], s["pairs"])
        groups.setdefault(key, []).append(s["execute_s"] + s["overhead_s"])
    errs: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for (seqs, tokens, _, _), times in groups.items():
        if len(times) < 2:
            continue
        total = sum(times)
        for t in times:
            errs[phase_of(seqs, tokens)].append(abs((total - t) / (len(times) - 1) - t) / t)
    return {phase: summarize_errors(e) for phase, e in errs.items() if e}


def fit_swap_cost(samples: Sequence[dict], block_bytes: int, k: int = 5, seed: int = 0) -> dict:
    """Seconds of one swap copy (either way) of n KV blocks: a + b*n, from samples with
    `blocks` and `seconds`; with its held-out error and the block size it was timed at."""
    rows = [{"one": 1.0, "blocks": float(s["blocks"])} for s in samples]
    y = [max(s["seconds"], 1e-9) for s in samples]
    coef = fit_nonneg([[r["one"], r["blocks"]] for r in rows], y)
    return {"features": ["one", "blocks"], "coef": coef, "block_bytes": int(block_bytes),
            "held_out": summarize_errors(cross_validate(rows, y, ("one", "blocks"), k, seed)),
            "samples": list(samples)}


def swap_seconds(swap: dict, num_blocks: int, block_bytes: int) -> float:
    """A fitted swap cost at another block size: the per-block term scales with the bytes."""
    if num_blocks <= 0:
        return 0.0
    a, b = swap["coef"]
    return a + b * num_blocks * block_bytes / swap["block_bytes"]


def scaled_model(model: dict, factor: float) -> dict:
    """A copy of `model` whose every step takes `factor` times as long (e.g. a machine where
    the engine gets 1/factor of a core); the raw samples are left out."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"a cost model's time scale must be finite and > 0, got {factor}")
    out = {k: v for k, v in model.items() if k not in ("parts", "samples")}
    out["parts"] = {part: {phase: dict(entry, coef=[c * factor for c in entry["coef"]])
                           for phase, entry in phases.items()} for part, phases in model["parts"].items()}
    if "swap" in model:
        out["swap"] = dict(model["swap"], coef=[c * factor for c in model["swap"]["coef"]])
    out["profile"] = dict(model.get("profile", {}), time_scale=factor * model.get("profile", {}).get("time_scale", 1.0))
    return out


# -- served calibration ---------------------------------------------------------------------
# The grid's steps run back to back on an otherwise idle engine; served steps (HTTP and
# streaming on the other core, shapes changing every step, decode batches of mixed context
# lengths) cost more CPU for the same batch sums (SmolLM2 on CPU: 1.1-1.4x, most for small
# batches and prefills). A served calibration measures that ratio on logged served steps
# and scales the grid model by it: per phase, or per phase and bucket, the family chosen
# by held-out error like the step model's. Buckets: by batch size ("phase+batch"), or by
# the step's new tokens ("phase+size": prefill steps by their tokens, so a 438-token
# prefill is scaled by what big prefills cost served, not by what the small prefills of
# its batch size cost; decode steps by their tokens, which are their sequences).
SERVED_FAMILIES = ("none", "phase", "phase+batch", "phase+size")
BATCH_BUCKETS = (1, 4, 8, 16)            # upper bounds of the batch-size buckets; one more above
# Upper bounds of the prefill-size buckets (new tokens in the step); one more above. From
# served runs of SmolLM2 (sessions twin_quiet3/D, E): short prompts and chunks (<= 64),
# middling prompts, and the few hundred-token prompts `serve` prefills in one step, whose
# cost grows faster than the profile's line (1.08-1.47x served, run to run).
PREFILL_TOKEN_BUCKETS = (64, 256)
MIN_BUCKET_STEPS = 5                     # a bucket with fewer calibration steps uses its phase's factor


class ServedStep(NamedTuple):
    """One logged served step as calibration sees it: its phase and size, the grid model's
    seconds for its shape and the seconds it took."""
    phase: str
    seqs: int
    tokens: int
    predicted: float
    measured: float
    wake: int = 0           # its place after the engine sat idle (1: the first step; 0: not known)


def batch_bucket(seqs: int) -> str:
    """The batch-size bucket of a step with `seqs` sequences, as a key ("<=4", ">16")."""
    for hi in BATCH_BUCKETS:
        if seqs <= hi:
            return f"<={hi}"
    return f">{BATCH_BUCKETS[-1]}"


def prefill_size_bucket(tokens: int) -> str:
    """The size bucket of a prefill step with `tokens` new tokens ("tokens<=64", "tokens>256")."""
    for hi in PREFILL_TOKEN_BUCKETS:
        if tokens <= hi:
            return f"tokens<={hi}"
    return f"tokens>{PREFILL_TOKEN_BUCKETS[-1]}"


def served_key(family: str, phase: str, seqs: int, tokens: int) -> str | None:
    """A step's bucket key under `family` ("<phase>:<bucket>"); None for the per-phase families."""
    if family == "phase+batch" or (family == "phase+size" and phase == "decode"):
        return f"{phase}:{batch_bucket(seqs)}"          # a decode step's tokens are its sequences
    if family == "phase+size":
        return f"{phase}:{prefill_size_bucket(tokens)}"
    return None


def _stratum(phase: str, seqs: int, tokens: int) -> str:
    """The finest cell both bucketings split steps into: the per-stratum held-out error
    judges every family on the same cells."""
    key = f"{phase}:{batch_bucket(seqs)}"
    return key + (f":{prefill_size_bucket(tokens)}" if phase == "prefill" else "")


def served_factors(rows: Sequence[ServedStep], family: str) -> dict[str, float]:
    """Scale factors from calibration rows: per key, measured over predicted seconds summed
    (so the factor keeps the total time right, which is what a simulated clock
    accumulates). Keys: "<phase>" and, for the bucketed families, "<phase>:<bucket>" for
    buckets with at least MIN_BUCKET_STEPS steps."""
    if family not in SERVED_FAMILIES:
        raise ValueError(f"served calibration family must be one of {SERVED_FAMILIES}, got {family!r}")
    if family == "none":
        return {}
    sums: dict[str, list[float]] = {}
    for phase, seqs, tokens, predicted, measured, *_ in rows:
        bucket = served_key(family, phase, seqs, tokens)
        for key in [phase] + ([bucket] if bucket else []):
            acc = sums.setdefault(key, [0.0, 0.0, 0])
            acc[0] += predicted
            acc[1] += measured
            acc[2] += 1
    return {key: m / p for key, (p, m, n) in sums.items()
            if p > 0 and (":" not in key or n >= MIN_BUCKET_STEPS)}


def served_factor(factors: dict[str, float], phase: str, seqs: int, tokens: int) -> float:
    """The factor a step gets: its prefill-size bucket's, else its batch bucket's, else its
    phase's, else 1 (a fitted set holds one family's keys)."""
    if phase == "prefill":
        sized = factors.get(f"prefill:{prefill_size_bucket(tokens)}")
        if sized is not None:
            return sized
    return factors.get(f"{phase}:{batch_bucket(seqs)}", factors.get(phase, 1.0))


def fit_served_scale(rows: Sequence[Sequence], k: int = 5, seed: int = 0) -> dict:
    """Choose and fit the served scale from calibration rows (ServedStep: phase, seqs,
    tokens, predicted s by the grid model, measured s on the served engine). Per family,
    k-fold held-out: the relative error of each held-out fold's total time (`total`: how
    well the steps' mix is priced), of all held-out predictions' sum (`pooled`: the bias a
    simulated clock accumulates over the whole run; a few long steps make single folds
    noisy, which can hide a bias every fold shares), of each held-out fold's totals per
    stratum (`strata`: per phase, batch-size bucket and, for prefills, size bucket the
    predicted minus the measured seconds, their absolute values summed over the fold's
    measured seconds: what a run with another mix of batch sizes or prompt lengths would
    see; one factor per phase prices the calibration runs' mix right but can misprice a
    scenario of mostly 1-sequence decodes) and of single steps (`step`). The simplest
    family within SIMPLER_TOLERANCE (relative) or half a percentage point of the best
    pooled error, and among those of the best per-stratum error, wins (else the simplest
    near the best pooled error)."""
    rows = [ServedStep(*r) for r in rows]
    if len(rows) < 2:
        raise ValueError(f"served calibration needs at least 2 logged steps, got {len(rows)}")
    report = {}
    for family in SERVED_FAMILIES:
        totals, strata, steps = [], [], []
        pooled_pred = pooled_meas = 0.0
        for train, held in _splits(len(rows), k, seed):
            factors = served_factors([rows[i] for i in train], family)
            pred = [rows[i].predicted * served_factor(factors, rows[i].phase, rows[i].seqs, rows[i].tokens)
                    for i in held]
            meas = [rows[i].measured for i in held]
            totals.append(abs(sum(pred) - sum(meas)) / sum(meas))
            by_stratum: dict[str, float] = {}
            for i, p, m in zip(held, pred, meas):
                key = _stratum(rows[i].phase, rows[i].seqs, rows[i].tokens)
                by_stratum[key] = by_stratum.get(key, 0.0) + p - m
            strata.append(sum(abs(d) for d in by_stratum.values()) / sum(meas))
            steps += relative_errors(pred, meas)
            pooled_pred += sum(pred)
            pooled_meas += sum(meas)
        report[family] = {"total": summarize_errors(totals), "pooled": abs(pooled_pred - pooled_meas) / pooled_meas,
                          "strata": summarize_errors(strata), "step": summarize_errors(steps)}

    def near(value: float, best: float) -> bool:
        return value <= max(best * (1 + SIMPLER_TOLERANCE), best + 0.005)

    best_pooled = min(r["pooled"] for r in report.values())
    best_strata = min(r["strata"]["mean"] for r in report.values())
    good = [f for f in SERVED_FAMILIES if near(report[f]["pooled"], best_pooled)]
    family = next((f for f in good if near(report[f]["strata"]["mean"], best_strata)), good[0])
    return {"family": family, "factors": served_factors(rows, family), "held_out": report, "n": len(rows)}


# -- waking from idle ----------------------------------------------------------------------
# A served engine's first steps after it sat idle cost more than the same shapes in the
# middle of a busy stretch (the first one: vLLM's CPU backend under a light load +2-7%,
# ours +2-3%; the steps after it within their noise: caches and the other core's front
# end have moved on meanwhile). Under a light load it is the prefill of a request that
# found the engine idle, so a model without it prices that request's TTFT low. The "wake"
# section holds one factor per place after idle (1..WAKE_STEPS), fitted on the calibration
# runs on top of the served factors, which are then fitted on the other steps.
WAKE_STEPS = 4
MIN_WAKE_STEPS = 5                       # fewer steps at a place: its factor stays 1


def is_wake_step(row: ServedStep, steps: int = WAKE_STEPS) -> bool:
    return 1 <= row.wake <= steps


def fit_wake(rows: Sequence[Sequence], factors: dict[str, float], steps: int = WAKE_STEPS) -> dict:
    """The wake section: per place j = 1..steps after the engine sat idle, the logged over
    the served-calibrated seconds summed over the calibration rows at that place (1 where
    fewer than MIN_WAKE_STEPS rows are), and how many rows each rests on."""
    sums = [[0.0, 0.0, 0] for _ in range(steps)]
    for row in (ServedStep(*r) for r in rows):
        if is_wake_step(row, steps) and row.predicted > 0:
            acc = sums[row.wake - 1]
            acc[0] += row.predicted * served_factor(factors, row.phase, row.seqs, row.tokens)
            acc[1] += row.measured
            acc[2] += 1
    return {"factors": [m / p if n >= MIN_WAKE_STEPS and p > 0 else 1.0 for p, m, n in sums],
            "n": [n for _, _, n in sums]}


def fit_served_and_wake(rows: Sequence[Sequence], k: int = 5, steps: int = WAKE_STEPS) -> tuple[dict, dict]:
    """(served section, wake section) from calibration rows: the served factors fitted on
    the steps a wake factor does not price (places after idle with fewer than
    MIN_WAKE_STEPS rows stay in, and so does every row of a phase that has no other: with
    no busy prefill, the prefill factor is the one after idle), the wake factors on top."""
    rows = [ServedStep(*r) for r in rows]
    counts = [0] * (steps + 1)
    for r in rows:
        if is_wake_step(r, steps):
            counts[r.wake] += 1
    priced_apart = {j for j in range(1, steps + 1) if counts[j] >= MIN_WAKE_STEPS}
    steady_phases = {r.phase for r in rows if r.wake not in priced_apart}
    fit_rows = [r for r in rows if r.wake not in priced_apart or r.phase not in steady_phases]
    served = fit_served_scale(fit_rows if len(fit_rows) >= 2 else rows, k=k)
    return served, fit_wake(rows, served["factors"], steps)


def wake_factor(wake: Sequence[float], place: int) -> float:
    """The factor of a step at `place` after idle (1-based; 0: not known) under a wake
    section's factors: 1 past them."""
    return wake[place - 1] if 1 <= place <= len(wake) else 1.0


def calibrated_seconds(row: ServedStep, factors: dict[str, float], wake: Sequence[float] = ()) -> float:
    """A calibration row's seconds as the calibrated model prices it."""
    return row.predicted * served_factor(factors, row.phase, row.seqs, row.tokens) * wake_factor(wake, row.wake)


def wake_params(model: dict, where: str = "cost model") -> tuple[float, ...]:
    """The model's wake factors (place 1 first); () without a wake section."""
    if model.get("wake") is None:
        return ()
    return tuple(float(f) for f in schema.decode(model["wake"], where, schema.Wake, path=".wake").factors)


# -- step jitter ---------------------------------------------------------------------------
# The calibrated model prices a served step right on average, but the same shape costs
# more or less from one step to the next: the host slows for a second or two at a time
# (other jobs on the memory bus), decode batches mix context lengths. Latency statistics
# taken at a rank (median TPOT: where the lone-decode requests end and the batched ones
# begin) land on the edge of that spread, which a twin without it cannot reproduce. The
# jitter section measures it on the calibration runs: per step, the log of measured over
# calibrated seconds, each run's own mean removed (what differs between whole runs is the
# served ratio's business, not the step's). Its autocorrelation has two time scales: it
# falls fast over the first steps and then keeps a long tail (slow stretches: at 16 steps,
# about one request's decode, still 0.1-0.2 here, where one AR(1) with the lag-1
# correlation has ~0). So the fit is a sum of two AR(1) processes in the log, a fast and a
# slow one, whose covariances match the runs' out to JITTER_LAGS steps (corrected for each
# run's mean being removed, which eats most of a slow part's variance in a short run);
# `StepJitter` draws that sum, as factors averaging 1.
MIN_JITTER_STEPS = 20            # per run: a shorter run says little about correlation
JITTER_LAGS = 16                 # covariances fitted out to this lag (> one request's decode)
PHI_GRID = tuple(i / 100 for i in range(100))      # candidate lag-1 correlations of each part


def demeaned_ar1_covariances(phi: float, n: int, max_lag: int) -> list[float]:
    """For a unit-variance AR(1) with lag-1 correlation `phi` seen for `n` steps and its
    sample mean removed: the expected mean product of values k steps apart, k = 0..max_lag
    (what the same statistic of a real run's demeaned residuals estimates)."""
    # c[t] = Cov(x_t, sample mean) = (1/n) sum_u phi^|t-u|; Var(sample mean) = mean of c
    if phi == 0.0:
        c = [1.0 / n] * n
    else:
        c = [(2.0 - phi ** (t + 1) - phi ** (n - t) - (1.0 - phi)) / (1.0 - phi) / n for t in range(n)]
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)
    var_mean = prefix[n] / n
    # E[(x_t - m)(x_{t+k} - m)] = phi^k - c[t] - c[t+k] + var_mean, averaged over t < n - k
    return [phi ** k - (prefix[n - k] + prefix[n] - prefix[k]) / (n - k) + var_mean for k in range(max_lag + 1)]


def fit_two_scales(dev: Sequence[Sequence[float]]) -> tuple[float, float, float, float]:
    """(sigma, phi, slow_share, slow_phi) of the sum of two AR(1) processes (lag-1
    correlations phi <= slow_phi, the slow one holding slow_share of the variance sigma^2)
    whose demeaned covariances at lags 0..JITTER_LAGS best match (least squares, variances
    >= 0) those pooled over the runs' demeaned residuals `dev` (each at least
    JITTER_LAGS + 2 steps long). One AR(1) is the special case slow_share = 0."""
    lags = range(JITTER_LAGS + 1)
    pairs = [sum(len(d) - k for d in dev) for k in lags]
    measured = [sum(a * b for d in dev for a, b in zip(d, d[k:])) / pairs[k] for k in lags]
    expected = {}
    for phi in PHI_GRID:
        acc = [0.0] * len(pairs)
        for d in dev:
            for k, cov in enumerate(demeaned_ar1_covariances(phi, len(d), JITTER_LAGS)):
                acc[k] += (len(d) - k) * cov
        expected[phi] = [a / m for a, m in zip(acc, pairs)]

    def dot(u, v):
        return sum(a * b for a, b in zip(u, v))
    norm = {phi: dot(e, e) for phi, e in expected.items()}
    toward = {phi: dot(e, measured) for phi, e in expected.items()}
    best = (math.inf, 0.0, 0.0, 0.0, 0.0)            # (squared error, fast var, slow var, phi, slow_phi)
    for i, fast in enumerate(PHI_GRID):
        for slow in PHI_GRID[i:]:
            cross = dot(expected[fast], expected[slow])
            det = norm[fast] * norm[slow] - cross * cross
            candidates = [(max(toward[fast] / norm[fast], 0.0), 0.0)]       # one part only
            if det > 1e-12 * norm[fast] * norm[slow]:
                a = (toward[fast] * norm[slow] - toward[slow] * cross) / det
                b = (toward[slow] * norm[fast] - toward[fast] * cross) / det
                if a >= 0 and b >= 0:
                    candidates.append((a, b))
            for a, b in candidates:
                err = sum((m - a * x - b * y) ** 2 for m, x, y in zip(measured, expected[fast], expected[slow]))
                if err < best[0]:
                    best = (err, a, b, fast, slow)
    _, a, b, fast, slow = best
    if b == 0.0:
        slow = 0.0
    return math.sqrt(a + b), fast, (b / (a + b) if a + b > 0 else 0.0), slow


def fit_step_jitter(runs: Sequence[Sequence[Sequence]], factors: dict[str, float],
                    wake: Sequence[float] = ()) -> dict:
    """The jitter section from calibration runs (each a list of ServedStep rows in step
    order) and the served factors (and wake factors) fitted on them: sigma (sd of the log
    residual), phi and slow_share, slow_phi (the two time scales, `fit_two_scales`),
    run_sigma (sd across runs of each run's mean log residual: how much a whole run's host
    state moves its speed; 0 with fewer than two runs), n (steps), runs."""
    dev: list[list[float]] = []
    means: list[float] = []
    for rows in runs:
        logs = [math.log(r.measured / calibrated_seconds(r, factors, wake))
                for r in (ServedStep(*row) for row in rows) if r.predicted > 0 and r.measured > 0]
        if len(logs) >= MIN_JITTER_STEPS:
            mean = sum(logs) / len(logs)
            means.append(mean)
            dev.append([x - mean for x in logs])
    n = sum(map(len, dev))
    if not n:
        return {"sigma": 0.0, "phi": 0.0, "slow_share": 0.0, "slow_phi": 0.0, "run_sigma": 0.0, "n": 0,
                "runs": 0}
    sigma, phi, slow_share, slow_phi = fit_two_scales(dev)
    run_sigma = 0.0
    if len(means) >= 2:
        mbar = sum(means) / len(means)
        run_sigma = math.sqrt(sum((m - mbar) ** 2 for m in means) / (len(means) - 1))
    return {"sigma": sigma, "phi": phi, "slow_share": slow_share, "slow_phi": slow_phi, "run_sigma": run_sigma,
            "n": n, "runs": len(dev)}


class StepJitter:
    """Multiplicative step-time noise: the sum of two Gaussian AR(1) processes in the log,
    x_t = phi x_{t-1} + sqrt(1 - phi^2) sd e_t per part (e_t standard normal, each part
    started from its stationary law; the slow part holds slow_share of the variance
    sigma^2), factor_t = exp(x_t - sigma^2 / 2), whose mean is 1. Seeded: the same seed
    gives the same factors; with slow_share 0 the factors are one AR(1)'s. (The section's
    run_sigma, whole runs' spread, is not drawn: tried on four twin sessions' stored runs,
    a per-run factor moved the pooled queueing bias 2 points towards 0 but no session's
    error, and added about +-2% of Monte Carlo noise to a 16-draw prediction.)"""

    def __init__(self, sigma: float, phi: float, slow_share: float = 0.0, slow_phi: float = 0.0, *, seed: int):
        self._rng = random.Random(seed)
        self._parts = []                 # per part: [lag-1 correlation, innovation sd, current value]
        for share, p in ((1.0 - slow_share, phi), (slow_share, slow_phi)):
            sd = sigma * math.sqrt(share)
            if sd > 0:
                self._parts.append([p, math.sqrt(1.0 - p * p) * sd, self._rng.gauss(0.0, sd)])
        self._shift = sigma * sigma / 2

    def next(self) -> float:
        """The factor of the next step."""
        x = 0.0
        for part in self._parts:
            x += part[2]
            part[2] = part[0] * part[2] + self._rng.gauss(0.0, part[1])
        return math.exp(x - self._shift)


def check_model(model: dict, where: str = "cost model") -> None:
    """Raise ValueError naming what is wrong, and where (a field path), when `model` is not
    a usable step-cost model (schema: core.cost.schema)."""
    if not isinstance(model, dict) or model.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} file (format field is {model.get('format') if isinstance(model, dict) else None!r})")
    if model.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{where}: version {model.get('version')!r}, this build reads versions {READABLE_VERSIONS}")
    typed = schema.decode(model, where)
    for part in PARTS:
        for phase in PHASES:
            entry = getattr(getattr(typed.parts, part), phase)
            allowed = set(FEATURES) | {f"k:{t}" for t in entry.knots[1:-1]}
            unknown = [f for f in entry.features if f not in allowed]
            if unknown:
                raise ValueError(f"{where}: features {unknown} are not among {FEATURES} and the knots' k:<tokens> "
                                 f"- at `$.parts.{part}.{phase}.features`")
    if typed.served is not None:
        keys = set(PHASES) | {f"{p}:{b}" for p in PHASES for b in [f"<={h}" for h in BATCH_BUCKETS] + [f">{BATCH_BUCKETS[-1]}"]}
        keys |= {f"prefill:tokens{b}"
                 for b in [f"<={h}" for h in PREFILL_TOKEN_BUCKETS] + [f">{PREFILL_TOKEN_BUCKETS[-1]}"]}
        for key in typed.served.factors:
            if key not in keys:
                raise ValueError(f"{where}: unknown factor key {key!r} (phase, phase:<=N / phase:>N with N in "
                                 f"{BATCH_BUCKETS}, or prefill:tokens<=N / prefill:tokens>N with N in "
                                 f"{PREFILL_TOKEN_BUCKETS}) - at `$.served.factors`")


def jitter_params(model: dict, where: str = "cost model") -> tuple[float, float, float, float] | None:
    """(sigma, phi, slow_share, slow_phi) of the model's jitter section (a section without
    the slow part: one AR(1), slow_share 0); None without one. (Its run_sigma, where
    present, is reported, not drawn: see StepJitter.)"""
    if model.get("jitter") is None:
        return None
    j = schema.decode(model["jitter"], where, schema.Jitter, path=".jitter")
    return float(j.sigma), float(j.phi), float(j.slow_share), float(j.slow_phi)


def client_delays(model: dict, where: str = "cost model") -> tuple[float, float]:
    """(first, last): seconds a client sees its first / last token after the engine
    produced it, counted from when its request reached the server (HTTP in, streaming
    out; `client` section of a served calibration); (0, 0) without one."""
    if model.get("client") is None:
        return 0.0, 0.0
    c = schema.decode(model["client"], where, schema.Client, path=".client")
    return c.first_token_s, c.last_token_s


def intake_delay(model: dict, where: str = "cost model") -> float:
    """Seconds from a request reaching the server to its reaching the engine (the server's
    own work on it and the hand-off; the `client` section's intake_s); 0 without one."""
    if model.get("client") is None:
        return 0.0
    return schema.decode(model["client"], where, schema.Client, path=".client").intake_s


class StepCostEvaluator:
    """Evaluates a checked model file: seconds of one step from its four sums."""

    def __init__(self, model: dict, where: str = "cost model"):
        check_model(model, where)
        self.model = model
        # per phase: one coefficient per FEATURES entry, execute + overhead summed, and
        # each part's bumps as (knots, {interior knot index: coefficient})
        self._coef, self._bumps = {}, {}
        for phase in PHASES:
            total = dict.fromkeys(FEATURES, 0.0)
            bumps = []
            for part in PARTS:
                entry = model["parts"][part][phase]
                knots = entry.get("knots", [])
                index = {f"k:{t}": i for i, t in enumerate(knots)}
                mine = {}
                for f, c in zip(entry["features"], entry["coef"]):
                    if f in total:
                        total[f] += c
                    elif c:
                        mine[index[f]] = c
                if mine:
                    bumps.append((knots, mine))
            self._coef[phase] = tuple(total[f] for f in FEATURES)
            self._bumps[phase] = bumps
        # served calibration (absent: the grid model as profiled)
        self._served = dict(model.get("served", {}).get("factors", {}))

    def step_time(self, seqs: int, tokens: int, context: int, pairs: int) -> float:
        """Seconds of one step: the grid model, scaled by the served calibration if any."""
        t = self.grid_step_time(seqs, tokens, context, pairs)
        if self._served and seqs > 0:
            t *= served_factor(self._served, phase_of(seqs, tokens), seqs, tokens)
        return t

    def grid_step_time(self, seqs: int, tokens: int, context: int, pairs: int) -> float:
        """Seconds of one step by the profiled grid's model alone (no served calibration)."""
        if seqs <= 0:
            return 0.0
        phase = "prefill" if tokens > seqs else "decode"
        one, cs, ct, cc, cp = self._coef[phase]
        t = one + cs * seqs + ct * tokens + cc * context + cp * pairs
        for knots, coefs in self._bumps[phase]:
            if knots[0] < tokens < knots[-1]:
                j = bisect_right(knots, tokens) - 1        # knots[j] <= tokens < knots[j + 1]
                for i in (j, j + 1):
                    if i in coefs:
                        t += coefs[i] * hat(knots, i, tokens)
        return t

    def part_time(self, part: str, seqs: int, tokens: int, context: int, pairs: int) -> float:
        entry = self.model["parts"][part][phase_of(seqs, tokens)]
        values = feature_values(seqs, tokens, context, pairs, entry.get("knots", []))
        return predict_linear(entry["features"], entry["coef"], values)
