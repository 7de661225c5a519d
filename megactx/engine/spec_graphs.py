"""Speculative steps as CUDA graphs: the acceptance after a graphed verify (`AcceptGraphs`) and the
MTP draft loop (`DraftGraphs`), each replayed from the runner's `StepGraphs` instead of launching
its few dozen ops one by one (at batch 1 each launch costs the host more than its work costs the
device). `spec_decode.SpecDecoder` decides when a step can take them and falls back to its eager
paths otherwise; both give the same tokens. Their sampling settings are static buffers
(`StaticSettings`), filled from a batch's before a replay."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from megactx.engine.rejection_sampler import VerifyResult, accept_with_draws, greedy_verify
from megactx.engine.sampler import RowGenerator, SamplingTensors, process_logits, race, stream_values
from megactx.engine.sampling_params import SamplingParams
from megactx.engine.spec_decode import draft_logits, mtp_forward
from megactx.model.paged import OutputRows, PagedBatch, StagedBuffers, slots_of_range, to_device

if TYPE_CHECKING:
    from megactx.engine.model_runner import StepGraphs
    from megactx.engine.sequence import Sequence as Seq
    from megactx.engine.spec_decode import SpecDecoder, TargetPass, _DraftPlan


SETTINGS_FIELDS = ("temperature", "top_k", "top_p", "min_p")  # what process_logits reads of SamplingTensors


def sampling_stages(t: SamplingTensors) -> tuple[bool, bool, bool, bool]:
    """The sampling stages a batch uses (process_logits' host flags): one graph for each set."""
    return t.any_greedy, t.any_top_k, t.any_top_p, t.any_min_p


class StaticSettings:
    """A graph's sampling settings: a static SamplingTensors of n rows (temperature 1, no truncation
    until filled), whose rows are filled from a batch's before a replay."""

    def __init__(self, n: int, device: torch.device | str, vocab_size: int):
        self.tensors = SamplingTensors.from_params([SamplingParams()] * n, device, vocab_size)

    def fill(self, tensors: SamplingTensors, rows: torch.Tensor | None = None) -> None:
        """Rows `rows` [B] (None: the first B) of the static settings <- the B rows of `tensors`
        (process_logits' fields)."""
        for name in SETTINGS_FIELDS:
            mine, theirs = getattr(self.tensors, name), getattr(tensors, name)
            if rows is None:
                mine[: len(theirs)].copy_(theirs)
            else:
                mine.index_copy_(0, rows, theirs)

    def view(self, bs: int, stages: tuple[bool, bool, bool, bool]) -> SamplingTensors:
        """The first bs rows as process_logits sees them in a graph of the sampling stages `stages`."""
        any_greedy, any_top_k, any_top_p, any_min_p = stages
        rows = {name: getattr(self.tensors, name)[:bs] for name in SETTINGS_FIELDS}
        return dataclasses.replace(self.tensors, **rows, any_greedy=any_greedy, any_top_k=any_top_k,
                                   any_top_p=any_top_p, any_min_p=any_min_p, all_greedy=False)


class AcceptGraphs:
    """verify()'s acceptance as one graph after a graphed verify whose rows all verify K drafts (most
    steps), keyed ("accept", batch bucket, K, which): the logits of the verify graph's rows, then
    greedily (which = "greedy") their argmax against the drafts, else (which = ("sampled", the
    sampling stages in use, whether the drafts have a q)) process_logits on every position, the
    acceptance uniforms and the race's noise from each request's random stream (γ values, then a
    vocabulary, as the eager path draws them: the host advances the streams and sends their
    counters), and the rejection rule. So a step's acceptance is one launch instead of a few dozen
    eager ones, each costing more host time than its work takes the GPU at small batch (an H100's
    host spent ~1.5 ms a γ = 3 step in them, 2026-12-05).

    Inputs are static: the verify graphs' output rows and input tokens, the requests' settings a
    verified position (`SpecDecoder._per_position`, filled when the batch or K changes), the
    streams' keys and counters (sent every step), the drafts' q (copied in when sampled). Outputs:
    the logits [bs·q, V] (for logprobs) and the VerifyResult, views of static buffers valid until
    the next replay."""

    def __init__(self, spec: SpecDecoder, graphs: StepGraphs):
        self.spec, self.graphs = spec, graphs
        gamma, n, dev = spec.config.num_speculative_tokens, graphs.max_num_seqs, spec.runner.device
        self.q = gamma + 1
        self.streams = StagedBuffers({"keys": ((n,), torch.long), "uniforms": ((n,), torch.long),
                                      "noise": ((n,), torch.long)}, dev)
        self.tokens = torch.zeros(n, self.q, dtype=torch.long, device=dev)
        self.num_accepted = torch.zeros(n, dtype=torch.long, device=dev)
        self.settings: StaticSettings | None = None  # sampled: a row a verified position, those of _filled
        self.draft_q: torch.Tensor | None = None  # [n, γ, V] fp32
        self._filled: SamplingTensors | None = None
        self.failed = False  # a capture raised: SpecDecoder accepts eagerly instead

    def run(self, bsz: int, width: int, tensors: SamplingTensors, gens: list[RowGenerator | None],
            draft_q: torch.Tensor | None) -> tuple[torch.Tensor, VerifyResult] | None:
        """The acceptance of bsz sequences verifying `width` drafts each from the verify graphs'
        rows -> (logits [bs·q, V], VerifyResult of the bsz rows); None when no batch bucket fits.
        draft_q: [bsz, width, V], the drafts' q (sampled), or None (greedy, or drafts q one-hot)."""
        bs = next((b for b in self.graphs.batch_buckets if b >= bsz), None)
        if bs is None:
            return None
        vocab = self.spec.vocab_size
        if tensors.all_greedy:
            which = "greedy"
        else:
            which = ("sampled", *sampling_stages(tensors), draft_q is not None)
        graph = self.graphs.captured(("accept", bs, width, which), lambda: self._build(bs, width, which), lambda: None)
        if not tensors.all_greedy:
            host = self.streams.host()
            host["keys"][:], host["uniforms"][:], host["noise"][:] = 0, 0, 0
            gamma = self.q - 1
            for b, g in enumerate(gens):  # as draw_uniforms (γ values a row), then the race's noise (a vocabulary)
                host["keys"][b], host["uniforms"][b] = g.key, g.offset
                host["noise"][b] = g.offset + gamma
                g.offset += gamma + vocab
            self.streams.send()
            per_position = self.spec._per_position(tensors, width)  # [bsz·(width + 1)], kept while the batch stays
            if self._filled is not per_position:
                self.settings.fill(per_position)
                self._filled = per_position
            if draft_q is not None:
                self.draft_q[:bsz, :width].copy_(draft_q)
        graph.replay()
        return graph.outputs, VerifyResult(self.tokens[:bsz, : width + 1], self.num_accepted[:bsz])

    def _build(self, bs: int, width: int, which: str | tuple) -> Callable[[], torch.Tensor]:
        spec, graphs, q = self.spec, self.graphs, self.q
        model, vocab = spec.model, spec.vocab_size
        hidden = graphs.hidden_rows(q)[: bs * q]
        drafted = graphs.static_batch("verify", q).input_ids.view(-1, q)[:bs, 1 : width + 1]
        logits = graphs.output("accept-logits", bs * q, vocab, capacity=graphs.max_num_seqs * q)
        tokens, num_accepted = self.tokens[:bs, : width + 1], self.num_accepted[:bs]
        if which == "greedy":
            def accept() -> torch.Tensor:
                logits.copy_(model.compute_logits(hidden))
                result = greedy_verify(logits.view(bs, q, vocab)[:, : width + 1].argmax(dim=-1), drafted)
                tokens.copy_(result.tokens)
                num_accepted.copy_(result.num_accepted)
                return logits

            return accept
        _, *stages, has_q = which
        n, dev = graphs.max_num_seqs, self.tokens.device
        if self.settings is None:
            self.settings = StaticSettings(n * q, dev, vocab)  # a row a verified position
        if has_q and self.draft_q is None:
            self.draft_q = torch.zeros(n, q - 1, vocab, device=dev)
        settings = self.settings.view(bs * (width + 1), tuple(stages))
        fields = self.streams.device
        keys, uniform_at, noise_at = fields["keys"][:bs], fields["uniforms"][:bs], fields["noise"][:bs]
        draft_q = self.draft_q[:bs, :width] if has_q else None

        def accept() -> torch.Tensor:
            logits.copy_(model.compute_logits(hidden))
            rows = logits.view(bs, q, vocab)[:, : width + 1].reshape(bs * (width + 1), vocab)
            p = process_logits(rows, settings).view(bs, width + 1, vocab)
            uniforms = stream_values(keys, uniform_at, q - 1, exponential=False)[:, :width]
            noise = stream_values(keys, noise_at, vocab, exponential=True)
            result = accept_with_draws(p, drafted, draft_q, None, uniforms, noise)
            tokens.copy_(result.tokens)
            num_accepted.copy_(result.num_accepted)
            return logits

        return accept


class DraftGraphs:
    """propose() as graphs: MTP step 1 over the positions each sequence computed (their KV; the
    rest of the layer for the last one alone), then draft steps 2 .. γ, for B sequences of at most
    q = γ + 1 computed positions (so: after a decode step), keyed ("draft", batch bucket, key
    bucket, which) in the runner's `StepGraphs`.

    Granularity. Nothing between two draft steps is decided on the host, so step 1 and steps
    2 .. γ are one graph, one launch for the whole draft loop — what speculation at batch 1 needs,
    where every eager kernel launch costs more than its work: with their argmax for greedy drafts
    (greedy requests, or the target-only acceptance; which = "loop"), or for sampled drafts with
    process_logits and the exponential race of `sample` (which = ("sampled", the sampling stages in
    use)), the noise of draft step j being the next vocabulary of each row's random stream — read
    from static key and counter buffers, so the replay draws what the eager loop would, and the
    host advances the streams. Sampled drafts of rows without a stream (a caller's torch.Generator
    or the shared one) run a graph a draft step (which = j; per step index, since each reads its
    own row of the per-step metadata uploaded once before step 1), with the sampling eager between
    replays, writing the token the next graph embeds into a static buffer (no host sync). Step 1
    alone (which = 0) also serves a step in which no sequence drafts.

    Rows. Sequence b's computed positions are rows b·q .. of `batch` (padding rows after them);
    its last one feeds the draft steps. Every graph computes every step for all B rows: a sequence
    whose drafts end earlier (or that drafts nothing) keeps computing, but from then on writes
    nothing (slot -1) and its tokens are dropped, as the eager loop never computes them. KVShare
    steps write and select nothing; baseline steps write at pos0 + j - 1 and index up to there.

    State between graphs (hidden, top-k, tokens) and each step's logits live in static buffers
    allocated outside the graphs' memory pool; step 1 reads its hidden states from the verify graphs'
    output buffer (`StepGraphs.hidden_rows`), where a graphed verify left them."""

    def __init__(self, spec: SpecDecoder, graphs: StepGraphs):
        runner, cfg = spec.runner, spec.model.cfg
        self.spec, self.graphs, self.runner = spec, graphs, runner
        self.gamma = gamma = spec.config.num_speculative_tokens
        self.q = q = gamma + 1
        self.kv_share = spec.config.kv_share
        n, dev = graphs.max_num_seqs, runner.device
        # step 1's batch (input_ids: the next tokens); the graphs' other inputs, and the indices of the
        # eager ops around them, are fields of its buffers: run() sends all of them in the fill's one copy
        self.batch = graphs.static_batch("draft", q, extra={
            "last_rows": ((n,), torch.long),  # row of each sequence's last position
            # draft steps 2 .. γ: row j - 1 of each is step j + 1's (pos0 + j)
            "positions": ((gamma - 1, n), torch.long),
            "slots": ((gamma - 1, n), torch.long),
            "key_len": ((gamma - 1, n), torch.int32),
            # the sampled loop's random streams: each row's key, and the values it drew before the loop
            "keys": ((n,), torch.long),
            "offsets": ((n,), torch.long),
            "members": ((n,), torch.long),  # the drafting sequences' rows (plan.members)
            "hidden_from": ((n * q,), torch.long),  # rows of the step's hidden states -> rows of hidden_in
            "hidden_to": ((n * q,), torch.long),
        })
        fields = self.batch.buffers.device
        self.last_rows, self.positions, self.slots, self.key_len = (
            fields[name] for name in ("last_rows", "positions", "slots", "key_len"))
        self.keys, self.offsets = fields["keys"], fields["offsets"]
        # step 1's h: the verify graphs' output, whose rows are this batch's when every sequence of a
        # graphed verify goes on (most steps: then there is nothing to copy)
        self.hidden_in = graphs.hidden_rows(q)  # [n·q, D]
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=spec.model.dtype, device=dev)  # fed from step to step
        self.topk = torch.full((n, cfg.index_topk), -1, dtype=torch.int32, device=dev)  # step 1's, for KVShare
        self.tokens = torch.zeros(n, gamma, dtype=torch.long, device=dev)  # tokens[:, j]: step j + 1's draft
        self.seq_idx = torch.arange(n, dtype=torch.int32, device=dev)
        # the sampled loop's sampling settings (benign on rows that draft nothing: their tokens are
        # dropped), and the q each draft was drawn from; at first use
        self.settings: StaticSettings | None = None
        self.probs: torch.Tensor | None = None  # [n, γ, V] fp32
        self._filled: tuple[SamplingTensors, list[int]] | None = None  # whose keys and settings the rows hold
        self.early_rounds = 0  # draft rounds run before the verify's host sync (run(accepted=...))

    def run(self, members: list[tuple[Seq, int, int]], target: TargetPass, rows: list[int],
            plan: _DraftPlan, accepted: VerifyResult | None = None) -> bool:
        """propose()'s MTP steps from graphs: members (sequence, chunk start, positions computed),
        target: the step's forward, rows [Σ computed]: the computed positions' rows in it. Holds the
        drafts of plan.seqs and returns True; False (nothing run) when no graph fits.

        accepted: before the verify's host sync (SpecDecoder._draft_early; KVShare, one loop graph):
        members' positions are the verified ones, and what follows from the accepted counts — each
        row's next token, the row the drafts start from, their positions — is put in place on the
        device. The drafts are then held (SpecDecoder._hold) until propose() keeps them."""
        q, device = self.q, self.runner.device
        if any(n > q for _, _, n in members):
            return False
        pos0 = [start + n - 1 for _, start, n in members]  # each sequence's last computed position
        early = accepted is not None
        assert not early or (self.kv_share and (plan.greedy or all(isinstance(g, RowGenerator) for g in plan.gens)))
        steps = [0] * len(members)
        for m, k in zip(plan.members, plan.steps):
            steps[m] = k
        buckets = self.buckets(members, plan)
        if buckets is None:
            return False
        bs, keys = buckets
        # one graph for the whole loop when drafts are argmaxes, or sampled from streams (every request
        # has one in the engine); a draft step a graph otherwise
        sampled_loop = bool(plan.seqs) and not plan.greedy and all(isinstance(g, RowGenerator) for g in plan.gens)
        loop = sampled_loop or (plan.greedy and bool(plan.seqs))
        # capture first: a capture clears the static inputs
        which = [self._loop_key(plan)] if loop else list(range(max(plan.steps, default=1)))
        graphs = [self.graphs.captured(("draft", bs, keys, w), lambda w=w: self._build(bs, keys, w), self._clear)
                  for w in which]

        # every input, written into the batch's host twin, goes in the fill's one copy
        host = self.batch.buffers.host()
        filled = [m * q + i for m, (_, _, n) in enumerate(members) for i in range(n)]  # the fill's rows of them
        # after a verify graph (its output is hidden_in) whose sequences all go on, they are there already
        in_place = rows == filled and target.hidden.data_ptr() == self.hidden_in.data_ptr()
        if not in_place:
            host["hidden_from"][: len(rows)], host["hidden_to"][: len(rows)] = rows, filled
        last = host["last_rows"]
        last[:] = np.arange(last.shape[0]) * q
        if not early:  # (early: + the accepted drafts, on the device)
            last[: len(members)] += [n - 1 for _, _, n in members]
        if self.gamma > 1:
            host["positions"][:] = np.arange(1, self.gamma)[:, None]  # [γ - 1, n]: pos0 + j, pos0 = 0 on padding
            host["positions"][:, : len(members)] += [start for _, start, _ in members] if early else pos0
            if not self.kv_share:  # step j + 1 of sequence b writes at pos0 + j while j < steps[b]
                slots, key_len = host["slots"], host["key_len"]
                slots[:], key_len[:] = -1, 0
                for b, ((seq, _, _), p, k) in enumerate(zip(members, pos0, steps)):
                    if k > 1:
                        slots[: k - 1, b] = slots_of_range(seq.block_table, p + 1, k - 1)
                        key_len[: k - 1, b] = range(p + 2, p + k + 1)
        host["members"][: len(plan.members)] = plan.members
        new_streams = sampled_loop and self._stage_streams(plan, host)
        self.batch.fill(bs, [seq.block_table for seq, _, _ in members], [start for _, start, _ in members],
                        [[0] * n if early else seq.token_ids[start + 1 : start + n + 1] for seq, start, n in members])
        fields = self.batch.buffers.device
        if early:  # row b·q + i's next token is the verify's token i of sequence b; drafts start at its last accepted
            width, num_accepted = accepted.tokens.shape[1], accepted.num_accepted
            self.batch.input_ids[: len(members) * q].view(len(members), q)[:, :width].copy_(
                accepted.tokens.clamp_min(0))
            self.last_rows[: len(members)] += num_accepted
            if self.gamma > 1:
                self.positions[:, : len(members)] += num_accepted
        if not in_place:
            self.hidden_in.index_copy_(0, fields["hidden_to"][: len(rows)],
                                       target.hidden.index_select(0, fields["hidden_from"][: len(rows)]))

        if not plan.seqs:
            graphs[0].replay()
            return True
        member_rows = fields["members"][: len(plan.members)]
        keep = self.spec._hold if early else self.spec._keep
        self.early_rounds += early
        if sampled_loop:
            if new_streams:
                self.settings.fill(plan.tensors, member_rows)
            graphs[0].replay()
            keep(plan, self.tokens.index_select(0, member_rows), self.probs.index_select(0, member_rows))
            return True
        if loop:
            graphs[0].replay()
            keep(plan, self.tokens.index_select(0, member_rows), None)
            return True
        tokens = torch.zeros(len(plan.seqs), max(plan.steps), dtype=torch.long, device=device)
        probs = torch.zeros(len(plan.seqs), max(plan.steps), self.spec.vocab_size, device=device)
        for step, graph in enumerate(graphs):
            graph.replay()
            active = [b for b in range(len(plan.seqs)) if plan.steps[b] > step]
            # all of plan.seqs (most steps): no index to copy or gather with
            idx = None if len(active) == len(plan.seqs) else to_device(active, device)
            rows = member_rows if idx is None else member_rows[idx]
            self.spec._pick(plan, step, active, idx, graph.outputs.index_select(0, rows), tokens, probs)
            if step + 1 < len(graphs):  # what the next graph embeds
                self.tokens[rows, step] = tokens[:, step] if idx is None else tokens[idx, step]
        self.spec._keep(plan, tokens, probs)
        return True

    def buckets(self, members: list[tuple[Seq, int, int]], plan: _DraftPlan) -> tuple[int, int] | None:
        """(batch bucket, key bucket) of run()'s graphs for these members and plan, None if past
        the largest."""
        pos0 = [start + n - 1 for _, start, n in members]
        max_keys = max(pos0) + 1
        if not self.kv_share:  # baseline step j + 1 reads keys up to pos0 + j
            max_keys = max(max_keys, max(pos0[m] + k for m, k in zip(plan.members, plan.steps)) if plan.seqs else 0)
        return self.graphs.bucket(len(members), max_keys)

    @staticmethod
    def _loop_key(plan: _DraftPlan) -> str | tuple:
        """The loop graph of a plan: "loop" for argmax drafts; for sampled ones, one graph for each
        set of the sampling stages the drafting requests use (process_logits' host flags)."""
        if plan.greedy:
            return "loop"
        return ("sampled", *sampling_stages(plan.tensors))

    def _stage_streams(self, plan: _DraftPlan, host: dict[str, np.ndarray]) -> bool:
        """The sampled loop's streams for the drafting sequences' rows, into the host twin (then
        advanced on the host by the values the eager loop would draw: a vocabulary a draft step).
        -> whether the rows' settings must be filled too: keys and settings are those of the last
        loop while the drafting requests stay (most steps)."""
        offsets = host["offsets"]
        offsets[:] = 0
        offsets[plan.members] = [g.offset for g in plan.gens]
        for g, k in zip(plan.gens, plan.steps):
            g.offset += k * self.spec.vocab_size
        if self._filled is not None and self._filled[0] is plan.tensors and self._filled[1] == plan.members:
            return False
        keys = host["keys"]
        keys[:] = 0
        keys[plan.members] = [g.key for g in plan.gens]
        self._filled = (plan.tensors, list(plan.members))
        return True

    def _clear(self) -> None:
        self.batch.clear()
        self.slots.fill_(-1)
        self.key_len.zero_()

    def _sampling_buffers(self) -> None:
        """The sampled loop's static settings (temperature 1, no truncation until filled) and q buffer."""
        if self.probs is not None:
            return
        n, dev, vocab = self.graphs.max_num_seqs, self.runner.device, self.spec.vocab_size
        self.settings = StaticSettings(n, dev, vocab)
        self.probs = torch.zeros(n, self.gamma, vocab, device=dev)

    def _build(self, bs: int, max_keys: int, which: int | str | tuple) -> Callable[[], torch.Tensor | None]:
        if isinstance(which, int):
            return self._step(bs, max_keys, which)
        steps = [self._step(bs, max_keys, j) for j in range(self.gamma)]
        if which == "loop":
            def loop() -> None:
                for j, step in enumerate(steps):
                    self.tokens[:bs, j].copy_(step().argmax(dim=-1))

            return loop

        # sampled drafts: process_logits and the exponential race of `sample`, the noise of draft
        # step j being the next vocabulary of each row's stream, as the eager loop draws it
        self._sampling_buffers()
        settings = self.settings.view(bs, which[1:])  # views: filled before replays
        vocab, keys, offsets = self.spec.vocab_size, self.keys[:bs], self.offsets[:bs]

        def sampled_loop() -> None:
            for j, step in enumerate(steps):
                q = process_logits(step(), settings)
                noise = stream_values(keys, offsets + j * vocab, vocab, exponential=True)
                self.tokens[:bs, j].copy_(race(q, noise))
                self.probs[:bs, j].copy_(q)

        return sampled_loop

    def _step(self, bs: int, max_keys: int, j: int) -> Callable[[], torch.Tensor]:
        """Draft step j + 1 over the first bs rows -> its draft logits [bs, V] fp32."""
        runner, model = self.runner, self.spec.model
        first = self.batch.view(bs, max_keys)
        hidden, topk, logits = self.hidden[:bs], self.topk[:bs], self.graphs.output("logits", bs, model.cfg.vocab_size)
        tokens = self.tokens[:bs, j - 1] if j else None  # what the step embeds: the previous step's drafts
        if j == 0:
            rows, last = bs * self.q, self.last_rows[:bs]
            last_keys = torch.full((bs,), max_keys, dtype=torch.int32)  # (host) the key bucket bounds them

            def step() -> torch.Tensor:  # every row writes its MTP KV; the sequences' last rows go on
                out, selected = mtp_forward(runner, self.hidden_in[:rows], self.batch.input_ids[:rows], first,
                                            first.positions, rows=OutputRows(last, first.select(last, last_keys)))
                hidden.copy_(out)
                topk.copy_(selected)
                return logits.copy_(draft_logits(model, hidden))
        elif self.kv_share:
            positions = self.positions[j - 1, :bs]

            def step() -> torch.Tensor:  # `first` only names the cache: nothing is written or selected
                out, _ = mtp_forward(runner, hidden, tokens, first, positions, topk=topk, write_kv=False)
                hidden.copy_(out)
                return logits.copy_(draft_logits(model, hidden))
        else:
            batch = PagedBatch(self.positions[j - 1, :bs], self.slots[j - 1, :bs], self.seq_idx[:bs],
                               self.key_len[j - 1, :bs], self.batch.block_table[:bs],
                               torch.full((bs,), max_keys, dtype=torch.int32))

            def step() -> torch.Tensor:
                out, _ = mtp_forward(runner, hidden, tokens, batch, batch.positions)
                hidden.copy_(out)
                return logits.copy_(draft_logits(model, hidden))
        return step
