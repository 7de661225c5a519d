"""Per-request sampling settings, validated at construction so bad input fails early. (When a
request is finished: the token rules in `LLM._emit`, the text rules in `tokenizer.CompletionText`.)"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# OpenAI's API caps the number of top tokens whose logprobs come back with each token at 20.
MAX_LOGPROBS = 20
# OpenAI's range for presence_penalty and frequency_penalty.
MAX_ABS_OPENAI_PENALTY = 2.0
# The range of a 64-bit seed, as torch.Generator.manual_seed takes it (a request's stream reduces it
# modulo 2**64, so negative seeds wrap).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Fields follow the OpenAI / vLLM meanings:
    - `temperature` 0 means greedy (argmax); `top_k` 0 (or -1, as vLLM spells it) means off;
      `top_p` 1 and `min_p` 0 mean off.
    - `max_tokens` caps the generated tokens; `min_tokens` blocks EOS and `stop_token_ids` (and
      stop strings) until that many tokens exist.
    - `stop`: strings that end the request; the text is cut before the stop string.
      `stop_token_ids`: token ids that end it besides the model's EOS ids; `ignore_eos` keeps
      going past EOS (stop_token_ids still stop).
    - `repetition_penalty` (HF/vLLM, > 0, 1 = off) applies to tokens of the prompt and the output;
      `presence_penalty` / `frequency_penalty` (OpenAI, in [-2, 2]) to output tokens only.
    - `logprobs`: None = none; k in 0..20 = the chosen token's logprob plus the k most likely.
    - `seed`: the request samples from its own random stream (`sampler.RowGenerator`), so it is
      reproducible whatever else is in the batch. `n`: completions per prompt (the engine forks the request).
    """

    # sampling
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    # length and stopping
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # penalties
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # output
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0  # vLLM's spelling of "off"
        self._check_sampling()
        self._check_stopping()
        self._check_penalties()
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    def _check_sampling(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 or -1 = off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None and not (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")

    def _check_stopping(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    def _check_penalties(self) -> None:
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_OPENAI_PENALTY <= value <= MAX_ABS_OPENAI_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ABS_OPENAI_PENALTY:g}, {MAX_ABS_OPENAI_PENALTY:g}] "
                                 f"(0 = off), got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
