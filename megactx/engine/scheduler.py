"""Continuous-batching scheduler: which positions of which sequences the next model step computes.

Each step has a budget of `max_num_batched_tokens` positions, filled in this order:

1. Running sequences in decode (one uncomputed token) get their token, oldest first. Decode goes
   first because it is what users wait on between tokens, and it is cheap (1 position each).
2. Running sequences still in prefill continue with a chunk of at most the remaining budget, so a
   long prompt is spread over several steps interleaved with other sequences' decodes.
3. Waiting sequences are admitted first-come-first-served while the batch has room
   (`max_num_seqs`), budget is left and the block manager can hold all their known tokens. The queue
   head blocks the rest (no overtaking), so a long prompt is never starved by short ones. No one is
   admitted in a step that had to preempt: the pool is already too tight.

Preemption (recompute). When a decode step needs a new block and none is free, the running
sequence that arrived last is preempted: its blocks are freed, num_computed_tokens drops to 0, and
it goes back to the front of the waiting queue keeping all its tokens (prompt and outputs so far).
Re-admitted later, it recomputes those tokens (often from its own blocks, still in the prefix cache)
and continues exactly where it was. Priority is arrival order, as in vLLM's FCFS policy: a sequence
only ever preempts sequences that arrived after it, or itself if it is the youngest. Because add()
refuses any request that could not finish alone in the whole cache, the oldest sequence always
makes progress: no livelock.

A step's work is a list of `ScheduledSeq(seq, start, num_tokens)`: compute positions
start .. start + num_tokens - 1 (their KV slots are allocated); the chunk yields a sampled token iff it
reaches the sequence's last known token. The engine runs the model, then calls postprocess() with
the sampled tokens, then decides which sequences finished (max_tokens, stop tokens, or once a
sequence has max_model_len tokens) and calls finish() on them.

Speculative decoding (`num_speculative_tokens` = γ > 0). The engine holds draft tokens for its
decoding sequences and passes their counts to schedule(). A decode then also verifies up to γ of
them: `ScheduledSeq.num_draft_tokens` = k, capped so that the accepted drafts plus one more token
fit in max_tokens and max_model_len, and by what is left of the token budget (a decode costs 1 + k
positions). Its slots cover the k + 1 verified positions plus `num_lookahead_slots` more, for KV a
drafter writes at draft positions after the step (the MTP baseline's draft steps); a prefill chunk
that samples takes those extra slots only if they are free (a prefill never preempts). postprocess()
then takes the emitted tokens — the accepted drafts and one more — and marks only the positions
computed with accepted tokens; the rejected positions stay uncomputed and are written again by the
next step (the rollback). Slots past a sequence's known tokens go back to the pool at the start of
the next schedule(). Every reservation stops at max_kv_tokens(seq), so add()'s capacity check holds.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from megactx.engine.block_manager import BlockManager
from megactx.engine.sequence import Sequence, SequenceStatus


@dataclass(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in one batch
    max_num_batched_tokens: int = 8192  # positions computed in one step (prefill chunks + decodes)
    max_model_len: int  # longest prompt accepted; the engine stops a sequence at this many tokens
    chunked_prefill: bool = True  # False: a prompt is admitted only when all of it fits in one step
    # speculative decoding
    num_speculative_tokens: int = 0  # γ: draft tokens a decode may verify (0: none)
    num_lookahead_slots: int = 0  # slots kept past a sampling chunk's positions for draft-position KV

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_speculative_tokens", "num_lookahead_slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # otherwise a full batch of decodes would not fit in one step's budget
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit in one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                "raise it or set chunked_prefill=True"
            )


@dataclass
class ScheduledSeq:
    """Compute positions start .. start + num_tokens - 1 of `seq` this step (known tokens). A chunk
    that samples also verifies the sequence's first `num_draft_tokens` draft tokens at the positions
    after its last known token (speculative decoding): its forward covers num_positions positions."""

    seq: Sequence
    start: int
    num_tokens: int
    num_draft_tokens: int = 0
    samples: bool = field(init=False)  # the chunk reaches the last known token: sample the next one

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens
        assert self.samples or not self.num_draft_tokens, "only a chunk that samples verifies drafts"

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_positions(self) -> int:
        """Positions the step computes for this chunk: known tokens, then draft tokens."""
        return self.num_tokens + self.num_draft_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes first, then prefill chunks, then newly admitted
    preempted: list[Sequence]  # preempted in this step (their KV is gone; they are waiting again)
    num_batched_tokens: int  # sum of scheduled num_positions, <= max_num_batched_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()  # in arrival order (preempted ones return to the front)
        self.running: list[Sequence] = []  # in arrival order, so the last one is the preemption victim
        self.num_preemptions = 0  # total, for metrics
        self._next_arrival = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def max_kv_tokens(self, seq: Sequence) -> int:
        """Most positions `seq` can ever need KV for: it ends at max_tokens outputs or once it has
        max_model_len tokens, and its last token is never computed."""
        longest = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        return min(longest - 1, self.config.max_model_len)

    def max_draft_tokens(self, seq: Sequence) -> int:
        """Draft tokens a verify of `seq` could use now: at most num_speculative_tokens, and few
        enough that the accepted drafts plus the token after them stay within max_tokens and
        max_model_len (the engine stops a sequence there). 0 when nothing can be gained."""
        return max(0, min(self.config.num_speculative_tokens, self.draft_room(seq)))

    def draft_room(self, seq: Sequence) -> int:
        """Draft tokens whose acceptance, with the token after them, keeps `seq` within max_tokens
        and max_model_len (unbounded by γ; may be negative)."""
        left = min(seq.sampling_params.max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens)
        return left - 1

    def reserve_ahead(self, seq: Sequence, n: int) -> bool:
        """Slots for the next n positions of running `seq` without preempting anyone (a step launched
        before the host knows where its sequences stand: LLM's overlapped speculative steps). False
        if the pool lacks them. Slots past seq's tokens go back at the next schedule()."""
        bm = self.block_manager
        if bm.has_slots(seq, n):
            return True
        if not bm.can_append(seq, n):
            return False
        bm.append_slots(seq, n)
        return True

    def _slots(self, seq: Sequence, num_positions: int) -> int:
        """Slots a chunk of num_positions positions reserves: those plus the lookahead slots,
        stopping at max_kv_tokens(seq) (no step ever writes KV at or past it)."""
        if not self.config.num_lookahead_slots:
            return num_positions
        room = self.max_kv_tokens(seq) - seq.num_computed_tokens
        return max(num_positions, min(num_positions + self.config.num_lookahead_slots, room))

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError for a prompt longer than max_model_len or a
        request that could not finish even with the whole KV cache to itself."""
        if seq.status is not SequenceStatus.WAITING or seq.arrival >= 0:
            raise ValueError(f"sequence {seq.seq_id} was already added (status {seq.status.name})")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens; the maximum context (max_model_len) is "
                f"{self.config.max_model_len}"
            )
        bm = self.block_manager
        kv_tokens = self.max_kv_tokens(seq)
        if bm.blocks_for(kv_tokens) > bm.num_blocks:
            raise ValueError(
                f"request needs KV for up to {kv_tokens} tokens ({seq.num_prompt_tokens} prompt + "
                f"max_tokens {seq.sampling_params.max_tokens}), {bm.blocks_for(kv_tokens)} blocks; the "
                f"cache has {bm.num_blocks} blocks of {bm.block_size} tokens. Shorten the prompt or max_tokens"
            )
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self.waiting.append(seq)

    # ---------------------------------------------------------------------------- one step
    def schedule(self, draft_lengths: Mapping[int, int] | None = None) -> SchedulerOutput:
        """Pick the next step's work (policy in the module docstring). Slots for every scheduled
        position are allocated on return; call postprocess() with the step's results.

        draft_lengths: seq_id -> draft tokens the engine holds for that decoding sequence
        (speculative decoding; missing = none)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        draft_lengths = draft_lengths or {}
        bm = self.block_manager
        if self.config.num_speculative_tokens:  # last step's lookahead and rejected-draft slots go back
            for seq in self.running:
                if seq.num_blocks > bm.blocks_for(seq.num_tokens):
                    bm.truncate(seq, seq.num_tokens)

        # This loop runs for every sequence every step: it reads token counts directly, not
        # through Sequence's properties (a decode step's host time is mostly such loops).
        prefills = []
        max_model_len, lookahead, block_size = self.config.max_model_len, self.config.num_lookahead_slots, bm.block_size
        running = SequenceStatus.RUNNING
        for seq in list(self.running):  # decodes, oldest first; prefills are set aside
            if budget == 0:
                break
            num_tokens = len(seq.token_ids)
            computed = seq.num_computed_tokens
            if num_tokens - computed > 1:
                prefills.append(seq)
                continue
            if seq.status is not running:
                continue  # preempted earlier in this loop
            # It has all its tokens by count (max_model_len, or max_tokens outputs): the engine finishes
            # it when it sees its last token, which an overlapped engine schedules the next step before.
            if num_tokens >= max_model_len or num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens:
                continue
            num_drafts = 0
            if drafts := draft_lengths.get(seq.seq_id, 0):
                num_drafts = min(drafts, self.max_draft_tokens(seq), budget - 1)
            n = self._slots(seq, 1 + num_drafts) if lookahead else 1 + num_drafts
            if computed + n > len(seq.block_table) * block_size and not self._reserve(seq, n, preempted):
                continue  # it had to preempt itself
            scheduled.append(ScheduledSeq(seq, num_tokens - 1, 1, num_drafts))
            budget -= 1 + num_drafts
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # a decode preempted it
            n = seq.num_uncomputed_tokens
            if self.config.chunked_prefill:
                n = min(n, budget)
            elif n > budget:
                continue  # an unchunked prompt waits for a step with room for all of it
            # a prefill needs no new block: allocate() gave slots for all known tokens, so it
            # never preempts a decode already scheduled in this step
            assert seq.num_blocks * bm.block_size >= seq.num_tokens
            self._take_lookahead_if_free(seq, n)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n

        while not preempted and self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            if not self.config.chunked_prefill:
                if seq.num_tokens - self.block_manager.prefix_hit_tokens(seq) > budget:
                    break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            n = min(seq.num_uncomputed_tokens, budget)
            self._take_lookahead_if_free(seq, n)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n

        return SchedulerOutput(scheduled, preempted, self.config.max_num_batched_tokens - budget)

    def _take_lookahead_if_free(self, seq: Sequence, n: int) -> None:
        """A prefill chunk of n positions that samples gets its lookahead slots when the pool has
        them free; it never preempts for them (the drafter then drafts less, see the engine)."""
        if self.config.num_lookahead_slots and seq.num_computed_tokens + n == seq.num_tokens:
            slots = self._slots(seq, n)
            if self.block_manager.can_append(seq, slots):
                self.block_manager.append_slots(seq, slots)

    def _reserve(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Slots for the next `n` positions of decoding `seq`, preempting the youngest running
        sequences until they fit. False if `seq` itself had to go. Decodes are visited oldest first
        and prefills come after them, so a victim (younger than `seq`) is not scheduled yet."""
        if self.block_manager.has_slots(seq, n):  # most steps: the last block has room
            return True
        while not self.block_manager.can_append(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.append_slots(seq, n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # victims go youngest first, so pushing each to the front keeps the queue in arrival order
        self.waiting.appendleft(seq)

    def postprocess(self, output: SchedulerOutput, sampled: Mapping[int, int | SequenceOf[int]]) -> None:
        """Record a finished step: each scheduled chunk is now computed, and each chunk that samples
        gets its tokens appended. `sampled` maps seq_id -> the sampled token id, or a verify's
        emitted tokens: the accepted drafts (the first ones of the drafts the step computed, in
        order), then the one token after them. Only positions computed with accepted tokens are
        marked computed; rejected drafts' positions are not (the next step rewrites their KV).
        Sequences finished or aborted since schedule() are skipped. Finishing is the engine's call
        (see finish())."""
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            assert seq.num_computed_tokens == item.start, "postprocess() must follow its own schedule()"
            if not item.samples:
                self.block_manager.mark_computed(seq, item.num_tokens)
                continue
            if seq.seq_id not in sampled:
                raise ValueError(f"sequence {seq.seq_id} completed its chunk but `sampled` has no token for it")
            tokens = sampled[seq.seq_id]
            if isinstance(tokens, int):  # a plain decode step's one token (the common case: fast)
                seq.token_ids.append(tokens)
                self.block_manager.mark_computed(seq, item.num_tokens)
                continue
            tokens = list(tokens)
            if not 1 <= len(tokens) <= 1 + item.num_draft_tokens:
                raise ValueError(f"sequence {seq.seq_id} verified {item.num_draft_tokens} draft tokens, so it emits "
                                 f"1 to {1 + item.num_draft_tokens} tokens; got {len(tokens)}")
            for token in tokens:  # first: mark_computed needs the tokens of the positions it registers
                seq.append_token(token)
            self.block_manager.mark_computed(seq, item.num_tokens + len(tokens) - 1)

    # ---------------------------------------------------------------------------- ending
    def finish(self, seq: Sequence) -> None:
        """Release `seq`'s blocks and forget it (finished or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of `request_id` (running or waiting); returns them (empty if none)."""
        victims = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for seq in victims:
            self.finish(seq)
        return victims
