"""Fused KV write: store new tokens' MLA latent + rope key (+ indexer key) into the paged caches.

One Triton program per token writes its row of the MLA cache (bf16, or the FP8 656-byte layout)
and, on full layers, its indexer key; layouts are in `megactx.kernels.reference`, whose `write_kv`
is this kernel's twin. Byte for byte the kernel matches the twin run on a CPU: same scales
(amax / 448, IEEE division), same clamp to ±448, round-to-nearest-even casts. (The twin run on
CUDA can differ by an ulp in a scale: PyTorch there divides by a Python scalar through its
reciprocal.)

Given the projections and their `KeyPrep`s instead of the keys (the paged layer's write), the same
program first makes the keys: the latent's RMSNorm and the rope key's rope (MLA); the indexer key's
LayerNorm, the rope on its first dims and, for an FP8 cache, the Hadamard rotation (three fp32
products against the rows of the matrix each part meets, as `index_queries` does) — each step in
fp32 and rounded to the input's dtype, as the separate kernels round. A decode step of a small model
is bound by its launches: this takes the two to six launches a layer those ops cost (a norm, a
rope; on a full layer a LayerNorm, a rope, a cast and a matmul more) into the write's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import check_device, next_power_of_2, quantize_e4m3, to_bf16
from megactx.kernels.norm import kernel_norm, norm_apply, norm_stats
from megactx.kernels.reference import BLOCK_SIZE, SCALE_GROUP, KeyPrep, mla_fp8_bytes, prepare_keys
from megactx.kernels.rope import pair_offsets, rotate, rotate_pairs

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
def _rounded(x, BF16: tl.constexpr):
    """x fp32, rounded to bf16 (nearest even) and back when BF16: what an op returning bf16 leaves."""
    if BF16:
        x = to_bf16(x).to(tl.float32)
    return x


@triton.jit
def _write_kv_kernel(
    c_ptr, stride_cn, stride_cd,          # c: [N, R] latent (C_NORM: the projection, normed here)
    pe_ptr, stride_pn, stride_pd,         # k_pe: [N, DR] roped key (PE_ROPE: unroped, stride_pd 1)
    ik_ptr, stride_in, stride_id,         # index_k: [N, DI] (HAS_INDEX; INDEX_PREP: before its norm, stride_id 1)
    slots_ptr,                            # [N] int32/int64, -1 = skip
    kv_ptr,                               # bf16 [nb, 64, R + DR] or uint8 [nb, 64, ROW_BYTES]
    idx_ptr,                              # uint8 [nb, 64 * (DI + 4)] (HAS_INDEX)
    num_slots,                            # slots both caches hold
    cw_ptr, c_eps,                        # the latent's RMSNorm weight [R] (C_NORM)
    cos_ptr, sin_ptr, stride_cos,         # [N, DR] ([cos | cos], [-sin | sin]; PE_ROPE)
    iw_ptr, ib_ptr, i_eps,                # the indexer key's norm weight and bias [DI] (INDEX_PREP)
    icos_ptr, isin_ptr, stride_icos,      # [N, IR] (INDEX_PREP)
    rot_ptr,                              # [DI, DI] fp32 rotation (INDEX_PREP with INDEX_FP8)
    R: tl.constexpr, DR: tl.constexpr, DI: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DI: tl.constexpr,
    FP8: tl.constexpr, HAS_INDEX: tl.constexpr, INDEX_FP8: tl.constexpr,
    KV_BF16: tl.constexpr, INDEX_BF16: tl.constexpr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr,
    C_NORM: tl.constexpr, PE_ROPE: tl.constexpr, INTERLEAVE: tl.constexpr, IN_BF16: tl.constexpr,
    INDEX_IN_BF16: tl.constexpr, INDEX_PREP: tl.constexpr, INDEX_RMS: tl.constexpr, INDEX_BIAS: tl.constexpr,
    IR: tl.constexpr, INDEX_INTERLEAVE: tl.constexpr, BLOCK_IH: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    # the wrapper has already refused out-of-range slots (except under CUDA-graph capture, where it
    # cannot look): never write outside the caches
    if (slot < 0) | (slot >= num_slots):
        return

    # --- the rope key: as given, or roped here from the projection's pairs, half-split (PE_ROPE)
    HALF: tl.constexpr = DR // 2
    d_pe = tl.arange(0, BLOCK_DR)
    if PE_ROPE:
        h = tl.arange(0, BLOCK_DR // 2)
        c = tl.load(cos_ptr + tok * stride_cos + h, mask=h < HALF, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + tok * stride_cos + HALF + h, mask=h < HALF, other=0.0).to(tl.float32)
        pe1, pe2 = rotate_pairs(pe_ptr + tok * stride_pn, h, h < HALF, c, sn, INTERLEAVE, HALF)
        pe1, pe2 = _rounded(pe1, IN_BF16), _rounded(pe2, IN_BF16)
    else:
        pe = tl.load(pe_ptr + tok * stride_pn + d_pe * stride_pd, mask=d_pe < DR, other=0.0)

    # --- MLA cache
    if FP8:
        # row: R e4m3 | R / GROUP fp32 scales | DR bf16; R % 128 == 0 and DR even keep both aligned
        NG: tl.constexpr = R // GROUP
        ROW_BYTES: tl.constexpr = R + 4 * NG + 2 * DR
        row = kv_ptr + slot * ROW_BYTES
        g = tl.arange(0, BLOCK_R // GROUP)[:, None]
        d = g * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
        mask = d < R
        x = tl.load(c_ptr + tok * stride_cn + d * stride_cd, mask=mask, other=0.0).to(tl.float32)
        if C_NORM:  # the latent's RMSNorm over all its groups
            den = tl.sqrt_rn(tl.sum(tl.sum(x * x, 1), 0) / R + c_eps)
            x = _rounded(norm_apply(x, cw_ptr, cw_ptr, d, mask, 0.0, den, False), IN_BF16)
        values, scale = quantize_e4m3(x)
        tl.store(row + d, values, mask=mask)
        gs = tl.arange(0, BLOCK_R // GROUP)
        tl.store((row + R).to(tl.pointer_type(tl.float32)) + gs, scale, mask=gs < NG)
        pe_row = (row + R + 4 * NG).to(tl.pointer_type(tl.bfloat16))
        if PE_ROPE:
            tl.store(pe_row + h, to_bf16(pe1), mask=h < HALF)
            tl.store(pe_row + HALF + h, to_bf16(pe2), mask=h < HALF)
        else:
            tl.store(pe_row + d_pe, to_bf16(pe), mask=d_pe < DR)
    else:
        row = kv_ptr + slot * (R + DR)
        d = tl.arange(0, BLOCK_R)
        x = tl.load(c_ptr + tok * stride_cn + d * stride_cd, mask=d < R, other=0.0).to(tl.float32)
        if C_NORM:
            mean, den = norm_stats(x, d < R, R, c_eps, True)
            x = _rounded(norm_apply(x, cw_ptr, cw_ptr, d, d < R, mean, den, False), IN_BF16)
        tl.store(row + d, _to_cache(x, KV_BF16), mask=d < R)
        if PE_ROPE:
            tl.store(row + R + h, _to_cache(pe1, KV_BF16), mask=h < HALF)
            tl.store(row + R + HALF + h, _to_cache(pe2, KV_BF16), mask=h < HALF)
        else:
            tl.store(row + R + d_pe, _to_cache(pe, KV_BF16), mask=d_pe < DR)

    # --- indexer cache: a block is 64 keys of DI e4m3 bytes, then their 64 fp32 scales
    if HAS_INDEX:
        di = tl.arange(0, BLOCK_DI)[None, :]  # one group of DI: one scale per key
        if INDEX_PREP:
            _write_index_key(ik_ptr + tok * stride_in, idx_ptr, slot, tok, iw_ptr, ib_ptr, i_eps,
                             icos_ptr, isin_ptr, stride_icos, rot_ptr, DI, BLOCK_DI, IR, BLOCK_IH, BLOCK_REST,
                             INDEX_RMS, INDEX_BIAS, INDEX_INTERLEAVE, INDEX_IN_BF16, INDEX_FP8, INDEX_BF16, BLOCK)
        else:
            k = tl.load(ik_ptr + tok * stride_in + di * stride_id, mask=di < DI, other=0.0).to(tl.float32)
            _store_index_key(k, di, idx_ptr, slot, DI, INDEX_FP8, INDEX_BF16, BLOCK)


@triton.jit
def _store_index_key(k, di, idx_ptr, slot, DI: tl.constexpr, INDEX_FP8: tl.constexpr, INDEX_BF16: tl.constexpr,
                     BLOCK: tl.constexpr):
    """k: fp32 [1, BLOCK_DI] (its dims at di) -> the indexer cache's slot: e4m3 and a scale, or exact."""
    if INDEX_FP8:
        block_base = idx_ptr + (slot // BLOCK) * (BLOCK * (DI + 4))
        offset = slot % BLOCK
        values, scale = quantize_e4m3(k)
        tl.store(block_base + offset * DI + di, values, mask=di < DI)
        tl.store((block_base + BLOCK * DI).to(tl.pointer_type(tl.float32)) + offset + tl.arange(0, 1), scale)
    else:  # exact keys: [num_blocks, 64 * DI] of the cache's float dtype, a key every DI values
        tl.store(idx_ptr + slot * DI + di, _to_cache(k, INDEX_BF16), mask=di < DI)


@triton.jit
def _write_index_key(row, idx_ptr, slot, tok, w_ptr, b_ptr, eps, cos_ptr, sin_ptr, stride_cos, rot_ptr,
                     DI: tl.constexpr, BLOCK_DI: tl.constexpr, IR: tl.constexpr, BLOCK_IH: tl.constexpr,
                     BLOCK_REST: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     INTERLEAVE: tl.constexpr, IN_BF16: tl.constexpr, INDEX_FP8: tl.constexpr,
                     INDEX_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """The indexer key from its projection `row` (wk's [DI], contiguous): the norm, rope on the first
    IR dims (the result half-split: [firsts | seconds | the rest]), each rounded to the input's dtype;
    on an FP8 cache the rotation (exact caches take no rotation: the wrapper sends those to the twin's
    ops); then the store."""
    d = tl.arange(0, BLOCK_DI)
    mean, den = norm_stats(tl.load(row + d, mask=d < DI, other=0.0).to(tl.float32), d < DI, DI, eps, RMS)
    IH: tl.constexpr = IR // 2
    j = tl.arange(0, BLOCK_IH)
    live = j < IH
    o1, o2 = pair_offsets(j, INTERLEAVE, IH)
    x1 = _rounded(norm_apply(tl.load(row + o1, mask=live, other=0.0).to(tl.float32), w_ptr, b_ptr, o1, live,
                             mean, den, HAS_BIAS), IN_BF16)
    x2 = _rounded(norm_apply(tl.load(row + o2, mask=live, other=0.0).to(tl.float32), w_ptr, b_ptr, o2, live,
                             mean, den, HAS_BIAS), IN_BF16)
    c = tl.load(cos_ptr + tok * stride_cos + j, mask=live, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + tok * stride_cos + IH + j, mask=live, other=0.0).to(tl.float32)
    first, second = rotate(x1, x2, c, sn)
    first, second = _rounded(first, IN_BF16), _rounded(second, IN_BF16)
    r = IR + tl.arange(0, BLOCK_REST)
    rest = _rounded(norm_apply(tl.load(row + r, mask=r < DI, other=0.0).to(tl.float32), w_ptr, b_ptr, r, r < DI,
                               mean, den, HAS_BIAS), IN_BF16)
    if INDEX_FP8:
        # [firsts | seconds | rest] @ rotation, by the rows of the matrix each part meets (fp32 products)
        cols = d[None, :]
        y = tl.sum(first[:, None] * tl.load(rot_ptr + j[:, None] * DI + cols,
                                            mask=live[:, None] & (cols < DI), other=0.0), 0)
        y += tl.sum(second[:, None] * tl.load(rot_ptr + (IH + j[:, None]) * DI + cols,
                                              mask=live[:, None] & (cols < DI), other=0.0), 0)
        y += tl.sum(rest[:, None] * tl.load(rot_ptr + r[:, None] * DI + cols,
                                            mask=(r[:, None] < DI) & (cols < DI), other=0.0), 0)
        _store_index_key(y[None, :], cols, idx_ptr, slot, DI, INDEX_FP8, INDEX_BF16, BLOCK)
    else:
        base = idx_ptr + slot * DI
        tl.store(base + j, _to_cache(first, INDEX_BF16), mask=live)
        tl.store(base + IH + j, _to_cache(second, INDEX_BF16), mask=live)
        tl.store(base + r, _to_cache(rest, INDEX_BF16), mask=r < DI)


# ------------------------------------------------------------------------------ wrapper
def _check_2d(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] == 0:
        raise ValueError(f"{name} must be [N, dim] with N = {n} (slots' length), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _fused_prep(prep: KeyPrep, x: torch.Tensor, rope_width: int, rms_only: bool
                ) -> tuple[tuple, torch.Tensor, torch.Tensor] | None:
    """(the norm's (weight, bias, eps, rms), cos, sin with contiguous last dims) where the kernel makes
    keys as `prep` says, its norm over x [N, D] (a kernel norm in x's dtype, fp32 or bf16; RMSNorm only
    if rms_only) and its rope over rope_width dims (even; cos / sin [N, rope_width]), else None."""
    norm = kernel_norm(prep.norm, x.dtype) if x.dtype in (torch.float32, torch.bfloat16) else None
    N, D = x.shape
    if (norm is None or (rms_only and not norm[3]) or norm[0].shape != (D,) or rope_width % 2
            or prep.cos.shape != (N, rope_width) or prep.sin.shape != prep.cos.shape):
        return None
    cos, sin = prep.cos, prep.sin
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return norm, cos, sin


def write_kv(c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
             index_k: torch.Tensor | None = None, index_cache: torch.Tensor | None = None, *,
             mla_prep: KeyPrep | None = None, index_prep: KeyPrep | None = None, check_slots: bool = False) -> None:
    """Store new tokens into the paged caches, in place (the twin: `reference.write_kv`).

    c: [N, r] latent, k_pe: [N, dr] roped key (fp32/bf16/fp16, any strides: slices of one
    projection output are fine); slots: [N] int32/int64, block * 64 + offset, -1 = skip the token;
    kv_cache: bf16 (or fp32, exact) [num_blocks, 64, r + dr], or uint8 [num_blocks, 64,
    r + 4 r/128 + 2 dr] = FP8 (e4m3 latent, an fp32 scale per 128 values, bf16 rope); index_k:
    [N, DI] with index_cache: uint8 [num_blocks, 64 * (DI + 4)] (FP8) or bf16/fp32
    [num_blocks, 64 * DI] (exact) — full layers only. Two tokens given the same slot leave one of
    them, unspecified which.

    mla_prep / index_prep (`reference.KeyPrep`): c and k_pe / index_k are the projections, made into
    the keys on the way (see the module docstring). Preps the kernel does not take — another norm,
    16-bit float inputs other than bf16, an exact indexer cache with a rotation — run as the twin's
    ops first (`reference.prepare_keys`).

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

    index_fp8 = index_cache is not None and index_cache.dtype == torch.uint8
    mla = _fused_prep(mla_prep, c, dr, True) if mla_prep is not None and c.dtype == k_pe.dtype else None
    index = None
    if (index_prep is not None and index_k is not None and index_fp8 == (index_prep.rotation is not None)
            and 0 < index_prep.cos.shape[-1] <= DI):
        index = _fused_prep(index_prep, index_k, index_prep.cos.shape[-1], False)
        rotation = index_prep.rotation
        if index is not None and rotation is not None:
            if rotation.shape != (DI, DI) or rotation.dtype != torch.float32:
                index = None
            else:
                rotation = rotation.contiguous()
    unfused = (mla_prep if mla is None else None, index_prep if index is None else None)
    if any(p is not None for p in unfused):  # the twin's ops make those keys first
        c, k_pe, index_k = prepare_keys(c, k_pe, index_k, *unfused)
    if mla is not None and k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    if index is not None and index_k.stride(-1) != 1:
        index_k = index_k.contiguous()
    (c_w, _, c_eps, _), cos, sin = mla if mla is not None else ((c, None, 0.0, True), c, c)  # placeholders
    (i_w, i_b, i_eps, i_rms), icos, isin = index if index is not None else ((c, None, 0.0, True), c, c)
    ir = icos.shape[-1] if index is not None else 2
    ik = index_k if index_k is not None else c  # a placeholder the kernel never reads
    _write_kv_kernel[(N,)](
        c, c.stride(0), c.stride(1),
        k_pe, k_pe.stride(0), k_pe.stride(1),
        ik, ik.stride(0), ik.stride(1),
        slots, kv_cache, index_cache if index_cache is not None else kv_cache, num_slots,
        c_w, c_eps, cos, sin, cos.stride(0),
        i_w, i_w if i_b is None else i_b, i_eps, icos, isin, icos.stride(0),
        rotation if index is not None and index_fp8 else c,
        R=r, DR=dr, DI=max(DI, 1),
        BLOCK_R=next_power_of_2(r), BLOCK_DR=next_power_of_2(dr),
        BLOCK_DI=next_power_of_2(max(DI, 1)),
        FP8=fp8, HAS_INDEX=index_k is not None, INDEX_FP8=index_fp8,
        KV_BF16=kv_cache.dtype == torch.bfloat16,
        INDEX_BF16=index_cache is not None and index_cache.dtype == torch.bfloat16,
        BLOCK=BLOCK_SIZE, GROUP=SCALE_GROUP,
        C_NORM=mla is not None, PE_ROPE=mla is not None, INTERLEAVE=mla_prep is not None and mla_prep.interleave,
        IN_BF16=c.dtype == torch.bfloat16, INDEX_IN_BF16=index_k is not None and index_k.dtype == torch.bfloat16,
        INDEX_PREP=index is not None, INDEX_RMS=i_rms, INDEX_BIAS=i_b is not None, IR=ir,
        INDEX_INTERLEAVE=index_prep is not None and index_prep.interleave,
        BLOCK_IH=next_power_of_2(ir // 2), BLOCK_REST=next_power_of_2(max(DI - ir, 1)),
    )
