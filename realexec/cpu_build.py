"""Build and load the CPU C++ kernels (plain C ABI, no torch headers) with the system compiler.

Shared by the paged-attention kernel (`realexec.attention.cpu_backend`) and the fused
elementwise ops (`realexec.models.cpu_ops`). A source is compiled on first use with
`$CXX` (else g++/c++/clang++) into `$TWINSERVE_CACHE_DIR/kernels/` (default
~/.cache/twinserve), keyed by the source, the compiler and flags, and this CPU's feature
flags (-march=native), then loaded with ctypes. The flags link libgomp.so.1, the soname
torch's own OpenMP runtime is loaded under, so kernels and torch share one thread pool and
torch.set_num_threads applies to both. Imports neither torch nor triton.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno"]


class BuildError(RuntimeError):
    """A C++ kernel could not be compiled or loaded."""


def compiler(what: str, hint: str = "", error: type[BuildError] = BuildError) -> str:
    """The C++ compiler to use; raises `error` naming `what` (and `hint`) when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise error(f"no C++ compiler found (set $CXX, or install g++) to build {what}" + (f"; {hint}" if hint else ""))


def cpuinfo_line(*keys: str) -> str | None:
    """The first /proc/cpuinfo line starting with one of `keys`; None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    return cpuinfo_line("flags", "Features") or platform.processor()


def library_path(source: Path, compiler: str, flags: list[str]) -> Path:
    from realexec.models.loader import cache_root
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join([compiler] + flags).encode(),
                                     cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{key}.so"


def build(source: Path, what: str, *, flags: list[str] = FLAGS, hint: str = "",
          error: type[BuildError] = BuildError, verbose: bool = False) -> Path:
    """Compile `source` into the cache (if not there yet) and return the library's path.
    Concurrent builders (tensor-parallel workers) each compile to a temporary file and
    rename it into place, so a reader never sees a half-written library."""
    cxx = compiler(what, hint, error)
    path = library_path(source, cxx, flags)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cxx, *flags, str(source), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise error(f"building {what} failed ({' '.join(cmd)}):\n{res.stderr.strip()[-2000:]}")
        if verbose and res.stderr:
            print(res.stderr)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(path: Path, what: str, abi_symbol: str, abi_version: int,
         error: type[BuildError] = BuildError) -> ctypes.CDLL:
    """Load a built library and check its ABI version (`abi_symbol()` returns it)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise error(f"loading {what} {path} failed: {e}") from e
    if getattr(lib, abi_symbol)() != abi_version:
        raise error(f"{path}: ABI version mismatch (delete it to rebuild)")
    return lib
