"""Fused KV write: store new tokens' MLA latent + rope key (+ indexer key) into the paged caches.

One Triton program per token writes its row of the MLA cache (bf16, or the FP8 656-byte layout)
and, on full layers, its indexer key; layouts are in `megactx.kernels.reference`, whose `write_kv`
is this kernel's twin. Byte for byte the kernel matches the twin run on a CPU: same scales
(amax / 448, IEEE division), same clamp to ±448, round-to-nearest-even casts. (The twin run on
CUDA can differ by an ulp in a scale: PyTorch there divides by a Python scalar through its
reciprocal.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import check_device, next_power_of_2, quantize_e4m3, to_bf16
from megactx.kernels.reference import BLOCK_SIZE, SCALE_GROUP, mla_fp8_bytes

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _to_cache(x, BF16: tl.constexpr):
    """x -> the element type of an exact cache: bf16 (rounded to nearest even) or fp32."""
    if BF16:
        y = to_bf16(x)
    else:
        y = x.to(tl.float32)
    return y


# ------------------------------------------------------------------------------ kernel
@triton.jit
def _write_kv_kernel(
    c_ptr, stride_cn, stride_cd,          # c: [N, R] latent
    pe_ptr, stride_pn, stride_pd,         # k_pe: [N, DR] roped key
    ik_ptr, stride_in, stride_id,         # index_k: [N, DI] (HAS_INDEX)
    slots_ptr,                            # [N] int32/int64, -1 = skip
    kv_ptr,                               # bf16 [nb, 64, R + DR] or uint8 [nb, 64, ROW_BYTES]
    idx_ptr,                              # uint8 [nb, 64 * (DI + 4)] (HAS_INDEX)
    num_slots,                            # slots both caches hold
    R: tl.constexpr, DR: tl.constexpr, DI: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DI: tl.constexpr,
    FP8: tl.constexpr, HAS_INDEX: tl.constexpr, INDEX_FP8: tl.constexpr,
    KV_BF16: tl.constexpr, INDEX_BF16: tl.constexpr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    # the wrapper has already refused out-of-range slots (except under CUDA-graph capture, where it
    # cannot look): never write outside the caches
    if (slot < 0) | (slot >= num_slots):
        return

    # --- MLA cache
    d_pe = tl.arange(0, BLOCK_DR)
    pe = tl.load(pe_ptr + tok * stride_pn + d_pe * stride_pd, mask=d_pe < DR, other=0.0)
    if FP8:
        # row: R e4m3 | R / GROUP fp32 scales | DR bf16; R % 128 == 0 and DR even keep both aligned
        NG: tl.constexpr = R // GROUP
        ROW_BYTES: tl.constexpr = R + 4 * NG + 2 * DR
        row = kv_ptr + slot * ROW_BYTES
        g = tl.arange(0, BLOCK_R // GROUP)[:, None]
        d = g * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
        mask = d < R
        x = tl.load(c_ptr + tok * stride_cn + d * stride_cd, mask=mask, other=0.0).to(tl.float32)
        values, scale = quantize_e4m3(x)
        tl.store(row + d, values, mask=mask)
        gs = tl.arange(0, BLOCK_R // GROUP)
        tl.store((row + R).to(tl.pointer_type(tl.float32)) + gs, scale, mask=gs < NG)
        tl.store((row + R + 4 * NG).to(tl.pointer_type(tl.bfloat16)) + d_pe, to_bf16(pe), mask=d_pe < DR)
    else:
        row = kv_ptr + slot * (R + DR)
        d = tl.arange(0, BLOCK_R)
        x = tl.load(c_ptr + tok * stride_cn + d * stride_cd, mask=d < R, other=0.0)
        tl.store(row + d, _to_cache(x, KV_BF16), mask=d < R)
        tl.store(row + R + d_pe, _to_cache(pe, KV_BF16), mask=d_pe < DR)

    # --- indexer cache: a block is 64 keys of DI e4m3 bytes, then their 64 fp32 scales
    if HAS_INDEX:
        di = tl.arange(0, BLOCK_DI)[None, :]  # one group of DI: one scale per key
        k = tl.load(ik_ptr + tok * stride_in + di * stride_id, mask=di < DI, other=0.0).to(tl.float32)
        if INDEX_FP8:
            block_base = idx_ptr + (slot // BLOCK) * (BLOCK * (DI + 4))
            offset = slot % BLOCK
            values, scale = quantize_e4m3(k)
            tl.store(block_base + offset * DI + di, values, mask=di < DI)
            tl.store((block_base + BLOCK * DI).to(tl.pointer_type(tl.float32)) + offset + tl.arange(0, 1), scale)
        else:  # exact keys: [num_blocks, 64 * DI] of the cache's float dtype, a key every DI values
            tl.store(idx_ptr + slot * DI + di, _to_cache(k, INDEX_BF16), mask=di < DI)


# ------------------------------------------------------------------------------ wrapper
def _check_2d(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] == 0:
        raise ValueError(f"{name} must be [N, dim] with N = {n} (slots' length), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def write_kv(c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
             index_k: torch.Tensor | None = None, index_cache: torch.Tensor | None = None, *,
             check_slots: bool = False) -> None:
    """Store new tokens into the paged caches, in place (the twin: `reference.write_kv`).

    c: [N, r] latent, k_pe: [N, dr] roped key (fp32/bf16/fp16, any strides: slices of one
    projection output are fine); slots: [N] int32/int64, block * 64 + offset, -1 = skip the token;
    kv_cache: bf16 (or fp32, exact) [num_blocks, 64, r + dr], or uint8 [num_blocks, 64,
    r + 4 r/128 + 2 dr] = FP8 (e4m3 latent, an fp32 scale per 128 values, bf16 rope); index_k:
    [N, DI] with index_cache: uint8 [num_blocks, 64 * (DI + 4)] (FP8) or bf16/fp32
    [num_blocks, 64 * DI] (exact) — full layers only. Two tokens given the same slot leave one of
    them, unspecified which.

    The kernel never writes outside the caches: it skips slots out of range as it skips -1.
    check_slots=True refuses them with a ValueError instead, at the cost of reading the slots back
    on the host (one sync; not under CUDA-graph capture) — for debugging, not for the hot path."""
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    N = slots.shape[0]
    _check_2d("c", c, N)
    _check_2d("k_pe", k_pe, N)
    r, dr = c.shape[1], k_pe.shape[1]

    fp8 = kv_cache.dtype == torch.uint8
    if fp8:
        if dr % 2:
            raise ValueError(f"the FP8 MLA cache needs an even rope dim (keeps its fp32 scales aligned), got {dr}")
        row = mla_fp8_bytes(r, dr)  # also refuses r not divisible by 128
    elif kv_cache.dtype in (torch.bfloat16, torch.float32):
        row = r + dr
    else:
        raise ValueError(f"kv_cache must be bfloat16, float32 (exact) or uint8 (FP8 layout), got {kv_cache.dtype}")
    if kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != (BLOCK_SIZE, row):
        raise ValueError(f"kv_cache must be [num_blocks, {BLOCK_SIZE}, {row}] for r = {r}, dr = {dr} "
                         f"({'FP8' if fp8 else 'bf16'} layout), got shape {tuple(kv_cache.shape)}")
    num_slots = kv_cache.shape[0] * BLOCK_SIZE

    if (index_k is None) != (index_cache is None):
        raise ValueError("index_k and index_cache come together (full layers) or not at all")
    DI = 0
    if index_k is not None:
        _check_2d("index_k", index_k, N)
        DI = index_k.shape[1]
        index_row = BLOCK_SIZE * (DI + 4) if index_cache.dtype == torch.uint8 else BLOCK_SIZE * DI
        if index_cache.dtype not in (torch.uint8, torch.bfloat16, torch.float32) or index_cache.dim() != 2 \
                or index_cache.shape[1] != index_row:
            raise ValueError(f"index_cache must be uint8 [num_blocks, {BLOCK_SIZE * (DI + 4)}] (FP8) or bf16/fp32 "
                             f"[num_blocks, {BLOCK_SIZE * DI}] (exact) for DI = {DI}, "
                             f"got {index_cache.dtype} of shape {tuple(index_cache.shape)}")
        num_slots = min(num_slots, index_cache.shape[0] * BLOCK_SIZE)

    caches = [("kv_cache", kv_cache)] + ([("index_cache", index_cache)] if index_k is not None else [])
    for name, cache in caches:
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous (its layout is defined on the dense tensor)")
        if cache.dtype == torch.uint8 and cache.data_ptr() % 4:
            raise ValueError(f"{name} must start 4-byte aligned (it holds fp32 scales)")
    tensors = [c, k_pe, slots, kv_cache] + ([index_k, index_cache] if index_k is not None else [])
    check_device(*tensors)
    if any(t.device != slots.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if N == 0:
        return
    if check_slots and not (slots.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = torch.stack(torch.aminmax(slots)).tolist()  # the one host sync
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slots must be -1 or in [0, {num_slots}) (the caches' blocks × {BLOCK_SIZE}), "
                             f"got {lo if lo < -1 else hi}")

    ik = index_k if index_k is not None else c  # a placeholder the kernel never reads
    _write_kv_kernel[(N,)](
        c, c.stride(0), c.stride(1),
        k_pe, k_pe.stride(0), k_pe.stride(1),
        ik, ik.stride(0), ik.stride(1),
        slots, kv_cache, index_cache if index_cache is not None else kv_cache, num_slots,
        R=r, DR=dr, DI=max(DI, 1),
        BLOCK_R=next_power_of_2(r), BLOCK_DR=next_power_of_2(dr),
        BLOCK_DI=next_power_of_2(max(DI, 1)),
        FP8=fp8, HAS_INDEX=index_k is not None,
        INDEX_FP8=index_cache is not None and index_cache.dtype == torch.uint8,
        KV_BF16=kv_cache.dtype == torch.bfloat16,
        INDEX_BF16=index_cache is not None and index_cache.dtype == torch.bfloat16,
        BLOCK=BLOCK_SIZE, GROUP=SCALE_GROUP,
    )
