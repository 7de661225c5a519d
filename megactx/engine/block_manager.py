"""Paged-KV block manager: reference-counted blocks and a prefix cache of chained block hashes.

A block id indexes every layer's caches at once (the MLA KV of all layers and the indexer keys of
the full layers), so this class deals only in ids: `seq.block_table[i]` holds positions
`i * block_size .. i * block_size + block_size - 1` of the sequence, and position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Prefix caching. Once every position of a block is computed, the block is registered under
hash(previous block's hash, its token ids). The chain makes a hash name the whole prefix, so equal
tokens after a different prefix never match. A later sequence whose prompt starts with the same
full blocks takes those blocks (ref_count + 1) instead of computing them again. Only full, computed
blocks are ever registered, so a shared block is never written again. A prompt's cached blocks are
looked up by content (the parent's hash and the block's token ids): admission hashes nothing, and
each block is hashed once, when it is registered.

Drafter KV. With an MTP drafter (speculative decoding) every block also holds the MTP layer's KV, and
the MTP input at a position combines that position's hidden state with the *next* token, so the
drafter KV of a block's last position depends on the first token of the following block, which the
block's hash does not cover. `recompute_last_hit_block=True` therefore leaves the last matching block
out of every prefix hit: it is recomputed (target and drafter KV) with this sequence's own next token.

Freed blocks. A block whose ref_count drops to 0 is free. If it is registered it keeps its contents
and stays findable until its id is needed for a new allocation: new blocks come first from the
never-registered free blocks, then from the registered ones, least recently freed first (LRU).
A sequence's blocks are freed last block first, so a chain loses its tail before its head, which
keeps the surviving part of a prefix usable.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from megactx.engine.sequence import Sequence
from megactx.kernels.reference import BLOCK_SIZE

_HASH_BYTES = 16  # 128-bit digests: collisions are negligible even for billions of blocks


def block_hash(prev_hash: int | None, token_ids: Iterable[int]) -> int:
    """Chained hash of one full block: `prev_hash` is the hash of the block before it (None for the
    first block of a sequence). blake2b over fixed-width little-endian bytes rather than Python's
    hash(): the value is the same in every process and on every machine, so caches could be shared
    across workers or tiers later."""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(_HASH_BYTES, "little"))
    tokens = tuple(token_ids)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0  # sequences whose block_table holds this id; 0 = free
    hash: int | None = None  # set iff registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the block's tokens while registered
    parent: int | None = None  # while registered: the hash of the block before it (None: a sequence's first)


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` tokens; see the module docstring for the model.

    Contract with the scheduler/engine, per sequence:
      allocate(seq)             once, while it holds no blocks: slots for all its known tokens,
                                the longest cached prefix reused (sets num_computed_tokens).
      append_slots(seq, n)      before a step that writes KV for positions
                                num_computed_tokens .. num_computed_tokens + n - 1.
      mark_computed(seq, n)     after that step: those n positions now have KV.
      truncate(seq, num_tokens) roll back to the first num_tokens tokens (rejected drafts).
      free(seq)                 on finish, abort or preemption.
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, enable_prefix_caching: bool = True,
                 recompute_last_hit_block: bool = False) -> None:
        """recompute_last_hit_block: a prefix hit never includes its last matching block (for an MTP
        drafter, see the module docstring)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (the kernels use {BLOCK_SIZE}), got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recompute_last_hit_block = recompute_last_hit_block
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._hash_to_block: dict[int, int] = {}
        # The same registered blocks by (parent hash, token ids): a prompt's cached prefix is found
        # by its tokens, without hashing them (blake2b is ~5x the lookup; a 1M-token prompt has 16K blocks).
        self._by_content: dict[tuple[int | None, tuple[int, ...]], int] = {}
        self._version = 0  # bumped whenever a block is registered or unregistered
        # _match_prefix's last answer, (seq, its num_tokens, _version, answer): the scheduler asks
        # can_allocate() and then allocate() about the queue's head in one step
        self._matched: tuple[Sequence, int, int, tuple[list[int], list[int]]] | None = None
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # registered free blocks, LRU first
        self.prefix_cache_queries = 0  # prompt tokens looked up at allocation
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # ---------------------------------------------------------------------------- stats
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take, including registered blocks no sequence holds."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._hash_to_block)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def reset_prefix_cache(self) -> None:
        """Forget every registered block that no sequence holds, and the hit counts (the engine's
        warm-up; a benchmark between runs). Blocks that sequences hold stay registered."""
        for block_id in self._free_cached:
            self._unregister(self.blocks[block_id])
            self._free_uncached.append(block_id)
        self._free_cached.clear()
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------------------- admission
    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Hashes and block ids of the longest cached run of full blocks at the start of `seq`.
        At most (num_tokens - 1) // block_size blocks: the last token is always computed, because
        computing it is what produces the logits for the next token (one block fewer with
        recompute_last_hit_block). Found by content (parent hash, tokens): ~1 us a block, ~20 ms
        for a 1M-token prompt on a 2-core CPU (blake2b hashes took 4.5x as long); the answer is kept
        until the cache or the sequence changes."""
        if not self.enable_prefix_caching:
            return [], []
        if self._matched is not None and self._matched[:3] == (seq, seq.num_tokens, self._version):
            return self._matched[3]
        bs, hashes, hits = self.block_size, [], []
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            block_id = self._by_content.get((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
            if block_id is None:
                break
            parent = self.blocks[block_id].hash
            hashes.append(parent)
            hits.append(block_id)
        if self.recompute_last_hit_block and hits:
            del hashes[-1], hits[-1]
        self._matched = (seq, seq.num_tokens, self._version, (hashes, hits))
        return hashes, hits

    def _blocks_to_allocate(self, seq: Sequence, hits: list[int]) -> int:
        # a hit on a free registered block takes it out of the free pool too
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(seq.num_tokens) - len(hits) + revived

    def prefix_hit_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` that allocate() would take from the prefix cache now (no side effects)."""
        return len(self._match_prefix(seq)[1]) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self._blocks_to_allocate(seq, self._match_prefix(seq)[1]) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` (holding no blocks) slots for all its known tokens, reusing the longest cached
        prefix of full blocks. Sets num_computed_tokens = num_cached_tokens = the hit length (a
        multiple of block_size, < num_tokens). Raises if the pool cannot hold it: check can_allocate."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds {seq.num_blocks} blocks; free() it first")
        hashes, hits = self._match_prefix(seq)
        self._matched = None  # the lists become seq's own
        needed = self._blocks_to_allocate(seq, hits)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {needed} free blocks, {self.num_free_blocks} are free; "
                "call can_allocate() first"
            )
        for block_id in hits:
            self._take_cached(block_id)
        new = [self._take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.block_table = hits + new
        seq.block_hashes = hashes
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    # ---------------------------------------------------------------------------- growth
    def _blocks_to_append(self, seq: Sequence, n: int) -> int:
        if n < 1:
            raise ValueError(f"n must be >= 1 (positions the next step writes), got {n}")
        return max(self.blocks_for(seq.num_computed_tokens + n) - seq.num_blocks, 0)

    def has_slots(self, seq: Sequence, n: int = 1) -> bool:
        """Whether positions num_computed_tokens .. + n - 1 of `seq` have slots already."""
        return seq.num_computed_tokens + n <= len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence, n: int = 1) -> bool:
        return self._blocks_to_append(seq, n) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, n: int = 1) -> None:
        """Make sure positions num_computed_tokens .. num_computed_tokens + n - 1 have slots (a decode
        step writes 1; a speculative verify step writes 1 + num draft tokens). Raises if the pool
        cannot grow it: check can_append."""
        needed = self._blocks_to_append(seq, n)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {needed} free blocks, {self.num_free_blocks} are free; "
                "call can_append() first"
            )
        seq.block_table.extend(self._take_free() for _ in range(needed))

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The step just run wrote KV for the next `num_tokens` positions of `seq`: advance
        num_computed_tokens and register every block that is now full. The tokens at those positions
        must already be in seq.token_ids (append accepted drafts before calling this)."""
        computed = seq.num_computed_tokens + num_tokens
        if num_tokens < 0 or computed > seq.num_tokens:
            raise ValueError(
                f"num_tokens must be in [0, {seq.num_uncomputed_tokens}] for sequence {seq.seq_id} "
                f"({seq.num_tokens} tokens, {seq.num_computed_tokens} computed), got {num_tokens}"
            )
        if computed > seq.num_blocks * self.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} has slots for {seq.num_blocks * self.block_size} positions, "
                f"cannot mark {computed} computed; call append_slots() before the step"
            )
        seq.num_computed_tokens = computed
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), computed // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            assert block.hash is None, f"block {block.block_id} was registered before it was full"
            # Another block may already hold this content (two sequences prefilled the same prefix in
            # the same step): keep the first; this one stays private and is simply freed later.
            if h not in self._hash_to_block:
                self._hash_to_block[h] = self._by_content[(parent, tokens)] = block.block_id
                block.hash, block.token_ids, block.parent = h, tokens, parent
                self._version += 1

    # ---------------------------------------------------------------------------- release
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll `seq` back to its first `num_tokens` tokens (num_prompt_tokens <= num_tokens <=
        num_tokens now): later token ids are dropped, num_computed_tokens is capped at num_tokens,
        blocks holding no position < num_tokens are released, and a registered block that stays
        only partly valid leaves the prefix cache (its tail will be rewritten). Blocks released
        whole stay cached: their contents are still exactly what their hash says.
        truncate(seq, seq.num_tokens) only releases the slots reserved beyond the known tokens."""
        if not seq.num_prompt_tokens <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"num_tokens must be in [{seq.num_prompt_tokens}, {seq.num_tokens}] (prompt length .. "
                f"current length) for sequence {seq.seq_id}, got {num_tokens}"
            )
        computed = min(seq.num_computed_tokens, num_tokens)
        keep_blocks = self.blocks_for(num_tokens)
        keep_hashes = computed // self.block_size
        if keep_hashes < min(keep_blocks, len(seq.block_hashes)):  # the block at the cut was full
            block = self.blocks[seq.block_table[keep_hashes]]
            if block.ref_count > 1:
                raise ValueError(
                    f"cannot roll sequence {seq.seq_id} back to {num_tokens} tokens: block {block.block_id} "
                    f"at the cut is shared by {block.ref_count} sequences; roll back no further than "
                    f"num_cached_tokens ({seq.num_cached_tokens}) or to a block boundary"
                )
            if block.hash is not None:
                assert block.hash == seq.block_hashes[keep_hashes]
                self._unregister(block)
        for block_id in reversed(seq.block_table[keep_blocks:]):
            self._release(block_id)
        del seq.block_table[keep_blocks:]
        del seq.block_hashes[keep_hashes:]
        del seq.token_ids[num_tokens:]
        seq.num_computed_tokens = computed
        seq.num_cached_tokens = min(seq.num_cached_tokens, computed)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (last first, see the module docstring); it computes nothing."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    # ---------------------------------------------------------------------------- slots
    def slot(self, seq: Sequence, position: int) -> int:
        """Physical slot of `position` (block_id * block_size + offset)."""
        if not 0 <= position < seq.num_blocks * self.block_size:
            raise ValueError(
                f"position must be in [0, {seq.num_blocks * self.block_size}) for sequence {seq.seq_id}, "
                f"got {position}; call append_slots() first"
            )
        block, offset = divmod(position, self.block_size)
        return seq.block_table[block] * self.block_size + offset

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Physical slots of positions start .. end - 1, built block by block."""
        if not 0 <= start <= end <= seq.num_blocks * self.block_size:
            raise ValueError(
                f"need 0 <= start <= end <= {seq.num_blocks * self.block_size} for sequence {seq.seq_id}, "
                f"got start={start}, end={end}"
            )
        bs, out = self.block_size, []
        for i in range(start // bs, self.blocks_for(end)):
            base = seq.block_table[i] * bs
            out.extend(range(base + max(start - i * bs, 0), base + min(end - i * bs, bs)))
        return out

    # ---------------------------------------------------------------------------- pool
    def _take_free(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            self._unregister(self.blocks[block_id])
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def _take_cached(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} released more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self._free_uncached.append(block_id)
            else:
                self._free_cached[block_id] = None

    def _unregister(self, block: Block) -> None:
        del self._hash_to_block[block.hash]
        del self._by_content[(block.parent, block.token_ids)]
        block.hash, block.token_ids, block.parent = None, (), None
        self._version += 1

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Assert the internal bookkeeping is consistent. With `seqs` (all sequences holding blocks,
        possibly none) also check that ref counts equal the references in their block tables and
        that each sequence's block hashes are the chain of its computed full blocks. For tests."""
        free_uncached, free_cached = set(self._free_uncached), set(self._free_cached)
        assert len(free_uncached) == len(self._free_uncached), "a block is twice in the free list"
        assert not free_uncached & free_cached, "a block is in both free pools"
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id}: negative ref count"
            is_free = block.block_id in free_uncached or block.block_id in free_cached
            assert is_free == (block.ref_count == 0), f"block {block.block_id}: must be free xor referenced"
            if block.block_id in free_cached:
                assert block.hash is not None, f"block {block.block_id}: unregistered in the cached pool"
            if block.block_id in free_uncached:
                assert block.hash is None, f"block {block.block_id}: registered in the uncached pool"
            if block.hash is not None:
                assert self._hash_to_block.get(block.hash) == block.block_id, f"block {block.block_id}: hash map"
                assert len(block.token_ids) == self.block_size, f"block {block.block_id}: registered but not full"
        for h, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"hash map points at block {block_id} with another hash"
        assert len(self._by_content) == len(self._hash_to_block), "the content map holds other blocks"
        for (parent, tokens), block_id in self._by_content.items():
            block = self.blocks[block_id]
            assert (block.parent, block.token_ids) == (parent, tokens), f"content map: block {block_id}"
            assert block.hash == block_hash(parent, tokens), f"block {block_id}: hash of another content"
        if seqs is None:
            return
        seqs = list(seqs)
        refs = Counter(b for seq in seqs for b in seq.block_table)
        for block in self.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id}: ref count"
        bs = self.block_size
        for seq in seqs:
            assert seq.num_computed_tokens <= min(seq.num_tokens, seq.num_blocks * bs)
            n_full = seq.num_computed_tokens // bs if self.enable_prefix_caching else 0
            assert len(seq.block_hashes) == n_full, f"sequence {seq.seq_id}: one hash per computed full block"
            prev = None
            for i, h in enumerate(seq.block_hashes):
                prev = block_hash(prev, seq.token_ids[i * bs : (i + 1) * bs])
                assert h == prev, f"sequence {seq.seq_id}: block {i} hash does not match its tokens"
                block = self.blocks[seq.block_table[i]]
                assert block.hash in (None, h), f"sequence {seq.seq_id}: block {i} registered under another hash"
