"""What the engine gives back: a request's completions (`RequestOutput`, `CompletionOutput`),
what a step added to one (`Delta`, for streaming), logprobs, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from megactx.engine.spec_decode import SpecDecodeStats


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the `logprobs` most likely tokens' (id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(eq=False)
class CompletionOutput:
    """One completion of a request; `text` is what has been streamed so far (all of it once
    `finish_reason` is set)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    # the streamed text's pieces, joined when read: appending a token's text stays O(1) however long it gets
    _pieces: list[str] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return ((self.index, self.text, self.token_ids, self.finish_reason, self.logprobs)
                == (other.index, other.text, other.token_ids, other.finish_reason, other.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    spec_decode: SpecDecodeStats | None = None  # drafted / accepted tokens of this request (speculative engine)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


@dataclass
class Delta:
    """What one step added to one completion of a request (streaming)."""

    request_id: str
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None

    def fields(self) -> tuple:
        """Its fields in order, `Delta(*fields)` again: a tuple of plain values pickles ~5x faster
        than the dataclass (the engine process sends every step's deltas)."""
        return (self.request_id, self.index, self.text, self.token_ids, self.logprobs, self.finish_reason)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    # latency samples since the last clear(): the server drains them into its histograms each step
    time_to_first_token: list[float] = field(default_factory=list)  # seconds, per request
    inter_token_latency: list[float] = field(default_factory=list)  # seconds, per generated token
    spec_decode: SpecDecodeStats | None = None  # drafted / accepted tokens, with speculative decoding
