"""`python -m realexec ...` as a user meets it: one-line errors, streamed `generate` with
its Ctrl-C, quiet exits (no nanobind leak report, no Ray auth warning), help texts, and
the content-keyed GGUF conversion cache."""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from core.procs import free_port, realexec_server
from tests.tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, **kwargs) -> list[str]:
    return [sys.executable, "-m", "realexec", *args]


def env() -> dict:
    """No progress bars; stdout buffered as a user's is (not PYTHONUNBUFFERED)."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    e.pop("PYTHONUNBUFFERED", None)
    return e


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's tokenizer, 4096 positions (max_model_len 2048 on CPU)."""
    from transformers import AutoTokenizer

    from realexec.bench.throughput import model_dir

    path = tmp_path_factory.mktemp("models") / "tiny-cli"
    save_tiny_llama(path, tokenizer=AutoTokenizer.from_pretrained(model_dir(None)), max_position_embeddings=4096,
                    initializer_range=0.15, tie_word_embeddings=True)
    return str(path)


# ----------------------------------------------------------------------------- one-line errors

def test_user_errors_are_one_line_with_exit_2(tmp_path):
    """Each is a mistake a user makes; each used to end in a traceback (or, for argparse, a
    usage dump): now one `error: ...` line on stderr and exit code 2."""
    port = free_port()                                      # nothing listens there
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "garbage.gguf").write_bytes(b"not a gguf" * 100)
    cases = [
        (["bench", "serve", "--url", f"http://127.0.0.1:{port}"], f"no server at http://127.0.0.1:{port}"),
        (["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--model", "m"], "no server at"),
        (["bench", "serve", "--url", "127.0.0.1:8000"], "--url must start with http://"),
        (["generate", "--prompt", "hi", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["generate", "--prompt", "hi", "--device", "gpu0"], "device must be auto, cpu, cuda or cuda:N"),
        (["generate"], "the following arguments are required: --prompt"),
        (["generate", "--prompt", "hi", "--model", str(tmp_path)], "no config.json and not exactly one *.gguf"),
        (["bench", "serve", "--trace", str(tmp_path / "missing.json")], "missing.json"),
        (["generate", "--prompt", "hi", "--model", str(tmp_path / "bad" / "garbage.gguf")],
         "garbage.gguf: not a GGUF file we can read"),
    ]
    procs = [(args, want, subprocess.Popen(cli(*args), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)) for args, want in cases]
    for args, want, p in procs:
        out, err = p.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert p.returncode == 2, (args, out, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], (args, err)


def _fail_with(exc: BaseException):
    def run(args):
        raise exc
    return run


def _no_arguments(parser):
    pass


@pytest.mark.parametrize("exc, code", [
    (ConnectionRefusedError(111, "Connection refused"), 2),
    (PermissionError(13, "Permission denied", "/root/x"), 2),
    (KeyboardInterrupt(), 130),
])
def test_known_user_errors_and_ctrl_c_exit_codes(monkeypatch, capsys, exc, code):
    import realexec.cli as cli_mod

    monkeypatch.setitem(cli_mod.COMMANDS, "boom", cli_mod.Command("t", f"{__name__}:_no_arguments", "x:y"))
    monkeypatch.setattr(cli_mod, "_load", lambda ref: _no_arguments if ref.endswith("_no_arguments")
                        else _fail_with(exc))
    assert cli_mod.main(["boom"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == (1 if code == 2 else 0) and (code != 2 or err.startswith("error: "))


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only known user errors are shortened: a RuntimeError or KeyError from our own code
    propagates (python prints its traceback)."""
    import realexec.cli as cli_mod

    monkeypatch.setitem(cli_mod.COMMANDS, "boom", cli_mod.Command("t", f"{__name__}:_no_arguments", "x:y"))
    for exc in (RuntimeError("bug"), KeyError("float64")):
        monkeypatch.setattr(cli_mod, "_load", lambda ref, exc=exc: _no_arguments if ref.endswith("_no_arguments")
                            else _fail_with(exc))
        with pytest.raises(type(exc)):
            cli_mod.main(["boom"])


def test_engine_args_reject_bad_dtype_and_device_before_loading():
    from realexec.config import EngineArgs

    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="float64").validate()
    with pytest.raises(ValueError, match="device must be"):
        EngineArgs(device="cuda0").validate()
    EngineArgs(dtype="bf16", device="cuda:1").validate()         # both fine (nothing is loaded)


def test_resolve_dtype_names_the_choices():
    import torch

    from realexec.models.loader import resolve_dtype

    with pytest.raises(ValueError, match="dtype must be auto or one of float32"):
        resolve_dtype("float64", torch.device("cpu"), None)
    assert resolve_dtype("bf16", torch.device("cpu"), None) is torch.bfloat16


# ----------------------------------------------------------------------------- generate: streaming, Ctrl-C

class StreamReader:
    """Collects a pipe's bytes in a thread, noting whether the process was still running
    when the first ones came."""

    def __init__(self, proc: subprocess.Popen, pipe):
        self.proc, self.pipe = proc, pipe
        self.data = b""
        self.first_while_running: bool | None = None
        self.first_chunk = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while chunk := self.pipe.read1(1 << 16):
            if self.first_while_running is None:
                self.first_while_running = self.proc.poll() is None
                self.first_chunk = len(chunk)
            self.data += chunk

    def wait_for(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.data):
                return True
            if not self.thread.is_alive():
                return predicate(self.data)
            time.sleep(0.05)
        return False


@contextlib.contextmanager
def cli_process(*args: str):
    """A `python -m realexec ...` subprocess whose stdout and stderr are read as they come;
    killed if still running, and its readers joined, on the way out."""
    proc = subprocess.Popen(cli(*args), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = StreamReader(proc, proc.stdout), StreamReader(proc, proc.stderr)
    try:
        yield proc, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.thread.join(5)
        err.thread.join(5)


def test_generate_streams_says_it_capped_and_stops_on_ctrl_c_with_abort(tiny_dir):
    """stdout is a pipe (not a terminal): text still arrives while the request runs; the
    --max-tokens cap is announced up front; SIGINT ends it with the text so far, finish
    reason `abort` and exit code 130 (no traceback)."""
    from transformers import AutoTokenizer

    prompt = "Once upon a time"
    n_prompt = len(AutoTokenizer.from_pretrained(tiny_dir)(prompt).input_ids)
    with cli_process("generate", "--model", tiny_dir, "--prompt", prompt, "--max-tokens", "100000",
                     "--ignore-eos", "--kv-cache-memory", "0.05", "--swap-space", "0") as (proc, out, err):
        assert out.wait_for(lambda d: len(d.decode(errors="replace").strip()) >= 20, timeout=240), \
            (out.data, err.data)
        assert out.first_while_running, "the first text came only after generate had exited"
        assert out.first_chunk < 4096, "stdout was not flushed: the first text came as a full buffer (8 KB)"
        assert proc.poll() is None, "2046 tokens should take longer than this"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    stdout, stderr = out.data.decode(), err.data.decode()
    assert code == 130, (stdout[-300:], stderr)
    assert f"note: --max-tokens 100000 capped at {2048 - n_prompt}: max_model_len 2048 minus the prompt's " \
           f"{n_prompt} tokens" in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    *text, last = stdout.rstrip("\n").split("\n")
    m = re.fullmatch(r"\[finish_reason: abort, (\d+) tokens\]", last)
    assert m and 0 < int(m.group(1)) < 2048 - n_prompt, last
    assert len("\n".join(text).strip()) >= 20                   # what was streamed stays


def test_generate_to_the_end_of_the_context_says_so(tiny_dir):
    r = run_cli("generate", "--model", tiny_dir, "--prompt", "Hi", "--max-tokens", "50", "--ignore-eos",
                "--max-model-len", "40", "--kv-cache-memory", "0.05", "--swap-space", "0")
    assert r.returncode == 0, r.stderr
    n = 40 - int(re.search(r"capped at (\d+)", r.stderr).group(1))                # prompt tokens
    assert r.stdout.rstrip("\n").rsplit("\n", 1)[1] == \
        f"[finish_reason: length, {40 - n} tokens (cut off: the context is full at max_model_len 40)]"


# ----------------------------------------------------------------------------- quiet exits

def test_frozen_startup_heap_leaves_no_nanobind_leak_report():
    """gc.freeze() hid Triton's nanobind objects from the interpreter's last collections:
    ~30 'nanobind: leaked ...' lines after every clean `serve`/`profile` exit."""
    pytest.importorskip("triton")
    code = ("import triton, triton._C.libtriton\n"
            "from realexec.engine.llm_engine import freeze_startup_heap\n"
            "assert freeze_startup_heap() > 0\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "nanobind: leaked" not in r.stderr, r.stderr[:500]


def test_short_serve_run_exits_quietly(tiny_dir, tmp_path):
    """`serve` started, stopped with SIGINT (drain, exit 0): nothing alarming in its output."""
    pytest.importorskip("uvicorn")
    with realexec_server(["--model", tiny_dir, "--kv-cache-memory", "0.05", "--swap-space", "0",
                          "--log-level", "warning"], tmp_path / "serve.log", ready_timeout=240, cwd=ROOT,
                         env=env()) as server:
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=120)
    out = server.output()
    assert code == 0, out[-2000:]
    assert "stopped; 0 KV blocks in use" in out
    assert "nanobind: leaked" not in out, out[:1000]


@pytest.mark.slow
def test_local_ray_cluster_starts_without_the_token_auth_warning(tiny_dir):
    pytest.importorskip("ray")
    r = run_cli("generate", "--model", tiny_dir, "--prompt", "Hi", "--max-tokens", "2",
                "--distributed-executor-backend", "ray", "--kv-cache-memory", "0.05", "--swap-space", "0",
                timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Token authentication" not in r.stderr, r.stderr[-3000:]
    assert "[finish_reason: length, 2 tokens" in r.stdout


# ----------------------------------------------------------------------------- help texts

def test_bench_kernels_and_bench_gpu_help():
    from realexec.bench.graphs import add_kernels_arguments

    p = argparse.ArgumentParser()
    add_kernels_arguments(p)
    assert all(a.help for a in p._actions), [a.dest for a in p._actions if not a.help]
    r = subprocess.run([sys.executable, "-m", "realexec.bench.gpu", "--help"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "==SUPPRESS==" not in r.stdout, r.stdout
    for flag in ("--steps STEPS", "--greedy-tokens GREEDY_TOKENS"):
        assert re.search(rf"{flag}\s+\S", r.stdout), (flag, r.stdout)      # the flag has a help text


# ----------------------------------------------------------------------------- GGUF conversion cache

def write_tiny_gguf(path: Path, seed: int = 0, arch: str = "llama") -> None:
    """A 1-layer Llama GGUF with random fp32 weights (no tokenizer)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads, vocab = 16, 32, 2, 1, 40
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads),
                       (w.add_head_count_kv, kv_heads), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_rope_freq_base, 10000.0)]:
        add(value)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
              "blk.0.attn_v.weight": (kv_heads * head_dim, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_copies_share_one_cache_entry_and_first_use_says_where(tmp_path, monkeypatch, capsys):
    """The conversion is keyed by the file's content, not its path or mtime: two clones'
    copies of one GGUF share one converted directory (was: one 538 MB copy each)."""
    from realexec.models import loader

    cache = tmp_path / "cache"
    monkeypatch.setenv("TWINSERVE_CACHE_DIR", str(cache))       # honoured: no cache_dir argument below
    a = tmp_path / "clone-a" / "m.gguf"
    a.parent.mkdir()
    write_tiny_gguf(a)
    b = tmp_path / "clone-b" / "m.gguf"
    b.parent.mkdir()
    shutil.copy(a, b)                                           # another path, another mtime
    os.utime(b, ns=(a.stat().st_mtime_ns + 10**9,) * 2)

    first = loader.resolve_model_dir(a)
    err = capsys.readouterr().err
    assert first.parent == cache and (first / "config.json").is_file()
    assert err.count("\n") == 1 and f"converting m.gguf once to fp32 weights in {first}" in err
    assert "TWINSERVE_CACHE_DIR" in err

    monkeypatch.setattr(loader, "_write_hf_dir_from_gguf",
                        lambda *a: pytest.fail("the copy was converted again"))
    assert loader.resolve_model_dir(b) == first
    assert capsys.readouterr().err == ""                        # said once, on first use only
    assert [p.name for p in cache.iterdir()] == [first.name]

    c = tmp_path / "clone-c" / "m.gguf"                         # other bytes: another entry
    c.parent.mkdir()
    write_tiny_gguf(c, seed=1)
    monkeypatch.undo()
    monkeypatch.setenv("TWINSERVE_CACHE_DIR", str(cache))
    assert loader.resolve_model_dir(c) != first
    assert len(list(cache.iterdir())) == 2


def test_unsupported_gguf_is_a_value_error_and_leaves_nothing_in_the_cache(tmp_path, capsys):
    from realexec.models import loader

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(ValueError, match="m.gguf: GGUF architecture 'gpt2' not supported"):
        loader.resolve_model_dir(path, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []           # the temporary directory is gone
    assert "converting" not in capsys.readouterr().err          # nothing announced for it
