"""The projections' matmul, and the CPU's pre-packed weight layout for it.

Every projection (fused qkv, o, fused gate/up, down, MoE routers and dense MLPs, the LM head)
goes through `project(x, weight, bias, packed)`. On a GPU that is F.linear on the
checkpoint's row-major weight. On the CPU, `pack_weights(model)` adds each weight in
oneDNN's blocked layout (torch.ops.mkldnn, the layout oneDNN's GEMM reads without
re-blocking per call: what vLLM's CPU backend does with its own oneDNN handle), which steps
of at least `min_rows` rows use; smaller steps take F.linear on the dense weight (MKL).

Where the two cross depends on the CPU, because MKL's small-row kernels are Intel's
(`default_packed_min_rows`):

- Intel (the 2-core AVX-512 Xeon dev host, one thread, SmolLM2's shapes, GFLOP/s, F.linear
  -> packed): 8 rows 28-30 -> 46-52 (LM head 12 -> 34), 64 rows 78-106 -> 91-110, 512 rows
  equal within 5%; at 1-3 rows oneDNN is 1.2-1.5x slower than MKL's GEMV: min_rows 4.
  See docs/lab/2026-11-27-cpu-packed-gemm.md.
- AMD (the 2-vCPU EPYC Zen 4 host): MKL's time grows with the rows from 1 to 3 (the same
  ~25 GFLOP/s at each: no weight reuse across rows) while oneDNN's packed GEMM reuses them,
  so packed wins from 2 rows by 1.6-2.3x, and at 1 row by 5% over the layers and 20% on
  the LM head; SmolLM2's decode steps of 1/2/3 sequences took 54/99/124 ms dense and
  50/57/46 ms packed (one thread): min_rows 1. See docs/lab/2026-11-29-small-rows.md.

Two libraries can hold the packed weights (EngineArgs.cpu_gemm, `default_cpu_gemm`): oneDNN
(an mkldnn tensor, `torch.ops.mkldnn._linear_pointwise`) and MKL's packed GEMM
(`cblas_sgemm_pack` / `cblas_sgemm_compute`, which torch's CPU build links and exports; called
here through ctypes, because torch's own `mkl_linear` uses the packed weight only when a step
has exactly the row count it was packed for). MKL's packed buffer serves any row count and
holds MKL's panels plus ~8-10 MB of its own per matrix: SmolLM2-135M's projections take 1.75 GB
packed against 0.42 GB dense (4x; a 4096x4096 matrix 1.3x, 14336x4096 1.1x). On Intel (the
2-core Emerald Rapids host, 2 threads, 30 layers of SmolLM2 projections, weights streamed from
memory, GFLOP/s, oneDNN -> MKL): 32 rows 155 -> 188, 48 rows 169 -> 212, 64 rows 195 -> 250,
128 rows 242 -> 262, 512 rows 287 -> 293, 1 row 10.0 -> 13.7 (dense MKL 13.3): MKL packed from
one row up. Elsewhere oneDNN (MKL runs generic kernels on AMD, see above).

Formats (EngineArgs.cpu_weight_format): "dense" (no packing), "packed" (the packed weight
replaces the dense one: no extra memory; every step packed), "both" (dense kept for steps
under min_rows rows: twice the projections' memory), "auto" ("packed" where min_rows is 1,
as no step would read the dense weights; else "both" while the projections weigh at most
AUTO_BOTH_MAX_BYTES, else "packed"). The LM head keeps its dense rows (a tied head is the
embedding table) and gets a packed copy in every format but "dense".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CPU_WEIGHT_FORMATS = ("auto", "dense", "packed", "both")
CPU_GEMMS = ("auto", "onednn", "mkl")
# Below this many rows MKL's GEMV on the dense weight beats oneDNN's packed kernel on Intel
# CPUs (`default_packed_min_rows`).
SMALL_ROWS = 4
# The row count oneDNN chooses its blocking for; 16..256 measured alike for 8..512 rows.
PACK_ROWS_HINT = 64
AUTO_BOTH_MAX_BYTES = 2 << 30
# "auto" keeps MKL's packed GEMM only while its buffers add at most this much memory (or this
# fraction of the dense weights, whichever is more): a model of many small matrices (MoE
# experts: ~10 MB each on top) packs with oneDNN instead.
MKL_AUTO_MAX_EXTRA_BYTES = 2 << 30
MKL_AUTO_MAX_EXTRA_FRACTION = 0.5
# What a packed Parameter carries besides its data (`packed_parameter`).
PACKED_ATTRS = ("min_rows", "mkl_shape")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...); "" where there is none."""
    from realexec.cpu_build import cpuinfo_line

    line = cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def default_packed_min_rows(vendor: str | None = None, gemm: str = "onednn") -> int:
    """The fewest rows a step needs to run on the packed weights (see the module doc): 1 for
    MKL's packed GEMM (it beats MKL's dense GEMV from one row) and for oneDNN on AMD;
    SMALL_ROWS for oneDNN on Intel and on CPUs not measured."""
    if gemm == "mkl":
        return 1
    vendor = cpu_vendor() if vendor is None else vendor
    return 1 if vendor == "AuthenticAMD" else SMALL_ROWS


def default_cpu_gemm(vendor: str | None = None) -> str:
    """The library that packs the weights on this CPU: MKL on Intel (where torch's build
    exports MKL's packed GEMM), oneDNN elsewhere (see the module doc)."""
    vendor = cpu_vendor() if vendor is None else vendor
    return "mkl" if vendor == "GenuineIntel" and _mkl.available() else "onednn"


def resolve_cpu_gemm(gemm: str | None) -> str:
    """"auto" (or None) -> this CPU's default; "mkl" where torch's build lacks MKL's packed
    GEMM is refused."""
    if gemm in (None, "auto"):
        return default_cpu_gemm()
    if gemm not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm must be one of {', '.join(CPU_GEMMS)}, got {gemm!r}")
    if gemm == "mkl" and not _mkl.available():
        raise ValueError("cpu_gemm 'mkl': this torch build does not export MKL's packed GEMM "
                         "(cblas_sgemm_pack/compute); use onednn")
    return gemm


class _Mkl:
    """MKL's packed sgemm, from the libtorch_cpu that torch already loaded (ctypes: the call
    releases the GIL; MKL runs on torch's OpenMP threads)."""
    ROW_MAJOR, NO_TRANS, TRANS, B_MATRIX, PACKED = 101, 111, 112, 162, 151

    def __init__(self):
        self._lib = None
        self._checked = False

    def available(self) -> bool:
        if not self._checked:
            self._checked = True
            self._lib = self._load()
        return self._lib is not None

    @staticmethod
    def _load():
        import ctypes
        import os

        if not torch.backends.mkl.is_available():
            return None
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
        except (OSError, AttributeError):
            return None
        i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        get_size.restype, get_size.argtypes = ctypes.c_size_t, [i, i, i, i]
        pack.restype, pack.argtypes = None, [i, i, i, i, i, i, f, p, i, p]
        compute.restype, compute.argtypes = None, [i, i, i, i, i, i, p, i, p, i, f, p, i]
        return lib

    def packed_nbytes(self, weight: torch.Tensor) -> int:
        """Bytes of `weight`'s packed buffer (MKL's panels plus its own ~8-10 MB)."""
        n, k = weight.shape
        return int(self._lib.cblas_sgemm_pack_get_size(self.B_MATRIX, PACK_ROWS_HINT, n, k))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] fp32 -> MKL's packed buffer of weight^T (uint8). MKL's buffer holds
        internal pointers: it must stay where it was packed (a torch tensor never moves)."""
        n, k = weight.shape
        w = weight.detach().contiguous()
        buf = torch.empty(self.packed_nbytes(w), dtype=torch.uint8)
        self._lib.cblas_sgemm_pack(self.ROW_MAJOR, self.B_MATRIX, self.TRANS, PACK_ROWS_HINT, n, k, 1.0,
                                   w.data_ptr(), k, buf.data_ptr())
        return buf

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = packed.mkl_shape
        if x.shape[-1] != k:
            raise ValueError(f"projection input has {x.shape[-1]} features, the packed weight takes {k}")
        a = x.reshape(-1, k)
        if a.dtype != torch.float32 or not a.is_contiguous():
            a = a.float().contiguous()
        m = a.shape[0]
        out = torch.empty(m, n, dtype=torch.float32)
        if m:
            self._lib.cblas_sgemm_compute(self.ROW_MAJOR, self.NO_TRANS, self.PACKED, m, n, k, a.data_ptr(), k,
                                          packed.data_ptr(), n, 0.0, out.data_ptr(), n)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], n)


_mkl = _Mkl()


def mkl_available() -> bool:
    """Whether this torch build exports MKL's packed GEMM."""
    return _mkl.available()


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return _mkl.linear(x, packed, bias)


def is_packed(weight: torch.Tensor | None) -> bool:
    """Whether `weight` is a packed weight rather than a dense matrix: oneDNN's (an mkldnn
    tensor) or MKL's (a uint8 buffer; no projection weight is uint8 otherwise)."""
    return weight is not None and (weight.is_mkldnn or weight.dtype == torch.uint8)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> x @ weight^T + bias [..., out]. `weight` may itself be packed (the
    "packed" format); `packed`, when given, is its packed twin, used from its `min_rows`
    rows (`packed_parameter`)."""
    if is_packed(weight):
        return _packed_linear(x, weight, bias)
    if packed is not None and x.numel() >= packed.min_rows * x.shape[-1]:
        return _packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def weight_shape(weight: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a projection weight, dense or packed."""
    return tuple(getattr(weight, "mkl_shape", weight.shape))


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes in: its first floating-point parameter's (MKL's packed
    weights are uint8 buffers)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


class Linear(nn.Linear):
    """nn.Linear whose matmul is `project` (so it can run on packed weights)."""

    projects = True     # pack_weights packs this module's weight

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.register_parameter("weight_packed", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.weight_packed)


def packable(weight: torch.Tensor, gemm: str = "onednn") -> bool:
    """oneDNN packs 2-D fp32 CPU weights (bf16 too where the CPU has bf16 instructions); MKL's
    packed GEMM here is fp32 only (other dtypes fall back to oneDNN in `packed_parameter`)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or is_packed(weight) or weight.numel() == 0:
        return False
    if weight.dtype == torch.float32:
        return torch.backends.mkldnn.is_available() or (gemm == "mkl" and _mkl.available())
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_parameter(weight: torch.Tensor, min_rows: int = SMALL_ROWS, gemm: str = "onednn") -> nn.Parameter:
    """`weight` [out, in] packed by `gemm` ("onednn": its blocked layout, an mkldnn tensor of
    the weight's shape; "mkl": MKL's packed buffer, uint8, with `mkl_shape` = (out, in)), as a
    frozen Parameter; as the packed twin of a dense weight, `project` uses it for steps of
    at least `min_rows` rows."""
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    if gemm == "mkl" and weight.dtype == torch.float32 and _mkl.available():
        param = nn.Parameter(_mkl.pack(weight), requires_grad=False)
        param.mkl_shape = tuple(weight.shape)
    else:
        param = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT),
                             requires_grad=False)
    param.min_rows = min_rows
    return param


def projection_modules(model: nn.Module, gemm: str = "onednn") -> list[nn.Module]:
    """The modules whose `weight` is a projection run by `project` (LM head not included)."""
    return [m for m in model.modules() if getattr(m, "projects", False) and packable(m.weight, gemm)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack_weights(model: nn.Module, fmt: str = "auto", min_rows: int | None = None, gemm: str | None = None) -> dict:
    """Pack `model`'s projection weights for the CPU in format `fmt` (see the module doc) with
    library `gemm` (None / "auto": this CPU's, `default_cpu_gemm`, but oneDNN where MKL's
    buffers would add more than MKL_AUTO_MAX_EXTRA_BYTES / _FRACTION); packed twins serve steps
    of at least `min_rows` rows (None: the library's and CPU's default). Returns {"format":
    resolved format, "gemm": the library, "packed": weights packed, "extra_bytes": memory
    added, "min_rows": the rows from which the packed weights run}. A model on another
    device, or in a dtype neither library packs, is left alone."""
    if fmt not in CPU_WEIGHT_FORMATS:
        raise ValueError(f"cpu_weight_format must be one of {', '.join(CPU_WEIGHT_FORMATS)}, got {fmt!r}")
    auto_gemm = gemm in (None, "auto")
    gemm = resolve_cpu_gemm(gemm)
    if min_rows is not None and min_rows < 1:
        raise ValueError(f"cpu_packed_min_rows must be >= 1, got {min_rows}")
    modules = projection_modules(model, gemm)
    head = model.head_weight() if hasattr(model, "head_weight") else None
    pack_head = head is not None and packable(head, gemm)
    if auto_gemm and gemm == "mkl" and fmt != "dense":
        weights = [m.weight for m in modules] + ([head] if pack_head else [])
        fp32 = [w for w in weights if w.dtype == torch.float32]
        dense_bytes = sum(_nbytes(w) for w in fp32)
        mkl_extra = sum(_mkl.packed_nbytes(w) - _nbytes(w) for w in fp32)
        if mkl_extra > max(MKL_AUTO_MAX_EXTRA_BYTES, MKL_AUTO_MAX_EXTRA_FRACTION * dense_bytes):
            gemm = "onednn"
    min_rows = default_packed_min_rows(gemm=gemm) if min_rows is None else min_rows
    if fmt == "dense" or not (modules or pack_head):
        return {"format": "dense", "gemm": None, "packed": 0, "extra_bytes": 0, "min_rows": None}
    nbytes = sum(_nbytes(m.weight) for m in modules)
    if fmt == "auto":
        fmt = "both" if min_rows > 1 and nbytes <= AUTO_BOTH_MAX_BYTES else "packed"
    extra = 0
    for m in modules:
        packed = packed_parameter(m.weight, min_rows, gemm)
        extra += _nbytes(packed) - (_nbytes(m.weight) if fmt == "packed" else 0)
        if fmt == "both":
            m.weight_packed = packed
        else:
            m.weight = packed
    if pack_head:
        extra += model.pack_head(min_rows, gemm)
    return {"format": fmt, "gemm": gemm, "packed": len(modules) + int(pack_head), "extra_bytes": extra,
            "min_rows": min_rows}


def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Point parameter `name` at `tensor`. `.data =` where the layouts agree (the object the
    optimizer-free engine, CUDA graphs and compiled code hold stays the same); a new
    Parameter where the layouts or dtypes differ (a packed mkldnn tensor, which `.data`
    cannot take, or MKL's uint8 buffer). A packed Parameter's `min_rows` and `mkl_shape`
    go with it."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    param = getattr(module, leaf)
    if param.is_mkldnn == tensor.is_mkldnn and param.dtype == tensor.dtype:
        param.data = tensor
    else:
        param = nn.Parameter(tensor, requires_grad=False)
        setattr(module, leaf, param)
    for attr in PACKED_ATTRS:            # a packed weight's rule and shape go with it (`packed_parameter`)
        if hasattr(tensor, attr):
            setattr(param, attr, getattr(tensor, attr))
