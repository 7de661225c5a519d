"""RMSNorm / LayerNorm over rows that are not contiguous: one kernel where PyTorch takes two.

The paged attention layer computes its x projections as one GEMM (`MLA.fuse`) and normalises
slices of its output: q_a_proj's [T, q_lora] (q_a_layernorm), the latent of kv_a_proj's [T, r]
(kv_a_layernorm) and the indexer's wk [T, DI] (k_norm, a LayerNorm). With T > 1 such a slice's rows
are strided, and PyTorch's fused norms copy it to a contiguous tensor first: on an H100 a verify of
4 rows ran 36 such copies (67 us of its 1,068 us of kernels) before 36 norms. Here a program reads
one row through its stride and writes the normalised row to a new contiguous tensor: fp32 inside,
one rounding to x's dtype (as PyTorch's fused norms), weight and bias applied in fp32. (The two
key norms now run inside the paged KV write, `kv_write`, with the same math: `norm_stats`,
`norm_apply`; q_a_layernorm's slice is this kernel's.)

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
def norm_stats(x, mask, D, eps, RMS: tl.constexpr):
    """x: fp32 [BLOCK] values of a row of D (padding lanes 0) -> (mean, den) such that the norm is
    (x - mean) / den: RMSNorm's (0, √(mean x² + eps)), LayerNorm's (mean x, √(var x + eps))."""
    if RMS:
        mean = 0.0
        centred = x
    else:
        mean = tl.sum(x, 0) / D
        centred = tl.where(mask, x - mean, 0.0)
    # sqrt_rn (and div_rn in norm_apply): IEEE root and division, as PyTorch's kernels (Triton's are approximate)
    return mean, tl.sqrt_rn(tl.sum(centred * centred, 0) / D + eps)


@triton.jit
def norm_apply(x, w_ptr, b_ptr, offs, mask, mean, den, HAS_BIAS: tl.constexpr):
    """The norm of some of a row's values x (fp32, at offs of the row; stats from `norm_stats`):
    (x - mean) / den · w[offs] (+ b[offs]), fp32."""
    y = tl.math.div_rn(x - mean, den) * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return y


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
    mean, den = norm_stats(x, mask, D, eps, RMS)
    y = norm_apply(x, w_ptr, b_ptr, offs, mask, mean, den, HAS_BIAS)
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


def kernel_norm(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, float, bool] | None:
    """(weight, bias or None, eps, rms) of a norm the kernels compute as `module` does on inputs of
    `dtype` — megactx's RMSNorm or an affine nn.LayerNorm over one dim, parameters in that dtype
    (fp32, bf16 or fp16) — else None (the module runs itself)."""
    if not isinstance(module, (RMSNorm, nn.LayerNorm)) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    weight, bias = module.weight, getattr(module, "bias", None)
    if weight is None or weight.dim() != 1 or weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
        return None
    return weight, bias, float(module.eps), isinstance(module, RMSNorm)


def norm_rows(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """module(x) for megactx's RMSNorm or an affine nn.LayerNorm over x's last dim, as a new
    contiguous tensor: strided rows (x [..., D] with its last dim contiguous, e.g. a column slice of
    a fused projection's output) in one kernel; anything else through the module itself."""
    params = None if x.is_contiguous() else kernel_norm(module, x.dtype)
    if (params is None or params[0].shape != x.shape[-1:]
            or (torch.is_grad_enabled() and (x.requires_grad or params[0].requires_grad))):  # no backward here
        return module(x)
    weight, bias, eps, rms = params
    stride = _rows_stride(x)
    if stride is None:
        return module(x)
    check_device(x, weight)
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // D if D else 0
    if rows:
        _norm_rows_kernel[(rows,)](x, stride, weight, weight if bias is None else bias, out, eps, D,
                                   BLOCK_D=next_power_of_2(D), RMS=rms, HAS_BIAS=bias is not None,
                                   OUT_BF16=x.dtype == torch.bfloat16, num_warps=4 if D >= 1024 else 1)
    return out
