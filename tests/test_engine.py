"""The engine (`LLM`) on a CPU with the torch backend (also on a GPU machine): greedy output equals
step-by-step greedy decoding with the reference model — with chunked prefill, preemption and
prefix-cache hits — and sampling, stopping, logprobs, streaming and aborts behave as documented."""

from __future__ import annotations

import random
import re

import pytest
import torch

from megactx import LLM, ModelConfig, SamplingParams
from megactx.engine.model_runner import DeviceTokens, EagerCapture, StaticBatch, StepGraphs
from megactx.model import build_model

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    # 16 indexer heads keep exact-zero ties out of the top-k of a random model (see test_paged.py)
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=VOCAB, index_topk=16, index_n_heads=16,
                                                      max_position_embeddings=1024, eos_token_id=[VOCAB - 1])
    return build_model(cfg, seed=3)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE trained on a little of the standard library, with a chat template."""
    import inspect
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"])
    tok.train_from_iterator([inspect.getsource(json), inspect.getsource(inspect)], trainer)
    directory = tmp_path_factory.mktemp("tok")
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|end|>"}))
    return directory


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_the_progress_bar_says_how_far_the_prompts_are(model, capsys, monkeypatch):
    """generate()'s bar counts requests; its postfix, the prompt tokens in the cache (of all) and the
    output tokens, is what a long prompt's wait shows: here updated every step, ending complete."""
    import megactx.engine.llm as llm_module

    monkeypatch.setattr(llm_module._Progress, "PERIOD_S", 0.0)
    prompts = _prompts([130, 20])
    llm = LLM(model, device="cpu", num_blocks=32, max_num_seqs=4, max_num_batched_tokens=48)
    llm.generate(prompts, GREEDY, use_tqdm=True)
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "prompt" in line]
    assert any("prompt 48/150 tok" in line for line in lines)  # the first chunk, mid-prompt
    assert "prompt 150/150 tok" in lines[-1] and f"output {2 * GREEDY.max_tokens} tok" in lines[-1]


def test_a_streamed_long_prompt_shows_its_prefill_until_the_text_starts(model, capsys, monkeypatch):
    import megactx.engine.llm as llm_module

    monkeypatch.setattr(llm_module._Progress, "PERIOD_S", 0.0)
    prompt = _prompts([130])[0]
    llm = LLM(model, device="cpu", num_blocks=32, max_num_seqs=4, max_num_batched_tokens=48)
    tokens = [t for delta in llm.stream(prompt, GREEDY, prefill_progress=True) for t in delta.token_ids]
    assert tokens == _greedy(model, prompt, GREEDY.max_tokens)
    frames = re.findall(r"prefill:.*?(\d+)/130", capsys.readouterr().err)
    assert any(0 < int(n) < 130 for n in frames), frames  # a chunk's count, before the first token


@pytest.mark.parametrize("setup", [
    dict(),  # plenty of room
    dict(max_num_batched_tokens=48),  # every prompt prefilled in chunks beside other decodes
    dict(max_num_batched_tokens=48, num_blocks=5),  # and too few blocks: preemption + recompute
    dict(chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256),
    dict(async_scheduling=True),  # each step overlapped with the next: input tokens from the device
    dict(max_num_batched_tokens=48, num_blocks=5, async_scheduling=True),
], ids=["plain", "chunked", "preempting", "unchunked", "overlapped", "overlapped-preempting"])
def test_greedy_equals_the_reference(model, setup):
    # prompts just short of a block edge, so decoding needs new blocks
    prompts = _prompts([5, 100, 70, 130, 3, 64] if "num_blocks" not in setup else [60, 62, 50, 63, 40, 58])
    llm = LLM(model, device="cpu", max_num_seqs=4, **({"num_blocks": 32} | setup))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _greedy(model, prompt, GREEDY.max_tokens)
        assert out.outputs[0].finish_reason == "length"
    if "num_blocks" in setup:
        assert llm.stats.preemptions > 0, "the test meant to exercise preemption"
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.usefixtures("one_torch_thread")
def test_overlapped_steps_give_the_synchronous_engines_outputs(model, tokenizer_dir):
    """async_scheduling (a step's tokens reach the host while the next step runs, which reads them
    from the device; a sequence a token ends computes one token more, dropped) against the engine
    that waits every step: the same tokens, text, finish reasons and logprobs, for every sampling
    option, with chunked prefill, preemption, a prefix shared across requests, n > 1 and an abort."""
    shared = _prompts([64], seed=3)[0]  # one block: a prefix-cache hit for the later requests
    prompts = [shared + p for p in _prompts([60, 62, 58, 63, 61, 55, 59], seed=4)]  # a block edge near
    free = _greedy(model, prompts[2], 12)
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, max_tokens=11, seed=5, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[4]]),  # ends mid-run
        SamplingParams(temperature=0.7, top_k=20, max_tokens=7, seed=6, repetition_penalty=1.3,
                       frequency_penalty=0.5, min_tokens=3),  # penalties read the outputs on the host
        SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, stop=["e"], ignore_eos=True),
    ]
    results = {}
    for overlap in (False, True):
        llm = LLM(model, device="cpu", tokenizer=tokenizer_dir, max_num_seqs=4, num_blocks=7,
                  max_num_batched_tokens=40, async_scheduling=overlap)
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        results[overlap] = [llm.requests[i].output for i in ids]
        victim = llm.add_request(prompts[0], SamplingParams(max_tokens=30, ignore_eos=True))
        steps = 0
        while llm.has_unfinished():
            llm.step()
            steps += 1
            if steps == 12:
                llm.abort(victim)
        assert all(o.finished for o in results[overlap]) and not llm.requests
        assert llm.block_manager.num_used_blocks == 0 and llm.stats.preemptions > 0
    for sync, overlapped in zip(results[False], results[True]):
        for a, b in zip(sync.outputs, overlapped.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:
                for x, y in zip(a.logprobs, b.logprobs, strict=True):  # batches differ: summation order
                    assert x.token_id == y.token_id and list(x.top) == list(y.top)
                    assert max(abs(u - v) for u, v in zip(x.top.values(), y.top.values())) < 1e-4
    assert results[True][2].outputs[0].finish_reason == "stop" and results[True][2].token_ids[-1] == free[4]


def test_prefix_cache_hits_keep_greedy_output(model):
    shared = _prompts([150])[0]
    prompts = [shared + tail for tail in _prompts([7, 20, 1], seed=1)]
    llm = LLM(model, device="cpu", num_blocks=40)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [128, 128]  # two full blocks of the shared prefix
    for prompt, out in zip(prompts, first + rest):
        assert out.token_ids == _greedy(model, prompt, GREEDY.max_tokens)


def test_seeded_sampling_is_reproducible_alone_and_batched(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt, *rest = _prompts([20, 33, 9])
    alone = LLM(model, device="cpu", num_blocks=16).generate([prompt], params, use_tqdm=False)[0].token_ids
    batched = LLM(model, device="cpu", num_blocks=16).generate([*rest, prompt], [others, others, params],
                                                               use_tqdm=False)
    assert batched[-1].token_ids == alone
    other_seed = LLM(model, device="cpu", num_blocks=16).generate([prompt], SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=12, seed=124, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert other_seed != alone


def test_n_completions_differ_and_each_is_complete(model):
    outs = LLM(model, device="cpu", num_blocks=16).generate(_prompts([10]), SamplingParams(
        n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True), use_tqdm=False)
    completions = outs[0].outputs
    assert len(completions) == 3 and all(len(c.token_ids) == 8 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1


def test_stop_token_ids_and_eos_end_the_request(model):
    prompt = _prompts([12])[0]
    free = _greedy(model, prompt, 10)
    llm = LLM(model, device="cpu", num_blocks=16)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[free[3]]),
                       use_tqdm=False)[0]
    assert out.token_ids == free[: free.index(free[3]) + 1] and out.outputs[0].finish_reason == "stop"


@pytest.mark.usefixtures("one_torch_thread")
def test_fused_projections_compute_the_same_with_fewer_gemms(model):
    import copy

    from megactx.model.attention import MLA
    from megactx.model.moe import MLP

    fused = copy.deepcopy(model)
    assert fused.fuse_projections() > 0
    # the weights are views of the fused ones: the same parameters by name, the same values
    assert all(torch.equal(p, fused.state_dict()[name]) for name, p in model.state_dict().items())
    attn = fused.model.layers[0].self_attn
    assert attn.q_a_proj.weight.data_ptr() == attn.x_proj.data_ptr()
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=4)
    prompt = _prompts([40])[0]

    def run(m):
        llm = LLM(m, device="cpu", num_blocks=16)
        with torch.profiler.profile() as prof:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
        return out, sum(e.name == "aten::linear" for e in prof.events())

    (plain, plain_gemms), (out, gemms) = run(model), run(fused)
    assert out.token_ids == plain.token_ids
    for a, b in zip(out.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert abs(a.logprob - b.logprob) < 1e-5 and list(a.top) == list(b.top)
    # three forwards of the backbone (the prefill, two decodes), each short of what fusing saved there
    saved = sum(m.fuse() for m in fused.model.modules() if isinstance(m, (MLA, MLP)))
    assert plain_gemms - gemms == 3 * saved


def test_logprobs_are_the_reference_log_softmax(model):
    prompt = _prompts([15])[0]
    llm = LLM(model, device="cpu", num_blocks=16)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=4), use_tqdm=False)[0]
    ids = list(prompt)
    for token, lp in zip(out.token_ids, out.outputs[0].logprobs):
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([ids]))[0, -1], -1)
        assert lp.token_id == token and abs(lp.logprob - want[token].item()) < 1e-4
        top = want.topk(4)
        assert list(lp.top) == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top.values(), top.values.tolist())) < 1e-4
        ids.append(token)


def test_text_prompts_stop_strings_and_streaming(model, tokenizer_dir):
    llm = LLM(model, device="cpu", tokenizer=tokenizer_dir, num_blocks=16)
    prompt = "def dumps(obj, *, skipkeys=False):"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert free.text == llm.tokenizer.decode(free.token_ids)
    stop = free.text[5:8]
    assert stop, "the random model produced too little text for this test"
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0]
    assert cut.text == free.text[: free.text.index(stop)] and cut.outputs[0].finish_reason == "stop"
    deltas = list(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True)))
    assert "".join(d.text for d in deltas) == cut.text
    assert deltas[-1].finish_reason == "stop"
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<user>hi\n<assistant>"


def test_stop_strings_of_any_length_anywhere_cut_a_long_completion(model, tokenizer_dir):
    """Stop strings of 1 to 12 characters that start early, late or span tokens cut the text at the
    earliest one; the streamed deltas add up to the text, and none shows a character past the cut."""
    llm = LLM(model, device="cpu", tokenizer=tokenizer_dir, num_blocks=32)
    prompt = "class JSONEncoder(object):"
    greedy = dict(temperature=0, max_tokens=200, ignore_eos=True)
    free = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].text
    assert len(free) > 300, "the random model produced too little text for this test"
    for start, length in [(0, 1), (3, 12), (150, 2), (len(free) - 7, 7), (200, 5)]:
        stops = [free[start : start + length], "\x00never"]
        want = free[: min(free.index(s) for s in stops if s in free)]
        deltas = list(llm.stream(prompt, SamplingParams(**greedy, stop=stops)))
        assert "".join(d.text for d in deltas) == want and deltas[-1].finish_reason == "stop", (start, length)
    out = llm.generate([prompt], SamplingParams(**greedy, stop=[free[250:253]]), use_tqdm=False)[0]
    assert out.text == free[: free.index(free[250:253])]


def test_the_step_log_has_a_line_for_every_step(model, tmp_path, capsys):
    import json

    from megactx.engine import steplog

    path = tmp_path / "steps.jsonl"
    llm = LLM(model, device="cpu", max_num_seqs=4, num_blocks=40, max_num_batched_tokens=48, step_log=path)
    prompts = _prompts([5, 100, 70])
    llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.step_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == llm.stats.steps and all(r["ms"] > 0 and r["graphs"] == 0 for r in lines)
    assert all(0 <= r["wait_ms"] <= r["ms"] for r in lines)  # the host's wait for tokens is part of the step
    # every prompt position and every generated token but the last is computed once
    assert sum(r["tokens"] for r in lines) == sum(len(p) for p in prompts) + len(prompts) * (GREEDY.max_tokens - 1)
    assert all(r["tokens"] <= 48 for r in lines) and lines[0]["prefill"] >= 1 and lines[-1]["prefill"] == 0
    assert [r["t"] for r in lines] == sorted(r["t"] for r in lines)
    # keys: the longest sequence a step computes, at its chunk's end; the last token sampled follows
    # max_tokens - 1 computed ones of the longest prompt
    assert all(1 <= r["keys"] <= 100 + GREEDY.max_tokens - 1 for r in lines)
    assert max(r["keys"] for r in lines) == 100 + GREEDY.max_tokens - 1
    assert 5 <= lines[0]["keys"] <= 48  # the first step: chunks from the prompts' starts, 48 tokens in all
    assert steplog.main([str(path), "--slowest", "3"]) == 0
    summary = capsys.readouterr().out
    assert f"{len(lines)} steps" in summary and "decode only" in summary and "with prefill" in summary
    assert "host p50" in summary and "by the keys a position sees" in summary
    by_keys = steplog.prefill_by_keys(lines)  # (keys up to, steps, p50 ms, p50 ms per 1K tokens)
    assert sum(n for _, n, _, _ in by_keys) == sum(1 for r in lines if r["prefill"])
    assert [b for b, *_ in by_keys] == sorted(b for b, *_ in by_keys) and all(b & (b - 1) == 0 for b, *_ in by_keys)
    assert steplog.main([str(path), "--plot", str(tmp_path / "steps.png")]) == 0
    assert (tmp_path / "steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert steplog.main([str(tmp_path / "missing.jsonl")]) == 2
    from megactx.cli import main  # the same as a subcommand, without runpy's double import of the module

    assert main(["steplog", str(path), "--slowest", "3"]) == 0 and capsys.readouterr().out == summary


def test_abort_frees_the_blocks(model):
    llm = LLM(model, device="cpu", num_blocks=16)
    rid = llm.add_request(_prompts([100])[0], SamplingParams(max_tokens=50))
    llm.step()
    assert llm.block_manager.num_used_blocks > 0
    llm.abort(rid)
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished()


def test_aborting_one_completion_leaves_the_others_running_and_token_id_requests_carry_no_text(model, tokenizer_dir):
    """What the server does with a stop string it found: `abort(request_id, index)` ends that
    completion alone (its blocks freed); the request's other completion goes on to its end, and
    a request added with detokenize=False has no text (stop strings are not applied either)."""
    llm = LLM(model, device="cpu", tokenizer=tokenizer_dir, num_blocks=16)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, stop=["e"])
    rid = llm.add_request(_prompts([100])[0], greedy, detokenize=False)
    request = llm.requests[rid]
    for _ in range(3):
        llm.step()
    used = llm.block_manager.num_used_blocks
    llm.abort(rid, 0)
    assert llm.block_manager.num_used_blocks < used and request.output.outputs[0].finish_reason == "abort"
    while llm.has_unfinished():
        llm.step()
    second = request.output.outputs[1]
    assert second.finish_reason == "length" and len(second.token_ids) == 12 and second.text == ""
    assert llm.block_manager.num_used_blocks == 0 and rid not in llm.requests


def test_bad_requests_are_refused_with_reasons(model):
    llm = LLM(model, device="cpu", num_blocks=16, max_model_len=256)
    with pytest.raises(ValueError, match="context is 256"):
        llm.add_request(list(range(300)))
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.add_request("text without a tokenizer")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        llm.add_request([VOCAB])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.add_request([1, 2, 3], SamplingParams(max_tokens=2000))
    assert not llm.has_unfinished()


def test_without_max_model_len_the_context_shrinks_to_the_cache_and_a_given_one_is_kept_or_refused(model, caplog):
    from megactx.model.paged import cache_bytes_per_token

    block = cache_bytes_per_token(model.cfg, torch.float32, torch.float32) * 64
    llm = LLM(model, device="cpu", max_num_seqs=2, cpu_cache_bytes=10 * block)  # 1024 positions need 16 blocks
    assert llm.max_model_len == 640 and "max_model_len = 640" in caplog.text
    assert LLM(model, device="cpu", max_num_seqs=2, cpu_cache_bytes=10 * block, max_model_len=512).max_model_len == 512
    with pytest.raises(ValueError, match="lower max_model_len"):
        LLM(model, device="cpu", max_num_seqs=2, cpu_cache_bytes=10 * block, max_model_len=1024)


def test_mixed_graphs_cover_the_step_token_budget(model):
    """A step of the whole token budget (a batch of new prompts) replays a graph, up to MAX_ROWS;
    eager beyond that. Row buckets double from MIN_ROWS and end at the budget."""
    for budget, last in ((300, 300), (8192, 8192), (20000, StepGraphs.MAX_ROWS)):
        llm = LLM(model, device="cpu", num_blocks=8, max_num_batched_tokens=budget, warm_up=False)
        graphs = llm.runner.use_graphs(EagerCapture(), min_keys=64)
        assert graphs.row_buckets[0] == StepGraphs.MIN_ROWS and graphs.row_buckets[-1] == last
        assert all(b == 2 * a for a, b in zip(graphs.row_buckets, graphs.row_buckets[1:-1]))


def test_static_batch_ragged_rows_of_prefill_chunks_and_decodes():
    """fill_ragged: each sequence's tokens in consecutive rows with their positions, slots (across
    block edges) and key counts; padding rows after them; sample_rows at the sampling chunks' ends."""
    batch = StaticBatch(max_seqs=4, q=1, max_blocks=4, device=torch.device("cpu"), rows=160)
    # a 70-token chunk from position 60 (blocks 5 -> 2 -> 9), one decode at 10, a 2-token chunk at 0
    batch.fill_ragged([[5, 2, 9], [7], [3]], [60, 10, 0], [list(range(100, 170)), [7], [8, 9]], rows=96, samples=[1, 2])
    view = batch.view(3, 256, rows=96)
    positions = list(range(60, 130)) + [10, 0, 1]
    assert view.positions.tolist() == positions + [0] * 23
    slots = [5 * 64 + p for p in range(60, 64)] + [2 * 64 + p - 64 for p in range(64, 128)] + [9 * 64, 9 * 64 + 1]
    assert view.slots.tolist() == slots + [7 * 64 + 10, 3 * 64, 3 * 64 + 1] + [-1] * 23
    assert view.seq_idx.tolist() == [0] * 70 + [1, 2, 2] + [0] * 23
    assert view.key_len.tolist() == [p + 1 for p in positions] + [0] * 23
    assert batch.input_ids[:73].tolist() == list(range(100, 170)) + [7, 8, 9]
    assert batch.sample_rows.tolist() == [70, 72, 0, 0]


def test_static_batch_rows_past_each_sequence_are_padding():
    """Token i of sequence b sits in row b·q + i; every other row sees no key and writes nothing."""
    batch = StaticBatch(max_seqs=4, q=3, max_blocks=4, device=torch.device("cpu"))
    rows = batch.fill(3, [[5, 2], [7]], [63, 10], [[11, 12, 13], [14]])  # batch bucket 3: sequence 2 is padding
    view = batch.view(3, 128)
    assert rows == [0, 1, 2, 3]
    assert batch.input_ids[:9].tolist() == [11, 12, 13, 14, 0, 0, 0, 0, 0]
    assert view.positions.tolist() == [63, 64, 65, 10, 10, 10, 0, 0, 0]  # position 64 is block 2's first
    assert view.slots.tolist() == [5 * 64 + 63, 2 * 64, 2 * 64 + 1, 7 * 64 + 10, -1, -1, -1, -1, -1]
    assert view.key_len.tolist() == [64, 65, 66, 11, 0, 0, 0, 0, 0]
    assert view.seq_idx.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert view.block_table[:2, :2].tolist() == [[5, 2], [7, 0]] and view.key_len_host.tolist() == [128] * 9
    batch.fill(2, [[3]], [0], [[9]])  # the next step: one sequence of one token
    assert batch.view(2, 64).slots.tolist() == [3 * 64, -1, -1, -1, -1, -1]
    assert set(batch.slots[6:].tolist()) == {-1} and set(batch.key_len[6:].tolist()) == {0}  # past the bucket
    batch.clear()
    assert batch.view(4, 64).key_len.tolist() == [0] * 12 and set(batch.slots.tolist()) == {-1}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_static_batch_shift_moves_sequences_as_a_fill_at_the_later_positions_would(device):
    """An overlapped speculative step fills its verify before the host knows each sequence's accepted
    count, then moves sequence b's rows by[b] positions on the device: positions, key counts and
    slots (across a block edge too) are those of a fill at the later starts; padding rows stay."""
    dev = torch.device(device)
    tables, starts, ids = [[5, 2], [7, 3]], [60, 10], [[1, 2, 3], [4, 5, 6]]
    want = StaticBatch(max_seqs=4, q=3, max_blocks=4, device=dev)
    want.fill(4, tables, [62, 10], ids)
    batch = StaticBatch(max_seqs=4, q=3, max_blocks=4, device=dev)
    batch.fill(4, tables, starts, ids)
    batch.shift(2, torch.tensor([2, 0], device=dev))
    for field in ("positions", "slots", "key_len", "seq_idx", "input_ids"):
        assert torch.equal(getattr(batch, field), getattr(want, field)), field
    assert batch.slots[:3].tolist() == [5 * 64 + 62, 5 * 64 + 63, 2 * 64]  # into the next block


def test_static_batch_puts_device_tokens_in_their_rows_and_sends_block_tables_when_they_change():
    batch = StaticBatch(max_seqs=2, q=3, max_blocks=4, device=torch.device("cpu"))
    # sequence 0: a token then two on the device; sequence 1: a token then one on the device
    tokens = DeviceTokens([1, 2, 4], torch.tensor([21, 22, 23]))
    rows = batch.fill(2, [[5], [7, 8]], [3, 70], [[11, 0, 0], [12, 0]], device_tokens=tokens)
    assert rows == [0, 1, 2, 3, 4] and batch.input_ids.tolist() == [11, 21, 22, 12, 23, 0]
    assert batch.block_table[:2, :2].tolist() == [[5, 0], [7, 8]]
    batch.block_table[1, 0] = 99  # (a marker) the same tables again: no copy
    batch.fill(2, [[5], [7, 8]], [4, 71], [[11], [12]])
    assert batch.block_table[:2, :2].tolist() == [[5, 0], [99, 8]]
    batch.fill(2, [[5], [7, 8, 9]], [4, 128], [[11], [12]])  # sequence 1 took a block
    assert batch.block_table[:2, :3].tolist() == [[5, 0, 0], [7, 8, 9]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("ragged", [False, True])
def test_static_batch_stable_rows_keep_each_sequence_on_its_block_table_row(ragged, device):
    """With stable_rows a sequence keeps its block-table row while it is in every fill (a server's
    oldest request ends first: sequence b = row b would move every other one), whatever joins,
    ends or grows around it; each fill's seq_idx names a row holding that sequence's table (on
    CUDA: rows copied asynchronously from the pinned twin, which the next fill rewrites)."""
    rng = random.Random(0)
    batch = StaticBatch(max_seqs=6, q=1, max_blocks=8, device=torch.device(device), rows=64 if ragged else None,
                        stable_rows=True)
    live: list[list[int]] = []  # each sequence's table: a list that grows in place, as Sequence.block_table
    ended = []  # kept alive, so that no new table takes an ended one's id and the stability check holds
    rows_before: dict[int, int] = {}
    for step in range(60):
        if live and rng.random() < 0.3:
            ended.append(live.pop(rng.randrange(len(live))))  # it ended (the oldest, or any)
        while len(live) < 6 and rng.random() < 0.5:
            live.append([rng.randrange(100) for _ in range(rng.randint(1, 3))])  # it joined
        for table in live:
            if len(table) < 8 and rng.random() < 0.2:
                table.append(rng.randrange(100))  # it took a block
        if not live:
            continue
        starts = [64 * len(t) - 1 for t in live]  # each at the last position of its last block
        if ragged:
            batch.fill_ragged(live, starts, [[1]] * len(live), rows=32, samples=list(range(len(live))))
            seq_idx = batch.seq_idx[: len(live)].tolist()
        else:
            batch.fill(6, live, starts, [[1]] * len(live))
            seq_idx = batch.view(6, 512).seq_idx[: len(live)].tolist()
        assert len(set(seq_idx)) == len(live) and all(0 <= r < 6 for r in seq_idx)
        for table, row in zip(live, seq_idx):
            assert batch.block_table[row, : len(table)].tolist() == table, f"step {step}"
            assert rows_before.get(id(table), row) == row, f"step {step}: a sequence moved to another row"
        rows_before = {id(t): r for t, r in zip(live, seq_idx)}
        assert batch.view(len(live), 512, rows=32 if ragged else None).block_table.shape[0] == 6  # every row


@pytest.mark.gpu
def test_static_batch_block_table_twin_is_not_rewritten_before_its_copy_runs():
    """A fill queues its block-table row copies from the pinned twin without waiting; the next fill
    waits for them before it rewrites the twin, so the step between sees its own tables."""
    batch = StaticBatch(max_seqs=2, q=1, max_blocks=4, device=torch.device("cuda"), stable_rows=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # a kernel that spins for a few hundred ms
    batch.fill(2, [[5]], [0], [[1]])  # a sequence takes row 0: its copy queued behind the spin
    assert not torch.cuda.current_stream().query()  # the fill did not wait for it
    seen = batch.block_table[0, :1].clone()  # what a step queued now reads
    batch.fill(2, [[9]], [0], [[1]])  # it ended and another takes row 0: the twin's row changes
    assert seen.tolist() == [5] and batch.block_table[0, :1].tolist() == [9]


def test_eager_capture_replays_into_the_captured_outputs():
    x = torch.zeros(3)
    graph = EagerCapture().capture(lambda: (x * 2, x + 1))
    doubled, plus_one = graph.outputs
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert doubled.tolist() == [2, 4, 6] and plus_one.tolist() == [2, 3, 4]


@pytest.mark.gpu
def test_a_cuda_graph_keeps_the_tensors_only_its_function_held():
    """A graph reads its inputs at their addresses: an index tensor made for it, held by nothing
    but the captured function, must outlive the capture (an acceptance graph's did not, and its
    replays read whatever memory took the index's: a device-side assert, 2026-12-05)."""
    from megactx.engine.model_runner import CudaGraphCapture

    src = torch.arange(8, device="cuda", dtype=torch.float32)

    def build():
        idx = torch.arange(4, device="cuda").repeat_interleave(2)  # [0, 0, 1, 1, ...]: only the closure holds it
        return lambda: src.index_select(0, idx) * 2

    graph = CudaGraphCapture().capture(build())
    junk = [torch.full((1024,), 10**6, device="cuda", dtype=torch.long) for _ in range(64)]  # takes freed memory
    src.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert graph.outputs.tolist() == [2, 2, 4, 4, 6, 6, 8, 8]
    del junk


@pytest.mark.usefixtures("one_torch_thread")
def test_graphed_decode_equals_eager_decode(model):
    """Decode steps replayed through the graph machinery (EagerCapture on a CPU: batch and key
    buckets, static buffers refilled every step, padding rows) sample the eager engine's tokens
    and write its KV, step by step, greedy and seeded requests alike."""
    prompts = _prompts([5, 100, 70, 3, 40])  # the long ones end first: later steps read fewer keys
    params = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True, seed=s)
              for t, n, s in [(0, 8, None), (0, 3, None), (1.0, 4, 1), (0, 6, None), (1.0, 9, 2)]]
    eager, graphed = (LLM(model, device="cpu", max_num_seqs=4, num_blocks=32) for _ in range(2))
    graphed.runner.use_graphs(EagerCapture(), min_keys=64)
    for llm in (eager, graphed):
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            llm.add_request(prompt, sp, request_id=str(i))
    while eager.has_unfinished():
        assert [(d.request_id, d.token_ids) for d in graphed.step()] == [(d.request_id, d.token_ids)
                                                                          for d in eager.step()]
        for want, got in zip(eager.runner.caches, graphed.runner.caches):
            assert all(a is None or torch.allclose(a, b, atol=1e-5) for a, b in zip(want, got))
    assert not graphed.has_unfinished()
    keys = [k for k in graphed.runner.graphs.graphs if k[0] == "decode"]
    assert len({bs for _, bs, _ in keys}) >= 2 and len({n for _, _, n in keys}) >= 2, keys


@pytest.mark.usefixtures("one_torch_thread")
def test_graphed_mixed_steps_equal_eager_steps(model):
    """Steps with prefill chunks (chunked prompts, arrivals while others decode, a chunk that ends
    mid-prompt) replayed from "mixed" graphs, ragged rows in row buckets: the eager engine's tokens
    and KV, step by step."""
    prompts = _prompts([90, 7, 150, 33, 64, 12])
    params = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True, seed=s)
              for t, n, s in [(0, 6, None), (1.0, 9, 4), (0, 4, None), (0, 7, None), (1.0, 5, 5), (0, 3, None)]]
    eager, graphed = (LLM(model, device="cpu", max_num_seqs=4, num_blocks=40, max_num_batched_tokens=72)
                      for _ in range(2))
    graphed.runner.use_graphs(EagerCapture(), min_keys=64)
    arrivals = {0: [0, 1, 2], 2: [3], 3: [4], 6: [5]}  # step -> requests added before it
    step = 0
    while step == 0 or eager.has_unfinished() or step <= max(arrivals):
        for i in arrivals.get(step, []):
            for llm in (eager, graphed):
                llm.add_request(prompts[i], params[i], request_id=str(i))
        assert [(d.request_id, d.token_ids) for d in graphed.step()] == [(d.request_id, d.token_ids)
                                                                          for d in eager.step()], step
        for want, got in zip(eager.runner.caches, graphed.runner.caches):
            assert all(a is None or torch.allclose(a, b, atol=1e-5) for a, b in zip(want, got))
        step += 1
    assert not graphed.has_unfinished()
    mixed = [k for k in graphed.runner.graphs.graphs if k[0] == "mixed"]
    assert len({rows for _, rows, _ in mixed}) >= 2 and len({keys for _, _, keys in mixed}) >= 2, mixed


@pytest.mark.usefixtures("one_torch_thread")
def test_warm_up_meets_every_bucket_and_leaves_the_engine_as_new(model):
    """warm_up (on by default on CUDA) replays a decode step of every batch bucket and a mixed step
    of every row bucket the token budget reaches; after it the engine holds no request, block,
    prefix-cache entry or count, and generates what an engine that did not warm up generates."""
    # prompts of at most 97 tokens: the 128-row steps take two
    kwargs = dict(device="cpu", max_num_seqs=4, num_blocks=40, max_num_batched_tokens=128, max_model_len=100,
                  warm_up=False)
    cold, warm = LLM(model, **kwargs), LLM(model, **kwargs)
    graphs = warm.runner.use_graphs(EagerCapture(), min_keys=64)
    warm.warm_up()
    assert {bs for kind, bs, _ in graphs.graphs if kind == "decode"} == set(graphs.batch_buckets)
    assert {rows for kind, rows, _ in graphs.graphs if kind == "mixed"} == {32, 64, 128}
    bm = warm.block_manager
    assert not warm.requests and not warm.has_unfinished()
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0
    assert warm.stats.steps == warm.stats.prompt_tokens == warm.stats.generation_tokens == 0
    prompts = _prompts([40, 70, 3, 90])
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=9, seed=2, ignore_eos=True)] * 2
    assert ([o.token_ids for o in warm.generate(prompts, params, use_tqdm=False)]
            == [o.token_ids for o in cold.generate(prompts, params, use_tqdm=False)])


@pytest.mark.usefixtures("one_torch_thread")
def test_speculative_warm_up_captures_the_sampled_draft_loops(model):
    """A speculative engine's warm-up also decodes sampled requests: the sampled draft loop of every
    batch bucket is captured then, not at the first sampled request; the engine is left as new."""
    kwargs = dict(device="cpu", max_num_seqs=4, num_blocks=40, max_num_batched_tokens=64, max_model_len=100,
                  num_speculative_tokens=3, warm_up=False)
    cold, warm = LLM(model, **kwargs), LLM(model, **kwargs)
    graphs = warm.runner.use_graphs(EagerCapture(), min_keys=64)
    warm.warm_up()
    loops = {(bs, which) for kind, bs, _, which in (k for k in graphs.graphs if k[0] == "draft") if which != 0}
    assert {bs for bs, which in loops if which[0] == "sampled"} == set(graphs.batch_buckets), loops
    assert not warm.requests and warm.stats.steps == 0 and warm.stats.spec_decode.num_drafts == 0
    prompts = _prompts([40, 3])
    params = SamplingParams(temperature=1.0, max_tokens=9, seed=5, ignore_eos=True)
    assert ([o.token_ids for o in warm.generate(prompts, params, use_tqdm=False)]
            == [o.token_ids for o in cold.generate(prompts, params, use_tqdm=False)])


@pytest.mark.parametrize("max_model_len,gamma", [(1, 0), (2, 0), (5, 0), (16, 7), (40, 3)])
def test_warm_up_fits_any_context(model, max_model_len, gamma):
    """Contexts too short for the warm-up's usual requests (or for any request) still start."""
    llm = LLM(model, device="cpu", max_num_seqs=4, num_blocks=8, max_num_batched_tokens=64,
              max_model_len=max_model_len, num_speculative_tokens=gamma, warm_up=True)
    assert not llm.requests and llm.block_manager.num_used_blocks == 0 and llm.stats.steps == 0


@pytest.mark.gpu
def test_after_the_warm_up_staggered_arrivals_capture_no_cuda_graph(model):
    """The warm-up captures every graph that traffic within the token budget needs: requests that
    arrive while others decode (steps of many row counts and batch sizes) capture nothing more,
    and the tokens are those of an engine that did not warm up (fp32, exact caches)."""
    prompts = _prompts([5, 100, 70, 3, 64, 130, 300, 17, 250, 1])
    arrivals = {0: [0, 1], 1: [2], 2: [3, 4, 5], 5: [6], 6: [7, 8], 9: [9]}  # step -> requests added before it
    cuda = model.to("cuda")
    try:
        tokens = {}
        for warm in (False, True):
            llm = LLM(cuda, device="cuda", dtype=torch.float32, index_cache_dtype="auto", num_blocks=128,
                      max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=512, warm_up=warm)
            captured = len(llm.runner.graphs.graphs)
            outs, step = {}, 0
            while step <= max(arrivals) or llm.has_unfinished():
                for i in arrivals.get(step, []):
                    outs[i] = llm.requests[llm.add_request(prompts[i], GREEDY)].output
                llm.step()
                step += 1
            tokens[warm] = [outs[i].token_ids for i in range(len(prompts))]
            if warm:
                assert len(llm.runner.graphs.graphs) == captured, "a step shape the warm-up missed"
        assert tokens[True] == tokens[False]
    finally:
        model.to("cpu")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_decode(model):
    """Decode steps replayed from CUDA graphs (several batch and key-count buckets, padded rows)
    give the eager path's logits; fp32 so that only the summation order can differ."""
    prompts = _prompts([5, 100, 70, 3, 64])
    cuda = model.to("cuda")
    try:
        outs = {}
        for graphs in (False, True):
            llm = LLM(cuda, device="cuda", dtype=torch.float32, index_cache_dtype="auto", num_blocks=64,
                      max_num_seqs=8, max_model_len=1024, cuda_graphs=graphs, warm_up=False)
            outs[graphs] = llm.generate(prompts, GREEDY, use_tqdm=False)
            if graphs:
                assert llm.runner.graphs.graphs, "no decode step ran from a graph"
        for eager, replayed in zip(outs[False], outs[True]):
            assert replayed.token_ids == eager.token_ids
    finally:
        model.to("cpu")


def test_the_engine_fuses_the_checkpoints_it_loads_unless_asked_not_to(tmp_path):
    from megactx.testing import make_random_checkpoint

    path = make_random_checkpoint(tmp_path / "ckpt", num_hidden_layers=2, vocab_size=256)
    fused = LLM(path, device="cpu", num_blocks=8).model
    plain = LLM(path, device="cpu", num_blocks=8, fuse=False).model
    assert all(a.x_proj is not None for a in fused.attention_modules())
    assert all(a.x_proj is None for a in plain.attention_modules())
    assert all(torch.equal(p, plain.state_dict()[name]) for name, p in fused.state_dict().items())
