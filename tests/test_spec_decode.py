"""MTP speculative decoding in the engine, on a CPU with the torch backend (also on a GPU machine).

Greedy output is token for token the non-speculative engine's (batches of different lengths, chunked
prefill, preemption, prefix hits, stops and max_tokens inside accepted runs, both MTP modes); the
engine's drafts are the reference drafter's (model/mtp.py `draft`) after every step, so the MTP
layer's paged KV is right, rolled back included; after rejections both caches hold exactly the KV of
the accepted tokens; sampling reproduces the target's distribution end to end; the scheduler's
draft budget and lookahead slots, the statistics and /metrics behave as documented.

Two random tiny MTP checkpoints: one as built (its MTP layer drafts noise: nearly every draft is
rejected) and one made into a decent drafter (`BIGRAM_SCALE`), so that runs of drafts are accepted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megactx import LLM, ModelConfig, SamplingParams
from megactx.engine.block_manager import BlockManager
from megactx.engine.model_runner import EagerCapture
from megactx.engine.scheduler import Scheduler, SchedulerConfig
from megactx.engine.sequence import Sequence, SequenceStatus
from megactx.engine.spec_decode import SpecDecodeStats
from megactx.kernels.reference import BLOCK_SIZE, read_index_k, read_kv
from megactx.model import build_model
from megactx.model.attention import LayerCache
from megactx.model.mtp import draft

VOCAB = 512
GAMMA = 3
# The embedding scaled this much makes the next token depend mostly on the current one (a bigram
# model), and an MTP layer that passes the next token's embedding through predicts the same bigram:
# about half its drafts are accepted, so accepted runs, partial accepts and rejections all occur.
BIGRAM_SCALE = 10.0
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _model(bigram_scale: float | None = None, **overrides):
    # 16 indexer heads keep exact-zero ties out of the top-k of a random model (see test_paged.py)
    # 4 layers: 3 full and 1 shared (IndexShare); dense MLPs (MoE is not what this file tests, and
    # its per-expert loop is the slowest part of a CPU step)
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=VOCAB, index_topk=16, index_n_heads=16,
                                                      num_hidden_layers=4, first_k_dense_replace=5,
                                                      max_position_embeddings=1024, eos_token_id=[VOCAB - 1],
                                                      **overrides)
    model = build_model(cfg, seed=3)
    if bigram_scale is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(bigram_scale)
            mtp, dim = model.mtp[0], cfg.hidden_size
            mtp.eh_proj.weight.zero_()  # [D, 2D] over (enorm(embedding), hnorm(hidden))
            # the embedding half, at the scale of the target's residual stream (init std 0.02)
            mtp.eh_proj.weight[:, :dim] = torch.eye(dim) * bigram_scale * 0.02
    return model


# tiny models on a shared CPU: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def noise_drafter():
    return _model()


@pytest.fixture(scope="module")
def good_drafter():
    return _model(BIGRAM_SCALE)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


def _spec(model, **kwargs) -> LLM:
    return LLM(model, device="cpu", num_speculative_tokens=kwargs.pop("gamma", GAMMA), **({"num_blocks": 32} | kwargs))


# ------------------------------------------------------------------------------ greedy equality
@pytest.mark.parametrize("case", [
    ("good", "kvshare", dict()),
    ("good", "baseline", dict(max_num_batched_tokens=48, num_blocks=7)),  # chunked prefill + preemption
    ("noise", "kvshare", dict(max_num_batched_tokens=48, num_blocks=7)),
    ("good", "kvshare", dict(chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256)),
], ids=["good-kvshare", "good-baseline-chunked-preempting", "noise-kvshare-chunked-preempting", "good-unchunked"])
def test_greedy_equals_non_speculative_decoding(case, noise_drafter, good_drafter):
    which, mode, setup = case
    model = good_drafter if which == "good" else noise_drafter
    # different lengths, two sharing a 100-token prefix (a prefix hit), ends near block edges
    shared = _prompts([100], seed=5)[0]
    prompts = _prompts([5, 60, 130, 3]) + [shared + [1, 2], shared + [3]]
    if "num_blocks" in setup:
        prompts = _prompts([60, 62, 50, 63], seed=1)
    want = LLM(model, device="cpu", num_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    llm = _spec(model, mtp_mode=mode, max_num_seqs=4, **setup)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for got, ref in zip(outs, want):
        assert got.token_ids == ref.token_ids
        assert got.outputs[0].finish_reason == "length"
    stats = llm.stats.spec_decode
    assert stats.num_draft_tokens > 0
    if which == "good":
        assert stats.mean_acceptance_length > 1.5, "the test meant to exercise accepted runs"
        assert stats.num_accepted_tokens < stats.num_draft_tokens, "and rejections"
    if "num_blocks" in setup:
        assert llm.stats.preemptions > 0, "the test meant to exercise preemption"
    assert llm.block_manager.num_used_blocks == 0 and not llm.spec.drafts


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlapped"])
def test_stops_and_max_tokens_inside_an_accepted_run(good_drafter, tmp_path, overlap):
    """overlapped: graphed steps, each launching the next verify before its host sync; a stop ends a
    sequence whose next verify was launched already (it is dropped, the step scheduled anew)."""
    from megactx.testing import train_tokenizer

    train_tokenizer(VOCAB).save(str(tmp_path / "tokenizer.json"))
    llm = _spec(good_drafter, gamma=4, tokenizer=tmp_path, async_scheduling=overlap)
    if overlap:
        _graphed(llm)
    prompt = _prompts([8], seed=11)[0]  # token ids; outputs still come with text
    free_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    deltas = list(llm.stream(prompt, free_params))
    tokens = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    want = LLM(good_drafter, device="cpu", num_blocks=32, tokenizer=tmp_path).generate(
        [prompt], free_params, use_tqdm=False)[0]
    assert tokens == want.token_ids and text == want.text
    for got, ref in zip([lp for d in deltas for lp in d.logprobs], want.outputs[0].logprobs):
        assert got.token_id == ref.token_id and abs(got.logprob - ref.logprob) < 1e-4
        assert list(got.top) == list(ref.top)

    # an emitted run of >= 3 tokens whose middle token first occurs there: stopping at it drops the rest
    starts = [sum(len(d.token_ids) for d in deltas[:i]) for i in range(len(deltas))]
    at = next(s + 1 for d, s in zip(deltas, starts) if len(d.token_ids) >= 3 and tokens.index(tokens[s + 1]) == s + 1)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                stop_token_ids=[tokens[at]]), use_tqdm=False)[0]
    assert out.token_ids == tokens[: at + 1] and out.outputs[0].finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=at + 1, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == tokens[: at + 1] and out.outputs[0].finish_reason == "length"

    # a stop string inside an accepted run: the text of a run's middle token, where it first occurs
    for d, s in zip(deltas, starts):
        before = llm.tokenizer.decode(tokens[: s + 1])
        middle = llm.tokenizer.decode(tokens[: s + 2])[len(before) :]
        stop = middle.strip()
        if len(d.token_ids) >= 3 and len(stop) >= 2 and text.find(stop) == len(before) + middle.index(stop):
            break
    else:
        pytest.fail("the random model produced no usable stop string inside an accepted run")
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert cut.text == text[: text.index(stop)] and cut.outputs[0].finish_reason == "stop"
    assert llm.block_manager.num_used_blocks == 0
    if overlap:
        assert llm.spec.overlapped_steps > llm.spec.overlapped_discarded >= 1  # a stop ended a launched step


# ------------------------------------------------------------------------------ the MTP layer's KV
@pytest.mark.parametrize("mode", ["kvshare", "baseline"])
def test_drafts_equal_the_reference_drafter_after_every_step(good_drafter, mode):
    """The reference drafter recomputes everything densely from the tokens; the engine's drafts come
    from its paged MTP cache, filled chunk by chunk, by accepted runs and after rollbacks."""
    llm = _spec(good_drafter, mtp_mode=mode, max_num_seqs=4, max_num_batched_tokens=40)
    for prompt in _prompts([70, 9], seed=2):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    seqs = {seq.seq_id: seq for seq in llm.scheduler.waiting}
    checked = 0
    while llm.has_unfinished():
        llm.step()
        for seq_id, held in llm.spec.drafts.items():
            # the reference takes the computed context and predicts the last (uncomputed) token itself
            *context, last = seqs[seq_id].token_ids
            ref = draft(good_drafter, torch.tensor([context]), len(held.tokens), kv_share=mode == "kvshare")
            assert ref.next_token.item() == last
            assert held.tokens == ref.tokens[0].tolist()
            checked += 1
    assert checked >= 8


def test_the_mtp_indexer_runs_only_where_a_draft_starts(good_drafter):
    """MTP step 1 writes the KV of every position a step computes, but its indexer (a scan of the
    whole context) runs only at the last position of a sequence that drafts: a prompt prefilled in
    four chunks takes it once, at its last chunk's last row, and each decode step once a sequence."""
    llm = _spec(good_drafter, max_num_batched_tokens=64)
    mtp_index = llm.runner.caches[good_drafter.cfg.num_hidden_layers][1]
    rows_seen = []  # rows of each indexer call over the MTP layer's cache
    topk = llm.runner.ops.indexer_topk

    def counting(q, w, index_cache, *args):
        if index_cache is mtp_index:
            rows_seen.append(q.shape[0])
        return topk(q, w, index_cache, *args)

    llm.runner.ops = dataclasses.replace(llm.runner.ops, indexer_topk=counting)
    prompts = _prompts([200, 30], seed=4)
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    assert rows_seen and set(rows_seen) <= {1, 2}  # one row a drafting sequence, two sequences at most
    assert len(rows_seen) < steps  # the prompt's first chunks (no draft yet) ran no MTP indexer
    # the drafts and the KV they read are those of the reference drafter (see the test below): here,
    # that the outputs are still the non-speculative engine's
    plain = LLM(good_drafter, device="cpu", num_blocks=32, max_num_batched_tokens=64)
    want = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_rejected_drafts_leave_exactly_the_kv_of_the_accepted_tokens(noise_drafter):
    """After every step, the target and MTP caches hold, at each computed position, the KV a dense
    forward of the sequence's tokens computes: the slots a verify wrote for rejected drafts are
    not counted as computed, and the next verify rewrites them."""
    model, cfg = noise_drafter, noise_drafter.cfg
    llm = _spec(model, mtp_mode="baseline", max_num_batched_tokens=64)  # baseline: lookahead slots too
    for prompt in _prompts([61, 20], seed=3):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    seqs = list(llm.scheduler.waiting)
    layers, kv_width = cfg.num_hidden_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    while llm.has_unfinished():
        llm.step()
        running = [s for s in seqs if s.status is SequenceStatus.RUNNING]
        llm.block_manager.check_invariants(running)
        for seq in running:
            n = seq.num_computed_tokens
            slots = torch.tensor(llm.block_manager.slots(seq, 0, n))
            ids = torch.tensor([seq.token_ids])
            dense = [LayerCache() for _ in range(layers)]
            with torch.no_grad():
                hidden = model.hidden_states(ids[:, :n], caches=dense)
                mtp_cache, positions = LayerCache(), torch.arange(n)[None]
                cos, sin = model.rotary(positions, hidden.dtype)
                model.mtp[0](hidden, model.embed(ids[:, 1 : n + 1]), cos, sin, positions, cache=mtp_cache)
            for i, (kv, index) in enumerate(llm.runner.caches):
                want = dense[i] if i < layers else mtp_cache
                got = read_kv(kv, slots, cfg.kv_lora_rank)
                assert got.shape == (n, kv_width)
                assert torch.allclose(got, torch.cat([want.c[0], want.k_pe[0]], -1), atol=1e-5)
                if index is not None:
                    keys, _ = read_index_k(index, slots, cfg.index_head_dim)
                    assert torch.allclose(keys, want.index_k[0], atol=1e-5)
    stats = llm.stats.spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens / 4
    assert llm.block_manager.num_used_blocks == 0


def test_prefix_hits_leave_the_last_matching_block_to_recompute(good_drafter):
    """The MTP KV of a block's last position depends on the next block's first token, which the
    block's hash does not cover: a speculative engine recomputes the last matching block."""
    shared = _prompts([150], seed=4)[0]
    prompts = [shared + tail for tail in _prompts([7, 20], seed=6)]
    llm = _spec(good_drafter)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    second = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert second[0].num_cached_tokens == BLOCK_SIZE  # not 2 blocks, as without speculative decoding
    want = LLM(good_drafter, device="cpu", num_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first + second] == [o.token_ids for o in want]


# ------------------------------------------------------------------------------ sampling
def test_sampling_reproduces_the_target_distribution_end_to_end():
    """Many samples of the first two tokens after a prompt, from a 16-token vocabulary: the second
    comes out of a verify (an accepted draft or a replacement from the residual), and its marginal
    must equal the target's Σ_t p(t | prompt) p(· | prompt, t), by a chi-square test."""
    from test_rejection_sampler import P_VALUE, chi_square_p_value

    vocab = 16
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=vocab, index_topk=16, index_n_heads=16,
                                                      num_hidden_layers=2, eos_token_id=[vocab - 1])
    model = build_model(cfg, seed=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    # max_tokens 3: the verify after the prefill's token checks one draft for the second token. With
    # 1200 samples, resampling rejections from p instead of the residual fails at p < 1e-7 here.
    params = SamplingParams(temperature=0.15, max_tokens=3, ignore_eos=True, n=1200)
    llm = LLM(model, device="cpu", num_blocks=400, max_num_seqs=400, num_speculative_tokens=2, seed=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    stats = llm.stats.spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_drafts, "the test needs accepted and rejected drafts"
    second = torch.tensor([c.token_ids[1] for c in out.outputs])
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt]))[0, -1] / params.temperature, -1)
        contexts = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = torch.softmax(model(contexts)[:, -1] / params.temperature, -1)  # [t, V]
    marginal = p1 @ p2
    # cells expected to hold fewer than 5 samples are pooled into the most likely one
    small = marginal * len(second) < 5
    pooled_ids = torch.where(small[second], int(marginal.argmax()), second)
    pooled = marginal.masked_fill(small, 0.0)
    pooled[marginal.argmax()] += marginal[small].sum()
    assert chi_square_p_value(pooled_ids, pooled) > P_VALUE


def test_seeded_sampling_is_reproducible_alone_and_batched(good_drafter):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    others = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    prompt, *rest = _prompts([20, 33, 9])
    alone = _spec(good_drafter).generate([prompt], params, use_tqdm=False)[0].token_ids
    batched = _spec(good_drafter).generate([*rest, prompt], [others, others, params], use_tqdm=False)
    assert batched[-1].token_ids == alone


# ------------------------------------------------------------------------------ scheduler
def _prefilled(scheduler, prompts_and_max_tokens):
    """Sequences (prompt length, max_tokens) admitted and prefilled in one step, each holding its
    first output token: decoding from the next step on."""
    seqs = [Sequence(i, list(range(n)), SamplingParams(max_tokens=m))
            for i, (n, m) in enumerate(prompts_and_max_tokens)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [item.seq for item in out.scheduled if item.samples] == seqs
    scheduler.postprocess(out, {seq.seq_id: 7 for seq in seqs})
    return seqs


def test_scheduler_caps_drafts_by_what_is_held_the_limits_and_the_budget():
    sched = Scheduler(SchedulerConfig(max_model_len=20, max_num_seqs=4, max_num_batched_tokens=32,
                                      num_speculative_tokens=4), BlockManager(16))
    a, b, c = _prefilled(sched, [(5, 50), (16, 50), (5, 3)])
    # b has 17 of max_model_len = 20 tokens: 2 accepted drafts + 1 fill it; c has 1 of 3 outputs
    assert [sched.max_draft_tokens(s) for s in (a, b, c)] == [4, 2, 1]
    out = sched.schedule({0: 4, 1: 4, 2: 4})
    assert {i.seq.seq_id: (i.num_tokens, i.num_draft_tokens) for i in out.scheduled} == {0: (1, 4), 1: (1, 2),
                                                                                        2: (1, 1)}
    assert out.num_batched_tokens == 5 + 3 + 2
    # a verify emits its accepted drafts + 1; only positions computed with accepted tokens count
    sched.postprocess(out, {0: [11, 12], 1: [21, 22, 23], 2: [31]})
    assert (a.num_tokens, a.num_computed_tokens) == (8, 7)  # its last token and 1 accepted draft
    assert (b.num_tokens, b.num_computed_tokens) == (20, 19)
    assert (c.num_tokens, c.num_computed_tokens) == (7, 6)
    assert a.token_ids[5:] == [7, 11, 12]

    # drafts also stop at what the token budget leaves
    tight = Scheduler(SchedulerConfig(max_model_len=200, max_num_seqs=1, max_num_batched_tokens=3,
                                      num_speculative_tokens=4), BlockManager(16))
    _prefilled(tight, [(3, 50)])
    out = tight.schedule({0: 4})
    assert out.scheduled[0].num_draft_tokens == 2 and out.num_batched_tokens == 3
    with pytest.raises(ValueError, match="emits 1 to 3 tokens"):
        tight.postprocess(out, {0: [1, 2, 3, 4]})


def test_lookahead_slots_are_reserved_capped_and_returned():
    bm = BlockManager(8)
    config = SchedulerConfig(max_model_len=400, num_speculative_tokens=3, num_lookahead_slots=2)
    sched = Scheduler(config, bm)
    (seq,) = _prefilled(sched, [(BLOCK_SIZE - 4, 100)])  # 60 positions + 2 lookahead slots: one block
    assert seq.num_blocks == 1
    out = sched.schedule({0: 3})  # verifies positions 60 .. 63, lookahead 64, 65: a second block
    assert out.scheduled[0].num_draft_tokens == 3 and seq.num_blocks == 2
    sched.postprocess(out, {0: [5]})  # every draft rejected
    assert seq.num_blocks == 2 and bm.blocks_for(seq.num_tokens) == 1
    sched.schedule({})  # a plain decode (no drafts held): the spare block goes back first
    assert seq.num_blocks == 1 and bm.num_used_blocks == 1
    bm.check_invariants([seq])
    # reservations stop at max_kv_tokens, prompt + max_tokens - 1 = 64 positions here: never a second block
    short_sched = Scheduler(config, BlockManager(8))
    (short,) = _prefilled(short_sched, [(BLOCK_SIZE - 1, 2)])
    out = short_sched.schedule({0: 3})
    assert out.scheduled[0].num_draft_tokens == 0 and short.num_blocks == 1


# ------------------------------------------------------------------------------ graphs
def _graphed(llm: LLM) -> LLM:
    """The engine running its decode, verify and draft steps through the graph machinery, on a
    CPU: EagerCapture, key buckets from 64 keys (so these short prompts cross several)."""
    llm.runner.use_graphs(EagerCapture(), min_keys=64)
    return llm


def _same_state(eager: LLM, graphed: LLM, ahead: bool = False) -> None:
    """Both engines hold the same drafts, and the same values in every slot of every cache: the
    graphs' padding rows wrote nothing, and rejected positions hold what the eager step wrote.
    ahead: `graphed` overlaps its steps (it wrote the next verify's target KV already): every
    cache is compared where the running sequences computed, as the MTP layer's always is."""
    assert eager.spec.drafts.keys() == graphed.spec.drafts.keys()
    for seq_id, want in eager.spec.drafts.items():
        got = graphed.spec.drafts[seq_id]
        assert got.tokens == want.tokens
        assert (got.probs is None) == (want.probs is None)
        if want.probs is not None:
            assert torch.allclose(got.probs, want.probs, atol=1e-5)
    mtp = graphed.runner.cfg.num_hidden_layers  # the MTP layer's cache: see below
    for layer, (want, got) in enumerate(zip(eager.runner.caches, graphed.runner.caches)):
        if layer == mtp or ahead:
            # drafts made before the verify's host sync write the MTP KV of every verified position,
            # the rejected ones too (the next step writes them again before anything reads them):
            # equal at every position the running sequences computed
            live = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                 for seq in graphed.scheduler.running for blocks in [seq.block_table]
                                 for p in range(seq.num_computed_tokens)], dtype=torch.long)
            want, got = ([None if t is None else t.reshape(t.shape[0] * BLOCK_SIZE, -1)[live] for t in pair]
                         for pair in (want, got))  # [slots, bytes a slot] (exact layouts)
        for a, b in zip(want, got):
            assert (a is None and b is None) or torch.allclose(a, b, atol=1e-5)


def _run_in_lockstep(eager: LLM, graphed: LLM, waves: list[list[tuple[list[int], int]]],
                     temperature: float | str, ahead: bool = False) -> list:
    """Step both engines together, adding wave i of (prompt, max_tokens) requests after 3 i steps
    (every other one seeded; temperature "mixed": greedy, top-k + top-p and min-p requests in turn);
    after every step they emitted the same tokens and hold the same state. -> the graphed engine's
    RequestOutputs."""
    mixed = [dict(temperature=0.0), dict(temperature=0.9, top_k=20, top_p=0.9), dict(temperature=1.2, min_p=0.05)]
    outputs, step = [], 0
    while waves or eager.has_unfinished():
        if waves and step % 3 == 0:
            for prompt, max_tokens in waves.pop(0):
                seed = len(outputs) if len(outputs) % 2 else None
                how = mixed[len(outputs) % 3] if temperature == "mixed" else dict(temperature=temperature)
                params = SamplingParams(**how, max_tokens=max_tokens, ignore_eos=True, seed=seed)
                eager.add_request(prompt, params, request_id=str(len(outputs)))
                graphed.add_request(prompt, params, request_id=str(len(outputs)))
                outputs.append(graphed.requests[str(len(outputs))].output)
        got = [(d.request_id, d.token_ids) for d in graphed.step()]
        assert got == [(d.request_id, d.token_ids) for d in eager.step()], f"step {step}"
        _same_state(eager, graphed, ahead)
        step += 1
    assert not graphed.has_unfinished()
    return outputs


@pytest.mark.parametrize("case", [
    ("good", "kvshare", 0.0),
    ("good", "baseline", 0.0),
    ("noise", "baseline", 0.0),  # nearly every draft rejected: rollbacks
    ("good", "kvshare", 0.8),  # sampled drafts: the loop graph samples from the requests' streams
    ("good", "baseline", 0.8),
    ("good", "kvshare", "mixed"),  # greedy and truncated sampling in one batch: other loop graphs
], ids=["good-kvshare", "good-baseline", "noise-baseline", "sampled-kvshare", "sampled-baseline", "mixed-kvshare"])
def test_graphed_steps_equal_eager_steps(case, noise_drafter, good_drafter):
    """Verify and draft steps replayed from graphs (EagerCapture: the same code path as CUDA graphs,
    buckets, static buffers and padding rows included) emit the eager engine's tokens, draft its
    drafts and write its KV, step by step: batches of 1 to 4 sequences of different lengths, a
    second wave of requests that hits the prefix cache beside running decodes, rejections."""
    which, mode, temperature = case
    shared = _prompts([140], seed=5)[0]  # two full blocks: a speculative engine reuses the first
    first, second = _prompts([5, 40], seed=7), _prompts([3, 50], seed=8)
    # the long ones end first: later steps fall to smaller key buckets
    waves = [[(shared + [1], 5), (first[0], 6), (first[1], 12)],
             [(shared + [2, 3], 4), (second[0], 9), (second[1], 10)]]
    engines = [LLM(good_drafter if which == "good" else noise_drafter, device="cpu", num_speculative_tokens=GAMMA,
                   mtp_mode=mode, max_num_seqs=4, num_blocks=32) for _ in range(2)]
    eager, graphed = engines[0], _graphed(engines[1])
    eager_loops = []  # the graphed engine drafts from graphs after prefills too (their MTP KV eager)
    graphed.spec._draft = lambda *args: eager_loops.append(args)
    outputs = _run_in_lockstep(eager, graphed, waves, temperature)
    assert not eager_loops

    assert graphed.stats.spec_decode == eager.stats.spec_decode and eager.stats.spec_decode.num_drafts > 0
    assert outputs[3].num_cached_tokens == BLOCK_SIZE
    keys = graphed.runner.graphs.graphs
    verify = [k for k in keys if k[0] == "verify"]
    assert len({bs for _, bs, _ in verify}) >= 2 and len({n for _, _, n in verify}) >= 2, sorted(keys, key=str)
    # prefills (and the second wave's beside running decodes and their drafts) as ragged rows
    assert any(k[0] == "mixed-hidden" for k in keys), sorted(keys, key=str)
    drafts = {k[3] for k in keys if k[0] == "draft"}
    # the acceptance after a graphed verify as one graph (AcceptGraphs): greedy, or sampled
    accepts = {k[3] if isinstance(k[3], str) else k[3][0] for k in keys if k[0] == "accept"}
    assert accepts == ({"greedy"} if temperature == 0 else {"sampled"}), sorted(keys, key=str)
    if temperature == 0:
        assert "loop" in drafts, sorted(keys, key=str)
    elif temperature == "mixed":
        assert any(isinstance(d, tuple) and d[0] == "sampled" and d[1] and d[2] for d in drafts), sorted(keys, key=str)
    else:
        assert ("sampled", False, False, False, False) in drafts, sorted(keys, key=str)
    assert graphed.runner.graphs.capture.num_replays > 0
    assert graphed.block_manager.num_used_blocks == 0
    # KVShare drafts after a graphed verify run before its host sync (from the accepted counts on
    # the device); the baseline's draft steps write at positions the host picks: after it
    early = graphed.spec._graphs.early_rounds
    assert early > 0 if mode == "kvshare" else early == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8, "mixed"])
def test_overlapped_steps_equal_the_steps_they_overlap(good_drafter, temperature):
    """async_scheduling with speculative decoding: each graphed step launches the next verify before
    its host sync, where every sequence then stands known on the device alone (its accepted count).
    Step by step it emits the tokens of the engine that does not overlap (greedy, sampled from seeded
    and unseeded streams, truncated sampling), with the same drafts and the same KV at every computed
    position; a launched verify that a new wave of requests finds is dropped, the step scheduled anew."""
    first, second = _prompts([5, 40, 70], seed=7), _prompts([3, 50], seed=8)
    waves = [[(first[0], 60), (first[1], 56), (first[2], 63)], [(second[0], 50), (second[1], 57)]]
    setup = dict(num_speculative_tokens=GAMMA, max_num_seqs=4, num_blocks=32)
    plain = _graphed(LLM(good_drafter, device="cpu", **setup))
    overlapped = _graphed(LLM(good_drafter, device="cpu", async_scheduling=True, **setup))
    _run_in_lockstep(plain, overlapped, waves, temperature, ahead=True)
    assert overlapped.stats.spec_decode == plain.stats.spec_decode and plain.stats.spec_decode.num_drafts > 0
    spec = overlapped.spec
    # most steps: all but prefills, those while the second wave could join, and those near the ends
    taken = spec.overlapped_steps - spec.overlapped_discarded
    assert plain.spec.overlapped_steps == 0 and taken > overlapped.stats.steps / 2
    assert spec.overlapped_discarded >= 1  # the second wave came while a verify was launched
    assert overlapped.stats.steps == plain.stats.steps and overlapped.block_manager.num_used_blocks == 0


def test_an_overlapped_step_goes_on_without_the_sequence_that_ended(good_drafter):
    """A sequence stopped (a stop token inside its accepted run) while the next verify was launched:
    the others take that verify, its rows left in place, and every step still equals the engine that
    does not overlap."""
    prompts = _prompts([5, 40, 70], seed=7)
    setup = dict(num_speculative_tokens=GAMMA, max_num_seqs=4, num_blocks=32)
    free = LLM(good_drafter, device="cpu", **setup).generate(prompts[:1], GREEDY, use_tqdm=False)[0].token_ids
    stop = free[12]  # request 0 stops there, mid-run
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop_token_ids=[stop])] + \
        [SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True, seed=s) for s in (1, 2)]
    plain = _graphed(LLM(good_drafter, device="cpu", **setup))
    overlapped = _graphed(LLM(good_drafter, device="cpu", async_scheduling=True, **setup))
    for llm in (plain, overlapped):
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            llm.add_request(prompt, p, request_id=str(i))
    ended = None
    while plain.has_unfinished():
        got = [(d.request_id, d.token_ids, d.finish_reason) for d in overlapped.step()]
        assert got == [(d.request_id, d.token_ids, d.finish_reason) for d in plain.step()]
        _same_state(plain, overlapped, ahead=True)
        if ended is None and any(r == "0" and f == "stop" for r, _, f in got):
            ended = overlapped.spec.overlapped_steps
    assert not overlapped.has_unfinished() and ended is not None
    spec = overlapped.spec
    assert spec.overlapped_discarded == 0 and spec.overlapped_steps > ended  # the others went on overlapped


def test_an_acceptance_graph_that_cannot_be_captured_falls_back_to_the_eager_acceptance(good_drafter, monkeypatch,
                                                                                        caplog):
    from megactx.engine.spec_graphs import AcceptGraphs

    def refuse(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(AcceptGraphs, "_build", refuse)
    prompts = _prompts([5, 40])
    want = LLM(good_drafter, device="cpu", num_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    llm = _graphed(_spec(good_drafter))
    with caplog.at_level("WARNING", logger="megactx"):
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.spec._accepts.failed and "accepting eagerly from now on" in caplog.text
    assert not any(k[0] == "accept" for k in llm.runner.graphs.graphs)


def test_graphed_steps_equal_eager_steps_under_preemption(good_drafter):
    """As above with too few blocks and a small token budget: chunked prefills beside graphed
    decodes, a preempted sequence recomputed, then drafting again from graphs."""
    a, b, c, d = _prompts([60, 62, 50, 63], seed=1)
    setup = dict(num_speculative_tokens=GAMMA, mtp_mode="baseline", max_num_seqs=4, num_blocks=5,
                 max_num_batched_tokens=40)
    eager, graphed = LLM(good_drafter, device="cpu", **setup), _graphed(LLM(good_drafter, device="cpu", **setup))
    _run_in_lockstep(eager, graphed, [[(a, 16), (b, 13), (c, 16)], [(d, 16), (a[:40] + [1, 2], 12)]], 0.0)
    assert graphed.stats.spec_decode == eager.stats.spec_decode
    assert graphed.stats.preemptions == eager.stats.preemptions > 0, "the test meant to exercise preemption"


def test_graphed_prefix_hits_and_rollbacks_keep_greedy_output(good_drafter):
    """The graphed speculative engine's greedy tokens are the non-speculative engine's, with the
    KV of the drafts it rejected rolled back (a batch that hits the prefix cache of an earlier one)."""
    shared = _prompts([150], seed=4)[0]
    prompts = [shared + tail for tail in _prompts([7, 20, 1], seed=6)]
    llm = _graphed(_spec(good_drafter))
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [BLOCK_SIZE, BLOCK_SIZE]
    want = LLM(good_drafter, device="cpu", num_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in want]
    stats = llm.stats.spec_decode
    assert stats.mean_acceptance_length > 1.5 and stats.num_accepted_tokens < stats.num_draft_tokens


# ------------------------------------------------------------------------------ stats, metrics, errors
def test_stats_count_drafts_per_position_and_per_request(good_drafter):
    stats = SpecDecodeStats(3)
    for drafted, accepted in [(3, 3), (3, 0), (2, 1)]:
        stats.record(drafted, accepted)
    assert stats.mean_acceptance_length == (4 + 1 + 2) / 3
    assert stats.acceptance_rate_per_position == [2 / 3, 1 / 3, 1 / 2]

    llm = _spec(good_drafter)
    outs = llm.generate(_prompts([30, 40]), GREEDY, use_tqdm=False)
    engine = llm.stats.spec_decode
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(engine, name) == sum(getattr(o.spec_decode, name) for o in outs) > 0
    for o in outs:  # the prefill's token, then accepted drafts + 1 a verify (plain decodes add 1 each)
        assert 1 + o.spec_decode.num_accepted_tokens + o.spec_decode.num_drafts <= len(o.token_ids)


def test_metrics_expose_the_draft_counters(good_drafter):
    from prometheus_client.parser import text_string_to_metric_families

    from megactx.serve.metrics import ServerMetrics

    llm = _spec(good_drafter)
    metrics = ServerMetrics("tiny")
    metrics.watch_spec_decode(llm.stats.spec_decode)
    llm.generate(_prompts([30]), GREEDY, use_tqdm=False)
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    stats = llm.stats.spec_decode
    assert samples[("megactx_spec_decode_num_drafts_total", None)] == stats.num_drafts
    assert samples[("megactx_spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert samples[("megactx_spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    for j in range(GAMMA):
        assert samples[("megactx_spec_decode_num_accepted_tokens_per_pos_total", str(j))] == \
            stats.accepted_per_position[j]
    assert samples[("megactx_spec_decode_mean_acceptance_length", None)] == pytest.approx(
        stats.mean_acceptance_length)


def test_a_speculative_server_serves_the_greedy_tokens_and_its_draft_metrics(good_drafter, capsys):
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from megactx.cli import main as cli_main
    from megactx.serve.api import build_app

    prompt = _prompts([30], seed=8)[0]
    want = LLM(good_drafter, device="cpu", num_blocks=32).generate([prompt], GREEDY, use_tqdm=False)[0]
    with TestClient(build_app(_spec(good_drafter), served_model_name="tiny")) as client:
        # without a tokenizer, logprobs name the tokens by id
        body = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0,
                                                    "max_tokens": GREEDY.max_tokens, "logprobs": 0}).json()
        assert [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]] == want.token_ids
        metrics = {s.name: s.value for family in text_string_to_metric_families(client.get("/metrics").text)
                   for s in family.samples}
    assert metrics["megactx_spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["megactx_spec_decode_mean_acceptance_length"] > 1

    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    assert "--mtp-mode" in (help_text := capsys.readouterr().out) and "--draft-acceptance" in help_text
    assert cli_main(["serve", "--model", "anywhere", "--num-speculative-tokens", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_bad_speculative_settings_are_refused(noise_drafter):
    no_mtp = _model(num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="needs an MTP layer"):
        LLM(no_mtp, device="cpu", num_blocks=8, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 0"):
        LLM(noise_drafter, device="cpu", num_blocks=8, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="mtp_mode must be one of"):
        LLM(noise_drafter, device="cpu", num_blocks=8, num_speculative_tokens=2, mtp_mode="fast")
    with pytest.raises(ValueError, match="draft_acceptance must be one of"):
        LLM(noise_drafter, device="cpu", num_blocks=8, num_speculative_tokens=2, draft_acceptance="greedy")


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("mode", ["kvshare", "baseline"])
def test_triton_speculative_greedy_equals_non_speculative(good_drafter, mode, cuda_graphs):
    """On CUDA through the Triton kernels, fp32 weights and exact caches (so only summation order
    differs): the non-speculative engine's tokens, and the drafter's tokens accepted as on a CPU,
    with the steps run eagerly or replayed from CUDA graphs."""
    prompts = _prompts([5, 100, 70, 3, 64])
    cuda = good_drafter.to("cuda")
    try:
        kwargs = dict(device="cuda", dtype=torch.float32, index_cache_dtype="auto", num_blocks=64, max_num_seqs=8,
                      max_model_len=1024, cuda_graphs=cuda_graphs, warm_up=False)
        want = LLM(cuda, **kwargs).generate(prompts, GREEDY, use_tqdm=False)
        llm = LLM(cuda, num_speculative_tokens=GAMMA, mtp_mode=mode, **kwargs)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        assert llm.stats.spec_decode.mean_acceptance_length > 1.5
    finally:
        good_drafter.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("acceptance", ["rejection", "target-only"])
def test_triton_speculative_sampling_in_bf16_with_an_fp8_indexer_cache(acceptance):
    """The production path (bf16 weights, FP8 indexer cache, Triton kernels) drafts, verifies and
    samples: every request completes, and the bigram drafter's drafts are accepted. The MLA cache
    stays bf16: the tiny latent (64 wide) cannot take the FP8 layout's groups of 128 values."""
    model = _model(BIGRAM_SCALE).cast(torch.bfloat16).to("cuda")  # router and indexer head weights stay fp32
    llm = LLM(model, device="cuda", kv_cache_dtype="bf16", index_cache_dtype="fp8", num_blocks=64, max_num_seqs=8,
              max_model_len=1024,
              num_speculative_tokens=GAMMA, draft_acceptance=acceptance)
    params = [SamplingParams(temperature=t, max_tokens=32, ignore_eos=True, seed=s)
              for t, s in [(0.0, None), (0.3, 1), (0.8, None), (1.0, 2)]]
    outs = llm.generate(_prompts([5, 100, 70, 300]), params, use_tqdm=False)
    assert all(len(o.token_ids) == 32 for o in outs)
    # target-only accepts a greedy draft with probability p(x) only: far fewer at temperature 0.8-1
    assert llm.stats.spec_decode.mean_acceptance_length > (1.3 if acceptance == "rejection" else 1.05)
    assert llm.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    from megactx.testing import make_random_checkpoint

    # fp32 weights; 16 indexer heads keep exact-zero ties out of the top-k (see test_paged.py)
    return make_random_checkpoint(tmp_path_factory.mktemp("random"), dtype=torch.float32, vocab_size=VOCAB,
                                  index_topk=16, index_n_heads=16, max_position_embeddings=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma", [3, 7])
@pytest.mark.parametrize("mode", ["kvshare", "baseline"])
def test_cuda_graphs_replay_the_eager_speculative_steps(random_checkpoint, gamma, mode):
    """Greedy speculative decoding with its verify and draft steps replayed from CUDA graphs emits
    the eager engine's tokens and drafts: fp32 weights and exact caches, so only the summation
    order (and the MoE's dense form under capture) can differ. Batches shrink from 6 sequences
    (bucket 8) to 1 as requests of different lengths finish."""
    kwargs = dict(device="cuda", dtype=torch.float32, index_cache_dtype="auto", num_blocks=64, max_num_seqs=8,
                  max_model_len=1024, num_speculative_tokens=gamma, mtp_mode=mode, warm_up=False)
    eager = LLM(random_checkpoint, cuda_graphs=False, **kwargs)
    assert eager.runner.graphs is None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, eager.cfg.vocab_size - 1, (n,), generator=g).tolist() for n in (5, 100, 70, 3, 64, 130)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 16, 20, 9, 24, 12)]
    want = eager.generate(prompts, params, use_tqdm=False)
    graphed = LLM(random_checkpoint, cuda_graphs=True, **kwargs)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert graphed.stats.spec_decode == eager.stats.spec_decode and eager.stats.spec_decode.num_drafts > 0
    keys = graphed.runner.graphs.graphs
    assert len({bs for kind, bs, *_ in keys if kind == "verify"}) >= 2, sorted(keys, key=str)
    assert any(k[0] == "draft" and k[3] == "loop" for k in keys), sorted(keys, key=str)
    assert any(k[0] == "accept" and k[3] == "greedy" for k in keys), sorted(keys, key=str)
    assert graphed.block_manager.num_used_blocks == 0
    early = graphed.spec._graphs.early_rounds  # KVShare drafts launched before the verify's host sync
    assert early > 0 if mode == "kvshare" else early == 0
    # overlapped: each verify launched before the host sync of the step before (KVShare; the baseline's
    # drafts wait for the host, so its steps are not overlapped)
    overlapped = LLM(random_checkpoint, cuda_graphs=True, async_scheduling=True, **kwargs)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert overlapped.stats.spec_decode == eager.stats.spec_decode
    taken = overlapped.spec.overlapped_steps - overlapped.spec.overlapped_discarded
    if mode == "baseline":
        assert overlapped.spec.overlapped_steps == 0
    elif gamma == 3:  # (at γ = 7 these requests seldom leave room for two more verifies)
        assert taken > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["kvshare", "baseline"])
def test_cuda_graphs_replay_sampled_drafts_in_one_graph(good_drafter, mode):
    """Sampled drafts run the whole draft loop, sampling included, as one CUDA graph (the noise read
    from the requests' random streams): seeded requests draw the eager engine's tokens (fp32, exact
    caches), drafts accepted in runs."""
    cuda = good_drafter.to("cuda")
    try:
        kwargs = dict(device="cuda", dtype=torch.float32, index_cache_dtype="auto", num_blocks=64, max_num_seqs=8,
                      max_model_len=1024, num_speculative_tokens=GAMMA, mtp_mode=mode, warm_up=False)
        params = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=s) for s in range(4)]
        prompts = _prompts([5, 100, 70, 33])
        eager = LLM(cuda, cuda_graphs=False, **kwargs)
        want = eager.generate(prompts, params, use_tqdm=False)
        graphed = LLM(cuda, cuda_graphs=True, **kwargs)
        got = graphed.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert graphed.stats.spec_decode == eager.stats.spec_decode
        assert graphed.stats.spec_decode.mean_acceptance_length > 1.3
        loops = {k[3] for k in graphed.runner.graphs.graphs if k[0] == "draft"}
        assert ("sampled", False, False, False, False) in loops, loops
        accepts = {k[3] for k in graphed.runner.graphs.graphs if k[0] == "accept"}
        assert ("sampled", False, False, False, False, True) in accepts, accepts
        assert (graphed.spec._graphs.early_rounds > 0) == (mode == "kvshare")
        overlapped = LLM(cuda, cuda_graphs=True, async_scheduling=True, **kwargs)
        got = overlapped.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert (overlapped.spec.overlapped_steps > overlapped.spec.overlapped_discarded) == (mode == "kvshare")
    finally:
        good_drafter.to("cpu")
