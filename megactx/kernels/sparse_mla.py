"""Sparse MLA forward in Triton: every query token attends to its own top-k slots of the paged cache.

Absorbed form (MQA over the latent): the keys are the cached rows `c ‖ k_pe` [r + dr] and the
values their latent part `c` [r], shared by all heads. One kernel serves prefill and decode: each
query token brings its own top-k row, so a decode step with 1–8 tokens a sequence is just T rows.

Tiling (FlashMLA-style): one program per (query token, block of BLOCK_H heads, split of the top-k).
The heads of a token share every key, so the program gathers a tile of BLOCK_N cached rows once and
uses it twice: as keys (scores = q_lat·cᵀ + q_pe·k_peᵀ, a [BLOCK_H, BLOCK_N] tl.dot) and as values
(acc [BLOCK_H, r] += p·c). The softmax is online, in fp32, in base 2 (log2 e folded into the
scale). Heads are padded to at least 16 rows with masks so that tl.dot always gets a legal tile.
FP8 caches are dequantized on load (e4m3 · fp32 scale per 128 latent values; bf16 rope) and then
fed to the same bf16 dots as a bf16 cache.

Pipelining: the gather's addresses come from another load (the slot ids), and Triton's pipeliner
then splits its stages between the two loads: the rows of a tile are requested
(num_stages - 1) // 2 iterations ahead, so 2 stages leave each gather's latency exposed and 5 keep
two tiles in flight (see `_launch_config` for the measurements and the shared-memory budget).

Split-K (flash-decoding): a decode batch has too few (token, head block) programs to fill the GPU
(64 tokens x 1 head block on 132 SMs), so the top-k of each token is cut into `num_splits` chunks
of whole key tiles. Each split writes its normalised partial out (fp32) and lse to scratch, and a
small combine kernel merges them: out = Σ_i exp(lse_i - lse) out_i with lse = log Σ_i exp(lse_i).
A split without a valid slot writes out 0 and lse -inf and weighs 0.

Program order: the head blocks of a token run next to each other (they gather the same rows, so
the second gather hits L2), then the splits of the token, then the next token (neighbouring
tokens' top-k overlap, again an L2 hit).

The pure-PyTorch twin with the same contract is `megactx.kernels.reference.sparse_mla`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from megactx.kernels.common import INTERPRET, check_device
from megactx.kernels.reference import BLOCK_SIZE, SCALE_GROUP

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)  # ln 2: base-2 scores back to natural log

# SMs assumed under the interpreter (no device to ask); small, so that CPU tests exercise splits.
INTERPRET_NUM_SMS = 8
# Split-K cost model, in units of one key tile's gather + math (see `choose_num_splits`): a program's
# fixed cost (q load, the first gather's latency, the epilogue) and a split's extra one (its fp32
# partial out is [BLOCK_H, r] x 4 B, about one bf16 key tile of traffic, written then read back).
PROGRAM_OVERHEAD_TILES = 2
SPLIT_OVERHEAD_TILES = 1
MAX_SPLITS = 64  # bounds the scratch: T x splits x H x r fp32
COMBINE_HEADS = 16  # heads a combine program merges: [16, r] fp32 suits 4 warps; T x H / 16 programs


@triton.jit
def _gather_rows(kv_ptr, kv_f32_ptr, kv_bf16_ptr, slot, stride_kb, stride_ks,
                 R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
                 FP8: tl.constexpr):
    """The cached rows of `slot` [BLOCK_N] (-1 = none) as stored: latent [BLOCK_N, BLOCK_R] (e4m3
    bytes for FP8, else the cache dtype), its scales [BLOCK_N, NG] fp32 (FP8; ones otherwise) and
    the rope key [BLOCK_N, BLOCK_DR]. Rows of -1 slots and padded columns read as 0 without traffic."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    valid = slot >= 0
    s = tl.where(valid, slot, 0).to(tl.int64)  # int64: 1M slots x 576 elements passes 2^31
    row = (s // PAGE) * stride_kb + (s % PAGE) * stride_ks  # [BLOCK_N] start of each row (bytes for FP8)
    lat_mask = valid[:, None] & (offs_r < R)[None, :]
    pe_mask = valid[:, None] & (offs_dr < DR)[None, :]
    if FP8:
        # Row bytes: r e4m3 | r/GROUP fp32 scales | dr bf16. kv_f32_ptr / kv_bf16_ptr view the same bytes.
        offs_g = tl.arange(0, NG)
        lat = tl.load(kv_ptr + row[:, None] + offs_r[None, :], mask=lat_mask, other=0)
        scale = tl.load(kv_f32_ptr + (row // 4 + R // 4)[:, None] + offs_g[None, :],
                        mask=valid[:, None] & (offs_g < R // GROUP)[None, :], other=0.0)
        k_pe = tl.load(kv_bf16_ptr + (row // 2 + (R + 4 * (R // GROUP)) // 2)[:, None] + offs_dr[None, :],
                       mask=pe_mask, other=0.0)
    else:
        lat = tl.load(kv_ptr + row[:, None] + offs_r[None, :], mask=lat_mask, other=0.0)
        scale = tl.full([BLOCK_N, NG], 1.0, tl.float32)
        k_pe = tl.load(kv_ptr + row[:, None] + R + offs_dr[None, :], mask=pe_mask, other=0.0)
    return lat, scale, k_pe


@triton.jit
def _dequant(lat, scale, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
             FP8: tl.constexpr, DOT_F32: tl.constexpr):
    """Stored latent [BLOCK_N, BLOCK_R] -> the dots' operand: fp32 with DOT_F32, else bf16."""
    # one return statement: the GPU compiler refused this function with a return in each branch
    if FP8:
        c = lat.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        c = tl.reshape(tl.reshape(c, [BLOCK_N, NG, GROUP]) * scale[:, :, None], [BLOCK_N, BLOCK_R])
    else:
        c = lat.to(tl.float32)
    if DOT_F32:
        c = c.to(tl.float32)
    else:
        c = c.to(tl.bfloat16)
    return c


# num_splits and num_head_blocks only enter the program-id arithmetic: not specializing them on the
# value 1 keeps split and unsplit launches on one compiled kernel.
@triton.jit(do_not_specialize=["num_head_blocks", "num_splits"])
def _sparse_mla_fwd(
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, slots_ptr, out_ptr, lse_ptr,
    qk_scale,  # softmax_scale * log2(e): scores go straight to the base-2 domain
    H, K, split_len, num_head_blocks, num_splits,
    stride_qt, stride_qh, stride_st,
    stride_ot, stride_os, stride_oh,  # out (or the partial outs): token, split, head
    stride_lt, stride_ls,  # lse (or the partial lses): token, split; heads are contiguous
    stride_kb, stride_ks,  # cache strides of a block and of a slot, in bytes for FP8, else in elements
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
    FP8: tl.constexpr, DOT_F32: tl.constexpr,
):
    # Program order: head block fastest, then split, then token (see the module docstring).
    pid = tl.program_id(0)
    hb = pid % num_head_blocks
    split = (pid // num_head_blocks) % num_splits
    t = (pid // (num_head_blocks * num_splits)).to(tl.int64)  # int64: T * H * (r + dr) passes 2^31
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_n = tl.arange(0, BLOCK_N)
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

    # This split's key range: whole tiles, the last split ends at K.
    k_lo = split * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    slot_row = slots_ptr + t * stride_st
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of scores (base 2)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(k_lo, k_hi, BLOCK_N):
        offs = start + offs_n
        slot = tl.load(slot_row + offs, mask=offs < k_hi, other=-1)
        lat, scale, k_pe = _gather_rows(kv_ptr, kv_f32_ptr, kv_bf16_ptr, slot, stride_kb, stride_ks,
                                        R, DR, BLOCK_R, BLOCK_DR, BLOCK_N, PAGE, GROUP, NG, FP8)
        valid = slot >= 0
        c = _dequant(lat, scale, BLOCK_N, BLOCK_R, GROUP, NG, FP8, DOT_F32)  # [BLOCK_N, BLOCK_R]
        if DOT_F32:
            k_pe = k_pe.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
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
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * _LN2, float("-inf"))  # natural log
    out_ptrs = out_ptr + t * stride_ot + split * stride_os + offs_h[:, None] * stride_oh + offs_r[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])
    tl.store(lse_ptr + t * stride_lt + split * stride_ls + offs_h, lse, mask=mask_h)


@triton.jit
def _combine_splits(part_ptr, part_lse_ptr, out_ptr, lse_ptr, H, num_splits,
                    stride_pt, stride_ps, stride_ph, stride_plt, stride_pls, stride_ot, stride_oh,
                    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[t, h] = Σ_i exp(lse_i - lse) out_i and lse = log Σ_i exp(lse_i) over the splits i of token t."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < H
    mask_hr = mask_h[:, None] & (offs_r < R)[None, :]

    lse_row = part_lse_ptr + t * stride_plt + offs_h
    lse_all = tl.load(lse_row[None, :] + offs_s[:, None] * stride_pls,
                      mask=(offs_s < num_splits)[:, None] & mask_h[None, :], other=float("-inf"))  # [BLOCK_S, BLOCK_H]
    m = tl.max(lse_all, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights exp(-inf) = 0
    denom = tl.sum(tl.exp(lse_all - m_safe[None, :]), 0)

    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    part_row = part_ptr + t * stride_pt + offs_h[:, None] * stride_ph + offs_r[None, :]
    for i in range(num_splits):
        w = tl.exp(tl.load(lse_row + i * stride_pls, mask=mask_h, other=float("-inf")) - m_safe)
        acc += w[:, None] * tl.load(part_row + i * stride_ps, mask=mask_hr, other=0.0)

    has_keys = denom > 0.0
    d_safe = tl.where(has_keys, denom, 1.0)
    out = acc / d_safe[:, None]
    lse = tl.where(has_keys, m_safe + tl.log(d_safe), float("-inf"))
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_hr)
    tl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)


@dataclass(frozen=True)
class LaunchConfig:
    """How `sparse_mla` tiles and launches a problem (each field can be overridden by a keyword)."""

    block_h: int  # heads a program serves (>= 16: tl.dot's smallest tile side)
    block_n: int  # cached rows gathered a tile
    num_warps: int
    num_stages: int  # Triton's software pipeliner; rows are requested (num_stages - 1) // 2 tiles ahead


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRET_NUM_SMS under the Triton interpreter)."""
    if device.type != "cuda":
        return INTERPRET_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, num_tiles: int, sms: int) -> int:
    """Splits of each token's top-k that finish a launch soonest under a wave model.

    num_programs: (token, head block) pairs; num_tiles: key tiles a token; sms: programs that run at
    once (one a SM: a GLM-size program holds 170-220 KiB of shared memory). A launch of
    num_programs x s programs runs in ceil(num_programs x s / sms) waves, each as long as one
    program: ceil(num_tiles / s) tiles plus PROGRAM_OVERHEAD_TILES, plus SPLIT_OVERHEAD_TILES when
    split. Prefill (T x head blocks >> SMs) gets 1; decode of 64 tokens on 132 SMs gets 2; one
    token gets one tile a split (up to MAX_SPLITS)."""
    best, best_cost = 1, None
    for s in range(1, min(num_tiles, MAX_SPLITS) + 1):
        per_program = triton.cdiv(num_tiles, s) + PROGRAM_OVERHEAD_TILES + (SPLIT_OVERHEAD_TILES if s > 1 else 0)
        cost = triton.cdiv(num_programs * s, sms) * per_program
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def _launch_config(num_heads: int, topk: int, block_r: int, fp8: bool) -> LaunchConfig:
    """The tiling for a problem; tl.dot needs every tile side >= 16.

    Timed on an H200 (triton 3.6, `python -m benchmarks.tune_sparse_mla`: GLM-5.2 geometry H = 64,
    r = 512, K = 2048, a 1M-token cache, L2 flushed). Prefill T = 4096: 64 x 64 tiles, 8 warps,
    3 stages ran at 216 TFLOP/s with a bf16 cache (192 FP8), 2 stages at 213; 32-row tiles with 5-9
    stages, which the sm_90 code suggested would hide the gather latency better (rows requested
    (stages - 1) // 2 tiles ahead), ran at 139 at best: with heads in the MMA's M both warpgroups
    compute the same scores, and small tiles re-read q from shared memory more often. Decode
    T = 64: 64 x 64 with 2 splits 167 TFLOP/s (FP8 149), unsplit 146. Every configuration is
    latency-bound on its gathers (~5 us a 64-row tile an SM), not bandwidth-bound: the accumulator
    [64, 512] fp32 holds 128 registers a thread, so one program runs a SM and nothing else hides
    the gathers' latency. Tiles of 128 keys do not fit shared memory with 2+ stages."""
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    block_n = min(64, max(16, triton.next_power_of_2(topk)))
    # acc [BLOCK_H, r] fp32 stays in registers: 8 warps keep it at 128 registers a thread for GLM.
    num_warps = 8 if block_h * block_r >= 64 * 256 else 4
    return LaunchConfig(block_h, block_n, num_warps, num_stages=3)


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int, *, block_h: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form sparse MLA: each query token attends to its own top-k slots only.

    q: [T, H, r + dr] bf16 or fp32 (latent-space query ‖ roped query); kv_cache: paged
    [num_blocks, 64, r + dr] bf16/fp32, or the FP8 layout [num_blocks, 64, r + 4 r/128 + 2 dr] uint8
    (see `megactx.kernels.reference`); topk_slots: [T, K] int32/int64 physical slots
    (block * 64 + offset), -1 = none; slots must lie inside the cache (not checked: it would sync).
    softmax_scale multiplies q·k; kv_lora_rank is r.
    Returns out [T, H, r] in q's dtype and lse [T, H] fp32 (natural log of the softmax denominator
    over scaled scores); a row with no valid slot gives out 0 and lse -inf.

    Dots run in bf16 with fp32 accumulation (fp32 throughout when q or the cache is fp32). The
    keyword-only arguments override the tiling of `_launch_config` (for tuning): block_h, block_n,
    num_warps, num_stages, and num_splits (split-K: chunks of each token's top-k, >= 1, capped at
    the number of key tiles; default from `choose_num_splits` and the SM count). No host sync: safe
    under CUDA-graph capture (the split-K scratch comes from the caching allocator)."""
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
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (1 = no split-K), got {num_splits}")
    for name, value in (("block_h", block_h), ("block_n", block_n)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile side), got {value}")
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
    overrides = {"block_h": block_h, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    cfg = replace(_launch_config(H, K, block_r, fp8), **{k: v for k, v in overrides.items() if v is not None})
    head_blocks = triton.cdiv(H, cfg.block_h)
    num_tiles = triton.cdiv(K, cfg.block_n)
    if num_splits is None:
        num_splits = choose_num_splits(T * head_blocks, num_tiles, num_sms(q.device))
    # Whole tiles a split; then drop splits that would start past K (e.g. K = 5 asked for 4 splits).
    split_len = triton.cdiv(num_tiles, min(num_splits, num_tiles)) * cfg.block_n
    splits = triton.cdiv(K, split_len)

    if fp8:
        # Views of the same bytes for the fp32 scales and bf16 rope values; element offsets are byte offsets / 4, / 2.
        kv_f32, kv_bf16 = kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)
    else:
        kv_f32 = kv_bf16 = kv_cache  # unused
    if splits > 1:
        # Partial outs stay fp32 (they are rescaled and summed); [T, splits, H, r] and [T, splits, H].
        dst = torch.empty(T, splits, H, r, dtype=torch.float32, device=q.device)
        dst_lse = torch.empty(T, splits, H, dtype=torch.float32, device=q.device)
    else:
        dst, dst_lse = out.unsqueeze(1), lse.unsqueeze(1)
    _sparse_mla_fwd[(T * splits * head_blocks,)](
        q, kv_cache, kv_f32, kv_bf16, topk_slots, dst, dst_lse,
        softmax_scale * _LOG2E,
        H, K, split_len, head_blocks, splits,
        q.stride(0), q.stride(1), topk_slots.stride(0),
        dst.stride(0), dst.stride(1), dst.stride(2), dst_lse.stride(0), dst_lse.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        R=r, DR=dr, BLOCK_R=block_r, BLOCK_DR=block_dr, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        PAGE=BLOCK_SIZE, GROUP=SCALE_GROUP, NG=max(1, block_r // SCALE_GROUP), FP8=fp8,
        DOT_F32=INTERPRET or torch.float32 in (q.dtype, kv_cache.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _combine_splits[(T, triton.cdiv(H, COMBINE_HEADS))](
            dst, dst_lse, out, lse, H, splits,
            dst.stride(0), dst.stride(1), dst.stride(2), dst_lse.stride(0), dst_lse.stride(1),
            out.stride(0), out.stride(1),
            R=r, BLOCK_R=block_r, BLOCK_H=COMBINE_HEADS, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )
    return out.to(q.dtype), lse
