"""BlockManager: ref-counted paged-KV blocks, chained-hash prefix cache, LRU eviction, rollback."""

import random

import pytest

from megactx.engine.block_manager import BlockManager, block_hash
from megactx.engine.sequence import Sequence
from megactx.kernels.reference import BLOCK_SIZE

BS = BLOCK_SIZE


def tokens(n, start=0):
    return list(range(start, start + n))


def prefilled(bm, seq_id, prompt):
    """A sequence admitted and fully prefilled (as the engine would leave it before sampling)."""
    seq = Sequence(seq_id, prompt)
    bm.allocate(seq)
    bm.mark_computed(seq, seq.num_uncomputed_tokens)
    return seq


def test_block_size_is_the_kernels_block_size():
    assert BlockManager(4).block_size == BLOCK_SIZE == 64


def test_allocate_free_round_trip_restores_the_free_count():
    bm = BlockManager(10)
    seq = Sequence(0, tokens(2 * BS + 2))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert seq.num_blocks == 3 and len(set(seq.block_table)) == 3
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (7, 3, 0.3)
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    bm.check_invariants([])


def test_allocate_refuses_when_the_pool_is_too_small():
    bm = BlockManager(2)
    seq = Sequence(0, tokens(2 * BS + 1))
    assert not bm.can_allocate(seq)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(seq)
    assert bm.num_free_blocks == 2


def test_a_shared_prompt_prefix_is_reused_with_the_same_blocks():
    bm = BlockManager(16)
    shared = tokens(2 * BS, start=1000)
    a = prefilled(bm, 0, shared + tokens(10))
    b = Sequence(1, shared + tokens(20, start=500))
    bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 2 * BS
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    assert bm.prefix_cache_hits == 2 * BS
    assert bm.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert bm.prefix_cache_hit_rate == pytest.approx(2 * BS / (a.num_tokens + b.num_tokens))
    bm.check_invariants([a, b])
    bm.free(a)  # b still holds the shared blocks
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.check_invariants([b])



def test_a_waiting_prompt_is_found_by_content_once_and_never_hashed(monkeypatch):
    """The scheduler asks can_allocate() about the queue's head every step while the pool cannot hold
    it, then allocate(): its cached prefix is found by its tokens, each block looked up once over all
    of those (a 1M-token prompt is 16K blocks), and again when the cache has changed since; nothing
    is hashed until blocks are computed and registered (blake2b took 4.5x the lookups' time)."""
    import megactx.engine.block_manager as module

    hashed = []
    monkeypatch.setattr(module, "block_hash", lambda prev, toks: hashed.append(1) or block_hash(prev, toks))

    class Lookups(dict):
        count = 0

        def get(self, key, default=None):
            Lookups.count += 1
            return super().get(key, default)

    bm = BlockManager(8)
    shared = tokens(3 * BS, start=1000)
    a = prefilled(bm, 0, shared + tokens(5))  # 3 full blocks registered (4 in use)
    bm._by_content = Lookups(bm._by_content)
    hashed.clear()
    waiting = Sequence(1, shared + tokens(5 * BS, start=500))  # 3 blocks hit, then 5 new: the 4 free will not do
    for _ in range(3):
        assert not bm.can_allocate(waiting)
    assert Lookups.count == 4 and not hashed  # the 3 hits and the first miss, once
    bm.free(a)  # its registered blocks stay cached: the answer holds
    assert bm.can_allocate(waiting) and Lookups.count == 4
    bm.allocate(waiting)
    assert waiting.num_cached_tokens == 3 * BS and Lookups.count == 4 and not hashed
    bm.free(waiting)
    bm.can_allocate(waiting)  # allocated and freed since: looked up afresh
    assert Lookups.count == 8
    other = prefilled(bm, 2, tokens(2 * BS, start=3000))  # hashes and registers 2 blocks: the cache changed
    assert len(hashed) == 2
    assert Lookups.count == 9  # other's own admission: its first block, a miss
    bm.can_allocate(waiting)
    assert Lookups.count == 13
    bm.free(other)
    bm.check_invariants([])


def test_a_partial_last_block_is_never_shared():
    bm = BlockManager(16)
    prompt = tokens(BS + 36)
    a = prefilled(bm, 0, prompt)
    assert bm.num_cached_blocks == 1  # only the full block was registered
    b = Sequence(1, prompt + tokens(50, start=7000))
    bm.allocate(b)
    assert b.num_cached_tokens == BS
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.blocks[a.block_table[1]].ref_count == 1
    bm.check_invariants([a, b])


@pytest.mark.parametrize("num_tokens", [BS + 1, 2 * BS, 2 * BS + 1, 3 * BS - 1])
def test_a_full_prompt_hit_still_computes_the_last_token(num_tokens):
    bm = BlockManager(16)
    prompt = tokens(num_tokens)
    a = prefilled(bm, 0, prompt)
    b = Sequence(1, prompt)
    bm.allocate(b)
    assert b.num_computed_tokens == BS * ((num_tokens - 1) // BS)
    assert b.num_uncomputed_tokens >= 1
    # a block-aligned prompt recomputes its whole last block instead of writing into a shared one
    shared = b.num_computed_tokens // BS
    assert b.block_table[:shared] == a.block_table[:shared]
    assert set(b.block_table[shared:]).isdisjoint(a.block_table)
    bm.check_invariants([a, b])


def test_unreferenced_cached_blocks_are_evicted_lru_and_then_miss():
    bm = BlockManager(4)
    prompt = tokens(2 * BS + 1, start=300)
    a = prefilled(bm, 0, prompt)
    bm.free(a)
    # freed but registered: both full blocks are free, yet still hit
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.prefix_hit_tokens(Sequence(9, prompt)) == 2 * BS
    # never-registered free blocks are used first: the cached prefix survives this allocation
    c = Sequence(1, tokens(BS))
    bm.allocate(c)
    assert bm.prefix_hit_tokens(Sequence(9, prompt)) == 2 * BS
    # next, the least recently freed cached block goes; a's tail was freed first
    d = Sequence(2, tokens(BS + 1, start=5000))
    bm.allocate(d)
    assert bm.num_cached_blocks == 1
    assert bm.prefix_hit_tokens(Sequence(9, prompt)) == BS
    bm.check_invariants([c, d])
    bm.free(c)
    bm.free(d)
    e = Sequence(3, tokens(4 * BS, start=9000))
    bm.allocate(e)
    assert bm.num_cached_blocks == 0
    assert bm.prefix_hit_tokens(Sequence(9, prompt)) == 0
    bm.check_invariants([e])


def test_hashes_chain_so_equal_blocks_after_different_prefixes_do_not_hit():
    x, y = tokens(BS, start=0), tokens(BS, start=100)
    assert block_hash(None, y) != block_hash(block_hash(None, x), y)
    assert block_hash(block_hash(None, x), y) == block_hash(block_hash(None, x), tuple(y))  # deterministic
    bm = BlockManager(16)
    a = prefilled(bm, 0, x + y + [1])
    assert bm.num_cached_blocks == 2
    b = Sequence(1, y + [1])  # block y, but at the start: a different prefix
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[1]
    bm.check_invariants([a, b])


def test_append_slots_across_a_block_boundary():
    bm = BlockManager(8)
    seq = prefilled(bm, 0, tokens(BS - 1))
    assert seq.num_blocks == 1
    assert bm.has_slots(seq, 1) and not bm.has_slots(seq, 2)
    seq.append_token(1)  # sampled token: position BS - 1, still in block 0
    bm.append_slots(seq, 1)
    assert seq.num_blocks == 1
    bm.mark_computed(seq, 1)
    assert bm.num_cached_blocks == 1  # block 0 became full and was registered
    assert not bm.has_slots(seq, 1)
    seq.append_token(2)  # position BS opens block 1
    assert bm.can_append(seq, 1)
    bm.append_slots(seq, 1)
    assert seq.num_blocks == 2
    assert bm.slot(seq, BS) == seq.block_table[1] * BS
    assert bm.slot(seq, BS - 1) == seq.block_table[0] * BS + BS - 1
    # a verify step writing 1 + 70 positions crosses two more boundaries
    bm.append_slots(seq, 71)
    assert seq.num_blocks == bm.blocks_for(BS + 71) == 3
    assert bm.slots(seq, BS - 4, BS + 70) == [bm.slot(seq, p) for p in range(BS - 4, BS + 70)]
    assert bm.slots(seq, 5, 5) == []
    with pytest.raises(ValueError, match="position"):
        bm.slot(seq, 3 * BS)
    with pytest.raises(ValueError, match="n must be >= 1"):
        bm.append_slots(seq, 0)
    bm.check_invariants([seq])


def test_reset_prefix_cache_forgets_free_registered_blocks_only():
    bm = BlockManager(8)
    held = prefilled(bm, 0, tokens(2 * BS))
    gone = prefilled(bm, 1, tokens(2 * BS, start=500))
    bm.free(gone)
    assert bm.num_cached_blocks == 4 and bm.prefix_cache_queries > 0
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 2 and bm.prefix_cache_queries == bm.prefix_cache_hits == 0
    assert bm.num_free_blocks == 6
    bm.check_invariants([held])
    assert bm.prefix_hit_tokens(Sequence(2, tokens(2 * BS, start=500) + [1])) == 0  # forgotten
    assert bm.prefix_hit_tokens(Sequence(3, tokens(2 * BS) + [1])) == 2 * BS  # still held: still cached


def test_can_append_reports_a_full_pool():
    bm = BlockManager(1)
    seq = prefilled(bm, 0, tokens(BS))
    seq.append_token(0)
    assert not bm.can_append(seq, 1)
    with pytest.raises(RuntimeError, match="can_append"):
        bm.append_slots(seq, 1)


def test_mark_computed_refuses_positions_without_slots_or_tokens():
    bm = BlockManager(4)
    seq = Sequence(0, tokens(10))
    bm.allocate(seq)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        bm.mark_computed(seq, 11)
    bm.mark_computed(seq, 10)
    seq.token_ids.extend(tokens(BS))  # e.g. drafts appended without append_slots()
    with pytest.raises(ValueError, match="append_slots"):
        bm.mark_computed(seq, BS)


def test_truncate_releases_trailing_blocks_and_unregisters_the_cut_block():
    bm = BlockManager(8)
    seq = prefilled(bm, 0, tokens(BS - 4))
    seq.append_token(1)  # the last sampled token
    # a verify step: the last token + 8 drafts, positions BS - 4 .. BS + 4
    bm.append_slots(seq, 9)
    assert seq.num_blocks == 2
    seq.token_ids.extend(tokens(8, start=50))
    bm.mark_computed(seq, 9)
    assert bm.num_cached_blocks == 1  # block 0 filled up with drafts and was registered
    # only 2 drafts accepted: keep BS - 4 + 1 + 2 tokens
    keep = BS - 1
    bm.truncate(seq, keep)
    assert seq.num_tokens == seq.num_computed_tokens == keep
    assert seq.num_blocks == 1 and bm.num_free_blocks == 7
    assert bm.num_cached_blocks == 0  # block 0 is no longer full of valid KV
    assert seq.block_hashes == []
    other = Sequence(1, seq.token_ids[: BS - 4] + [1] + tokens(8, start=50))  # the rejected continuation
    assert bm.prefix_hit_tokens(other) == 0
    bm.check_invariants([seq])


def test_truncate_keeps_whole_released_blocks_cached():
    bm = BlockManager(8)
    seq = prefilled(bm, 0, tokens(10))
    seq.token_ids.extend(tokens(3 * BS + 10, start=10))  # as if generated
    bm.append_slots(seq, 3 * BS + 10)
    bm.mark_computed(seq, 3 * BS + 10)
    assert bm.num_cached_blocks == 3
    blocks = list(seq.block_table)
    bm.truncate(seq, BS + 36)
    assert seq.block_table == blocks[:2]
    assert seq.num_computed_tokens == BS + 36 and len(seq.block_hashes) == 1
    # block 1 is cut (unregistered), block 2 was released whole (still valid, still cached), block 3 was partial
    assert [bm.blocks[b].hash is not None for b in blocks] == [True, False, True, False]
    assert bm.blocks[blocks[2]].ref_count == 0
    bm.check_invariants([seq])
    # truncating to the current length only gives back reserved-but-unused slots
    bm.append_slots(seq, 2 * BS)
    assert seq.num_blocks == 4
    bm.truncate(seq, seq.num_tokens)
    assert seq.block_table == blocks[:2]
    bm.check_invariants([seq])


def test_truncate_refuses_to_cut_into_a_shared_block():
    bm = BlockManager(8)
    a = prefilled(bm, 0, tokens(10))
    a.token_ids.extend(tokens(2 * BS, start=10))
    bm.append_slots(a, 2 * BS)
    bm.mark_computed(a, 2 * BS)
    b = Sequence(1, list(a.token_ids))
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    before = (list(a.token_ids), list(a.block_table), a.num_computed_tokens)
    with pytest.raises(ValueError, match="shared"):
        bm.truncate(a, BS + 10)
    assert (a.token_ids, a.block_table, a.num_computed_tokens) == before
    with pytest.raises(ValueError, match="num_tokens must be in"):
        bm.truncate(a, 5)  # into the prompt
    bm.check_invariants([a, b])


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(8, enable_prefix_caching=False)
    prompt = tokens(2 * BS + 1)
    a = prefilled(bm, 0, prompt)
    b = Sequence(1, prompt)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0
    bm.check_invariants([a, b])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_operations_keep_invariants_and_cache_contents(seed, prefix_caching):
    """Random admissions, chunked prefills, decodes, speculative verify + rollback and frees on a
    small pool with small blocks. A shadow KV cache stores each written position's token id; every
    computed position of every live sequence must read back its own token (sharing never corrupts)."""
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(24, block_size=bs, enable_prefix_caching=prefix_caching)
    kv = [None] * (bm.num_blocks * bs)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    live: list[Sequence] = []

    def compute(seq, n):  # the model writes KV for the next n positions
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            kv[bm.slot(seq, p)] = seq.token_ids[p]
        bm.mark_computed(seq, n)

    for step in range(400):
        op = rng.random()
        if op < 0.25 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 8))]
            seq = Sequence(step, prompt)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                assert seq.num_computed_tokens % bs == 0 and seq.num_computed_tokens < seq.num_tokens
                live.append(seq)
        else:
            seq = rng.choice(live)
            if op < 0.35:
                bm.free(seq)
                live.remove(seq)
            elif seq.is_prefill:  # a prefill chunk; reaching the end samples a token
                compute(seq, rng.randint(1, seq.num_uncomputed_tokens))
                if seq.num_uncomputed_tokens == 0:
                    seq.append_token(rng.randrange(5))
            elif op < 0.7:  # decode: compute the last token, sample the next
                if bm.can_append(seq, 1):
                    bm.append_slots(seq, 1)
                    compute(seq, 1)
                    seq.append_token(rng.randrange(5))
            else:  # speculative verify: last token + k drafts, accept some, roll back the rest
                k = rng.randint(1, 6)
                if bm.can_append(seq, 1 + k):
                    bm.append_slots(seq, 1 + k)
                    seq.token_ids.extend(rng.randrange(5) for _ in range(k))
                    compute(seq, 1 + k)
                    accepted = rng.randint(0, k)
                    bm.truncate(seq, seq.num_tokens - k + accepted)
                    seq.append_token(rng.randrange(5))  # the bonus token; its slot comes next step
                    assert bm.blocks_for(seq.num_computed_tokens) <= seq.num_blocks <= bm.blocks_for(seq.num_tokens)
        bm.check_invariants(live)
        for s in live:
            assert [kv[bm.slot(s, p)] for p in range(s.num_computed_tokens)] == s.token_ids[: s.num_computed_tokens]
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
