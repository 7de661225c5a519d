"""`StepLog`: one JSON line for every engine step, to see where a server's time goes.

    llm = LLM(path, step_log="steps.jsonl")        # or: megactx serve --step-log steps.jsonl
    python -m megactx.engine.steplog steps.jsonl   # a summary: step times, and the slowest steps

A line: {"pid", "t" (time.perf_counter() at the step's start, s; one clock for every process of a
machine), "ms" (the step's wall time), "seqs" (sequences scheduled), "tokens" (positions computed),
"prefill" (chunks that are not single-token decodes), "running", "waiting" (after the step),
"graphs" (CUDA graphs captured so far: a step that raised it waited for a capture)}. With
overlapped steps (`async_scheduling`) a step's wall time is its host work plus its wait for the
step before. Lines are appended (several processes may share a file) and flushed at least every
half second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

FLUSH_S = 0.5


class StepLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = self.path.open("a", buffering=1 << 16)
        self.pid = os.getpid()
        self._flushed = time.perf_counter()

    def record(self, start: float, end: float, scheduled, num_tokens: int, running: int, waiting: int,
               graphs: int) -> None:
        """scheduled: the step's ScheduledSeq list."""
        prefill = sum(1 for item in scheduled if item.num_tokens > 1 or not item.samples)
        self.file.write(json.dumps({"pid": self.pid, "t": round(start, 6), "ms": round(1e3 * (end - start), 3),
                                    "seqs": len(scheduled), "tokens": num_tokens, "prefill": prefill,
                                    "running": running, "waiting": waiting, "graphs": graphs}) + "\n")
        if end - self._flushed > FLUSH_S:
            self.file.flush()
            self._flushed = end

    def close(self) -> None:
        self.file.close()


def summarize(lines: list[dict], slowest: int = 10) -> str:
    """Per process: steps, wall-time percentiles of decode-only and other steps, time in steps that
    captured graphs, and the slowest steps."""
    out = []
    for pid in sorted({r["pid"] for r in lines}):
        steps = [r for r in lines if r["pid"] == pid]
        span = steps[-1]["t"] + steps[-1]["ms"] / 1e3 - steps[0]["t"]
        busy = sum(r["ms"] for r in steps) / 1e3
        out.append(f"process {pid}: {len(steps)} steps over {span:.2f} s, {busy:.2f} s in steps")
        for name, group in (("decode only", [r for r in steps if not r["prefill"]]),
                            ("with prefill", [r for r in steps if r["prefill"]])):
            if group:
                ms = sorted(r["ms"] for r in group)
                out.append(f"  {name}: {len(ms)} steps, p50 {statistics.median(ms):.2f} ms, "
                           f"p99 {ms[min(len(ms) - 1, int(0.99 * len(ms)))]:.2f} ms, max {ms[-1]:.1f} ms")
        captures = [r for prev, r in zip(steps, steps[1:]) if r["graphs"] > prev["graphs"]]
        if captures:
            out.append(f"  {len(captures)} steps captured CUDA graphs: {sum(r['ms'] for r in captures) / 1e3:.2f} s")
        out.append(f"  slowest {slowest}:")
        for r in sorted(steps, key=lambda r: -r["ms"])[:slowest]:
            out.append(f"    +{r['t'] - steps[0]['t']:8.3f} s  {r['ms']:8.2f} ms  {r['seqs']} seqs, {r['tokens']} "
                       f"tokens ({r['prefill']} prefill), {r['running']} running, {r['waiting']} waiting, "
                       f"graphs {r['graphs']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megactx.engine.steplog", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="a step log (JSON lines) written by LLM(step_log=...) / --step-log")
    p.add_argument("--slowest", type=int, default=10, help="slowest steps listed per process (default 10)")
    args = p.parse_args(argv)
    if not args.path.is_file():
        print(f"no such file: {args.path}", file=sys.stderr)
        return 2
    lines = [json.loads(line) for line in args.path.read_text().splitlines() if line.strip()]
    if not lines:
        print(f"{args.path}: no steps logged", file=sys.stderr)
        return 1
    print(summarize(lines, args.slowest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
