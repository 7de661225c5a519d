"""Lightning-indexer logits over the paged indexer cache (Triton, FP8 or exact), and a chunked top-k on top.

One kernel serves prefill (a variable-length batch, each query with its own causal key range) and
decode / speculative verify (a few query tokens a sequence over a long paged cache): every query
row carries its sequence and its key count, nothing else distinguishes the two.

Tiling: one program per (BLOCK_M consecutive query rows) × (BLOCK_N keys = BLOCK_N / 64 cache
blocks). Rows of the tile that belong to the same sequence form a group; a group loads its key tile
once (e4m3 [BLOCK_N, DI] gathered through the block table, plus the keys' fp32 scales) and runs one
FP8 dot for all its rows and heads at once, k [BLOCK_N, DI] × qᵀ [DI, BLOCK_M·HI] ->
[BLOCK_N, BLOCK_M·HI] fp32, then ReLU, × w, Σ over heads, × k_scale. A tile whose rows all belong
to one sequence (prefill, multi-token decode) is one group; a lone row (plain decode, a sequence
boundary) takes a narrow k × qᵀ [DI, HI] dot instead. Groups whose rows all end before the key
tile load nothing, so causal prefill skips the upper triangle.

On an H200 (HI = 64, DI = 128, logits only) this ran a causal prefill of 8K in 2.0 ms and of 32K in
33 ms, and a 64-row paged decode batch at 64K context in 0.33 ms; DeepGEMM's logits plus torch.topk
take 1.99, 28.4 and 0.323 ms (shared/reference/FACTS.md). GLM's HI = 32: 1.15, 20 and 0.30 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import INTERPRET, check_device
from megactx.kernels.reference import BLOCK_SIZE, chunked_topk
from megactx.kernels.topk import topk_rows
from megactx.model.quant import FP8


@triton.jit
def _weighted_relu_dot(q_ptr, w_ptr, k, first_row, T, stride_qt, stride_qh, stride_wt,
                       HI: tl.constexpr, DI: tl.constexpr, HI_PAD: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Rows first_row .. first_row + ROWS - 1 against the key tile k [BLOCK_N, DI] e4m3 ->
    [ROWS, BLOCK_N] fp32 = Σ_h w[t, h] · ReLU(q[t, h] · k[n])."""
    r = tl.arange(0, ROWS * HI_PAD)
    tok = first_row + r // HI_PAD
    head = r % HI_PAD
    ok = (tok < T) & (head < HI)  # padded heads load q = 0 and w = 0: they add nothing
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=ok[:, None], other=0.0)  # [ROWS·HI_PAD, DI] e4m3
    w = tl.load(w_ptr + tok.to(tl.int64) * stride_wt + head, mask=ok, other=0.0)  # [ROWS·HI_PAD]
    if DOT_F32:  # exact caches (fp32 inputs, or bf16 under the interpreter, whose bf16 dot is wrong)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    # Keys in the MMA's M, rows·heads in its N (both operands K-major, as FP8 MMAs want them): on an
    # H200 this ran 1.7-2.6x faster than heads in M. The FP8 tensor cores accumulate with reduced
    # precision (as DeepGEMM's): ~4e-4 of a row's max logit at DI = 128. max_num_imprecise_acc=0
    # makes it exact to fp32 but made the kernel 2.5-3x slower; top-k selection does not need it.
    if DOT_F32:
        dots = tl.dot(k, tl.trans(q), input_precision="ieee")  # [BLOCK_N, ROWS·HI_PAD] fp32
    else:
        dots = tl.dot(k, tl.trans(q))
    x = tl.maximum(dots, 0.0) * w[None, :]
    return tl.trans(tl.sum(tl.reshape(x, (BLOCK_N, ROWS, HI_PAD)), axis=2))  # [ROWS, BLOCK_N]


@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, seq_ptr, klen_ptr, out_ptr,
                           T, max_keys, max_blocks,
                           stride_qt, stride_qh, stride_wt, stride_kb, stride_sb, stride_bt, stride_ot,
                           HI: tl.constexpr, DI: tl.constexpr, HI_PAD: tl.constexpr, PAGE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                           DOT_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ids = tl.arange(0, BLOCK_M)
    rows = pid_m * BLOCK_M + ids
    row_ok = rows < T
    seq = tl.load(seq_ptr + rows, mask=row_ok, other=-1)
    klen = tl.minimum(tl.load(klen_ptr + rows, mask=row_ok, other=0), max_keys)
    n0 = pid_n * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, DI)

    # A row is active when it sees a key of this tile; the leader of a group is its first active row.
    active = row_ok & (klen > n0)
    same = (seq[:, None] == seq[None, :]) & active[None, :]
    first = tl.min(tl.where(same, ids[None, :], BLOCK_M), axis=1)
    leader = active & (first == ids)

    acc = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    for i in range(BLOCK_M):
        if tl.sum((leader & (ids == i)).to(tl.int32)) > 0:
            s = tl.sum(tl.where(ids == i, seq, 0)).to(tl.int64)
            group = active & (seq == s)
            kmax = tl.max(tl.where(group, klen, 0))
            # The key tile of sequence s: BLOCK_N / PAGE physical blocks through the block table.
            lblock = n // PAGE
            key_ok = n < kmax
            phys = tl.load(bt_ptr + s * stride_bt + lblock, mask=key_ok & (lblock < max_blocks), other=0)
            phys = phys.to(tl.int64)
            off = n % PAGE
            k = tl.load(k_ptr + phys[:, None] * stride_kb + off[:, None] * DI + d[None, :],
                        mask=key_ok[:, None], other=0.0)  # [BLOCK_N, DI] e4m3 (exact cache: float)
            if FP8:
                k_scale = tl.load(ks_ptr + phys * stride_sb + (PAGE * DI // 4) + off, mask=key_ok, other=0.0)
            else:
                k_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
            if tl.sum(group.to(tl.int32)) == 1:
                one = _weighted_relu_dot(q_ptr, w_ptr, k, pid_m * BLOCK_M + i, T, stride_qt, stride_qh,
                                         stride_wt, HI, DI, HI_PAD, 1, BLOCK_N, DOT_F32)  # [1, BLOCK_N]
                acc = tl.where(group[:, None], one * k_scale[None, :], acc)
            else:
                many = _weighted_relu_dot(q_ptr, w_ptr, k, pid_m * BLOCK_M, T, stride_qt, stride_qh,
                                          stride_wt, HI, DI, HI_PAD, BLOCK_M, BLOCK_N, DOT_F32)  # [BLOCK_M, BLOCK_N]
                acc = tl.where(group[:, None], many * k_scale[None, :], acc)

    acc = tl.where(n[None, :] < klen[:, None], acc, float("-inf"))
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & (n[None, :] < max_keys))


def indexer_logits(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_idx: torch.Tensor, key_len: torch.Tensor, max_keys: int, *,
                   block_m: int | None = None, block_n: int = 128) -> torch.Tensor:
    """Lightning-indexer logits over the paged indexer cache (twin: reference.indexer_logits).

    q: [T, HI, DI] e4m3 queries over an FP8 cache ([num_blocks, 64 · (DI + 4)] uint8), or float
    queries over an exact cache ([num_blocks, 64 · DI] of q's dtype; layouts in
    megactx.kernels.reference); w: [T, HI] fp32 head weights with q's per-(token, head) scales
    (FP8), HI^-1/2 and DI^-1/2 folded in; block_table: [B, max_blocks] int32 physical block of each
    logical block of sequence b; seq_idx: [T] the sequence of each query row (rows of one sequence
    need not be adjacent, but adjacent rows share key loads); key_len: [T] how many keys (logical
    0 .. key_len - 1) row t sees. Returns [T, max_keys] fp32:
    Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · k_scale[s] for s < key_len[t], -inf beyond.

    block_m: query rows a program (default: enough to stack 128 rows·heads into one dot);
    block_n: keys a program, a multiple of 64."""
    T, HI, DI = q.shape
    fp8 = index_cache.dtype == torch.uint8
    if fp8 and q.dtype != FP8:
        raise ValueError(f"queries over an FP8 indexer cache must be float8_e4m3fn, got {q.dtype}")
    if not fp8 and (q.dtype != index_cache.dtype or q.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"an exact indexer cache must be fp32 or bf16 and match the queries' dtype, got cache "
                         f"{index_cache.dtype} and queries {q.dtype}")
    if DI < 16 or DI & (DI - 1):
        raise ValueError(f"the indexer kernel needs a power-of-two head dim >= 16, got {DI}")
    if tuple(w.shape) != (T, HI):
        raise ValueError(f"head weights have shape {tuple(w.shape)}; queries [{T}, {HI}, {DI}] need [{T}, {HI}]")
    row = BLOCK_SIZE * (DI + 4) if fp8 else BLOCK_SIZE * DI
    if index_cache.dim() != 2 or index_cache.shape[1] != row:
        raise ValueError(f"index_cache must be [num_blocks, {row}] for DI = {DI} ({'FP8' if fp8 else 'exact'} "
                         f"layout), got {index_cache.dtype} {tuple(index_cache.shape)}")
    if block_n % BLOCK_SIZE or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power-of-two multiple of {BLOCK_SIZE}, got {block_n}")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache must be contiguous (a copy of the whole cache a call would be silent and slow)")
    check_device(q, w, index_cache, block_table, seq_idx, key_len)
    out = torch.empty(T, max_keys, dtype=torch.float32, device=q.device)
    if T == 0 or max_keys == 0:
        return out

    # Heads are padded to a power of two, and to 16 so that a lone row's dot has N >= 16.
    hi_pad = max(16, triton.next_power_of_2(HI))
    if block_m is None:
        block_m = max(1, 128 // hi_pad)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if fp8:
        # The same bytes seen two ways: e4m3 key rows, and the fp32 scales that start at byte 64 · DI
        # of each block (4-byte aligned since the block size 64 · (DI + 4) is); .view checks it.
        keys, scales = index_cache.view(FP8), index_cache.view(torch.float32)
    else:
        keys = scales = index_cache  # no scales
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = w.float().contiguous()
    block_table = block_table.contiguous()
    seq_idx, key_len = seq_idx.contiguous(), key_len.contiguous()

    grid = (triton.cdiv(T, block_m), triton.cdiv(max_keys, block_n))
    _indexer_logits_kernel[grid](
        q, w, keys, scales, block_table, seq_idx, key_len, out,
        T, max_keys, block_table.shape[1],
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), scales.stride(0), block_table.stride(0), out.stride(0),
        HI=HI, DI=DI, HI_PAD=hi_pad, PAGE=BLOCK_SIZE, BLOCK_M=block_m, BLOCK_N=block_n,
        FP8=fp8, DOT_F32=not fp8 and (INTERPRET or q.dtype == torch.float32),
        num_warps=4,  # on an H200, 4 beat 8 at 128 x 128 tiles (GLM and DeepSeek geometry alike)
    )
    return out


def indexer_topk_chunked(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_idx: torch.Tensor, key_len: torch.Tensor, k: int, chunk_tokens: int,
                         key_len_host: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k keys of each query row as physical slots [T, k] int32 (block_id · 64 + offset), -1 where
    the row has fewer than k visible keys; chunk_tokens rows at a time so the logits buffer stays
    [chunk_tokens, longest key range of the chunk], each chunk's rows cut to k by the Triton
    selection of `megactx.kernels.topk`. Arguments as in `indexer_logits` and
    `reference.chunked_topk` (the twin is `reference.indexer_topk_chunked`)."""
    return chunked_topk(indexer_logits, topk_rows, q, w, index_cache, block_table, seq_idx, key_len, k,
                        chunk_tokens, key_len_host)
