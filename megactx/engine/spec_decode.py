"""MTP speculative decoding in the engine: drafts from the checkpoint's MTP layer over its own paged
cache, one target forward that verifies them, and the acceptance rules of `rejection_sampler`.

One step of the speculative engine (`LLM.step` calls these in order):

1. `SpecDecoder.forward` — the target over the scheduled chunks: prefill chunks' known tokens, and
   for each decoding sequence its last token followed by its k draft tokens (the verify), writing
   the target KV of all of them; returns the final-normed hidden state and the input token of
   every position (`TargetPass`).
2. `SpecDecoder.verify` — logits at the k + 1 verified positions of each chunk that samples (k = 0
   for a prefill's last chunk), each request's sampling pipeline on every position (penalties and
   min_tokens with the earlier drafts counted as output, then temperature / top-k / top-p / min-p),
   then greedy acceptance or rejection sampling -> the tokens each sequence emits. The scheduler's
   postprocess() appends them and marks computed only the positions computed with accepted tokens.
3. `SpecDecoder.propose` — MTP step 1 over every position the step computed: the MTP input at
   position i is the target hidden state h_i with the embedding of x_{i+1}, and it predicts x_{i+2}
   (model/mtp.py). It writes the MTP layer's KV into the same slots as the target's, so the two
   caches always cover the same positions, share the prefix cache, and roll back together. The rest
   of the layer (its indexer over the whole context, attention, MLP) runs only at the positions a
   draft starts from: of a long prompt's chunk, one row or none; after a decode step, a sequence's
   last accepted position. Then
   draft steps 2 .. k' continue from the last computed position of each sequence that keeps
   decoding, with the same MTP weights every step:
   - kvshare (IndexShare + KVShare, the checkpoint's `index_share_for_mtp_iteration`): steps >= 2
     reuse step 1's top-k of that position and attend only to KV step 1 computed from target hidden
     states; they write nothing, so no draft ever attends to draft-made KV;
   - baseline: every step runs the MTP indexer and writes its own KV at its draft position (slots
     the scheduler keeps past the verified positions: `num_lookahead_slots` = γ - 1). Those
     positions are uncomputed, so the next step's MTP step 1 overwrites them.

Drafts: greedy requests, and every request under the "target-only" acceptance, take the argmax of
the draft logits (q is then one-hot: accepted with probability p(d)); "rejection" samples d ~ q =
`process_logits(draft logits)` and keeps q for the verify. Penalties and min_tokens shape p only:
any q is valid as long as the drafts were drawn from it.

Host syncs: one a step, the emitted tokens after the verify (with the drafts already queued behind
it where they can be: "Drafts before the sync" below). The drafts stay on the device (the
next verify's inputs and its rejection rule read them there; `Draft.tokens`, their host copy, is
fetched only for penalties and min_tokens), so the host emits, schedules and fills the next verify
while the device drafts.

Host work. At batch 1 a step is bound by the host, not the GPU (an eager launch or copy costs more
host time than its work takes on the device), so a graphed step keeps its eager ops few. It makes
two host-to-device copies, one a graph: the graph's inputs and the indices of the eager ops around
it travel together, from a pinned buffer kept for them (`StaticBatch.fill`). verify() reads the
verify graph's rows in place (no gathers when every sequence verifies as many drafts), and the
drafting reads the verify graph's output in place.

Graphs. When the runner replays graphs (CUDA; `ModelRunner.use_graphs`), a step whose chunks are
all decodes runs its verify forward as one graph of B sequences x (γ + 1) rows (`StepGraphs`,
kind "verify": a sequence with k < γ drafts leaves padding rows), any other step (prefill
chunks, beside decodes and their drafts) as one graph of ragged rows (kind "mixed-hidden", up to
the largest row bucket: eager, a 256-token prompt's step took 56 ms of host launches on an H200),
and propose() runs the MTP steps as `spec_graphs.DraftGraphs` (after a chunk of more than γ + 1 positions, a
prompt's, its MTP KV eagerly first, then the graphs from each sequence's last position). After a
verify graph whose sequences all verify K drafts, greedily or from their requests' streams, the
acceptance is one graph too (`spec_graphs.AcceptGraphs`: logits, sampling pipeline, draws, rule); else eager.

Drafts before the sync. With KVShare after a graphed verify, nothing in the next drafts waits for
the host: verify() launches the draft graph between its acceptance and its host sync, from the
accepted counts on the device (MTP step 1 over every verified position, the rejected ones'
MTP KV included — uncomputed positions, written again before anything reads them — then γ drafts
from each sequence's last accepted position), and propose() keeps the drafts of the sequences that
go on. The device then runs verify and drafts back to back while the host emits, schedules and
fills the next verify. A draft round spends γ vocabularies of a request's random stream whatever it
drafts, on every path, so that sampled drafts do not depend on which path made them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from megactx.config import ModelConfig
from megactx.engine.model_runner import DeviceTokens, input_ids_on_device
from megactx.engine.rejection_sampler import (
    VerifyResult,
    draw_uniforms,
    greedy_verify,
    rejection_sample,
)
from megactx.engine.sampler import (
    PAD_ID,
    RowGenerator,
    SamplingTensors,
    SamplingTensorsCache,
    apply_penalties,
    compute_logprobs,
    mask_stop_tokens_before_min,
    pad_token_ids,
    process_logits,
    sample,
)
from megactx.engine.scheduler import ScheduledSeq
from megactx.engine.sequence import Sequence as Seq
from megactx.engine.sequence import SequenceStatus
from megactx.engine.steplog import device_wait
from megactx.kernels.reference import BLOCK_SIZE
from megactx.model.paged import (
    HostCopy,
    OutputRows,
    PagedBatch,
    PagedLayerCache,
    to_device,
    to_device_packed,
)

if TYPE_CHECKING:
    from megactx.engine.model_runner import ModelRunner
    from megactx.engine.spec_graphs import AcceptGraphs, DraftGraphs
    from megactx.model.transformer import Transformer

log = logging.getLogger("megactx")

MTP_MODES = ("auto", "kvshare", "baseline")  # auto: the checkpoint's index_share_for_mtp_iteration
DRAFT_ACCEPTANCE = ("rejection", "target-only")


@dataclass(frozen=True)
class SpecConfig:
    """num_speculative_tokens: γ, draft tokens a step. kv_share: IndexShare + KVShare across draft
    steps (else the baseline). acceptance: "rejection" (sampled drafts, rejection sampling) or
    "target-only" (greedy drafts accepted with probability p(d)); greedy requests accept greedily
    under both."""

    num_speculative_tokens: int
    kv_share: bool
    acceptance: str = "rejection"

    @classmethod
    def create(cls, cfg: ModelConfig, num_speculative_tokens: int, mtp_mode: str = "auto",
               draft_acceptance: str = "rejection") -> SpecConfig:
        """Validate the engine's arguments against the checkpoint (raises ValueError)."""
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1 here, got {num_speculative_tokens!r}")
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("num_speculative_tokens > 0 needs an MTP layer, and this checkpoint has none "
                             "(num_nextn_predict_layers = 0); use num_speculative_tokens=0")
        if mtp_mode not in MTP_MODES:
            raise ValueError(f"mtp_mode must be one of {', '.join(MTP_MODES)}, got {mtp_mode!r}")
        if draft_acceptance not in DRAFT_ACCEPTANCE:
            raise ValueError(f"draft_acceptance must be one of {', '.join(DRAFT_ACCEPTANCE)}, got {draft_acceptance!r}")
        kv_share = cfg.index_share_for_mtp_iteration if mtp_mode == "auto" else mtp_mode == "kvshare"
        return cls(num_speculative_tokens, kv_share, draft_acceptance)

    @property
    def num_lookahead_slots(self) -> int:
        """Slots past the verified positions that the drafter writes: the baseline's draft steps
        2 .. γ write at the γ - 1 positions after the last computed one."""
        return 0 if self.kv_share else self.num_speculative_tokens - 1


@dataclass
class SpecDecodeStats:
    """Drafted and accepted token counts. A *draft* is one verify of one sequence with at least one
    draft token (a verify of 0 drafts is a plain decode and is not counted)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [γ]: drafts with a token at position j
    accepted_per_position: list[int] = field(default_factory=list)  # [γ]: drafts whose token j was accepted

    def __post_init__(self) -> None:
        self.drafted_per_position = self.drafted_per_position or [0] * self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify of num_draft_tokens (>= 1) drafts, of which the first num_accepted were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_draft_tokens):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify emits on average: accepted drafts + 1 (0.0 before the first draft)."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """[γ]: of the drafts that had a token at position j, the fraction whose token j was accepted
        (which needs all tokens before it accepted too)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


@dataclass
class Draft:
    """A sequence's draft tokens for its next verify: device_tokens [k] int64 on the device, where
    the next verify reads them; `tokens`, their host copy, waits for the copy the drafting queued
    when its requests need the drafts on the host (penalties, min_tokens), else syncs (nothing on
    the hot path reads it: the host goes on scheduling while the device drafts). probs: [k, V]
    fp32, the q each token was drawn from; None when they were picked deterministically (q = one-hot)."""

    device_tokens: torch.Tensor
    probs: torch.Tensor | None = None
    host: HostCopy | None = None  # the drafting's copy of its [B, steps] tokens to the host, if it made one
    row: int = 0  # this draft's row in it, and in all_probs
    all_probs: torch.Tensor | None = None  # [B, steps, V]: the q of every sequence of the drafting

    @property
    def num_tokens(self) -> int:
        return self.device_tokens.shape[0]

    @property
    def tokens(self) -> list[int]:
        if self.host is None:
            return self.device_tokens.tolist()
        return self.host.lists()[0][self.row][: self.num_tokens]


@dataclass
class Emitted:
    """What one sequence's chunk emitted this step. logprobs: per emitted token (logprob of the raw
    target distribution, {token id: logprob} of the most likely ones), when the request asked."""

    tokens: list[int]
    num_drafts: int  # draft tokens verified
    num_accepted: int
    logprobs: list[tuple[float, dict[int, float]]] | None = None


@dataclass
class TargetPass:
    """The step's target forward (`SpecDecoder.forward`) as verify() and propose() read it: the
    final-normed hidden state and the input token (drafts in place) of each row. Chunk b's
    positions are consecutive rows from first_rows[b]: flattened, chunk after chunk (q None), or in
    the verify graph's layout (chunk b from row b·q, q = γ + 1, padding rows after its tokens)."""

    hidden: torch.Tensor  # [N, D]
    input_ids: torch.Tensor  # [N] int64
    first_rows: list[int]  # [len(scheduled)]
    q: int | None = None


# ------------------------------------------------------------------------------ runner functions
def forward_positions(runner: ModelRunner, scheduled: Sequence[ScheduledSeq],
                      drafts: DeviceTokens | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over the step's chunks, each its known tokens then its draft tokens (slots were
    reserved by the scheduler; the drafts on the device: `draft_tokens`), writing their KV. ->
    (final-normed hidden states [T, D], input ids [T] int64), chunk after chunk, T = Σ num_positions."""
    ids = []
    for item in scheduled:
        ids += item.seq.token_ids[item.start : item.end] + [0] * item.num_draft_tokens
    batch = PagedBatch.build([item.seq.block_table for item in scheduled], [item.start for item in scheduled],
                             [item.num_positions for item in scheduled], runner.device)
    (input_ids,) = input_ids_on_device(ids, drafts, runner.device)  # one copy
    hidden = runner.model.hidden_states(input_ids[None], batch.positions[None], runner.layer_caches(batch))[0]
    return hidden, input_ids


def draft_tokens(items: Sequence[ScheduledSeq], drafts: Mapping[int, Draft],
                 positions: Callable[[int, int], int]) -> DeviceTokens | None:
    """The draft tokens the chunks `items` verify, which never left the device: draft j of items[b]
    at position positions(b, j). None when no chunk verifies drafts."""
    at = [positions(b, j) for b, item in enumerate(items) for j in range(item.num_draft_tokens)]
    if not at:
        return None
    values = [drafts[item.seq.seq_id].device_tokens[: item.num_draft_tokens] for item in items if item.num_draft_tokens]
    return DeviceTokens(at, values[0] if len(values) == 1 else torch.cat(values))


def mtp_forward(runner: ModelRunner, hidden: torch.Tensor, next_tokens: torch.Tensor, batch: PagedBatch,
                positions: torch.Tensor, topk: torch.Tensor | None = None,
                write_kv: bool = True, rows: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the (first) MTP layer over its paged cache, `runner.caches[num_hidden_layers]`.

    hidden: [T, D], the target's final-normed hidden states (step 1) or the previous step's MTP
    output; next_tokens: [T] int64, the token after each row's position; batch: where the rows sit
    (their KV is written to batch.slots when write_kv; the indexer reads the sequences' blocks);
    positions: [T] int64 rope positions (batch.positions, except for KVShare steps, which write and
    select nothing). topk: [T, K] slots to attend to instead of running the MTP indexer (-1 = none).
    rows: compute only those rows' outputs (every row's KV is still written).
    -> (output hidden [T or R, D] before shared_head.norm, top-k slots used [T or R, K] int32)."""
    model = runner.model
    kv, index = runner.caches[model.cfg.num_hidden_layers]
    cache = PagedLayerCache(kv, index, batch, runner.ops)
    cos, sin = model.rotary(positions[None], hidden.dtype)
    out, topk = model.mtp[0](hidden[None], model.embed(next_tokens)[None], cos, sin, positions[None], topk, cache,
                             write_kv, rows)
    return out[0], topk


def draft_logits(model: Transformer, mtp_hidden: torch.Tensor) -> torch.Tensor:
    """MTP output hidden states [T, D] -> draft logits [T, V] fp32 (shared_head.norm, then the lm_head)."""
    return model.compute_logits(model.mtp[0].shared_head.norm(mtp_hidden))


def _offsets(scheduled: Sequence[ScheduledSeq]) -> list[int]:
    """Row of each chunk's first position in the step's flattened batch."""
    return [0, *itertools.accumulate(item.num_positions for item in scheduled)][:-1]


# ------------------------------------------------------------------------------ the decoder
class SpecDecoder:
    """Drafts, verification and their statistics for an engine over `runner` (a ModelRunner: its
    `model`, `caches`, `ops`, `layer_caches`, `device` are what is used).

    shared_generator: noise of requests without a seed (the engine's sampler generator); seeded
    requests pass their own generators to verify() / propose()."""

    def __init__(self, runner: ModelRunner, config: SpecConfig, vocab_size: int, eos_token_ids: Sequence[int],
                 shared_generator: torch.Generator | None = None):
        self.runner = runner
        self.model = runner.model
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.shared_generator = shared_generator
        self.drafts: dict[int, Draft] = {}  # seq_id -> drafts for its next verify
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self._graphs: DraftGraphs | None = None
        self._accepts: AcceptGraphs | None = None
        self._verify_sampling, self._draft_sampling = SamplingTensorsCache(), SamplingTensorsCache()
        self._positions: tuple[SamplingTensors, int, SamplingTensors] | None = None  # see _per_position
        # drafts made before the verify's host sync (_draft_early), until propose() keeps them
        self._held: tuple[_DraftPlan, torch.Tensor, torch.Tensor | None] | None = None
        self.overlapped_steps = 0  # verifies launched before the host sync of the step before (launch_next)
        self.overlapped_discarded = 0  # of them, those the engine did not take (a sequence ended, a request came)

    def draft_lengths(self) -> dict[int, int]:
        """seq_id -> draft tokens held (what Scheduler.schedule takes)."""
        return {seq_id: draft.num_tokens for seq_id, draft in self.drafts.items()}

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's drafts (it finished, was aborted, or was preempted: its KV is gone)."""
        self.drafts.pop(seq_id, None)

    def forward(self, scheduled: Sequence[ScheduledSeq]) -> TargetPass:
        """The step's target forward over known and draft tokens."""
        offsets = _offsets(scheduled)  # each chunk's drafts follow its known tokens
        drafts = draft_tokens(scheduled, self.drafts, lambda b, j: offsets[b] + scheduled[b].num_tokens + j)
        graphs = self.runner.graphs
        if graphs is not None and all(item.num_tokens == 1 and item.samples for item in scheduled):
            q = self.config.num_speculative_tokens + 1
            ids = [[item.seq.token_ids[item.start]] + [0] * item.num_draft_tokens for item in scheduled]  # 0: drafts
            hidden = graphs.forward("verify", [item.seq.block_table for item in scheduled],
                                    [item.start for item in scheduled], ids, q=q, device_tokens=drafts)
            if hidden is not None:
                return TargetPass(hidden, graphs.static_batch("verify", q).input_ids,
                                  [b * q for b in range(len(scheduled))], q)
        elif graphs is not None:  # prefill chunks (beside decodes): ragged rows, chunk after chunk
            ids = [item.seq.token_ids[item.start : item.end] + [0] * item.num_draft_tokens for item in scheduled]
            hidden = graphs.forward_mixed([item.seq.block_table for item in scheduled],
                                          [item.start for item in scheduled], ids, [], drafts, hidden=True)
            if hidden is not None:
                return TargetPass(hidden, graphs.mixed_input_ids(hidden.shape[0]), offsets)
        return TargetPass(*forward_positions(self.runner, scheduled, drafts), offsets)

    # -------------------------------------------------------------------------- verify
    @torch.inference_mode()
    def verify(self, scheduled: Sequence[ScheduledSeq], target: TargetPass,
               generators: Mapping[int, RowGenerator],
               before_sync: Callable[[VerifyResult], object] | None = None) -> dict[int, Emitted]:
        """Accept or reject the drafts of every chunk that samples -> seq_id -> Emitted.

        target: from forward(). generators: seq_id -> the generator of a seeded request.
        before_sync: called with the acceptance (on the device) before the host sync when the next
        drafts were launched before it too (`_draft_early`): where the engine launches the next
        verify (`launch_next`)."""
        chunks = [(b, item) for b, item in enumerate(scheduled) if item.samples]
        if not chunks:
            return {}
        device, vocab = target.hidden.device, self.vocab_size
        bsz, width = len(chunks), max(item.num_draft_tokens for _, item in chunks)
        lengths = [item.num_draft_tokens for _, item in chunks]

        # logits of the real rows only (the lm_head is the expensive part), then padded to K + 1 a row
        rows, padded = [], []
        for b, item in chunks:
            first, n = len(rows), item.num_draft_tokens + 1
            last = target.first_rows[b] + item.num_tokens - 1  # the chunk's last known token, then its drafts
            rows.extend(range(last, last + n))
            padded.extend(first + min(j, n - 1) for j in range(width + 1))
        # the indices the step needs on the device, in one copy: none after a verify graph whose
        # sequences all verify K drafts (most steps), where rows are a prefix of the graph's and
        # nothing is padded or masked
        needed = {}
        if rows != list(range(len(rows))):
            needed["rows"] = rows
        if any(k != width for k in lengths):
            needed["padded"], needed["num_drafts"] = padded, lengths
        if target.q is None or target.first_rows != [b * target.q for b in range(len(scheduled))]:
            # the drafts' rows (of ragged rows, or of a verify graph's that some sequences left: an overlapped
            # step's); past a chunk's drafts (ignored) its last verified row
            needed["drafts"] = [target.first_rows[b] + item.num_tokens - 1 + min(j + 1, item.num_draft_tokens)
                                for b, item in chunks for j in range(width)]
        seqs = [item.seq for _, item in chunks]
        tensors = self._verify_sampling.get(seqs, device, vocab, self.eos_token_ids)
        graphed = None
        if not needed and not (tensors.any_penalties or tensors.any_min_tokens):  # a verify graph's rows as they are
            graphed = self._accept_graphs(bsz, width, tensors, [item for _, item in chunks], generators)
        if graphed is not None:
            raw, result = graphed
            raw = raw[: len(rows)]  # the verified rows' logits, in order (for logprobs)
        else:
            raw, result = self._accept(scheduled, chunks, seqs, target, width, rows, needed, tensors, generators)
        # the step's host sync, one copy: row b holds its num_accepted + 1 tokens, then PAD_ID. Queued
        # first, so that a graphed step's drafts follow the verify on the device while the host waits
        copy = HostCopy(result.tokens)
        self._draft_early(scheduled, target, result, generators)
        if before_sync is not None and self._held is not None:
            before_sync(result)
        with device_wait():
            tokens = copy.lists()[0]
        accepted = [row.index(PAD_ID) - 1 if PAD_ID in row else width for row in tokens]

        logprobs = None
        if tensors.max_num_logprobs is not None:
            chosen, top_values, top_ids = compute_logprobs(raw, result.tokens.clamp_min(0).flatten(),
                                                           tensors.max_num_logprobs)
            chosen = chosen.view(bsz, width + 1).tolist()
            top_values = top_values.view(bsz, width + 1, -1).tolist()
            top_ids = top_ids.view(bsz, width + 1, -1).tolist()
            logprobs = [[(chosen[b][j], dict(zip(top_ids[b][j], top_values[b][j]))) for j in range(accepted[b] + 1)]
                        for b in range(bsz)]

        emitted = {}
        for b, (seq, k) in enumerate(zip(seqs, lengths)):
            if k:
                self.stats.record(k, accepted[b])
            emitted[seq.seq_id] = Emitted(tokens[b][: accepted[b] + 1], k, accepted[b],
                                          logprobs[b] if logprobs is not None else None)
        return emitted

    def _accept(self, scheduled: Sequence[ScheduledSeq], chunks: list[tuple[int, ScheduledSeq]], seqs: list[Seq],
                target: TargetPass, width: int, rows: list[int], needed: dict[str, list[int]],
                tensors: SamplingTensors, generators: Mapping[int, RowGenerator]) -> tuple[torch.Tensor, VerifyResult]:
        """verify()'s acceptance, eagerly: -> (logits of the verified rows [R, V] fp32, the result)."""
        device, vocab, bsz = target.hidden.device, self.vocab_size, len(chunks)
        indices = dict(zip(needed, to_device_packed([np.array(v, dtype=np.int64) for v in needed.values()], device)
                           if needed else []))
        hidden = target.hidden.index_select(0, indices["rows"]) if "rows" in indices else target.hidden[: len(rows)]
        raw = self.model.compute_logits(hidden)  # [R, V]
        if "padded" in indices:
            raw = raw.index_select(0, indices["padded"])  # [B (K + 1), V]
        if "drafts" in indices:
            drafted = target.input_ids.index_select(0, indices["drafts"]).view(bsz, width)  # [B, K]
        else:  # the verify graph's rows, sequence b's from row b·q: every chunk is a decode, its drafts after its token
            assert bsz == len(scheduled), "a verify graph runs decodes only"
            drafted = target.input_ids.view(-1, target.q)[:bsz, 1 : width + 1]
        num_drafts = indices.get("num_drafts")  # None: every chunk verifies K drafts

        if not tensors.all_greedy or tensors.any_min_tokens or tensors.any_penalties:  # a row a position
            tensors = self._per_position(tensors, width)
        processed = raw
        if tensors.any_min_tokens or tensors.any_penalties:
            # position j of a verify comes after drafts 1 .. j: they count as output there (on the host: waits
            # for the drafts' copy)
            drafts = [self.drafts[item.seq.seq_id].tokens[: item.num_draft_tokens] if item.num_draft_tokens else []
                      for _, item in chunks]
            history = [s.output_token_ids + d[:j] for s, d in zip(seqs, drafts) for j in range(width + 1)]
            outputs = pad_token_ids(history, device)
            if tensors.any_min_tokens:
                processed = mask_stop_tokens_before_min(processed, tensors, outputs)
            if tensors.any_penalties:
                prompts = pad_token_ids([s.token_ids[: s.num_prompt_tokens] for s in seqs for _ in range(width + 1)],
                                        device)
                processed = apply_penalties(processed, tensors, prompts, outputs)

        if tensors.all_greedy:
            result = greedy_verify(processed.argmax(dim=-1).view(bsz, width + 1), drafted, num_drafts)
        else:
            gens = [generators.get(s.seq_id) for s in seqs]
            # γ draws a row whatever this batch's K, so a seeded request's draws do not depend on the batch
            uniforms = draw_uniforms(bsz, self.config.num_speculative_tokens, device, gens, self.shared_generator)
            result = rejection_sample(process_logits(processed, tensors).view(bsz, width + 1, vocab), drafted,
                                      self._draft_probs([item for _, item in chunks], width), num_drafts,
                                      uniforms[:, :width], gens, self.shared_generator)
        return raw, result

    def _per_position(self, tensors: SamplingTensors, width: int) -> SamplingTensors:
        """tensors (a row a sequence) with a row a verified position: each sequence's row K + 1 times.
        Kept while the batch and K stay (most steps): the gathers would be a launch a field a step."""
        cached = self._positions
        if cached is None or cached[0] is not tensors or cached[1] != width:
            rows = torch.arange(len(tensors.temperature), device=tensors.temperature.device)
            cached = self._positions = (tensors, width, tensors.select(rows.repeat_interleave(width + 1)))
        return cached[2]

    def _draft_probs(self, chunks: list[ScheduledSeq], width: int) -> torch.Tensor | None:
        """q of the drafts being verified, [B, K, V] (one-hot rows for drafts picked
        deterministically), or None when every draft was (the rejection rule's one-hot case)."""
        held = [self.drafts[item.seq.seq_id] if item.num_draft_tokens else None for item in chunks]
        if not any(d is not None and d.probs is not None for d in held):
            return None
        whole = held[0].all_probs if held[0] is not None else None
        if (whole is not None and whole.shape[0] == len(held) and whole.shape[1] >= width
                and all(d is not None and d.all_probs is whole and d.row == b for b, d in enumerate(held))):
            return whole[:, :width]  # the verify's batch is the drafting's, in order (most steps): no copies
        device = self.runner.device
        q = torch.zeros(len(chunks), width, self.vocab_size, device=device)
        for b, (item, draft) in enumerate(zip(chunks, held)):
            k = item.num_draft_tokens
            if draft is None:
                continue
            if draft.probs is not None:
                q[b, :k] = draft.probs[:k]
            else:
                q[b, torch.arange(k, device=device), draft.device_tokens[:k]] = 1.0
        return q

    def _draft_early(self, scheduled: Sequence[ScheduledSeq], target: TargetPass, result: VerifyResult,
                     generators: Mapping[int, RowGenerator]) -> None:
        """The next drafts, launched before the verify's host sync when nothing in them waits for
        the host: after a graphed verify (every chunk a decode) with KVShare, and drafts that are
        argmaxes or sampled from the requests' streams (one draft graph). MTP step 1 then runs over
        every verified position (the rejected ones' MTP KV is written too, past the sequence's
        computed positions: the next step writes those positions again before anything reads them)
        and goes on from each sequence's last accepted one, which the device knows; every sequence
        drafts γ. propose() keeps the drafts of the sequences that go on (self._held). So the device
        runs verify and drafts back to back, and the host's work after the sync (emit, schedule,
        the next fill) overlaps the drafts instead of the device waiting for it."""
        graphs = self._draft_graphs()
        if graphs is None or target.q is None or not self.config.kv_share:
            return
        gamma = self.config.num_speculative_tokens
        members = [(item.seq, item.start, item.num_draft_tokens + 1) for item in scheduled]
        plan = self._plan(members, {item.seq.seq_id: gamma for item in scheduled}, generators)
        if not plan.greedy and not all(isinstance(g, RowGenerator) for g in plan.gens):
            return  # a graph a draft step, the sampling eager between them: after the sync
        rows = [target.first_rows[b] + i for b, (_, _, n) in enumerate(members) for i in range(n)]
        spent = self._streams_after_drafting(plan.seqs, generators)
        if graphs.run(members, target, rows, plan, accepted=result):
            for g, offset in spent:
                g.offset = offset

    def launch_next(self, scheduled: Sequence[ScheduledSeq], result: VerifyResult) -> TargetPass | None:
        """The next step's verify forward, launched before this step's host sync (an overlapped
        step: `LLM.async_scheduling`): each of `scheduled` (this step's verify-graph decodes, all
        drafting on with γ drafts: the caller checks that, and that their blocks cover γ + 1
        positions past this step's last possible one) verifies its next token — the acceptance's
        last, still on the device — and the γ drafts _draft_early holds, at positions shifted on
        the device by its accepted count. -> the step's TargetPass, or None where no graph fits.
        The host then learns what it launched (the tokens, where each sequence stands) after the
        sync; the engine's next step takes the pass if every sequence still runs."""
        plan, tokens, _ = self._held
        gamma, q = self.config.num_speculative_tokens, self.config.num_speculative_tokens + 1
        assert [s.seq_id for s in plan.seqs] == [item.seq.seq_id for item in scheduled] and tokens.shape[1] == gamma
        last = result.tokens.gather(1, result.num_accepted.view(-1, 1))  # [B, 1]: the token after the accepted
        values = torch.cat([last, tokens], dim=1).view(-1)  # [B·q]: every row's input
        n = len(scheduled)
        graphs = self.runner.graphs
        hidden = graphs.forward("verify", [item.seq.block_table for item in scheduled],
                                [item.start + 1 for item in scheduled], [[0] * q] * n, q=q,
                                device_tokens=DeviceTokens(list(range(n * q)), values),
                                shift=(result.num_accepted, gamma))
        if hidden is None:
            return None
        self.overlapped_steps += 1
        return TargetPass(hidden, graphs.static_batch("verify", q).input_ids, [b * q for b in range(n)], q)

    def _streams_after_drafting(self, seqs: Sequence[Seq], generators: Mapping[int, RowGenerator]
                                ) -> list[tuple[RowGenerator, int]]:
        """(stream, its offset after the draft round) of each of seqs that has one: a draft round
        spends γ vocabularies of a stream whatever it drafts (see propose())."""
        spent = self.config.num_speculative_tokens * self.vocab_size
        return [(g, g.offset + spent) for seq in seqs if isinstance(g := generators.get(seq.seq_id), RowGenerator)]

    def _hold(self, plan: _DraftPlan, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        self._held = (plan, tokens, probs)

    def _keep_held(self, num_drafts: Mapping[int, int]) -> None:
        """The drafts _draft_early made, kept for the sequences that go on, num_drafts[seq_id] of
        them (what the scheduler lets the next verify use, at most γ)."""
        (plan, tokens, probs), self._held = self._held, None
        for seq in plan.seqs:
            self.forget(seq.seq_id)
        gamma = self.config.num_speculative_tokens
        kept = [(b, seq, k) for b, seq in enumerate(plan.seqs)
                if seq.status is SequenceStatus.RUNNING and (k := min(num_drafts.get(seq.seq_id, 0), gamma)) > 0]
        if not kept:
            return
        if len(kept) < len(plan.seqs):
            idx = to_device([b for b, _, _ in kept], tokens.device)
            tokens = tokens.index_select(0, idx)
            probs = None if probs is None else probs.index_select(0, idx)
        self._keep(dataclasses.replace(plan, members=[plan.members[b] for b, _, _ in kept],
                                       seqs=[seq for _, seq, _ in kept], steps=[k for _, _, k in kept],
                                       gens=[plan.gens[b] for b, _, _ in kept]), tokens, probs)

    # -------------------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, scheduled: Sequence[ScheduledSeq], target: TargetPass, num_drafts: Mapping[int, int],
                generators: Mapping[int, RowGenerator]) -> None:
        """After the scheduler's postprocess(): MTP step 1 over every position the step computed
        (writing the MTP KV; the output only where a draft starts), then drafts for the sequences
        in num_drafts (seq_id -> how many, from Scheduler.max_draft_tokens; missing or 0 = none).
        Drafts the step verified are dropped. When verify() drafted already (_draft_early), only
        keeps those drafts.

        Streams: a sequence that sampled this step and goes on spends γ vocabularies of its random
        stream on its draft round, whatever it drafts (a draft step j draws the j-th of them): the
        rule the drafts made before the host knows k follow, kept by every path, so a request's
        tokens do not depend on which path drafted them.

        target: from forward(). generators: seq_id -> the generator of a seeded request."""
        if self._held is not None:
            self._keep_held(num_drafts)
            return
        spent = self._streams_after_drafting([item.seq for item in scheduled if item.samples
                                              and item.seq.status is SequenceStatus.RUNNING], generators)
        self._propose(scheduled, target, num_drafts, generators)
        for g, offset in spent:
            g.offset = offset

    def _propose(self, scheduled: Sequence[ScheduledSeq], target: TargetPass, num_drafts: Mapping[int, int],
                 generators: Mapping[int, RowGenerator]) -> None:
        device, runner = target.hidden.device, self.runner
        rows, members = [], []
        for item, first in zip(scheduled, target.first_rows):
            seq = item.seq
            if item.samples:
                self.forget(seq.seq_id)
            if seq.status is not SequenceStatus.RUNNING:
                continue
            computed = seq.num_computed_tokens - item.start  # known tokens, then the accepted drafts
            rows.extend(range(first, first + computed))
            members.append((seq, item.start, computed))
        if not members:
            return
        plan = self._plan(members, num_drafts, generators)
        graphs = self._draft_graphs()
        if graphs is not None and graphs.run(members, target, rows, plan):
            return
        # A chunk past γ + 1 positions (a prompt's): with graphs, the eager pass below writes the MTP KV
        # alone, and the drafts come from graphs over each member's last position (its step 1 there
        # again, writing the same KV): an eager draft loop is hundreds of launches a step.
        ends = list(itertools.accumulate(n for _, _, n in members))
        lasts = [(seq, start + n - 1, 1) for seq, start, n in members]
        graphed = graphs is not None and bool(plan.seqs) and graphs.buckets(lasts, plan) is not None
        batch = PagedBatch.build([s.block_table for s, _, _ in members], [start for _, start, _ in members],
                                 [n for _, _, n in members], device)
        next_tokens = [t for seq, start, n in members for t in seq.token_ids[start + 1 : start + n + 1]]
        # each drafting sequence continues from its last computed position (its chunk's last row)
        last_host = [] if graphed else [ends[m] - 1 for m in plan.members]
        computed, next_ids, last = to_device_packed(  # one copy
            [np.array(v, dtype=np.int64) for v in (rows, next_tokens, last_host)], device)
        # Every computed position's MTP KV; the rest of step 1 (its indexer over the whole context,
        # attention, MLP) only where a draft starts: a long prefill's other rows would discard it.
        step1, topk = mtp_forward(runner, target.hidden.index_select(0, computed), next_ids, batch, batch.positions,
                                  rows=batch.output_rows(last_host, last))
        if graphed:
            ran = graphs.run(lasts, target, [rows[e - 1] for e in ends], plan)
            assert ran, "run() fits the buckets checked above"
        elif plan.seqs:
            self._draft(plan, step1, topk)

    def _plan(self, members: list[tuple[Seq, int, int]], num_drafts: Mapping[int, int],
              generators: Mapping[int, RowGenerator]) -> _DraftPlan:
        """Which of the members (sequence, chunk start, positions computed) draft, and how."""
        which = [m for m, (seq, _, _) in enumerate(members) if num_drafts.get(seq.seq_id, 0) > 0]
        seqs = [members[m][0] for m in which]
        steps = [num_drafts[s.seq_id] for s in seqs]
        if not self.config.kv_share:
            # baseline step j >= 2 writes at position num_computed + j - 2, which must lie in the
            # sequence's slots (a prefill may not have got its lookahead slots)
            steps = [min(k, s.num_blocks * BLOCK_SIZE - s.num_computed_tokens + 1) for k, s in zip(steps, seqs)]
        if not seqs:
            return _DraftPlan([], [], [], True, None, [])
        tensors = self._draft_sampling.get(seqs, self.runner.device, self.vocab_size, self.eos_token_ids)
        greedy = self.config.acceptance == "target-only" or tensors.all_greedy
        return _DraftPlan(which, seqs, steps, greedy, tensors, [generators.get(s.seq_id) for s in seqs])

    def _draft(self, plan: _DraftPlan, hidden: torch.Tensor, shared_topk: torch.Tensor) -> None:
        """Draft steps 1 .. k' eagerly: hidden [B, D] and shared_topk [B, K] are MTP step 1's
        output and top-k at each drafting sequence's last computed position."""
        runner, cfg, device = self.runner, self.config, hidden.device
        seqs, steps = plan.seqs, plan.steps
        pos0 = [s.num_computed_tokens - 1 for s in seqs]  # step 1's position; step j runs at pos0 + j - 1
        tokens = torch.zeros(len(seqs), max(steps), dtype=torch.long, device=device)
        probs = None if plan.greedy else torch.zeros(len(seqs), max(steps), self.vocab_size, device=device)
        for step in range(max(steps)):
            active = [b for b in range(len(seqs)) if steps[b] > step]
            idx = to_device(active, device)
            if step > 0:
                tables = [seqs[b].block_table for b in active]
                if cfg.kv_share:  # no write, no selection: the batch only names the sequences
                    batch = PagedBatch.build(tables, [pos0[b] for b in active], [1] * len(active), device)
                    positions = to_device([pos0[b] + step for b in active], device)
                    out, _ = mtp_forward(runner, hidden.index_select(0, idx), tokens[idx, step - 1], batch, positions,
                                         topk=shared_topk.index_select(0, idx), write_kv=False)
                else:
                    batch = PagedBatch.build(tables, [pos0[b] + step for b in active], [1] * len(active), device)
                    out, _ = mtp_forward(runner, hidden.index_select(0, idx), tokens[idx, step - 1], batch,
                                         batch.positions)
                hidden = hidden.index_copy(0, idx, out)
            self._pick(plan, step, active, idx, draft_logits(self.model, hidden.index_select(0, idx)), tokens, probs)
        self._keep(plan, tokens, probs)

    def _pick(self, plan: _DraftPlan, step: int, active: list[int], idx: torch.Tensor | None, logits: torch.Tensor,
              tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """The draft tokens of step `step` of the drafting sequences `active` (indices into plan.seqs;
        idx: the same on the device, None when `active` is all of them) from their draft logits [A, V]
        fp32 -> tokens[idx, step], and probs[idx, step] = the q they were drawn from when sampled.
        Eager and graphed paths alike."""
        every = len(active) == len(plan.seqs)  # all of them, in order (most steps): no gathers
        rows = slice(None) if every else idx
        if plan.greedy:
            tokens[rows, step] = logits.argmax(dim=-1)
            return
        q = process_logits(logits, plan.tensors if every else plan.tensors.select(idx))
        tokens[rows, step] = sample(q, [plan.gens[b] for b in active], self.shared_generator)
        probs[rows, step] = q

    def _keep(self, plan: _DraftPlan, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Hold tokens [B, >= max steps] (and probs) as each drafting sequence's next drafts. No host
        sync: the next verify reads them on the device; their host copy travels meanwhile if the
        next verify reads them on the host too (penalties, min_tokens)."""
        host = HostCopy(tokens) if plan.tensors.any_penalties or plan.tensors.any_min_tokens else None
        for b, (seq, k) in enumerate(zip(plan.seqs, plan.steps)):
            self.drafts[seq.seq_id] = Draft(tokens[b, :k], None if probs is None else probs[b, :k], host, b, probs)

    def _accept_graphs(self, bsz: int, width: int, tensors: SamplingTensors, items: list[ScheduledSeq],
                       generators: Mapping[int, RowGenerator]) -> tuple[torch.Tensor, VerifyResult] | None:
        """The acceptance of a graphed verify's rows as one graph (`AcceptGraphs`), where it can be:
        every row verifies `width` >= 1 drafts, and greedily or from its request's random stream."""
        graphs = self.runner.graphs
        if graphs is None or width < 1:
            return None
        gens = [generators.get(item.seq.seq_id) for item in items]
        if not tensors.all_greedy and not all(isinstance(g, RowGenerator) for g in gens):
            return None
        if self._accepts is None or self._accepts.graphs is not graphs:
            from megactx.engine.spec_graphs import AcceptGraphs  # (it imports this module)

            self._accepts = AcceptGraphs(self, graphs)
        if self._accepts.failed:
            return None
        try:
            return self._accepts.run(bsz, width, tensors, gens,
                                     None if tensors.all_greedy else self._draft_probs(items, width))
        except RuntimeError as e:  # a capture the device refused (run() captures before it takes any draw)
            self._accepts.failed = True
            log.warning("megactx: the acceptance graph could not be captured (%s); accepting eagerly from now on "
                        "(same tokens, more host time a step)", e)
            return None

    def _draft_graphs(self) -> DraftGraphs | None:
        """The draft graphs over the runner's graphs (None: the runner runs eagerly)."""
        graphs = self.runner.graphs
        if graphs is None:
            return None
        if self._graphs is None or self._graphs.graphs is not graphs:
            from megactx.engine.spec_graphs import DraftGraphs  # (it imports this module)

            self._graphs = DraftGraphs(self, graphs)
        return self._graphs


@dataclass
class _DraftPlan:
    """Who drafts after one step, decided on the host before any MTP step runs: plan.seqs[b] is
    member plan.members[b] of propose() and drafts plan.steps[b] tokens."""

    members: list[int]
    seqs: list[Seq]
    steps: list[int]
    greedy: bool  # every draft is an argmax (no sampling between draft steps)
    tensors: SamplingTensors | None  # the drafting requests' sampling settings
    gens: list[RowGenerator | None]
