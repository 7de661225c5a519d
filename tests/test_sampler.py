import math

import pytest
import torch

from megactx.engine.sampler import (
    PAD_ID,
    Sampler,
    SamplingBatch,
    SamplingTensors,
    apply_penalties,
    make_generator,
    pad_token_ids,
    process_logits,
    sample,
    token_counts,
)
from megactx.engine.sampling_params import MAX_LOGPROBS, SamplingParams

VOCAB = 10


def tensors_for(*params: SamplingParams, vocab: int = VOCAB, eos=()) -> SamplingTensors:
    return SamplingTensors.from_params(list(params), "cpu", vocab, eos_token_ids=eos)


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """The documented pipeline written out for one row in float64 Python."""
    vocab = len(logits)
    if p.temperature == 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [float(i == best) for i in range(vocab)]
    scaled = [x / p.temperature for x in logits]
    order = sorted(range(vocab), key=lambda i: (-scaled[i], i))
    kept = order[: p.top_k] if p.top_k else order
    z = sum(math.exp(scaled[i]) for i in kept)
    probs = {i: math.exp(scaled[i]) / z for i in kept}
    if p.top_p < 1:
        mass, nucleus = 0.0, []
        for i in kept:
            if nucleus and mass >= p.top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        probs = {i: probs[i] for i in nucleus}
    p_max = max(probs.values())
    probs = {i: q for i, q in probs.items() if q >= p.min_p * p_max}
    total = sum(probs.values())
    return [probs.get(i, 0.0) / total for i in range(vocab)]


def probs_to_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()[None]


# ----------------------------------------------------------------------------- process_logits


def test_temperature_divides_the_logits_before_the_softmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0)]
    probs = process_logits(logits, tensors_for(*params))
    expected = torch.softmax(logits / torch.tensor([0.5, 1.0, 2.0])[:, None], dim=-1)
    torch.testing.assert_close(probs, expected)


def test_temperature_zero_is_a_one_hot_at_the_argmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    probs = process_logits(logits, tensors_for(*[SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 4))
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_top_k_keeps_exactly_k_tokens_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, -1.0]])
    probs = process_logits(logits, tensors_for(SamplingParams(top_k=2), vocab=6))
    # Ties go to the lower token ids, so tokens 1 and 2 share the mass.
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0]]))


def test_top_k_larger_than_the_vocab_or_zero_is_off():
    tensors = tensors_for(SamplingParams(top_k=0), SamplingParams(top_k=10_000))
    assert tensors.top_k.tolist() == [VOCAB, VOCAB] and not tensors.any_top_k
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.75, 2), (0.85, 3), (0.99, 4)])
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, kept):
    base = [0.5, 0.3, 0.15, 0.05]
    probs = process_logits(probs_to_logits(base), tensors_for(SamplingParams(top_p=top_p), vocab=4))
    expected = torch.tensor(base[:kept] + [0.0] * (4 - kept))
    torch.testing.assert_close(probs[0], expected / expected.sum())


def test_top_p_one_keeps_even_the_tiniest_tokens():
    logits = torch.tensor([[30.0, 0.0, -5.0, -10.0]])
    probs = process_logits(logits, tensors_for(SamplingParams(top_p=1.0, top_k=4), vocab=4))
    assert (probs > 0).all()
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    base = [0.5, 0.3, 0.15, 0.05]
    probs = process_logits(probs_to_logits(base), tensors_for(SamplingParams(min_p=0.2), vocab=4))
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # Combined with top-k (the sorted path) the threshold is the same.
    probs = process_logits(probs_to_logits(base), tensors_for(SamplingParams(min_p=0.2, top_k=3), vocab=4))
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_process_logits_matches_the_written_out_pipeline_on_mixed_rows():
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m))
              for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (0.9, 0, 1.0, 0.3),
                                 (1.0, 5, 0.8, 0.1), (0.0, 2, 0.5, 0.0), (2.0, 8, 0.95, 0.05)]]
    logits = torch.randn(len(params), VOCAB, generator=gen) * 2
    probs = process_logits(logits, tensors_for(*params))
    expected = torch.tensor([reference_probs(row.tolist(), p) for row, p in zip(logits.double(), params)],
                            dtype=torch.float64)
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)


def test_selected_rows_process_like_the_original_rows():
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5, temperature=0.5)]
    tensors = tensors_for(*params)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([1, 1, 0])
    expected = process_logits(logits, tensors)[rows]
    torch.testing.assert_close(process_logits(logits[rows], tensors.select(rows)), expected)


# ----------------------------------------------------------------------------- penalties


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    tensors = tensors_for(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
                          vocab=5)
    out = apply_penalties(logits, tensors, prompt_token_ids=torch.tensor([[0, PAD_ID]]),
                          output_token_ids=torch.tensor([[1, 1, 3]]))
    # token 0: prompt only -> repetition only: 2 / 2. token 1: output x2, negative: -1 * 2 - 0.25 * 2 - 0.5.
    # token 2: unseen. token 3: output x1: 3 / 2 - 0.25 - 0.5. token 4: unseen.
    torch.testing.assert_close(out, torch.tensor([[1.0, -3.0, 0.5, 0.75, -2.0]]))


def test_penalties_are_per_row_and_padding_counts_nothing():
    logits = torch.zeros(2, 4)
    tensors = tensors_for(SamplingParams(frequency_penalty=1.0), SamplingParams(), vocab=4)
    out = apply_penalties(logits, tensors, None, pad_token_ids([[2, 2], [2]], "cpu"))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, -2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert token_counts(torch.tensor([[PAD_ID, 3, 3]]), 4).tolist() == [[0.0, 0.0, 0.0, 2.0]]


# ----------------------------------------------------------------------------- sampling


def run_steps(sampler, logits_steps, params, generators, row):
    tensors = tensors_for(*params)
    return [sampler(logits, SamplingBatch(tensors, generators=generators)).tokens[row].item()
            for logits in logits_steps]


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0, top_p=0.1),
              SamplingParams(top_k=3)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, SamplingBatch(tensors_for(*params)))
    assert out.tokens[[0, 2]].tolist() == logits.argmax(-1)[[0, 2]].tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_a_seeded_request_samples_the_same_alone_and_batched():
    steps = [torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(10 + i)) for i in range(8)]
    seeded = SamplingParams(seed=1234, top_k=7)
    alone = run_steps(Sampler(), [s[1:2] for s in steps], [seeded], [make_generator(1234)], row=0)
    batched = run_steps(Sampler(torch.Generator().manual_seed(99)), steps,
                        [SamplingParams(seed=5), seeded, SamplingParams()],
                        [make_generator(5), make_generator(1234), None], row=1)
    again = run_steps(Sampler(), [s[1:2] for s in steps], [seeded], [make_generator(1234)], row=0)
    assert alone == batched == again


def test_a_batch_of_seeded_rows_leaves_the_shared_generator_alone():
    """Every row has its own generator: no noise is drawn from the shared one (it would be thrown
    away, a [B, V] draw a step); a row without one still draws from it."""
    probs = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)), dim=-1)
    shared = torch.Generator().manual_seed(1)
    before = shared.get_state()
    sample(probs, [make_generator(s) for s in (5, 6, 7)], shared)
    assert torch.equal(shared.get_state(), before)
    sample(probs, [make_generator(5), None, make_generator(7)], shared)
    assert not torch.equal(shared.get_state(), before)


def test_different_seeds_give_different_tokens():
    steps = [torch.zeros(1, VOCAB)] * 20  # uniform: any difference comes from the seed
    runs = [run_steps(Sampler(), steps, [SamplingParams(seed=s)], [make_generator(s)], row=0)
            for s in (1, 2)]
    assert runs[0] != runs[1]


CHI2_4_DOF_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, p = 0.001


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return ((observed - expected) ** 2 / expected).sum().item()


def test_sample_follows_probs_by_chi_square():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    num = 20_000
    tokens = sample(probs.expand(num, 5).contiguous(), shared_generator=torch.Generator().manual_seed(7))
    assert chi_square(tokens, probs) < CHI2_4_DOF_P001
    # The test has power: a sampler that is slightly off (p ** 0.8, renormalised) fails it.
    skewed = probs ** 0.8 / (probs ** 0.8).sum()
    wrong = sample(skewed.expand(num, 5).contiguous(), shared_generator=torch.Generator().manual_seed(7))
    assert chi_square(wrong, probs) > CHI2_4_DOF_P001


def test_seeded_streams_follow_probs_by_chi_square():
    """Seeded rows draw from counter-based streams: 20,000 requests of different seeds, one draw each
    (across streams), and one request drawing 20,000 times (along its stream), both by chi-square."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    num = 20_000
    across = sample(probs.expand(num, 5).contiguous(), [make_generator(seed) for seed in range(num)])
    assert chi_square(across, probs) < CHI2_4_DOF_P001
    stream = make_generator(2024)
    along = torch.cat([sample(probs[None], [stream]) for _ in range(num // 100) for _ in range(100)])
    assert chi_square(along, probs) < CHI2_4_DOF_P001
    assert stream.offset == num * 5  # each draw took a row's worth of the stream


def test_sample_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]).repeat(500, 1)
    tokens = sample(probs, shared_generator=torch.Generator().manual_seed(8))
    assert (probs.gather(1, tokens[:, None]) > 0).all()


# ----------------------------------------------------------------------------- logprobs and min_tokens


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    params = [SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5), SamplingParams(logprobs=0),
              SamplingParams(temperature=0.0)]
    batch = SamplingBatch(tensors_for(*params), output_token_ids=pad_token_ids([[1, 2], [], [4]], "cpu"))
    out = Sampler(torch.Generator().manual_seed(0))(logits, batch)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.tokens[:, None]).squeeze(1))
    values, ids = reference.topk(3, dim=-1)
    torch.testing.assert_close(out.top_logprobs, values)
    assert out.top_token_ids.tolist() == ids.tolist()


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # EOS (1) first, stop token (2) second
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    tensors = tensors_for(params, vocab=4, eos=[1])
    early = SamplingBatch(tensors, output_token_ids=pad_token_ids([[3]], "cpu"))
    late = SamplingBatch(tensors, output_token_ids=pad_token_ids([[3, 3]], "cpu"))
    assert Sampler()(logits, early).tokens.tolist() == [3]
    assert Sampler()(logits, late).tokens.tolist() == [1]


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
    dict(top_k=2.5), dict(min_p=-0.1), dict(min_p=1.1), dict(max_tokens=0), dict(min_tokens=-1),
    dict(min_tokens=20), dict(seed=2**64), dict(seed=1.5), dict(stop=[""]), dict(stop_token_ids=[-1]),
    dict(ignore_eos="yes"), dict(repetition_penalty=0.0), dict(presence_penalty=2.5),
    dict(frequency_penalty=-2.1), dict(logprobs=MAX_LOGPROBS + 1), dict(logprobs=-1), dict(n=0),
])
def test_sampling_params_name_the_bad_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
