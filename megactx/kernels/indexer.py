"""Lightning-indexer logits over the paged FP8 indexer cache (Triton), and a chunked top-k on top.

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

from megactx.kernels.common import check_device
from megactx.kernels.reference import BLOCK_SIZE, logical_to_slots
from megactx.model.quant import FP8


@triton.jit
def _weighted_relu_dot(q_ptr, w_ptr, k, first_row, T, stride_qt, stride_qh, stride_wt,
                       HI: tl.constexpr, DI: tl.constexpr, HI_PAD: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr):
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
    # Keys in the MMA's M, rows·heads in its N (both operands K-major, as FP8 MMAs want them): on an
    # H200 this ran 1.7-2.6x faster than heads in M. The FP8 tensor cores accumulate with reduced
    # precision (as DeepGEMM's): ~4e-4 of a row's max logit at DI = 128. max_num_imprecise_acc=0
    # makes it exact to fp32 but made the kernel 2.5-3x slower; top-k selection does not need it.
    dots = tl.dot(k, tl.trans(q))  # [BLOCK_N, ROWS·HI_PAD] fp32
    x = tl.maximum(dots, 0.0) * w[None, :]
    return tl.trans(tl.sum(tl.reshape(x, (BLOCK_N, ROWS, HI_PAD)), axis=2))  # [ROWS, BLOCK_N]


@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, seq_ptr, klen_ptr, out_ptr,
                           T, max_keys, max_blocks,
                           stride_qt, stride_qh, stride_wt, stride_kb, stride_sb, stride_bt, stride_ot,
                           HI: tl.constexpr, DI: tl.constexpr, HI_PAD: tl.constexpr, PAGE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
                        mask=key_ok[:, None], other=0.0)  # [BLOCK_N, DI] e4m3
            k_scale = tl.load(ks_ptr + phys * stride_sb + (PAGE * DI // 4) + off, mask=key_ok, other=0.0)
            if tl.sum(group.to(tl.int32)) == 1:
                one = _weighted_relu_dot(q_ptr, w_ptr, k, pid_m * BLOCK_M + i, T, stride_qt, stride_qh,
                                         stride_wt, HI, DI, HI_PAD, 1, BLOCK_N)  # [1, BLOCK_N]
                acc = tl.where(group[:, None], one * k_scale[None, :], acc)
            else:
                many = _weighted_relu_dot(q_ptr, w_ptr, k, pid_m * BLOCK_M, T, stride_qt, stride_qh,
                                          stride_wt, HI, DI, HI_PAD, BLOCK_M, BLOCK_N)  # [BLOCK_M, BLOCK_N]
                acc = tl.where(group[:, None], many * k_scale[None, :], acc)

    acc = tl.where(n[None, :] < klen[:, None], acc, float("-inf"))
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & (n[None, :] < max_keys))


def indexer_logits(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_idx: torch.Tensor, key_len: torch.Tensor, max_keys: int, *,
                   block_m: int | None = None, block_n: int = 128) -> torch.Tensor:
    """Lightning-indexer logits over the paged indexer cache, FP8 inputs (twin: reference.indexer_logits).

    q: [T, HI, DI] e4m3 queries; w: [T, HI] fp32 head weights with q's per-(token, head) scales,
    HI^-1/2 and DI^-1/2 folded in; index_cache: [num_blocks, 64 · (DI + 4)] uint8 paged indexer
    cache (layout in megactx.kernels.reference); block_table: [B, max_blocks] int32 physical block
    of each logical block of sequence b; seq_idx: [T] the sequence of each query row (rows of one
    sequence need not be adjacent, but adjacent rows share key loads); key_len: [T] how many keys
    (logical 0 .. key_len - 1) row t sees. Returns [T, max_keys] fp32:
    Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · k_scale[s] for s < key_len[t], -inf beyond.

    block_m: query rows a program (default: enough to stack 128 rows·heads into one dot);
    block_n: keys a program, a multiple of 64."""
    T, HI, DI = q.shape
    if q.dtype != FP8:
        raise ValueError(f"indexer queries must be float8_e4m3fn, got {q.dtype}")
    if DI < 16 or DI & (DI - 1):
        raise ValueError(f"the indexer kernel needs a power-of-two head dim >= 16, got {DI}")
    if tuple(w.shape) != (T, HI):
        raise ValueError(f"head weights have shape {tuple(w.shape)}; queries [{T}, {HI}, {DI}] need [{T}, {HI}]")
    if index_cache.dtype != torch.uint8 or index_cache.dim() != 2 or index_cache.shape[1] != BLOCK_SIZE * (DI + 4):
        raise ValueError(f"index_cache must be uint8 [num_blocks, {BLOCK_SIZE * (DI + 4)}] for DI = {DI}, "
                         f"got {index_cache.dtype} {tuple(index_cache.shape)}")
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
    # The same bytes seen two ways: e4m3 key rows, and the fp32 scales that start at byte 64 · DI of
    # each block (4-byte aligned since the block size 64 · (DI + 4) is); .view checks the alignment.
    keys = index_cache.view(FP8)
    scales = index_cache.view(torch.float32)
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
        num_warps=4,  # on an H200, 4 beat 8 at 128 x 128 tiles (GLM and DeepSeek geometry alike)
    )
    return out


def indexer_topk_chunked(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_idx: torch.Tensor, key_len: torch.Tensor, k: int, chunk_tokens: int) -> torch.Tensor:
    """Top-k keys of each query row as physical slots, chunk_tokens rows at a time so the logits
    buffer stays [chunk_tokens, max key_len of the chunk].

    Arguments as in `indexer_logits`; k: keys kept per row. Returns slots [T, k] int32 (block_id · 64
    + offset), -1 where the row has fewer than k visible keys. Order within a row is unspecified.
    One host sync (the chunks' key counts); a fused streaming top-k kernel would avoid it."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    T = q.shape[0]
    out = torch.full((T, k), -1, dtype=torch.int32, device=q.device)
    if T == 0 or k == 0:
        return out
    starts = range(0, T, chunk_tokens)
    chunk_keys = torch.stack([key_len[i : i + chunk_tokens].max() for i in starts]).clamp_min(0).tolist()
    for i, max_keys in zip(starts, chunk_keys):
        if max_keys == 0:
            continue  # no row of the chunk sees a key
        rows = slice(i, i + chunk_tokens)
        logits = indexer_logits(q[rows], w[rows], index_cache, block_table, seq_idx[rows], key_len[rows], max_keys)
        values, pos = logits.topk(min(k, max_keys), dim=-1)  # [chunk, ≤ k]
        pos = pos.masked_fill(values == float("-inf"), -1)
        out[rows, : pos.shape[1]] = logical_to_slots(block_table, seq_idx[rows], pos).int()
    return out
