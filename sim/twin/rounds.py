"""Calibration and validation runs in A/B rounds, so a prediction is fitted on served
runs from the same stretch of time as the real run it is compared with.

Why: on this host the served/profiled CPU ratio of the same engine moves 1.03-1.24x
between runs minutes apart (fp32 decode is memory-bound; the host's other tenants change
the memory traffic). Calibrating once and validating afterwards compares a factor of one
host state with runs of another. Interleaved, each scenario's runs go

    C0 V0 C1 V1 ... C(R-1) V(R-1) CR        (C: calibration slice, V: validation slice)

(the scenarios' rounds alternate, so round r of every scenario lies in one stretch of
time), and validation run r is predicted by a fit on calibration runs of the same
minutes: the ones on either side of it (C(r) and C(r+1)), its scenario's, or all of the
session's, whichever pairing predicts left-out calibration runs best (`pairing_check`:
measured on calibration runs alone). Validation requests never enter a fit (the
calibration slice is other trace requests with another arrival seed).
The sequential design (every calibration run first, then every validation run) is the
earlier twin_tables' order, kept to show what interleaving fixes.

Pure scheduling and bookkeeping: what is served in which order, which calibration runs
feed which prediction, and a held-out check of that pairing on calibration runs alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from core.cost.fit import ServedStep, calibrated_seconds, fit_served_scale

DESIGNS = ("interleaved", "sequential")
CALIBRATION, VALIDATION = "calibration", "validation"


@dataclass(frozen=True)
class Slot:
    """One served run: its role, scenario and round (calibration runs: 0..R, validation: 0..R-1)."""
    role: str
    scenario: str
    round: int

    @property
    def name(self) -> str:
        return f"{self.role[:3]}-{self.scenario}-r{self.round}"


def schedule(scenarios: Sequence[str], rounds: int, design: str = "interleaved",
             calibrate: bool = True) -> list[Slot]:
    """The served runs in time order: R validation runs per scenario and, when calibrating,
    R + 1 calibration runs per scenario (interleaved: one before and one after every
    validation run; sequential: all of them first)."""
    if design not in DESIGNS:
        raise ValueError(f"round design must be one of {DESIGNS}, got {design!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not scenarios:
        raise ValueError("no scenario to serve")
    cal = [[Slot(CALIBRATION, s, r) for s in scenarios] for r in range(rounds + 1)] if calibrate else []
    val = [[Slot(VALIDATION, s, r) for s in scenarios] for r in range(rounds)]
    if not calibrate:
        return [slot for block in val for slot in block]
    if design == "sequential":
        return [slot for block in cal + val for slot in block]
    out = []
    for r in range(rounds):
        for c, v in zip(cal[r], val[r]):
            out += [c, v]
    return out + cal[rounds]


# Which calibration runs a prediction for a run (a validation run, or in the held-out check a
# calibration run left out) is fitted on, nearest first:
#   neighbours: its scenario's calibration runs next before and next after it in time;
#   scenario:   all its scenario's calibration runs (of this schedule: the same minutes);
#   session:    every calibration run of the schedule, all scenarios (the fit's per-stratum
#               factors price each scenario's mix of batch sizes).
PAIRINGS = ("neighbours", "scenario", "session")


def calibration_for(slots: Sequence[Slot], target: Slot, pairing: str = "neighbours") -> list[Slot]:
    """The calibration runs (in time order, `target` itself left out) whose fit predicts
    `target`; for neighbours either side may be missing (sequential: none after)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    if target not in slots:
        raise ValueError(f"{target} is not a run of this schedule")
    at = slots.index(target)
    cals = [i for i, s in enumerate(slots) if s.role == CALIBRATION and i != at]
    mine = [i for i in cals if slots[i].scenario == target.scenario]
    if pairing == "neighbours":
        before, after = [i for i in mine if i < at], [i for i in mine if i > at]
        picked = ([before[-1]] if before else []) + ([after[0]] if after else [])
    else:
        picked = mine if pairing == "scenario" else cals
    if not picked:
        raise ValueError(f"no calibration run for {target.name} in the schedule")
    return [slots[i] for i in picked]


Rows = Sequence[ServedStep]          # (phase, seqs, tokens, grid prediction s, logged s, place after idle) per step


def total_error(fit_rows: Rows, held_rows: Rows) -> float:
    """Signed relative error of the held-out run's total logged seconds when each of its
    steps is priced by the served scale fitted on `fit_rows`."""
    factors = fit_served_scale(fit_rows)["factors"]
    predicted = sum(calibrated_seconds(r, factors) for r in held_rows)
    measured = sum(r.measured for r in held_rows)
    return (predicted - measured) / measured


def pairing_check(slots: Sequence[Slot], rows: Callable[[Slot], Rows]) -> dict[str, list[float]]:
    """Held-out check of the pairings on calibration runs alone: every calibration run with
    a neighbour on both sides (in its scenario) is left out and predicted by each pairing's
    fit on the others; per pairing the signed total errors, in schedule order (empty with
    fewer than 3 calibration runs per scenario). Validation runs play no part in it."""
    held = interior_calibration_runs(slots)
    return {pairing: [total_error([r for c in calibration_for(slots, h, pairing) for r in rows(c)], rows(h))
                      for h in held] for pairing in PAIRINGS}


def interior_calibration_runs(slots: Sequence[Slot]) -> list[Slot]:
    """The calibration runs with one of their scenario's before and one after them."""
    out = []
    for s in slots:
        mine = [x for x in slots if x.role == CALIBRATION and x.scenario == s.scenario]
        if s.role == CALIBRATION and mine[0] != s and mine[-1] != s:
            out.append(s)
    return out


def choose_pairing(check: dict[str, list[float]]) -> str:
    """The pairing with the smallest mean absolute held-out error (the first, the most
    local, on a tie or when nothing could be checked)."""
    scored = [(sum(abs(e) for e in errs) / len(errs), i, name)
              for i, (name, errs) in enumerate(check.items()) if errs]
    return min(scored)[2] if scored else PAIRINGS[0]
