"""`python -m realexec COMMAND ...`

Commands live in the `COMMANDS` table: a name maps to a `Command` (help text plus
"module:function" references to its argument builder and its runner) or to a nested
table (a command group such as `bench`). Modules are imported only for the command
being run, so adding one is a single table entry:

    COMMANDS["bench"]["kernels"] = Command("Triton kernel bandwidth", "realexec.bench.kernels:add_arguments",
                                           "realexec.bench.kernels:run")

A runner takes the parsed namespace and returns an exit code. A user's mistake (a bad flag
or value, InvalidRequestError, a missing file, a bad trace, a server that cannot be
reached) prints one `error: ...` line and exits 2; anything else is a bug and keeps its
traceback. Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from contextlib import contextmanager
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
                       "realexec.twin.profile:add_arguments", "realexec.twin.profile:run"),
    "export-hf": Command("write a model (default: the embedded GGUF) as an fp32 Hugging Face directory, e.g. for vLLM",
                         "realexec.models.export_hf:add_arguments", "realexec.models.export_hf:run"),
    "bench": {
        "throughput": Command("offline throughput: our engine vs HF generate, vLLM, llama-server (--peer)",
                              "realexec.bench.throughput:add_arguments", "realexec.bench.throughput:run"),
        "serve": Command("serving benchmark: stream a trace's requests at a rate to an OpenAI-compatible server",
                         "realexec.bench.serve:add_arguments", "realexec.bench.serve:run"),
        "simulate-vs-real": Command("serve --simulate vs the real server on one trace slice: TTFT/TPOT/throughput "
                                    "table", "realexec.bench.simulated:add_vs_real_arguments",
                                    "realexec.bench.simulated:run_vs_real"),
        "simulate-cpu": Command("CPU one serve --simulate replica takes at a request rate (server process, /proc)",
                                "realexec.bench.simulated:add_cpu_arguments", "realexec.bench.simulated:run_cpu"),
        "chaos": Command("good traffic under malformed, oversized, disconnecting and timing-out traffic",
                         "realexec.bench.chaos:add_arguments", "realexec.bench.chaos:run"),
        "executors": Command("uni / mp / ray executors: step-message bytes, RPC overhead, tok/s; SmolLM2 TP=1 vs 3",
                             "realexec.bench.executors:add_arguments", "realexec.bench.executors:run"),
        "pipeline": Command("pipeline parallelism: stage busy fraction and tok/s, 1 vs P batches in flight",
                            "realexec.bench.pipeline_overlap:add_arguments", "realexec.bench.pipeline_overlap:run"),
        "kernels": Command("CUDA: Triton decode-attention bandwidth, and decode step graph vs eager",
                           "realexec.bench.graphs:add_kernels_arguments", "realexec.bench.graphs:run_kernels"),
        "record-vllm": Command("vLLM's own scheduling decisions and step times as a step log (`sim replay` reads it)",
                               "realexec.bench.record_vllm:add_arguments", "realexec.bench.record_vllm:run"),
        "profile-vllm": Command("time vLLM's steps over a grid (decodes at every batch size, prefills alone and "
                                "mixed) and fit the simulator's step-cost model on them",
                                "realexec.bench.record_vllm:add_profile_arguments",
                                "realexec.bench.record_vllm:run_profile"),
        "fit-vllm": Command("fit the simulator's step-cost model on vLLM recordings (`bench record-vllm`)",
                            "realexec.bench.record_vllm:add_fit_arguments", "realexec.bench.record_vllm:run_fit"),
    },
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that a usage error is one line (no usage dump): `error: ...`,
    exit 2. Subcommand parsers are of the same class (add_subparsers' default)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m realexec", description="twinserve real executor")
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
    """Exceptions that mean the user asked for something that cannot be done (a bad value, a
    path that is not there or not readable, nothing listening at a URL) rather than a bug."""
    from traces import TraceError
    errors = [ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
              ConnectionError, TraceError]
    httpx = sys.modules.get("httpx")     # only a command that talks HTTP has imported it
    if httpx is not None:
        errors += [httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol, httpx.InvalidURL]
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return _load(args._run)(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if type(e).__module__.startswith("httpx"):          # "All connection attempts failed": say what
        text = f"{type(e).__name__}: {text}"
    return text


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


def finish_line(c, max_model_len: int | None = None) -> str:
    """'[finish_reason: stop, 8 tokens]'; a 'length' finish says the answer was cut off, and
    by what: --max-tokens, or (given `max_model_len`, when it was hit) the context."""
    cut = ""
    if c.finish_reason == "length":
        cut = (f" (cut off: the context is full at max_model_len {max_model_len})" if max_model_len
               else " (cut off: raise --max-tokens for more)")
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
    from realexec.engine.llm import LLM
    from realexec.progress import busy

    with busy(f"loading {engine_args.model or 'SmolLM2-135M-Instruct'}"):   # bars only on a terminal
        llm = LLM(**{k: v for k, v in vars(engine_args).items()})
    try:
        return _generate(llm, args, params)
    finally:
        llm.shutdown()                # worker processes / Ray actors stop now, not at exit


@contextmanager
def _first_sigint_stops():
    """While inside: the first Ctrl-C (SIGINT) only sets the yielded event, so the caller
    stops between two engine steps with its output intact; a second one raises
    KeyboardInterrupt at once, as usual."""
    stop = threading.Event()

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _generate(llm, args, params) -> int:
    """Stream one request's text to stdout as the engine produces it (n > 1 and beams: print
    them at the end, with a token bar on a terminal); Ctrl-C stops it with finish reason
    'abort' and exit code 130."""
    engine = llm.engine
    prompt_ids = (engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
                  else engine.encode(args.prompt))
    room = engine.max_model_len - len(prompt_ids)
    if 0 < room < params.max_tokens:
        print(f"note: --max-tokens {params.max_tokens} capped at {room}: max_model_len {engine.max_model_len} "
              f"minus the prompt's {len(prompt_ids)} tokens (--max-model-len sets it)",
              file=sys.stderr, flush=True)
    many = params.n > 1 or params.beam_width > 0
    rid = engine.add_request(prompt_ids, params)      # an impossible request fails here (InvalidRequestError)
    progress = None
    if many:
        from realexec.progress import TokenProgress, bar
        progress = TokenProgress(bar(min(params.max_tokens, room), "generating", "tok"))   # the longest one
    last = None
    try:
        with _first_sigint_stops() as interrupted:
            while not interrupted.is_set() and not (last is not None and last.finished):
                outputs = engine.step()
                for out in outputs:
                    if out.request_id != rid:
                        continue
                    last = out
                    if not many and out.outputs[0].text_delta:
                        print(out.outputs[0].text_delta, end="", flush=True)
                if progress is not None:
                    progress.update(outputs)
    finally:
        if progress is not None:
            progress.close()
    aborted = last is None or not last.finished
    if aborted:
        engine.abort_request(rid)
    completions = last.outputs if last is not None else []
    if not many:
        c = completions[0] if completions else None
        if c is not None and c.finish_reason is None:
            c.finish_reason = "abort"
        print()
        full = engine.max_model_len if c is not None and len(c.token_ids) >= room else None
        print(finish_line(c, full) if c is not None else "[finish_reason: abort, 0 tokens]", flush=True)
    elif aborted and params.beam_width:
        print("[finish_reason: abort; beam search reports its beams only when it ends]", flush=True)
    for c in completions:
        if many:
            if c.finish_reason is None:
                c.finish_reason = "abort"
            label = "beam" if params.beam_width else "sample"
            score = f" cumulative_logprob={c.cumulative_logprob:.4f}" if c.cumulative_logprob is not None else ""
            print(f"--- {label} {c.index} (finish: {c.finish_reason}{score}) ---")
            print(c.text)
        if c.logprobs is not None and llm.tokenizer is not None:
            tok = llm.tokenizer
            for t, lp in zip(c.token_ids, c.logprobs):
                alts = ", ".join(f"{tok.decode([a])!r}: {v:.3f}" for a, v in sorted(lp.items(), key=lambda kv: -kv[1]))
                print(f"  {tok.decode([t])!r}: {lp[t]:.3f}  [{alts}]")
    return 130 if aborted else 0
