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

from megactx.engine.sampler import EXPONENTIAL, PAD_ID, UNIFORM, RowSource, draw_rows
from megactx.kernels import reference


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


def greedy_verify(target_tokens: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> VerifyResult:
    """The greedy rule. target_tokens: [B, K + 1] int64, the target's argmax at each verified
    position; draft_tokens: [B, K] int64 (entries past num_drafts[b] are ignored); num_drafts: [B]
    int64 in [0, K], None when every row verifies K drafts."""
    _check_drafts(target_tokens.shape[1], draft_tokens, num_drafts)
    width = draft_tokens.shape[1]
    num_accepted = reference.leading_accepts(draft_tokens == target_tokens[:, :width], num_drafts)
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

    # the token after the accepted drafts races on these (as `sample` draws them)
    noise = draw_rows(torch.empty(bsz, vocab, device=device), EXPONENTIAL, generators, shared_generator)
    return accept_with_draws(target_probs, draft_tokens, draft_probs, num_drafts, uniforms, noise)


def accept_with_draws(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                      num_drafts: torch.Tensor | None, uniforms: torch.Tensor, noise: torch.Tensor) -> VerifyResult:
    """rejection_sample's rule given its draws (uniforms [B, K], noise [B, V] Exp(1), which the twin
    overwrites): the Triton kernel on CUDA, its twin elsewhere. Nothing here reads the device on the
    host, so a CUDA graph can hold it (`spec_graphs.AcceptGraphs`)."""
    if target_probs.device.type == "cuda":  # two launches where the twin's ~20 small ops would each cost host time
        from megactx.kernels.rejection import rejection_rows

        tokens, num_accepted = rejection_rows(target_probs, draft_tokens, draft_probs, num_drafts, uniforms, noise,
                                              PAD_ID)
    else:
        tokens, num_accepted = reference.rejection_rows(target_probs, draft_tokens, draft_probs, num_drafts,
                                                        uniforms, noise, PAD_ID)
    return VerifyResult(tokens, num_accepted)
