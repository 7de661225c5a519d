"""A sequence: one stream of tokens the engine is generating, and how much of it the KV cache holds.

Counting convention used by the whole engine: position p is the p-th token of `token_ids`
(prompt first, then outputs). A position is *computed* when its KV is in the paged cache. Computing
a chunk of positions that reaches the last known token yields logits for the next token, which is
sampled and appended. So a sequence always has at least one uncomputed token while it runs:

    prefill   num_tokens - num_computed_tokens > 1   (a prompt, or prompt + outputs after preemption)
    decode    num_tokens - num_computed_tokens == 1  (the last sampled token; one step computes it)
"""

from __future__ import annotations

from enum import Enum, auto

from megactx.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # not holding blocks: new, or preempted (its KV freed, to be recomputed)
    RUNNING = auto()  # holding blocks for its known tokens, scheduled every step it fits
    FINISHED = auto()  # done or aborted; its blocks are released


class Sequence:
    """One generated sequence of a request (a request with n > 1 samples owns n of them).

    Fields owned by the engine parts: `block_table`, `block_hashes`, `num_computed_tokens` and
    `num_cached_tokens` by the BlockManager; `status`, `arrival` and `num_preemptions` by the
    Scheduler. `arrival` is -1 until the scheduler accepts the sequence, then its FCFS rank.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id}: the prompt is empty; give at least one token id")
        self.seq_id = seq_id
        self.request_id = request_id if request_id is not None else str(seq_id)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + outputs
        self.num_prompt_tokens = len(self.token_ids)
        self.block_table: list[int] = []  # block ids; block i holds positions 64 i .. 64 i + 63
        self.block_hashes: list[int] = []  # chained hashes of the computed full blocks, in order
        self.num_computed_tokens = 0  # positions 0 .. num_computed_tokens - 1 have KV in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.status = SequenceStatus.WAITING
        self.arrival = -1
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not in the cache yet (>= 1 while the sequence runs)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token still to compute; see the module docstring."""
        return self.num_uncomputed_tokens > 1

    @property
    def num_blocks(self) -> int:
        """Blocks the sequence holds now (len(block_table))."""
        return len(self.block_table)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens} "
            f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, blocks={self.num_blocks})"
        )
