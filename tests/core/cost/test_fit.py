"""The step-cost fit's math (core.cost.fit): the non-negative least squares every fitted
coefficient comes from, checked against scipy's Lawson-Hanson on random problems shaped
like the profile's, and the two rules that keep a fit from chasing noise (a served bucket
needs MIN_BUCKET_STEPS steps; a richer family must beat a simpler one by more than
SIMPLER_TOLERANCE)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy.optimize import lsq_linear, nnls       # the dev extra's references

from core.cost.fit import (MIN_BUCKET_STEPS, SIMPLER_TOLERANCE, TABLE_FAMILY, ServedStep, StepCostEvaluator,
                           choose_family, families, feature_values, fit_family, fit_nonneg, fit_step_cost,
                           predict_linear, served_factor, served_factors, shape_of, table_knots)


# ----------------------------------------------------------------------------- problems

def _grid_shapes(phase: str) -> list[tuple[int, int, int, int]]:
    """Step shapes like the full profile grid's (realexec.twin.profile.grid): prefill chunks
    over cached context and mixed chunked-prefill steps, or decode batches over growing
    context (where seqs == tokens and pairs == context + seqs: dependent columns)."""
    steps = []
    if phase == "prefill":
        steps += [([c], [p]) for p in (16, 64, 128, 256, 512) for c in (0, 512, 1024)]
        steps += [([64 + j] * b + [0], [1] * b + [p]) for b in (4, 16) for p in (32, 512) for j in range(3)]
    else:
        steps += [([length + j] * b, [1] * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 32) for length in (32, 128, 384)
                  if b * length <= 2048 for j in range(8)]
    return [shape_of(s, n) for s, n in steps]


def table_problem(seed: int) -> tuple[list[list[float]], list[float]]:
    """A full+tokens-table fit as `fit_step_cost` poses it: the table family's features and
    noisy step times of a cost that is not linear in the batch (random bumps, some of them
    dips, which is what makes a greedy fit go wrong), 1-3 repeats of each shape."""
    rng = random.Random(seed)
    phase = rng.choice(("prefill", "decode"))
    shapes = _grid_shapes(phase) * rng.randint(1, 3)
    knots = table_knots(t for _, t, _, _ in shapes)
    feats = families(knots)[TABLE_FAMILY]
    base = {"one": rng.uniform(1e-4, 5e-3), "seqs": rng.uniform(0, 3e-4), "tokens": rng.uniform(0, 2e-4),
            "context": rng.uniform(0, 1e-7), "pairs": rng.uniform(0, 3e-8)}
    bumps = {t: rng.uniform(-0.3, 1.0) for t in knots}
    noise = rng.choice((0.01, 0.05, 0.15))
    rows, y = [], []
    for seqs, tokens, context, pairs in shapes:
        v = feature_values(seqs, tokens, context, pairs, knots)
        t = sum(c * v[f] for f, c in base.items()) * (1 + bumps[tokens] * rng.random())
        rows.append([v[f] for f in feats])
        y.append(max(t * (1 + rng.uniform(-noise, noise)), 1e-6))
    return rows, y


def five_feature_problem(seed: int) -> tuple[list[list[float]], list[float]]:
    """The five linear features of random batches, timed by a cost with one falling term."""
    rng = random.Random(seed)
    coef = [rng.uniform(0, 1e-3), rng.uniform(0, 1e-4), rng.uniform(0, 1e-4), rng.uniform(0, 1e-7),
            rng.uniform(0, 1e-8)]
    coef[rng.randrange(1, 5)] *= -0.5
    rows, y = [], []
    for _ in range(rng.randint(6, 120)):
        b = rng.randint(1, 32)
        n = [rng.choice((1, 1, rng.randint(1, 512))) for _ in range(b)]
        seqs, tokens, context, pairs = shape_of([rng.randint(0, 2048) for _ in range(b)], n)
        r = [1.0, float(seqs), float(tokens), float(context), float(pairs)]
        rows.append(r)
        y.append(max(sum(a * x for a, x in zip(coef, r)) * (1 + rng.uniform(-0.1, 0.1)), 1e-5))
    return rows, y


def degenerate_problem(seed: int) -> tuple[list[list[float]], list[float]]:
    """What a fold of a small grid can hand the fit: fewer rows than columns, all-zero,
    duplicated and summed columns, scales 1e-6..1e6 apart, signed values."""
    rng = random.Random(seed)
    n, k = rng.randint(1, 30), rng.randint(1, 8)
    cols = [[rng.uniform(-1, 1) if rng.random() < 0.3 else rng.random() for _ in range(n)] for _ in range(k)]
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(("zero", "copy", "sum", "scaled"))
        if kind == "zero":
            cols.append([0.0] * n)
        elif kind == "copy":
            cols.append(list(rng.choice(cols)))
        elif kind == "sum":
            a, b = rng.choice(cols), rng.choice(cols)
            cols.append([u + v for u, v in zip(a, b)])
        else:
            cols.append([u * 10.0 ** rng.randint(-6, 6) for u in rng.choice(cols)])
    rng.shuffle(cols)
    rows = [[c[i] for c in cols] for i in range(n)]
    y = [rng.uniform(0.1, 10.0) for _ in range(n)]
    return rows, y


def _objective(rows, y, coef) -> float:
    """What fit_nonneg minimises: the sum of squared relative errors."""
    a = np.asarray(rows, dtype=float)
    t = np.asarray(y, dtype=float)
    return float((((t - a @ np.asarray(coef, dtype=float)) / t) ** 2).sum())


def _scipy_fit(rows, y) -> list[float]:
    """scipy's NNLS on the same weighted problem (columns scaled to unit max, like ours)."""
    a = np.asarray(rows, dtype=float) / np.asarray(y, dtype=float)[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    x, _ = nnls(a / scale, np.ones(len(y)))
    return list(x / scale)


def _assert_kkt(rows, y, coef, tol=1e-9):
    """The optimality conditions of min ||A x - 1||^2 over x >= 0, on the weighted columns
    normalised to unit length: the gradient g = A^T (A x - 1) is ~0 where x > 0 and >= ~0
    where x == 0 (no coefficient could fall or rise to improve the fit)."""
    a = np.asarray(rows, dtype=float) / np.asarray(y, dtype=float)[:, None]
    norms = np.linalg.norm(a, axis=0)
    x = np.asarray(coef, dtype=float)
    assert (x >= 0).all(), coef
    live = norms > 0
    g = (a[:, live] / norms[live]).T @ (a @ x - 1.0) / math.sqrt(len(y))
    xl = x[live]
    assert (np.abs(g[xl > 0]) <= tol).all(), (g, xl)
    assert (g[xl == 0] >= -tol).all(), (g, xl)


# ----------------------------------------------------------------------------- the NNLS

@pytest.mark.parametrize("make, count", [(table_problem, 150), (five_feature_problem, 150)],
                         ids=["full+tokens-table", "five-features"])
def test_fit_is_the_nonnegative_least_squares_optimum_scipy_finds(make, count):
    """Same objective as scipy.optimize.nnls within 1e-9 relative, never worse, and the KKT
    conditions hold. (The greedy fit this replaced was worse in about one table problem in
    five, by up to tens of percent.)"""
    for seed in range(count):
        rows, y = make(seed)
        ours, ref = _objective(rows, y, fit_nonneg(rows, y)), _objective(rows, y, _scipy_fit(rows, y))
        assert abs(ours - ref) <= 1e-9 * ref + 1e-18, (seed, ours, ref)
        _assert_kkt(rows, y, fit_nonneg(rows, y))


def test_degenerate_problems_are_solved_never_worse_than_scipy():
    for seed in range(200):
        rows, y = degenerate_problem(seed)
        coef = fit_nonneg(rows, y)
        ours, ref = _objective(rows, y, coef), _objective(rows, y, _scipy_fit(rows, y))
        assert ours <= ref * (1 + 1e-9) + 1e-18, (seed, ours, ref)
        assert all(c >= 0 for c in coef)
        _assert_kkt(rows, y, coef, tol=1e-7)


def test_the_fit_is_the_least_squares_optimum_not_a_greedy_drop():
    """The unconstrained fit is exact at (4, -1, -1). Dropping the most negative column and
    refitting (the old fit) ends at a constant, objective 3/7; the optimum keeps the third
    column: (0.4, 0, 0.8), objective 0.2."""
    rows = [[1, 1, 1], [1, 0, 2], [1, 0, 2], [1, 2, 1]]
    y = [2, 2, 2, 1]
    coef = fit_nonneg(rows, y)
    assert coef == pytest.approx([0.4, 0.0, 0.8], abs=1e-12)
    assert _objective(rows, y, coef) == pytest.approx(0.2, rel=1e-12)


def test_zero_and_copied_columns_get_zero_and_change_nothing():
    """Decode steps have seqs == tokens: the copy adds nothing, takes nothing, costs nothing."""
    rows, y = five_feature_problem(7)
    base = fit_nonneg(rows, y)
    wide = fit_nonneg([r + [0.0, r[2], r[1] + r[2]] for r in rows], y)
    assert wide[5] == 0.0
    assert _objective(rows, y, base) == pytest.approx(_objective([r + [0.0, r[2], r[1] + r[2]] for r in rows],
                                                                 y, wide), rel=1e-9)
    assert fit_nonneg([[0.0, 0.0]] * 3, [1.0, 2.0, 3.0]) == [0.0, 0.0]


@pytest.mark.parametrize("seed", range(60))
def test_signed_columns_reach_the_bounded_least_squares_optimum_scipy_finds(seed):
    """With the table's bumps signed (the five linear features still >= 0): the same
    objective as scipy's bounded least squares (BVLS), never worse."""
    rows, y = table_problem(seed)
    signed = list(range(5, len(rows[0])))
    coef = fit_nonneg(rows, y, signed)
    assert all(c >= 0 for c in coef[:5]), coef
    a = np.asarray(rows, dtype=float) / np.asarray(y, dtype=float)[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    lower = [0.0 if j < 5 else -np.inf for j in range(len(rows[0]))]
    ref = lsq_linear(a / scale, np.ones(len(y)), bounds=(lower, np.inf), method="bvls", tol=1e-12).x / scale
    ours, theirs = _objective(rows, y, coef), _objective(rows, y, list(ref))
    assert ours <= theirs * (1 + 1e-7) + 1e-15, (seed, ours, theirs)


def _dip_samples() -> list[dict]:
    """Decode steps of 1..8 sequences shaped like vLLM's CPU backend's served steps: 2
    sequences the slowest, 3-6 faster than 1 (ms per batch size), a little context cost."""
    ms = {1: 52.0, 2: 62.0, 3: 46.0, 4: 45.0, 5: 45.0, 6: 46.0, 7: 50.0, 8: 55.0}
    out = []
    for n, t in ms.items():
        for ctx in (20, 200, 400):
            seqs, tokens, context, pairs = shape_of([ctx] * n, [1] * n)
            step = t / 1e3 + 2e-8 * context
            out.append({"seqs": seqs, "tokens": tokens, "context": context, "pairs": pairs,
                        "execute_s": step * 0.98, "overhead_s": step * 0.02})
    for p in (16, 32, 64, 128, 256, 512):          # prefills (a model has both phases)
        seqs, tokens, context, pairs = shape_of([0], [p])
        step = 0.04 + 2.5e-4 * p
        out.append({"seqs": seqs, "tokens": tokens, "context": context, "pairs": pairs,
                    "execute_s": step * 0.98, "overhead_s": step * 0.02})
    return out


def test_a_table_fits_batch_sizes_that_are_cheaper_than_a_single_sequence():
    """A step cost that falls from 1 to 3-6 sequences (the matmul kernel changes with the
    row count) is priced within 2% at every batch size; with bumps held non-negative no fit
    prices them all within 5%."""
    samples = _dip_samples()
    model = fit_step_cost(samples)
    assert model["parts"]["execute"]["decode"]["family"] == TABLE_FAMILY
    ev = StepCostEvaluator(model)
    samples = [s for s in samples if s["seqs"] == s["tokens"]]          # the decodes
    for s in samples:
        want = s["execute_s"] + s["overhead_s"]
        assert ev.step_time(s["seqs"], s["tokens"], s["context"], s["pairs"]) == pytest.approx(want, rel=0.02), s
    knots = table_knots(s["tokens"] for s in samples)
    feats = families(knots)[TABLE_FAMILY]
    rows = [feature_values(s["seqs"], s["tokens"], s["context"], s["pairs"], knots) for s in samples]
    y = [s["execute_s"] for s in samples]
    unsigned = fit_nonneg([[r[f] for f in feats] for r in rows], y)
    # without negative bumps the 1-sequence step (the table's end, on the line) and the
    # cheaper 3-6-sequence ones cannot all be priced: one of them is off by > 5%
    assert max(abs(predict_linear(feats, unsigned, r) / t - 1) for r, t in zip(rows, y)) > 0.05


def test_a_bump_that_would_price_a_sample_at_or_below_zero_is_refused():
    """fit_family falls back to non-negative bumps when the signed optimum prices one of
    its own samples at <= 0 (a step never costs nothing)."""
    feats = ("one", "k:2")
    rows = [{"one": 1.0, "k:2": 1.0}, {"one": 1.0, "k:2": 1.5}, {"one": 1.0, "k:2": 0.0}]
    y = [1e-3, 10.0, 10.0]
    signed = fit_nonneg([[r[f] for f in feats] for r in rows], y, [1])
    assert predict_linear(feats, signed, rows[1]) <= 0           # what the guard is for
    coef = fit_family(rows, y, feats)
    assert coef[1] >= 0 and all(predict_linear(feats, coef, r) > 0 for r in rows), coef


def test_signed_column_indices_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"signed columns \[2\] out of range for 2 features"):
        fit_nonneg([[1.0, 2.0]], [1.0], [2])


def test_exact_data_is_recovered():
    rows = [[1.0, float(n), float(n * n)] for n in range(1, 9)]
    y = [2e-3 + 1e-4 * n + 3e-6 * n * n for n in range(1, 9)]
    assert fit_nonneg(rows, y) == pytest.approx([2e-3, 1e-4, 3e-6], rel=1e-9)


@pytest.mark.parametrize("rows, y, match", [
    ([], [], "no samples"),
    ([[1.0, 2.0], [1.0]], [1.0, 1.0], "row 1 has 1 features, row 0 has 2"),
    ([[1.0, float("nan")]], [1.0], "row 0 has a non-finite feature"),
    ([[1.0], [1.0]], [1.0, 0.0], "> 0 to fit.*sample 1"),
    ([[1.0]], [float("inf")], "> 0 to fit.*sample 0"),
    ([[1.0], [1.0]], [1.0], "2 rows but 1 step times"),
    ([[1e300]], [1e-300], "feature 0 divided by its step time overflows"),
])
def test_bad_input_is_refused_with_where_it_is(rows, y, match):
    with pytest.raises(ValueError, match=match):
        fit_nonneg(rows, y)


# ----------------------------------------------------------------------------- choosing a family

def _near_tie_data():
    """Steps whose cost has a small context term: the family with it predicts better, but by
    less than SIMPLER_TOLERANCE (deterministic jitter keeps both families' errors apart)."""
    rows, y = [], []
    for i, (tokens, context) in enumerate((t, c) for t in (8, 16, 32, 64, 128, 256) for c in (0, 300, 600, 900)):
        v = feature_values(1, tokens, context, tokens * context + tokens * (tokens + 1) // 2)
        wobble = 1 + 0.02 * math.sin(1.7 * i) + 0.01 * math.cos(5.3 * i)
        rows.append(v)
        y.append((1e-3 + 1e-5 * tokens + 4.7e-8 * context) * wobble)
    return rows, y


def test_a_richer_family_within_the_tolerance_loses_to_the_simpler_one():
    rows, y = _near_tie_data()
    candidates = {"tokens": ("one", "tokens"), "tokens+context": ("one", "tokens", "context")}
    family, report = choose_family(rows, y, candidates=candidates)
    simple, rich = report["tokens"]["mean"], report["tokens+context"]["mean"]
    # the richer family wins outright, by less than the tolerance: only the tolerance decides
    assert rich < simple < rich * (1 + SIMPLER_TOLERANCE), report
    assert simple > rich * 1.002, report
    assert family == "tokens"


def test_a_richer_family_beyond_the_tolerance_wins():
    rows, y = _near_tie_data()
    y = [t + 2e-8 * r["context"] for t, r in zip(y, rows)]          # a real context cost
    family, report = choose_family(rows, y, candidates={"tokens": ("one", "tokens"),
                                                        "tokens+context": ("one", "tokens", "context")})
    assert report["tokens"]["mean"] > report["tokens+context"]["mean"] * (1 + SIMPLER_TOLERANCE), report
    assert family == "tokens+context"


# ----------------------------------------------------------------------------- served buckets

def _rows(phase, seqs, tokens, n, ratio):
    return [ServedStep(phase, seqs, tokens, 0.01, 0.01 * ratio) for _ in range(n)]


def test_a_served_bucket_needs_min_bucket_steps_else_its_phase_factor_applies():
    """A bucket with one step fewer than MIN_BUCKET_STEPS gets no factor of its own (its
    steps take the phase's); one with exactly MIN_BUCKET_STEPS does."""
    few = _rows("decode", 2, 2, MIN_BUCKET_STEPS - 1, 2.0)           # bucket <=4
    enough = _rows("decode", 12, 12, MIN_BUCKET_STEPS, 1.5)          # bucket <=16
    bulk = _rows("decode", 6, 6, 40, 1.0)                            # bucket <=8
    factors = served_factors(few + enough + bulk, "phase+batch")
    assert "decode:<=4" not in factors
    assert factors["decode:<=16"] == pytest.approx(1.5)
    assert factors["decode:<=8"] == pytest.approx(1.0)
    phase = factors["decode"]
    assert phase == pytest.approx(((MIN_BUCKET_STEPS - 1) * 2.0 + MIN_BUCKET_STEPS * 1.5 + 40) /
                                  (2 * MIN_BUCKET_STEPS - 1 + 40))
    assert served_factor(factors, "decode", 2, 2) == pytest.approx(phase)
    assert served_factor(factors, "decode", 12, 12) == pytest.approx(1.5)
    # the same for prefill size buckets
    sized = served_factors(_rows("prefill", 1, 500, MIN_BUCKET_STEPS - 1, 3.0) + _rows("prefill", 1, 40, 30, 1.0),
                           "phase+size")
    assert "prefill:tokens>256" not in sized and sized["prefill:tokens<=64"] == pytest.approx(1.0)
    assert served_factor(sized, "prefill", 1, 500) == pytest.approx(sized["prefill"])

