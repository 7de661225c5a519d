"""fp32 x·Wᵀ for a few rows: the MoE routers and the indexers' head weights of a decode step or a
speculative verify.

Those weights stay fp32 (as in the published checkpoints) while x is the model's dtype, so PyTorch
first casts x to fp32 (a kernel), then for 2-8 rows cuBLAS picks a SIMT GEMM plus a split-K
reduction, two kernels of ~5 us at megactx-tiny's size where one row gets a ~2 us gemv (an H100's
verify graph, 2026-12-05: 17 such pairs, 90 us of its 1,050 us of kernels; a batched gemv with the
weight broadcast, ~2.2 us on its own, was given the same GEMM inside the engine). Here one kernel:
it reads x in its own dtype and widens it to fp32 (exact: the cast's values), each program takes
BLOCK_E output columns (rows of W) for every row of x and sums x·w over D in fp32 (products and
sums, no tensor-core dot: no TF32 rounding), reading W once. Its programs walk D in series, so a
large W (GLM-5.2's routers) is slower than cuBLAS: `linear_fp32` sends only small ones here
(measured there).

The twin is `F.linear(x.float(), w)` itself; `megactx.model.layers.linear_fp32` picks this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import cdiv, check_device, next_power_of_2

MAX_ROWS = 8  # rows of x a launch takes (its [rows, BLOCK_E, BLOCK_D] products stay in registers)
PROGRAMS = 128  # about one wave on an H100 / H200: W is read once, spread over the SMs


@triton.jit
def rows_dot_w(x_ptr, stride_x, offs_r, R, w_ptr, stride_w, offs_e, E, D, BLOCK_D: tl.constexpr):
    """x[offs_r] · w[offs_e]ᵀ -> fp32 [BLOCK_R, BLOCK_E] (0 outside R rows, E columns): x [R, D] of
    any float dtype, widened; w [E, D] fp32; products and sums in fp32, BLOCK_D dims at a time."""
    acc = tl.zeros([offs_r.shape[0], offs_e.shape[0]], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_x + offs_d[None, :],
                    mask=(offs_r[:, None] < R) & (offs_d[None, :] < D), other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_D]
        w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_d[None, :],
                    mask=(offs_e[:, None] < E) & (offs_d[None, :] < D), other=0.0)  # [BLOCK_E, BLOCK_D]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _linear_rows_kernel(
    x_ptr, stride_x,    # x: [R, D] fp32, bf16 or fp16, rows stride_x apart
    w_ptr, stride_w,    # w: [E, D] fp32, rows stride_w apart
    out_ptr,            # [R, E] fp32 contiguous
    R, E, D,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_r = tl.arange(0, BLOCK_R)
    acc = rows_dot_w(x_ptr, stride_x, offs_r, R, w_ptr, stride_w, offs_e, E, D, BLOCK_D)
    tl.store(out_ptr + offs_r[:, None] * E + offs_e[None, :], acc, mask=(offs_r[:, None] < R) & (offs_e[None, :] < E))


X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., D] (fp32, bf16 or fp16) with at most MAX_ROWS rows, w [E, D] fp32 -> x·wᵀ [..., E]
    fp32, as F.linear(x.float(), w)."""
    D = x.shape[-1]
    if x.dtype not in X_DTYPES or w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] != D:
        raise ValueError(f"linear_rows needs x [..., D] in fp32, bf16 or fp16 and fp32 w [E, D], got x "
                         f"{x.dtype} {tuple(x.shape)} and w {w.dtype} {tuple(w.shape)}")
    rows = x.reshape(-1, D)  # a view for the callers' contiguous rows
    R, E = rows.shape[0], w.shape[0]
    if R > MAX_ROWS:
        raise ValueError(f"linear_rows takes at most {MAX_ROWS} rows, got {R}: use F.linear")
    check_device(x, w)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty(R, E, dtype=torch.float32, device=x.device)
    if R and E:
        block_r = next_power_of_2(R)
        block_e = min(16, max(1, next_power_of_2(cdiv(E, PROGRAMS))))
        # at most 4096 products a step: 32 registers a thread of 4 warps
        block_d = min(256, next_power_of_2(D), max(16, 4096 // (block_r * block_e)))
        _linear_rows_kernel[(cdiv(E, block_e),)](rows, rows.stride(0), w, w.stride(0), out, R, E, D,
                                                BLOCK_R=block_r, BLOCK_E=block_e, BLOCK_D=block_d, num_warps=4)
    return out.view(*x.shape[:-1], E)
