"""`python -m realexec COMMAND ...`

Commands live in the `COMMANDS` table: a name maps to a `Command` (help text plus
"module:function" references to its argument builder and its runner) or to a nested
table (a command group such as `bench`). Modules are imported only for the command
being run, so adding one is a single table entry:

    COMMANDS["bench"]["kernels"] = Command("Triton kernel bandwidth", "realexec.kernels.bench:add_arguments",
                                           "realexec.kernels.bench:run")

A runner takes the parsed namespace and returns an exit code. Bad input (ValueError,
InvalidRequestError, a missing file, a bad trace) prints `error: ...` and exits 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: str     # "module:function(parser)"
    run: str               # "module:function(args) -> int"


def _load(ref: str) -> Callable:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


COMMANDS: dict[str, Command | dict] = {
    "generate": Command("generate a completion for a prompt", "realexec.cli:add_generate_arguments",
                        "realexec.cli:run_generate"),
    "serve": Command("OpenAI-compatible HTTP server (completions, chat, models, health, metrics)",
                     "realexec.server.cli:add_serve_arguments", "realexec.server.cli:run_serve"),
    "profile": Command("time real engine steps over a grid and fit the simulator's step-cost model",
                       "realexec.profile:add_arguments", "realexec.profile:run"),
    "export-hf": Command("write a model (default: the embedded GGUF) as an fp32 Hugging Face directory, e.g. for vLLM",
                         "realexec.export_hf:add_arguments", "realexec.export_hf:run"),
    "bench": {
        "throughput": Command("offline throughput: our engine vs HF generate, vLLM, llama-server (--peer)",
                              "realexec.bench_throughput:add_arguments", "realexec.bench_throughput:run"),
        "serve": Command("serving benchmark: stream a trace's requests at a rate to an OpenAI-compatible server",
                         "realexec.bench_serve:add_arguments", "realexec.bench_serve:run"),
        "chaos": Command("good traffic under malformed, oversized, disconnecting and timing-out traffic",
                         "realexec.bench_chaos:add_arguments", "realexec.bench_chaos:run"),
        "executors": Command("uni / mp / ray executors: step-message bytes, RPC overhead, tok/s; SmolLM2 TP=1 vs 3",
                             "realexec.bench_executors:add_arguments", "realexec.bench_executors:run"),
        "pipeline": Command("pipeline parallelism: stage busy fraction and tok/s, 1 vs P batches in flight",
                            "realexec.bench_pipeline:add_arguments", "realexec.bench_pipeline:run"),
        "kernels": Command("CUDA: Triton decode-attention bandwidth, and decode step graph vs eager",
                           "realexec.bench_graphs:add_kernels_arguments", "realexec.bench_graphs:run_kernels"),
    },
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m realexec", description="twinserve real executor")
    _add_commands(parser, COMMANDS, argv, "command")
    return parser


def _add_commands(parser, table: dict, argv: list[str], dest: str) -> None:
    sub = parser.add_subparsers(dest=dest, required=True, metavar="{" + ",".join(table) + "}")
    selected = argv[0] if argv else None
    for name, entry in table.items():
        rest = argv[1:] if name == selected else []
        if isinstance(entry, dict):
            group = sub.add_parser(name, help=f"{name} commands: {', '.join(entry)}")
            _add_commands(group, entry, rest, f"{dest}_{name}")
        else:
            p = sub.add_parser(name, help=entry.help, description=entry.help)
            if name == selected:         # only the chosen command's module is imported
                _load(entry.add_arguments)(p)
                p.set_defaults(_run=entry.run)


def _user_errors() -> tuple[type[BaseException], ...]:
    from traces import TraceError
    return (ValueError, FileNotFoundError, NotADirectoryError, TraceError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return _load(args._run)(args)
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# ----------------------------------------------------------------------------- generate

def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most [64]")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [0]")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass [1.0]")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all) [0]")
    g.add_argument("--n", type=int, default=1, help="parallel samples [1]")
    g.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (0 = off) [0]")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    g.add_argument("--logprobs", type=int, default=None, help="print this many top logprobs per token")


def sampling_params_from_args(args):
    from core import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, n=args.n, beam_width=args.beam_width, seed=args.seed,
                          stop=list(args.stop), ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def finish_line(c) -> str:
    """'[finish_reason: stop, 8 tokens]'; a 'length' finish says the answer was cut off."""
    cut = " (cut off: raise --max-tokens for more)" if c.finish_reason == "length" else ""
    return f"[finish_reason: {c.finish_reason}, {len(c.token_ids)} tokens{cut}]"


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from realexec.config import add_engine_args
    parser.add_argument("--prompt", required=True, help="the prompt text (or the user message with --chat)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(parser)
    add_engine_args(parser)      # its --seed also seeds the request's sampler


def run_generate(args) -> int:
    from core import InvalidRequestError
    from realexec.config import engine_args_from_namespace

    params = sampling_params_from_args(args)          # bad input fails before torch and the model load
    if not args.prompt.strip():
        raise InvalidRequestError("prompt is empty")
    engine_args = engine_args_from_namespace(args)
    engine_args.validate()
    from realexec.llm import LLM
    from realexec.progress import busy

    with busy(f"loading {engine_args.model or 'SmolLM2-135M-Instruct'}"):   # bars only on a terminal
        llm = LLM(**{k: v for k, v in vars(engine_args).items()})
    try:
        if args.chat:
            (out,) = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=None)
        else:
            (out,) = llm.generate(args.prompt, params, use_tqdm=None)
    finally:
        llm.shutdown()                # worker processes / Ray actors stop now, not at exit
    many = len(out.outputs) > 1
    for c in out.outputs:
        if many:
            label = "beam" if params.beam_width else "sample"
            score = f" cumulative_logprob={c.cumulative_logprob:.4f}" if c.cumulative_logprob is not None else ""
            print(f"--- {label} {c.index} (finish: {c.finish_reason}{score}) ---")
        print(c.text)
        if not many:
            print(finish_line(c))
        if c.logprobs is not None and llm.tokenizer is not None:
            tok = llm.tokenizer
            for t, lp in zip(c.token_ids, c.logprobs):
                alts = ", ".join(f"{tok.decode([a])!r}: {v:.3f}" for a, v in sorted(lp.items(), key=lambda kv: -kv[1]))
                print(f"  {tok.decode([t])!r}: {lp[t]:.3f}  [{alts}]")
    return 0
