"""Sparse MLA forward in Triton: every query token attends to its own top-k slots of the paged cache.

Absorbed form (MQA over the latent): the keys are the cached rows `c ‖ k_pe` [r + dr] and the
values their latent part `c` [r], shared by all heads. One kernel serves prefill and decode: each
query token brings its own top-k row, so a decode step with 1–8 tokens a sequence is just T rows.

Tiling (FlashMLA-style): one program per (query token, block of BLOCK_H heads). The heads of a
token share every key, so the program gathers a tile of BLOCK_N cached rows once and uses it twice:
as keys (scores = q_lat·cᵀ + q_pe·k_peᵀ, a [BLOCK_H, BLOCK_N] tl.dot) and as values
(acc [BLOCK_H, r] += p·c). The softmax is online, in fp32, in base 2 (log2 e folded into the
scale). Heads are padded to at least 16 rows with masks so that tl.dot always gets a legal tile.
FP8 caches are dequantized on load (e4m3 · fp32 scale per 128 latent values; bf16 rope) and then
fed to the same bf16 dots as a bf16 cache.

The pure-PyTorch twin with the same contract is `megactx.kernels.reference.sparse_mla`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import INTERPRET, check_device
from megactx.kernels.reference import BLOCK_SIZE, SCALE_GROUP

_LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mla_fwd(
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, slots_ptr, out_ptr, lse_ptr,
    qk_scale,  # softmax_scale * log2(e): scores go straight to the base-2 domain
    H, K,
    stride_qt, stride_qh, stride_st, stride_ot, stride_oh,
    stride_kb, stride_ks,  # cache strides of a block and of a slot, in bytes for FP8, else in elements
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
    FP8: tl.constexpr, DOT_F32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # int64: T * H * (r + dr) passes 2^31 in long prefills
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H
    mask_r = offs_r < R
    mask_dr = offs_dr < DR

    # q: [BLOCK_H, BLOCK_R] latent part and [BLOCK_H, BLOCK_DR] rope part; padded heads are zeros.
    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_row + R + offs_dr[None, :], mask=mask_h[:, None] & mask_dr[None, :], other=0.0)
    if DOT_F32:  # fp32 inputs, or the interpreter (whose bf16 tl.dot is wrong)
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    else:
        q_lat = q_lat.to(tl.bfloat16)
        q_pe = q_pe.to(tl.bfloat16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of scores (base 2)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    slot_row = slots_ptr + t * stride_st
    for start in range(0, K, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_row + offs_n, mask=offs_n < K, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0).to(tl.int64)
        row = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks  # [BLOCK_N] start of each cached row
        lat_mask = valid[:, None] & mask_r[None, :]
        pe_mask = valid[:, None] & mask_dr[None, :]
        if FP8:
            # Row bytes: r e4m3 | r/GROUP fp32 scales | dr bf16. kv_f32_ptr / kv_bf16_ptr view the same bytes.
            offs_g = tl.arange(0, NG)
            c8 = tl.load(kv_ptr + row[:, None] + offs_r[None, :], mask=lat_mask, other=0)
            scale = tl.load(kv_f32_ptr + (row // 4 + R // 4)[:, None] + offs_g[None, :],
                            mask=valid[:, None] & (offs_g < R // GROUP)[None, :], other=0.0)
            c = c8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            c = tl.reshape(tl.reshape(c, [BLOCK_N, NG, GROUP]) * scale[:, :, None], [BLOCK_N, BLOCK_R])
            k_pe = tl.load(kv_bf16_ptr + (row // 2 + (R + 4 * (R // GROUP)) // 2)[:, None] + offs_dr[None, :],
                           mask=pe_mask, other=0.0)
        else:
            c = tl.load(kv_ptr + row[:, None] + offs_r[None, :], mask=lat_mask, other=0.0)
            k_pe = tl.load(kv_ptr + row[:, None] + R + offs_dr[None, :], mask=pe_mask, other=0.0)
        if DOT_F32:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            c = c.to(tl.bfloat16)
            k_pe = k_pe.to(tl.bfloat16)
            s = tl.dot(q_lat, tl.trans(c))
            s += tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Until a valid slot shows up m stays -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p, c, input_precision="ieee")
        else:
            pv = tl.dot(p.to(tl.bfloat16), c)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]  # rows without keys have acc = 0, so out = 0
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # x ln 2: natural log
    out_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])
    tl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)


def _launch_config(num_heads: int, topk: int, block_r: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) for a problem; tl.dot needs every tile side >= 16.

    Picked on an H200 (triton 3.6) at GLM-5.2 geometry (H = 64, r = 512, K = 2048, T = 4096):
    64 x 64 tiles, 8 warps, 2 stages ran at 227 TFLOP/s with a bf16 cache and 200 with FP8; key tiles
    of 32 ran at 145, and of 128 ran out of shared memory with 2 stages (127 with 1)."""
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    block_n = min(64, max(16, triton.next_power_of_2(topk)))
    # acc [BLOCK_H, r] fp32 stays in registers: 8 warps keep it at 128 registers a thread for GLM.
    num_warps = 8 if block_h * block_r >= 64 * 256 else 4
    return block_h, block_n, num_warps, 2


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int, *, block_h: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form sparse MLA: each query token attends to its own top-k slots only.

    q: [T, H, r + dr] bf16 or fp32 (latent-space query ‖ roped query); kv_cache: paged
    [num_blocks, 64, r + dr] bf16/fp32, or the FP8 layout [num_blocks, 64, r + 4 r/128 + 2 dr] uint8
    (see `megactx.kernels.reference`); topk_slots: [T, K] int32/int64 physical slots
    (block * 64 + offset), -1 = none; slots must lie inside the cache (not checked: it would sync).
    softmax_scale multiplies q·k; kv_lora_rank is r.
    Returns out [T, H, r] in q's dtype and lse [T, H] fp32 (natural log of the softmax denominator
    over scaled scores); a row with no valid slot gives out 0 and lse -inf.

    Dots run in bf16 with fp32 accumulation (fp32 throughout when q or the cache is fp32). The
    keyword-only arguments override the tile sizes and launch parameters (for tuning)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, r + dr], got shape {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be bf16 or fp32, got {q.dtype}")
    if kv_cache.dim() != 3 or kv_cache.shape[1] != BLOCK_SIZE:
        raise ValueError(f"kv_cache must be [num_blocks, {BLOCK_SIZE}, row], got shape {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in (torch.bfloat16, torch.float32, torch.uint8):
        raise ValueError(f"kv_cache must be bf16, fp32 or uint8 (the FP8 layout), got {kv_cache.dtype}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache rows must be contiguous (stride 1 along the last dim)")
    if topk_slots.dim() != 2 or topk_slots.shape[0] != q.shape[0]:
        raise ValueError(f"topk_slots must be [T, K] with T = {q.shape[0]} (q's tokens), "
                         f"got shape {tuple(topk_slots.shape)}")
    if topk_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_slots must be int32 or int64, got {topk_slots.dtype}")
    r = int(kv_lora_rank)
    if r <= 0 or r >= q.shape[-1]:
        raise ValueError(f"kv_lora_rank must be in [1, {q.shape[-1]}) (q's last dim is r + dr), got {kv_lora_rank}")
    fp8 = kv_cache.dtype == torch.uint8
    dr = q.shape[-1] - r
    row = r + 4 * (r // SCALE_GROUP) + 2 * dr if fp8 else r + dr
    if fp8 and (r % SCALE_GROUP or dr % 2):
        raise ValueError(f"the FP8 kv_cache needs kv_lora_rank divisible by {SCALE_GROUP} and an even rope dim "
                         f"(to keep its fp32 scales aligned), got r = {r}, dr = {dr}")
    if kv_cache.shape[-1] != row:
        layout = f"{r} + 4 * {r // SCALE_GROUP} + 2 * {dr} bytes (FP8)" if fp8 else f"{r} + {dr}"
        raise ValueError(f"kv_cache rows must hold {layout} = {row} for q of shape {tuple(q.shape)} and "
                         f"kv_lora_rank {r}, got {kv_cache.shape[-1]}")
    if not (q.device == kv_cache.device == topk_slots.device):
        raise ValueError(f"q, kv_cache and topk_slots must share a device, got {q.device}, {kv_cache.device}, "
                         f"{topk_slots.device}")
    check_device(q, kv_cache, topk_slots)

    T, H, _ = q.shape
    K = topk_slots.shape[1]
    # The interpreter truncates fp32 -> bf16 instead of rounding to nearest; there the kernel writes
    # fp32 and torch rounds.
    out_dtype = torch.float32 if INTERPRET else q.dtype
    out = torch.empty(T, H, r, dtype=out_dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out.to(q.dtype), lse
    if K == 0:
        return out.zero_().to(q.dtype), lse.fill_(float("-inf"))
    if q.stride(-1) != 1:
        q = q.contiguous()
    if topk_slots.stride(-1) != 1:
        topk_slots = topk_slots.contiguous()

    block_r = max(16, triton.next_power_of_2(r))
    block_dr = max(16, triton.next_power_of_2(dr))
    cfg_h, cfg_n, cfg_warps, cfg_stages = _launch_config(H, K, block_r)
    block_h = block_h or cfg_h
    block_n = block_n or cfg_n
    if fp8:
        # Views of the same bytes for the fp32 scales and bf16 rope values; element offsets are byte offsets / 4, / 2.
        kv_f32, kv_bf16 = kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)
    else:
        kv_f32 = kv_bf16 = kv_cache  # unused
    grid = (T, triton.cdiv(H, block_h))
    _sparse_mla_fwd[grid](
        q, kv_cache, kv_f32, kv_bf16, topk_slots, out, lse,
        softmax_scale * _LOG2E,
        H, K,
        q.stride(0), q.stride(1), topk_slots.stride(0), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        R=r, DR=dr, BLOCK_R=block_r, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_N=block_n,
        PAGE=BLOCK_SIZE, GROUP=SCALE_GROUP, NG=max(1, block_r // SCALE_GROUP), FP8=fp8,
        DOT_F32=INTERPRET or torch.float32 in (q.dtype, kv_cache.dtype),
        num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages,
    )
    return out.to(q.dtype), lse

