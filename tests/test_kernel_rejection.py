"""The acceptance rule of speculative sampling in two launches (`megactx.kernels.rejection`) against its
twin `reference.rejection_rows`, given the same random draws. Without a GPU the kernel runs in the
Triton interpreter (set by conftest); tests/test_bench_compile.py compiles its launches for sm_90."""

from __future__ import annotations

import pytest
import torch

from megactx.kernels import reference as ref
from megactx.kernels import rejection as rej
from megactx.kernels.rejection import rejection_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD = -1


def _case(B: int, K: int, V: int, *, q: bool, nd: bool, seed: int):
    """Peaked random p and q (drafts drawn from q, so many are accepted and some rejected), row 0
    with p == q at its first position (no residual mass), padding drafts past num_drafts."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(B, K + 1, V, generator=g), dim=-1)
    qp = torch.softmax(3 * torch.randn(B, K, V, generator=g), dim=-1) if q else None
    if q and K and B:
        qp[0, 0] = p[0, 0]
    src = qp if q else p[:, :K]
    drafts = (torch.multinomial(src.reshape(-1, V), 1, generator=g).view(B, K) if K
              else torch.zeros(B, 0, dtype=torch.long))
    num_drafts = torch.randint(0, K + 1, (B,), generator=g) if nd else None
    if nd and B:
        num_drafts[0] = K
        drafts[num_drafts[None, :].T <= torch.arange(K)[None, :]] = PAD  # ignored columns hold padding
    u = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    return [x if x is None else x.to(DEVICE) for x in (p, drafts, qp, num_drafts, u, noise)]


@pytest.mark.parametrize("V", [5, 37, 3000])
@pytest.mark.parametrize("K", [0, 1, 3, 7])
@pytest.mark.parametrize("q,nd", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["q-nd", "q", "onehot-nd", "onehot"])
def test_rejection_rows_match_twin(V, K, q, nd):
    p, drafts, qp, num_drafts, u, noise = _case(9, K, V, q=q, nd=nd, seed=V * 10 + K)
    tokens, accepted = rejection_rows(p, drafts, qp, num_drafts, u, noise, PAD)
    ref_tokens, ref_accepted = ref.rejection_rows(p, drafts, qp, num_drafts, u, noise.clone(), PAD)
    assert torch.equal(accepted, ref_accepted)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("q,nd", [(True, True), (False, False)], ids=["q-nd", "onehot"])
def test_rejection_rows_over_vocabulary_slices(q, nd):
    # A vocabulary of several slices (the race split over programs, then a second launch): the
    # same tokens as the twin; and where every entry of a row ties, the first of the vocabulary wins.
    V = 3 * rej.MIN_SLICE_STEPS * rej.BLOCK_V + 5  # 4 slices at this batch
    p, drafts, qp, num_drafts, u, noise = _case(9, 3, V, q=q, nd=nd, seed=17)
    tokens, accepted = rejection_rows(p, drafts, qp, num_drafts, u, noise, PAD)
    ref_tokens, ref_accepted = ref.rejection_rows(p, drafts, qp, num_drafts, u, noise.clone(), PAD)
    assert torch.equal(accepted, ref_accepted)
    assert torch.equal(tokens, ref_tokens)
    flat = torch.full((2, 1, V), 1.0 / V, device=DEVICE)
    none = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    uniforms, noise = torch.zeros(2, 0, device=DEVICE), torch.ones(2, V, device=DEVICE)
    tokens, _ = rejection_rows(flat, none, None, None, uniforms, noise, PAD)
    assert tokens.tolist() == [[0], [0]]


def test_rejection_rows_read_strided_rows():
    # The engine's layout: drafts a view of the verify graph's input ids (row stride K + 1),
    # uniforms the first K of gamma draws a row, q the first K of gamma positions.
    p, drafts, qp, _, u, noise = _case(6, 7, 300, q=True, nd=False, seed=3)
    K = 3
    ids = torch.cat([torch.zeros(6, 1, dtype=torch.long, device=DEVICE), drafts], dim=1)  # [B, 8]
    d, uu, qq, pp = ids[:, 1 : K + 1], u[:, :K], qp[:, :K], p[:, : K + 1].contiguous()
    assert d.stride(0) == 8 and uu.stride(0) == 7 and not qq.is_contiguous()
    tokens, accepted = rejection_rows(pp, d, qq, None, uu, noise, PAD)
    ref_tokens, ref_accepted = ref.rejection_rows(pp, d.contiguous(), qq.contiguous(), None, uu.contiguous(),
                                                  noise.clone(), PAD)
    assert torch.equal(accepted, ref_accepted) and torch.equal(tokens, ref_tokens)


def test_rejection_rows_emit_drafts_then_token_then_pad():
    # q = p everywhere: every draft is accepted (u q < p fails only at u ~ 1), the bonus token follows.
    p, drafts, qp, _, u, noise = _case(4, 5, 50, q=True, nd=False, seed=4)
    qp = p[:, :5].contiguous()
    tokens, accepted = rejection_rows(p, drafts, qp, None, u * 0.999, noise, PAD)
    assert torch.equal(accepted, torch.full_like(accepted, 5))
    assert torch.equal(tokens[:, :5], drafts)
    # num_drafts 0 and a p that puts no mass on the draft: nothing accepted, no pad before the token
    num_drafts = torch.tensor([0, 5, 5, 2], device=DEVICE)
    p2 = p.clone()
    p2[1, 0, drafts[1, 0]] = 0.0
    tokens, accepted = rejection_rows(p2, drafts, qp, num_drafts, u, noise, PAD)
    assert accepted[0] == 0 and accepted[1] == 0 and accepted[3] <= 2
    assert torch.all(tokens[:, 0] >= 0) and torch.all(tokens[0, 1:] == PAD)


def test_rejection_rows_refuse_bad_inputs():
    p, drafts, qp, num_drafts, u, noise = _case(2, 3, 20, q=True, nd=True, seed=5)
    with pytest.raises(ValueError, match="draft_tokens and uniforms"):
        rejection_rows(p, drafts[:, :2], qp, num_drafts, u, noise, PAD)
    with pytest.raises(ValueError, match="uniforms must be"):
        rejection_rows(p, drafts, qp, num_drafts, u.double(), noise, PAD)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_rows(p, drafts, qp[:, :2], num_drafts, u, noise, PAD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("q,nd", [(True, True), (False, False)], ids=["q-nd", "onehot"])
def test_rejection_rows_match_twin_on_cuda(q, nd):
    # The compiled kernel at the engine's sizes: batch 64, γ = 7, a GLM-size vocabulary.
    p, drafts, qp, num_drafts, u, noise = _case(64, 7, 151_552, q=q, nd=nd, seed=6)
    tokens, accepted = rejection_rows(p, drafts, qp, num_drafts, u, noise, PAD)
    ref_tokens, ref_accepted = ref.rejection_rows(p, drafts, qp, num_drafts, u, noise.clone(), PAD)
    assert torch.equal(accepted, ref_accepted)
    assert torch.equal(tokens, ref_tokens)
