"""Time vLLM's offline `LLM` engine on a requests file; write the timings as JSON.

Run by vLLM's own interpreter (vLLM is not a twinserve dependency), by path:

    /path/to/vllm-venv/bin/python realexec/bench/peers/vllm_runner.py --model HF_DIR \
        --requests requests.json --out result.json [--enforce-eager] [--max-model-len N]

Imports only vllm and the stdlib (this file never imports twinserve, and twinserve never
imports it). The CPU backend's thread binding and KV space come from the environment
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE), set by the caller.

requests.json: {"requests": [{"prompt_token_ids": [int, ...], "max_tokens": int}, ...]}.
Every request is greedy with EOS ignored, so it generates exactly max_tokens tokens.
A warm-up generate() (the first prompts reversed, 8 tokens each) runs first and is not
timed; then all requests go to one generate() call (submitted at once) and its wall time
is `seconds`.

result.json: {"engine": "vllm", "vllm_version", "enforce_eager", "requests",
"output_tokens" (tokens of each request up to its max_tokens, summed), "seconds",
"load_s", "warmup_s", "token_ids" (per request, in request order), "env" (the VLLM_CPU_*
variables seen)}.

Exit status: 0 done; 2 bad arguments or requests file (one line on stderr); 3 vllm
cannot be imported by this interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def read_requests(path: str) -> list[tuple[list[int], int]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the requests file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    items = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected {{\"requests\": [{{\"prompt_token_ids\": [...], \"max_tokens\": N}}, ...]}}")
    out = []
    for i, r in enumerate(items):
        ids = r.get("prompt_token_ids") if isinstance(r, dict) else None
        m = r.get("max_tokens") if isinstance(r, dict) else None
        if (not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids)
                or not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"{path}: request {i}: expected a non-empty 'prompt_token_ids' list of token ids "
                             f"and an integer 'max_tokens' >= 1")
        out.append((ids, m))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory vLLM loads")
    p.add_argument("--requests", required=True, help="requests JSON file")
    p.add_argument("--out", required=True, help="result JSON file to write")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        requests = read_requests(args.requests)
        if not os.path.isdir(args.model):
            raise ValueError(f"--model {args.model}: not a directory")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as e:   # ImportError, or a broken install failing inside vllm
        print(f"error: cannot import vllm with {sys.executable}: {type(e).__name__}: {e}", file=sys.stderr)
        return 3

    t0 = time.perf_counter()
    kwargs = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager,
              seed=args.seed, **kwargs)
    load_s = time.perf_counter() - t0

    def prompts(reqs):
        return [{"prompt_token_ids": ids} for ids, _ in reqs]

    def params(reqs):
        return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]

    # Warm-up on prompts of the same lengths but other content (no prefix-cache hits later).
    warm = [(list(reversed(ids)), min(m, 8)) for ids, m in requests[:4]]
    t0 = time.perf_counter()
    llm.generate(prompts(warm), params(warm), use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    outputs = llm.generate(prompts(requests), params(requests), use_tqdm=False)
    seconds = time.perf_counter() - t0

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "engine": "vllm",
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "enforce_eager": args.enforce_eager,
        "requests": len(requests),
        "output_tokens": sum(min(len(t), m) for t, (_, m) in zip(token_ids, requests)),
        "seconds": seconds,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "token_ids": token_ids,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")},
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
