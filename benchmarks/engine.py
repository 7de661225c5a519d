"""`megactx bench engine`: the whole engine on one checkpoint — offline throughput and latency at
several batch sizes against Hugging Face transformers' `generate` on the same device in the same
run, and an online run through `megactx serve` with many concurrent HTTP clients.

Offline: for each batch size B, B prompts of P random token ids each generate exactly M tokens
(greedy, ignore_eos) with `LLM.generate`: one untimed warm-up run of the same shape (on a CPU, 2
tokens long), then 3 timed runs (--reps), each on prompts of its own. Figures: the median run's
wall time and output tokens/s (B·M / wall); TTFT (arrival to first token, per request) and ITL (gap
between a request's successive tokens) at p50 / p99 over all timed runs. Both engines are loaded
side by side and their timed runs alternate (megactx, transformers, megactx, ...): the speed of a
lent GPU machine's host, which bounds both at these sizes, was seen to change twofold within minutes.

Peer: transformers' own model class loads the same checkpoint directory (AutoModelForCausalLM,
bf16 on a GPU, fp32 on a CPU) and runs `generate` on the same prompts as one batch (equal lengths:
no padding), greedy, max_new_tokens = min_new_tokens = M. A streamer stamps every decoding step,
giving its TTFT and ITL. The JSON also says how many requests got the same tokens from both.

Online: `python -m megactx serve --model PATH --host 127.0.0.1 --port P [--serve-arg ...]` runs as
a subprocess; after /health answers, C client threads send R streaming /v1/completions requests in
all (token-id prompts of length P, max_tokens M, temperature 0, ignore_eos), after one untimed
warm-up round of C requests. The server is started with the offline engine's --device,
--max-model-len (P + M), --max-num-seqs and no speculative decoding. Figures: requests/s, output
tokens/s, request latency and TTFT (first streamed chunk) at p50 / p99, and the mean TTFT beside the
server's own (its /metrics histogram, from the request handler). Each client keeps its connection
(HTTP keep-alive, as the OpenAI SDK's clients do). Server overhead = 1 −
online tokens/s ÷ offline tokens/s at batch C. The R requests go in rounds (16 on a GPU) with
offline runs at batch C before the first and after each, and the offline figure is their mean: the
offline engine stays loaded beside the server (idle while the clients run), since a lent host's
speed drifts, within a run, by more than the 10% to be measured. The target is judged round by
round: each round's overhead against the offline runs just before and after it, and the median of
those with a distribution-free 95% interval (from 6 rounds on): passed when the interval lies below
10%, failed when above, undecided when it holds 10%. Independent runs of one workload can pool
their rounds (`--from-json A B ...` reports A, judging the target on the rounds of all). Three
runs, side by side: C
clients with the engine in a thread of the server's process (`--no-engine-process`), and in a
process of its own (serve's default; `--no-online-engine-process` skips that run); then the default
server with its batch kept full: its --max-num-seqs is C and 2C clients send (--saturated-clients;
0 skips it), so requests queue in the server and its engine runs batches of C, as the offline
engine does (vLLM compares its server at request rate inf with its offline throughput the same
way). At exactly C clients each finished request's slot idles until that client's next request has
come through the HTTP layer: those runs measure the clients' turnaround too. Beside them, the C-client
workload on the offline engine in-process, without HTTP (C requests in flight, the clients starting
one a step, a client's next added when its last ends): what the engine itself makes of requests
that arrive as others end, so that the closed loop's overhead splits into the engine's part and
the server's.

Targets (the issue's): megactx >= 10x transformers' output tokens/s at batch 64 on a GPU; server
overhead <= 10%, judged on the run with the batch kept full (what the server costs the engine); the
default server's closed-loop overhead at C clients is quoted beside it.

Default sizes:

    device      batches     P    M    clients C  requests R  rounds
    GPU         1, 16, 64   128  128  64         16384       16
    GPU --quick 1, 16       128  32   16         64          2
    CPU         1, 16, 64   32   16   16         32          1
    CPU --quick 1, 16       16   8    16         16          1

A CPU run uses one torch thread in every part, the server included: the tiny model's ops gain
nothing from more, and OpenMP threads waiting for a core on a busy machine cost up to 10x
(--threads changes it).

Without --model the shipped models/megactx-tiny is used, else a random tiny checkpoint made and
cached (see `megactx generate --help`); the figures measure the engine, not the quality of the text. Results:
benchmarks/results/engine-<device>.json, .md, .png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import itertools
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Ceilings,
    Progress,
    ceilings_markdown,
    fmt_num,
    fmt_time,
    free_device_memory,
    host_probe_ms,
    int_list,
    machine_info,
    md_table,
    measure_machine_ceilings,
    pyplot,
    rerender_from_json,
    save_figure,
    stop_process,
    sync_device,
    write_suite_reports,
)
from megactx.engine import steplog

HELP = "engine throughput, TTFT and ITL at batch 1/16/64 against transformers, and online through megactx serve"
SCHEMA = "megactx-bench-engine/1"
RESULTS_DIR = Path(__file__).parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]
# Targets of the issue (benchmark figures, not tests).
TARGET_SPEEDUP = 10.0  # megactx output tokens/s >= 10x transformers' ...
TARGET_SPEEDUP_BATCH = 64  # ... at this batch, on a GPU
MAX_SERVER_OVERHEAD = 0.10  # online tokens/s within 10% of offline at the engine's batch (ONLINE_SATURATED's)
ONLINE_PROCESS = "online_engine_process"  # results key (and part name) of the --engine-process online run
# results key (and part name) of the run the overhead target is judged on: the default server with
# more clients than its --max-num-seqs, so that requests queue and the engine's batch stays full
ONLINE_SATURATED = "online_saturated"
ONLINE_RUNS = (("online", "engine thread (--no-engine-process)"), (ONLINE_PROCESS, "engine process (default)"),
               (ONLINE_SATURATED, "engine process (default), batch kept full"))
CLOSED_LOOP = "closed_loop"  # results key: the online workload on the offline engine, in-process
CLOSED_LOOP_LABEL = "engine alone, in-process (no HTTP)"
# offline runs at batch C before an online run's first round and after each (the figure its overhead
# is taken against): the lent H200 host's speed moved +-25% from one 0.2 s run to the next (tokens/s
# of batch-64 runs back to back: 28,680 ... 46,714) and by 1.4x between two sets of such runs 20 s
# apart, so one run, or runs only before and after the whole online run, would not do. (Its vCPUs each
# switch between two speeds, 1.7x apart, every 1-3 s: benchmarks/README.md, `megactx bench engine`.)
REFERENCE_RUNS = 8
# an online run whose offline references (the sets of REFERENCE_RUNS around its rounds) differ by more
# than this fraction of their mean cannot decide the overhead target: the host's speed moved by more
# than the 10% to be measured (seen on the H200 host: sets 40-70K tokens/s apart within a minute)
MAX_REFERENCE_SPREAD = MAX_SERVER_OVERHEAD
HEALTH_POLL_S = 0.5
SERVER_STOP_S = 30.0  # after SIGTERM, then SIGKILL
LOG_TAIL_CHARS = 1500  # of the server's output, in the reason of a failed online run
MEGACTX, TRANSFORMERS, SERVE, CLOSED = "megactx", "transformers", "megactx serve", "megactx closed loop"


# ------------------------------------------------------------------------------ settings
@dataclass
class Settings:
    """Sizes of a run (see the module docstring for the defaults by device)."""

    device: str = "cuda"
    batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    prompt_len: int = 128  # P, tokens of every prompt
    output_len: int = 128  # M, tokens every request generates
    # tokens of the untimed warm-up runs: on a GPU the whole length, so that every kernel the timed
    # run needs (Triton specialises on sizes) is compiled before it; on a CPU a short run suffices
    warmup_len: int = 128
    reps: int = 3  # timed runs of every batch (other prompts each); the figure is the median run's
    concurrency: int = 64  # C, online clients in flight
    # the saturated run's clients (None: 2C), against a server whose --max-num-seqs is C: requests
    # queue, so the engine's batch stays at C as the offline one's does (0: no such run)
    saturated_clients: int | None = None
    # R, online requests in all, sent in `rounds` rounds with offline runs between them (the figure
    # the overhead is taken against; see REFERENCE_RUNS). 16 a client in a round on a GPU: a round
    # starts at once and ends unevenly (requests made in turns end in turns), so fewer than C are in
    # flight at either end of it; at 4 a client those ends took 13% of a round (H200: 6% of its tokens/s)
    requests: int = 4096
    rounds: int = 1  # 16 on a GPU (defaults): enough for an interval of the rounds' median
    seed: int = 0
    # torch intra-op threads in every part (None: torch's default). A CPU run uses 1: the tiny
    # model's ops are too small to gain from more, OpenMP teams spinning on a busy machine cost up
    # to 10x, and the server's engine runs in a thread of its own, so the parts compare only at a
    # fixed count.
    threads: int | None = None
    peer: bool = True
    online: bool = True
    online_engine_process: bool = True  # the online run again with `megactx serve --engine-process`
    serve_args: list[str] = field(default_factory=list)
    port: int | None = None  # None: a free port
    server_timeout_s: float = 600.0  # model load + first compiles before /health answers
    request_timeout_s: float = 600.0

    @classmethod
    def defaults(cls, device: str, quick: bool) -> Settings:
        if device == "cuda":
            if quick:
                return cls(device, [1, 16], 128, 32, concurrency=16, requests=64, rounds=2)
            return cls(device, requests=16384, rounds=16)
        if quick:
            return cls(device, [1, 16], 16, 8, warmup_len=2, concurrency=16, requests=16, rounds=1, threads=1,
                       server_timeout_s=300)
        return cls(device, [1, 16, 64], 32, 16, warmup_len=2, concurrency=16, requests=32, rounds=1, threads=1,
                   server_timeout_s=300)

    def check(self) -> None:
        """ValueError naming the flag of a bad size."""
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"--batches must be positive batch sizes, e.g. 1,16,64; got {self.batches}")
        for flag, value in (("--prompt-len", self.prompt_len), ("--output-len", self.output_len),
                            ("--concurrency", self.concurrency), ("--requests", self.requests),
                            ("--threads", 1 if self.threads is None else self.threads), ("--reps", self.reps),
                            ("--rounds", self.rounds)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.saturated_clients is not None and self.saturated_clients < 0:
            raise ValueError(f"--saturated-clients must be >= 0 (0 = no such run), got {self.saturated_clients}")
        if self.requests < self.rounds:
            raise ValueError(f"--requests ({self.requests}) must be at least --rounds ({self.rounds}): "
                             "every round sends some")
        self.warmup_len = min(self.warmup_len, self.output_len)

    @property
    def num_saturated_clients(self) -> int:
        return 2 * self.concurrency if self.saturated_clients is None else self.saturated_clients

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"dtype": str(self.dtype).removeprefix("torch.")}


# ------------------------------------------------------------------------------ figures
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """p50, p99, mean and count of seconds; None for no values."""
    if not values:
        return None
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "mean": sum(values) / len(values),
            "n": len(values)}


@dataclass
class RunFigures:
    """One timed run. batch: requests in flight at once (an offline batch, or the online clients);
    latencies in seconds as `summarize` dicts (None where the run cannot tell)."""

    engine: str  # MEGACTX | TRANSFORMERS | SERVE
    batch: int
    requests: int
    prompt_len: int
    output_len: int
    output_tokens: int  # generated in all
    wall_s: float
    ttft_s: dict[str, float] | None
    itl_s: dict[str, float] | None
    latency_s: dict[str, float] | None  # arrival to last token, per request
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def clients(self) -> int:
        """The clients that sent an online run's requests (more than its batch when it kept the batch full)."""
        return self.detail.get("clients", self.batch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"tokens_per_s": self.tokens_per_s, "requests_per_s": self.requests_per_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunFigures:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids drawn uniformly from the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()


def _prompt_seed(s: Settings, batch: int, run: int) -> int:
    """The seed of the prompts of one run (0 = the warm-up, 1.. the timed ones) at one batch size:
    every run gets prompts of its own, so none finds its prompt in the prefix cache, and both
    engines get the same prompts for the same (batch, run). (A tuple of ints hashes the same in
    every process.)"""
    return hash((s.seed, batch, run)) & (2**63 - 1)


# ------------------------------------------------------------------------------ offline: megactx
def _timed_figures(engine: str, batch: int, s: Settings, walls: list[float], tokens: int, ttft: list[float],
                   itl: list[float], latency: list[float], detail: dict[str, Any]) -> RunFigures:
    """Figures of `s.reps` timed runs of one batch: the median run's wall time and tokens, the
    latencies of every run pooled."""
    if tokens != batch * s.output_len * len(walls):  # ignore_eos: only the length ends a request
        raise RuntimeError(f"{engine} generated {tokens} tokens in {len(walls)} runs of {batch} requests, "
                           f"asked for {s.output_len} a request")
    return RunFigures(engine, batch, batch, s.prompt_len, s.output_len, batch * s.output_len,
                      statistics.median(walls), summarize(ttft), summarize(itl), summarize(latency),
                      detail | {"walls_s": walls})


def megactx_runs(llm, s: Settings, batch: int, tokens: list[list[int]]) -> Generator[None, None, RunFigures]:
    """One warm-up and `s.reps` timed `llm.generate` calls of `batch` prompts, yielding after each
    timed run (see `interleaved`); returns the figures. `tokens` gets the first timed run's tokens."""
    from megactx import SamplingParams

    vocab = llm.cfg.vocab_size
    warm = SamplingParams(temperature=0.0, max_tokens=s.warmup_len, ignore_eos=True)
    llm.generate(random_prompts(batch, s.prompt_len, vocab, _prompt_seed(s, batch, 0)), warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
    walls, ttft, latency, generated = [], [], [], 0
    itl_from, steps_from = len(llm.stats.inter_token_latency), llm.stats.steps
    with logged_steps(llm) as step_figures:
        for run in range(1, s.reps + 1):
            prompts = random_prompts(batch, s.prompt_len, vocab, _prompt_seed(s, batch, run))
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
            if run == 1:
                tokens[:] = [o.token_ids for o in outs]
            generated += sum(len(o.token_ids) for o in outs)
            ttft += [o.first_token_time - o.arrival_time for o in outs]
            latency += [o.finish_time - o.arrival_time for o in outs]
            yield
    itl = llm.stats.inter_token_latency[itl_from:]
    steps = (llm.stats.steps - steps_from) // s.reps
    return _timed_figures(MEGACTX, batch, s, walls, generated, ttft, itl, latency,
                          {"steps": steps, "engine_steps": step_figures()})


def interleaved(runs: list[Generator[None, None, RunFigures]]) -> list[RunFigures]:
    """Advance the runs in turn, one timed run of each at a time, until all are done; their figures.
    Two engines timed alternately see the same drifts of the machine (a lent GPU host's speed was
    seen to change twofold within minutes), so their ratio holds where back-to-back parts would not."""
    figures: list[RunFigures | None] = [None] * len(runs)
    active = list(enumerate(runs))
    while active:
        for item in list(active):
            try:
                next(item[1])
            except StopIteration as done:
                figures[item[0]] = done.value
                active.remove(item)
    return figures


def offline_engine(path: Path, s: Settings):
    """The engine for the offline runs: room for the largest batch (or the online run's clients) of
    P + M tokens a request, as the server's. Its KV cache holds every sequence twice over and no
    more: the engine stays loaded beside the server, for the offline runs around each online run."""
    from megactx import LLM
    from megactx.kernels.reference import BLOCK_SIZE

    max_num_seqs = max(s.concurrency, *s.batches)
    blocks_per_seq = -(-(s.prompt_len + s.output_len) // BLOCK_SIZE)
    return LLM(path, device=s.device, dtype=s.dtype, max_model_len=s.prompt_len + s.output_len,
               max_num_seqs=max_num_seqs, num_blocks=2 * max_num_seqs * blocks_per_seq, seed=s.seed)


# ------------------------------------------------------------------------------ offline: transformers
class _StepStamps:
    """A transformers streamer that notes the host time of every `put`: the prompt first, then
    each decoding step's tokens (transformers syncs with the device every step to check for the
    end, so these are the times tokens exist on the host)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_transformers(path: Path, s: Settings):
    """transformers' model class for the checkpoint, on the bench device in the bench dtype."""
    import transformers

    transformers.logging.set_verbosity_error()  # its load report lists the MTP layer it does not use
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=s.dtype)
    return model.to(s.device).eval()


def transformers_runs(model, s: Settings, batch: int, vocab_size: int,
                      reference: list[list[int]] | None = None) -> Generator[None, None, RunFigures]:
    """One warm-up and `s.reps` timed greedy `generate` calls of `batch` prompts (the same prompts
    as `megactx_runs` for this batch), yielding after each timed run; `reference`: megactx's
    tokens (read after the first timed run), to count the requests that agree."""
    from transformers.generation.streamers import BaseStreamer

    class Stamps(_StepStamps, BaseStreamer):
        pass

    pad = model.config.pad_token_id
    if pad is None:
        eos = model.config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos

    @torch.inference_mode()
    def generate(prompts: list[list[int]], new_tokens: int, streamer=None) -> torch.Tensor:
        ids = torch.tensor(prompts, device=s.device)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                              streamer=streamer)

    generate(random_prompts(batch, s.prompt_len, vocab_size, _prompt_seed(s, batch, 0)), s.warmup_len)
    walls, ttft, itl, tokens, detail = [], [], [], 0, {}
    for run in range(1, s.reps + 1):
        prompts = random_prompts(batch, s.prompt_len, vocab_size, _prompt_seed(s, batch, run))
        sync_device(s.device)
        stamps = Stamps()
        start = time.perf_counter()
        out = generate(prompts, s.output_len, stamps)
        sync_device(s.device)
        walls.append(time.perf_counter() - start)
        new = out[:, s.prompt_len:].tolist()
        tokens += sum(map(len, new))
        steps = stamps.times[1:]  # times[0]: the prompt, before the prefill
        # every request of the batch gets its tokens at the same steps
        ttft += [steps[0] - start] * batch
        itl += [b - a for a, b in zip(steps, steps[1:])] * batch
        if run == 1:
            detail["steps"] = len(steps)
            if reference:
                detail["same_tokens_as_megactx"] = sum(a == b for a, b in zip(new, reference))
                detail["same_first_token_as_megactx"] = sum(a[:1] == b[:1] for a, b in zip(new, reference))
        yield
    # a request's latency is its batch's wall time
    latency = [w for w in walls for _ in range(batch)]
    return _timed_figures(TRANSFORMERS, batch, s, walls, tokens, ttft, itl, latency, detail)


# ------------------------------------------------------------------------------ online
# what the online run reads from the server's /metrics: its own TTFT (from the request handler), its
# event loop's lag and its garbage collector's pauses
SERVER_HISTOGRAMS = ("megactx_time_to_first_token_seconds", "megactx_event_loop_lag_seconds",
                     "megactx_gc_pause_seconds")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class Histogram:
    """A Prometheus histogram as scraped: cumulative (upper bound, count) buckets, sum, count."""

    buckets: list[tuple[float, float]]
    sum: float
    count: float

    def __sub__(self, before: Histogram) -> Histogram:
        """What was observed since `before` (a scrape of the same histogram)."""
        old = dict(before.buckets)
        return Histogram([(le, n - old.get(le, 0.0)) for le, n in self.buckets], self.sum - before.sum,
                         self.count - before.count)

    def __add__(self, other: Histogram) -> Histogram:
        more = dict(other.buckets)
        return Histogram([(le, n + more.get(le, 0.0)) for le, n in self.buckets], self.sum + other.sum,
                         self.count + other.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket that holds quantile q (an upper estimate)."""
        if not self.count:
            return None
        return next((le for le, n in self.buckets if n >= q * self.count), math.inf)


class ServeProcess:
    """`python -m megactx serve` as a child process, up from `start()` (after /health answers) to
    `stop()` (SIGTERM, then SIGKILL). Its output goes to a log file whose tail explains a failure."""

    def __init__(self, model: Path, s: Settings, host: str = "127.0.0.1"):
        self.host, self.port = host, s.port or free_port(host)
        # the engine configured as the offline one (device, context, batch room); --serve-arg comes
        # last, so it can override any of these
        self.command = [sys.executable, "-m", "megactx", "serve", "--model", str(model), "--host", host,
                        "--port", str(self.port), "--device", s.device, "--max-model-len",
                        str(s.prompt_len + s.output_len), "--max-num-seqs", str(max(s.concurrency, *s.batches)),
                        "--num-speculative-tokens", "0",  # the offline engine does not speculate either
                        *s.serve_args]
        self.timeout_s = s.server_timeout_s
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        if s.threads:
            self.env["OMP_NUM_THREADS"] = str(s.threads)  # every thread of the server, its engine's too
        self.log = tempfile.NamedTemporaryFile("w+", prefix="megactx-serve-", suffix=".log", delete=False)
        # the engine's steps (megactx.engine.steplog), for the report's step figures
        self.step_log = Path(self.log.name).with_suffix(".steps.jsonl")
        before_serve_args = len(self.command) - len(s.serve_args)
        self.command[before_serve_args:before_serve_args] = ["--step-log", str(self.step_log)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server and wait for /health; RuntimeError with the log's tail if it does not come up."""
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=REPO_ROOT, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`{shlex.join(self.command[1:])}` exited with code {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                status, _ = self.get("/health")
                if status == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"megactx serve did not answer /health within {self.timeout_s:.0f} s: {self.log_tail()}")

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def model_name(self, default: str) -> str:
        """The first model id of /v1/models (what requests must name), else `default`."""
        try:
            status, body = self.get("/v1/models")
            if status == 200:
                return json.loads(body)["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            pass
        return default

    def log_tail(self) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").strip()
        return ("…" + text[-LOG_TAIL_CHARS:]) if len(text) > LOG_TAIL_CHARS else (text or "(no output)")

    def steps(self, start: float, end: float) -> dict[str, Any] | None:
        """Step figures of the engine's steps that began between perf_counter times start and end
        (one monotonic clock for every process), None without any. The engine flushes its step log
        before it emits the deltas that leave it idle, so it is complete once the clients are done."""
        if not self.step_log.is_file():
            return None
        steps = [r for r in steplog.read(self.step_log) if start <= r["t"] <= end]
        return steplog.step_stats(steps) if steps else None

    def histograms(self, *names: str) -> dict[str, Histogram]:
        """The server's histograms of these names as /metrics has them now (those it has)."""
        from prometheus_client.parser import text_string_to_metric_families

        status, body = self.get("/metrics")
        if status != 200:
            return {}
        out = {}
        for family in text_string_to_metric_families(body.decode()):
            if family.name in names:
                values = {sample.name: sample.value for sample in family.samples}
                buckets = [(float(sample.labels["le"]), sample.value) for sample in family.samples
                           if sample.name == family.name + "_bucket"]
                out[family.name] = Histogram(buckets, values.get(family.name + "_sum", 0.0),
                                             values.get(family.name + "_count", 0.0))
        return out

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, SERVER_STOP_S)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        self.step_log.unlink(missing_ok=True)

    def __enter__(self) -> ServeProcess:
        try:
            self.start()
        except BaseException:  # a server that never answered may still be running: stop it
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class RequestResult:
    """One streamed completion, host seconds from sending it."""

    ttft_s: float | None  # to the first chunk with a choice
    latency_s: float  # to the end of the stream
    completion_tokens: int | None  # from the final usage chunk, None without one
    chunks: int


def post_completion(host: str, port: int, body: dict[str, Any], timeout_s: float,
                    conn: http.client.HTTPConnection | None = None) -> RequestResult:
    """POST a streaming /v1/completions request and read its server-sent events to `data: [DONE]`.
    RuntimeError on an HTTP error or an error event, with the server's words. (The standard
    library's client: a benchmark should not need another dependency to talk to the server.)
    conn: a connection to keep using (HTTP keep-alive, as the OpenAI SDK's clients do; it reconnects
    by itself where the server closed it); None: a connection of its own, closed at the end."""
    own = conn is None
    conn = conn or http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from /v1/completions: {resp.read()[:500].decode(errors='replace')}")
        first, tokens, chunks = None, None, 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, keep-alives
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event from /v1/completions: {event['error']}")
            if event.get("choices"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
        end = time.perf_counter()
        resp.read()  # the body's end (the last chunk): the connection is then free for the next request
        return RequestResult(first, end - start, tokens, chunks)
    except BaseException:
        conn.close()  # in an unknown state: not reused
        raise
    finally:
        if own:
            conn.close()


def client_round(host: str, port: int, bodies: Sequence[dict[str, Any]], concurrency: int,
                 timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send every body with `concurrency` clients, each sending its next request when its last one
    ends, on the connection it keeps. Returns the results (in body order) and the wall time of the round."""
    local, conns = threading.local(), []

    def send(body: dict[str, Any]) -> RequestResult:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
            conns.append(local.conn)
        return post_completion(host, port, body, timeout_s, local.conn)

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(send, bodies))
        return results, time.perf_counter() - start
    finally:
        for conn in conns:
            conn.close()


def completion_bodies(model: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """OpenAI /v1/completions bodies: token-id prompts, greedy, exactly max_tokens (ignore_eos is
    the vLLM extension), streamed with a final usage chunk."""
    return [{"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}} for p in prompts]


@contextlib.contextmanager
def logged_steps(llm):
    """Log llm's steps inside the block; yields a function that returns their step figures
    (megactx.engine.steplog.step_stats) once the block has ended."""
    with tempfile.TemporaryDirectory() as tmp:
        path, figures = Path(tmp) / "steps.jsonl", {}
        previous, llm.step_log = llm.step_log, steplog.StepLog(path)
        try:
            yield lambda: figures.get("steps")
        finally:
            llm.step_log.close()
            llm.step_log = previous
            lines = steplog.read(path)
            figures["steps"] = steplog.step_stats(lines) if lines else None


def split_rounds(items: list, rounds: int) -> list[list]:
    """items in `rounds` consecutive parts of sizes as equal as they can be (the first ones longer)."""
    size, extra = divmod(len(items), rounds)
    bounds = list(itertools.accumulate([0] + [size + (i < extra) for i in range(rounds)]))
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _send_next(llm, waiting: Iterator[list[int]], params, outs: list) -> None:
    """Add the next waiting prompt (if any) to llm; its output (filled in as it runs) goes to outs."""
    prompt = next(waiting, None)
    if prompt is not None:
        outs.append(llm.requests[llm.add_request(prompt, params)].output)


def _nothing() -> None:
    pass


def run_closed_loop(llm, s: Settings, between: Callable[[], object] = _nothing) -> RunFigures:
    """The online run's workload on `llm` in-process: a warm-up round of C requests, then R requests
    (the online run's prompts) in `s.rounds` rounds, each with C in flight, a client's next added when
    its last finishes. The C clients of a round start one a step, so that their requests end apart as
    a server's do (started together, they would all end in one step and join in the next: the
    offline batch again). between(): called before the first round and after each (not timed)."""
    from megactx import SamplingParams

    vocab = llm.cfg.vocab_size
    warm = SamplingParams(temperature=0.0, max_tokens=s.warmup_len, ignore_eos=True)
    llm.generate(random_prompts(s.concurrency, s.prompt_len, vocab, _prompt_seed(s, 0, 0)), warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
    outs, wall, rates = [], 0.0, []

    with logged_steps(llm) as step_figures:
        for prompts in split_rounds(random_prompts(s.requests, s.prompt_len, vocab, _prompt_seed(s, 0, 1)), s.rounds):
            between()  # offline runs log their steps elsewhere (logged_steps of their own)
            waiting, done = iter(prompts), len(outs)
            start = time.perf_counter()
            starting = s.concurrency  # clients not started yet: one joins a step, as clients that connect apart do
            while starting or llm.has_unfinished():
                if starting:
                    _send_next(llm, waiting, params, outs)
                    starting -= 1
                for delta in llm.step():
                    if delta.finish_reason is not None:
                        _send_next(llm, waiting, params, outs)
            took = time.perf_counter() - start
            wall += took
            rates.append(sum(len(o.token_ids) for o in outs[done:]) / took)
        between()
    tokens = sum(len(o.token_ids) for o in outs)
    return RunFigures(CLOSED, s.concurrency, len(outs), s.prompt_len, s.output_len, tokens, wall,
                      summarize([o.first_token_time - o.arrival_time for o in outs]), None,
                      summarize([o.finish_time - o.arrival_time for o in outs]),
                      {"engine_steps": step_figures(), "round_tokens_per_s": rates})


def online_figures(results: list[RequestResult], wall_s: float, s: Settings, clients: int | None = None) -> RunFigures:
    """The figures of an online run; its batch is C (the offline runs it compares with), `clients`
    (in its detail) the clients that sent the requests, C unless given."""
    counted = [r.completion_tokens for r in results]
    exact = all(t is not None for t in counted)
    # without usage chunks, count max_tokens a request: ignore_eos makes every request that long
    tokens = sum(counted) if exact else s.output_len * len(results)
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    return RunFigures(SERVE, s.concurrency, len(results), s.prompt_len, s.output_len, tokens, wall_s,
                      summarize(ttft), None, summarize([r.latency_s for r in results]),
                      {"tokens_counted_from": "usage" if exact else "max_tokens",
                       "chunks": sum(r.chunks for r in results), "clients": clients or s.concurrency})


def run_online(path: Path, s: Settings, vocab_size: int, log: Callable[[str], object],
               extra_args: Sequence[str] = (), between: Callable[[], object] = _nothing,
               clients: int | None = None) -> RunFigures:
    """Start the server (with extra_args), run one warm-up round of clients (C, unless `clients`),
    then `s.rounds` timed rounds of R requests in all, stop it. between(): called before the first
    timed round and after each (not timed; the server idles meanwhile)."""
    clients = clients or s.concurrency
    if extra_args:
        s = dataclasses.replace(s, serve_args=[*extra_args, *s.serve_args])
    with ServeProcess(path, s) as server:
        log(f"megactx serve is up on port {server.port}")
        model = server.model_name(default=str(path))
        # batch 0 in the seed: prompts of their own, none the offline runs used
        warm = random_prompts(clients, s.prompt_len, vocab_size, _prompt_seed(s, 0, 0))
        client_round(server.host, server.port, completion_bodies(model, warm, s.warmup_len), clients,
                     s.request_timeout_s)
        prompts = random_prompts(s.requests, s.prompt_len, vocab_size, _prompt_seed(s, 0, 1))
        results, wall, rates, start = [], 0.0, [], time.perf_counter()
        observed: dict[str, Histogram] = {}  # the server's histograms, over the rounds only (not between)
        for part in split_rounds(prompts, s.rounds):
            between()
            before = server.histograms(*SERVER_HISTOGRAMS)
            got, took = client_round(server.host, server.port, completion_bodies(model, part, s.output_len),
                                     clients, s.request_timeout_s)
            for name, after in server.histograms(*SERVER_HISTOGRAMS).items():
                if name in before:
                    new = after - before[name]
                    observed[name] = observed[name] + new if name in observed else new
            results += got
            wall += took
            rates.append(online_figures(got, took, s, clients).tokens_per_s)
        steps = server.steps(start, time.perf_counter())  # the server makes no steps between rounds
        between()
    figures = online_figures(results, wall, s, clients)
    figures.detail["engine_steps"] = steps
    figures.detail["round_tokens_per_s"] = rates
    ttft, lag, pauses = (observed.get(name) for name in SERVER_HISTOGRAMS)
    if ttft and ttft.count:
        # the server's own TTFT (from its request handler): the rest of the clients' is before the handler
        figures.detail["server_ttft_mean_s"] = ttft.mean
    if lag and lag.count:  # how late its event loop ran a 10 ms timer: what arrivals and events waited
        figures.detail["loop_lag_s"] = {"mean": lag.mean, "p90": lag.quantile(0.9), "p99": lag.quantile(0.99)}
    if pauses is not None:  # the server process's garbage-collector pauses (its loop stood still)
        figures.detail["server_gc_pauses"] = {"count": pauses.count, "total_s": pauses.sum,
                                              "p99_s": pauses.quantile(0.99) if pauses.count else None}
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    figures.detail["client_ttft_mean_s"] = statistics.fmean(ttfts) if ttfts else None
    return figures


# ------------------------------------------------------------------------------ the run
class EngineBench:
    """The parts in order (ceilings, offline: megactx and transformers side by side, online); each part frees the device
    before the next, and `after_part` gets the results so far (to write them as they come)."""

    def __init__(self, path: Path, random_weights: bool, s: Settings, progress: Progress | None = None):
        from megactx import ModelConfig

        self.path, self.s = path, s
        self.cfg = ModelConfig.from_pretrained(path)
        self.llm = None  # the offline engine (engine()), kept for the offline runs between an online run's rounds
        self.progress = progress or Progress()
        self.results: dict[str, Any] = {
            "schema": SCHEMA, "machine": machine_info(s.device), "settings": s.to_dict(),
            "model": {"path": str(path), "random_weights": random_weights, "model_type": self.cfg.model_type,
                      "layers": self.cfg.num_hidden_layers, "hidden_size": self.cfg.hidden_size,
                      "vocab_size": self.cfg.vocab_size},
            "offline": [], "online": None, "skipped": []}

    def run(self, after_part: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
        start, threads = time.perf_counter(), torch.get_num_threads()
        if self.s.threads:
            torch.set_num_threads(self.s.threads)
        try:
            self._run_parts(start, after_part)
        finally:
            torch.set_num_threads(threads)
        return self.results

    def _run_parts(self, start: float, after_part: Callable[[dict[str, Any]], object] | None) -> None:
        parts = [("ceilings", self.ceilings), ("offline", self.offline)]
        parts += [(CLOSED_LOOP, self.closed_loop), ("online", self.online_thread)] if self.s.online else []
        parts += [(ONLINE_PROCESS, self.online_process)] if self.s.online and self.s.online_engine_process else []
        parts += [(ONLINE_SATURATED, self.online_saturated)] if self.s.online and self.s.num_saturated_clients else []
        for name, part in parts:
            try:
                part()
            except Exception as e:  # a part that fails is reported, and the others still run
                reason = f"{type(e).__name__}: {e}"
                self.progress.log(f"{name}: not run: {reason}")
                self.results["skipped"].append({"step": name, "reason": reason})
            free_device_memory(self.s.device)
            self.results["wall_s"] = time.perf_counter() - start
            if after_part:
                after_part(self.results)

    def ceilings(self) -> None:
        """The machine's matmul and copy ceilings, measured in this run beside the engines."""
        c = self.results["ceilings"] = measure_machine_ceilings(self.s.device)
        if c is not None:
            self.progress.log(f"ceilings: bf16 mm {fmt_num(c['bf16_mm'])} TFLOP/s, copy {fmt_num(c['copy'])} GB/s")

    def _add(self, figures: RunFigures) -> None:
        self.results["offline"].append(figures.to_dict())
        self.progress.log(f"{figures.engine:<12} batch {figures.batch:3d}: {fmt_num(figures.tokens_per_s):>8} "
                          f"tokens/s, wall {fmt_time(figures.wall_s)}, TTFT p50 {_p(figures.ttft_s, 'p50')}, "
                          f"ITL p50 {_p(figures.itl_s, 'p50')}")

    def engine(self):
        """The offline engine, loaded at its first use and kept: for the offline table, the closed loop
        and the offline runs between an online run's rounds."""
        if self.llm is None:
            self.progress.log(f"megactx: loading {self.path} on {self.s.device}")
            self.llm = offline_engine(self.path, self.s)
            self.results["model"]["params"] = sum(p.numel() for p in self.llm.model.parameters())
        return self.llm

    def offline(self) -> None:
        """megactx and (with a peer) transformers, loaded side by side: at each batch size their
        timed runs alternate (see `interleaved`)."""
        model = self.load_peer() if self.s.peer else None  # first: the engine's KV plan then leaves it room
        llm = self.engine()
        for batch in self.s.batches:
            tokens: list[list[int]] = []
            runs = [megactx_runs(llm, self.s, batch, tokens)]
            if model is not None:
                runs.append(transformers_runs(model, self.s, batch, self.cfg.vocab_size, tokens))
            for figures in interleaved(runs):
                self._add(figures)
        del model

    def closed_loop(self) -> None:
        """The online workload on the offline engine, in-process (see run_closed_loop). First the
        process's objects go out of the garbage collector's sight, as the server's engine process
        does with its own, so that the offline runs from here on (the online runs' references too)
        are not held up by full collections the served engine no longer makes."""
        from megactx.serve import settle_heap

        llm = self.engine()
        settle_heap()  # (transformers' model is gone: the offline part deleted it, and _run_parts collected)
        figures = self.referenced(lambda between: run_closed_loop(llm, self.s, between))
        self.results[CLOSED_LOOP] = figures.to_dict()
        self.progress.log(f"{CLOSED_LOOP}: {self.s.concurrency} requests in flight: "
                          f"{fmt_num(figures.tokens_per_s)} tokens/s, latency p50 {_p(figures.latency_s, 'p50')}, "
                          f"TTFT p50 {_p(figures.ttft_s, 'p50')}")

    def load_peer(self):
        """transformers' model of the checkpoint, or None (reported as skipped) when it cannot load."""
        self.progress.log(f"transformers: loading {self.path} on {self.s.device}")
        try:
            import transformers

            self.results["model"]["transformers"] = transformers.__version__
            return load_transformers(self.path, self.s)
        except Exception as e:  # megactx's figures still come
            reason = f"{type(e).__name__}: {e}"
            self.progress.log(f"transformers offline: not run: {reason}")
            self.results["skipped"].append({"step": "transformers offline", "reason": reason})
            return None

    def referenced(self, run: Callable[[Callable[[], object]], RunFigures]) -> RunFigures:
        """run(between)'s figures, with the offline engine's tokens/s at the clients' batch measured
        at every between() (before its first round and after each; `offline_tokens_per_s`: their
        mean), the figure its overhead is taken against: the lent host's speed drifts (see
        REFERENCE_RUNS), so an offline figure from another part of the run would measure the drift
        as much as the server."""
        if self.llm is None:  # the offline engine did not load: the offline table's figure, if any
            return run(_nothing)
        around: list[float] = []
        probes: list[float] = []  # the host's speed just before each reference set (host_probe_ms)

        def between() -> None:
            probes.append(host_probe_ms())
            around.append(self._offline_reference())

        figures = run(between)
        figures.detail["offline_tokens_per_s_around"] = around
        figures.detail["offline_tokens_per_s"] = statistics.fmean(around)
        figures.detail["host_probe_ms_around"] = probes
        return figures

    def _offline_reference(self) -> float:
        """tokens/s of REFERENCE_RUNS offline runs at batch C (after a warm-up run), now: all their
        tokens over all their time, a stretch of about as many seconds as an online run's."""
        s = dataclasses.replace(self.s, reps=max(self.s.reps, REFERENCE_RUNS))
        figures = interleaved([megactx_runs(self.llm, s, s.concurrency, [])])[0]
        walls = figures.detail["walls_s"]
        return figures.output_tokens * len(walls) / sum(walls)

    def online(self, key: str = "online", extra_args: Sequence[str] = (), clients: int | None = None) -> None:
        what = " ".join(["megactx serve", *extra_args])
        clients = clients or self.s.concurrency
        self.progress.log(f"{key}: starting {what}, {clients} clients, {self.s.requests} requests")
        figures = self.referenced(lambda between: run_online(self.path, self.s, self.cfg.vocab_size,
                                                             self.progress.log, extra_args, between, clients))
        self.results[key] = figures.to_dict()
        self.progress.log(f"{key}: {figures.requests_per_s:.2f} requests/s, {fmt_num(figures.tokens_per_s)} "
                          f"tokens/s, latency p50 {_p(figures.latency_s, 'p50')}, TTFT p50 {_p(figures.ttft_s, 'p50')}")

    def online_process(self) -> None:
        self.online(ONLINE_PROCESS, ["--engine-process"])

    def online_thread(self) -> None:
        self.online("online", ["--no-engine-process"])

    def online_saturated(self) -> None:
        """The default server with its batch room at C and more clients than that: the engine always
        has requests queued, as an offline engine has, so the comparison leaves out the clients' own
        turnaround (a closed-loop client's next request is in transit while its slot idles)."""
        self.online(ONLINE_SATURATED, ["--engine-process", "--max-num-seqs", str(self.s.concurrency)],
                    self.s.num_saturated_clients)


def _online_runs(results: dict[str, Any]) -> list[tuple[str, RunFigures]]:
    """(label, figures) of the in-process closed loop and the online runs that are in `results`."""
    return [(label, RunFigures.from_dict(results[key]))
            for key, label in ((CLOSED_LOOP, CLOSED_LOOP_LABEL), *ONLINE_RUNS) if results.get(key)]


def _plot_label(label: str, figures: RunFigures) -> str:
    return label if figures.engine == CLOSED else f"{SERVE}, {label}"


def _p(summary: dict[str, float] | None, key: str) -> str:
    return fmt_time(summary[key]) if summary else "–"


# ------------------------------------------------------------------------------ targets
def _target(target: str, figure: str, needs: str, passed: bool | None, note: str = "") -> dict[str, Any]:
    return {"target": target, "figure": figure, "needs": needs, "passed": passed, "note": note}


def _offline(results: dict[str, Any], engine: str, batch: int) -> RunFigures | None:
    found = [RunFigures.from_dict(d) for d in results["offline"] if d["engine"] == engine and d["batch"] == batch]
    return found[0] if found else None


def _reference(results: dict[str, Any], figures: RunFigures) -> float | None:
    """The offline tokens/s an online run's overhead is taken against: the mean of the offline runs
    between its rounds where it has them, else the offline table's at its batch."""
    if figures.detail.get("offline_tokens_per_s"):
        return figures.detail["offline_tokens_per_s"]
    offline = _offline(results, MEGACTX, figures.batch)
    return offline.tokens_per_s if offline else None


def _overhead(figures: RunFigures, offline: float | None) -> float | None:
    """An online run's overhead against its offline reference (`_reference`): 1 - online / offline."""
    return 1 - figures.tokens_per_s / offline if offline else None


def paired_overheads(figures: RunFigures) -> list[float] | None:
    """An online run's overhead round by round, each round against the offline runs just before and
    after it (the mean of the two reference sets around it): pairs taken seconds apart, so the
    host's drift from one part of the run to another cancels. None for a run without round figures."""
    rates, around = figures.detail.get("round_tokens_per_s"), figures.detail.get("offline_tokens_per_s_around")
    if not rates or not around or len(around) != len(rates) + 1:
        return None
    runs = [(rates, around)] + [(run["round_tokens_per_s"], run["offline_tokens_per_s_around"])
                                for run in figures.detail.get("pooled_runs", [])]
    return [1 - rate / ((before + after) / 2)
            for rates, around in runs for rate, before, after in zip(rates, around, around[1:])]


# what must agree between runs whose rounds are pooled (`--from-json A B ...`): the same workload on
# the same machine kind, model and software
POOL_MUST_MATCH = (("machine", ("device", "gpu", "torch", "triton")),
                   ("settings", ("prompt_len", "output_len", "concurrency", "saturated_clients", "serve_args")),
                   ("model", ("model_type", "layers", "hidden_size", "vocab_size", "params")))


def pool_rounds(runs: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The first run's results, with the server-overhead run's rounds of the others attached (its
    detail's `pooled_runs`), so that the target is judged on all their rounds: independent runs of one
    workload give exchangeable round pairs. ValueError names what differs or is missing."""
    (_, first), rest = runs[0], runs[1:]
    if not first.get(ONLINE_SATURATED):
        raise ValueError(f"{runs[0][0]} has no {ONLINE_SATURATED} run to pool rounds into")
    pooled = []
    for name, results in rest:
        for part, keys in POOL_MUST_MATCH:
            for key in keys:
                if results[part].get(key) != first[part].get(key):
                    raise ValueError(f"cannot pool {name} with {runs[0][0]}: {part} {key} differs "
                                     f"({results[part].get(key)!r} vs {first[part].get(key)!r})")
        detail = (results.get(ONLINE_SATURATED) or {}).get("detail", {})
        if not detail.get("round_tokens_per_s"):
            raise ValueError(f"{name} has no rounds of its {ONLINE_SATURATED} run "
                             "(a run of an older bench, or of --rounds 1)")
        pooled.append({"source": str(name), "date": results["machine"].get("date"),
                       **{k: detail[k] for k in ("round_tokens_per_s", "offline_tokens_per_s_around")}})
    saturated = first[ONLINE_SATURATED]
    return first | {ONLINE_SATURATED: saturated | {"detail": saturated["detail"] | {"pooled_runs": pooled}}}


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(median, low, high): a distribution-free interval holding the median of what `values` sample
    with probability >= level (order statistics k and n + 1 - k, k from the binomial(n, 1/2) tail:
    at n = 16 the 4th and 13th, 97.9%). None when n is too small for the level (n < 6 at 95%)."""
    x, n = sorted(values), len(values)
    k, tail = 0, 0.0  # tail: P(Binomial(n, 1/2) <= k - 1)
    while k < n and tail + math.comb(n, k) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return (statistics.median(x), x[k - 1], x[n - k]) if k else None


def _probe_note(figures: RunFigures) -> str:
    """', a fixed Python loop took A - B ms beside them' from the host probes around a run ('' without)."""
    probes = figures.detail.get("host_probe_ms_around")
    return f": a fixed Python loop took {min(probes):.1f} - {max(probes):.1f} ms beside them" if probes else ""


def _skip_reason(results: dict[str, Any], step: str) -> str | None:
    return next((x["reason"] for x in results.get("skipped", []) if x["step"] == step), None)


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's two targets (the overhead: of the server as it ships, its engine in a process of
    its own); passed is None where the run cannot decide (not run, or a GPU target on a CPU run: the
    ratio is still shown)."""
    on_gpu = results["machine"]["device"] == "cuda"
    rows = []
    b = TARGET_SPEEDUP_BATCH
    t = f"megactx >= {TARGET_SPEEDUP:.0f}x transformers' output tokens/s at batch {b} (GPU)"
    ours, peer = _offline(results, MEGACTX, b), _offline(results, TRANSFORMERS, b)
    if ours and peer:
        ratio = ours.tokens_per_s / peer.tokens_per_s
        rows.append(_target(t, f"{fmt_num(ratio)}x ({fmt_num(ours.tokens_per_s)} vs {fmt_num(peer.tokens_per_s)} "
                               "tokens/s)", f">= {TARGET_SPEEDUP:.0f}x",
                            ratio >= TARGET_SPEEDUP if on_gpu else None, "" if on_gpu else "a GPU target; CPU run"))
    else:
        why = (f"batch {b} not in this run" if b not in results["settings"]["batches"]
               else _skip_reason(results, "transformers offline") or _skip_reason(results, "offline")
               or "not run")
        rows.append(_target(t, "–", f">= {TARGET_SPEEDUP:.0f}x", None, why))

    # the server as it ships (its engine in a process of its own) with its batch kept full: what the
    # server costs the engine. The closed-loop runs' overheads (the clients' turnaround included) are
    # in the online table beside it; the default server's is quoted in the note.
    t = (f"server overhead <= {MAX_SERVER_OVERHEAD:.0%} of offline output tokens/s at the engine's batch, "
         f"{dict(ONLINE_RUNS)[ONLINE_SATURATED]}")
    online = RunFigures.from_dict(results[ONLINE_SATURATED]) if results.get(ONLINE_SATURATED) else None
    offline = online and _reference(results, online)
    closed = RunFigures.from_dict(results[ONLINE_PROCESS]) if results.get(ONLINE_PROCESS) else None
    closed_overhead = closed and _overhead(closed, _reference(results, closed))
    note = f"{closed.batch} closed-loop clients: {closed_overhead:.1%}" if closed_overhead is not None else ""
    paired = online and paired_overheads(online)
    interval = paired and median_interval(paired)
    if online and offline and interval:
        # decided by the rounds: passed when the interval of their median lies below the target, failed
        # when above it, else undecided
        middle, low, high = interval
        passed = True if high <= MAX_SERVER_OVERHEAD else False if low > MAX_SERVER_OVERHEAD else None
        if passed is None:
            note = "; ".join(filter(None, [
                f"undecided: the 95% interval of the rounds' median, {low:.1%} - {high:.1%}, holds "
                f"{MAX_SERVER_OVERHEAD:.0%}; run again with more --rounds, or pool this run's rounds with another's "
                f"(--from-json A B)", note]))
        runs = 1 + len(online.detail.get("pooled_runs", []))
        others = ", ".join(r["date"] or r["source"] for r in online.detail.get("pooled_runs", []))
        of_runs = f" of {runs} runs of this workload (this and {others})" if runs > 1 else ""
        together = "this run's" if runs > 1 else "all"
        rows.append(_target(t, f"{middle:.1%}, median of {len(paired)} rounds{of_runs} each against the offline runs "
                               f"just before and after it (95% interval {low:.1%} - {high:.1%}; "
                               f"{together} rounds together: "
                               f"{_overhead(online, offline):.1%}, {fmt_num(online.tokens_per_s)} online from "
                               f"{online.clients} clients vs {fmt_num(offline)} offline tokens/s at {online.batch})",
                            f"<= {MAX_SERVER_OVERHEAD:.0%}", passed, note))
    elif online and offline:  # too few rounds for the interval (or a run from before rounds were recorded)
        overhead = _overhead(online, offline)
        passed = overhead <= MAX_SERVER_OVERHEAD
        around = online.detail.get("offline_tokens_per_s_around") or [offline]
        spread = (max(around) - min(around)) / offline
        if spread > MAX_REFERENCE_SPREAD:
            passed = None  # the reference moved more than what is measured
            note = "; ".join(filter(None, [
                f"undecided: the offline runs around it gave {fmt_num(min(around))} - {fmt_num(max(around))} tokens/s, "
                f"a spread of {spread:.0%} of their mean, more than the {MAX_SERVER_OVERHEAD:.0%} to be measured "
                "(the host's speed drifted" + _probe_note(online) + "); run again", note]))
        rows.append(_target(t, f"{overhead:.1%} ({fmt_num(online.tokens_per_s)} online from {online.clients} "
                               f"clients vs {fmt_num(offline)} offline tokens/s at {online.batch})",
                            f"<= {MAX_SERVER_OVERHEAD:.0%}", passed, note))
    else:
        if online:
            why = f"no offline megactx run at batch {online.batch} (the server's --max-num-seqs)"
        elif not results["settings"]["online"]:
            why = "online run disabled (--no-online)"
        elif results["settings"].get("saturated_clients") == 0:
            why = "the saturated run disabled (--saturated-clients 0)"
        else:
            why = _skip_reason(results, ONLINE_SATURATED) or "not run"
        rows.append(_target(t, "–", f"<= {MAX_SERVER_OVERHEAD:.0%}", None, why))
    return rows


# ------------------------------------------------------------------------------ Markdown
def _lat(summary: dict[str, float] | None) -> tuple[str, str]:
    return (_p(summary, "p50"), _p(summary, "p99"))


def render_markdown(results: dict[str, Any], targets: list[dict[str, Any]]) -> str:
    m, s, model = results["machine"], results["settings"], results["model"]
    device = m.get("gpu") or m["device"]
    out = [f"# megactx engine benchmark: {device}\n"]
    versions = f"torch {m['torch']}, triton {m['triton']}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "")
    if model.get("transformers"):
        versions += f", transformers {model['transformers']}"
    params = f", {model['params'] / 1e6:.1f}M parameters" if model.get("params") else ""
    out.append(f"{m['date']}; {versions}. Model `{model['path']}` ({model['model_type']}, {model['layers']} layers, "
               f"hidden {model['hidden_size']}, vocabulary {model['vocab_size']}{params}), {s['dtype']}. "
               f"Every request: {s['prompt_len']} random prompt tokens, exactly {s['output_len']} generated "
               "(greedy, EOS ignored)" + (f"; {s['threads']} torch thread(s)" if s.get("threads") else "")
               + (f"; whole run {results['wall_s']:.0f} s" if "wall_s" in results else "") + ".\n")
    if model.get("random_weights"):
        out.append("**Random weights** (no trained model yet): the figures measure the engine, not the text.\n")
    if m["device"] != "cuda":
        out.append("**CPU run**: megactx runs its pure-torch kernel twins here; the targets are GPU targets.\n")
    out.append("TTFT: request arrival to its first token; ITL: gap between a request's successive tokens; "
               f"latency: arrival to last token. Every batch: one untimed warm-up run, then {s.get('reps', 1)} "
               "timed runs on prompts of their own; wall and tokens/s of the median run, latency percentiles over "
               "all runs. "
               "transformers: `generate` on the same prompts as one batch; its TTFT / ITL are per decoding step, "
               "the same for every request of the batch.\n")

    if results.get("ceilings"):
        out.append(ceilings_markdown(Ceilings.from_dict(results["ceilings"])) + "\n")
    out.append("## Offline\n")
    rows = []
    for d in results["offline"]:
        f = RunFigures.from_dict(d)
        peer = _offline(results, TRANSFORMERS, f.batch)
        ratio = f"{fmt_num(f.tokens_per_s / peer.tokens_per_s)}x" if f.engine == MEGACTX and peer else ""
        same = f.detail.get("same_tokens_as_megactx")
        rows.append([f.batch, f.engine, fmt_num(f.tokens_per_s), ratio, fmt_time(f.wall_s), *_lat(f.ttft_s),
                     *_lat(f.itl_s), "" if same is None else f"{same}/{f.requests}"])
    rows.sort(key=lambda r: (r[0], r[1] != MEGACTX))
    out.append(md_table(["batch", "engine", "output tokens/s", "vs transformers", "wall", "TTFT p50", "TTFT p99",
                         "ITL p50", "ITL p99", "same tokens as megactx"], rows))

    out.append("\n## Online: megactx serve, streaming /v1/completions\n")
    runs = _online_runs(results)
    if runs:
        rounds = s.get("rounds", 1)
        out.append(f"The requests in {rounds} round{'s' if rounds > 1 else ''}, each client sending its next "
                   "request when its last has ended (a closed loop). Batch kept full: a server whose "
                   f"--max-num-seqs is {s['concurrency']}, with more clients than that, so that requests queue "
                   "and its engine runs full batches as the offline one does (as vLLM compares its server at "
                   "request rate inf with its offline throughput): the server's own cost. At exactly "
                   f"{s['concurrency']} clients a finished request's slot idles until that client's next "
                   "request has come through the HTTP layer. "
                   "Overhead: 1 − tokens/s ÷ offline tokens/s at the engine's batch, the mean of offline "
                   f"runs ({REFERENCE_RUNS} at a time) before the first round and after each (the host's speed "
                   "drifts between parts of a run; min – max beside it). The first row runs the "
                   "same requests on the offline engine in-process (the clients starting one a step, a client's "
                   "next request added as its last ends, no HTTP): its overhead is the engine's own, from requests "
                   "arriving as others end; the rest is the server's. TTFT mean, client / server: the clients' "
                   "mean against the server's own (its /metrics histogram, from its request handler): the "
                   "difference is spent before the handler (connection, parsing, the event loop's queue). Event "
                   "loop lag: how late the server's loop ran a timer due every 10 ms during the rounds "
                   "(its /metrics histogram; p90 and p99 as bucket bounds, resolution ~1 ms): what each "
                   "arrival and each streamed event waited for the loop. GC pauses: the server process's "
                   "garbage-collector pauses during the rounds (its /metrics histogram), their count and "
                   "total time, through which its loop stood still.\n")
        rows = []
        for label, f in runs:
            offline = _reference(results, f)
            overhead = f"{_overhead(f, offline):.1%}" if offline else "–"
            around = f.detail.get("offline_tokens_per_s_around")
            split = [f.detail.get("client_ttft_mean_s"), f.detail.get("server_ttft_mean_s")]
            split = " / ".join("–" if t is None else fmt_time(t) for t in split) if f.engine == SERVE else "–"
            lag = f.detail.get("loop_lag_s")
            lag = (f"{fmt_time(lag['mean'])} / ≤ {fmt_time(lag['p90'])} / ≤ {fmt_time(lag['p99'])}" if lag else "–")
            gcp = f.detail.get("server_gc_pauses")
            gcp = f"{gcp['count']:.0f}, {fmt_time(gcp['total_s'])}" if gcp else "–"
            rows.append([label, f.clients, f.requests, fmt_num(f.requests_per_s),
                         fmt_num(f.tokens_per_s),
                         (fmt_num(offline) + (f" ({fmt_num(min(around))} – {fmt_num(max(around))})" if around else "")
                          if offline else "–"), overhead, *_lat(f.latency_s),
                         *_lat(f.ttft_s), split, lag, gcp])
        out.append(md_table(
            ["server", "clients", "requests", "requests/s", "output tokens/s",
             "offline tokens/s at that batch (min – max)", "overhead", "latency p50", "latency p99", "TTFT p50",
             "TTFT p99", "TTFT mean, client / server", "event loop lag mean / p90 / p99", "GC pauses"], rows))
        if any(f.detail.get("tokens_counted_from") == "max_tokens" for _, f in runs if f.engine == SERVE):
            out.append("\n(The server sent no usage chunk: every request is counted as max_tokens long.)\n")
        if all(f.engine == CLOSED for _, f in runs):
            out.append(f"\nmegactx serve not run: {_skip_reason(results, 'online') or 'disabled'}.\n")
    else:
        out.append(f"Not run: {_skip_reason(results, 'online') or 'disabled (--no-online)'}.\n")

    out.append(steps_markdown(results))
    out.append("\n## Targets\n")
    mark = {True: "pass", False: "**FAIL**", None: "n/a"}
    out.append(md_table(["target", "figure", "needs", "result"],
                        [[t["target"], t["figure"], t["needs"], mark[t["passed"]] + (f" ({t['note']})" if t["note"]
                                                                                      else "")] for t in targets]))
    if results.get("skipped"):
        out.append("\n## Not run\n")
        out.append(md_table(["part", "why"], [[x["step"], x["reason"].replace("\n", " ")]
                                              for x in results["skipped"]]))
    return "\n".join(out)


def steps_markdown(results: dict[str, Any]) -> str:
    """The engine's steps in each timed run (megactx.engine.steplog): where a served run loses time
    against the offline one shows as slower decode steps, more steps with prefill, or captures."""
    runs = [(f"offline, batch {f.batch}", f) for f in map(RunFigures.from_dict, results["offline"])
            if f.engine == MEGACTX]
    runs += [(f"{label}, {f.clients} clients", f) for label, f in _online_runs(results)]
    rows = []
    for label, f in runs:
        st = f.detail.get("engine_steps")
        if not st:
            continue
        ms = {key: "–" if st.get(key) is None else fmt_time(st[key] / 1e3)
              for key in ("decode_p50_ms", "decode_p99_ms", "decode_host_p50_ms", "prefill_p50_ms", "prefill_p99_ms",
                          "prefill_host_p50_ms", "max_ms")}
        seqs = "–" if st.get("mean_seqs") is None else f"{st['mean_seqs']:.1f}"
        rows.append([label, st["steps"], f"{st['busy_s']:.2f} s", seqs, st["decode_steps"], ms["decode_p50_ms"],
                     ms["decode_p99_ms"], ms["decode_host_p50_ms"], st["prefill_steps"], ms["prefill_p50_ms"],
                     ms["prefill_p99_ms"], ms["prefill_host_p50_ms"], ms["max_ms"],
                     f"{st['capture_steps']} ({st['capture_s']:.2f} s)"])
    if not rows:
        return ""
    return ("\n## Engine steps\n\nEvery step of the timed part of each run (`--step-log`; with overlapped steps "
            "a step's time is its host work plus its wait for the step before). Host p50: a step's time less its "
            "wait for the device's tokens (near the step's time: bound by the host; well below: by the device). "
            "Sequences a step: the mean batch (below the clients where requests are in transit between a "
            "client and the engine). Captures: steps that captured a CUDA graph, and their time.\n\n"
            + md_table(["run", "steps", "in steps", "sequences a step", "decode-only steps", "p50", "p99", "host p50",
                        "steps with prefill", "p50", "p99", "host p50", "longest", "captures"], rows))


# ------------------------------------------------------------------------------ PNG
def plot(results: dict[str, Any], path: Path) -> bool:
    """Two panels: output tokens/s by batch for each engine (with the online run at its
    concurrency); TTFT and ITL p50 / p99 by batch. False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    runs = [RunFigures.from_dict(d) for d in results["offline"]]
    onlines = _online_runs(results)
    batches = sorted({f.batch for f in runs} | {f.batch for _, f in onlines})
    x = {b: i for i, b in enumerate(batches)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    engines = [(MEGACTX, "C0"), (TRANSFORMERS, "C1")]
    width = 0.8 / (len(engines) + len(onlines))
    for k, (engine, color) in enumerate(engines):
        mine = [f for f in runs if f.engine == engine]
        if mine:
            bars = ax1.bar([x[f.batch] + (k - 0.5) * width for f in mine], [f.tokens_per_s for f in mine], width,
                           label=engine, color=color)
            ax1.bar_label(bars, [fmt_num(f.tokens_per_s) for f in mine], fontsize=7)
    for k, (label, online) in enumerate(onlines):
        bars = ax1.bar([x[online.batch] + (1.5 + k) * width], [online.tokens_per_s], width, color=f"C{2 + k}",
                       label=f"{_plot_label(label, online)} ({online.clients} clients)")
        ax1.bar_label(bars, [fmt_num(online.tokens_per_s)], fontsize=7)
    ax1.set(yscale="log", xlabel="batch (requests in flight)", ylabel="output tokens/s",
            title="Throughput (higher is better)")

    for engine, color in engines:
        mine = [f for f in runs if f.engine == engine]
        for key, marker, what in (("ttft_s", "o", "TTFT"), ("itl_s", "s", "ITL")):
            pts = [(x[f.batch], getattr(f, key)) for f in mine if getattr(f, key)]
            if pts:
                xs = [p[0] for p in pts]
                ax2.plot(xs, [1e3 * p[1]["p50"] for p in pts], marker + "-", color=color, label=f"{engine} {what} p50")
                ax2.plot(xs, [1e3 * p[1]["p99"] for p in pts], marker + ":", color=color, label=f"{engine} {what} p99")
    for k, (label, online) in enumerate(onlines):
        for key, marker, what in (("ttft_s", "o", "TTFT"), ("latency_s", "D", "latency")):
            summary = getattr(online, key)
            if summary:
                ax2.plot([x[online.batch] + 0.1 * k] * 2, [1e3 * summary["p50"], 1e3 * summary["p99"]],
                         marker + "--", color=f"C{2 + k}", label=f"{_plot_label(label, online)}: {what} p50 / p99")
    ax2.set(yscale="log", xlabel="batch (requests in flight)", ylabel="milliseconds",
            title="Latency (solid p50, dotted p99)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.grid(True, which="both", axis="y", alpha=0.3)
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 30)  # log axes: room above the data for the legend
        if ax.get_legend_handles_labels()[0]:  # (a report written before the first run has none)
            ax.legend(fontsize=7, loc="upper left")
    device = results["machine"].get("gpu") or results["machine"]["device"]
    s = results["settings"]
    fig.suptitle(f"megactx bench engine: {device}, {s['prompt_len']} prompt + {s['output_len']} output tokens "
                 "a request")
    save_figure(fig, path)
    return True


def write_reports(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Evaluate the targets, then write engine-<device>.json (raw figures + targets), .md and .png
    (when matplotlib is installed) into out_dir. Returns the paths written."""
    targets = evaluate_targets(results)
    return write_suite_reports("engine", results | {"targets": targets}, out_dir,
                               lambda r: render_markdown(r, targets), plot)


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: models/megactx-tiny, else a cached random tiny checkpoint)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda or cpu (default: cuda when torch sees a GPU); sizes default by device, see above")
    p.add_argument("--quick", action="store_true", help="batches 1 and 16, fewer tokens and requests")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for engine-<device>.json, .md and .png (default: {RESULTS_DIR})")
    p.add_argument("--batches", type=int_list, default=None, help="offline batch sizes, e.g. 1,16,64")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens a request (P)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens a request (M)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="online clients in flight (C); the overhead compares with offline runs at batch C")
    p.add_argument("--saturated-clients", type=int, default=None,
                   help="clients of the run that keeps the server's batch full (its --max-num-seqs is C): the run "
                        "the overhead target is judged on (default 2C; 0 skips it)")
    p.add_argument("--requests", type=int, default=None, help="online requests in all (R)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds the R requests are sent in, with offline runs at batch C before the first and after "
                        "each: the figure the overhead is taken against, round by round; from 6 rounds on the "
                        "target is judged on the rounds' median (default 16 on a GPU, 1 on a CPU)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--no-online", action="store_true", help="skip the online runs through megactx serve")
    p.add_argument("--no-online-engine-process", action="store_true",
                   help="skip the second online run, whose server runs its engine in a process of its own")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for megactx serve (repeat; e.g. --serve-arg=--max-model-len=4096)")
    p.add_argument("--port", type=int, default=None, help="port of megactx serve (default: a free one)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed runs of every offline batch, each on other prompts; the median counts (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of every part, the server's too (default: 1 on a CPU, torch's "
                        "own on a GPU run)")
    p.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="FILE",
                   help="do not measure: write the .md and .png again from a results JSON. Given several runs "
                        "of one workload (same machine kind, software, model and sizes), the first is reported "
                        "and the server-overhead target is judged on the rounds of all of them (written into "
                        "the new JSON, so it renders again alike)")


def pool_from_json(prog: str, paths: Sequence[Path], out: Path | None) -> int:
    """`--from-json A B ...`: A's reports again, the server-overhead target judged on the rounds of all."""
    try:
        results = pool_rounds([(str(path), json.loads(Path(path).read_text())) for path in paths])
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
        why = f"a results JSON without {e}" if isinstance(e, KeyError) else e
        print(f"{prog}: error: --from-json: {why}", file=sys.stderr)
        return 2
    for written in write_reports(results, out or Path(paths[0]).parent):
        print(written)
    return 0


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed arguments; ValueError names the bad argument."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    s = Settings.defaults(device, args.quick)
    for name in ("batches", "prompt_len", "output_len", "concurrency", "saturated_clients", "requests", "rounds",
                 "port", "threads", "reps"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    s.seed, s.peer, s.online, s.serve_args = args.seed, not args.no_peer, not args.no_online, list(args.serve_arg)
    s.online_engine_process = not args.no_online_engine_process
    s.check()
    return s


def run(args: argparse.Namespace) -> int:
    """`megactx bench engine`: 0 on success (parts that could not run are reported in the results),
    2 on bad arguments or an unusable checkpoint."""
    prog = "megactx bench engine"
    if args.from_json is not None and len(args.from_json) > 1:
        return pool_from_json(prog, args.from_json, args.out)
    if args.from_json is not None:
        return rerender_from_json(prog, args.from_json[0], args.out, write_reports)
    from megactx.generate import resolve_model

    progress = Progress()
    try:
        settings = settings_from_args(args)
        path, random_weights = resolve_model(args.model, progress.log)
        bench = EngineBench(path, random_weights, settings, progress)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = args.out or RESULTS_DIR
    written: list[Path] = []

    def write(results: dict[str, Any]) -> None:  # after every part, so a later crash keeps the figures
        written[:] = write_reports(results, out)

    bench.run(after_part=write)
    for path in written:
        print(path)
    return 0
