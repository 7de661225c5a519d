"""The FP8 indexer queries of a full layer in one kernel; twin: `reference.index_queries_fp8`.

On an FP8 indexer cache the paged forward turns the indexer's projections into its logits' inputs:
rope on the first `rope_dims` dims of every head (the result half-split, rounded to q's dtype), the
[DI, DI] Hadamard rotation in fp32, a per-head FP8 e4m3 quantization, and the head weights times
HI^-1/2, DI^-1/2 and each head's scale. In PyTorch (after the fused rope) that is a cast, a matmul,
six kernels of quantization and three multiplications: ~12 launches a full layer, in a decode step
that is bound by its launches (megactx-tiny: four full layers, plus the MTP layer's). Here one program
for a token's 16 heads does all of it in registers: the rotation as three fp32 dots (the rotated
firsts, the rotated seconds and the passed-through dims against their rows of the Hadamard matrix),
so no register tile has to be re-laid out; the e4m3 rounding on the bits (`common.quantize_e4m3`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import cdiv, check_device, quantize_e4m3, to_bf16
from megactx.kernels.rope import rotate_pairs
from megactx.model.quant import FP8

# Heads a program: the least rows of a dot (megactx-tiny's 4 heads are padded to it). Compiled for sm_90
# (Triton 3.9): 64 dims at 4 warps 167 registers, no spill; 128 (GLM-5.x) at 8 warps 255 and 80 bytes
# of spill (at 4 warps 8 KB; all 32 heads in one program spilled 160 bytes at 8 warps, 808 at 16).
BLOCK_H = 16


@triton.jit
def _index_queries_kernel(
    q_ptr, stride_qt, stride_qh,      # q: [T, HI, DI] before rope, last dim contiguous
    w_ptr, stride_wt,                 # w: [T, HI] fp32, the head weights' projection
    cos_ptr, sin_ptr, stride_cs,      # cos / sin: [1, T, ROPE] ([cos | cos], [-sin | sin])
    h_ptr,                            # Hadamard matrix [DI, DI] fp32, contiguous
    q8_ptr, w_out_ptr,                # [T, HI, DI] e4m3 and [T, HI] fp32, contiguous
    HI, w_scale_heads, w_scale_dim,
    DI: tl.constexpr, ROPE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROPE // 2
    REST: tl.constexpr = DI - ROPE
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t * stride_cs + i).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_cs + HALF + i).to(tl.float32)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]: 16 heads, a dot's least
    live = h < HI
    row = q_ptr + t * stride_qt + h * stride_qh
    first, second = rotate_pairs(row, i[None, :], live, c[None, :], sn[None, :], INTERLEAVE, HALF)
    if ROUND_BF16:  # the roped queries are q's dtype before the rotation, as the fused rope leaves them
        first = to_bf16(first).to(tl.float32)
        second = to_bf16(second).to(tl.float32)
    d = tl.arange(0, DI)[None, :]
    j = tl.arange(0, HALF)[:, None]
    # [firsts | seconds | rest] @ H, by the rows of H each part meets
    y = tl.dot(first, tl.load(h_ptr + j * DI + d), input_precision="ieee")
    y += tl.dot(second, tl.load(h_ptr + (HALF + j) * DI + d), input_precision="ieee")
    if REST > 0:
        r = tl.arange(0, REST)
        rest = tl.load(row + ROPE + r[None, :], mask=live, other=0.0).to(tl.float32)
        y += tl.dot(rest, tl.load(h_ptr + (ROPE + r[:, None]) * DI + d), input_precision="ieee")
    q8, scale = quantize_e4m3(y)  # [BLOCK_H, DI] e4m3 bytes, [BLOCK_H] (padding heads: zeros, scale 1e-12 / 448)
    tl.store(q8_ptr + (t * HI + h) * DI + d, q8, mask=live)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    w = tl.load(w_ptr + t * stride_wt + heads, mask=heads < HI, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + t * HI + heads, w * w_scale_heads * w_scale_dim * scale, mask=heads < HI)


def fits(head_dim: int, rope_dims: int) -> bool:
    """Whether the kernel takes this geometry: each dot's inner size (rope_dims / 2, and the dims past
    the rope ones unless there are none) a power of two >= 16, head_dim too."""
    def pow2_16(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    rest = head_dim - rope_dims
    return pow2_16(head_dim) and rope_dims % 2 == 0 and pow2_16(rope_dims // 2) and (rest == 0 or pow2_16(rest))


def takes(q: torch.Tensor, rope_dims: int) -> bool:
    """Whether `index_queries_fp8` takes these queries: bf16 or fp32, and a geometry that `fits`."""
    return q.dtype in (torch.bfloat16, torch.float32) and fits(q.shape[-1], rope_dims)


def index_queries_fp8(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                      rope_dims: int, rotation: torch.Tensor, w_scale_heads: float,
                      w_scale_dim: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, HI, DI] (the indexer's wq_b output before rope; any strides but the last dim's 1),
    w: [T, HI] fp32 (its weights_proj output), cos/sin: [1, T, rope_dims] from `Rotary`, rotation:
    [DI, DI] fp32 -> (q8: [T, HI, DI] e4m3, w: [T, HI] fp32 = w · w_scale_heads · w_scale_dim · each
    head's scale), with q ≈ q8 · scale the rotated queries. See the module docstring."""
    check_device(q, w, cos, sin, rotation)
    T, HI, DI = q.shape
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be bf16 or fp32 (the roped queries keep its dtype), got {q.dtype}")
    if not fits(DI, rope_dims):
        raise ValueError(f"index_queries_fp8 takes head dims and rope dims / 2 (and the dims past them) that are "
                         f"powers of two >= 16, got head_dim {DI}, rope_dims {rope_dims}; use the twin "
                         "(megactx.kernels.reference.index_queries_fp8)")
    if w.shape != (T, HI) or w.dtype != torch.float32 or rotation.shape != (DI, DI) or rotation.dtype != torch.float32:
        raise ValueError(f"w must be fp32 [{T}, {HI}] and rotation fp32 [{DI}, {DI}], got {w.dtype} "
                         f"{tuple(w.shape)} and {rotation.dtype} {tuple(rotation.shape)}")
    if cos.shape != (1, T, rope_dims) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [1, {T}, {rope_dims}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    rotation = rotation.contiguous()
    q8 = torch.empty(T, HI, DI, dtype=torch.uint8, device=q.device)  # e4m3 bytes, written on the bits
    w_out = torch.empty(T, HI, dtype=torch.float32, device=q.device)
    if T:
        _index_queries_kernel[(T, cdiv(HI, BLOCK_H))](
            q, q.stride(0), q.stride(1), w, w.stride(0), cos, sin, cos.stride(1), rotation, q8, w_out,
            HI, w_scale_heads, w_scale_dim,
            DI=DI, ROPE=rope_dims, INTERLEAVE=interleave, BLOCK_H=BLOCK_H, ROUND_BF16=q.dtype == torch.bfloat16,
            num_warps=4 if DI <= 64 else 8)
    return q8.view(FP8), w_out


__all__ = ["fits", "index_queries_fp8", "takes"]
