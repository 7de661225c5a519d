"""Speculative decoding's acceptance rules: which draft tokens a verify step keeps, and the token
that follows them.

A verify step of one sequence with k draft tokens d_1 .. d_k (k differs between rows; k = 0 is a
plain decode) gives the target's distributions p_0 .. p_k over the k + 1 verified positions: p_j
follows the context plus d_1 .. d_j. Both rules emit the accepted drafts, then one more token.

- `greedy_verify`: d_{j+1} is accepted while it equals argmax p_j; the first mismatch is replaced
  by the target's argmax, and when all k match, the target's argmax after them is a bonus token.
  The output is token for token what non-speculative greedy decoding produces.
- `rejection_sample` (speculative sampling, Leviathan et al. 2023; Chen et al. 2023): d_{j+1} was
  drawn from the draft distribution q_j and is accepted with probability min(1, p_j(d) / q_j(d));
  the first rejected one is replaced by a sample of normalize(max(p_j - q_j, 0)); when all k are
  accepted, a bonus token is sampled from p_k. Every emitted token is then distributed exactly as
  under p, whatever q is: speculative sampling samples from the target alone. Drafts picked
  deterministically (greedy drafts, the "target-only" ablation) are the case q_j = one-hot(d):
  accepted with probability p_j(d), and on rejection replaced by a sample of p_j without d.

p and q are the distributions the requests sample from, after temperature / top-k / top-p / min-p
(`megactx.engine.sampler.process_logits` makes both). Nothing here syncs with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megactx.engine.sampler import PAD_ID, UNIFORM, RowSource, draw_rows, sample


@dataclass
class VerifyResult:
    """What a verify step emits, per row.

    tokens: [B, K + 1] int64 — the accepted drafts, then the replacement or bonus token, then PAD_ID.
    num_accepted: [B] int64 in [0, num_drafts[b]] — row b emits num_accepted[b] + 1 tokens."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def _check_drafts(num_positions: int, draft_tokens: torch.Tensor, num_drafts: torch.Tensor | None) -> None:
    bsz, width = draft_tokens.shape
    if width != num_positions - 1:
        raise ValueError(f"draft_tokens must be [B, K] with K = verified positions - 1 = {num_positions - 1}, "
                         f"got {tuple(draft_tokens.shape)}")
    if num_drafts is not None and num_drafts.shape != (bsz,):
        raise ValueError(f"num_drafts must be [B={bsz}], got {tuple(num_drafts.shape)}")


def _leading_accepts(accept: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """accept: [B, K] bool -> [B] int64, how many leading entries of each row are True, counting only
    the first num_drafts[b] of row b (None: all K)."""
    if num_drafts is not None:
        accept = accept & (torch.arange(accept.shape[1], device=accept.device)[None, :] < num_drafts[:, None])
    return accept.cumprod(dim=1).sum(dim=1)  # a cumulative product of bools is int64


def _row_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [B, N, V], index: [B] int64 in [0, N) -> x[b, index[b]] for each row b, [B, V]."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[2])).squeeze(1)


def _emitted(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, K + 1]: draft_tokens[b, :a] then last[b] at column a = num_accepted[b], PAD_ID after."""
    col = torch.arange(draft_tokens.shape[1] + 1, device=draft_tokens.device)[None, :]  # [1, K + 1]
    tokens = torch.cat([draft_tokens, last[:, None]], dim=1).scatter_(1, num_accepted[:, None], last[:, None])
    return tokens.masked_fill_(col > num_accepted[:, None], PAD_ID)


def greedy_verify(target_tokens: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> VerifyResult:
    """The greedy rule. target_tokens: [B, K + 1] int64, the target's argmax at each verified
    position; draft_tokens: [B, K] int64 (entries past num_drafts[b] are ignored); num_drafts: [B]
    int64 in [0, K], None when every row verifies K drafts."""
    _check_drafts(target_tokens.shape[1], draft_tokens, num_drafts)
    width = draft_tokens.shape[1]
    num_accepted = _leading_accepts(draft_tokens == target_tokens[:, :width], num_drafts)
    # the accepted drafts are the target's tokens, and so is the one after them: row b emits
    # target_tokens[b, :a + 1]
    col = torch.arange(width + 1, device=draft_tokens.device)[None, :]  # [1, K + 1]
    return VerifyResult(torch.where(col > num_accepted[:, None], PAD_ID, target_tokens), num_accepted)


def draw_uniforms(num_rows: int, width: int, device: torch.device | str,
                  generators: Sequence[RowSource] | None = None,
                  shared_generator: torch.Generator | None = None) -> torch.Tensor:
    """U[0, 1) draws [num_rows, width] fp32 for the acceptance tests. A row with its own generator
    (a seeded request) draws its `width` values from it, so its draws do not depend on the batch;
    the others draw from `shared_generator` (None: torch's default generator)."""
    return draw_rows(torch.empty(num_rows, width, device=device), UNIFORM, generators, shared_generator)


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     num_drafts: torch.Tensor | None, uniforms: torch.Tensor | None = None,
                     generators: Sequence[RowSource] | None = None,
                     shared_generator: torch.Generator | None = None) -> VerifyResult:
    """The speculative-sampling rule (module docstring).

    target_probs: [B, K + 1, V] fp32, p_0 .. p_K (rows sum to 1). draft_tokens: [B, K] int64, each
    drawn from its q. draft_probs: [B, K, V] fp32, q_0 .. q_{K-1}; None means every draft was picked
    deterministically (q = one-hot of the draft). num_drafts: [B] int64 in [0, K]: row b verifies its
    first num_drafts[b] drafts, later columns of every input are ignored (None: every row verifies
    K). uniforms: [B, K] in [0, 1), the acceptance draws (None: `draw_uniforms` with the
    generators). generators / shared_generator: where the replacement / bonus token's noise comes
    from, as in `sample`.

    Draft j is accepted iff u_j · q_j(d) < p_j(d), i.e. with probability min(1, p_j(d) / q_j(d)) —
    and never when p_j(d) = 0."""
    bsz, num_positions, vocab = target_probs.shape
    _check_drafts(num_positions, draft_tokens, num_drafts)
    width = num_positions - 1
    if draft_probs is not None and draft_probs.shape != (bsz, width, vocab):
        raise ValueError(f"draft_probs must be [B, K, V] = {(bsz, width, vocab)}, got {tuple(draft_probs.shape)}")
    device = target_probs.device
    if uniforms is None:
        uniforms = draw_uniforms(bsz, width, device, generators, shared_generator)
    if uniforms.shape != (bsz, width):
        raise ValueError(f"uniforms must be [B, K] = {(bsz, width)}, got {tuple(uniforms.shape)}")

    drafts = draft_tokens.clamp(0, vocab - 1)  # ignored columns may hold padding
    p_draft = target_probs[:, :width].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    # q(d) = 1 for a draft picked deterministically, and u · 1 = u exactly: no product to take
    scaled = uniforms if draft_probs is None else uniforms * draft_probs.gather(2, drafts[..., None]).squeeze(2)
    num_accepted = _leading_accepts(scaled < p_draft, num_drafts)  # [B]

    p_next = _row_at(target_probs, num_accepted)  # [B, V]: p at the first position not accepted
    if width > 0:
        col = num_accepted.clamp(max=width - 1)  # rows that accepted everything use p_next as is
        if draft_probs is None:
            # q = one-hot(d): max(p - q, 0) is p with p(d) zeroed, exactly (p - 0 = p, and p(d) <= 1:
            # a normalised p has no entry above its sum)
            residual = p_next.scatter(1, drafts.gather(1, col[:, None]), 0.0)
        else:
            residual = (p_next - _row_at(draft_probs, col)).clamp_min(0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # No mass left means p <= q everywhere, i.e. p == q up to rounding: then a rejection had
        # probability ~0, and p itself is the residual's limit.
        residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_next)
        rejected = num_accepted < (width if num_drafts is None else num_drafts)  # [B]
        p_next = torch.where(rejected[:, None], residual, p_next)
    last = sample(p_next, generators, shared_generator)
    return VerifyResult(_emitted(draft_tokens, num_accepted, last), num_accepted)
