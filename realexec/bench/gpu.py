"""Everything the GPU paths need checked, in one command: `python -m realexec.bench.gpu`.

For a lent GPU box, where time is short: runs these steps in order of importance, each in
its own process with a time limit, and prints one summary table at the end (a step that
fails or runs out of time is reported and the next one still runs):

  1. kernels   the Triton kernel tests compiled on CUDA (bf16 included):
               TWINSERVE_TRITON_GPU_TESTS=1 pytest tests/realexec/kernels/test_kernels.py
  2. greedy    the engine end to end on CUDA, greedy, Triton attention + CUDA-graph decode
               (uncompiled and torch.compile'd) and piecewise graphs for the other steps vs
               the torch backend run eagerly, and vs HF transformers' generate (fp32)
  3. attention `bench kernels`: decode-attention bandwidth table, decode step graph vs eager,
               mixed prefill+decode step piecewise graphs vs eager
  4. throughput `bench throughput`: ours vs HF generate on ShareGPT, then our engine with
               async scheduling, without the mixed-step piecewise graphs, with
               uncompiled decode graphs, eager, and with the torch attention backend, for the
               compile, graph and kernel speed-ups end to end
  5. serve     `realexec serve` and `bench serve` against it (ShareGPT, 400 requests at 16
               req/s and all at once, streamed over HTTP)

The embedded SmolLM2 GGUF is used when installed. A box that cannot receive it (it is larger
than what a lent machine is sent) gets `--random-from DIR`: a directory with SmolLM2's
config.json and tokenizer files, from which a checkpoint of the same shapes with random weights
is built (timings depend only on shapes; the greedy comparison is between our two paths and
HF on the same weights, so it does not need real ones).

Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from core.procs import ServerError, realexec_server, run_child, sigterm_unwinds, stop

ROOT = Path(__file__).resolve().parents[2]

# Prompts for the greedy comparison: varied lengths so prefill, chunking and several decode
# buckets are exercised.
GREEDY_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention and the memory it saves.",
    "def fibonacci(n):",
    "In 1969, the first humans walked on the moon. The mission was called",
    "A list of the ten largest cities in Europe by population:\n1.",
    "Explain continuous batching to a systems engineer in three sentences.",
    "SELECT name, count(*) FROM requests GROUP BY",
    "Once upon a time, in a data center far away, there lived a tiny language model that",
] * 3


def make_random_checkpoint(src: Path, out: Path, std: float = 0.05, seed: int = 0) -> Path:
    """An HF Llama directory with src's config and tokenizer and random weights (normal(0, std)
    for matrices, ones for norms): the real model's shapes without its weights. A larger std
    than HF's 0.02 makes greedy choices clear-cut, so rounding differences between two correct
    attention paths rarely flip a token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    cfg["initializer_range"] = std
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.name != "config.json" and f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


# ----------------------------------------------------------------------------- greedy step

def prompt_ids(model: str) -> list[list[int]]:
    """GREEDY_PROMPTS tokenized by the checkpoint's tokenizer, or (a checkpoint without one)
    random token ids of similar lengths."""
    import random

    if (Path(model) / "tokenizer.json").exists():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model)
        return [tok(p, add_special_tokens=False).input_ids for p in GREEDY_PROMPTS]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(len(p) // 4 + 1)] for p in GREEDY_PROMPTS]


def greedy_tokens(model: str, prompts, backend: str, max_tokens: int, eager: bool, device: str,
                  compile_decode: bool = False, **engine_args) -> list[list[int]]:
    """Our engine's greedy tokens for GREEDY_PROMPTS in fp32."""
    from core import SamplingParams
    from realexec import LLM

    llm = LLM(model, device=device, dtype="float32", attention_backend=backend, enforce_eager=eager,
              gpu_memory_utilization=0.3, max_num_seqs=64, compile_decode=compile_decode, **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def hf_greedy_tokens(model: str, prompts, max_tokens: int, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out.append(hf.generate(input_ids=ids, generation_config=cfg)[0, ids.shape[1]:].tolist())
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical sequences, and the mean fraction of each sequence before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(k / max(1, len(x)))
    return {"identical": same, "of": len(a), "mean_prefix": sum(prefix) / len(prefix)}


def run_greedy(model: str, max_tokens: int, out: Path, device: str = "cuda", num_prompts: int | None = None) -> int:
    # TF32 would make the fp32 torch/HF paths differ from each other by more than rounding.
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {}
    prompts = prompt_ids(model)[:num_prompts]
    paths = [("triton+graphs", lambda: greedy_tokens(model, prompts, "triton", max_tokens, False, device)),
             ("triton+graphs+async", lambda: greedy_tokens(model, prompts, "triton", max_tokens, False, device,
                                                           async_scheduling=True))]
    if device == "cuda":     # compile_decode only applies to the CUDA decode graphs
        paths.append(("triton+graphs+compile",
                      lambda: greedy_tokens(model, prompts, "triton", max_tokens, False, device, compile_decode=True)))
    for name, fn in [*paths,
                     ("triton eager", lambda: greedy_tokens(model, prompts, "triton", max_tokens, True, device)),
                     ("torch eager", lambda: greedy_tokens(model, prompts, "torch", max_tokens, True, device)),
                     ("HF generate", lambda: hf_greedy_tokens(model, prompts, max_tokens, device))]:
        t0 = time.perf_counter()
        results[name] = fn()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    ref = results["HF generate"]
    table = {name: agreement(toks, ref) for name, toks in results.items() if name != "HF generate"}
    table["triton+graphs vs torch eager"] = agreement(results["triton+graphs"], results["torch eager"])
    print(f"{'path':<30} {'identical':>10} {'mean prefix':>12}   (vs HF generate, fp32, {max_tokens} tokens)")
    for name, a in table.items():
        print(f"{name:<30} {a['identical']:>4}/{a['of']:<5} {100 * a['mean_prefix']:>11.1f}%")
    out.write_text(json.dumps(table, indent=2))
    # Correct paths agree almost everywhere; a broken kernel or graph agrees nowhere.
    return 0 if all(a["mean_prefix"] >= 0.9 for a in table.values()) else 1


# ----------------------------------------------------------------------------- serve step

def run_serve(model: str, out: Path, num_requests: int, rates: list[str], max_tokens_cap: int,
              port: int | None = None, start_timeout: float = 180.0) -> int:
    """`realexec serve` on this box and `bench serve` against it at each rate (the OpenAI
    server, streaming, and the engine loop on CUDA end to end). The server is core.procs'
    context manager: stopped by its process on the way out, also when something fails."""
    py = sys.executable
    try:
        with realexec_server(["--model", model], out / "server.log", port=port, ready_timeout=start_timeout,
                             cwd=ROOT) as server:
            print(f"server ready in {server.ready_s:.0f} s", flush=True)
            rc = 0
            for rate in rates:
                r = run_child([py, "-m", "realexec", "bench", "serve", "--url", server.url, "--num-requests",
                               str(num_requests), "--rate", rate, "--max-tokens-cap", str(max_tokens_cap),
                               "--save-result", str(out / f"serve_rate_{rate}.json")], cwd=ROOT)
                rc = rc or r.returncode
            return rc
    except ServerError as e:
        print(e)
        return 1


# ----------------------------------------------------------------------------- orchestration

def _step(name: str, cmd: list[str], limit: float, log: Path, env: dict | None = None) -> dict:
    print(f"\n=== {name}: {' '.join(cmd)} (limit {limit:.0f} s)", flush=True)
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n=== {name}: {' '.join(cmd)}\n")
        f.flush()
        status = "timed out"
        try:
            with sigterm_unwinds():
                p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
                try:
                    for line in p.stdout:
                        sys.stdout.write(line)
                        f.write(line)
                        if time.perf_counter() - t0 > limit:
                            break
                    rc = p.wait(timeout=max(1.0, limit - (time.perf_counter() - t0)))
                    if time.perf_counter() - t0 <= limit:
                        status = "ok" if rc == 0 else f"failed (rc {rc})"
                except subprocess.TimeoutExpired:
                    pass
                finally:
                    # SIGINT first: the step's own servers and workers stop with it
                    stop(p, (10.0, 5.0))
        except OSError as e:
            status = f"could not start: {e}"
    secs = time.perf_counter() - t0
    print(f"=== {name}: {status} in {secs:.0f} s", flush=True)
    return {"step": name, "status": status, "seconds": round(secs, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m realexec.bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--random-from", default=None,
                   help="dir with a config.json + tokenizer: benchmark a random-weight model of its shapes")
    p.add_argument("--out", default="results/gpu", help="logs and JSON results [results/gpu]")
    # Compiled decode graphs add ~90 s of start-up to each engine (H100, 23 buckets).
    p.add_argument("--budget", type=float, default=900.0, help="seconds for all steps together [900]")
    p.add_argument("--steps", default="kernels,greedy,attention,throughput,serve",
                   help="comma-separated steps to run, in this order [kernels,greedy,attention,throughput,serve]")
    p.add_argument("--greedy-tokens", type=int, default=48,
                   help="tokens each greedy prompt generates in the greedy step [48]")
    # The steps' own processes (greedy, serve): internal, so left out of --help. A parser's
    # help=SUPPRESS does not hide a choice (argparse prints "==SUPPRESS=="): the whole
    # subcommand action is hidden instead, and its parsers get no help entry.
    sub = p.add_subparsers(dest="inner", help=argparse.SUPPRESS)
    g = sub.add_parser("greedy")
    g.add_argument("model")
    g.add_argument("--max-tokens", type=int, default=48)
    g.add_argument("--json", required=True)
    g.add_argument("--device", default="cuda", help="cpu: a smoke run of this step (Triton interpreted)")
    g.add_argument("--num-prompts", type=int, default=None)
    v = sub.add_parser("serve")
    v.add_argument("model")
    v.add_argument("--out", required=True)
    v.add_argument("--num-requests", type=int, default=400)
    v.add_argument("--rates", default="16,inf")
    v.add_argument("--max-tokens-cap", type=int, default=256)
    v.add_argument("--port", type=int, default=None, help="(default: a free port)")
    args = p.parse_args(argv)

    if args.inner == "serve":
        return run_serve(args.model, Path(args.out), args.num_requests, args.rates.split(","),
                         args.max_tokens_cap, args.port)
    if args.inner == "greedy":
        return run_greedy(args.model, args.max_tokens, Path(args.json), args.device, args.num_prompts)

    import torch
    if not torch.cuda.is_available():
        print("CUDA is not available on this machine: bench_gpu checks the GPU paths and needs a GPU (nothing run).")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "bench_gpu.log"
    log.write_text("")
    t_start = time.perf_counter()
    import triton
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"CUDA {torch.version.cuda}", flush=True)

    model = args.model
    if args.random_from:
        t0 = time.perf_counter()
        model = str(make_random_checkpoint(Path(args.random_from), Path("/tmp/twinserve-random-model")))
        print(f"random-weight checkpoint of {args.random_from}'s shapes at {model} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    elif model is None:
        from realexec.models.loader import resolve_model_dir
        model = str(resolve_model_dir(None))
    py = sys.executable
    # The throughput steps' workload: the first 256 requests of the repository's ShareGPT
    # trace, outputs capped at 128 (the slice of the earlier GPU tables).
    SLICE = ["--trace", str(ROOT / "traces" / "sharegpt.json")]
    steps = {
        "kernels": ([py, "-m", "pytest", "tests/realexec/kernels/test_kernels.py", "-q", "-x", "-p", "no:cacheprovider"],
                    180, {"TWINSERVE_TRITON_GPU_TESTS": "1"}),
        "greedy": ([py, "-m", "realexec.bench.gpu", "greedy", model, "--max-tokens", str(args.greedy_tokens),
                    "--json", str(out / "greedy.json")], 150, None),
        "attention": ([py, "-m", "realexec", "bench", "kernels", "--model", model], 180, None),
        "throughput": ([py, "-m", "realexec", "bench", "throughput", "--model", model, *SLICE, "--num-requests", "256",
                        "--max-tokens-cap", "128", "--hf-batch-size", "64", "--output-json", str(out / "throughput.json")], 300, None),
        "serve": ([py, "-m", "realexec.bench.gpu", "serve", model, "--out", str(out)], 300, None),
        "throughput-uncompiled": ([py, "-m", "realexec", "bench", "throughput", "--model", model, *SLICE,
                                   "--num-requests", "256", "--max-tokens-cap", "128", "--skip-hf",
                                   "--no-compile-decode", "--output-json", str(out / "throughput_uncompiled.json")],
                                  90, None),
        "throughput-eager": ([py, "-m", "realexec", "bench", "throughput", "--model", model, *SLICE, "--num-requests",
                              "256", "--max-tokens-cap", "128", "--skip-hf", "--enforce-eager",
                              "--output-json", str(out / "throughput_eager.json")], 60, None),
        "throughput-torch": ([py, "-m", "realexec", "bench", "throughput", "--model", model, *SLICE, "--num-requests",
                              "256", "--max-tokens-cap", "128", "--skip-hf", "--enforce-eager",
                              "--attention-backend", "torch",
                              "--output-json", str(out / "throughput_torch.json")], 60, None),
    }
    for name, flag in (("async", "--async-scheduling"), ("no-mixed-graphs", "--no-mixed-step-graphs")):
        steps[f"throughput-{name}"] = ([py, "-m", "realexec", "bench", "throughput", "--model", model, *SLICE,
                                        "--num-requests", "256", "--max-tokens-cap", "128", "--skip-hf", flag,
                                        "--output-json", str(out / f"throughput_{name.replace('-', '_')}.json")],
                                       90, None)
    wanted = args.steps.split(",")
    if "throughput" in wanted:
        wanted += ["throughput-async", "throughput-no-mixed-graphs", "throughput-uncompiled", "throughput-eager",
                   "throughput-torch"]
    unknown = [s for s in wanted if s not in steps]
    if unknown:
        print(f"error: unknown step(s) {unknown}; choose from {sorted(steps)}", file=sys.stderr)
        return 2
    summary = []
    for name in [s for s in steps if s in wanted]:
        cmd, limit, env = steps[name]
        left = args.budget - (time.perf_counter() - t_start)
        if left < 20:
            summary.append({"step": name, "status": "skipped (budget spent)", "seconds": 0})
            continue
        summary.append(_step(name, cmd, min(limit, left), log, env))
    print(f"\n{'step':<18} {'status':<24} {'seconds':>8}")
    for s in summary:
        print(f"{s['step']:<18} {s['status']:<24} {s['seconds']:>8.0f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if all(s["status"] == "ok" for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
