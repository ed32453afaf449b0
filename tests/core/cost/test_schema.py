"""core.cost.schema: the cost-model file's typed schema. A bad file is refused with what is
wrong and where (its field path); good files (fitted, calibrated, older ones) load."""
from __future__ import annotations

import copy
import json
import math

import pytest

from core.cost.fit import check_model, client_delays, fit_step_cost, jitter_params
from core.cost.fitted import load_cost_model_file
from core.cost.schema import engine_settings

# one linear model per part and phase (the fit's own output shape)
SAMPLES = [{"seqs": s, "tokens": t, "context": c, "pairs": c + t,
            "execute_s": 1e-3 + 1e-4 * t + 1e-8 * (c + t), "overhead_s": 4e-4 + 3e-5 * s}
           for s, t, c in [(1, 64, 0), (1, 256, 0), (2, 512, 0), (4, 1024, 0), (1, 1, 100), (4, 4, 800),
                           (8, 8, 3000), (16, 16, 9000), (2, 128, 0), (8, 8, 400)] * 2]


@pytest.fixture(scope="module")
def model() -> dict:
    m = fit_step_cost(SAMPLES, k=2)
    check_model(m)
    return m


def _bad(model: dict, edit) -> dict:
    bad = copy.deepcopy(model)
    edit(bad)
    return bad


def test_only_the_tables_bumps_may_be_negative(model):
    """A negative k:<tokens> bump is a table correction (a batch size cheaper than the line
    through its neighbours) and loads; a negative linear term is refused."""
    bumped = copy.deepcopy(model)
    entry = bumped["parts"]["execute"]["decode"]
    entry.update(features=entry["features"] + ["k:4"], coef=entry["coef"] + [-1e-3], knots=[1, 4, 8])
    check_model(bumped, "p.json")
    entry["coef"][0] = -1e-9
    with pytest.raises(ValueError, match=r"coef\[0\] \(one\) must be >= 0"):
        check_model(bumped, "p.json")


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["parts"]["execute"]["prefill"]["coef"].__setitem__(0, -1e-3),
     "coef[0] (one) must be >= 0, got -0.001 (only the k:<tokens> bumps may be negative) "
     "- at `$.parts.execute.prefill`"),
    (lambda m: m["parts"]["overhead"]["decode"]["coef"].__setitem__(0, math.inf),
     "coef[0] must be finite, got inf - at `$.parts.overhead.decode`"),
    (lambda m: m["parts"]["overhead"]["decode"]["coef"].__setitem__(0, "1e-3"),
     "Expected `float`, got `str` - at `$.parts.overhead.decode.coef[0]`"),
    (lambda m: m["parts"]["execute"]["decode"].__setitem__("knots", [1, 8, 4]),
     "knots must be increasing token counts >= 1, got [1, 8, 4] - at `$.parts.execute.decode`"),
    (lambda m: m["parts"]["execute"].pop("decode"), "Object missing required field `decode` - at `$.parts.execute`"),
    (lambda m: m.__setitem__("swap", {"coef": [1e-3], "block_bytes": 4096}),
     "Expected `array` of length 2, got 1 - at `$.swap.coef`"),
    (lambda m: m.__setitem__("jitter", {"sigma": 0.1, "phi": 1.0}), "Expected `float` < 1.0 - at `$.jitter.phi`"),
    (lambda m: m.__setitem__("client", {"first_token_s": math.nan, "last_token_s": 0.0}),
     "first_token_s and last_token_s must be finite, got [nan, 0.0] - at `$.client`"),
    (lambda m: m.__setitem__("served", {"factors": {"decode": 0.0}}),
     "factor 'decode' must be finite and > 0, got 0.0 - at `$.served`"),
    (lambda m: m.__setitem__("engine", {"block_size": 16, "enable_prefix_caching": "yes"}),
     "Expected `bool | null`, got `str` - at `$.engine.enable_prefix_caching`"),
    (lambda m: m.__setitem__("engine", {"swap_space_gib": -1.0}),          # an old key: checked as its new name
     "Expected `float` >= 0.0 - at `$.engine.swap_space`"),
])
def test_a_bad_field_is_named_by_its_path(model, edit, message):
    with pytest.raises(ValueError) as e:
        check_model(_bad(model, edit), "p.json")
    assert str(e.value) == f"p.json: {message}"


def test_sections_decode_to_their_values(model):
    calibrated = dict(model, jitter={"sigma": 0.1, "phi": 0.5, "run_sigma": 0.02, "n": 100},
                      client={"first_token_s": 0.002, "last_token_s": 0.001},
                      served={"factors": {"decode": 1.2, "prefill:tokens<=64": 0.9}, "rows": [[1, 2]]})
    check_model(calibrated)                          # unknown fields (n, rows, reports) ride along
    assert jitter_params(calibrated) == (0.1, 0.5, 0.0, 0.0)
    assert client_delays(calibrated) == (0.002, 0.001)
    assert jitter_params(model) is None and client_delays(model) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"^x: Expected `float` >= 0.0 - at `\$\.jitter\.sigma`$"):
        jitter_params(dict(model, jitter={"sigma": -1, "phi": 0.5}), "x")


def test_engine_section_old_and_new_key_names(model, tmp_path):
    new = {"num_gpu_blocks": 200, "block_size": 8, "enable_chunked_prefill": True, "swap_space": 1.0,
           "queue_policy": "fcfs", "preemption_mode": "swap", "victim_policy": "newest", "eviction_policy": "lru",
           "max_model_len": None}
    old = {"num_gpu_blocks": 200, "block_size": 8, "enable_chunked_prefill": True, "swap_space_gib": 1.0,
           "queue": "fcfs", "preemption": "swap", "victim": "newest", "eviction": "lru", "max_model_len": None}
    want = {k: v for k, v in new.items() if v is not None}
    for engine in (new, old):
        path = tmp_path / "p.json"
        path.write_text(json.dumps(dict(model, engine=engine)))
        loaded = load_cost_model_file(str(path))
        check_model(loaded)
        assert engine_settings(loaded, "p.json") == want
    assert engine_settings(model, "p.json") == {}
    with pytest.raises(ValueError, match=r"^p\.json: Expected `object`, got `array` - at `\$\.engine`$"):
        engine_settings(dict(model, engine=[1]), "p.json")


def test_format_and_version_are_checked_first(model):
    with pytest.raises(ValueError, match="p.json: not a twinserve-step-cost file"):
        check_model(dict(model, format="other"), "p.json")
    with pytest.raises(ValueError, match="version 9, this build reads versions"):
        check_model(dict(model, version=9), "p.json")
