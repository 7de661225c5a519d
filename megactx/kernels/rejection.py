"""Speculative sampling's acceptance rule in one launch; twin: `reference.rejection_rows`.

Given a verify step's target distributions p, the drafts and their q, and the random draws, the
rule is a short sequential scan over a row's K <= 8 drafts (accept draft j iff u_j · q_j(d) <
p_j(d), stop at the first rejection) and then one token from a V-wide distribution: the residual
normalize(max(p_a - q_a, 0)) after a rejection, p_a itself when all were accepted. In PyTorch that
is ~20 small launches a step (gathers, a cumulative product, the residual, its sum, the race, the
output row), each costing more host time than the GPU spends on it at batch 1-64. Here one
program a row does all of it: the scan on scalars, then two passes over the row's V entries (the
residual's mass, then the race argmax(r / E) with the exponential draws E), then the row of
emitted tokens. The draws come in as tensors (drawn by `megactx.engine.sampler.draw_rows`, as the
twin takes them), so kernel and twin see the same randomness; their tokens agree except where two
entries of r / E tie to within the rounding of the mass (summed in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import check_device

BLOCK_V = 1024  # vocabulary entries a step of the two passes
TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny


@triton.jit
def _residual_block(p_row, q_row, v, V, q_len, d_col, HAS_Q: tl.constexpr):
    """Entries v of p at the row's next position, and of max(p - q, 0) there (one-hot q: p with the
    draft d_col zeroed); q is read at v < q_len only (none unless a draft was rejected)."""
    p = tl.load(p_row + v, mask=v < V, other=0.0)
    if HAS_Q:
        r = tl.maximum(p - tl.load(q_row + v, mask=v < q_len, other=0.0), 0.0)
    else:
        r = tl.where(v == d_col, 0.0, p)
    return p, r


@triton.jit
def _rejection_kernel(p_ptr, q_ptr, draft_ptr, nd_ptr, u_ptr, noise_ptr, tok_ptr, nacc_ptr,
                      K, V, pad,
                      stride_pb, stride_pj, stride_qb, stride_qj, stride_db, stride_ub, stride_eb, stride_tb,
                      HAS_Q: tl.constexpr, HAS_ND: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program b: row b's accepted count, and its emitted tokens [K + 1] (see the module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    if HAS_ND:
        nd = tl.load(nd_ptr + b).to(tl.int32)
    else:
        nd = tl.zeros([], tl.int32) + K
    # 1. leading accepts
    n_acc = tl.zeros([], tl.int32)
    going = tl.full([], 1, tl.int32)
    for j in range(0, K):
        d = tl.minimum(tl.maximum(tl.load(draft_ptr + b * stride_db + j), 0), V - 1)
        p_d = tl.load(p_ptr + b * stride_pb + j * stride_pj + d)
        s = tl.load(u_ptr + b * stride_ub + j)
        if HAS_Q:
            s = s * tl.load(q_ptr + b * stride_qb + j * stride_qj + d)
        ok = ((s < p_d) & (j < nd)).to(tl.int32)
        going = going * ok
        n_acc += going
    # 2. the distribution of the next token: p at position n_acc, or after a rejection the residual
    rejected = n_acc < nd
    col = tl.minimum(n_acc, tl.maximum(K - 1, 0))
    p_row = p_ptr + b * stride_pb + n_acc.to(tl.int64) * stride_pj
    q_row = q_ptr + b * stride_qb + col.to(tl.int64) * stride_qj
    # the row's drafts as one masked vector (a row of K = 0 has none to load; q is read only after a rejection)
    cols = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ptr + b * stride_db + cols, mask=cols < K, other=0)
    d_col = tl.minimum(tl.maximum(tl.sum(tl.where(cols == col, drafts, 0), 0), 0), V - 1)
    offs = tl.arange(0, BLOCK_V)
    q_len = tl.where(rejected, V, 0)
    mass = tl.zeros([BLOCK_V], tl.float32)
    if rejected:
        for v0 in range(0, V, BLOCK_V):
            _, r = _residual_block(p_row, q_row, v0 + offs, V, q_len, d_col, HAS_Q)
            mass += r
    total = tl.sum(mass, 0)
    use_residual = rejected & (total > 0)
    denom = tl.maximum(total, TINY)
    # 3. the race argmax(r / E): the first of the largest, as torch.argmax
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.zeros([], tl.int64)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + offs
        p, r = _residual_block(p_row, q_row, v, V, q_len, d_col, HAS_Q)
        r = tl.where(use_residual, tl.math.div_rn(r, denom), p)  # IEEE division, as torch's
        e = tl.maximum(tl.load(noise_ptr + b * stride_eb + v, mask=v < V, other=1.0), TINY)
        x = tl.where(v < V, tl.math.div_rn(r, e), float("-inf"))
        m = tl.max(x, 0)
        at = tl.min(tl.where(x == m, v, V), 0).to(tl.int64)  # the first index of the block's maximum
        better = m > best
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, m, best)
    # 4. the emitted row: drafts before n_acc, the token at n_acc, pad after
    out = tl.where(cols < n_acc, drafts, tl.where(cols == n_acc, best_at, pad))
    tl.store(tok_ptr + b * stride_tb + cols, out, mask=cols <= K)
    tl.store(nacc_ptr + b, n_acc.to(tl.int64))


def rejection_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                   num_drafts: torch.Tensor | None, uniforms: torch.Tensor, noise: torch.Tensor,
                   pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rejection_rows` (same arguments and results) in one launch. noise is read, not
    overwritten. Inner dims must be contiguous (the row strides may be anything)."""
    bsz, num_positions, vocab = target_probs.shape
    width = num_positions - 1
    for name, t, dtype in (("target_probs", target_probs, torch.float32), ("draft_tokens", draft_tokens, torch.int64),
                           ("uniforms", uniforms, torch.float32), ("noise", noise, torch.float32)):
        if t.dtype != dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must be {dtype} with a contiguous last dim, got {t.dtype}, strides {t.stride()}")
    if draft_tokens.shape != (bsz, width) or uniforms.shape != (bsz, width) or noise.shape != (bsz, vocab):
        raise ValueError(f"for target_probs {tuple(target_probs.shape)}: draft_tokens and uniforms must be "
                         f"{(bsz, width)}, noise {(bsz, vocab)}; got {tuple(draft_tokens.shape)}, "
                         f"{tuple(uniforms.shape)}, {tuple(noise.shape)}")
    if draft_probs is not None and (draft_probs.shape != (bsz, width, vocab) or draft_probs.dtype != torch.float32
                                    or draft_probs.stride(-1) != 1):
        raise ValueError(f"draft_probs must be [B, K, V] = {(bsz, width, vocab)} fp32, contiguous in V")
    if num_drafts is not None and num_drafts.shape != (bsz,):
        raise ValueError(f"num_drafts must be [B = {bsz}], got {tuple(num_drafts.shape)}")
    check_device(target_probs, draft_tokens, uniforms, noise)
    device = target_probs.device
    tokens = torch.empty(bsz, width + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(bsz, dtype=torch.int64, device=device)
    if bsz == 0:
        return tokens, num_accepted
    q = draft_probs if draft_probs is not None else target_probs  # unread without HAS_Q
    nd = num_drafts if num_drafts is not None else num_accepted  # unread without HAS_ND
    _rejection_kernel[(bsz,)](
        target_probs, q, draft_tokens, nd, uniforms, noise, tokens, num_accepted,
        width, vocab, pad,
        target_probs.stride(0), target_probs.stride(1), q.stride(0), q.stride(1), draft_tokens.stride(0),
        uniforms.stride(0), noise.stride(0), tokens.stride(0),
        HAS_Q=draft_probs is not None, HAS_ND=num_drafts is not None,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)), BLOCK_K=triton.next_power_of_2(width + 1),
    )
    return tokens, num_accepted
