"""Scheduler: decode first, chunked prefill under a token budget, FCFS admission, preemption by
recompute. Driven by a fake model that stores token ids in a shadow paged KV cache and samples from
what it reads back, so a lost, reordered or corrupted token changes the generated text."""

import random

import pytest

from megactx.engine.block_manager import BlockManager
from megactx.engine.sampling_params import SamplingParams
from megactx.engine.scheduler import Scheduler, SchedulerConfig
from megactx.engine.sequence import Sequence, SequenceStatus
from megactx.kernels.reference import BLOCK_SIZE

BS = BLOCK_SIZE
VOCAB = 997
MAX_STEPS = 5000


def next_token(context):
    """The fake model's "sampling": a deterministic function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % VOCAB


class FakeModel:
    """Writes the token id of every computed position into its slot, and samples next_token() of the
    context read back from the slots (never from seq.token_ids)."""

    def __init__(self, block_manager):
        self.bm = block_manager
        self.kv = {}  # slot -> token id

    def step(self, output):
        sampled = {}
        for item in output.scheduled:
            seq = item.seq
            for slot, pos in zip(self.bm.slots(seq, item.start, item.end), range(item.start, item.end)):
                self.kv[slot] = seq.token_ids[pos]
            if item.samples:
                sampled[seq.seq_id] = next_token([self.kv[s] for s in self.bm.slots(seq, 0, item.end)])
        return sampled


def make_scheduler(num_blocks, block_size=BS, prefix_caching=True, **config):
    config.setdefault("max_model_len", 4096)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(**config), bm)


def seq_of(seq_id, prompt, max_tokens, request_id=None):
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens), request_id=request_id)


def step(sched, model):
    """One engine step: schedule, run, record, finish. Checks the step's contract on the way."""
    cfg, bm = sched.config, sched.block_manager
    was_running = {id(s) for s in sched.running}
    out = sched.schedule()
    assert not out.is_empty, "unfinished work but nothing scheduled"
    assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) == len({id(s.seq) for s in out.scheduled}) <= cfg.max_num_seqs
    assert sched.num_running <= cfg.max_num_seqs
    if out.preempted:  # a step that had to preempt admits no one
        assert all(id(s.seq) in was_running for s in out.scheduled)
    for victim in out.preempted:  # only the youngest are preempted
        assert all(r.arrival < victim.arrival for r in sched.running)
        assert victim.block_table == [] and victim.status is SequenceStatus.WAITING
    waiting = [s.arrival for s in sched.waiting]
    assert waiting == sorted(waiting), "the waiting queue is in arrival order (preempted ones in front)"
    for item in out.scheduled:
        assert item.start == item.seq.num_computed_tokens and item.num_tokens >= 1
        assert item.seq.num_blocks * bm.block_size >= item.end  # slots exist for every position
    sched.postprocess(out, model.step(out))
    for item in out.scheduled:
        seq = item.seq
        if item.samples and (
            seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= cfg.max_model_len
        ):
            sched.finish(seq)
    bm.check_invariants(sched.running)
    return out


def run_to_completion(sched, seqs):
    model = FakeModel(sched.block_manager)
    for seq in seqs:
        sched.add(seq)
    steps = []
    while sched.has_unfinished():
        steps.append(step(sched, model))
        assert len(steps) < MAX_STEPS
    assert sched.block_manager.num_used_blocks == 0
    return steps


def random_requests(seed, n, shared_prefix_len=0, prompt_len=(1, 200), max_tokens=(1, 60)):
    """(prompt, max_tokens) pairs: a common prefix + random tokens; lengths drawn from [lo, hi)."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(shared_prefix_len)]
    return [
        (shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(*prompt_len))], rng.randrange(*max_tokens))
        for _ in range(n)
    ]


def expected_output(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


# ------------------------------------------------------------------------------ config and add()
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=64, max_num_seqs=0), "max_num_seqs"),
        (dict(max_model_len=64, max_num_seqs=16, max_num_batched_tokens=8), "max_num_batched_tokens"),
        (dict(max_model_len=1024, max_num_batched_tokens=512, chunked_prefill=False), "chunked_prefill"),
    ],
)
def test_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_too_long_prompts_and_requests_are_refused_at_add():
    sched = make_scheduler(3, max_model_len=200)
    with pytest.raises(ValueError, match="prompt has 201 tokens.*200"):
        sched.add(seq_of(0, [1] * 201, 1))
    # 150 prompt + 100 outputs, capped at max_model_len: KV for 200 positions, 4 blocks; the cache has 3
    with pytest.raises(ValueError, match="4 blocks; the cache has 3 blocks"):
        sched.add(seq_of(1, [1] * 150, 100))
    assert not sched.has_unfinished()
    ok = seq_of(2, [1] * 150, 40)  # KV for at most 189 positions: 3 blocks
    sched.add(ok)
    with pytest.raises(ValueError, match="already added"):
        sched.add(ok)
    assert (sched.num_waiting, sched.num_running) == (1, 0)


# ------------------------------------------------------------------------------ step composition
@pytest.mark.parametrize(
    "with_decode, budget, chunks",
    [
        (False, 256, [256, 256, 256, 232]),
        (True, 257, [256, 256, 256, 232]),  # the decode takes 1 token of each step's budget
        (True, 256, [255, 255, 255, 235]),
    ],
)
def test_a_long_prompt_is_prefilled_in_chunks_interleaved_with_decodes(with_decode, budget, chunks):
    sched = make_scheduler(64, max_num_batched_tokens=budget, max_num_seqs=8)
    model = FakeModel(sched.block_manager)
    talker = seq_of(0, list(range(10)), 100)
    if with_decode:
        sched.add(talker)
        step(sched, model)  # its prefill; it decodes from now on
    long = seq_of(1, [7] * 1000, 1)
    sched.add(long)
    got, starts, samples = [], [], []
    while not long.is_finished:
        talker_tokens = talker.num_tokens
        out = step(sched, model)
        if with_decode:  # decode first, one token, every step
            first = out.scheduled[0]
            assert (first.seq, first.start, first.num_tokens, first.samples) == (talker, talker_tokens - 1, 1, True)
        (item,) = [s for s in out.scheduled if s.seq is long]
        got.append(item.num_tokens)
        starts.append(item.start)
        samples.append(item.samples)
    assert got == chunks
    assert starts == [sum(chunks[:i]) for i in range(len(chunks))]
    assert samples == [False] * (len(chunks) - 1) + [True]
    assert long.output_token_ids == expected_output([7] * 1000, 1)


def test_budget_and_max_num_seqs_are_respected_under_load():
    sched = make_scheduler(80, max_num_batched_tokens=96, max_num_seqs=5)
    requests = random_requests(seed=1, n=20)
    seqs = [seq_of(i, p, m) for i, (p, m) in enumerate(requests)]
    steps = run_to_completion(sched, seqs)  # step() checks budget and batch size every step
    assert max(s.num_batched_tokens for s in steps) == 96  # the budget is used, not just respected
    assert max(len(s.scheduled) for s in steps) == 5
    for seq, (prompt, max_tokens) in zip(seqs, requests):
        assert seq.output_token_ids == expected_output(prompt, max_tokens)


def test_admission_is_first_come_first_served():
    sched = make_scheduler(64, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [seq_of(i, [i + 1] * (10 + 7 * i), 3 + i) for i in range(6)]
    admitted = []
    model = FakeModel(sched.block_manager)
    for seq in seqs:
        sched.add(seq)
    while sched.has_unfinished():
        for item in step(sched, model).scheduled:
            if item.seq not in admitted:
                admitted.append(item.seq)
    assert admitted == seqs


def test_the_queue_head_is_not_overtaken_when_it_does_not_fit():
    sched = make_scheduler(4, max_num_batched_tokens=512)
    model = FakeModel(sched.block_manager)
    holder = seq_of(0, [1] * (2 * BS), 10)  # 3 blocks of KV at most
    big = seq_of(1, [2] * (3 * BS), 2)  # 3 blocks: does not fit next to holder
    small = seq_of(2, [3] * 5, 2)  # 1 block: would fit, but arrived after big
    sched.add(holder)
    step(sched, model)
    sched.add(big)
    sched.add(small)
    while not holder.is_finished:
        out = step(sched, model)
        assert {s.seq for s in out.scheduled} == {holder}
        assert list(sched.waiting) == [big, small]
    out = step(sched, model)
    assert [s.seq for s in out.scheduled] == [big, small]  # the pool frees up: big first
    assert not sched.waiting


def test_without_chunked_prefill_prompts_are_admitted_whole():
    sched = make_scheduler(64, max_num_batched_tokens=512, max_model_len=512, chunked_prefill=False)
    model = FakeModel(sched.block_manager)
    a, b = seq_of(0, [1] * 300, 4), seq_of(1, [2] * 300, 4)
    sched.add(a)
    sched.add(b)
    out = step(sched, model)
    assert [(s.seq, s.num_tokens, s.samples) for s in out.scheduled] == [(a, 300, True)]
    out = step(sched, model)
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 300)]


def test_a_shared_prompt_prefix_is_computed_once():
    sched = make_scheduler(64, max_num_batched_tokens=1024)
    model = FakeModel(sched.block_manager)
    shared = list(range(3 * BS))
    a, b = seq_of(0, shared + [5] * 8, 4), seq_of(1, shared + [6] * 20, 4)
    sched.add(a)
    step(sched, model)  # a's prefill registers its 3 full blocks
    sched.add(b)
    out = step(sched, model)
    (item,) = [s for s in out.scheduled if s.seq is b]
    assert (item.start, item.num_tokens) == (3 * BS, 20)
    assert b.num_cached_tokens == 3 * BS and b.block_table[:3] == a.block_table[:3]
    while sched.has_unfinished():
        step(sched, model)
    assert a.output_token_ids == expected_output(a.token_ids[: a.num_prompt_tokens], 4)
    assert b.output_token_ids == expected_output(b.token_ids[: b.num_prompt_tokens], 4)


# ------------------------------------------------------------------------------ preemption
def test_the_youngest_running_sequence_is_preempted_when_blocks_run_out():
    bs = 4
    sched = make_scheduler(4, block_size=bs, max_num_batched_tokens=64, max_num_seqs=4)
    model = FakeModel(sched.block_manager)
    old, young = seq_of(0, [1, 2, 3], 8), seq_of(1, [4, 5, 6], 8)
    sched.add(old)
    sched.add(young)
    preempted_at = None
    while preempted_at is None:
        out = step(sched, model)
        if out.preempted:
            preempted_at = old.num_tokens
    # both grew to 2 blocks each; old needed a third for position 8 and took it from young
    assert out.preempted == [young] and [s.seq for s in out.scheduled] == [old]
    assert preempted_at == 2 * bs + 2
    assert list(sched.waiting) == [young] and young.num_computed_tokens == 0 and young.num_preemptions == 1
    assert young.num_tokens == 2 * bs + 1  # its generated tokens are kept for recomputation
    while sched.has_unfinished():
        step(sched, model)
    assert old.output_token_ids == expected_output([1, 2, 3], 8)
    assert young.output_token_ids == expected_output([4, 5, 6], 8)


@pytest.mark.parametrize(
    "block_size, prefix_caching, chunked",
    [(BS, True, True), (BS, False, True), (8, True, True), (8, False, False), (4, True, True)],
)
def test_preempted_sequences_complete_with_the_same_tokens_as_without_preemption(block_size, prefix_caching, chunked):
    # short prompts, long outputs: decodes keep asking for blocks
    requests = random_requests(seed=block_size, n=10, shared_prefix_len=70, prompt_len=(1, 60), max_tokens=(20, 120))
    max_kv = max(len(p) + m - 1 for p, m in requests)
    tiny = -(-max_kv // block_size) + 1  # fits the largest request alone, barely anything else

    def outputs(num_blocks):
        sched = make_scheduler(
            num_blocks,
            block_size,
            prefix_caching,
            max_num_seqs=6,
            max_num_batched_tokens=512,
            max_model_len=512,
            chunked_prefill=chunked,
        )
        seqs = [seq_of(i, p, m) for i, (p, m) in enumerate(requests)]
        run_to_completion(sched, seqs)
        return [s.output_token_ids for s in seqs], sched.num_preemptions

    big, big_preemptions = outputs(num_blocks=10 * tiny)
    small, small_preemptions = outputs(num_blocks=tiny)
    assert big_preemptions == 0 and small_preemptions > 0
    assert small == big == [expected_output(p, m) for p, m in requests]


# ------------------------------------------------------------------------------ abort / finish
def test_abort_frees_blocks_of_running_and_waiting_sequences():
    sched = make_scheduler(16, max_num_seqs=2, max_num_batched_tokens=256)
    model = FakeModel(sched.block_manager)
    seqs = [seq_of(0, [1] * 100, 50, "r0"), seq_of(1, [2] * 70, 50, "r1"), seq_of(2, [3] * 30, 50, "r1")]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    sampled = model.step(out)
    used = sched.block_manager.num_used_blocks
    aborted = sched.abort("r1")  # one running, one waiting; e.g. the client went away mid-step
    assert aborted == seqs[1:] and all(s.is_finished and s.block_table == [] for s in aborted)
    assert sched.block_manager.num_used_blocks == used - 2
    assert (sched.num_running, sched.num_waiting) == (1, 0)
    sched.postprocess(out, sampled)  # the aborted sequence's result is dropped
    assert seqs[1].num_tokens == 70 and seqs[0].num_tokens == 101
    assert sched.abort("unknown") == []
    sched.abort("r0")
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16
    sched.block_manager.check_invariants([])


def test_postprocess_needs_a_token_for_every_sampling_chunk():
    sched = make_scheduler(4)
    sched.add(seq_of(0, [1, 2, 3], 2))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no token"):
        sched.postprocess(out, {})


def test_a_sequence_its_last_token_ends_is_not_scheduled_again():
    """With overlapped steps the engine learns a sequence ended one step late; by count (max_tokens,
    max_model_len) the scheduler knows at once and gives it no position past its end."""
    sched = make_scheduler(8, max_model_len=2 * BS)
    done, long, live = seq_of(0, [1, 2, 3], 2), seq_of(1, list(range(2 * BS - 2)), 10), seq_of(2, [4, 5], 9)
    for seq in (done, long, live):
        sched.add(seq)
    for _ in range(2):  # the prompts, then one decode each
        out = sched.schedule()
        sched.postprocess(out, {item.seq.seq_id: 7 for item in out.scheduled if item.samples})
    assert done.num_output_tokens == 2 and long.num_tokens == 2 * BS  # max_tokens; max_model_len
    out = sched.schedule()
    assert [item.seq for item in out.scheduled] == [live]
