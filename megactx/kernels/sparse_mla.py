"""Sparse MLA forward in Triton: every query token attends to its own top-k slots of the paged cache.

Absorbed form (MQA over the latent): the keys are the cached rows `c ‖ k_pe` [r + dr] and the
values their latent part `c` [r], shared by all heads. One kernel serves prefill and decode: each
query token brings its own top-k row, so a decode step with 1–8 tokens a sequence is just T rows.

Tiling (FlashMLA-style): one program per (query token, block of BLOCK_H heads, split of the top-k).
The heads of a token share every key, so the program gathers a tile of BLOCK_N cached rows once and
uses it twice: as keys (scores = q_lat·cᵀ + q_pe·k_peᵀ, a [BLOCK_H, BLOCK_N] dot) and as values
(acc [BLOCK_H, r] += p·c). The softmax is online, in fp32, in base 2 (log2 e folded into the
scale). FP8 caches are dequantized once a tile (e4m3 · fp32 scale per 128 latent values; bf16
rope) and then fed to the same bf16 dots as a bf16 cache.

Three kernels implement this, with one contract (`LaunchConfig.kernel` picks):

- "triton" (`_sparse_mla_fwd`): portable Triton, for the CPU interpreter, fp32 inputs and any GPU.
  Heads are padded to at least 16 rows with masks so that tl.dot always gets a legal tile. Triton's
  software pipeliner decides where the next tile's gather goes: the slot-id load and the gather
  split its stages, and the gather is issued after the current tile's dots, so with the two tile
  buffers that shared memory holds at GLM size most of each gather's latency is exposed. On Hopper
  it also gives the score dot's MMA all 8 warps along the heads, so both warpgroups compute every
  score.
- "sm90" (`_sparse_mla_fwd_sm90`): Hopper only, written in Gluon (Triton's explicit-layout dialect)
  to schedule by hand. NUM_BUF shared-memory tile buffers; once tile i's score MMA is issued, the
  warps request the rows of tile i + NUM_BUF - 1 with cp.async (their slot ids came through
  cp.async too, a tile earlier), so each gather overlaps whole tiles of math. The two warpgroups
  split the keys of the score MMA (64 heads x BLOCK_N / 2 keys each) and the value columns of the
  p·c MMA (r / 2 each), exchanging p through shared memory. FP8 rows land raw and are dequantized
  into one bf16 operand buffer. Heads come in blocks of 64 (wgmma's M for one warpgroup), bf16 q,
  power-of-two r and dr.
- "sm90ws" (`_sparse_mla_fwd_sm90ws`): "sm90" warp-specialized (Gluon's warp_specialize), with its
  tiling and limits and about its shared memory. In "sm90" the math warps also issue the gathers:
  a tile's address math and cp.async requests take their issue slots between the score MMA's
  issue and its wait. Here the 8 math warps (the default partition) run only "sm90"'s math,
  through the same helpers, and a producer warpgroup (4 more warps on a small register budget)
  walks the same tiles: it waits until a buffer is free, gathers the tile's rows into it with
  cp.async (slot ids read a tile ahead, published beside the rows for the key mask) and signals
  the math warps through an mbarrier; they hand the buffer back through another once done with it
  (FP8: after the score MMA, the raw rows being dequantized by then). One tile's gather is in
  flight at a time: with 2 buffers as far ahead as "sm90"'s, with more not further.

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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megactx.kernels.common import INTERPRET, cdiv, check_device, dot_f32, next_power_of_2
from megactx.kernels.reference import BLOCK_SIZE, SCALE_GROUP

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)  # ln 2: base-2 scores back to natural log
# Gluon renamed these between Triton 3.6 (the GPU machine's) and 3.9: take whichever this Triton has.
_async_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# SMs assumed under the interpreter (no device to ask); small, so that CPU tests exercise splits.
INTERPRET_NUM_SMS = 8
# Split-K cost model, in units of one key tile's gather + math (see `choose_num_splits`): a program's
# fixed cost (q load, the first gather's latency, the epilogue) and a split's extra one (its fp32
# partial out is [BLOCK_H, r] x 4 B, about one bf16 key tile of traffic, written then read back).
PROGRAM_OVERHEAD_TILES = 2
SPLIT_OVERHEAD_TILES = 1
MAX_SPLITS = 64  # bounds the scratch: T x splits x H x r fp32
COMBINE_HEADS = 16  # heads a combine program merges: [16, r] fp32 suits 4 warps; T x H / 16 programs

# The Hopper kernel: two warpgroups (8 warps) over a block of 64 heads, wgmma's M for one warpgroup.
SM90_BLOCK_H = 64
SM90_WARPS = 8
HOPPER_SMEM_BYTES = 227 * 1024  # shared memory an sm_90 block can opt into
# Scratch of the softmax (p exchanged between the warpgroups, the row max), measured on the compiled
# kernel at GLM geometry with Triton 3.6 and 3.9.
SM90_SCRATCH_BYTES = 4096
# Which kernel sparse_mla runs on Hopper when a Hopper kernel can serve a problem ("triton", "sm90"
# or "sm90ws"; see `hopper_kernel`): the fastest in benchmarks.tune_sparse_mla on the H200 ("sm90ws"
# in every case of its 2026-12-02 run, bf16 and FP8: see `_launch_config`). WS_FP8: whether an FP8
# cache follows HOPPER_DEFAULT_KERNEL = "sm90ws" too (False: FP8 stays on "sm90").
HOPPER_DEFAULT_KERNEL = "sm90ws"
WS_FP8 = True
# The smallest kv_lora_rank the Hopper kernels are the default for. Their tiling is GLM's (64-head,
# r = 512 tiles). On the H200 (2026-12-03, CUDA graphs, random top-k) at r = 512, K = 2048 they beat
# "triton" at 8-64 heads (sm90ws: decode T = 64 49-57 us against 100-106, prefill T = 4096 2.8-3.1 ms
# against 3.5-5.6); at megactx-tiny's r = 64, K = 128 "triton" prefilled faster at 4-64 heads (T = 4096:
# 48-83 us against sm90's 80-100 and sm90ws's 146-164) and decoded as fast (5 us). Ranks in between
# are unmeasured and stay on "triton".
HOPPER_MIN_RANK = 512
HOPPER_KERNELS = ("sm90", "sm90ws")  # Gluon, sm_90 only
KERNELS = ("triton", *HOPPER_KERNELS)
# The warp-specialized Hopper kernel ("sm90ws"): a producer partition of one warpgroup (the unit of
# register reallocation) gathers the tiles on a small register budget; the 8 math warps get what is
# left (Triton 3.6 and 3.9: (168 x 12 - 4 x WS_PRODUCER_REGS) / 8 rounded down to 8, 216 a thread
# for 72). At 80 the math warps' 208 spilled (Triton 3.6); at 72 neither side spills.
WS_PRODUCER_WARPS = 4
WS_PRODUCER_REGS = 72
_WS_WARPS = gl.constexpr(WS_PRODUCER_WARPS)  # the kernels see module globals only as constexprs
_WS_REGS = gl.constexpr(WS_PRODUCER_REGS)
# Alignment slack in `sm90_smem_bytes` for each shared-memory buffer "sm90ws" adds to "sm90"'s
# (the tiles' slot ids, the ready and free barriers).
WS_ALIGN_BYTES = 128


# ------------------------------------------------------------------------------ the portable kernel (Triton)
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
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, slots_ptr, len_ptr, out_ptr, lse_ptr,
    qk_scale,  # softmax_scale * log2(e): scores go straight to the base-2 domain
    H, K, split_len, num_head_blocks, num_splits,
    stride_qt, stride_qh, stride_st,
    stride_ot, stride_os, stride_oh,  # out (or the partial outs): token, split, head
    stride_lt, stride_ls,  # lse (or the partial lses): token, split; heads are contiguous
    stride_kb, stride_ks,  # cache strides of a block and of a slot, in bytes for FP8, else in elements
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
    FP8: tl.constexpr, DOT_F32: tl.constexpr, HAS_LEN: tl.constexpr,
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

    # This split's key range: whole tiles, the last split ends at K (or at the token's topk_len).
    k_lo = split * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    if HAS_LEN:
        k_hi = tl.maximum(k_lo, tl.minimum(k_hi, tl.load(len_ptr + t)))
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


# ------------------------------------------------------------------------------ the Hopper kernels (Gluon)
@gluon.constexpr_function
def _copy_layout(cols, elem_bytes, num_warps, row_lanes=32):
    """Registers of a [rows, cols] copy: 16-byte vectors, up to row_lanes of a warp's lanes along a row
    (the others on the next rows), warps down the rows."""
    vec = max(1, 16 // elem_bytes)
    lanes = max(1, min(row_lanes, cols // vec))
    return gl.BlockedLayout([1, vec], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _mma_layout(cols, num_warps):
    """wgmma accumulator [64, cols]: warpgroup g of num_warps / 4 owns the columns [g cols / n, (g + 1) cols / n)."""
    groups = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups],
                                     instr_shape=[16, min(256, cols // groups), 16])


@gluon.jit
def _row_offset(slot, stride_kb, stride_ks, PAGE: gl.constexpr):
    """Start of each slot's cache row (elements; bytes for FP8); -1 slots point at slot 0 (never read)."""
    s = gl.where(slot >= 0, slot, 0).to(gl.int64)  # int64: 1M slots x 576 elements passes 2^31
    return (s // PAGE) * stride_kb + (s % PAGE) * stride_ks


@gluon.jit
def _issue_tile(kv_ptr, kv_f32_ptr, kv_bf16_ptr, slot_lat, slot_pe, slot_sc, lat_dst, pe_dst, sc_bufs, buf,
                stride_kb, stride_ks,
                R: gl.constexpr, DR: gl.constexpr, NG: gl.constexpr, PAGE: gl.constexpr, FP8: gl.constexpr,
                LAT_COPY: gl.constexpr, PE_COPY: gl.constexpr):
    """Start (cp.async, not waited) copying the cached rows of one key tile into shared memory.

    slot_lat / slot_pe / slot_sc: the tile's [BLOCK_N] slots (-1 = none: zeros, no traffic) in the
    layouts of the copies (LAT_COPY's and PE_COPY's rows; those layouts say which warps copy: all of
    "sm90"'s, or the producer's of "sm90ws"). lat_dst [BLOCK_N, R] gets the latent as stored (bf16,
    or e4m3 bytes for FP8), pe_dst [BLOCK_N, DR] the bf16 rope key and, for FP8, rows buf * NG .. of
    sc_bufs [NUM_BUF * NG, BLOCK_N] the fp32 scales transposed (group-major, so dequantization reads
    a group's scales as one row)."""
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LAT_COPY))
    offs_dr = gl.arange(0, DR, layout=gl.SliceLayout(0, PE_COPY))
    row_lat = _row_offset(slot_lat, stride_kb, stride_ks, PAGE)
    row_pe = _row_offset(slot_pe, stride_kb, stride_ks, PAGE)
    _async_load(lat_dst, kv_ptr + row_lat[:, None] + offs_r[None, :], mask=(slot_lat >= 0)[:, None])
    if FP8:
        # Row bytes: R e4m3 | NG fp32 scales | DR bf16; kv_f32_ptr / kv_bf16_ptr view the same bytes.
        sc_ptr = kv_f32_ptr + _row_offset(slot_sc, stride_kb, stride_ks, PAGE) // 4 + R // 4
        for g in gl.static_range(NG):
            _async_load(sc_bufs.index(buf * NG + g), sc_ptr + g, mask=slot_sc >= 0)
        _async_load(pe_dst, kv_bf16_ptr + (row_pe // 2 + (R + 4 * NG) // 2)[:, None] + offs_dr[None, :],
                    mask=(slot_pe >= 0)[:, None])
    else:
        _async_load(pe_dst, kv_ptr + row_pe[:, None] + R + offs_dr[None, :], mask=(slot_pe >= 0)[:, None])


@gluon.jit
def _ring_slots(ring, tile, k_lo, k_hi, BLOCK_N: gl.constexpr, RING: gl.constexpr, LAYOUT: gl.constexpr):
    """Tile `tile`'s [BLOCK_N] slots from the shared-memory ring, in LAYOUT; past k_hi -1 (the ring's
    copy zero-filled them)."""
    offs = k_lo + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=LAYOUT)
    return gl.where(offs < k_hi, ring.index(tile % RING).load(LAYOUT), -1)


@gluon.jit
def _load_q(q_ptr, q_lat_smem, q_pe_smem, t, hb, H, stride_qt, stride_qh,
            R: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr, Q_COPY: gl.constexpr, PE_COPY: gl.constexpr):
    """Start (cp.async, not committed) copying q of token t, head block hb, into shared memory: the
    latent part [BLOCK_H, R] into q_lat_smem, the rope part [BLOCK_H, DR] into q_pe_smem; padded
    heads read as zeros."""
    h_lat = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_COPY))
    h_pe = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, PE_COPY))
    r_lat = gl.arange(0, R, layout=gl.SliceLayout(0, Q_COPY))
    r_pe = gl.arange(0, DR, layout=gl.SliceLayout(0, PE_COPY))
    q_row = q_ptr + t * stride_qt
    _async_load(q_lat_smem, q_row + h_lat[:, None] * stride_qh + r_lat[None, :], mask=(h_lat < H)[:, None])
    _async_load(q_pe_smem, q_row + h_pe[:, None] * stride_qh + R + r_pe[None, :], mask=(h_pe < H)[:, None])


@gluon.jit
def _key_range(K, split_len, split, len_ptr, t, BLOCK_N: gl.constexpr, HAS_LEN: gl.constexpr):
    """This split's keys [k_lo, k_hi) and their number of BLOCK_N-key tiles: whole tiles, the last
    split ends at K (or at the token's topk_len)."""
    k_lo = split * split_len
    k_hi = gl.minimum(K, k_lo + split_len)
    if HAS_LEN:
        k_hi = gl.maximum(k_lo, gl.minimum(k_hi, gl.load(len_ptr + t)))
    return k_lo, k_hi, gl.cdiv(k_hi - k_lo, BLOCK_N)


@gluon.jit
def _dequant_tile(raw, sc_bufs, buf, lat_op, NG: gl.constexpr, GROUP: gl.constexpr, DEQ: gl.constexpr):
    """FP8: the raw tile raw [BLOCK_N, R] (e4m3 bytes) times its scales (rows buf * NG .. of sc_bufs)
    into the bf16 operand lat_op [BLOCK_N, R], a scale group at a time. Plain shared-memory stores:
    fence them before an MMA reads lat_op."""
    for g in gl.static_range(NG):
        codes = raw.slice(g * GROUP, GROUP, dim=1).load(DEQ)
        scale = sc_bufs.index(buf * NG + g).load(gl.SliceLayout(1, DEQ))
        c = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
        lat_op.slice(g * GROUP, GROUP, dim=1).store(c.to(gl.bfloat16))


@gluon.jit
def _score_mma(q_lat_smem, q_pe_smem, lat, pe_bufs, buf, s_init):
    """Issue (not wait) a tile's score MMA: q_lat·latᵀ + q_pe·peᵀ [BLOCK_H, BLOCK_N] (pe: pe_bufs[buf]),
    fp32 in s_init's layout (each warpgroup BLOCK_N / 2 keys)."""
    s = warpgroup_mma(q_lat_smem, lat.permute((1, 0)), s_init, use_acc=False, is_async=True)
    return warpgroup_mma(q_pe_smem, pe_bufs.index(buf).permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_pv(s, valid, qk_scale, m_i, l_part, acc, lat, P_DOT: gl.constexpr, O_MMA: gl.constexpr):
    """One tile's online softmax and value MMA, from its finished scores s [BLOCK_H, BLOCK_N] and key
    mask valid [BLOCK_N]: returns the running max m_i, the per-column denominators l_part and acc
    [BLOCK_H, R] += p·lat with the MMA complete (lat [BLOCK_N, R] may be reused after)."""
    s = gl.where(valid[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # Until a valid slot shows up m stays -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    l_part = l_part * alpha[:, None] + p
    # Each warpgroup holds p for half the keys and needs all of them for its value columns; the
    # exchange goes through shared memory inside convert_layout (no proxy fence: p stays a register operand).
    p_op = gl.convert_layout(p.to(gl.bfloat16), P_DOT)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
    acc = warpgroup_mma(p_op, lat, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    return m_new, l_part, acc


@gluon.jit
def _store_out(acc, m_i, l_part, out_ptr, lse_ptr, t, split, hb, H, stride_ot, stride_os, stride_oh, stride_lt,
               stride_ls, R: gl.constexpr, BLOCK_H: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr):
    """Epilogue: out = acc / l [BLOCK_H, R] in out's dtype and lse [BLOCK_H] (natural log) of this
    (token, split, head block); rows without keys give out 0 and lse -inf."""
    l_i = gl.sum(l_part, 1)
    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * _LN2, float("-inf"))  # natural log
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, O_MMA))[:, None]  # rows without keys: acc = 0
    h_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_MMA))
    r_o = gl.arange(0, R, layout=gl.SliceLayout(0, O_MMA))
    out_ptrs = out_ptr + t * stride_ot + split * stride_os + h_o[:, None] * stride_oh + r_o[None, :]
    gl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(h_o < H)[:, None])
    h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_MMA))
    gl.store(lse_ptr + t * stride_lt + split * stride_ls + h_s, lse, mask=h_s < H)


@gluon.jit
def _program_work(num_head_blocks, num_splits):
    """This program's (head block, split, token) of the launch grid (head blocks of a token next to
    each other, then its splits, then the next token; token as int64: T * H * (r + dr) passes 2^31)."""
    pid = gl.program_id(0)
    hb = pid % num_head_blocks
    split = (pid // num_head_blocks) % num_splits
    return hb, split, (pid // (num_head_blocks * num_splits)).to(gl.int64)


@gluon.jit
def _allocate_tiles(R: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_BUF: gl.constexpr, SLOT_ROWS: gl.constexpr, NG: gl.constexpr, FP8: gl.constexpr):
    """Both Hopper kernels' shared memory, in this order: q (latent [BLOCK_H, R], rope [BLOCK_H, DR]),
    NUM_BUF rope tiles [BLOCK_N, DR], SLOT_ROWS rows of BLOCK_N int32 slot ids, NUM_BUF latent tiles
    (bf16 [BLOCK_N, R]; FP8: raw e4m3 bytes, their fp32 scales [NUM_BUF * NG, BLOCK_N] and one bf16
    operand tile to dequantize into). GLM bf16: q 72 KiB + 2 tiles x 72 KiB; FP8: 2 raw tiles x 41
    KiB + a 64 KiB operand. Without FP8, sc_bufs and lat_op alias lat_bufs (never used)."""
    LAT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], gl.bfloat16)
    PE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16)
    QL_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.bfloat16)
    QP_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, DR], gl.bfloat16)
    RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    ROW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_lat_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], QL_SMEM)
    q_pe_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DR], QP_SMEM)
    pe_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, DR], PE_SMEM)
    slot_bufs = gl.allocate_shared_memory(gl.int32, [SLOT_ROWS, BLOCK_N], ROW_SMEM)
    if FP8:
        lat_bufs = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, R], RAW_SMEM)
        sc_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUF * NG, BLOCK_N], ROW_SMEM)
        lat_op = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, R], LAT_SMEM)
    else:
        lat_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, R], LAT_SMEM)
        sc_bufs = lat_bufs
        lat_op = lat_bufs
    return q_lat_smem, q_pe_smem, pe_bufs, slot_bufs, lat_bufs, sc_bufs, lat_op


# num_splits and num_head_blocks only enter the program-id arithmetic (as in `_sparse_mla_fwd`).
@gluon.jit(do_not_specialize=["num_head_blocks", "num_splits"])
def _sparse_mla_fwd_sm90(
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, slots_ptr, len_ptr, out_ptr, lse_ptr,
    qk_scale, H, K, split_len, num_head_blocks, num_splits,
    stride_qt, stride_qh, stride_st,
    stride_ot, stride_os, stride_oh,
    stride_lt, stride_ls,
    stride_kb, stride_ks,
    R: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
    PAGE: gl.constexpr, GROUP: gl.constexpr, FP8: gl.constexpr, HAS_LEN: gl.constexpr, num_warps: gl.constexpr,
):
    """`_sparse_mla_fwd`'s contract (same arguments but for the tiling constants; bf16 q, r and dr
    powers of two, NUM_BUF >= 2) for sm_90, pipelined by hand.

    Copy groups: group i (i < 0: the prologue's) holds the rows of tile i + NUM_BUF - 1 and the slot
    ids of tile i + 2 NUM_BUF - 2, which land in a shared-memory ring of 2 NUM_BUF tiles. At the
    top of tile i, waiting until at most NUM_BUF - 2 groups are pending completes group
    i - NUM_BUF + 1: tile i's rows and the slot ids of tile i + NUM_BUF - 1, whose rows are
    requested next. So no global load is outstanding at a proxy fence (a fence waits for this
    thread's loads: the slot ids come through cp.async too), and with 2 buffers none of the rows
    either (the fence precedes the next request)."""
    NG: gl.constexpr = R // GROUP
    RING: gl.constexpr = 2 * NUM_BUF
    S_MMA: gl.constexpr = _mma_layout(BLOCK_N, num_warps)  # scores: each warpgroup BLOCK_N / 2 keys
    O_MMA: gl.constexpr = _mma_layout(R, num_warps)  # acc: each warpgroup r / 2 value columns
    P_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)  # p, all keys a warpgroup
    LAT_COPY: gl.constexpr = _copy_layout(R, 1 if FP8 else 2, num_warps)
    PE_COPY: gl.constexpr = _copy_layout(DR, 2, num_warps)
    Q_COPY: gl.constexpr = _copy_layout(R, 2, num_warps)
    VEC_COPY: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    DEQ: gl.constexpr = _copy_layout(GROUP, 1, num_warps)  # one scale group of a tile: [BLOCK_N, GROUP]

    hb, split, t = _program_work(num_head_blocks, num_splits)
    q_lat_smem, q_pe_smem, pe_bufs, ring, lat_bufs, sc_bufs, lat_op = _allocate_tiles(
        R, DR, BLOCK_H, BLOCK_N, NUM_BUF, RING, NG, FP8)

    # q -> shared memory, in the first copy group.
    _load_q(q_ptr, q_lat_smem, q_pe_smem, t, hb, H, stride_qt, stride_qh, R, DR, BLOCK_H, Q_COPY, PE_COPY)

    # Tiles past this split's key range read as all -1 (zero-filled, no traffic), so short splits
    # need no special case.
    k_lo, k_hi, n_tiles = _key_range(K, split_len, split, len_ptr, t, BLOCK_N, HAS_LEN)
    slot_row = slots_ptr + t * stride_st
    offs_vec = gl.arange(0, BLOCK_N, layout=VEC_COPY)
    offs_lat = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAT_COPY))
    offs_pe = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, PE_COPY))

    # Prologue, groups -NUM_BUF + 1 .. -1: the rows of tiles 0 .. NUM_BUF - 2 (slot ids loaded
    # directly, once) and the slot ids of tiles 0 .. 2 NUM_BUF - 3 into the ring.
    for j in gl.static_range(NUM_BUF - 1):
        o = k_lo + j * BLOCK_N
        _issue_tile(kv_ptr, kv_f32_ptr, kv_bf16_ptr,
                    gl.load(slot_row + o + offs_lat, mask=o + offs_lat < k_hi, other=-1),
                    gl.load(slot_row + o + offs_pe, mask=o + offs_pe < k_hi, other=-1),
                    gl.load(slot_row + o + offs_vec, mask=o + offs_vec < k_hi, other=-1),
                    lat_bufs.index(j), pe_bufs.index(j), sc_bufs, j, stride_kb, stride_ks,
                    R, DR, NG, PAGE, FP8, LAT_COPY, PE_COPY)
        _async_load(ring.index(j), slot_row + o + offs_vec, mask=o + offs_vec < k_hi)
        o2 = o + (NUM_BUF - 1) * BLOCK_N
        _async_load(ring.index(j + NUM_BUF - 1), slot_row + o2 + offs_vec, mask=o2 + offs_vec < k_hi)
        _cp.commit_group()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))  # running max (base 2)
    # Running softmax denominator kept per (head, key column) and summed once at the end: a row sum
    # a tile would cross the warpgroups (a shared-memory round trip and two barriers).
    l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
    acc = gl.zeros([BLOCK_H, R], gl.float32, layout=O_MMA)
    s_init = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
    for it in range(n_tiles):
        cur = it % NUM_BUF
        _cp.wait_group(NUM_BUF - 2)  # group it - NUM_BUF + 1: tile it's rows, tile it + NUM_BUF - 1's ids
        if FP8:
            _barrier()  # every thread's part of the raw tile has landed, every warpgroup is past the last MMA
            _dequant_tile(lat_bufs.index(cur), sc_bufs, cur, lat_op, NG, GROUP, DEQ)
            lat = lat_op
        else:
            lat = lat_bufs.index(cur)
        # cp.async and st.shared write through the generic proxy, wgmma reads through the async one.
        fence_async_shared()
        # Every thread's copies have landed, and every warpgroup is past the previous tile's MMAs:
        # the oldest buffer (tile it - 1's) and ring entry (tile it - 2's) are free.
        _barrier()
        # The score MMA runs on the tensor cores while the warps request the next tile's rows.
        s = _score_mma(q_lat_smem, q_pe_smem, lat, pe_bufs, cur, s_init)
        # All ring reads before the ring's next copy (one barrier between, which the compiler adds).
        valid = _ring_slots(ring, it, k_lo, k_hi, BLOCK_N, RING, gl.SliceLayout(0, S_MMA)) >= 0
        nxt = it + NUM_BUF - 1
        _issue_tile(kv_ptr, kv_f32_ptr, kv_bf16_ptr,
                    _ring_slots(ring, nxt, k_lo, k_hi, BLOCK_N, RING, gl.SliceLayout(1, LAT_COPY)),
                    _ring_slots(ring, nxt, k_lo, k_hi, BLOCK_N, RING, gl.SliceLayout(1, PE_COPY)),
                    _ring_slots(ring, nxt, k_lo, k_hi, BLOCK_N, RING, VEC_COPY),
                    lat_bufs.index(nxt % NUM_BUF), pe_bufs.index(nxt % NUM_BUF), sc_bufs, nxt % NUM_BUF,
                    stride_kb, stride_ks, R, DR, NG, PAGE, FP8, LAT_COPY, PE_COPY)
        o = k_lo + (it + 2 * NUM_BUF - 2) * BLOCK_N
        _async_load(ring.index((it + 2 * NUM_BUF - 2) % RING), slot_row + o + offs_vec, mask=o + offs_vec < k_hi)
        _cp.commit_group()
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        m_i, l_part, acc = _softmax_pv(s, valid, qk_scale, m_i, l_part, acc, lat, P_DOT, O_MMA)
    _cp.wait_group(0)  # the (empty) copies requested past the last tile

    _store_out(acc, m_i, l_part, out_ptr, lse_ptr, t, split, hb, H, stride_ot, stride_os, stride_oh, stride_lt,
               stride_ls, R, BLOCK_H, S_MMA, O_MMA)


@gluon.jit
def _release(bar):
    """Hand a tile buffer back to the producer, once every warp of this partition is done with it.

    mbarrier.arrive is made by one thread of the partition (count 1), so a partition barrier goes
    first; the proxy fence orders this partition's reads (wgmma's, through the async proxy) before
    the producer's next cp.async writes to the buffer (generic proxy)."""
    fence_async_shared()
    _barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _sm90ws_consumer(q_ptr, out_ptr, lse_ptr, qk_scale, H, t, hb, split, n_tiles,
                     stride_qt, stride_qh, stride_ot, stride_os, stride_oh, stride_lt, stride_ls, smem, ready, free,
                     R: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                     NUM_BUF: gl.constexpr, GROUP: gl.constexpr, FP8: gl.constexpr, num_warps: gl.constexpr):
    """"sm90ws"'s default partition, the kernel's num_warps (8) math warps: `_sparse_mla_fwd_sm90`'s
    loop body without its copies. Tile it comes from buffer it % NUM_BUF once ready[it % NUM_BUF]
    completes its phase (it // NUM_BUF) & 1; the buffer goes back through free[...]."""
    NG: gl.constexpr = R // GROUP
    S_MMA: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
    O_MMA: gl.constexpr = _mma_layout(R, num_warps)
    P_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
    Q_COPY: gl.constexpr = _copy_layout(R, 2, num_warps)
    PE_COPY: gl.constexpr = _copy_layout(DR, 2, num_warps)
    DEQ: gl.constexpr = _copy_layout(GROUP, 1, num_warps)
    q_lat_smem, q_pe_smem, lat_bufs, pe_bufs, sc_bufs, lat_op, ids_bufs = smem

    _load_q(q_ptr, q_lat_smem, q_pe_smem, t, hb, H, stride_qt, stride_qh, R, DR, BLOCK_H, Q_COPY, PE_COPY)
    _cp.commit_group()
    _cp.wait_group(0)
    fence_async_shared()
    _barrier()  # both warpgroups' score MMAs read all of q, which all 8 warps copied

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))  # running max (base 2)
    l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)  # as in `_sparse_mla_fwd_sm90`
    acc = gl.zeros([BLOCK_H, R], gl.float32, layout=O_MMA)
    s_init = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
    for it in range(n_tiles):
        cur = it % NUM_BUF
        mbarrier.wait(ready.index(cur), (it // NUM_BUF) & 1)  # the producer fenced its copies before arriving
        valid = ids_bufs.index(cur).load(gl.SliceLayout(0, S_MMA)) >= 0
        if FP8:
            _barrier()  # every warpgroup is past the previous tile's PV MMA, which read lat_op
            _dequant_tile(lat_bufs.index(cur), sc_bufs, cur, lat_op, NG, GROUP, DEQ)
            fence_async_shared()
            _barrier()  # all of lat_op stored before either warpgroup's MMA reads it
            lat = lat_op
        else:
            lat = lat_bufs.index(cur)
        s = _score_mma(q_lat_smem, q_pe_smem, lat, pe_bufs, cur, s_init)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        if FP8:
            # Raw rows, scales, rope rows and ids all read: the producer may refill the buffer while
            # this tile's softmax and PV MMA (on lat_op) run.
            _release(free.index(cur))
        m_i, l_part, acc = _softmax_pv(s, valid, qk_scale, m_i, l_part, acc, lat, P_DOT, O_MMA)
        if not FP8:
            _release(free.index(cur))  # the PV MMA, the buffer's last reader, has completed

    _store_out(acc, m_i, l_part, out_ptr, lse_ptr, t, split, hb, H, stride_ot, stride_os, stride_oh, stride_lt,
               stride_ls, R, BLOCK_H, S_MMA, O_MMA)


@gluon.jit
def _sm90ws_producer(kv_ptr, kv_f32_ptr, kv_bf16_ptr, slot_row, k_lo, k_hi, n_tiles, stride_kb, stride_ks,
                     lat_bufs, pe_bufs, sc_bufs, ids_bufs, ready, free,
                     R: gl.constexpr, DR: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
                     PAGE: gl.constexpr, GROUP: gl.constexpr, FP8: gl.constexpr):
    """"sm90ws"'s worker partition, WS_PRODUCER_WARPS warps: gathers the rows of every tile of the
    split into buffer it % NUM_BUF, one tile in flight at a time, and publishes the tile's slot ids
    in ids_bufs for the consumers' key mask."""
    NG: gl.constexpr = R // GROUP
    # 8 lanes a row (128 bytes, an L1 line, a copy instruction), the rest of the warp on the next
    # rows: a thread copies whole lines of 4x fewer rows than with 32 lanes a row, so it holds 4x
    # fewer row addresses (no spills within WS_PRODUCER_REGS; 32 lanes a row spilled with FP8).
    LAT_COPY: gl.constexpr = _copy_layout(R, 1 if FP8 else 2, _WS_WARPS, 8)
    PE_COPY: gl.constexpr = _copy_layout(DR, 2, _WS_WARPS, 8)
    VEC_COPY: gl.constexpr = gl.BlockedLayout([1], [32], [_WS_WARPS], [0])
    offs_vec = gl.arange(0, BLOCK_N, layout=VEC_COPY)

    # Slot ids a tile ahead, in registers (masked to -1 past k_hi, as in `_sparse_mla_fwd_sm90`):
    # their global-load latency stays off the path from a free buffer to its gather.
    # int32 in shared memory whatever the slots' dtype (a cache of 2^31 slots would be 80+ TB).
    nxt_ids = gl.load(slot_row + k_lo + offs_vec, mask=k_lo + offs_vec < k_hi, other=-1).to(gl.int32)
    for it in range(n_tiles):
        cur = it % NUM_BUF
        ids = nxt_ids
        o = k_lo + (it + 1) * BLOCK_N
        nxt_ids = gl.load(slot_row + o + offs_vec, mask=o + offs_vec < k_hi, other=-1).to(gl.int32)
        # Buffer cur's previous tile (it - NUM_BUF) is done. The parity flip lets the first NUM_BUF
        # tiles through at once: a fresh mbarrier counts phase 1 (its "previous" one) as complete.
        mbarrier.wait(free.index(cur), ((it // NUM_BUF) & 1) ^ 1)
        ids_bufs.index(cur).store(ids)
        _barrier()  # ids stored: every producer thread reads them back in its copies' layouts
        _issue_tile(kv_ptr, kv_f32_ptr, kv_bf16_ptr,
                    ids_bufs.index(cur).load(gl.SliceLayout(1, LAT_COPY)),
                    ids_bufs.index(cur).load(gl.SliceLayout(1, PE_COPY)), ids,
                    lat_bufs.index(cur), pe_bufs.index(cur), sc_bufs, cur, stride_kb, stride_ks,
                    R, DR, NG, PAGE, FP8, LAT_COPY, PE_COPY)
        _cp.commit_group()
        _cp.wait_group(0)  # this thread's copies have landed
        fence_async_shared()  # cp.async wrote through the generic proxy, wgmma reads through the async one
        _barrier()  # every producer thread's copies have landed and been fenced: one thread arrives for all
        mbarrier.arrive(ready.index(cur), count=1)


# num_splits and num_head_blocks only enter the program-id arithmetic (as in `_sparse_mla_fwd`).
@gluon.jit(do_not_specialize=["num_head_blocks", "num_splits"])
def _sparse_mla_fwd_sm90ws(
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, slots_ptr, len_ptr, out_ptr, lse_ptr,
    qk_scale, H, K, split_len, num_head_blocks, num_splits,
    stride_qt, stride_qh, stride_st,
    stride_ot, stride_os, stride_oh,
    stride_lt, stride_ls,
    stride_kb, stride_ks,
    R: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
    PAGE: gl.constexpr, GROUP: gl.constexpr, FP8: gl.constexpr, HAS_LEN: gl.constexpr, num_warps: gl.constexpr,
):
    """`_sparse_mla_fwd_sm90`'s arguments and contract, warp-specialized: the num_warps (8) math
    warps (`_sm90ws_consumer`) only compute, WS_PRODUCER_WARPS more (`_sm90ws_producer`) gather.

    Barrier protocol, per tile buffer b (tile it uses b = it % NUM_BUF, round n = it // NUM_BUF):
    - ready[b]: the producer arrives once the tile's rows and ids are in b (after its own cp.async
      wait, proxy fence and partition barrier); the consumers wait for phase n & 1.
    - free[b]: the consumers arrive once they no longer read b (bf16: after the PV MMA; FP8: after
      the score MMA, the raw rows being dequantized into lat_op by then); the producer waits for
      phase (n & 1) ^ 1 before refilling b, which a fresh barrier passes in round 0.
    Both are initialized with count 1: Gluon's mbarrier.arrive is made by one elected thread of the
    arriving partition (thread 0 of its warps; the PTX `@p mbarrier.arrive` with p = tid % partition
    size == 0), after a barrier of that partition. Neither side gets more than one phase ahead (the
    producer refills b only after the consumers' arrival for its previous tile, which came after
    their wait for that tile), so a parity wait is never ambiguous."""
    NG: gl.constexpr = R // GROUP
    hb, split, t = _program_work(num_head_blocks, num_splits)
    # `_sparse_mla_fwd_sm90`'s shared memory, with each buffer's slot ids in place of its ring of them.
    q_lat_smem, q_pe_smem, pe_bufs, ids_bufs, lat_bufs, sc_bufs, lat_op = _allocate_tiles(
        R, DR, BLOCK_H, BLOCK_N, NUM_BUF, NUM_BUF, NG, FP8)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(b), count=1)  # one (elected) producer arrival a phase
        mbarrier.init(free.index(b), count=1)  # one (elected) consumer arrival a phase
    # No fence after the inits: the barriers are used only by mbarrier instructions (no TMA), and
    # warp_specialize starts its partitions behind a CTA-wide barrier.

    k_lo, k_hi, n_tiles = _key_range(K, split_len, split, len_ptr, t, BLOCK_N, HAS_LEN)
    smem = (q_lat_smem, q_pe_smem, lat_bufs, pe_bufs, sc_bufs, lat_op, ids_bufs)
    gl.warp_specialize([
        (_sm90ws_consumer, (q_ptr, out_ptr, lse_ptr, qk_scale, H, t, hb, split, n_tiles,
                            stride_qt, stride_qh, stride_ot, stride_os, stride_oh, stride_lt, stride_ls,
                            smem, ready, free, R, DR, BLOCK_H, BLOCK_N, NUM_BUF, GROUP, FP8, num_warps)),
        (_sm90ws_producer, (kv_ptr, kv_f32_ptr, kv_bf16_ptr, slots_ptr + t * stride_st, k_lo, k_hi, n_tiles,
                            stride_kb, stride_ks, lat_bufs, pe_bufs, sc_bufs, ids_bufs, ready, free,
                            R, DR, BLOCK_N, NUM_BUF, PAGE, GROUP, FP8)),
    ], [_WS_WARPS], [_WS_REGS])
    for b in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(b))
        mbarrier.invalidate(free.index(b))


# ------------------------------------------------------------------------------ launch
@dataclass(frozen=True)
class LaunchConfig:
    """How `sparse_mla` tiles and launches a problem (each field can be overridden by a keyword)."""

    block_h: int  # heads a program serves (>= 16: tl.dot's smallest tile side; 64 for "sm90", "sm90ws")
    block_n: int  # cached rows gathered a tile
    num_warps: int  # "sm90ws": its math warps (the producer's WS_PRODUCER_WARPS come on top)
    # "triton": Triton's software pipeliner (rows requested (num_stages - 1) // 2 tiles ahead);
    # "sm90": shared-memory tile buffers (rows requested num_stages - 1 tiles ahead); "sm90ws": as
    # many buffers, the producer one tile's gather in flight at a time (see `_sparse_mla_fwd_sm90ws`).
    num_stages: int
    kernel: str = "triton"  # one of KERNELS


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRET_NUM_SMS under the Triton interpreter)."""
    if device.type != "cuda":
        return INTERPRET_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, num_tiles: int, sms: int) -> int:
    """Splits of each token's top-k that finish a launch soonest under a wave model.

    num_programs: (token, head block) pairs; num_tiles: key tiles a token; sms: programs that run at
    once (one a SM: a GLM-size program holds 170-227 KiB of shared memory). A launch of
    num_programs x s programs runs in ceil(num_programs x s / sms) waves, each as long as one
    program: ceil(num_tiles / s) tiles plus PROGRAM_OVERHEAD_TILES, plus SPLIT_OVERHEAD_TILES when
    split. Prefill (T x head blocks >> SMs) gets 1; decode of 64 tokens on 132 SMs gets 2; one
    token gets one tile a split (up to MAX_SPLITS)."""
    best, best_cost = 1, None
    for s in range(1, min(num_tiles, MAX_SPLITS) + 1):
        per_program = cdiv(num_tiles, s) + PROGRAM_OVERHEAD_TILES + (SPLIT_OVERHEAD_TILES if s > 1 else 0)
        cost = cdiv(num_programs * s, sms) * per_program
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def sm90_smem_bytes(kv_lora_rank: int, rope_dim: int, block_n: int, num_buffers: int, fp8: bool,
                    warp_specialized: bool = False) -> int:
    """Shared memory of one Hopper-kernel program: q, the tile buffers (FP8: raw rows plus one bf16
    operand buffer), the softmax's scratch and, for `_sparse_mla_fwd_sm90`, its ring of slot ids
    (exact). warp_specialized (`_sparse_mla_fwd_sm90ws`): the tiles' slot ids, the ready and free
    mbarriers and warp_specialize's state (a byte a producer warp) instead of the ring, plus
    WS_ALIGN_BYTES for each of its buffers (an upper bound). GLM-5.2 (r = 512, dr = 64, 64-row
    tiles, 2 buffers): "sm90" 226,304 B with a bf16 cache, 228,352 B with FP8; "sm90ws" at most
    226,212 and 228,260 B (compiled: 225,828 and 227,876); all under sm_90's 232,448."""
    r, dr = kv_lora_rank, rope_dim
    q = SM90_BLOCK_H * (r + dr) * 2
    if fp8:
        tiles = num_buffers * block_n * (r + 4 * (r // SCALE_GROUP) + 2 * dr) + block_n * r * 2
    else:
        tiles = num_buffers * block_n * (r + dr) * 2
    if not warp_specialized:
        ring = 2 * num_buffers * block_n * 4
        return q + tiles + ring + SM90_SCRATCH_BYTES
    ids = num_buffers * block_n * 4
    barriers = 2 * num_buffers * 8
    return q + tiles + ids + barriers + WS_PRODUCER_WARPS + SM90_SCRATCH_BYTES + 3 * WS_ALIGN_BYTES


def sm90_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                     block_n: int = 64, num_buffers: int = 2, kernel: str = "sm90") -> str:
    """Why the Hopper kernel `kernel` ("sm90" or "sm90ws") cannot serve this problem ('' when it
    can): it needs a Hopper GPU, bf16 q, a bf16 or FP8 cache, power-of-two r >= 64 and dr >= 16
    (whole 16-byte copies, legal wgmma tiles), 2+ tile buffers (one computed while the next lands)
    within shared memory (`sm90_smem_bytes` of that kernel)."""
    r, dr = kv_lora_rank, q.shape[-1] - kv_lora_rank
    if INTERPRET or q.device.type != "cuda":
        return "it needs a CUDA device (the Triton interpreter runs only kernel='triton')"
    cc = torch.cuda.get_device_capability(q.device)
    if cc != (9, 0):
        return f"it needs a Hopper GPU (compute capability 9.0), this one is {cc[0]}.{cc[1]}"
    if q.dtype != torch.bfloat16 or kv_cache.dtype not in (torch.bfloat16, torch.uint8):
        return f"it needs bf16 q and a bf16 or FP8 cache, got q {q.dtype} and cache {kv_cache.dtype}"
    if r < 64 or dr < 16 or r & (r - 1) or dr & (dr - 1):
        return f"it needs power-of-two kv_lora_rank >= 64 and rope dim >= 16, got {r} and {dr}"
    if kv_cache.dtype == torch.uint8 and r != 512:
        # on the H200 its FP8 path matched the twin at r = 512 (GLM, DeepSeek) but not at 128 or 256
        return f"its FP8-cache path is verified only at kv_lora_rank 512, got {r}"
    if num_buffers < 2:
        return f"it needs num_stages >= 2 (tile buffers: one computed while the next lands), got {num_buffers}"
    need = sm90_smem_bytes(r, dr, block_n, num_buffers, kv_cache.dtype == torch.uint8, kernel == "sm90ws")
    if need > HOPPER_SMEM_BYTES:
        return (f"{block_n}-row tiles x {num_buffers} buffers at r = {r}, dr = {dr} need {need} B of shared "
                f"memory, more than sm_90's {HOPPER_SMEM_BYTES}")
    return ""


def hopper_kernel(fp8: bool) -> str:
    """The kernel `sparse_mla` picks on Hopper when none is asked for and `sm90_unsupported` allows
    it: HOPPER_DEFAULT_KERNEL, except that an FP8 cache stays on "sm90" when WS_FP8 is False."""
    if HOPPER_DEFAULT_KERNEL == "sm90ws" and fp8 and not WS_FP8:
        return "sm90"
    return HOPPER_DEFAULT_KERNEL


def default_kernel(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> str:
    """The kernel `sparse_mla` runs for q over kv_cache when none is asked for: the Hopper one
    (`hopper_kernel`) at kv_lora_rank >= HOPPER_MIN_RANK where `sm90_unsupported` allows it, else
    "triton"."""
    kernel = hopper_kernel(kv_cache.dtype == torch.uint8)
    if kernel != "triton" and (kv_lora_rank < HOPPER_MIN_RANK
                               or sm90_unsupported(q, kv_cache, kv_lora_rank, kernel=kernel)):
        return "triton"
    return kernel


def _launch_config(num_heads: int, topk: int, block_r: int, fp8: bool, kernel: str = "triton") -> LaunchConfig:
    """The tiling of `kernel` for a problem; tl.dot needs every tile side >= 16.

    Timed on an H200 (triton 3.6, `python -m benchmarks.tune_sparse_mla`: GLM-5.2 geometry H = 64,
    r = 512, K = 2048, a 1M-token cache, L2 flushed). "triton": prefill T = 4096 with 64 x 64
    tiles, 8 warps, 3 stages ran at 216 TFLOP/s with a bf16 cache (FP8 192); 32- and 16-row tiles
    with deeper pipelines 110-169, 32-head blocks (two programs a token) 125-155. Decode T = 64:
    2 stages, 2 splits, 167 (FP8 149). Latency-bound on the gathers (~5 us a 64-row tile an SM;
    index_select moves the same rows at 3.8 TB/s against the kernel's 1.8): the pipeliner requests
    the next tile after the tile's dots, and the [64, 512] fp32 accumulator (128 registers a
    thread) leaves one program a SM. "sm90" requests it during them (module docstring): 64-row
    tiles with 2 buffers (32-row tiles fit 4). Timed on the H200 (same script, same run as the Triton
    candidates): prefill T = 4096 bf16 379 TFLOP/s (local top-k) / 339 (uniform) against Triton's
    219 / 209; FP8 268 against 193; decode T = 64 bf16 253 (2 splits) against 167, FP8 203 against
    149 — faster in every case, so it is the Hopper default where `sm90_unsupported` allows it.
    "sm90ws" (the same math with the gathers on a producer warpgroup) takes "sm90"'s tiling and,
    in one run of the script on the H200 (2026-12-02), beat it in all 10 cases by 1.09-1.19x with
    64-row tiles and 2 buffers (its best tiling, as "sm90"'s): prefill T = 4096 bf16 426 / 379
    TFLOP/s (local / uniform) against 374 / 347, FP8 304 / 303 against 267; decode T = 64 bf16 288
    (63.5 us) against 251, FP8 233 against 203; verify T = 256 bf16 412 / 390 against 345 / 335, FP8
    287 / 285 against 248 / 251. So it is the Hopper default (HOPPER_DEFAULT_KERNEL, WS_FP8)."""
    if kernel in HOPPER_KERNELS:
        return LaunchConfig(SM90_BLOCK_H, min(64, max(16, next_power_of_2(topk))), SM90_WARPS, 2, kernel)
    block_h = min(64, max(16, next_power_of_2(num_heads)))
    block_n = min(64, max(16, next_power_of_2(topk)))
    # acc [BLOCK_H, r] fp32 stays in registers: 8 warps keep it at 128 registers a thread for GLM.
    num_warps = 8 if block_h * block_r >= 64 * 256 else 4
    return LaunchConfig(block_h, block_n, num_warps, num_stages=3)


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int, topk_len: torch.Tensor | None = None, *, block_h: int | None = None,
               block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               num_splits: int | None = None, kernel: str | None = None,
               split_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form sparse MLA: each query token attends to its own top-k slots only.

    q: [T, H, r + dr] bf16 or fp32 (latent-space query ‖ roped query); kv_cache: paged
    [num_blocks, 64, r + dr] bf16/fp32, or the FP8 layout [num_blocks, 64, r + 4 r/128 + 2 dr] uint8
    (see `megactx.kernels.reference`); topk_slots: [T, K] int32/int64 physical slots
    (block * 64 + offset), -1 = none; slots must lie inside the cache (not checked: it would sync).
    softmax_scale multiplies q·k; kv_lora_rank is r. topk_len: [T] int32, optional: token t reads
    only its first topk_len[t] slots, the rest count as -1. A top-k lists a row's valid slots
    first, so a causal query at position p passes p + 1 (its key count; min(p + 1, K) are valid):
    the tiles of slots that cannot be valid are skipped, not computed on zeros (prefill of
    contexts near K, FlashMLA's topk_length).
    Returns out [T, H, r] in q's dtype and lse [T, H] fp32 (natural log of the softmax denominator
    over scaled scores); a row with no valid slot gives out 0 and lse -inf.

    Dots run in bf16 with fp32 accumulation (fp32 throughout when q or the cache is fp32). The
    keyword-only arguments override the launch of `_launch_config` (for tuning): kernel ("triton",
    or a Hopper kernel: "sm90", "sm90ws"; default `hopper_kernel` where `sm90_unsupported` is empty
    for it, else "triton"), block_h, block_n, num_warps, num_stages, and num_splits (split-K:
    chunks of each token's top-k, >= 1, capped at the number of key tiles; default from
    `choose_num_splits` and the SM count), split_dtype: the dtype of the splits' partial outputs
    (default fp32; bf16 halves what they write and the combine reads, at one more bf16 rounding of
    each partial; their lse stays fp32). No host sync: safe under CUDA-graph capture (the split-K
    scratch comes from the caching allocator)."""
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
    if topk_len is not None and (topk_len.shape != (q.shape[0],) or topk_len.dtype != torch.int32
                                 or topk_len.device != q.device):
        raise ValueError(f"topk_len must be [T] int32 on {q.device} with T = {q.shape[0]}, got shape "
                         f"{tuple(topk_len.shape)}, {topk_len.dtype} on {topk_len.device}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (1 = no split-K), got {num_splits}")
    for name, value in (("block_h", block_h), ("block_n", block_n)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile side), got {value}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if split_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"split_dtype must be torch.float32 or torch.bfloat16, got {split_dtype}")
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
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

    block_r = max(16, next_power_of_2(r))
    block_dr = max(16, next_power_of_2(dr))
    if kernel is None:
        kernel = default_kernel(q, kv_cache, r)
    overrides = {"block_h": block_h, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    cfg = replace(_launch_config(H, K, block_r, fp8, kernel), **{k: v for k, v in overrides.items() if v is not None})
    if kernel in HOPPER_KERNELS:
        why = sm90_unsupported(q, kv_cache, r, cfg.block_n, cfg.num_stages, kernel)
        if why:
            raise ValueError(f"kernel={kernel!r} cannot run this problem: {why}; use kernel='triton'")
        if (cfg.block_h, cfg.num_warps) != (SM90_BLOCK_H, SM90_WARPS):
            raise ValueError(f"kernel={kernel!r} runs blocks of {SM90_BLOCK_H} heads on {SM90_WARPS} math warps "
                             f"(two warpgroups), got block_h = {cfg.block_h}, num_warps = {cfg.num_warps}")
    head_blocks = cdiv(H, cfg.block_h)
    num_tiles = cdiv(K, cfg.block_n)
    if num_splits is None:
        num_splits = choose_num_splits(T * head_blocks, num_tiles, num_sms(q.device))
    # Whole tiles a split; then drop splits that would start past K (e.g. K = 5 asked for 4 splits).
    split_len = cdiv(num_tiles, min(num_splits, num_tiles)) * cfg.block_n
    splits = cdiv(K, split_len)

    if fp8:
        # Views of the same bytes for the fp32 scales and bf16 rope values; element offsets are byte offsets / 4, / 2.
        kv_f32, kv_bf16 = kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)
    else:
        kv_f32 = kv_bf16 = kv_cache  # unused
    if splits > 1:
        # Partial outs, fp32 unless asked (they are rescaled and summed); [T, splits, H, r] and [T, splits, H].
        dst = torch.empty(T, splits, H, r, dtype=split_dtype or torch.float32, device=q.device)
        dst_lse = torch.empty(T, splits, H, dtype=torch.float32, device=q.device)
    else:
        dst, dst_lse = out.unsqueeze(1), lse.unsqueeze(1)
    args = (q, kv_cache, kv_f32, kv_bf16, topk_slots, topk_slots if topk_len is None else topk_len, dst, dst_lse,
            softmax_scale * _LOG2E,
            H, K, split_len, head_blocks, splits,
            q.stride(0), q.stride(1), topk_slots.stride(0),
            dst.stride(0), dst.stride(1), dst.stride(2), dst_lse.stride(0), dst_lse.stride(1),
            kv_cache.stride(0), kv_cache.stride(1))
    grid = (T * splits * head_blocks,)
    if kernel in HOPPER_KERNELS:
        fwd = _sparse_mla_fwd_sm90 if kernel == "sm90" else _sparse_mla_fwd_sm90ws
        fwd[grid](*args, R=r, DR=dr, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NUM_BUF=cfg.num_stages,
                  PAGE=BLOCK_SIZE, GROUP=SCALE_GROUP, FP8=fp8, HAS_LEN=topk_len is not None,
                  num_warps=cfg.num_warps)
    else:
        _sparse_mla_fwd[grid](
            *args,
            R=r, DR=dr, BLOCK_R=block_r, BLOCK_DR=block_dr, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
            PAGE=BLOCK_SIZE, GROUP=SCALE_GROUP, NG=max(1, block_r // SCALE_GROUP), FP8=fp8,
            DOT_F32=dot_f32(q.dtype, kv_cache.dtype), HAS_LEN=topk_len is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if splits > 1:
        _combine_splits[(T, cdiv(H, COMBINE_HEADS))](
            dst, dst_lse, out, lse, H, splits,
            dst.stride(0), dst.stride(1), dst.stride(2), dst_lse.stride(0), dst_lse.stride(1),
            out.stride(0), out.stride(1),
            R=r, BLOCK_R=block_r, BLOCK_H=COMBINE_HEADS, BLOCK_S=next_power_of_2(splits), num_warps=4,
        )
    return out.to(q.dtype), lse
