"""The acceptance rules of speculative decoding (megactx.engine.rejection_sampler) on synthetic p and q:
the greedy rule against hand-made cases, the rejection rule against its formula (accept iff
u · q(d) < p(d); replacement from normalize(max(p - q, 0)); bonus from p_K), and the property that
makes it right — every emitted token is distributed as the target's p — by chi-square tests that a
wrong rule fails."""

from __future__ import annotations

import pytest
import torch

from megactx.engine.rejection_sampler import draw_uniforms, greedy_verify, rejection_sample
from megactx.engine.sampler import PAD_ID

# A correct rule must pass at this p-value (a false alarm once in 10^4 seeds); the wrong rules below
# land below WRONG_RULE_P_VALUE with the same samples, so the test has the power to tell them apart.
P_VALUE = 1e-4
WRONG_RULE_P_VALUE = 1e-12


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test that `samples` (token ids) were drawn from `probs` [V]."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    assert (expected[probs > 0] >= 5).all(), "too few samples for a chi-square test"
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    keep = probs > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    # the chi-square survival function is the regularized upper incomplete gamma Q(dof / 2, stat / 2)
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def random_dists(gen: torch.Generator, rows: int, vocab: int, sharpness: float = 2.0) -> torch.Tensor:
    """[rows, vocab] distributions, every entry >= 1 / (20 vocab) so chi-square cells are populated."""
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * sharpness, dim=-1)
    floor = 1 / (20 * vocab)
    return (probs + floor) / (1 + vocab * floor)


# ------------------------------------------------------------------------------ greedy
def test_greedy_verify_keeps_the_matching_prefix_then_the_target_token():
    target = torch.tensor([[5, 6, 7, 8],   # all three drafts match: bonus 8
                           [5, 6, 7, 8],   # second draft differs: replaced by the target's 6
                           [5, 6, 7, 8],   # first differs
                           [5, 6, 7, 8],   # one draft verified; the later (mismatching) ones are ignored
                           [5, 6, 7, 8]])  # no drafts: a plain decode
    drafts = torch.tensor([[5, 6, 7], [5, 1, 7], [9, 6, 7], [5, 0, 0], [1, 2, 3]])
    num_drafts = torch.tensor([3, 3, 3, 1, 0])
    result = greedy_verify(target, drafts, num_drafts)
    assert result.num_accepted.tolist() == [3, 1, 0, 1, 0]
    P = PAD_ID
    assert result.tokens.tolist() == [[5, 6, 7, 8], [5, 6, P, P], [5, P, P, P], [5, 6, P, P], [5, P, P, P]]


def test_no_num_drafts_means_every_row_verifies_all_of_them():
    gen = torch.Generator().manual_seed(4)
    target = torch.randint(0, 3, (64, 4), generator=gen)
    drafts = torch.randint(0, 3, (64, 3), generator=gen)
    want, got = greedy_verify(target, drafts, torch.full((64,), 3)), greedy_verify(target, drafts)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    p = random_dists(gen, 64 * 4, 6).view(64, 4, 6)
    q = random_dists(gen, 64 * 3, 6).view(64, 3, 6)
    u = torch.rand(64, 3, generator=gen)
    for draft_probs in (q, None):
        want = rejection_sample(p, drafts, draft_probs, torch.full((64,), 3), u,
                                shared_generator=torch.Generator().manual_seed(5))
        got = rejection_sample(p, drafts, draft_probs, None, u, shared_generator=torch.Generator().manual_seed(5))
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
        assert 0 < want.num_accepted.sum() < 64 * 3


def test_deterministic_drafts_are_the_one_hot_case_exactly():
    """draft_probs None draws what explicit one-hot q draws, token for token (same noise)."""
    gen = torch.Generator().manual_seed(6)
    p = random_dists(gen, 64 * 4, 6).view(64, 4, 6)
    drafts = torch.randint(0, 6, (64, 3), generator=gen)
    one_hot = torch.zeros(64, 3, 6).scatter_(2, drafts[..., None], 1.0)
    num_drafts, u = torch.randint(0, 4, (64,), generator=gen), torch.rand(64, 3, generator=gen)
    want = rejection_sample(p, drafts, one_hot, num_drafts, u, shared_generator=torch.Generator().manual_seed(7))
    got = rejection_sample(p, drafts, None, num_drafts, u, shared_generator=torch.Generator().manual_seed(7))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    assert (want.num_accepted < num_drafts).any()  # some rows sampled a replacement


# ------------------------------------------------------------------------------ the formula
def test_a_draft_is_accepted_iff_u_times_q_is_below_p():
    # draft 0: p/q = 0.5/0.8 = 0.625. Residual max(p - q, 0) = [0, 0.3, 0, 0]: the replacement is 1.
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.3, 0.3]])  # p_0, p_1
    q = torch.tensor([[0.8, 0.2, 0.0, 0.0]])
    target = p[None].expand(4, -1, -1)  # [4 rows, K + 1 = 2, V]
    draft_probs = q.expand(4, 1, 4).clone()
    drafts = torch.zeros(4, 1, dtype=torch.long)
    uniforms = torch.tensor([[0.62], [0.63], [0.0], [0.999]])
    result = rejection_sample(target, drafts, draft_probs, torch.ones(4, dtype=torch.long), uniforms)
    assert result.num_accepted.tolist() == [1, 0, 1, 0]
    rejected = result.tokens[result.num_accepted == 0]
    assert (rejected[:, 0] == 1).all() and (rejected[:, 1] == PAD_ID).all()  # the residual's only token

    # p(d) = 0 is never accepted, not even with u = 0; p(d) >= q(d) always is
    zero = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    assert rejection_sample(zero, torch.tensor([[0]]), torch.tensor([[[0.5, 0.5]]]), torch.tensor([1]),
                            torch.tensor([[0.0]])).tokens.tolist() == [[1, PAD_ID]]
    sure = torch.tensor([[[0.9, 0.1], [0.0, 1.0]]])
    assert rejection_sample(sure, torch.tensor([[0]]), torch.tensor([[[0.5, 0.5]]]), torch.tensor([1]),
                            torch.tensor([[0.9999]])).tokens.tolist() == [[0, 1]]  # then the bonus from p_1


def test_deterministic_drafts_are_accepted_with_probability_p():
    """draft_probs=None (q = one-hot): accept iff u < p(d); the replacement excludes d."""
    target = torch.tensor([[[0.3, 0.7, 0.0], [1.0, 0.0, 0.0]]]).expand(2, -1, -1)
    drafts = torch.tensor([[1], [1]])
    result = rejection_sample(target, drafts, None, torch.tensor([1, 1]), torch.tensor([[0.69], [0.71]]))
    assert result.tokens.tolist() == [[1, 0], [0, PAD_ID]]  # accepted + bonus; rejected -> p without 1 = token 0


def test_replacements_follow_the_residual_and_bonus_tokens_the_last_target():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 6, 40_000
    p = random_dists(gen, 2, vocab)  # p_0, p_1
    q = random_dists(gen, 1, vocab)
    target = p[None].expand(rows, -1, -1)
    draft_probs = q[None].expand(rows, -1, -1)
    # the draft token where q exceeds p most: rejections are frequent
    d = int((q[0] - p[0]).argmax())
    drafts = torch.full((rows, 1), d)
    result = rejection_sample(target, drafts, draft_probs, torch.ones(rows, dtype=torch.long),
                              shared_generator=gen)
    rejected = result.num_accepted == 0
    accept_rate = 1 - rejected.double().mean().item()
    want_rate = min(1.0, (p[0, d] / q[0, d]).item())
    assert abs(accept_rate - want_rate) < 4 * (want_rate * (1 - want_rate) / rows) ** 0.5 + 1e-9
    residual = (p[0] - q[0]).clamp_min(0)
    assert chi_square_p_value(result.tokens[rejected, 0], residual / residual.sum()) > P_VALUE
    assert chi_square_p_value(result.tokens[~rejected, 1], p[1]) > P_VALUE  # bonus from p_1
    # rows that verify no draft sample straight from p_0
    plain = rejection_sample(target, drafts, draft_probs, torch.zeros(rows, dtype=torch.long), shared_generator=gen)
    assert (plain.num_accepted == 0).all() and chi_square_p_value(plain.tokens[:, 0], p[0]) > P_VALUE


# ------------------------------------------------------------------------------ the property
def _speculative_samples(gen, rows, vocab, width):
    p = random_dists(gen, width + 1, vocab)  # p_0 .. p_K (independent of the drafts, for simplicity)
    q = random_dists(gen, width, vocab)
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen) for j in range(width)], 1)
    uniforms = torch.rand(rows, width, generator=gen)
    return p, q, drafts, uniforms


def _first_tokens_p_values(tokens, num_accepted, p, width):
    """p-values that the emitted token at index j (over the rows that got that far) follows p_j."""
    return [chi_square_p_value(tokens[num_accepted >= j, j], p[j]) for j in range(width + 1)
            if (num_accepted >= j).sum() > 2000]


@pytest.mark.parametrize("acceptance", ["rejection", "target-only"])
def test_speculative_sampling_reproduces_the_target_distribution(acceptance):
    gen = torch.Generator().manual_seed(1)
    rows, vocab, width = 60_000, 6, 3
    p, q, drafts, uniforms = _speculative_samples(gen, rows, vocab, width)
    draft_probs = q[None].expand(rows, -1, -1)
    if acceptance == "target-only":  # greedy drafts, q = one-hot
        drafts = q.argmax(dim=-1)[None].expand(rows, -1).contiguous()
        draft_probs = None
    result = rejection_sample(p[None].expand(rows, -1, -1), drafts, draft_probs,
                              torch.full((rows,), width), uniforms, shared_generator=gen)
    assert 0 < result.num_accepted.float().mean() < width, "the test needs both acceptances and rejections"
    p_values = _first_tokens_p_values(result.tokens, result.num_accepted, p, width)
    assert len(p_values) >= 2 and min(p_values) > P_VALUE, p_values


def test_wrong_acceptance_rules_fail_the_same_test():
    """With the same samples, rules with a classic mistake fail the chi-square test of position 0."""
    gen = torch.Generator().manual_seed(1)
    rows, vocab, width = 60_000, 6, 1
    p, q, drafts, uniforms = _speculative_samples(gen, rows, vocab, width)
    d, u = drafts[:, 0], uniforms[:, 0]
    accept = u * q[0, d] < p[0, d]
    from_p = torch.multinomial(p[0], rows, replacement=True, generator=gen)
    resampled_from_p = torch.where(accept, d, from_p)  # forgets to subtract q on rejection
    always = d  # accepts every draft: the draft distribution
    ratio_unclamped = torch.where(u < p[0, d] / q[0, d] * 0.5, d, from_p)  # a mis-scaled acceptance test
    for wrong in (resampled_from_p, always, ratio_unclamped):
        assert chi_square_p_value(wrong, p[0]) < WRONG_RULE_P_VALUE


def test_seeded_rows_draw_from_their_own_generators():
    """A row with its own generator gets the same uniforms and tokens alone as in a batch."""
    gen = torch.Generator().manual_seed(2)
    p, q, drafts, _ = _speculative_samples(gen, 5, 8, 2)
    target, draft_probs = p[None].expand(5, -1, -1), q[None].expand(5, -1, -1)

    def run(rows, seeded_row):
        generators = [torch.Generator().manual_seed(7) if r == seeded_row else None for r in range(len(rows))]
        uniforms = draw_uniforms(len(rows), 2, "cpu", generators, torch.Generator().manual_seed(len(rows)))
        result = rejection_sample(target[rows], drafts[rows], draft_probs[rows], torch.full((len(rows),), 2),
                                  uniforms, generators, torch.Generator().manual_seed(99))
        return uniforms[seeded_row].tolist(), result.tokens[seeded_row].tolist()

    assert run([3], 0) == run([0, 1, 3, 4], 2)
    shared = torch.Generator().manual_seed(3)
    before = shared.get_state()  # every row seeded: nothing drawn from the shared generator
    assert torch.equal(draw_uniforms(2, 2, "cpu", [torch.Generator().manual_seed(7)] * 2, shared).isfinite(),
                       torch.ones(2, 2, dtype=torch.bool)) and torch.equal(shared.get_state(), before)


def test_shapes_are_checked():
    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_tokens must be"):
        rejection_sample(p, torch.zeros(2, 3, dtype=torch.long), None, torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(p, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, 5), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="num_drafts must be"):
        greedy_verify(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long), torch.ones(3))
