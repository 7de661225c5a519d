"""`AsyncEngine`: the `LLM` in a thread of its own, bridged to an asyncio event loop.

The LLM is not thread-safe, so exactly one thread owns it: the engine thread. The event loop
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from megactx.engine.llm import LLM, Delta
from megactx.engine.sampling_params import SamplingParams
from megactx.serve.metrics import ServerMetrics

log = logging.getLogger("megactx.serve")


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


class _Stop:
    pass


_END = object()  # queued to a RequestStream after its last delta


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
    fails meanwhile."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], num_prompts: int):
        self.request_ids = request_ids
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._admission: asyncio.Future = asyncio.get_running_loop().create_future()
        self._num_unadmitted = num_prompts
        self._num_unfinished = num_prompts
        self.done = False  # every completion finished, or aborted

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
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    # ------------------------------------------------ called by the engine, on the loop thread
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
            self._queue.put_nowait(_END if error is None else error)
        if error is not None and not self._admission.done():
            self._admission.set_exception(error)


class AsyncEngine:
    """Owns an LLM through a dedicated thread; see the module docstring.

    max_queued_requests: sequences admitted beyond the `max_num_seqs` the batch runs at once (>= 0).
    metrics: where engine gauges, token counters and latencies go (None: nowhere).
    All methods are called from the event loop's thread."""

    def __init__(self, llm: LLM, *, max_queued_requests: int, metrics: ServerMetrics | None = None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.llm = llm
        self.metrics = metrics
        self.capacity = llm.scheduler.config.max_num_seqs + max_queued_requests
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Tracked] = {}  # engine request id -> bookkeeping (loop thread only)
        self._streams: set[RequestStream] = set()
        self._num_seqs = 0  # sequences in flight: what the capacity bounds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop that will use the engine."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="megactx-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the engine thread. (The HTTP server drains its
        requests before it calls this, so normally nothing is left.)"""
        for stream in list(self._streams):
            stream.abort()
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Stop())
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Sequences accepted (or being admitted) and not finished."""
        return self._num_seqs

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
        arrival = time.perf_counter() if arrival is None else arrival
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids, len(prompts))
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
        """Route one step's deltas (made at time `now`) to their streams."""
        for delta in deltas:
            tracked = self._requests.get(delta.request_id)
            if tracked is None:  # aborted on this side; the engine has not heard yet
                continue
            self._record_latencies(tracked, delta, now)
            tracked.stream._queue.put_nowait((tracked.prompt_index, delta))
            if delta.finish_reason is not None:
                tracked.finish_reasons[delta.index] = delta.finish_reason
                if self.metrics:
                    self.metrics.completion_finished(delta.finish_reason)
                if tracked.finished:
                    self._retire(delta.request_id, tracked)
                    tracked.stream._prompt_finished()
                    if tracked.stream.done:
                        self._streams.discard(tracked.stream)

    def _record_latencies(self, tracked: _Tracked, delta: Delta, now: float) -> None:
        tracked.num_output_tokens += len(delta.token_ids)
        previous = tracked.last_token_time[delta.index]
        tracked.last_token_time[delta.index] = now
        first = tracked.first_token_time is None  # of the request: its n completions share one TTFT
        if first:
            tracked.first_token_time = now
        if self.metrics is None:
            return
        self.metrics.generation_tokens.inc(len(delta.token_ids))
        if first:
            self.metrics.ttft.observe(now - tracked.arrival)
        elif previous is not None:
            self.metrics.itl.observe(now - previous)

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

    # ---------------------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        llm, loop = self.llm, self._loop
        try:
            while True:
                self._observe_engine()  # the state after the last step or command, before a possible sleep
                # Sleep on the command queue while there is nothing to compute (no busy loop when idle).
                commands = [] if llm.has_unfinished() else [self._commands.get()]
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if isinstance(command, _Stop):
                        for request_id in list(llm.requests):
                            llm.abort(request_id)
                        return
                    if isinstance(command, _Abort):
                        llm.abort(command.request_id)
                        continue
                    try:
                        llm.add_request(command.prompt_token_ids, command.params, request_id=command.request_id)
                        error = None
                    except ValueError as e:  # the engine's reason: prompt too long, max_tokens too large, ...
                        error = e
                    loop.call_soon_threadsafe(self._admit, command.request_id, error)
                if llm.has_unfinished():
                    deltas = llm.step()
                    if deltas:
                        loop.call_soon_threadsafe(self._dispatch, deltas, time.perf_counter())
        except Exception as e:
            log.exception("the engine thread failed; every request in flight fails with it")
            loop.call_soon_threadsafe(self._fail_all, e)

    def _observe_engine(self) -> None:
        llm = self.llm
        # The server measures latencies itself (from HTTP arrival); the engine's own per-token lists
        # would otherwise grow with every token a long-running server makes.
        llm.stats.time_to_first_token.clear()
        llm.stats.inter_token_latency.clear()
        if self.metrics:
            bm = llm.block_manager
            self.metrics.observe_engine(llm.scheduler.num_running, llm.scheduler.num_waiting, bm.num_used_blocks,
                                        bm.num_free_blocks, bm.prefix_cache_hit_rate)
