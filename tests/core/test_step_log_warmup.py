"""Step-log transformations the twin's real runs rely on: trimming a warm-up off a served
run's log (core.cost.step_log.drop_warmup) and a vLLM log's loop seconds per step
(loop_step_seconds)."""
from __future__ import annotations

import pytest

from core.cost.step_log import drop_warmup, loop_step_seconds


def arrival(rid, step, t, landed=None):
    rec = {"kind": "arrival", "req_id": rid, "step": step, "t": t, "t_arrival": t - 0.001,
           "prompt_token_ids": [1, 2], "max_tokens": 2}
    if landed is not None:
        rec["landed"] = landed
    return rec


def step(n, rids, t):
    return {"kind": "step", "step": n, "t_start": t, "t_end": t + 0.01, "step_s": 0.01,
            "decision": {"batch": [[r, 0, 1, 1, 1] for r in rids], "preempted": []}}


def finish(rid):
    return {"kind": "finish", "req_id": rid, "num_output_tokens": 2, "status": "length", "first_text_token": 1}


CONFIG = {"kind": "config", "format": "twinserve-step-log"}


def served_log():
    """Two warm-up requests (w0, w1) served and finished, then two measured ones (a, b)."""
    return [CONFIG, arrival("w1", 0, 0.10), arrival("w0", 0, 0.05), step(0, ["w0", "w1"], 0.2),
            step(1, ["w0", "w1"], 0.3), finish("w0"), finish("w1"),
            arrival("a", 2, 1.0, landed=2), step(2, ["a"], 1.1), arrival("b", 3, 1.15, landed=3),
            step(3, ["a", "b"], 1.2), finish("a"), step(4, ["b"], 1.3), finish("b")]


def test_drop_warmup_removes_the_first_requests_and_renumbers_the_rest():
    kept = drop_warmup(served_log(), 2)
    assert kept[0] == CONFIG
    assert [r.get("req_id") for r in kept if r["kind"] in ("arrival", "finish")] == ["a", "b", "a", "b"]
    steps = [r for r in kept if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [s["decision"]["batch"][0][0] for s in steps] == ["a", "a", "b"]
    arrivals = {r["req_id"]: r for r in kept if r["kind"] == "arrival"}
    assert (arrivals["a"]["step"], arrivals["a"]["landed"]) == (0, 0)      # before the first kept step
    assert (arrivals["b"]["step"], arrivals["b"]["landed"]) == (1, 1)
    assert arrivals["b"]["t"] == 1.15                                       # times are kept
    assert drop_warmup(served_log(), 0) == served_log()


def test_the_warmup_is_the_first_requests_by_arrival_not_by_file_order():
    log = [CONFIG, arrival("late", 1, 0.5), arrival("early", 0, 0.05), step(0, ["early"], 0.1),
           finish("early"), step(1, ["late"], 0.6), finish("late")]
    kept = drop_warmup(log, 1)
    assert [r["req_id"] for r in kept if r["kind"] == "arrival"] == ["late"]
    assert [(s["step"], s["decision"]["batch"][0][0]) for s in kept if s["kind"] == "step"] == [(0, "late")]


@pytest.mark.parametrize("change, message", [
    (lambda log: log[7].update(step=1), "arrived before the warm-up's last step 1"),
    (lambda log: log[3]["decision"]["batch"].append(["a", 0, 1, 0, 1]), "step 0 ran a measured request"),
])
def test_a_warmup_that_overlaps_the_measured_requests_is_refused(change, message):
    log = served_log()
    change(log)
    with pytest.raises(ValueError, match=message):
        drop_warmup(log, 2)


def test_a_warmup_of_every_request_is_refused():
    with pytest.raises(ValueError, match="4 requests: none left after a warm-up of 4"):
        drop_warmup(served_log(), 4)


def test_loop_seconds_run_to_the_next_schedule_and_skip_idle_gaps_and_the_last_step():
    steps = [{"t_start": 0.0, "t_end": 0.05, "step_s": 0.05}, {"t_start": 0.06, "t_end": 0.1, "step_s": 0.04},
             {"t_start": 2.0, "t_end": 2.05, "step_s": 0.05}, {"t_start": 2.05, "t_end": 2.1, "step_s": 0.05}]
    got = loop_step_seconds(steps)
    assert [s for s, _ in got] == [steps[0], steps[2]]       # step 1: 1.9 s idle after it; step 3: the last
    assert [sec for _, sec in got] == pytest.approx([0.06, 0.05])


def test_loop_seconds_leave_out_a_gap_the_engine_waited_for_an_arrival_in():
    steps = [{"t_start": 0.0, "t_end": 0.05, "step_s": 0.05, "decision": {"batch": [["a", 0, 5, 1, 1]]}},
             {"t_start": 0.06, "t_end": 0.1, "step_s": 0.04, "decision": {"batch": [["a", 5, 1, 1, 1]]}},
             {"t_start": 0.5, "t_end": 0.55, "step_s": 0.05, "decision": {"batch": [["b", 0, 5, 1, 1]]}},
             {"t_start": 0.56, "t_end": 0.6, "step_s": 0.04, "decision": {"batch": [["b", 5, 1, 1, 1], ["c", 0, 2, 1, 1]]}},
             {"t_start": 0.61, "t_end": 0.65, "step_s": 0.04, "decision": {"batch": [["b", 6, 1, 1, 1]]}}]
    arrivals = [{"req_id": "a", "t": 0.0}, {"req_id": "b", "t": 0.49}, {"req_id": "c", "t": 0.555}]
    got = loop_step_seconds(steps, arrivals)
    # after step 1 the engine had nothing until b entered at 0.49: idle, left out; step 2 is
    # followed by b's next step (and c, which came in the gap): busy
    assert [s["t_start"] for s, _ in got] == [0.0, 0.5, 0.56]
    assert [sec for _, sec in got] == pytest.approx([0.06, 0.06, 0.05])
    assert len(loop_step_seconds(steps)) == 4                 # without arrivals: only the 1 s cap
