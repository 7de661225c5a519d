"""Fused rotary embedding: one kernel where `megactx.model.layers.rope_first` (its twin) takes three.

`rope_first(x, cos, sin, interleave, rope_dims)` rotates the first `rope_dims` dims of every head of
x and passes the rest through, writing the rotated pairs half-split ([firsts | seconds]) as the
twin does. In PyTorch that is a gather (cat), a mul and an addcmul, plus a cat for the passed-through
dims; a decode step of a small model is bound by its kernel count (and a CUDA graph's launch by its
node count), and rope runs twice a layer, four times on a full layer. Here: one program per token,
every head of it; fp32 inside, one rounding (round to nearest even, on the GPU and in the
interpreter alike).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import cdiv, check_device, next_power_of_2, to_bf16


@triton.jit
def pair_offsets(i, INTERLEAVE: tl.constexpr, HALF: tl.constexpr):
    """Where the rope dims' pairs i sit in a row: (2i, 2i + 1) when INTERLEAVE, else (i, i + HALF)."""
    if INTERLEAVE:
        o1, o2 = 2 * i, 2 * i + 1
    else:
        o1, o2 = i, HALF + i
    return o1, o2


@triton.jit
def rotate(x1, x2, c, sn):
    """A pair's rotation: (x1 cos - x2 sin, x2 cos + x1 sin), the firsts and the seconds."""
    return x1 * c - x2 * sn, x2 * c + x1 * sn


@triton.jit
def rotate_pairs(row, i, mask, c, sn, INTERLEAVE: tl.constexpr, HALF: tl.constexpr):
    """The rotated pairs i of the rope dims at `row` (i: offsets [..., n], `pair_offsets`) ->
    (firsts, seconds) fp32."""
    o1, o2 = pair_offsets(i, INTERLEAVE, HALF)
    return rotate(tl.load(row + o1, mask=mask, other=0.0).to(tl.float32),
                  tl.load(row + o2, mask=mask, other=0.0).to(tl.float32), c, sn)


@triton.jit
def _rope_kernel(
    x_ptr, stride_xb, stride_xs, stride_xh,   # x: [B, S, H, D], last dim contiguous
    cos_ptr, sin_ptr, stride_cb, stride_cs,   # cos / sin: [B or 1, S, ROPE] ([cos | cos], [-sin | sin])
    out_ptr, stride_ob, stride_os, stride_oh,  # out: [B, S, H, D], last dim contiguous
    S, H,
    D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    b, s = tok // S, tok % S
    HALF: tl.constexpr = ROPE // 2
    i = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + b * stride_cb + s * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + b * stride_cb + s * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    mask = (h < H) & (i[None, :] < HALF)
    row = x_ptr + b * stride_xb + s * stride_xs + h * stride_xh
    first, second = rotate_pairs(row, i[None, :], mask, c[None, :], sn[None, :], INTERLEAVE, HALF)
    out = out_ptr + b * stride_ob + s * stride_os + h * stride_oh
    if OUT_BF16:
        tl.store(out + i[None, :], to_bf16(first), mask=mask)
        tl.store(out + HALF + i[None, :], to_bf16(second), mask=mask)
    else:
        tl.store(out + i[None, :], first.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF + i[None, :], second.to(out_ptr.dtype.element_ty), mask=mask)
    if ROPE < D:  # the dims after the rotated ones, as they are
        j = ROPE + tl.arange(0, BLOCK_REST)[None, :]
        rest_mask = (h < H) & (j < D)
        tl.store(out + j, tl.load(row + j, mask=rest_mask, other=0.0), mask=rest_mask)


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
               rope_dims: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, S, D] or [B, S, H, D] (any strides but the last dim's 1), cos/sin: [B or 1, S, rope_dims]
    from `Rotary` -> a new contiguous tensor like x: its first rope_dims dims (default all) rotated
    and laid out half-split, the rest copied. out: written instead (x's shape and dtype, any strides
    but the last dim's 1: e.g. the rope part of MLA's assembled query) and returned. Same contract as
    the twin `layers.rope_first`."""
    check_device(x, cos, sin)
    D = x.shape[-1]
    rope_dims = D if rope_dims is None else rope_dims
    if rope_dims % 2 or not 0 < rope_dims <= D or cos.shape[-1] != rope_dims or sin.shape != cos.shape:
        raise ValueError(f"rope over {rope_dims} of {D} dims needs an even count and cos/sin of that width, got "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    x4 = x if x.dim() == 4 else x.unsqueeze(2)  # [B, S, H, D]
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    B, S, H, _ = x4.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"out must be like x ({tuple(x.shape)} {x.dtype} on {x.device}) with its last dim "
                         f"contiguous, got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")
    out4 = out if out.dim() == 4 else out.unsqueeze(2)
    if out.numel():
        block_h = min(next_power_of_2(H), 16)
        _rope_kernel[(B * S, cdiv(H, block_h))](
            x4, x4.stride(0), x4.stride(1), x4.stride(2),
            cos, sin, cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
            out4, out4.stride(0), out4.stride(1), out4.stride(2), S, H,
            D=D, ROPE=rope_dims, INTERLEAVE=interleave, BLOCK_H=block_h,
            BLOCK_HALF=next_power_of_2(rope_dims // 2),
            BLOCK_REST=next_power_of_2(max(D - rope_dims, 1)), OUT_BF16=x.dtype == torch.bfloat16)
    return out
