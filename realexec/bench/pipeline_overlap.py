"""`python -m realexec.bench.pipeline_overlap` (also `python -m realexec bench pipeline`): does the
pipeline stay full?

A tiny random Llama runs over P pipeline stages (mp or ray). Each decoder layer is slowed
by an artificial delay (`--layer-delay-ms`, a sleep in a wrapper around the layer that
this benchmark installs in the workers: it stands in for device compute, so that compute
dominates even on a 2-core machine where the real arithmetic of a tiny model is
negligible). The same engine then runs the same workload twice: with 1 batch in flight
(each stage idles while the others work) and with P batches in flight (the core's batch
queue). For each stage: the fraction of wall time it was busy (inside a step, minus the
time it waited for the previous stage's hidden state or for the next stage to take its
own); and tokens/s of both runs. Requests are split into P batches by --max-num-seqs =
requests / P in both runs, so only the overlap differs.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from core import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages [2]")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage [1]")
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"], help="executor [mp]")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny model [4]")
    parser.add_argument("--layer-delay-ms", type=float, default=5.0,
                        help="artificial compute per decoder layer and step, ms [5]")
    parser.add_argument("--requests", type=int, default=8, help="requests (split into --pp batches) [8]")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request [16]")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request [32]")
    parser.add_argument("--quick", action="store_true", help="fewer output tokens (12)")


def tiny_checkpoint(path: str, layers: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def slow_layers(worker, seconds: float) -> int:
    """Run in every worker (collective_rpc): each decoder layer sleeps `seconds` per call."""
    def slowed(forward):
        def run(*args, **kwargs):
            time.sleep(seconds)
            return forward(*args, **kwargs)
        return run
    for layer in worker.model.layers:
        layer.forward = slowed(layer.forward)
    return len(worker.model.layers)


def stage_busy_seconds(executor) -> list[float]:
    """Per stage (its TP driver): seconds inside steps, minus waits on the neighbours."""
    timings = executor.collective_rpc("get_timings")
    tp = executor.layout.tp
    return [t["execute_s"] - t["recv_wait_s"] - t["send_wait_s"] for t in timings[::tp]]


def run_workload(llm, in_flight: int, args) -> dict:
    engine = llm.engine
    engine.core.max_concurrent_batches = in_flight
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request([(i * 31 + j) % 500 + 3 for j in range(args.prompt_len)], params)
    busy0 = stage_busy_seconds(engine.executor)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(c.token_ids_delta) for out in engine.step() for c in out.outputs)
    wall = time.perf_counter() - t0
    busy = [b1 - b0 for b0, b1 in zip(busy0, stage_busy_seconds(engine.executor))]
    return {"in_flight": in_flight, "wall_s": wall, "tok_s": tokens / wall, "busy": [b / wall for b in busy]}


def run(args) -> int:
    from realexec import LLM

    if args.quick:
        args.max_tokens = 12
    if args.requests < args.pp:
        raise ValueError(f"--requests {args.requests} must be at least --pp {args.pp} (one batch per stage)")
    delay = args.layer_delay_ms / 1e3
    print(f"## pipeline fill: tiny Llama, {args.layers} layers over {args.pp} stages x TP {args.tp} ({args.backend}), "
          f"{args.layer_delay_ms:g} ms per layer, {args.requests} requests in {args.pp} batches, "
          f"prompt {args.prompt_len}, {args.max_tokens} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=tiny_checkpoint(tmp, args.layers), pipeline_parallel_size=args.pp,
                  tensor_parallel_size=args.tp, distributed_executor_backend=args.backend, block_size=16,
                  num_gpu_blocks=1024, max_num_seqs=max(1, args.requests // args.pp))
        try:
            llm.engine.executor.collective_rpc(slow_layers, (delay,))
            rows = [run_workload(llm, k, args) for k in (1, args.pp)]
        finally:
            llm.shutdown()
    stages = " | ".join(f"stage {k} busy" for k in range(args.pp))
    print(f"| batches in flight | wall s | tokens/s | {stages} |")
    print("|---:|---:|---:|" + "---:|" * args.pp)
    for r in rows:
        busy = " | ".join(f"{b:.0%}" for b in r["busy"])
        print(f"| {r['in_flight']} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | {busy} |")
    speedup = rows[1]["tok_s"] / rows[0]["tok_s"]
    print(f"\n{args.pp} batches in flight: {speedup:.2f}x the tokens/s of 1; "
          f"least busy stage {min(rows[1]['busy']):.0%} (target >= 80%)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m realexec.bench.pipeline_overlap", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
