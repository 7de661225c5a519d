"""The OpenAI-compatible HTTP server: a FastAPI app over an `AsyncEngine`.

    app = build_app(LLM("path/to/checkpoint"), served_model_name="tiny")
    uvicorn.run(app, host="127.0.0.1", port=8000)        # what `megactx serve` does

Routes: POST /v1/completions and /v1/chat/completions (both with SSE streaming: `data: {chunk}`
lines, then `data: [DONE]`), GET /v1/models, /health (200, or 503 once the engine died) and
/metrics (Prometheus text).

Errors come back as OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for a
request that cannot be served (malformed JSON, an unknown or out-of-range field, a prompt longer than
the context, a max_tokens that does not fit), 404 for an unknown model, 503 + Retry-After when the
queue is full. A refused request costs the others nothing.

Streaming is the server's hot path: this loop and the engine thread share the GIL, and whatever the
loop spends a token is taken from the engine. So a stream's deltas are handed over under an event
budget (`max_handovers_per_s`, see megactx.serve.async_engine), what waited going out as one event a
choice whose text, tokens and logprobs are those of the deltas it merges (`merge_deltas`), a
hand-over's events in one write; a chunk's constant fields are serialized once a response
(`ChunkEncoder`); an event stream runs no disconnect listener of its own (`EventStreamResponse`); and
what exists at startup is kept out of the garbage collector's full collections, which hold the GIL.
Clients get the same text, logprobs, finish reasons and usage either way: an event a step when few
streams run, fewer and longer ones when many do.

A client that disconnects (mid-stream or while waiting for a whole response) has its request
aborted, which frees its KV blocks. Shutdown (SIGTERM / Ctrl-C) is uvicorn's graceful one: the
server stops accepting connections, lets every request in flight finish, then stops the engine.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from megactx.engine.llm import LLM
from megactx.engine.outputs import Delta, TokenLogprobs
from megactx.engine.sampling_params import SamplingParams
from megactx.serve import DEFAULT_GC_THRESHOLD, DEFAULT_MAX_QUEUED_REQUESTS, settle_heap
from megactx.serve.async_engine import (
    DEFAULT_MAX_HANDOVERS_PER_S,
    AsyncEngine,
    EngineDead,
    EngineOverloaded,
    RequestStream,
)
from megactx.serve.metrics import CONTENT_TYPE, ServerMetrics
from megactx.serve.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)

# A 503 tells the client to come back after this many seconds: a decode step takes milliseconds,
# so a full queue usually has room again within a second.
RETRY_AFTER_S = 1
# a bad value is echoed in the error message, cut to this length
MAX_INPUT_ECHO_CHARS = 80
_TYPE_TAGS = {"str", "int", "float", "bool"}  # pydantic's names for union members of plain types
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def build_app(llm: LLM, *, served_model_name: str, max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
              max_handovers_per_s: float = DEFAULT_MAX_HANDOVERS_PER_S,
              gc_threshold: int = DEFAULT_GC_THRESHOLD) -> FastAPI:
    """The FastAPI app serving `llm` under the model name `served_model_name`. The engine thread
    starts with the app's lifespan and stops after the server drained its requests.
    max_queued_requests: sequences admitted beyond the batch's max_num_seqs before a 503.
    max_handovers_per_s: the streams' event budget, all together (AsyncEngine's; 0 = an event a step).
    gc_threshold: the server process's young-generation collection threshold from startup on
    (megactx.serve.settle_heap; 0 keeps Python's)."""
    metrics = ServerMetrics(served_model_name)
    if llm.stats.spec_decode is not None:
        metrics.watch_spec_decode(llm.stats.spec_decode)
    engine = AsyncEngine(llm, max_queued_requests=max_queued_requests, max_handovers_per_s=max_handovers_per_s,
                         metrics=metrics)
    serving = OpenAIServing(engine, llm, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # the model, the libraries, the app: a full collection holds the GIL, so an engine thread
        # would stop while it walks every object of the process (250 ms for the tiny model on a CPU)
        thresholds = gc.get_threshold()
        settle_heap(gc_threshold)
        yield
        await engine.shutdown()
        gc.unfreeze()
        gc.set_threshold(*thresholds)

    app = FastAPI(title="megactx", summary="OpenAI-compatible server for megactx models", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics

    def error_response(e: APIError) -> JSONResponse:
        if e.status == 503 and e.code == "overloaded":
            metrics.request_rejected("overloaded")
        elif 400 <= e.status < 500:
            metrics.request_rejected("invalid")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(e.errors())
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                       headers=e.headers))

    @app.exception_handler(EngineDead)
    async def on_engine_dead(request: Request, e: EngineDead) -> JSONResponse:
        return error_response(APIError(503, str(e), type="server_error", code="engine_dead"))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, e: Exception) -> JSONResponse:
        # the traceback goes to the log (uvicorn logs the exception again after this response)
        return error_response(APIError(500, f"internal error: {e!r}", type="server_error"))

    app.post("/v1/completions")(serving.completions)
    app.post("/v1/chat/completions")(serving.chat_completions)
    app.get("/v1/models")(serving.models)
    app.get("/health")(serving.health)
    app.get("/metrics")(serving.metrics)
    return app


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A person-readable message and the field at fault, from pydantic's errors."""
    if not errors:
        return "invalid request", None
    if errors[0]["type"] == "json_invalid":
        e = errors[0]
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}", None
    # A union field (prompt, content) fails once per member type; the deepest failure is in the
    # member the client meant (a content part of an unknown type, not "content is not a string").
    e = max(errors, key=lambda e: len(e["loc"]))
    name = _field_name(e["loc"])
    if e["type"] == "extra_forbidden":
        return f"{name}: unknown parameter; this server does not support it", name
    if e["type"] == "missing":
        return f"{name}: this field is required", name
    same_field = dict.fromkeys(x["msg"] for x in errors if _field_name(x["loc"]) == name)
    got = repr(e["input"])
    got = got if len(got) <= MAX_INPUT_ECHO_CHARS else got[:MAX_INPUT_ECHO_CHARS] + "..."
    return f"{name}: {' or '.join(same_field)}; got {got}", name


def _field_name(loc: tuple) -> str:
    """'messages.0.content.0.type' from pydantic's loc, without "body" and union member tags
    ('str', 'list[int]', 'list[TextPart]')."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    return ".".join(parts) or "body"


@dataclass
class _Choice:
    """One choice of a response being collected (non-streaming), or streamed."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # completions logprobs: where the next token's text starts


class OpenAIServing:
    """The route handlers. Text goes through the checkpoint's tokenizer (never by hand); a model
    without one serves token-id prompts of /v1/completions only."""

    def __init__(self, engine: AsyncEngine, llm: LLM, model_name: str, metrics: ServerMetrics):
        self.engine = engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.model_name = model_name
        self._metrics = metrics
        self._created = int(time.time())
        self._watchers: set[asyncio.Task] = set()  # disconnect watchers of streaming responses
        self._token_texts: dict[int, str] = {}  # token id -> its text in logprobs

    # ---------------------------------------------------------------------------- simple routes
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self._created,
                                         max_model_len=self.max_model_len)])

    async def health(self) -> JSONResponse:
        if not self.engine.is_alive:
            raise EngineDead(f"the engine is not running ({self.engine.error!r}); restart the server")
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return Response(self._metrics.render(), media_type=CONTENT_TYPE)

    # ---------------------------------------------------------------------------- completions
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_model(body.model)
        body.check_stream_options()
        prompt_ids = [await self._tokenize(p) for p in body.prompts()]
        params = [body.sampling_params(self._max_tokens(body.max_tokens, ids)) for ids in prompt_ids]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._submit(prompt_ids, params, request_id, arrival)
        n, created = params[0].n, int(time.time())
        usage_prompt = sum(len(ids) for ids in prompt_ids)
        if body.stream:
            return self._sse(self._completion_events(stream, request_id, created, n, usage_prompt,
                                                     body.include_usage), stream, request)
        choices = await self._collect(stream, request, len(prompt_ids) * n, n)
        want_logprobs = params[0].logprobs is not None
        return JSONResponse(CompletionResponse(
            id=request_id, created=created, model=self.model_name,
            choices=[CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                      logprobs=self._completion_logprobs(c.logprobs, c) if want_logprobs else None)
                     for i, c in enumerate(choices)],
            usage=_usage(usage_prompt, sum(c.num_tokens for c in choices))).model_dump())

    async def _completion_events(self, stream: RequestStream, request_id: str, created: int, n: int,
                                 prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}

        def choice_of(prompt_index: int, delta: Delta) -> tuple | None:
            index = prompt_index * n + delta.index
            choice = choices.setdefault(index, _Choice())
            choice.num_tokens += len(delta.token_ids)
            if not _visible(delta):
                return None
            logprobs = None if delta.logprobs is None else self._completion_logprobs(delta.logprobs, choice)
            return index, delta.text, logprobs, delta.finish_reason

        encoder = ChunkEncoder(CompletionResponse, request_id, created, self.model_name)
        async for events in _stream_events(stream, encoder, choice_of):
            yield events
        if include_usage:
            yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                          usage=_usage(prompt_tokens, sum(c.num_tokens for c in choices.values()))))

    def _completion_logprobs(self, logprobs: list[TokenLogprobs], choice: _Choice) -> dict:
        """The legacy format (`CompletionLogprobs` as a dict): each token's text and logprob, the top
        tokens' {text: logprob} with the sampled token always among them, and each token's offset in
        the completion text."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs:
            token = self._token_text(lp.token_id)
            top = {self._token_text(t): float(v) for t, v in lp.top.items()}
            top.setdefault(token, float(lp.logprob))
            out["tokens"].append(token)
            out["token_logprobs"].append(float(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(choice.text_offset)
            choice.text_offset += len(token)
        return out

    # ---------------------------------------------------------------------------- chat
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_model(body.model)
        body.check_stream_options()
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot render chat messages; use "
                                "/v1/completions with token ids", param="messages")
        messages = [m.to_template() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"the chat template could not render these messages: {e}", param="messages") from None
        ids = await asyncio.to_thread(self.tokenizer.encode, text)
        params = body.sampling_params(self._max_tokens(body.requested_max_tokens(), ids))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit([ids], [params], request_id, arrival)
        created, want_logprobs = int(time.time()), params.logprobs is not None
        if body.stream:
            return self._sse(self._chat_events(stream, request_id, created, params.n, len(ids), body.include_usage),
                             stream, request)
        choices = await self._collect(stream, request, params.n, params.n)
        return JSONResponse(ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name,
            choices=[ChatChoice(index=i, message=ChatResponseMessage(content="".join(c.text)),
                                finish_reason=c.finish_reason,
                                logprobs=self._chat_logprobs(c.logprobs) if want_logprobs else None)
                     for i, c in enumerate(choices)],
            usage=_usage(len(ids), sum(c.num_tokens for c in choices))).model_dump())

    async def _chat_events(self, stream: RequestStream, request_id: str, created: int, n: int, prompt_tokens: int,
                           include_usage: bool) -> AsyncIterator[str]:
        def chunk(choices, usage=None) -> str:
            return _sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                            usage=usage))

        # every choice opens with the assistant role, as OpenAI's stream does
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)])
        num_tokens = 0

        def choice_of(_: int, delta: Delta) -> tuple | None:
            nonlocal num_tokens
            num_tokens += len(delta.token_ids)
            if not _visible(delta):
                return None
            logprobs = None if delta.logprobs is None else self._chat_logprobs(delta.logprobs)
            return delta.index, delta.text, logprobs, delta.finish_reason

        encoder = ChunkEncoder(ChatCompletionChunk, request_id, created, self.model_name)
        async for events in _stream_events(stream, encoder, choice_of):
            yield events
        if include_usage:
            yield chunk([], _usage(prompt_tokens, num_tokens))

    def _chat_logprobs(self, logprobs: list[TokenLogprobs]) -> dict:
        """`ChatLogprobs` as a dict: each token's text, logprob and UTF-8 bytes, with its top tokens'."""
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}

        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top.items()]}
                            for lp in logprobs]}

    # ---------------------------------------------------------------------------- shared steps
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        # off the event loop: a long prompt takes a while to encode
        return await asyncio.to_thread(self.tokenizer.encode, prompt)

    def _max_tokens(self, requested: int | None, prompt_ids: list[int]) -> int:
        """What was asked for, or else everything the context has left after the prompt (at least 1,
        so that a prompt too long for the context is refused for its length)."""
        return requested if requested is not None else max(1, self.max_model_len - len(prompt_ids))

    async def _submit(self, prompt_ids: list[list[int]], params: list[SamplingParams], request_id: str,
                      arrival: float) -> RequestStream:
        try:
            stream = self.engine.submit(prompt_ids, params, request_id, arrival)
        except EngineOverloaded as e:
            raise APIError(503, str(e), type="server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:
            raise APIError(400, str(e), param="n") from None
        try:
            await stream.admitted()
        except ValueError as e:  # the engine's reason: the prompt or max_tokens does not fit, ...
            stream.abort()
            raise APIError(400, str(e)) from None
        except BaseException:  # the client went away while the engine was admitting it
            stream.abort()
            raise
        return stream

    async def _collect(self, stream: RequestStream, request: Request, num_choices: int, n: int) -> list[_Choice]:
        """Gather a whole response; abort it if the client disconnects meanwhile."""
        choices = [_Choice() for _ in range(num_choices)]
        watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
        try:
            async for prompt_index, delta in stream:
                _add_delta(choices[prompt_index * n + delta.index], delta)
        finally:
            watcher.cancel()
            stream.abort()  # a no-op once the stream finished
        return choices

    def _sse(self, events: AsyncIterator[str], stream: RequestStream, request: Request) -> EventStreamResponse:
        # Watch from now on, not from the body's first iteration: a client that leaves before the
        # body starts gets a body that never runs (and so never reaches its `finally`).
        watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
        self._watchers.add(watcher)  # the loop keeps only weak references to tasks
        watcher.add_done_callback(self._watchers.discard)

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except EngineDead as e:
                yield _sse_error(APIError(503, str(e), type="server_error", code="engine_dead"))
            finally:
                # on a disconnect starlette cancels this generator; either way the request must go
                watcher.cancel()
                stream.abort()
            yield "data: [DONE]\n\n"

        return EventStreamResponse(body(), headers=SSE_HEADERS)

    def _token_text(self, token_id: int) -> str:
        """A token's text in logprobs (decoded alone, memoized: at most a vocabulary's worth)."""
        text = self._token_texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:  # special tokens (EOS) keep their text, so the sampled token is visible in logprobs
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text


async def _stream_events(stream: RequestStream, encoder: ChunkEncoder,
                         choice_of: Callable[[int, Delta], tuple | None]) -> AsyncIterator[str]:
    """The SSE events of a stream: a hand-over's deltas (one a completion, `RequestStream.batches`),
    each made a chunk's choice by `choice_of(prompt_index, delta)` -> (index, text, logprobs,
    finish_reason), the arguments of `ChunkEncoder.event` (None: nothing to send yet); all of a
    hand-over's events in one string, so one write."""
    async for batch in stream.batches():
        choices = [choice_of(prompt_index, delta) for prompt_index, delta in batch]
        events = "".join(encoder.event(*c) for c in choices if c is not None)
        if events:
            yield events


def _visible(delta: Delta) -> bool:
    """Whether a delta has anything to send: else its text is held back (a possible stop string, an
    incomplete character) and it carries no logprobs or finish reason."""
    return bool(delta.text or delta.logprobs or delta.finish_reason)


def _add_delta(choice: _Choice, delta: Delta) -> None:
    choice.text.append(delta.text)
    choice.num_tokens += len(delta.token_ids)
    if delta.logprobs:
        choice.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        choice.finish_reason = delta.finish_reason


async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    """Wait for the client to go away, then abort its request (frees its KV blocks). Cancelled by
    the caller once the response is complete."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.abort()


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


class EventStreamResponse(Response):
    """A `text/event-stream` response whose body is `events`, each sent as it comes (one write).
    Unlike starlette's StreamingResponse it runs no task of its own listening for the client's
    disconnect (an anyio task group a request): `OpenAIServing._sse` watches for that itself and
    aborts the stream, which ends `events`; what it sends after a disconnect the server drops."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ChunkEncoder:
    """The server-sent events of one streamed response, each a chunk of `model` (CompletionResponse
    or ChatCompletionChunk) with one choice and no usage: byte for byte what `_sse` makes of that
    chunk built as a model, without building one. The fields every chunk repeats (id, object,
    created, model) are serialized once; an event serializes only its text, logprobs and finish
    reason into the choice's JSON (a completion's `text`, a chat delta's `content`)."""

    def __init__(self, model: type[CompletionResponse] | type[ChatCompletionChunk], request_id: str, created: int,
                 model_name: str):
        head = _json({"id": request_id, "object": model.model_fields["object"].default, "created": created,
                      "model": model_name})
        self._prefix = f'data: {head[:-1]},"choices":[{{"index":'
        self._chat = model is ChatCompletionChunk

    def event(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> str:
        """logprobs: CompletionLogprobs or ChatLogprobs as a dict, or None."""
        text_json = f'"delta":{{"content":{_json(text)}}}' if self._chat else f'"text":{_json(text)}'
        return (f'{self._prefix}{index},{text_json},"logprobs":{_json(logprobs)},'
                f'"finish_reason":{_json(finish_reason)}}}]}}\n\n')


def _sse(chunk: CompletionResponse | ChatCompletionChunk) -> str:
    """One server-sent event. A chat delta leaves out its empty fields and a chunk its usage until
    the last one, as OpenAI's stream does."""
    data = chunk.model_dump()
    if data.get("usage") is None:
        data.pop("usage", None)
    for choice in data["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {_json(data)}\n\n"


def _sse_error(e: APIError) -> str:
    return f"data: {_json(e.body())}\n\n"


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # compact, UTF-8 as it is


def _json(data: dict | str | None) -> str:
    """Compact JSON. One encoder for every call (json.dumps with options makes one a call), and a
    string or None without going through the general encoder: they are most of an event."""
    if data is None:
        return "null"
    return _JSON.encode(data)
