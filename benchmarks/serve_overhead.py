"""`python -m benchmarks.serve_overhead`: what the HTTP server costs the engine, measured on a CPU
with a mock engine behind the real server stack.

`megactx serve` runs the LLM in an engine thread and the HTTP / SSE work on the asyncio loop of the
main thread; the two share the GIL. A decode step of batch 64 on an H200 takes ~4.3 ms, most of it
the engine's own Python (scheduler, input preparation, sampler launches, detokenizer, stop checks:
~2.7 ms of `LLM.step` at batch 64 outside the model and the sampler, timed on a CPU) and the rest a
wait on the device with the GIL released. In that time the loop has 64 deltas to route and up to 64
server-sent events to build and write; whatever GIL time it needs beyond the device wait is taken
from the engine thread, and the server delivers fewer tokens/s than the engine makes offline.

`MockLLM` reproduces that without a GPU. It has the surface `AsyncEngine` and the API use
(`add_request`, `step`, `abort`, `has_unfinished`, the scheduler / block-manager gauges, `stats`, a
real tokenizer) and its `step()` sleeps `--device-ms` (the device: GIL released), then does
`--host-us` of CPU work per running completion (GIL held; with `--op-us`, let go of for a moment that
often, as PyTorch does around every op), and emits one token (a real `Delta`, with `TokenLogprobs`
when asked) for each running completion, up to `--clients` of them at once. The defaults, 1 ms +
64 x 50 us, make a 4.3-4.6 ms step of which three quarters hold the GIL: the regime that gives the
H200's measured overhead (51%; the server before this benchmark's fixes shows ~40% here).

Offline: the mock alone, `--clients` requests of `--output-len` tokens run to completion in a loop
(as `LLM.generate` does): output tokens/s = tokens / wall.
Served: the real app (`megactx.serve.api.build_app`) over the mock, with uvicorn on loopback in a
subprocess (so the clients' Python is not on the server's GIL); `--clients` concurrent streaming
clients send `--requests` /v1/completions requests of `--output-len` tokens with token-id prompts,
each client its next request when its last one ends, after one untimed warm-up round. Delivered
tokens/s = the usage chunks' completion tokens / wall. Server overhead = 1 - delivered / offline.

Where the time goes: a step's wall time splits into the engine thread's time on a core, its wait
for a core (both from Linux's schedstat: on a small or busy machine the loop thread and the clients
take cores from it), the device time it slept, and the rest: its wait for the GIL. Also reported:
SSE events per token (below 1 where the server sends several tokens in one event), TTFT, request
latency, the loop thread's CPU a token, the server's garbage collections. `--profile N` runs
cProfile on the server's event loop during the timed round (its times include GIL waits: for where
the GIL goes, py-spy's `record --gil --threads -p PID` on the server subprocess is the better tool).

    python -m benchmarks.serve_overhead                           # 64 clients, 1 ms device + 64 x 50 us host
    python -m benchmarks.serve_overhead --device-ms 4 --host-us 0   # a device-bound step
    python -m benchmarks.serve_overhead --op-us 20                  # the GIL let go of every 20 us, as torch ops do
    python -m benchmarks.serve_overhead --max-handovers-per-s 0     # an SSE event every step (no event budget)
    python -m benchmarks.serve_overhead --out benchmarks/results    # + serve-overhead-cpu.json / .md
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import http.client
import io
import json
import os
import pstats
import random
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "megactx-bench-serve-overhead/1"
MAX_SERVER_OVERHEAD = 0.10  # the target: served tokens/s within 10% of offline
MODEL_NAME = "mock"
VOCAB_SAMPLE = 512  # distinct tokens the mock cycles through (texts of a real tokenizer)
SERVER_START_S = 60.0
SERVER_STOP_S = 30.0
DEFAULT_PROFILE_LINES = 30


# ------------------------------------------------------------------------------ settings
@dataclass
class Settings:
    """One run. The engine step at batch B takes device_ms + B * host_us / 1000 ms plus the mock's
    own bookkeeping; the defaults make a ~4.4 ms step at batch 64, three quarters of it holding the GIL."""

    clients: int = 64  # C: concurrent streaming clients, and the mock's batch (max_num_seqs)
    requests: int = 128  # R: timed requests in all (each client sends its next when one ends)
    output_len: int = 256  # M: tokens of every request (ignore_eos: exactly M)
    prompt_len: int = 16  # token ids of every prompt (the mock does no prefill)
    device_ms: float = 1.0  # a step's wait on the device, GIL released (time.sleep)
    host_us: float = 50.0  # a step's Python CPU time a running completion, GIL held
    op_us: float = 0.0  # the host Python releases the GIL this often, as a torch op does (0: never)
    logprobs: int | None = None  # ask for the top-k logprobs of every token (None: none)
    max_handovers_per_s: float | None = None  # the server's event budget (None: build_app's default)
    warmup_len: int = 16  # tokens of the untimed warm-up round's requests
    seed: int = 0
    tokenizer: str | None = None  # checkpoint directory with tokenizer.json (default: the cached random one)

    def check(self) -> None:
        for flag, value in (("--clients", self.clients), ("--requests", self.requests),
                            ("--output-len", self.output_len), ("--prompt-len", self.prompt_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for flag, value in (("--device-ms", self.device_ms), ("--host-us", self.host_us), ("--op-us", self.op_us)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")


# ------------------------------------------------------------------------------ the mock engine
@dataclass
class MockStats:
    """What the mock's thread did between a reset and a read: steps, tokens, the device time it slept
    (asked for), and over the whole wall time, from Linux's schedstat, the time it ran on a core
    (cpu_s) and waited in the run queue for one (runq_s). What is left of the wall time the thread
    was blocked otherwise: waiting for the GIL (and for sleeps to end, and idle between requests).
    cpu_s and runq_s are None where schedstat is not there."""

    steps: int = 0
    tokens: int = 0
    device_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float | None = None
    runq_s: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        d = dataclasses.asdict(self)
        n = self.steps or None
        d["mean_batch"] = self.tokens / n if n else None
        d["step_period_s"] = self.wall_s / n if n else None  # wall time a step, between-steps work included
        known = n and self.cpu_s is not None and self.runq_s is not None
        d["cpu_per_step_s"] = self.cpu_s / n if known else None
        d["runq_per_step_s"] = self.runq_s / n if known else None
        d["gil_per_step_s"] = (self.wall_s - self.cpu_s - self.runq_s - self.device_s) / n if known else None
        return d


def schedstat(native_id: int | None) -> tuple[float, float] | None:
    """(seconds on a core, seconds waiting in the run queue) of the thread with this native id
    since it started, from Linux's /proc schedstat; None where that is not known."""
    try:
        on_core, waiting = Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[:2]
        return int(on_core) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


@dataclass
class _MockRequest:
    request_id: str
    params: Any  # SamplingParams
    produced: list[int]  # tokens made so far, per completion
    finished: list[bool]
    detokenize: bool = True  # else its deltas carry no text (the server makes it)


class _MockScheduler:
    """The scheduler gauges the server reads (`config.max_num_seqs`, `num_running`, `num_waiting`)."""

    def __init__(self, llm: MockLLM, max_num_seqs: int, max_model_len: int):
        from megactx.engine.scheduler import SchedulerConfig

        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self._llm = llm

    @property
    def num_running(self) -> int:
        return min(self._llm.num_unfinished_seqs, self.config.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return max(0, self._llm.num_unfinished_seqs - self.config.max_num_seqs)


class MockLLM:
    """An engine whose step costs what it is told to: `device_s` with the GIL released, then `host_s`
    of CPU per running completion with the GIL held (let go of every `op_s`, if > 0). Every running
    completion (the first `max_num_seqs` in arrival order) gets one token a step, and finishes with
    "length" after max_tokens.

    tokenizer: a megactx Tokenizer; token texts are its decodes of VOCAB_SAMPLE ids, so the text the
    server streams is real BPE text. Not thread-safe, like LLM: one thread owns it."""

    def __init__(self, tokenizer, *, max_num_seqs: int, max_model_len: int, device_s: float, host_s: float,
                 op_s: float = 0.0):
        from megactx.engine.block_manager import BlockManager
        from megactx.engine.outputs import EngineStats

        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.device_s, self.host_s, self.op_s = device_s, host_s, op_s
        self.scheduler = _MockScheduler(self, max_num_seqs, max_model_len)
        self.block_manager = BlockManager(num_blocks=max_num_seqs)  # the gauges only: no KV lives here
        self.stats = EngineStats()
        self.requests: dict[str, _MockRequest] = {}
        self.num_unfinished_seqs = 0  # completions added and not finished or aborted
        self.mock_stats = MockStats()
        self.thread_id: int | None = None  # native id of the thread that steps it
        self._at_reset: tuple[float, tuple[float, float] | None] = (time.perf_counter(), None)
        ids = list(range(min(tokenizer.vocab_size, VOCAB_SAMPLE)))
        random.Random(0).shuffle(ids)
        self._token_ids = ids
        self._texts = {t: tokenizer.decode([t]) for t in ids}
        self._top = {t: -1.0 - 0.25 * i for i, t in enumerate(ids[:20])}  # a fixed top-20 for logprobs

    # ---------------------------------------------------------------------------- LLM's surface
    def add_request(self, prompt_token_ids: list[int], params, request_id: str, detokenize: bool = True) -> None:
        """Refuses what LLM refuses for length (ValueError), accepts everything else. (With
        detokenize=False, as the server adds requests, its deltas carry token ids only.)"""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens and max_tokens {params.max_tokens} "
                             f"does not fit in the context of {self.max_model_len}")
        self.requests[request_id] = _MockRequest(request_id, params, [0] * params.n, [False] * params.n, detokenize)
        self.num_unfinished_seqs += params.n

    def abort(self, request_id: str, index: int | None = None) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        for i in range(len(request.finished)) if index is None else [index]:
            if not request.finished[i]:
                request.finished[i] = True
                self.num_unfinished_seqs -= 1
        if all(request.finished):
            del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        """One token for each of the first max_num_seqs unfinished completions; list[Delta]."""
        from megactx.engine.outputs import Delta, TokenLogprobs

        self.thread_id = threading.get_native_id()
        running = self._running()
        time.sleep(self.device_s)
        _spin(self.host_s * len(running), self.op_s)
        deltas = []
        for request, index in running:
            position = request.produced[index]
            token = self._token_ids[(position + index) % len(self._token_ids)]
            request.produced[index] = position + 1
            finish = None
            if position + 1 >= request.params.max_tokens:
                finish, request.finished[index] = "length", True
                self.num_unfinished_seqs -= 1
            logprobs = None
            if request.params.logprobs is not None:
                top = dict(list(self._top.items())[: request.params.logprobs])
                logprobs = [TokenLogprobs(token, -0.5, top)]
            text = self._texts[token] if request.detokenize else ""
            deltas.append(Delta(request.request_id, index, text, [token], logprobs, finish))
        for request, _ in running:
            if all(request.finished):
                self.requests.pop(request.request_id, None)
        stats = self.mock_stats
        stats.steps += 1
        stats.tokens += len(deltas)
        stats.device_s += self.device_s
        return deltas

    def reset_stats(self) -> None:
        """Start counting (MockStats) from now; call after the stepping thread has stepped once."""
        self.mock_stats = MockStats()
        self._at_reset = (time.perf_counter(), schedstat(self.thread_id))

    def read_stats(self) -> dict[str, float | None]:
        start, sched_start = self._at_reset
        stats, sched = self.mock_stats, schedstat(self.thread_id)
        stats.wall_s = time.perf_counter() - start
        if sched is not None and sched_start is not None:
            stats.cpu_s, stats.runq_s = sched[0] - sched_start[0], sched[1] - sched_start[1]
        return stats.to_dict()

    # ---------------------------------------------------------------------------- internals
    def _running(self) -> list[tuple[_MockRequest, int]]:
        running = []
        for request in self.requests.values():
            for index, done in enumerate(request.finished):
                if not done:
                    running.append((request, index))
                    if len(running) == self.scheduler.config.max_num_seqs:
                        return running
        return running


def _spin(seconds: float, op_s: float = 0.0) -> None:
    """Python work: hold the GIL until this thread has used `seconds` of CPU (a tight loop of
    bytecode). CPU time, not wall time: work that loses the GIL or its core meanwhile takes longer,
    as real work does. With op_s > 0 it lets go of the GIL every op_s seconds of it, as PyTorch does
    around every op it runs."""
    now = time.thread_time()
    end = now + seconds
    while now < end:
        slice_end = min(end, now + op_s) if op_s else end
        while now < slice_end:
            now = time.thread_time()
        if op_s:
            select.select([], [], [], 0)  # a ~1 us system call without the GIL: a waiting thread may take it


def load_tokenizer(path: str | None):
    from megactx.engine.tokenizer import Tokenizer
    from megactx.generate import random_checkpoint

    return Tokenizer(path or random_checkpoint(log=lambda m: print(m, file=sys.stderr)))


def make_mock(s: Settings) -> MockLLM:
    return MockLLM(load_tokenizer(s.tokenizer), max_num_seqs=s.clients,
                   max_model_len=s.prompt_len + max(s.output_len, s.warmup_len),
                   device_s=s.device_ms / 1e3, host_s=s.host_us / 1e6, op_s=s.op_us / 1e6)


# ------------------------------------------------------------------------------ offline
def run_offline(s: Settings) -> dict[str, Any]:
    """The mock alone at batch C: C requests of M tokens stepped to the end, as LLM.generate does."""
    from megactx.engine.sampling_params import SamplingParams

    llm = make_mock(s)
    params = SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True, logprobs=s.logprobs)
    for i in range(s.clients):
        llm.add_request([0] * s.prompt_len, params, request_id=f"offline-{i}")
    llm.thread_id = threading.get_native_id()
    llm.reset_stats()
    start = time.perf_counter()
    while llm.has_unfinished():
        llm.step()
    wall = time.perf_counter() - start
    engine = llm.read_stats()
    return {"tokens": engine["tokens"], "wall_s": wall, "tokens_per_s": engine["tokens"] / wall, "engine": engine}


# ------------------------------------------------------------------------------ the server process
def serve(s: Settings, fd: int) -> None:
    """The server subprocess: build_app over a MockLLM, uvicorn on the inherited listening socket.
    Extra routes: POST /mock/reset (zero the mock's stats; start profiling the loop thread when
    asked), GET /mock/stats (the stats; stop profiling, and the profile's text under "profile")."""
    import cProfile

    import uvicorn
    from fastapi.responses import JSONResponse

    from megactx.serve.api import build_app

    budget = {} if s.max_handovers_per_s is None else {"max_handovers_per_s": s.max_handovers_per_s}
    app = build_app(make_mock(s), served_model_name=MODEL_NAME, max_queued_requests=s.clients, **budget)
    llm = app.state.engine.llm
    profiler: list[cProfile.Profile] = []
    loop_cpu = [0.0]  # the event loop thread's CPU seconds at the last reset
    gc_pauses = GCPauses()
    gc.callbacks.append(gc_pauses.callback)

    async def reset(profile: int = 0) -> JSONResponse:
        llm.reset_stats()
        gc_pauses.reset()
        loop_cpu[0] = time.thread_time()  # this thread's: the event loop's
        if profile:
            profiler[:] = [cProfile.Profile()]
            profiler[0].enable()  # this thread's: the event loop's
        return JSONResponse({"ok": True})

    async def stats(profile_lines: int = DEFAULT_PROFILE_LINES) -> JSONResponse:
        out: dict[str, Any] = {"engine": llm.read_stats(), "loop_cpu_s": time.thread_time() - loop_cpu[0],
                               "gc": gc_pauses.to_dict()}
        if profiler:
            profiler[0].disable()
            text = io.StringIO()
            pstats.Stats(profiler[0], stream=text).sort_stats("tottime").print_stats(profile_lines)
            out["profile"] = text.getvalue()
            profiler.clear()
        return JSONResponse(out)

    app.post("/mock/reset")(reset)
    app.get("/mock/stats")(stats)
    sock = socket.socket(fileno=fd)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


class GCPauses:
    """Collections of the cyclic garbage collector and the seconds they took, by generation (a
    `gc.callbacks` entry). A collection holds the GIL: every thread waits for it."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def to_dict(self) -> dict[str, list]:
        return {"collections": list(self.counts), "seconds": list(self.seconds)}


class ServerProcess:
    """`python -m benchmarks.serve_overhead --serve-fd FD ...` on a loopback socket bound here (so
    there is no race for a free port); stopped with SIGTERM (uvicorn's graceful shutdown)."""

    def __init__(self, s: Settings):
        self.s = s

    def __enter__(self) -> ServerProcess:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.port = self.sock.getsockname()[1]
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "benchmarks.serve_overhead", "--serve-fd", str(self.sock.fileno()),
               *settings_args(self.s)]
        self.proc = subprocess.Popen(cmd, pass_fds=[self.sock.fileno()], stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[1])
        return self

    def __exit__(self, *exc) -> None:
        from benchmarks.common import stop_process

        stop_process(self.proc, SERVER_STOP_S)
        self.sock.close()
        self.log.close()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if http_call(self.port, "GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {SERVER_START_S:.0f} s:\n{self.output()}")
            time.sleep(0.1)


def http_call(port: int, method: str, path: str) -> tuple[int, Any]:
    """(status, JSON body) of one small request to the server (setup and stats, not timed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SERVER_START_S)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def settings_args(s: Settings) -> list[str]:
    """The command-line flags that make `s` again (for the server subprocess)."""
    args = []
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        if value is not None:
            args += [f"--{f.name.replace('_', '-')}", str(value)]
    return args


# ------------------------------------------------------------------------------ the clients
@dataclass
class RequestResult:
    ttft_s: float  # from sending to the first event with a token
    latency_s: float  # from sending to `data: [DONE]`
    completion_tokens: int  # from the usage chunk
    events: int  # SSE events with choices (the usage chunk and [DONE] not counted)


class StreamingClient:
    """One keep-alive HTTP/1.1 connection that POSTs streaming completions one after another and
    reads each to its end with as little client Python as it can: SSE events are counted on the raw
    bytes of each HTTP chunk (uvicorn writes whole events a chunk), and only the last event before
    `data: [DONE]` (the usage chunk) is parsed. httpx's AsyncClient is not used: with 64 concurrent
    streams in one process its connection pool answers seconds late (encode/httpx#3215), which
    would measure the client instead of the server."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: dict[str, Any]) -> RequestResult:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode()
        start = time.perf_counter()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        if not head.startswith("HTTP/1.1 200"):
            raise RuntimeError(f"{head.splitlines()[0]} from /v1/completions: {await self.reader.read(500)!r}")
        if "transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"expected a chunked event stream, got headers:\n{head}")
        first, events, last = None, 0, b""
        while True:
            size = int(await self.reader.readuntil(b"\r\n"), 16)
            chunk = (await self.reader.readexactly(size + 2))[:-2]  # without the chunk's CRLF
            if size == 0:
                break
            if first is None:
                first = time.perf_counter()
            events += chunk.count(b"data: ")
            if not chunk.startswith(b"data: [DONE]"):
                last = chunk
        end = time.perf_counter()
        if not last.startswith(b"data: {"):
            raise RuntimeError(f"the stream ended without a usage chunk: {last[:300]!r}")
        usage = json.loads(last.removeprefix(b"data: ")).get("usage")
        if usage is None:
            raise RuntimeError(f"no usage chunk before [DONE]: {last[:300]!r}")
        return RequestResult(first - start, end - start, usage["completion_tokens"], events - 2)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def client_round(port: int, bodies: list[dict[str, Any]], concurrency: int
                       ) -> tuple[list[RequestResult], float]:
    """Every body sent by `concurrency` clients, each sending its next request when its last one
    ends. Returns the results and the wall time of the round."""
    pending = list(reversed(bodies))
    results: list[RequestResult] = []

    async def client() -> None:
        conn = StreamingClient(port)
        try:
            while pending:
                results.append(await conn.post(pending.pop()))
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def completion_bodies(s: Settings, num: int, max_tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    return [{"model": MODEL_NAME, "prompt": [rng.randrange(VOCAB_SAMPLE) for _ in range(s.prompt_len)],
             "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True}, **({"logprobs": s.logprobs} if s.logprobs is not None else {})}
            for _ in range(num)]


def run_served(s: Settings, profile_lines: int) -> dict[str, Any]:
    """One warm-up round of C requests, then the timed round of R, against a server subprocess."""
    with ServerProcess(s) as server:
        server.wait_ready()
        rng = random.Random(s.seed)
        warm = completion_bodies(s, s.clients, s.warmup_len, rng)
        asyncio.run(client_round(server.port, warm, s.clients))
        http_call(server.port, "POST", f"/mock/reset?profile={int(profile_lines > 0)}")
        bodies = completion_bodies(s, s.requests, s.output_len, rng)
        cpu = time.process_time()
        results, wall = asyncio.run(client_round(server.port, bodies, s.clients))
        client_cpu = time.process_time() - cpu
        server_side = http_call(server.port, "GET", f"/mock/stats?profile_lines={profile_lines}")[1]
    tokens = sum(r.completion_tokens for r in results)
    if tokens != s.requests * s.output_len:
        raise RuntimeError(f"the clients got {tokens} tokens, not {s.requests} x {s.output_len}")
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "events_per_token": sum(r.events for r in results) / tokens,
            "ttft_p50_s": statistics.median(r.ttft_s for r in results),
            "latency_p50_s": statistics.median(r.latency_s for r in results),
            "client_cpu_fraction": client_cpu / wall,  # near 1: the clients, not the server, set the pace
            "loop_cpu_s": server_side["loop_cpu_s"],  # the server's event loop thread, GIL waits not included
            "gc": server_side["gc"],  # the server process's garbage collections in the timed round
            "engine": server_side["engine"], "profile": server_side.get("profile")}


# ------------------------------------------------------------------------------ the run and its report
def run(s: Settings, profile_lines: int = 0) -> dict[str, Any]:
    s.check()
    machine = _machine()
    offline = run_offline(s)
    served = run_served(s, profile_lines)
    overhead = 1.0 - served["tokens_per_s"] / offline["tokens_per_s"]
    return {"schema": SCHEMA, "settings": dataclasses.asdict(s), "machine": machine,
            "offline": offline, "served": served, "overhead": overhead,
            "target": {"max_overhead": MAX_SERVER_OVERHEAD, "met": overhead <= MAX_SERVER_OVERHEAD}}


def _machine() -> dict[str, Any]:
    import platform

    import fastapi
    import pydantic
    import uvicorn

    return {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "load_average": os.getloadavg()[0],
            "fastapi": fastapi.__version__, "uvicorn": uvicorn.__version__, "pydantic": pydantic.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def markdown(r: dict[str, Any]) -> str:
    from benchmarks.common import fmt_num, fmt_time, md_table

    s, off, srv = r["settings"], r["offline"], r["served"]

    def engine_cells(e: dict[str, Any]) -> list[str]:
        return [fmt_num(e["mean_batch"]), fmt_time(e["step_period_s"]), fmt_time(e["cpu_per_step_s"]),
                fmt_time(e["runq_per_step_s"]), fmt_time(e["gil_per_step_s"])]

    rows = [["offline (the mock alone)", fmt_num(off["tokens_per_s"]), *engine_cells(off["engine"]), "", "", ""],
            ["served (build_app + uvicorn)", fmt_num(srv["tokens_per_s"]), *engine_cells(srv["engine"]),
             f"{srv['events_per_token']:.3f}", fmt_time(srv["ttft_p50_s"]), fmt_time(srv["latency_p50_s"])]]
    verdict = "met" if r["target"]["met"] else "**not met**"
    logprobs = "" if s["logprobs"] is None else f", logprobs {s['logprobs']}"
    ops = f", letting go of the GIL every {s['op_us']} µs of it" if s["op_us"] else ""
    budget = "build_app's default" if s["max_handovers_per_s"] is None else f"{s['max_handovers_per_s']:g}/s"
    m = r["machine"]
    return (
        f"# megactx serve overhead (mock engine, CPU)\n\n"
        f"{m['date']}; Python {m['python']}, fastapi {m['fastapi']}, uvicorn {m['uvicorn']}, "
        f"pydantic {m['pydantic']}; {m['cores']} cores, load average {m['load_average']:.2f} at the start.\n\n"
        f"Mock step: {s['device_ms']} ms of device (GIL released) + {s['host_us']} µs of engine Python a running "
        f"completion{ops}; {s['clients']} streaming clients, {s['requests']} requests of {s['output_len']} "
        f"tokens{logprobs}; event budget {budget}.\n\n"
        + md_table(["run", "output tokens/s", "mean batch", "a step", "engine thread: on a core",
                    "waiting for a core", "waiting for the GIL", "SSE events / token", "TTFT p50", "latency p50"],
                   rows)
        + f"\nServer overhead: **{r['overhead']:.1%}** (target <= {MAX_SERVER_OVERHEAD:.0%}: {verdict}). "
        f"A step's wall time (between-steps work included) splits into the engine thread's time on a core and "
        f"waiting for one (Linux's schedstat), the device time it slept ({s['device_ms']} ms), and the rest: "
        f"waiting for the GIL (and for sleeps to end). The server's event loop thread used "
        f"{srv['loop_cpu_s'] / srv['wall_s']:.0%} of a core ({srv['loop_cpu_s'] / srv['tokens'] * 1e6:.1f} µs "
        f"a token, system calls included); the client process {srv['client_cpu_fraction']:.0%}. Garbage "
        f"collections in the server (generations 0/1/2): {'/'.join(map(str, srv['gc']['collections']))}, "
        f"{sum(srv['gc']['seconds']) * 1e3:.0f} ms.\n"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--clients", type=int, default=d.clients, help="concurrent streaming clients, and the mock's "
                                                                    "batch (default %(default)s)")
    p.add_argument("--requests", type=int, default=d.requests, help="timed requests in all (default %(default)s)")
    p.add_argument("--output-len", type=int, default=d.output_len, help="tokens a request (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="token ids a prompt (default %(default)s)")
    p.add_argument("--device-ms", type=float, default=d.device_ms,
                   help="a step's device time, GIL released (default %(default)s)")
    p.add_argument("--host-us", type=float, default=d.host_us,
                   help="a step's engine Python (CPU time) per running completion, GIL held (default %(default)s)")
    p.add_argument("--op-us", type=float, default=d.op_us,
                   help="the engine's Python lets go of the GIL this often, as PyTorch does around each op "
                        "(default %(default)s: never, one release a step, the device wait)")
    p.add_argument("--logprobs", type=int, default=None, help="request top-k logprobs of every token (default off)")
    p.add_argument("--max-handovers-per-s", type=float, default=None,
                   help="the server's SSE event budget, all streams together (build_app's max_handovers_per_s; "
                        "0 = an event a step; default: build_app's default)")
    p.add_argument("--warmup-len", type=int, default=d.warmup_len,
                   help="tokens of the untimed warm-up requests (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tokenizer", help="checkpoint directory whose tokenizer.json makes the token texts "
                                       "(default: the cached random tiny checkpoint)")
    p.add_argument("--profile", type=int, nargs="?", const=DEFAULT_PROFILE_LINES, default=0, metavar="N",
                   help="cProfile the server's event loop during the timed round; print its N costliest "
                        f"functions (default N {DEFAULT_PROFILE_LINES}; their times include waits for the GIL)")
    p.add_argument("--out", type=Path, help="write serve-overhead-cpu.json and .md into this directory "
                                            "(e.g. benchmarks/results); default: print only")
    p.add_argument("--serve-fd", type=int, help=argparse.SUPPRESS)  # internal: run as the server subprocess


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    s = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    if args.serve_fd is not None:
        serve(s, args.serve_fd)
        return 0
    try:
        result = run(s, args.profile)
    except (ValueError, RuntimeError) as e:
        print(f"serve_overhead: error: {e}", file=sys.stderr)
        return 2
    profile = result["served"].pop("profile", None)
    report = markdown(result)
    print(report)
    if profile:
        print("Event loop thread, timed round (cProfile, by own time):\n" + profile)
    if args.out is not None:
        from benchmarks.common import write_json

        write_json(args.out / "serve-overhead-cpu.json", result)
        (args.out / "serve-overhead-cpu.md").write_text(report)
        print(f"wrote {args.out / 'serve-overhead-cpu.json'} and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
