"""The engine in a process of its own: `megactx serve --engine-process`.

In one process the server's event loop and the engine thread share one GIL, so whatever Python the
loop runs (HTTP parsing, building and writing server-sent events) the engine waits for, with the
device idle between steps. In a process of its own the engine keeps a core and a GIL to itself; the
server process keeps the HTTP work and talks to it through two pipes: commands (add, abort, stop)
one way, the engine iterations' results (admissions, deltas, gauges, speculative-decoding counters)
the other. `AsyncEngine` runs the same engine loop (`run_engine`) either way.

The engine process has no threads of its own: its loop polls the command pipe between iterations (a
`select.poll` set up once: ~1 us) and writes each iteration's results to the output pipe itself,
pickled (a batch-64 step's: ~2 KB; on the H200 host ~25 us to pickle, ~12 us to write). Threads
that carried the pipes for it (the loop only putting to and taking from in-process queues) cost it
more than the work they took over: every message woke a thread that wanted the GIL, the loop gave
it up at its next torch op, mid-step, and waited to get it back (~12,000 GIL waits in a 4.5 s run,
H200 host: the main thread's voluntary context switches, against ~80 without the threads). Three
interleaved pairs of served runs (64 clients, 2,048 x 128 tokens): 56.8-58.7K tokens/s without them
against 47.6-54.3K with, decode steps 0.83-0.85 against 0.92-1.03 ms (host 0.54-0.58 against
0.76-1.0 ms).

    engine = EngineProcess(dict(model="path/to/checkpoint", max_num_seqs=64))  # returns once it is loaded
    app = build_app(engine, served_model_name="tiny")                          # as with an LLM

The child is spawned (a fresh interpreter: CUDA cannot cross a fork), ignores SIGINT and SIGTERM
(the server drains its requests on them, then stops the engine) and exits when its command pipe
closes, so it never outlives the server. Once loaded, it takes what it holds out of the garbage
collector's sight (`settle_heap`), as the server process does.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import select
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megactx.engine.spec_decode import SpecDecodeStats
from megactx.engine.tokenizer import Tokenizer
from megactx.serve import DEFAULT_GC_THRESHOLD, settle_heap

log = logging.getLogger("megactx.serve")

# The GIL switch interval of a server that talks to an engine process (Python's default is 5 ms): its
# pipe threads, woken by a message, wait for the GIL until the event loop lets go. (Measured when the
# engine process had pipe threads too: at 5 ms a request's next one reached the engine 10.7 ms after
# the step that finished it, p50, H200, 64 clients; at 0.2 ms 6.7 ms.)
SWITCH_INTERVAL_S = 2e-4


@dataclass
class EngineInfo:
    """What the server needs to know of an engine it does not hold."""

    max_model_len: int
    max_num_seqs: int
    num_speculative_tokens: int
    memory_report: str


@dataclass
class RemoteStats:
    spec_decode: SpecDecodeStats | None  # kept up to date from the engine's messages


class EngineFailed(RuntimeError):
    """The engine process could not start (its reason: a bad checkpoint, a KV cache that does not fit, ...)."""


class EngineProcess:
    """An LLM(**llm_kwargs) in a spawned process (see the module docstring). The constructor waits
    until the model is loaded (at most start_timeout_s) and raises EngineFailed with the engine's
    reason if it could not be. Attributes as the server reads them from an LLM: tokenizer,
    max_model_len, max_num_seqs, stats.spec_decode."""

    def __init__(self, llm_kwargs: dict[str, Any], *, log_level: str = "INFO", start_timeout_s: float = 1800.0,
                 gc_threshold: int = DEFAULT_GC_THRESHOLD):
        ctx = mp.get_context("spawn")
        commands_out, self._commands_in = ctx.Pipe(duplex=False)  # (read end, write end)
        self.outputs, outputs_in = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_engine_main, name="megactx-engine", daemon=True,
                                   args=(llm_kwargs, commands_out, outputs_in, log_level, gc_threshold))
        self.process.start()
        commands_out.close()  # the child's ends: this process keeps only its own
        outputs_in.close()
        if not self.outputs.poll(start_timeout_s):
            self.process.kill()
            raise EngineFailed(f"the engine process did not load the model within {start_timeout_s:.0f} s")
        try:
            kind, payload = self.outputs.recv()
        except EOFError:
            self.process.join(5)
            raise EngineFailed(f"the engine process exited while loading (exit code {self.process.exitcode})") from None
        if kind != "ready":
            self.process.join(5)
            raise EngineFailed(payload)
        info: EngineInfo = payload
        self.info = info
        self.max_model_len, self.max_num_seqs = info.max_model_len, info.max_num_seqs
        gamma = info.num_speculative_tokens
        self.stats = RemoteStats(SpecDecodeStats(gamma) if gamma else None)
        model = Path(llm_kwargs["model"])
        tok_dir = Path(llm_kwargs.get("tokenizer") or model)
        self.tokenizer = Tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        log.info("megactx engine process %d: %s", self.process.pid, info.memory_report)

    def send(self, command: Any) -> None:
        self._commands_in.send(command)

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the command pipe (the engine exits at its end) and wait for the process."""
        self._commands_in.close()
        self.process.join(timeout_s)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
            self.process.kill()
            self.process.join()

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()


def _engine_main(llm_kwargs: dict[str, Any], commands, outputs, log_level: str, gc_threshold: int) -> None:
    """The child: load the engine, report ready (or why not), run the engine loop until told to stop
    or until the server's end of the command pipe closes."""
    from megactx.engine.llm import LLM
    from megactx.serve.async_engine import run_engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        llm = LLM(**llm_kwargs)
    except Exception as e:  # ValueError: the engine's own reason (a KV cache that does not fit, ...)
        outputs.send(("failed", f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
        return
    spec = llm.stats.spec_decode  # pickled with every iteration's results: the server's copy follows it
    settle_heap(gc_threshold)  # torch, the model, the engine: as the server does with its own (build_app)
    outputs.send(("ready", EngineInfo(llm.max_model_len, llm.max_num_seqs,
                                      spec.num_speculative_tokens if spec else 0, llm.memory_report())))

    poller = select.poll()  # set up once: ~1 us a poll, against ~8 for Connection.poll
    poller.register(commands.fileno(), select.POLLIN)

    def receive(block: bool) -> list:
        received = [commands.recv()] if block else []  # EOFError once the server's end closes
        while poller.poll(0):
            received.append(commands.recv())
        return received

    def emit(admissions, deltas, now, gauges) -> None:
        message = ("step", (admissions, [d.fields() for d in deltas], now, gauges, spec))
        try:
            outputs.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the server is gone
            raise EOFError from None

    try:
        run_engine(llm, receive, emit)
    except EOFError:
        pass
    except Exception as e:
        log.exception("the engine failed; every request in flight fails with it")
        with contextlib.suppress(OSError):
            outputs.send(("failed", f"{type(e).__name__}: {e}"))
