"""Speculative sampling's acceptance rule in one or two launches; twin: `reference.rejection_rows`.

Given a verify step's target distributions p, the drafts and their q, and the random draws, the
rule is a short sequential scan over a row's K <= 8 drafts (accept draft j iff u_j · q_j(d) <
p_j(d), stop at the first rejection) and then one token from a V-wide distribution: the residual
max(p_a - q_a, 0) after a rejection (p_a itself where it has no mass), p_a when all were accepted,
drawn by the exponential race argmax(r / E). In PyTorch that is ~20 small launches a step
(gathers, a cumulative product, the residual, the race, the output row), each costing more host
time than the GPU spends on it at batch 1-64.

Here the race is split over the vocabulary: program (b, c) scans row b's drafts (a few scalar
loads, repeated by every program of the row) and streams its slice of the row once, keeping the
race's leader among the residual entries and among p's (the residual's mass decides between them
only at the end: whether any residual entry is > 0); a second launch, one program a row, takes the
leaders of the slices and writes the row of emitted tokens (a vocabulary of at most 8 steps is
one slice, whose program writes the row itself: one launch). One program a row streaming the row
itself was latency-bound: 575 us at a GLM-size vocabulary (151,552) on an H200, 48-115 us split.
The draws come in as tensors (drawn by `megactx.engine.sampler.draw_rows`, as the twin takes
them), so kernel and twin see the same randomness and emit the same tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import cdiv, check_device, next_power_of_2

BLOCK_V = 1024  # vocabulary entries a step of a slice
TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny
PROGRAMS = 512  # programs a launch aims for (a few per multiprocessor), in slices of whole BLOCK_V steps
# Steps a slice at the least: a row of a small vocabulary is one slice, and one launch (the race's
# program writes the emitted row itself) — at batch 1-32 with V = 4,096 a second launch cost more
# host time than its slices saved.
MIN_SLICE_STEPS = 8


@triton.jit
def _num_drafts(nd_ptr, b, K, HAS_ND: tl.constexpr):
    """The drafts row b verifies: num_drafts[b], or K for every row."""
    if HAS_ND:
        nd = tl.load(nd_ptr + b).to(tl.int32)
    else:
        nd = tl.zeros([], tl.int32) + K
    return nd


@triton.jit
def _accepted(p_ptr, q_ptr, draft_ptr, nd_ptr, u_ptr, b, K, V,
              stride_pb, stride_pj, stride_qb, stride_qj, stride_db, stride_ub,
              HAS_Q: tl.constexpr, HAS_ND: tl.constexpr):
    """Row b's leading accepts -> (n_acc, the drafts it verifies: nd)."""
    nd = _num_drafts(nd_ptr, b, K, HAS_ND)
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
    return n_acc, nd


@triton.jit
def _lead(x, v, best, best_at, V):
    """The race's leader after block x (entries v): the first of the largest, as torch.argmax."""
    m = tl.max(x, 0)
    at = tl.min(tl.where(x == m, v, V), 0)
    better = m > best
    return tl.where(better, m, best), tl.where(better, at, best_at)


@triton.jit
def _use_residual(n_acc, nd, r_max):
    """Whether the next token is drawn from the residual: after a rejection, unless the residual has
    no mass (p <= q everywhere, i.e. p == q up to rounding: a rejection had probability ~0 and p is
    the residual's limit)."""
    return (n_acc < nd) & (r_max > 0)


@triton.jit
def _emit_row(draft_ptr, tok_ptr, b, stride_db, stride_tb, n_acc, token, K, pad, BLOCK_K: tl.constexpr):
    """Row b's emitted tokens: its drafts before n_acc, the token at n_acc, pad after."""
    cols = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ptr + b * stride_db + cols, mask=cols < K, other=0)
    out = tl.where(cols < n_acc, drafts, tl.where(cols == n_acc, token.to(tl.int64), pad))
    tl.store(tok_ptr + b * stride_tb + cols, out, mask=cols <= K)


@triton.jit
def _race_kernel(p_ptr, q_ptr, draft_ptr, nd_ptr, u_ptr, noise_ptr, lead_ptr, at_ptr, nacc_ptr, tok_ptr,
                 K, V, slice_len, pad,
                 stride_pb, stride_pj, stride_qb, stride_qj, stride_db, stride_ub, stride_eb, stride_tb,
                 HAS_Q: tl.constexpr, HAS_ND: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 ONE_SLICE: tl.constexpr):
    """Program (b, c): row b's leaders over slice c of the vocabulary -> lead[b, c] = (max r / E,
    max p / E, max r), at[b, c] = (where r / E and p / E are largest). ONE_SLICE (the row is one
    slice): the row of emitted tokens instead."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n_acc, nd = _accepted(p_ptr, q_ptr, draft_ptr, nd_ptr, u_ptr, b, K, V, stride_pb, stride_pj, stride_qb,
                          stride_qj, stride_db, stride_ub, HAS_Q, HAS_ND)
    rejected = n_acc < nd
    col = tl.minimum(n_acc, tl.maximum(K - 1, 0))
    p_row = p_ptr + b * stride_pb + n_acc.to(tl.int64) * stride_pj
    q_row = q_ptr + b * stride_qb + col.to(tl.int64) * stride_qj
    # the draft at the first position not accepted (one-hot q zeroes it); none to load when K = 0
    cols = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ptr + b * stride_db + cols, mask=cols < K, other=0)
    d_col = tl.minimum(tl.maximum(tl.sum(tl.where(cols == col, drafts, 0), 0), 0), V - 1)
    q_len = tl.where(rejected, V, 0)  # q is read only after a rejection
    r_best = tl.full([], float("-inf"), tl.float32)
    p_best = tl.full([], float("-inf"), tl.float32)
    r_at = tl.zeros([], tl.int32)
    p_at = tl.zeros([], tl.int32)
    r_max = tl.zeros([], tl.float32)
    offs = tl.arange(0, BLOCK_V)
    start = c * slice_len
    for v0 in range(start, tl.minimum(start + slice_len, V), BLOCK_V):
        v = v0 + offs
        inside = v < V
        p = tl.load(p_row + v, mask=inside, other=0.0)
        if HAS_Q:
            r = tl.maximum(p - tl.load(q_row + v, mask=v < q_len, other=0.0), 0.0)
        else:
            r = tl.where(v == d_col, 0.0, p)
        e = tl.maximum(tl.load(noise_ptr + b * stride_eb + v, mask=inside, other=1.0), TINY)
        r_max = tl.maximum(r_max, tl.max(r, 0))
        r_best, r_at = _lead(tl.where(inside, tl.math.div_rn(r, e), float("-inf")), v, r_best, r_at, V)
        p_best, p_at = _lead(tl.where(inside, tl.math.div_rn(p, e), float("-inf")), v, p_best, p_at, V)
    if ONE_SLICE:
        token = tl.where(_use_residual(n_acc, nd, r_max), r_at, p_at)
        _emit_row(draft_ptr, tok_ptr, b, stride_db, stride_tb, n_acc, token, K, pad, BLOCK_K)
        tl.store(nacc_ptr + b, n_acc.to(tl.int64))
        return
    nc = tl.num_programs(1)
    tl.store(lead_ptr + (b * nc + c) * 3, r_best)
    tl.store(lead_ptr + (b * nc + c) * 3 + 1, p_best)
    tl.store(lead_ptr + (b * nc + c) * 3 + 2, r_max)
    tl.store(at_ptr + (b * nc + c) * 2, r_at)
    tl.store(at_ptr + (b * nc + c) * 2 + 1, p_at)
    if c == 0:
        tl.store(nacc_ptr + b, n_acc.to(tl.int64))


@triton.jit
def _emit_kernel(draft_ptr, nd_ptr, lead_ptr, at_ptr, nacc_ptr, tok_ptr, K, V, pad, num_slices,
                 stride_db, stride_tb, HAS_ND: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program b: the race's winner over row b's slices, and the row of emitted tokens."""
    b = tl.program_id(0).to(tl.int64)
    n_acc = tl.load(nacc_ptr + b).to(tl.int32)
    nd = _num_drafts(nd_ptr, b, K, HAS_ND)
    sl = tl.arange(0, BLOCK_S)
    ok = sl < num_slices
    row = b * num_slices + sl
    r_best = tl.load(lead_ptr + row * 3, mask=ok, other=float("-inf"))
    p_best = tl.load(lead_ptr + row * 3 + 1, mask=ok, other=float("-inf"))
    r_max = tl.max(tl.load(lead_ptr + row * 3 + 2, mask=ok, other=0.0), 0)
    use_residual = _use_residual(n_acc, nd, r_max)
    best = tl.where(use_residual, r_best, p_best)
    at = tl.load(at_ptr + row * 2 + tl.where(use_residual, 0, 1), mask=ok, other=0)
    top = tl.max(best, 0)
    token = tl.min(tl.where(ok & (best == top), at, V), 0)  # slices in order: the first of the largest
    _emit_row(draft_ptr, tok_ptr, b, stride_db, stride_tb, n_acc, token, K, pad, BLOCK_K)


def rejection_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                   num_drafts: torch.Tensor | None, uniforms: torch.Tensor, noise: torch.Tensor,
                   pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rejection_rows` (same arguments and results) in one or two launches. noise is read, not
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
    # slices of whole BLOCK_V steps, as many as fill the GPU with the batch's rows
    steps = cdiv(vocab, BLOCK_V)
    slices = max(1, min(cdiv(steps, MIN_SLICE_STEPS), cdiv(PROGRAMS, bsz)))
    slice_len = cdiv(steps, slices) * BLOCK_V
    slices = cdiv(vocab, slice_len)
    if slices == 1:
        leads = at = tokens  # unread: the race's program writes the row itself
    else:
        leads = torch.empty(bsz, slices, 3, dtype=torch.float32, device=device)
        at = torch.empty(bsz, slices, 2, dtype=torch.int32, device=device)
    block_k = next_power_of_2(width + 1)
    _race_kernel[(bsz, slices)](
        target_probs, q, draft_tokens, nd, uniforms, noise, leads, at, num_accepted, tokens,
        width, vocab, slice_len, pad,
        target_probs.stride(0), target_probs.stride(1), q.stride(0), q.stride(1), draft_tokens.stride(0),
        uniforms.stride(0), noise.stride(0), tokens.stride(0),
        HAS_Q=draft_probs is not None, HAS_ND=num_drafts is not None,
        BLOCK_V=min(BLOCK_V, next_power_of_2(vocab)), BLOCK_K=block_k, ONE_SLICE=slices == 1,
    )
    if slices == 1:
        return tokens, num_accepted
    _emit_kernel[(bsz,)](draft_tokens, nd, leads, at, num_accepted, tokens, width, vocab, pad, slices,
                         draft_tokens.stride(0), tokens.stride(0), HAS_ND=num_drafts is not None, BLOCK_K=block_k,
                         BLOCK_S=next_power_of_2(slices))
    return tokens, num_accepted
