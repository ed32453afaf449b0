"""`python -m realexec bench throughput`: offline output tokens/s, our engine vs HF generate.

Both run in this process on the same weights, prompts, thread count and dtype:
  * ours: every request added at once (continuous batching decides the rest), greedy,
    max_tokens = the traced output_len (capped by --max-tokens-cap), ignore_eos;
  * HF transformers `generate` on the converted checkpoint directory of our loader:
    static batches of --hf-batch-size requests in trace order, left padded, greedy,
    max_new_tokens = the batch's largest max_tokens, EOS disabled. Each request counts
    only its own max_tokens real tokens (padding and the batch's overshoot are not output).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from core import SamplingParams
from realexec.config import add_engine_args, engine_args_from_namespace


def add_arguments(parser) -> None:
    parser.add_argument("--trace", default="traces/sharegpt.json", help="trace file [traces/sharegpt.json]")
    parser.add_argument("--num-requests", type=int, default=200, help="first N requests of the trace [200]")
    parser.add_argument("--max-tokens-cap", type=int, default=None,
                        help="cap each request's output tokens (CPU runs: e.g. 32)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for HF generate [16]")
    parser.add_argument("--skip-hf", action="store_true", help="run only our engine")
    parser.add_argument("--output-json", default=None, help="also write the results here")
    add_engine_args(parser)


def model_dir(model: str | None) -> Path:
    """The HF directory our loader reads (GGUF files are converted once into the cache)."""
    from realexec.loader import cache_root, convert_gguf, embedded_model_path

    path = Path(model) if model is not None else embedded_model_path()
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_root())
    return path


def load_trace_requests(args):
    from traces import TraceError, load_trace

    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise ValueError(f"--max-tokens-cap must be >= 1, got {args.max_tokens_cap}")
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    trace = load_trace(args.trace, limit=args.num_requests)
    if not len(trace):
        raise TraceError(f"{args.trace}: no requests")
    return trace


def fit_requests(args, trace, engine) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per trace request, fitted into max_model_len."""
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    out = []
    for r in trace:
        if r.prompt_token_ids is not None:
            ids = list(r.prompt_token_ids)
        elif r.prompt is not None and engine.tokenizer is not None:
            ids = engine.tokenizer(r.prompt, add_special_tokens=False).input_ids
        else:          # a length-only trace: random tokens of the traced length
            ids = torch.randint(0, vocab, (r.prompt_len,), generator=gen).tolist()
        max_tokens = min(r.output_len, args.max_tokens_cap or r.output_len)
        limit = engine.max_model_len
        ids = ids[:limit - 2]
        max_tokens = max(1, min(max_tokens, limit - len(ids)))
        out.append((ids, max_tokens))
    return out


def run_ours(engine, requests, progress: bool | None = None) -> dict:
    """``progress``: a bar of output tokens with the running tok/s (None: on a terminal)."""
    from realexec.progress import TokenProgress, bar

    for ids, max_tokens in requests:
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens = 0
    counter = TokenProgress(bar(sum(m for _, m in requests), "twinserve", "tok", progress))
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for out in outputs:
                if out.finished:
                    tokens += sum(len(c.token_ids) for c in out.outputs)
            counter.update(outputs)
        elapsed = time.perf_counter() - t0
    finally:
        counter.close()
    return {"output_tokens": tokens, "seconds": elapsed, **engine.timing_stats()}


@torch.inference_mode()
def run_hf(path: Path, requests, batch_size: int, dtype: torch.dtype, device: torch.device, pad_id: int,
           progress: bool | None = None) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from realexec.progress import bar

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokens = 0
    pbar = bar(sum(m for _, m in requests), f"HF generate (batch {batch_size})", "tok", progress)
    t0 = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        max_new = max(m for _, m in batch)
        config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad_id)
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        generated = out.shape[1] - width
        tokens += sum(min(m, generated) for _, m in batch)
        pbar.update(sum(min(m, generated) for _, m in batch))
    elapsed = time.perf_counter() - t0
    pbar.close()
    return {"output_tokens": tokens, "seconds": elapsed}


def run(args) -> int:
    from realexec.engine import LLMEngine

    engine_args = engine_args_from_namespace(args)
    trace = load_trace_requests(args)           # bad input fails before the model loads
    from realexec.progress import busy
    with busy(f"loading {engine_args.model or 'SmolLM2-135M-Instruct'}"):
        engine = LLMEngine(engine_args)
    try:
        return _run(args, engine, engine_args, trace)
    finally:
        engine.shutdown()                       # worker processes / Ray actors (mp, ray; TP, PP)


def _run(args, engine, engine_args, trace) -> int:
    from realexec.loader import resolve_dtype
    from realexec.worker import resolve_device

    requests = fit_requests(args, trace, engine)
    device = resolve_device(engine_args.device)          # as the workers resolve it (their rank 0)
    dtype = resolve_dtype(engine_args.dtype, device, engine.model_config)
    n = len(requests)
    print(f"model {engine_args.model or 'embedded SmolLM2-135M-Instruct'} | device {device} | dtype "
          f"{str(dtype).removeprefix('torch.')} | threads {torch.get_num_threads() if device.type == 'cpu' else '-'} "
          f"| {n} requests, mean prompt {sum(len(i) for i, _ in requests) / n:.0f} tokens, "
          f"mean max_tokens {sum(m for _, m in requests) / n:.1f}"
          + (f" (cap {args.max_tokens_cap})" if args.max_tokens_cap else ""), flush=True)

    ours = run_ours(engine, requests)
    results = {"ours": ours}
    rows = [("twinserve", ours)]
    if not args.skip_hf:
        pad = engine.tokenizer.pad_token_id if engine.tokenizer is not None else None
        pad = pad if pad is not None else (engine.eos_token_id or 0)
        hf = run_hf(model_dir(engine_args.model), requests, args.hf_batch_size, dtype, device, pad)
        results["hf"] = hf
        rows.append((f"HF generate (batch {args.hf_batch_size})", hf))

    print(f"{'engine':<26} {'output tokens':>13} {'seconds':>9} {'output tok/s':>13}")
    for name, r in rows:
        print(f"{name:<26} {r['output_tokens']:>13} {r['seconds']:>9.1f} {r['output_tokens'] / r['seconds']:>13.1f}")
    if "hf" in results:
        ratio = (ours["output_tokens"] / ours["seconds"]) / (results["hf"]["output_tokens"] / results["hf"]["seconds"])
        results["ratio"] = ratio
        print(f"ratio twinserve / HF: {ratio:.2f}x")
    print(f"twinserve step time: {ours['steps']} steps, scheduler+update {100 * ours['scheduler_share']:.2f}%, "
          f"input preparation {100 * ours['prepare_share']:.2f}%, detokenize "
          f"{100 * ours['detokenize_s'] / ours['step_s']:.2f}%")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0
