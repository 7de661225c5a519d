"""`StepLog`: one JSON line for every engine step, to see where a server's time goes; and `phase`,
the named parts of a step that `megactx bench profile` reads from a torch.profiler trace.

    llm = LLM(path, step_log="steps.jsonl")        # or: megactx serve --step-log steps.jsonl
    megactx steplog steps.jsonl                    # a summary: step times, and the slowest steps
    megactx steplog steps.jsonl --plot steps.png   # + step times against time and against keys

A line: {"pid", "t" (time.perf_counter() at the step's start, s; one clock for every process of a
machine), "ms" (the step's wall time), "seqs" (sequences scheduled), "tokens" (positions computed),
"keys" (the most keys a position of the step attends to: its sequence's length at the chunk's end,
drafts included; what an indexer's scores grow with), "prefill" (chunks that are not single-token
decodes), "running", "waiting" (after the step),
"graphs" (CUDA graphs captured so far: a step that raised it waited for a capture), "wait_ms"
(of "ms", the host's wait for the device's tokens; not in speculative steps)}. With overlapped
steps (`async_scheduling`) a step's wall time is its host work plus its wait for the step before:
a step that waits long is bound by the device. One that hardly waits is bound by the host, or by a
launch that blocked (a CUDA graph of hundreds of kernels can fill the device's launch queue while
the step before still runs; the time then shows as host time). Lines are appended (several
processes may share a file), flushed at least every half second and whenever the engine runs out
of work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from megactx.analysis.flops import context_label

FLUSH_S = 0.5
PHASE_PREFIX = "megactx::"
DEVICE_WAIT = "(device wait)"  # timing_phases' row of the host's waits for the device, inside the parts
_recording_phases = False
_timing: dict[str, list[float]] | None = None  # while timing_phases() is on: name -> [calls, seconds]
_NO_RANGE = contextlib.nullcontext()  # reusable: what `phase` gives outside a profile


class _Timer:
    """Adds the host time spent inside it to a timing_phases() row [calls, seconds]."""

    __slots__ = ("row", "start")

    def __init__(self, row: list[float]):
        self.row = row

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.row[0] += 1
        self.row[1] += time.perf_counter() - self.start


def phase(name: str) -> contextlib.AbstractContextManager:
    """A part of an engine step (schedule, forward, verify, ...): a torch.profiler range named
    megactx::<name> while `recording_phases()` is on, its host time while `timing_phases()` is on,
    else nothing (so that a step outside a profile pays for no range)."""
    if _timing is not None:
        return _timed(name)
    if not _recording_phases:
        return _NO_RANGE
    import torch

    return torch.profiler.record_function(PHASE_PREFIX + name)


def device_wait() -> contextlib.AbstractContextManager:
    """The host waiting for the device (a step's host sync), inside a part: timed as DEVICE_WAIT
    while `timing_phases()` is on, else nothing (no profiler range: the parts do not nest)."""
    return _NO_RANGE if _timing is None else _timed(DEVICE_WAIT)


def _timed(name: str) -> _Timer:
    """A timer adding to timing_phases()'s row `name` (while it is on)."""
    return _Timer(_timing.setdefault(name, [0, 0.0]))


@contextlib.contextmanager
def timing_phases():
    """Within it, the host time of the engine's step parts (`phase`) and of its waits for the
    device (`device_wait`), without a profiler: yields the dict it fills, name -> [calls, seconds]."""
    global _timing
    previous, _timing = _timing, {}
    try:
        yield _timing
    finally:
        _timing = previous


@contextlib.contextmanager
def recording_phases():
    """Within it, the engine's steps name their parts (`phase`) for the profiler."""
    global _recording_phases
    previous, _recording_phases = _recording_phases, True
    try:
        yield
    finally:
        _recording_phases = previous


class StepLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = self.path.open("a", buffering=1 << 16)
        self.pid = os.getpid()
        self._flushed = time.perf_counter()

    def record(self, start: float, end: float, scheduled, num_tokens: int, running: int, waiting: int,
               graphs: int, device_wait_s: float | None = None) -> None:
        """scheduled: the step's ScheduledSeq list. device_wait_s: of the step's time, how long the host
        waited for the device's tokens (None: not known); the rest was host work."""
        prefill = sum(1 for item in scheduled if item.num_tokens > 1 or not item.samples)
        keys = max((item.end + item.num_draft_tokens for item in scheduled), default=0)
        line = {"pid": self.pid, "t": round(start, 6), "ms": round(1e3 * (end - start), 3), "seqs": len(scheduled),
                "tokens": num_tokens, "keys": keys, "prefill": prefill, "running": running, "waiting": waiting,
                "graphs": graphs}
        if device_wait_s is not None:
            line["wait_ms"] = round(1e3 * device_wait_s, 3)
        self.file.write(json.dumps(line) + "\n")
        if end - self._flushed > FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self.file.flush()
        self._flushed = time.perf_counter()

    def close(self) -> None:
        self.file.close()


def read(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def step_stats(steps: list[dict]) -> dict:
    """Figures of one process's steps: count, busy seconds, sequences a step (mean), decode-only and with-prefill step
    p50 / p99 (ms; None without such steps) and p50 of their host time (the step less its wait for
    the device; None where the log has no waits), the longest step, and the steps that captured graphs."""
    kinds = {"decode": [r for r in steps if not r["prefill"]], "prefill": [r for r in steps if r["prefill"]]}
    ms = {kind: [r["ms"] for r in rs] for kind, rs in kinds.items()}
    host = {kind: [r["ms"] - r["wait_ms"] for r in rs if "wait_ms" in r] for kind, rs in kinds.items()}
    captures = [r for prev, r in zip(steps, steps[1:]) if r["graphs"] > prev["graphs"]]
    figures = {"steps": len(steps), "busy_s": sum(r["ms"] for r in steps) / 1e3,
               "mean_seqs": statistics.fmean(r["seqs"] for r in steps)}
    for kind in kinds:
        figures |= {f"{kind}_steps": len(ms[kind]),
                    f"{kind}_p50_ms": statistics.median(ms[kind]) if ms[kind] else None,
                    f"{kind}_p99_ms": _pct(ms[kind], 0.99) if ms[kind] else None,
                    f"{kind}_host_p50_ms": statistics.median(host[kind]) if host[kind] else None}
    return figures | {
        "max_ms": max(r["ms"] for r in steps), "capture_steps": len(captures),
        "capture_s": sum(r["ms"] for r in captures) / 1e3}


def prefill_by_keys(steps: list[dict]) -> list[tuple[int, int, float, float]]:
    """The steps with a prefill chunk, by the keys their positions see (logs before "keys" existed
    have none): (keys up to, a power of two; steps; p50 ms; p50 ms per 1K tokens computed), shortest
    first. A long prompt's chunks grow dearer with the context before them (the indexers score
    every earlier key): the rows say by how much, and a row out of line points at something else."""
    rows = {}
    for r in steps:
        if r["prefill"] and r.get("keys"):
            rows.setdefault(1 << (r["keys"] - 1).bit_length(), []).append(r)
    return [(bound, len(rs), statistics.median(r["ms"] for r in rs),
             statistics.median(1e3 * r["ms"] / r["tokens"] for r in rs)) for bound, rs in sorted(rows.items())]


def summarize(lines: list[dict], slowest: int = 10) -> str:
    """Per process: steps, wall-time percentiles of decode-only and other steps, time in steps that
    captured graphs, prefill steps by the keys they see, and the slowest steps."""
    out = []
    for pid in sorted({r["pid"] for r in lines}):
        steps = [r for r in lines if r["pid"] == pid]
        st = step_stats(steps)
        span = steps[-1]["t"] + steps[-1]["ms"] / 1e3 - steps[0]["t"]
        out.append(f"process {pid}: {st['steps']} steps over {span:.2f} s, {st['busy_s']:.2f} s in steps, "
                   f"{st['mean_seqs']:.1f} sequences a step")
        for name, key in (("decode only", "decode"), ("with prefill", "prefill")):
            if st[f"{key}_steps"]:
                host = st[f"{key}_host_p50_ms"]
                out.append(f"  {name}: {st[f'{key}_steps']} steps, p50 {st[f'{key}_p50_ms']:.2f} ms, "
                           f"p99 {st[f'{key}_p99_ms']:.2f} ms" + ("" if host is None else f", host p50 {host:.2f} ms"))
        if st["capture_steps"]:
            out.append(f"  {st['capture_steps']} steps captured CUDA graphs: {st['capture_s']:.2f} s")
        by_keys = prefill_by_keys(steps)
        if by_keys:
            out.append("  steps with prefill, by the keys a position sees:")
            out += [f"    <= {context_label(bound):>5s} keys: {n:4d} steps, p50 {ms:9.2f} ms, "
                    f"{per_k:8.3f} ms per 1K tokens" for bound, n, ms, per_k in by_keys]
        out.append(f"  slowest {slowest}:")
        for r in sorted(steps, key=lambda r: -r["ms"])[:slowest]:
            keys = f", {r['keys']} keys" if "keys" in r else ""
            out.append(f"    +{r['t'] - steps[0]['t']:8.3f} s  {r['ms']:8.2f} ms  {r['seqs']} seqs, {r['tokens']} "
                       f"tokens{keys} ({r['prefill']} prefill), {r['running']} running, {r['waiting']} waiting, "
                       f"graphs {r['graphs']}")
    return "\n".join(out)


def plot(lines: list[dict], path: Path) -> None:
    """Two panels: every step's wall time against the time since the process's first step (decode-only
    and prefill steps apart: a step that slows down beside others points at the device's other
    tenants), and the prefill steps' time against the keys they see (the indexers' growth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_keys = any(r["prefill"] and r.get("keys") for r in lines)  # older logs have none
    fig, axes = plt.subplots(1, 2 if with_keys else 1, figsize=(12 if with_keys else 6.5, 4.5), squeeze=False)
    by_time, by_keys = axes[0][0], axes[0][-1]
    for pid in sorted({r["pid"] for r in lines}):
        steps = [r for r in lines if r["pid"] == pid]
        t0 = steps[0]["t"]
        for kind, rs, marker in (("decode", [r for r in steps if not r["prefill"]], "."),
                                 ("prefill", [r for r in steps if r["prefill"]], "o")):
            if rs:
                by_time.scatter([r["t"] - t0 for r in rs], [r["ms"] for r in rs], s=10, marker=marker,
                                label=f"{pid} {kind}")
        rs = [r for r in steps if r["prefill"] and r.get("keys")]
        if rs:
            by_keys.scatter([r["keys"] for r in rs], [r["ms"] for r in rs], s=12, label=str(pid))
    by_time.set(xlabel="s since the process's first step", ylabel="step wall time (ms)", yscale="log",
                title="every step")
    if with_keys:
        by_keys.set(xlabel="keys a position sees", ylabel="step wall time (ms)", xscale="log", yscale="log",
                    title="steps with prefill")
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, help="a step log (JSON lines) written by LLM(step_log=...) / --step-log")
    p.add_argument("--slowest", type=int, default=10, help="slowest steps listed per process (default 10)")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="also draw the steps' wall times against time and against the keys they see")


def add_steplog_parser(subparsers) -> None:
    p = subparsers.add_parser("steplog", help="summarize a step log (--step-log of serve and eval needles)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.path.is_file():
        print(f"no such file: {args.path}", file=sys.stderr)
        return 2
    lines = read(args.path)
    if not lines:
        print(f"{args.path}: no steps logged", file=sys.stderr)
        return 1
    print(summarize(lines, args.slowest))
    if args.plot is not None:
        plot(lines, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m megactx.engine.steplog PATH` (the same as `megactx steplog PATH`)."""
    p = argparse.ArgumentParser(prog="python -m megactx.engine.steplog", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
