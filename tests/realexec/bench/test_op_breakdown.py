"""`bench throughput --op-breakdown`: every operator call of the run is counted once, with
the work it did, and nothing of the timers is left on the model afterwards."""
from __future__ import annotations

import json

import pytest

from core import SamplingParams

PROMPT = [5, 9, 3, 17, 2, 8, 11]      # 7 tokens
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from tests.tiny_models import save_tiny_llama

    path = tmp_path_factory.mktemp("models") / "tiny"
    save_tiny_llama(path, vocab_size=128)
    return str(path)


def tiny_engine(path: str, **kwargs):
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=path, device="cpu", block_size=4, num_gpu_blocks=64, swap_space=0.01,
                                **kwargs))


def generate(engine, prompt=PROMPT, max_tokens=MAX_TOKENS) -> None:
    engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("weights", ["dense", "packed"])
def test_one_request_is_counted_call_by_call_with_its_flops_and_kv_bytes(tiny_dir, weights):
    from realexec.bench.op_breakdown import OpBreakdown

    engine = tiny_engine(tiny_dir, cpu_weight_format=weights)
    try:
        model = engine.executor.driver.model
        cfg = model.config
        layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
        kv_row = cfg.num_key_value_heads * cfg.head_dim * 4          # one token's K (or V) row, fp32
        # in x out of every projection of the model, from the checkpoint's config
        q, kv = cfg.num_attention_heads * cfg.head_dim, kv_row // 4
        per_token = layers * (hidden * (q + 2 * kv) + q * hidden + hidden * 2 * cfg.intermediate_size
                              + cfg.intermediate_size * hidden)
        with OpBreakdown(model) as ops:
            generate(engine)
        steps = MAX_TOKENS                                         # the prefill, then MAX_TOKENS - 1 decodes
        fed = len(PROMPT) + MAX_TOKENS - 1                         # the last sampled token is never fed back
        t = ops.tally
        assert t["projections"].calls == steps * layers * 4
        assert t["projections"].flops == 2 * fed * per_token
        assert t["LM head"].calls == steps
        assert t["LM head"].flops == 2 * MAX_TOKENS * hidden * cfg.vocab_size
        assert t["attention"].calls == steps * layers
        context = sum(len(PROMPT) + i for i in range(MAX_TOKENS))  # each step's context length
        assert t["attention"].bytes == 2 * kv_row * layers * context
        assert t["norms"].calls == steps * (2 * layers + 1)
        assert t["activation"].calls == t["rotary"].calls == steps * layers
        assert all(tally.seconds > 0 for tally in t.values())
        # the projections by rows: one prefill of 7 rows, then single-row decodes
        assert ops.by_rows["4-31"].calls == layers * 4 and ops.by_rows["1-3"].calls == (steps - 1) * layers * 4
        assert ops.by_rows["4-31"].flops == 2 * len(PROMPT) * per_token
    finally:
        engine.shutdown()


def test_the_timers_leave_nothing_behind_even_when_the_run_fails(tiny_dir):
    from realexec.bench.op_breakdown import OpBreakdown
    from realexec.models import cpu_ops

    engine = tiny_engine(tiny_dir)
    try:
        model = engine.executor.driver.model
        backend = model.layers[0].self_attn.backend
        names = ("rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary_qk")
        originals = [getattr(cpu_ops, n) for n in names]
        with pytest.raises(RuntimeError, match="stop here"):
            with OpBreakdown(model) as ops:
                generate(engine, max_tokens=2)
                raise RuntimeError("stop here")
        assert [getattr(cpu_ops, n) for n in names] == originals
        assert "forward" not in vars(backend) and "compute_logits" not in vars(model)
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        counted = {c: t.calls for c, t in ops.tally.items()}
        generate(engine, max_tokens=3)                             # runs untimed, as before
        assert {c: t.calls for c, t in ops.tally.items()} == counted
    finally:
        engine.shutdown()


def test_report_sets_rates_against_the_peaks_and_the_rest_is_the_untimed_wall():
    from realexec.bench.op_breakdown import OpBreakdown, format_report

    class Model:                                                   # report() reads only the tallies
        pass

    ops = OpBreakdown(Model())
    ops.tally["projections"].seconds, ops.tally["projections"].flops = 2.0, 300e9
    ops.tally["attention"].seconds, ops.tally["attention"].bytes = 1.0, 5e9
    ops.by_rows["32-127"].seconds, ops.by_rows["32-127"].flops = 2.0, 300e9
    rep = ops.report(4.0, {"gemm_gflops": 200.0, "read_gbps": 20.0, "threads": 2})
    assert rep["ops"]["projections"]["gflops"] == pytest.approx(150.0)
    assert rep["ops"]["projections"]["share_of_peak"] == pytest.approx(0.75)
    assert rep["ops"]["attention"]["gbps"] == pytest.approx(5.0)
    assert rep["ops"]["attention"]["share_of_peak"] == pytest.approx(0.25)
    assert rep["rest"]["seconds"] == pytest.approx(1.0) and rep["rest"]["share"] == pytest.approx(0.25)
    assert list(rep["projections_by_rows"]) == ["32-127"]
    text = format_report(rep)
    assert "150.0 GFLOP/s" in text and "75%" in text and "5.0 GB/s" in text and "25%" in text


def test_bench_throughput_prints_and_writes_the_breakdown(tiny_dir, tmp_path, capsys):
    from realexec.cli import main
    from traces import Trace, TraceRequest, save_trace

    trace = tmp_path / "t.json"
    save_trace(Trace([TraceRequest(f"r{i}", 0.0, 5 + i, 3 + i) for i in range(3)]), trace, "test")
    out = tmp_path / "res.json"
    rc = main(["bench", "throughput", "--trace", str(trace), "--model", tiny_dir, "--device", "cpu",
               "--num-gpu-blocks", "64", "--block-size", "4", "--skip-hf", "--op-breakdown",
               "--cpu-packed-min-rows", "3", "--cpu-gemm", "onednn", "--output-json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads(out.read_text())["ours"]["op_breakdown"]
    shares = sum(r["share"] for r in rep["ops"].values()) + rep["rest"]["share"]
    assert shares == pytest.approx(1.0, abs=1e-6)
    assert rep["peaks"]["gemm_gflops"] > 0 and rep["peaks"]["read_gbps"] > 0
    assert rep["ops"]["projections"]["share_of_peak"] > 0
    printed = capsys.readouterr().out
    assert "op breakdown of the generate loop" in printed
    assert "| weights auto, onednn packed from 3 rows |" in printed     # the header says which kernels ran


def test_bench_throughput_refuses_a_breakdown_it_cannot_time(tiny_dir, capsys):
    from realexec.cli import main

    assert main(["bench", "throughput", "--model", tiny_dir, "--op-breakdown",
                 "--distributed-executor-backend", "mp", "--skip-hf"]) == 2
    err = capsys.readouterr().err
    assert "--op-breakdown times CPU operators in this process" in err and "backend mp" in err
