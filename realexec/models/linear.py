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
# Below this many rows MKL's GEMV on the dense weight beats oneDNN's packed kernel on Intel
# CPUs (`default_packed_min_rows`).
SMALL_ROWS = 4
# The row count oneDNN chooses its blocking for; 16..256 measured alike for 8..512 rows.
PACK_ROWS_HINT = 64
AUTO_BOTH_MAX_BYTES = 2 << 30


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...); "" where there is none."""
    from realexec.cpu_build import cpuinfo_line

    line = cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def default_packed_min_rows(vendor: str | None = None) -> int:
    """The fewest rows a step needs to run on the packed weights, by CPU vendor (see the
    module doc): 1 on AMD, SMALL_ROWS on Intel and on CPUs not measured."""
    vendor = cpu_vendor() if vendor is None else vendor
    return 1 if vendor == "AuthenticAMD" else SMALL_ROWS


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> x @ weight^T + bias [..., out]. `weight` may itself be packed (the
    "packed" format); `packed`, when given, is its packed twin, used from its `min_rows`
    rows (`packed_parameter`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if packed is not None and x.numel() >= packed.min_rows * x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose matmul is `project` (so it can run on packed weights)."""

    projects = True     # pack_weights packs this module's weight

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.register_parameter("weight_packed", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.weight_packed)


def packable(weight: torch.Tensor) -> bool:
    """oneDNN packs 2-D fp32 CPU weights (bf16 too where the CPU has bf16 instructions)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.is_mkldnn or weight.numel() == 0:
        return False
    if weight.dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_parameter(weight: torch.Tensor, min_rows: int = SMALL_ROWS) -> nn.Parameter:
    """`weight` [out, in] in oneDNN's blocked layout, as a frozen Parameter; as the packed twin
    of a dense weight, `project` uses it for steps of at least `min_rows` rows."""
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    param = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT),
                         requires_grad=False)
    param.min_rows = min_rows
    return param


def projection_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose `weight` is a projection run by `project` (LM head not included)."""
    return [m for m in model.modules() if getattr(m, "projects", False) and packable(m.weight)]


def pack_weights(model: nn.Module, fmt: str = "auto", min_rows: int | None = None) -> dict:
    """Pack `model`'s projection weights for the CPU in format `fmt` (see the module doc);
    packed twins serve steps of at least `min_rows` rows (None: this CPU's default). Returns
    {"format": resolved format, "packed": weights packed, "extra_bytes": memory added,
    "min_rows": the rows from which the packed weights run}. A model on another device, or
    in a dtype oneDNN does not pack, is left alone."""
    if fmt not in CPU_WEIGHT_FORMATS:
        raise ValueError(f"cpu_weight_format must be one of {', '.join(CPU_WEIGHT_FORMATS)}, got {fmt!r}")
    min_rows = default_packed_min_rows() if min_rows is None else min_rows
    if min_rows < 1:
        raise ValueError(f"cpu_packed_min_rows must be >= 1, got {min_rows}")
    modules = projection_modules(model)
    head = model.head_weight() if hasattr(model, "head_weight") else None
    pack_head = head is not None and packable(head)
    if fmt == "dense" or not (modules or pack_head):
        return {"format": "dense", "packed": 0, "extra_bytes": 0, "min_rows": None}
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in modules)
    if fmt == "auto":
        fmt = "both" if min_rows > 1 and nbytes <= AUTO_BOTH_MAX_BYTES else "packed"
    extra = nbytes if fmt == "both" else 0
    for m in modules:
        if fmt == "both":
            m.weight_packed = packed_parameter(m.weight, min_rows)
        else:
            m.weight = packed_parameter(m.weight, min_rows)
    if pack_head:
        extra += model.pack_head(min_rows)
    return {"format": fmt, "packed": len(modules) + int(pack_head), "extra_bytes": extra, "min_rows": min_rows}


def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Point parameter `name` at `tensor`. `.data =` where the layouts agree (the object the
    optimizer-free engine, CUDA graphs and compiled code hold stays the same); a new
    Parameter where one side is a packed (mkldnn) tensor, which `.data` cannot take. A
    packed Parameter's `min_rows` is kept."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    param = getattr(module, leaf)
    if param.is_mkldnn == tensor.is_mkldnn:
        param.data = tensor
    else:
        param = nn.Parameter(tensor, requires_grad=False)
        setattr(module, leaf, param)
    if hasattr(tensor, "min_rows"):      # a packed twin's rule goes with it (`packed_parameter`)
        param.min_rows = tensor.min_rows
