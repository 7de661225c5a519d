"""Turning a step's logits into tokens: penalties, the processed distribution, seeded sampling and
logprobs, batched over requests.

The pipeline of one step (`Sampler.__call__`):

    raw logits ─► logprobs (of the raw model distribution, as vLLM reports them)
        └► min_tokens mask ─► penalties ─► process_logits ─► probs ─► sample ─► tokens

`process_logits` is a function of its own because speculative decoding's rejection sampler needs
the same processed distribution for the target model (p) and the draft (q).

Nothing here loops over the vocabulary in Python, and nothing reads a device value on the host:
which optional stages run is decided from the requests' `SamplingParams` when the per-step
`SamplingTensors` are built (gpt-fast style). A seeded request draws its noise from a stream of its
own (`RowGenerator`: counter-based, `megactx.kernels.rng`), so its tokens do not depend on the batch;
the seeded rows of a batch draw together, one launch a draw whatever their number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from megactx.engine.sampling_params import SamplingParams
from megactx.kernels import reference
from megactx.kernels.reference import stream_key
from megactx.model.paged import to_device, to_device_packed

if TYPE_CHECKING:
    from megactx.engine.sequence import Sequence as Seq

# Padding of token-id tensors ([B, N] with rows of different lengths).
PAD_ID = -1


class SamplingRow(NamedTuple):
    """One request's row of SamplingTensors, as host values (made once a request)."""

    floats: tuple[float, ...]  # temperature, top_p, min_p, repetition / presence / frequency penalty
    ints: tuple[int, int]  # top_k ("off" = vocab), min_tokens
    stops: tuple[int, ...]  # stop_token_ids + EOS (unless ignore_eos)
    logprobs: int | None
    argmax_only: bool  # its token is the argmax of the raw logits (Sampler's stages all off)

    @classmethod
    def of(cls, p: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> SamplingRow:
        return cls((p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty),
                   (min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size, p.min_tokens),
                   tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids)), p.logprobs,
                   p.greedy and p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
                   and p.min_tokens == 0 and p.logprobs is None)


@dataclass
class SamplingTensors:
    """The per-row settings of one batch, as device tensors, plus host flags that say which
    stages any row needs (so disabled stages cost nothing and need no host sync).

    Rows are requests (or, for the rejection sampler, positions; see `select`). Shapes: [B].
    """

    temperature: torch.Tensor  # [B] fp32; 0 = greedy
    top_k: torch.Tensor  # [B] int64 in [1, vocab]; "off" is stored as vocab
    top_p: torch.Tensor  # [B] fp32 in (0, 1]
    min_p: torch.Tensor  # [B] fp32 in [0, 1]
    repetition_penalty: torch.Tensor  # [B] fp32, 1 = off
    presence_penalty: torch.Tensor  # [B] fp32
    frequency_penalty: torch.Tensor  # [B] fp32
    min_tokens: torch.Tensor  # [B] int64
    stop_token_ids: torch.Tensor  # [B, S] int64, PAD_ID padded: EOS (unless ignore_eos) + stop_token_ids
    # host flags
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool
    any_min_tokens: bool
    max_num_logprobs: int | None  # None: no row wants logprobs

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str, vocab_size: int,
                    eos_token_ids: Sequence[int] = ()) -> SamplingTensors:
        """Build the tensors for one batch of requests (one host-to-device copy, no sync).

        eos_token_ids: the model's EOS ids; with `min_tokens`, they and `stop_token_ids` are
        masked until a row has generated that many tokens."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        return cls.from_rows([SamplingRow.of(p, vocab_size, eos_token_ids) for p in params], device, vocab_size)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], device: torch.device | str, vocab_size: int) -> SamplingTensors:
        """The tensors of rows made by SamplingRow.of (a server's batch changes most steps, and each
        request's row is made once: `SamplingTensorsCache`)."""
        if not rows:
            raise ValueError("params must hold one SamplingParams per row; got an empty list")
        width = max(len(r.stops) for r in rows)
        logprobs = [r.logprobs for r in rows if r.logprobs is not None]
        f = np.array([r.floats for r in rows], dtype=np.float32)  # [B, 6]
        i = np.array([r.ints for r in rows], dtype=np.int64)  # [B, 2]
        floats, ints, stops = to_device_packed([
            f.T.copy(), i.T.copy(),
            np.array([r.stops + (PAD_ID,) * (width - len(r.stops)) for r in rows], dtype=np.int64)
            .reshape(len(rows), width)], device)
        temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty = floats
        greedy = f[:, 0] == 0
        return cls(
            temperature=temperature, top_k=ints[0], top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, min_tokens=ints[1], stop_token_ids=stops,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_top_k=bool((i[:, 0] < vocab_size).any()),
            any_top_p=bool((f[:, 1] < 1).any()),
            any_min_p=bool((f[:, 2] > 0).any()),
            any_penalties=bool((f[:, 3] != 1).any() or f[:, 4:].any()),
            any_min_tokens=bool((i[:, 1] > 0).any()) and width > 0,
            max_num_logprobs=max(logprobs) if logprobs else None,
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The settings for rows `rows` ([R] int64 indices into B), e.g. one row per verified
        position in speculative decoding. Host flags stay those of the whole batch (a superset)."""
        gathered = {name: getattr(self, name).index_select(0, rows)
                    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                 "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids")}
        return replace(self, **gathered)


class SamplingTensorsCache:
    """The SamplingTensors of the last batch of sequences, rebuilt only when the batch changes: a
    decode step mostly samples for the sequences of the one before. A sequence's parameters are
    fixed once it is added, so its row (`SamplingRow`) is made once: a server's batch changes most
    steps (a request ends, another joins), and a rebuild then costs one array of cached rows and
    one host-to-device copy — or nothing, when every row is a plain argmax (`argmax_only`)."""

    def __init__(self):
        self._key: tuple[int, ...] | None = None
        self._tensors: SamplingTensors | None = None
        self._rows: dict[int, SamplingRow] = {}  # seq_id -> its row, for the sequences of the last batch
        self._argmax_only = False

    def _batch(self, seqs: Sequence[Seq], vocab_size: int, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        key = tuple(s.seq_id for s in seqs)
        if key != self._key:
            cached = self._rows
            self._rows = {s.seq_id: cached.get(s.seq_id) or SamplingRow.of(s.sampling_params, vocab_size, eos_token_ids)
                          for s in seqs}
            self._key, self._tensors = key, None
            self._argmax_only = all(r.argmax_only for r in self._rows.values())
        return key

    def argmax_only(self, seqs: Sequence[Seq], vocab_size: int, eos_token_ids: Sequence[int] = ()) -> bool:
        """Whether every row's token is the argmax of its raw logits (greedy; no penalty, no
        min_tokens, no logprobs): the sampler then needs none of the tensors."""
        self._batch(seqs, vocab_size, eos_token_ids)
        return self._argmax_only

    def get(self, seqs: Sequence[Seq], device: torch.device | str, vocab_size: int,
            eos_token_ids: Sequence[int] = ()) -> SamplingTensors:
        """The tensors of `seqs` (each with seq_id and sampling_params), in their order."""
        key = self._batch(seqs, vocab_size, eos_token_ids)
        if self._tensors is None:
            self._tensors = SamplingTensors.from_rows([self._rows[i] for i in key], device, vocab_size)
        return self._tensors


@dataclass
class SamplingBatch:
    """What the sampler needs about one step's rows besides the logits.

    prompt_token_ids / output_token_ids: [B, P] / [B, N] int64, PAD_ID padded (see
    `pad_token_ids`); they feed the penalties and `min_tokens`. None when no row needs them.
    generators: per row, the request's own stream (seeded requests, see `make_generator`; or any
    torch.Generator) or None to draw from the sampler's shared generator.
    """

    tensors: SamplingTensors
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    generators: Sequence[RowSource] | None = None


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [B] int64
    # Logprobs of the raw model distribution (log_softmax of the logits before penalties,
    # temperature and truncation, like vLLM's default); None when no row asked for logprobs.
    logprobs: torch.Tensor | None = None  # [B] fp32, of the chosen token
    top_logprobs: torch.Tensor | None = None  # [B, N] fp32, N = the batch's largest `logprobs`, descending
    top_token_ids: torch.Tensor | None = None  # [B, N] int64


class RowGenerator:
    """The random stream a seeded request keeps for its whole life: a key (from the seed) and a
    counter of the values drawn so far (`megactx.kernels.rng` defines the values). Each draw takes
    the next values of the stream, so the request's tokens depend only on its seed and its own
    history, never on the other rows of the batch; and the rows of a batch draw in one launch."""

    __slots__ = ("key", "offset")

    def __init__(self, seed: int):
        self.key = stream_key(seed)
        self.offset = 0


def make_generator(seed: int) -> RowGenerator:
    """The stream of a request with `seed` (see RowGenerator)."""
    return RowGenerator(seed)


# What a row of `generators` may be: a request's RowGenerator (the rows draw together) or a
# torch.Generator (drawn from on its own, a launch a row), or None (the shared generator).
RowSource = RowGenerator | torch.Generator | None


def pad_token_ids(token_ids: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """Rows of different lengths -> [B, max_len] int64, PAD_ID padded (at least one column)."""
    width = max(1, max((len(row) for row in token_ids), default=0))
    return to_device([list(row) + [PAD_ID] * (width - len(row)) for row in token_ids], device, torch.int64)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocabulary token occurs in each row: token_ids [B, N] int64 (PAD_ID padded)
    -> [B, vocab_size] fp32."""
    bsz = token_ids.shape[0]
    # Padding is sent to an extra column that is dropped, so no mask or host-side filtering is needed.
    index = torch.where(token_ids < 0, vocab_size, token_ids)
    counts = torch.zeros(bsz, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, tensors: SamplingTensors, prompt_token_ids: torch.Tensor | None,
                    output_token_ids: torch.Tensor | None) -> torch.Tensor:
    """Repetition, presence and frequency penalties. logits: [B, V] fp32; token ids: [B, *] int64,
    PAD_ID padded, or None for none. Returns new logits [B, V] fp32.

    - repetition (HF / vLLM): a token seen in the prompt or the output has its logit divided by the
      penalty if positive, multiplied by it if negative (so a penalty > 1 always makes it rarer);
    - frequency and presence (OpenAI), output tokens only:
      logit -= frequency_penalty * count + presence_penalty * (count > 0).
    """
    bsz, vocab = logits.shape
    zeros = torch.zeros(bsz, vocab, dtype=torch.float32, device=logits.device)
    prompt = token_counts(prompt_token_ids, vocab) if prompt_token_ids is not None else zeros
    output = token_counts(output_token_ids, vocab) if output_token_ids is not None else zeros
    rep = tensors.repetition_penalty[:, None]
    seen = (prompt + output) > 0
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - tensors.frequency_penalty[:, None] * output
            - tensors.presence_penalty[:, None] * (output > 0).float())


def mask_stop_tokens_before_min(logits: torch.Tensor, tensors: SamplingTensors,
                                output_token_ids: torch.Tensor | None) -> torch.Tensor:
    """`min_tokens`: rows that have generated fewer tokens than their minimum cannot pick a stop
    token (EOS or stop_token_ids). logits [B, V] fp32 -> [B, V] fp32."""
    stops = tensors.stop_token_ids  # [B, S]
    if stops.shape[1] == 0:
        return logits
    generated = (output_token_ids >= 0).sum(-1) if output_token_ids is not None else torch.zeros_like(
        tensors.min_tokens)
    active = (generated < tensors.min_tokens)[:, None] & (stops >= 0)  # [B, S]
    vocab = logits.shape[1]
    blocked = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    blocked.scatter_(1, torch.where(active, stops, vocab), True)
    return logits.masked_fill(blocked[:, :vocab], float("-inf"))


def process_logits(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """The distribution a row samples from. logits [B, V] fp32 (after penalties) -> probs [B, V] fp32,
    each row summing to 1.

    In order: temperature (rows with temperature 0 get a one-hot at the argmax of `logits`), top-k
    (exactly the k most likely; ties broken towards the lower token id), top-p (the smallest set of
    most likely tokens whose probability sums to >= top_p; the top token always stays), min-p (drop
    tokens with p < min_p * p_max), then renormalise. The rejection sampler calls this for both the
    target (p) and the draft (q) distribution.
    """
    greedy = tensors.temperature == 0  # [B]
    temperature = torch.where(greedy, 1.0, tensors.temperature)
    scaled = logits / temperature[:, None]
    if tensors.any_top_k or tensors.any_top_p:
        probs = _truncate_sorted(scaled, tensors)
    else:
        probs = torch.softmax(scaled, dim=-1)
        if tensors.any_min_p:
            p_max = probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < tensors.min_p[:, None] * p_max, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if tensors.any_greedy:
        # (a scatter, not F.one_hot: nothing that could read the device on the host inside a CUDA graph)
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _truncate_sorted(scaled: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """top-k, top-p and min-p in sorted order, where each is a mask on ranks. scaled [B, V] -> probs
    [B, V] (not renormalised)."""
    # A stable sort makes ties deterministic (lower token id first) and independent of the batch.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(scaled.shape[1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= tensors.top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # the top-k distribution, renormalised
    if tensors.any_top_p:
        cumulative = sorted_probs.cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
        # Keep a token while the mass before it is short of top_p. Rows with top_p = 1 are exempt:
        # rounding can make the cumulative sum reach 1 before the last nonzero token.
        drop = (before >= tensors.top_p[:, None]) & (tensors.top_p < 1)[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    if tensors.any_min_p:
        # p / p_max does not change under renormalisation, so the threshold can use these probs.
        sorted_probs = sorted_probs.masked_fill(sorted_probs < tensors.min_p[:, None] * sorted_probs[:, :1], 0.0)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def sample(probs: torch.Tensor, generators: Sequence[RowSource] | None = None,
           shared_generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row. probs [B, V] fp32 (rows sum to 1) -> tokens [B] int64.

    Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i (it is the
    Gumbel-max trick with E = exp(-G)) and needs no cumulative sum or host sync. generators: per
    row, the generator of a seeded request or None; rows without one (and all rows when
    `generators` is None) draw from `shared_generator` (None: torch's default generator). A one-hot
    row (greedy) always yields its hot token.
    """
    # A seeded row draws exactly V values from its own generator each step, so its noise is the same
    # whether it runs alone or batched.
    return race(probs, draw_rows(torch.empty_like(probs), EXPONENTIAL, generators, shared_generator))


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) of probs [B, V] with Exp(1) noise [B, V] (overwritten) -> tokens [B] int64."""
    # E can round to 0; a tiny floor keeps p / E finite (0 / 0 would be NaN, which argmax prefers).
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


UNIFORM, EXPONENTIAL = "uniform", "exponential"  # the draws of draw_rows: U(0, 1), Exp(1)


def draw_rows(out: torch.Tensor, kind: str, generators: Sequence[RowSource] | None,
              shared_generator: torch.Generator | None) -> torch.Tensor:
    """Fill out [B, ...] fp32 in place with `kind` draws (UNIFORM or EXPONENTIAL): row b from
    generators[b] where it has one, the other rows from shared_generator (drawn for the whole
    tensor, and only when some row has no generator of its own). The RowGenerator rows draw in one
    launch and advance their counters by a row's size. -> out."""
    rows = [(row, g) for row, g in enumerate(generators or ()) if g is not None]
    if len(rows) < out.shape[0]:
        _torch_draw(out, kind, shared_generator)
    streams = []
    for row, g in rows:
        if isinstance(g, RowGenerator):
            streams.append((row, g))
        else:
            _torch_draw(out[row], kind, g)
    if streams:
        _draw_streams(out, kind == EXPONENTIAL, streams)
    return out


def _draw_streams(out: torch.Tensor, exponential: bool, streams: list[tuple[int, RowGenerator]]) -> None:
    """The rows of out that have a RowGenerator (streams: (row, generator) in row order) in one
    launch: the Triton kernel on CUDA, its twin elsewhere (a CPU has no launches to save). Each
    stream advances by a row's size."""
    width = out[0].numel()
    offsets = [g.offset for _, g in streams]  # values each stream drew before
    for _, g in streams:
        g.offset += width
    if out.device.type == "cuda" and len(streams) == 1 and out[streams[0][0]].is_contiguous():
        from megactx.kernels.rng import one_row_random

        (row, g), = streams  # key and offset as kernel arguments: no copy to the device
        one_row_random(g.key, offsets[0], width, exponential, out[row])
        return
    # [S, 3]: key, values drawn before, row of out: one copy to the device
    state = to_device(np.array([(g.key, offset, row) for (row, g), offset in zip(streams, offsets)], dtype=np.int64),
                      out.device)
    if len(streams) == out.shape[0] and out.is_contiguous():  # every row, in order: straight into out
        stream_values(state[:, 0], state[:, 1], width, exponential, out=out.view(len(streams), width))
    else:
        draws = stream_values(state[:, 0], state[:, 1], width, exponential)  # [S, width]
        out.index_copy_(0, state[:, 2], draws.view(len(streams), *out.shape[1:]))


def stream_values(keys: torch.Tensor, offsets: torch.Tensor, width: int, exponential: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The next `width` values of streams (keys, offsets [S] int64 on the device; see
    `megactx.kernels.rng`) -> [S, width] fp32: the Triton kernel on CUDA, its twin elsewhere (a CPU
    has no launches to save). Reads the counters on the device, so a CUDA graph can replay it."""
    if keys.device.type == "cuda":
        from megactx.kernels.rng import row_random
        return row_random(keys, offsets, width, exponential, out=out)
    return reference.row_random(keys, offsets, width, exponential, out=out)


def _torch_draw(out: torch.Tensor, kind: str, generator: torch.Generator | None) -> None:
    if kind == UNIFORM:
        out.uniform_(generator=generator)
    elif kind == EXPONENTIAL:
        out.exponential_(generator=generator)
    else:
        raise ValueError(f"kind must be {UNIFORM!r} or {EXPONENTIAL!r}, got {kind!r}")


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of logits [B, V] at tokens [B] -> ([B] fp32, top values [B, num_top] fp32 in
    descending order, their ids [B, num_top] int64)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_values, top_ids


class Sampler:
    """One decode step's logits [B, V] -> `SamplerOutput`.

    generator: draws the noise of unseeded rows (None: torch's default generator of the device).
    """

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        tensors = batch.tensors
        if logits.dim() != 2 or logits.shape[0] != tensors.temperature.shape[0]:
            raise ValueError(f"logits must be [B={tensors.temperature.shape[0]}, vocab], got {tuple(logits.shape)}")
        raw = logits.float()  # [B, V]
        processed = raw
        if tensors.any_min_tokens:
            processed = mask_stop_tokens_before_min(processed, tensors, batch.output_token_ids)
        if tensors.any_penalties:
            processed = apply_penalties(processed, tensors, batch.prompt_token_ids, batch.output_token_ids)
        if tensors.all_greedy:
            tokens = processed.argmax(dim=-1)
        else:
            tokens = sample(process_logits(processed, tensors), batch.generators, self.generator)
        if tensors.max_num_logprobs is None:
            return SamplerOutput(tokens)
        chosen, top_values, top_ids = compute_logprobs(raw, tokens, tensors.max_num_logprobs)
        return SamplerOutput(tokens, chosen, top_values, top_ids)
