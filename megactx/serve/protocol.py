"""The OpenAI HTTP API's request and response bodies (the subset `megactx serve` speaks), as pydantic
models, and the translation of a request's sampling fields into `SamplingParams`.

Requests reject unknown fields (`extra="forbid"`): a misspelt or unsupported parameter gets a 400
naming it instead of being silently ignored. Sampling fields accept `null` as "the default".
Besides OpenAI's fields, requests take vLLM's extras under vLLM's names: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids` (the `openai` client sends them
through `extra_body`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from megactx.engine.sampling_params import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An error the client caused (or can act on); becomes an OpenAI-style error body.

    status: the HTTP status. param: the request field at fault, when there is one. headers: extra
    response headers (e.g. Retry-After with a 503)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------------------------ requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the usage and no choices


# request fields passed to SamplingParams under their own names
SAMPLING_FIELDS = ("n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k",
                   "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; `None` means the SamplingParams default."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as an end-user id is only for the client's bookkeeping
    # vLLM's extras
    top_k: int | None = None  # 0 or -1 = off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises APIError(400) naming the field when a value is out of range."""
        kwargs: dict[str, Any] = {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
        except ValueError as e:
            # SamplingParams' messages start with the field's name ("temperature must be ...")
            name = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=name if name in type(self).model_fields else None) from None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# A prompt is text or token ids; a batch is a list of either.
PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `max_tokens` defaults to 16 (OpenAI's default); null means "as many as
    fit in the context". `logprobs` k in 0..20 returns the sampled token's logprob and the k most
    likely tokens'. `echo` is refused (not supported)."""

    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The batch: one or more prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        return list(p)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.echo:
            raise APIError(400, "echo is not supported by this server; send echo=false (or leave it out)",
                           param="echo")
        return self._sampling_params(max_tokens, self.logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]  # images and audio are not supported
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, str]:
        """The message as the chat template sees it: content parts joined into one string."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. The messages are rendered with the checkpoint's chat template.
    `max_completion_tokens` (or the older `max_tokens`) defaults to "as many as fit in the context".
    `logprobs: true` returns the sampled tokens' logprobs, plus the `top_logprobs` (0..20) most likely."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree; send one of them",
                           param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


# ------------------------------------------------------------------------------------ responses
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, logprob, the top tokens' {text: logprob} (the sampled token
    included, so up to k + 1 entries), and where its text starts in the completion."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int  # prompt index * n + completion index
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length"; null while streaming


class CompletionResponse(BaseModel):
    """A whole completion, and also each streamed chunk (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # UTF-8 of the token's decoded text


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # only in a choice's first chunk
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "megactx"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
