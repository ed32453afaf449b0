"""`python -m realexec bench record-vllm`: vLLM's own scheduling decisions as a step log.

Takes a trace slice (any traces format; prompts tokenized with SmolLM2's tokenizer unless
the trace carries token ids), writes the requests file and runs
`realexec/bench/peers/vllm_recorder.py` with vLLM's interpreter (--vllm-python), which
runs vLLM's offline engine in-process with its v1 Scheduler wrapped, and writes a
`core/cost/step_log.py` log that `python -m sim replay LOG` reads. All requests are
submitted at once (an offline batch), greedy, EOS ignored, outputs of the trace's length
capped at --max-tokens-cap.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from core.procs import run_child

RECORDER = Path(__file__).with_name("peers") / "vllm_recorder.py"


def trace_requests(path: str, num_requests: int, skip: int = 0, cap: int | None = None, tokenizer=None
                   ) -> list[dict]:
    """[{"prompt_token_ids", "max_tokens"}] for requests skip..skip+num_requests-1
    of the trace; ValueError when the trace has fewer."""
    from traces import TraceError, load_trace
    from traces.build import prompt_ids

    trace = load_trace(path, limit=skip + num_requests)
    reqs = list(trace.requests)[skip:]
    if len(reqs) < num_requests:
        raise ValueError(f"{path}: {len(reqs)} requests after skipping {skip}, {num_requests} asked for")
    try:
        return [{"prompt_token_ids": ids, "max_tokens": max(1, min(r.output_len, cap) if cap else r.output_len)}
                for r, ids in prompt_ids(reqs, path, tokenizer)]
    except TraceError as e:
        raise ValueError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", required=True, metavar="PATH", help="python of a venv with vLLM installed")
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="fp32 HF directory of the model (`python -m realexec export-hf --out DIR`)")
    p.add_argument("--trace", default="traces/sharegpt.json", help="trace file (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=24, metavar="N", help="requests (default: %(default)s)")
    p.add_argument("--skip", type=int, default=0, metavar="K", help="leave out the trace's first K requests")
    p.add_argument("--max-tokens-cap", type=int, default=64, metavar="N",
                   help="cap each request's output tokens (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="LOG", help="step log to write")
    p.add_argument("--threads-bind", default="0-1",
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU backend (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up (default: %(default)s)")
    p.add_argument("recorder_args", nargs=argparse.REMAINDER,
                   help="after --: flags for the recorder, e.g. -- --num-gpu-blocks 64 --max-num-seqs 16")


def check_recorder_args(args: argparse.Namespace) -> str:
    """vLLM's interpreter (checked) and the model directory's existence, before anything runs."""
    from realexec.bench.peer_table import check_python

    python = check_python(args.vllm_python)
    if not os.path.isdir(args.model_dir):
        raise ValueError(f"--model-dir {args.model_dir}: not a directory (make one with "
                         f"`python -m realexec export-hf --out DIR`)")
    return python


def run_recorder(python: str, args: argparse.Namespace, requests: list[dict], log: str,
                 extra: list[str] = ()) -> int:
    """Run the recorder in vLLM's interpreter on `requests` (dicts of the recorder's requests
    file), writing the step log `log`; its exit status (1 on timeout)."""
    import json

    from realexec.bench.peer_table import vllm_env

    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    env = vllm_env(args.threads_bind, 1)     # 1 GiB of KV (vLLM otherwise wants 92% of RAM free)
    with tempfile.TemporaryDirectory(prefix="twinserve-record-vllm-") as tmp:
        req_file = Path(tmp) / "requests.json"
        req_file.write_text(json.dumps({"requests": requests}))
        cmd = [python, str(RECORDER), "--model", args.model_dir, "--requests", str(req_file), "--out", log,
               "--recorded-by", shlex.join([sys.executable, "-m", "realexec", *sys.argv[1:]]),
               *[a for a in args.recorder_args if a != "--"], *extra]
        try:
            return run_child(cmd, env=env, stdin=subprocess.DEVNULL, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"error: the vLLM recorder gave no result within {args.timeout:g} s", file=sys.stderr)
            return 1


def run(args: argparse.Namespace) -> int:
    python = check_recorder_args(args)
    if args.num_requests < 1 or args.skip < 0 or args.max_tokens_cap < 1:
        raise ValueError("--num-requests and --max-tokens-cap must be >= 1, --skip >= 0")
    reqs = trace_requests(args.trace, args.num_requests, args.skip, args.max_tokens_cap)
    return run_recorder(python, args, reqs, args.out)


# ----------------------------------------------------------------------------- a profile grid

def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", required=True, metavar="PATH", help="python of a venv with vLLM installed")
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="fp32 HF directory of the model (`python -m realexec export-hf --out DIR`)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="cost-model JSON to write (what `sim run --cost-model` and `sim.twin.tables --real vllm "
                        "--profile` read); the step log goes beside it as FILE.steps.jsonl")
    p.add_argument("--trace", default="traces/sharegpt.json", help="text for the prompts (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=16, metavar="N",
                   help="decode batch sizes 1..N, and vLLM's --max-num-seqs (default: %(default)s)")
    p.add_argument("--steps-per-size", type=int, default=6, metavar="K",
                   help="decode steps at each batch size (default: %(default)s)")
    p.add_argument("--threads-bind", default="0",
                   help="VLLM_CPU_OMP_THREADS_BIND (default: %(default)s, one compute core: how `sim validate "
                        "--real vllm` serves on a 2-core machine)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up (default: %(default)s)")
    p.add_argument("recorder_args", nargs=argparse.REMAINDER,
                   help="after --: flags for the recorder, as the deployment runs vLLM, e.g. -- --enforce-eager "
                        "--block-size 32")


def run_profile(args: argparse.Namespace) -> int:
    import json

    from core.cost.grid_workload import grid_tokens, profile_workload
    from core.cost.vllm_fit import fit_logs
    from traces.build import prompt_token_pool

    python = check_recorder_args(args)
    if args.max_num_seqs < 1 or args.steps_per_size < 1:
        raise ValueError("--max-num-seqs and --steps-per-size must be >= 1")
    reqs = profile_workload(prompt_token_pool(args.trace, grid_tokens(args.max_num_seqs)), args.max_num_seqs,
                            args.steps_per_size)
    log = f"{args.out}.steps.jsonl"
    rc = run_recorder(python, args, reqs, log, ["--max-num-seqs", str(args.max_num_seqs)])
    if rc:
        return rc
    model = fit_logs([log])
    with open(args.out, "w") as f:
        json.dump(model, f, indent=1)
    print(format_fit(model))
    print(f"fitted on {len(model['samples'])} vLLM steps ({log}); wrote {args.out}")
    return 0


# ----------------------------------------------------------------------------- fit on recorded steps

def add_fit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="LOG", help="vLLM step logs (`bench record-vllm --out`)")
    p.add_argument("--out", required=True, metavar="FILE", help="cost-model JSON to write")
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds (default: %(default)s)")


def run_fit(args: argparse.Namespace) -> int:
    import json

    if args.folds < 2:
        raise ValueError(f"--folds must be >= 2, got {args.folds}")
    from core.cost.vllm_fit import fit_logs

    model = fit_logs(args.logs, args.folds)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(model, f, indent=1)
    print(format_fit(model))
    print(f"fitted on {len(model['samples'])} vLLM steps; wrote {args.out}")
    return 0


def format_fit(model: dict) -> str:
    """Chosen family and held-out error per part and phase, and of the whole step."""
    lines = ["held-out relative error (k-fold over the recorded steps), chosen family:"]
    for part, phases in model["parts"].items():
        for phase, entry in phases.items():
            e = entry["held_out"][entry["family"]]
            lines.append(f"  {part:9s} {phase:8s} {entry['family']:22s} mean {e['mean'] * 100:6.2f}%  "
                         f"p90 {e['p90'] * 100:6.2f}%  (n={e['n']})")
    for phase, e in model["held_out_step"].items():
        lines.append(f"  whole step {phase:8s} mean {e['mean'] * 100:.2f}%  median {e['median'] * 100:.2f}%  "
                     f"p90 {e['p90'] * 100:.2f}%  (n={e['n']})")
    return "\n".join(lines)
