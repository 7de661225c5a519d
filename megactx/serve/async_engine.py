"""`AsyncEngine`: the `LLM` in a thread of its own, bridged to an asyncio event loop.

The LLM is not thread-safe, so exactly one thread owns it: the engine thread (or, with an
`EngineProcess`, the engine process's main thread: megactx.serve.engine_process). The event loop
talks to it through a command queue (add a request, abort one, stop), and the engine thread
sends back admission results and each step's deltas with `loop.call_soon_threadsafe`, so every
piece of loop-side bookkeeping (which request wants which delta, capacity, latencies, logs) lives
on the loop thread and needs no lock. When nothing is running, the engine thread sleeps on the
command queue: an idle server burns no CPU.

    engine = AsyncEngine(llm, max_queued_requests=256)
    engine.start()                                        # inside the running loop
    stream = engine.submit([prompt_ids], [params], "cmpl-1")
    await stream.admitted()                               # ValueError: the engine refused it
    async for prompt_index, delta in stream: ...          # until every completion finished
    await engine.shutdown()

Hand-over. The engine thread hands the loop a whole step's deltas in one callback, and a stream
wakes its consumer at most once for them. A consumer that fell behind (the loop busy with other
streams, a slow client) finds several deltas waiting: `stream.batches()` hands them over together,
and `merge_deltas` makes one delta of each completion's, so a server that cannot send an event per
token sends fewer, longer events instead of falling further behind the engine.

Text. The engine handles token ids only (`LLM.add_request(..., detokenize=False)`); the text of
each completion is made here, on the loop, when its deltas are handed over (`CompletionText`: the
tokens of a whole hand-over decoded together, stop strings applied, the characters that could start
one held back). A stop string found here ends the completion at once (its later tokens are dropped)
and tells the engine to stop it (`_Abort` with its index), as vLLM's front end does. So with an
engine process the engine's loop, the server's bottleneck, never decodes text.

Event budget. The loop and the engine thread share the GIL, and a step's host work is much of a
step on a fast device, so every microsecond the loop spends a token is taken from the engine.
`max_handovers_per_s` caps the rate at which deltas are handed to consumers (each hand-over is an
SSE event a completion on a stream) for the whole server: a stream's deltas are handed over at most
once every `(sequences in the last step) / max_handovers_per_s` seconds, at the first step after
that (see `AsyncEngine._pace`). A stream's first delta and every finishing delta go at once, so
time to first token and request latency do not change; between them a client gets the same text in
fewer, longer events when many streams run at once (64 streams at the default 2000/s: one every
32 ms, ~7 tokens on 4.6 ms steps), and an event a step when few do.

Capacity. At most `max_num_seqs + max_queued_requests` sequences (a request with n completions
counts n) are in flight at once: the running batch, plus a queue. A request that would go past
that raises `EngineOverloaded` at once (the server answers 503); a request once accepted always
runs to the end unless its client aborts it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from megactx.engine.llm import LLM
from megactx.engine.outputs import Delta
from megactx.engine.sampling_params import SamplingParams
from megactx.engine.spec_decode import SpecDecodeStats
from megactx.engine.tokenizer import CompletionText
from megactx.serve.engine_process import EngineProcess
from megactx.serve.metrics import ServerMetrics

log = logging.getLogger("megactx.serve")


# The event budget: hand-overs of deltas to streams (SSE events) a second, all streams together. A
# hand-over costs the loop ~30-50 us of GIL (waking the consumer, JSON, uvicorn + h11, the socket
# write), so 2000/s keep it under a tenth of the engine thread's time however many streams run: 64
# streams get an event every 32 ms (a 30 Hz stream of ~7 tokens on 4.6 ms steps), 8 every 4 ms.
DEFAULT_MAX_HANDOVERS_PER_S = 2000.0
MIN_PACING_TIMER_S = 0.005  # the fallback hand-over timer's least period
LOOP_PROBE_S = 0.01  # with metrics: how often the loop's lag is probed (megactx_event_loop_lag_seconds)


class EngineOverloaded(Exception):
    """The request does not fit in the queue now; it may fit later (HTTP 503 + Retry-After)."""


class EngineDead(Exception):
    """The engine thread failed or has stopped; nothing more can run in this process."""


# ---------------------------------------------------------------------------- engine-thread commands
@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str
    index: int | None = None  # one completion of the request (a stop string); None: all of them


class _Stop:
    pass


@dataclass
class _Tracked:
    """Loop-side bookkeeping of one engine request (one prompt of a RequestStream)."""

    stream: RequestStream
    prompt_index: int
    num_prompt_tokens: int
    n: int
    arrival: float  # time.perf_counter() seconds
    first_token_time: float | None = None
    last_token_time: list[float | None] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    num_output_tokens: int = 0
    accepted: bool = False

    def __post_init__(self) -> None:
        self.last_token_time = [None] * self.n
        self.finish_reasons = [None] * self.n

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)


class RequestStream:
    """The deltas of one HTTP request: prompts 0..P-1, each one engine request of n completions.

    Iterating yields `(prompt_index, Delta)` in the order the engine made them, and ends after every
    completion of every prompt has finished, or after `abort()`. Raises EngineDead if the engine
    fails meanwhile (after the deltas that came before the failure). `batches()` yields the same
    deltas a list at a time, paced by the engine's event budget (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], num_prompts: int,
                 texts: list[list[CompletionText | None]]):
        self.request_ids = request_ids
        self._texts = texts  # [prompt][completion]: its text (None: token ids only)
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._pending: list[tuple[int, Delta]] = []  # arrived, not yet handed to the consumer
        self._urgent = False  # a pending delta finishes a completion: hand over without waiting
        self._next_handover = 0.0  # loop.time() from which pending deltas may be handed over
        self._waiter: asyncio.Future | None = None  # the consumer, waiting until a hand-over is due
        self._error: BaseException | None = None  # raised to the consumer after the pending deltas
        self._admission: asyncio.Future = self._loop.create_future()
        self._num_unadmitted = num_prompts
        self._num_unfinished = num_prompts
        self.done = False  # every completion finished, or aborted, or the engine failed

    async def admitted(self) -> None:
        """Wait until the engine accepted every prompt. Raises ValueError with the engine's reason
        (prefixed with "prompt i: " in a batch) when it refused one; then abort() the stream."""
        await asyncio.shield(self._admission)

    def abort(self) -> None:
        """Stop every prompt still running and free its KV blocks. Safe to call more than once."""
        self._engine._abort_stream(self)

    def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, Delta]]:
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """The deltas that arrived since the last yield: [(prompt_index, Delta)], never empty, one
        a completion (`merge_deltas`: several steps' worth when the consumer was slower than the
        engine or its hand-over was not due yet), in the order of each completion's first, with
        their text (`_with_text`)."""
        while True:
            while not self._due():
                if self._pending:
                    self._engine._pace(self)
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            if self._pending:
                batch, self._pending, self._urgent = self._pending, [], False
                self._next_handover = self._loop.time() + self._engine.handover_interval_s
                batch = self._with_text(merge_deltas(batch))
                if batch:
                    yield batch
            else:  # done
                if self._error is not None:
                    raise self._error
                return

    def _with_text(self, batch: list[tuple[int, Delta]]) -> list[tuple[int, Delta]]:
        """Each completion's delta with its text (CompletionText); a stop string cuts its tokens and
        logprobs and finishes it (the engine is told), and what comes after its end is dropped."""
        out = []
        metrics = self._engine.metrics
        for prompt_index, delta in batch:
            text = self._texts[prompt_index][delta.index]
            if text is not None:
                piece, kept, reason = text.add(delta.token_ids, delta.finish_reason)
                if not kept:
                    continue  # it ended before these tokens
                if reason is not None and delta.finish_reason is None:  # a stop string
                    self._engine._stop_early(self, prompt_index, delta.index)
                tokens, logprobs = delta.token_ids, delta.logprobs
                if kept < len(tokens):
                    tokens, logprobs = tokens[:kept], logprobs and logprobs[:kept]
                delta = Delta(delta.request_id, delta.index, piece, tokens, logprobs, reason)
            # (no tokenizer: token ids only, as they came)
            if delta.finish_reason is not None and metrics:  # its final reason: counted once, here
                metrics.completion_finished(delta.finish_reason)
            out.append((prompt_index, delta))
        return out

    def _due(self) -> bool:
        """Whether the consumer should run now: the end, or deltas whose hand-over is due."""
        if self.done:
            return True
        return bool(self._pending) and (self._urgent or self._loop.time() >= self._next_handover)

    # ------------------------------------------------ called by the engine, on the loop thread
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _accept_one(self) -> None:
        self._num_unadmitted -= 1
        if self._num_unadmitted == 0 and not self._admission.done():
            self._admission.set_result(None)

    def _refuse(self, error: BaseException) -> None:
        if not self._admission.done():
            self._admission.set_exception(error)

    def _prompt_finished(self) -> None:
        self._num_unfinished -= 1
        if self._num_unfinished == 0:
            self._close()

    def _close(self, error: BaseException | None = None) -> None:
        if not self.done:
            self.done = True
            self._error = error
            self._wake()
        if error is not None and not self._admission.done():
            self._admission.set_exception(error)


def merge_deltas(batch: list[tuple[int, Delta]]) -> list[tuple[int, Delta]]:
    """One delta a completion: the deltas of each (prompt_index, completion index) in `batch` made
    into one, in the order of each completion's first delta. A merged delta's text, token ids and
    logprobs are its parts' concatenated in order (logprobs None when every part's is None), its
    finish reason the last part's (only a completion's last delta has one)."""
    if len(batch) == 1:
        return batch
    prompt_index, first = batch[0]
    if all(p == prompt_index and d.index == first.index for p, d in batch):  # one completion: the usual case
        return [(prompt_index, _concat([d for _, d in batch]))]
    parts: dict[tuple[int, int], list[Delta]] = {}
    for prompt_index, delta in batch:
        parts.setdefault((prompt_index, delta.index), []).append(delta)
    if len(parts) == len(batch):
        return batch
    return [(prompt_index, ds[0] if len(ds) == 1 else _concat(ds)) for (prompt_index, _), ds in parts.items()]


def _concat(deltas: list[Delta]) -> Delta:
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    return Delta(last.request_id, last.index, "".join(d.text for d in deltas),
                 [t for d in deltas for t in d.token_ids], logprobs, last.finish_reason)


class AsyncEngine:
    """Owns an LLM through a dedicated thread, or drives an EngineProcess (the same engine loop,
    `run_engine`, in a process of its own) through its pipes; see the module docstring.

    max_queued_requests: sequences admitted beyond the `max_num_seqs` the batch runs at once (>= 0).
    max_handovers_per_s: the event budget of all streams together (see the module docstring);
    0 = none: every step's deltas are handed over at once.
    metrics: where engine gauges, token counters and latencies go (None: nowhere).
    All methods are called from the event loop's thread."""

    def __init__(self, llm: LLM | EngineProcess, *, max_queued_requests: int,
                 max_handovers_per_s: float = DEFAULT_MAX_HANDOVERS_PER_S, metrics: ServerMetrics | None = None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        if max_handovers_per_s < 0:
            raise ValueError(f"max_handovers_per_s must be >= 0 (0 = no budget), got {max_handovers_per_s}")
        self.llm = llm
        self.metrics = metrics
        self.max_handovers_per_s = max_handovers_per_s
        self.handover_interval_s = 0.0  # a stream's least time between hand-overs; set by each step
        self._paced: set[RequestStream] = set()  # streams with deltas whose hand-over is not due yet
        self._pacing_timer: asyncio.TimerHandle | None = None  # hands over when no step came for a while
        self._last_dispatch = 0.0  # loop.time() of the last step's deltas
        self.capacity = llm.max_num_seqs + max_queued_requests
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Tracked] = {}  # engine request id -> bookkeeping (loop thread only)
        self._streams: set[RequestStream] = set()
        self._num_seqs = 0  # sequences in flight: what the capacity bounds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_probe: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread (or, with an EngineProcess, the threads that carry commands to it
        and its outputs back); call from inside the running event loop that will use the engine."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        if self.metrics:
            self._probe_loop(self._loop.time())
        if isinstance(self.llm, EngineProcess):
            threading.Thread(target=self._send_commands, name="megactx-engine-commands", daemon=True).start()
            self._thread = threading.Thread(target=self._receive_outputs, name="megactx-engine-outputs", daemon=True)
        else:
            self._thread = threading.Thread(target=self._run_thread, name="megactx-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the engine thread. (The HTTP server drains its
        requests before it calls this, so normally nothing is left.)"""
        for stream in list(self._streams):
            stream.abort()
        for timer in (self._pacing_timer, self._loop_probe):
            if timer is not None:
                timer.cancel()
        self._pacing_timer = self._loop_probe = None
        if self._thread is not None and self._thread.is_alive():
            self._stopping = True
            self._commands.put(_Stop())
            if isinstance(self.llm, EngineProcess):
                await asyncio.to_thread(self.llm.close)
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        alive = self.error is None and self._thread is not None and self._thread.is_alive()
        return alive and (not isinstance(self.llm, EngineProcess) or self.llm.is_alive)

    # ---------------------------------------------------------------------------- requests
    def submit(self, prompts: list[list[int]], params: list[SamplingParams], request_id: str,
               arrival: float | None = None) -> RequestStream:
        """Queue one engine request per prompt (token ids; params[i] for prompts[i]). Engine request
        ids are `request_id` for one prompt, `f"{request_id}-{i}"` for a batch.

        arrival: time.perf_counter() when the HTTP request came in (default: now), for the
        time-to-first-token and latency figures. Raises EngineOverloaded when the request does not
        fit in the queue now, ValueError when it can never fit (more sequences than the capacity),
        EngineDead when the engine is gone. Admission itself (prompt length, max_tokens) is decided
        by the engine thread: await `stream.admitted()`."""
        if not self.is_alive:
            raise EngineDead(f"the engine is not running ({self.error!r}); restart the server")
        if not prompts or len(prompts) != len(params):
            raise ValueError(f"submit needs at least one prompt and one SamplingParams per prompt, got "
                             f"{len(prompts)} prompts and {len(params)} SamplingParams")
        num_seqs = sum(p.n for p in params)
        if num_seqs > self.capacity:
            raise ValueError(f"the request asks for {num_seqs} sequences (prompts x n); this server admits at most "
                             f"{self.capacity} at once")
        if self._num_seqs + num_seqs > self.capacity:
            raise EngineOverloaded(f"the server is at its limit of {self.capacity} sequences in flight "
                                   f"({self._num_seqs} now); retry shortly")
        tokenizer = self.llm.tokenizer
        if tokenizer is None and any(p.stop for p in params):
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        arrival = time.perf_counter() if arrival is None else arrival
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        texts = [[CompletionText.of(tokenizer, p, sp) for _ in range(sp.n)] for p, sp in zip(prompts, params)]
        stream = RequestStream(self, ids, len(prompts), texts)
        self._streams.add(stream)
        self._num_seqs += num_seqs
        for i, (rid, ids_i, params_i) in enumerate(zip(ids, prompts, params)):
            self._requests[rid] = _Tracked(stream, i, len(ids_i), params_i.n, arrival)
            self._commands.put(_Add(rid, ids_i, params_i))
        return stream

    def _abort_stream(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            tracked = self._requests.get(rid)
            if tracked is None:
                continue
            self._commands.put(_Abort(rid))
            for i, reason in enumerate(tracked.finish_reasons):
                if reason is None:
                    tracked.finish_reasons[i] = "abort"
                    if tracked.accepted and self.metrics:
                        self.metrics.completion_finished("abort")
            self._retire(rid, tracked)
        self._streams.discard(stream)
        self._paced.discard(stream)
        stream._close()

    def _retire(self, request_id: str, tracked: _Tracked) -> None:
        """Forget a finished, aborted or refused engine request; log it if it ran."""
        del self._requests[request_id]
        self._num_seqs -= tracked.n
        if not tracked.accepted:
            return
        now = time.perf_counter()
        latency = now - tracked.arrival
        ttft = "-" if tracked.first_token_time is None else f"{tracked.first_token_time - tracked.arrival:.3f} s"
        log.info("request %s: %d prompt tokens, %d output tokens, TTFT %s, latency %.3f s, finish %s", request_id,
                 tracked.num_prompt_tokens, tracked.num_output_tokens, ttft, latency, ",".join(tracked.finish_reasons))
        if self.metrics:
            self.metrics.e2e.observe(latency)

    # ---------------------------------------------------------------------------- loop-side callbacks
    def _admit_all(self, admissions: list[tuple[str, Exception | None]]) -> None:
        """The engine's answers to added requests: (request id, None if accepted, else why not)."""
        for request_id, error in admissions:
            self._admit(request_id, error)

    def _admit(self, request_id: str, error: Exception | None) -> None:
        tracked = self._requests.get(request_id)
        if tracked is None:  # aborted while the engine was admitting it
            return
        stream = tracked.stream
        if error is None:
            tracked.accepted = True
            if self.metrics:
                self.metrics.prompt_tokens.inc(tracked.num_prompt_tokens)
            stream._accept_one()
            return
        if len(stream.request_ids) > 1:
            error = type(error)(f"prompt {tracked.prompt_index}: {error}")
        self._retire(request_id, tracked)
        stream._refuse(error)

    def _dispatch(self, deltas: list[Delta], now: float) -> None:
        """Route one step's deltas (made at time `now`) to their streams, then hand over what is due."""
        if self.max_handovers_per_s:
            # the budget shared by the sequences of this step: a full batch of 64 at 2000/s, 32 ms each
            self.handover_interval_s = len(deltas) / self.max_handovers_per_s
        loop_now = self._last_dispatch = self._loop.time()
        num_tokens = 0
        gaps: dict[float, int] = {}  # previous token time -> completions whose last token came then
        # This loop runs for every sequence every step, on the loop that every arrival waits for:
        # each delta's bookkeeping is inline, with what it touches in locals.
        requests, ttft = self._requests, self.metrics.ttft if self.metrics else None
        for delta in deltas:
            tracked = requests.get(delta.request_id)
            index = delta.index
            if tracked is None or tracked.finish_reasons[index] is not None:
                continue  # aborted or stopped on this side; the engine has not heard yet
            # latencies: the completion's token count and last token time; a request's n share a TTFT
            n = len(delta.token_ids)
            num_tokens += n
            tracked.num_output_tokens += n
            last_times = tracked.last_token_time
            previous, last_times[index] = last_times[index], now
            if tracked.first_token_time is None:
                tracked.first_token_time = now
                if ttft is not None:
                    ttft.observe(now - tracked.arrival)
            elif previous is not None:  # an inter-token latency, one a delta
                gaps[previous] = gaps.get(previous, 0) + 1
            # to its stream: a finishing delta wakes the consumer at once, the others when due
            stream = tracked.stream
            stream._pending.append((tracked.prompt_index, delta))
            if delta.finish_reason is not None:
                stream._urgent = True
                stream._wake()
                self._finish(delta.request_id, tracked, index, delta.finish_reason)
            elif stream._waiter is not None:  # else it is busy, and takes these when it comes back
                if loop_now >= stream._next_handover:
                    stream._wake()
                else:
                    self._pace(stream)
        if self.metrics:
            # once a step, not once a delta: a locked counter or histogram costs the loop ~1 us a call
            if num_tokens:
                self.metrics.generation_tokens.inc(num_tokens)
            for previous, count in gaps.items():
                self.metrics.itl.observe(now - previous, count)
        self._hand_over_due(loop_now)

    def _finish(self, request_id: str, tracked: _Tracked, index: int, reason: str) -> None:
        """Completion `index` of the request ended (the finish-reason metric is counted when its
        last delta is handed over: a stop string can still change the reason)."""
        tracked.finish_reasons[index] = reason
        if tracked.finished:
            self._retire(request_id, tracked)
            tracked.stream._prompt_finished()
            if tracked.stream.done:
                self._streams.discard(tracked.stream)

    def _stop_early(self, stream: RequestStream, prompt_index: int, index: int) -> None:
        """A stop string ended a completion the engine is still running: stop it there."""
        request_id = stream.request_ids[prompt_index]
        tracked = self._requests.get(request_id)
        if tracked is not None and tracked.finish_reasons[index] is None:
            self._commands.put(_Abort(request_id, index))
            self._finish(request_id, tracked, index, "stop")

    # ---------------------------------------------------------------------------- pacing (the event budget)
    def _pace(self, stream: RequestStream) -> None:
        """Hand `stream`'s deltas over at the first step after they are due. Hand-overs happen while
        the loop routes a step anyway, not at moments of their own: with an engine that lets go of the
        GIL around every op, each extra wake-up of the loop would take the GIL from the engine mid-step."""
        self._paced.add(stream)
        if self._pacing_timer is None:
            self._pacing_timer = self._loop.call_later(max(self.handover_interval_s, MIN_PACING_TIMER_S),
                                                       self._on_pacing_timer)

    def _hand_over_due(self, loop_now: float) -> None:
        if not self._paced:
            return
        due = [s for s in self._paced if s.done or s._next_handover <= loop_now]
        for stream in due:
            self._paced.discard(stream)
            stream._wake()

    def _on_pacing_timer(self) -> None:
        """The fallback: streams whose deltas wait while no step brings more (the engine busy with
        prefill chunks only, or idle) are handed over anyway."""
        self._pacing_timer = None
        now = self._loop.time()
        if now - self._last_dispatch >= self.handover_interval_s:
            self._hand_over_due(now)
        if self._paced:
            self._pacing_timer = self._loop.call_later(max(self.handover_interval_s, MIN_PACING_TIMER_S),
                                                       self._on_pacing_timer)

    def _probe_loop(self, due: float) -> None:
        """A timer due at loop time `due`: how late it runs is the loop's lag (a busy loop makes every
        request's arrival and every event wait that long); then the next one."""
        now = self._loop.time()
        self.metrics.loop_lag.observe(max(0.0, now - due))
        self.metrics.flush_gc_pauses()
        self._loop_probe = self._loop.call_at(now + LOOP_PROBE_S, self._probe_loop, now + LOOP_PROBE_S)

    def _fail_all(self, error: BaseException) -> None:
        self.error = error
        dead = EngineDead(f"the engine failed: {error!r}; restart the server")
        for stream in list(self._streams):
            for rid in stream.request_ids:
                tracked = self._requests.pop(rid, None)
                if tracked is not None:
                    self._num_seqs -= tracked.n
            stream._close(dead)
        self._streams.clear()
        self._paced.clear()

    # ---------------------------------------------------------------------------- the engine side
    def _on_engine_output(self, admissions: list[tuple[str, Exception | None]], deltas: list[Delta], now: float,
                          gauges: tuple, spec: SpecDecodeStats | None) -> None:
        """An engine iteration's results, on the loop thread: admissions, then deltas, then gauges."""
        if admissions:
            self._admit_all(admissions)
        if deltas:
            self._dispatch(deltas, now)
        if self.metrics:
            self.metrics.observe_engine(*gauges)
        if spec is not None and self.llm.stats.spec_decode is not None:  # the engine process's counters
            vars(self.llm.stats.spec_decode).update(vars(spec))

    def _run_thread(self) -> None:
        loop = self._loop

        def receive(block: bool) -> list:
            received = [self._commands.get()] if block else []
            while True:
                try:
                    received.append(self._commands.get_nowait())
                except queue.Empty:
                    return received

        def emit(admissions, deltas, now, gauges) -> None:
            loop.call_soon_threadsafe(self._on_engine_output, admissions, deltas, now, gauges, None)

        try:
            run_engine(self.llm, receive, emit)
        except Exception as e:
            log.exception("the engine thread failed; every request in flight fails with it")
            loop.call_soon_threadsafe(self._fail_all, e)

    def _send_commands(self) -> None:
        """Process mode: the command queue into the engine's pipe (the loop never blocks on a full pipe)."""
        process = self.llm
        while True:
            command = self._commands.get()
            try:
                process.send(command)
            except OSError:  # the engine is gone: the receiver reports it
                return
            if isinstance(command, _Stop):
                return

    def _receive_outputs(self) -> None:
        """Process mode: the engine's messages onto the loop, until its pipe ends; the iterations that
        came while the loop was busy go to it in one callback."""
        loop, pipe = self._loop, self.llm.outputs
        while True:
            steps, failure, ended = [], None, False
            try:
                while True:
                    kind, payload = pipe.recv()
                    if kind == "failed":
                        failure = RuntimeError(payload)
                        break
                    admissions, deltas, now, gauges, spec = payload
                    steps.append((admissions, [Delta(*d) for d in deltas], now, gauges, spec))
                    if not pipe.poll():
                        break
            except (EOFError, OSError):
                ended = True
                if not self._stopping:
                    failure = EngineDead("the engine process exited")
            if steps:
                loop.call_soon_threadsafe(self._on_engine_outputs, steps)
            if failure is not None:
                loop.call_soon_threadsafe(self._fail_all, failure)
            if failure is not None or ended:
                return

    def _on_engine_outputs(self, steps: list[tuple]) -> None:
        """Process mode: the iterations that came from the engine process since the last call, in order."""
        for step in steps:
            self._on_engine_output(*step)


def engine_gauges(llm: LLM) -> tuple[int, int, int, int, float]:
    """(running, waiting, KV blocks used, KV blocks free, prefix-cache hit rate): ServerMetrics.observe_engine's."""
    bm = llm.block_manager
    return (llm.scheduler.num_running, llm.scheduler.num_waiting, bm.num_used_blocks, bm.num_free_blocks,
            bm.prefix_cache_hit_rate)


def run_engine(llm: LLM, receive: Callable[[bool], list], emit: Callable[[list, list, float, tuple], None]) -> None:
    """The engine side of AsyncEngine, in its thread or its process: apply the commands that came
    (add: admitted or refused with the engine's reason; abort), run a step when there is work, and
    emit(admissions, deltas, time.perf_counter(), engine_gauges) whenever an iteration changed
    anything. receive(block) returns the commands waiting, blocking for one when block is True
    (nothing to compute: no busy loop when idle). Returns after a _Stop, having aborted everything."""
    sent_gauges = engine_gauges(llm)
    emit([], [], time.perf_counter(), sent_gauges)  # the state before the first request
    while True:
        # The server measures latencies itself (from HTTP arrival); the engine's own per-token lists
        # would otherwise grow with every token a long-running server makes.
        llm.stats.time_to_first_token.clear()
        llm.stats.inter_token_latency.clear()
        admissions: list[tuple[str, Exception | None]] = []
        for command in receive(not llm.has_unfinished()):
            if isinstance(command, _Stop):
                for request_id in list(llm.requests):
                    llm.abort(request_id)
                return
            if isinstance(command, _Abort):
                llm.abort(command.request_id, command.index)
                continue
            try:  # token ids only: the server makes the text (AsyncEngine, CompletionText)
                llm.add_request(command.prompt_token_ids, command.params, request_id=command.request_id,
                                detokenize=False)
                admissions.append((command.request_id, None))
            except ValueError as e:  # the engine's reason: prompt too long, max_tokens too large, ...
                admissions.append((command.request_id, e))
        deltas = llm.step() if llm.has_unfinished() else []
        gauges = engine_gauges(llm)
        if admissions or deltas or gauges != sent_gauges:
            emit(admissions, deltas, time.perf_counter(), gauges)
            sent_gauges = gauges
