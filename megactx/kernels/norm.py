"""RMSNorm / LayerNorm over rows that are not contiguous: one kernel where PyTorch takes two.

The paged attention layer computes its x projections as one GEMM (`MLA.fuse`) and normalises
slices of its output: q_a_proj's [T, q_lora] (q_a_layernorm), the latent of kv_a_proj's [T, r]
(kv_a_layernorm) and the indexer's wk [T, DI] (k_norm, a LayerNorm). With T > 1 such a slice's rows
are strided, and PyTorch's fused norms copy it to a contiguous tensor first: on an H100 a verify of
4 rows ran 36 such copies (67 us of its 1,068 us of kernels) before 36 norms. Here a program reads
one row through its stride and writes the normalised row to a new contiguous tensor: fp32 inside,
one rounding to x's dtype (as PyTorch's fused norms), weight and bias applied in fp32.

`norm_rows(x, module)` takes the module (megactx's `RMSNorm`, or `nn.LayerNorm` with an affine
weight) and its twin is the module itself; a contiguous x, one whose module keeps its weight in
another dtype, or one that needs gradients (the kernel has no backward) goes to the module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from megactx.kernels.common import check_device, next_power_of_2, to_bf16
from megactx.model.layers import RMSNorm


@triton.jit
def _norm_rows_kernel(
    x_ptr, stride_xr,   # x: [rows, D], last dim contiguous, rows stride_xr apart
    w_ptr, b_ptr,       # weight [D] (and bias [D] when HAS_BIAS), x's dtype
    out_ptr,            # [rows, D] contiguous
    eps, D,
    BLOCK_D: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_xr + offs, mask=mask, other=0.0).to(tl.float32)
    if not RMS:  # LayerNorm: centre first (padding lanes stay 0)
        x = tl.where(mask, x - tl.sum(x, 0) / D, 0.0)
    # div_rn / sqrt_rn: IEEE division and root, as PyTorch's kernels (Triton's `/` is approximate)
    y = tl.math.div_rn(x, tl.sqrt_rn(tl.sum(x * x, 0) / D + eps))
    y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OUT_BF16:
        y = to_bf16(y)
    tl.store(out_ptr + row * D + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_stride(x: torch.Tensor) -> int | None:
    """The one stride between consecutive rows of x [..., D] (last dim contiguous) viewed as
    [prod(...), D], or None when its leading dims do not form such rows."""
    if x.dim() < 2 or x.stride(-1) != 1:
        return None
    stride = None
    for size, st in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if stride is None:
            stride, inner = st, size
        elif st != stride * inner:
            return None
        else:
            inner *= size
    return x.shape[-1] if stride is None else stride


def norm_rows(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """module(x) for megactx's RMSNorm or an affine nn.LayerNorm over x's last dim, as a new
    contiguous tensor: strided rows (x [..., D] with its last dim contiguous, e.g. a column slice of
    a fused projection's output) in one kernel; anything else through the module itself."""
    if not isinstance(module, (RMSNorm, nn.LayerNorm)) or x.is_contiguous():
        return module(x)
    weight, bias, eps = module.weight, getattr(module, "bias", None), module.eps
    if (weight is None or weight.dtype != x.dtype or weight.shape != x.shape[-1:]
            or (bias is not None and bias.dtype != x.dtype)
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):  # no backward here
        return module(x)
    stride = _rows_stride(x)
    if stride is None:
        return module(x)
    rms = isinstance(module, RMSNorm)
    check_device(x, weight)
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // D if D else 0
    if rows:
        _norm_rows_kernel[(rows,)](x, stride, weight, weight if bias is None else bias, out, float(eps), D,
                                   BLOCK_D=next_power_of_2(D), RMS=rms, HAS_BIAS=bias is not None,
                                   OUT_BF16=x.dtype == torch.bfloat16, num_warps=4 if D >= 1024 else 1)
    return out
