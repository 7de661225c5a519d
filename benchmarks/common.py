"""What every megactx benchmark shares: timing on the device, timing a sample of query rows and
scaling it to the whole prefill, extrapolation, the machine's own ceilings, machine info and the
helpers that write reports.

`megactx bench kernels` uses all of it; `bench engine` and `bench spec` are meant to.

Methods (every figure says which one produced it):
- `measured`: the whole work was run and timed.
- `sampled`: the work splits into independent chunks of query rows (causal prefill); a subset of
  chunks spread evenly over the sequence was timed, and the time scaled to the whole prefill by the
  exact FLOP ratio (whole work / timed work).
- `extrapolated`: not run at this size (memory or time); the time is that of a smaller measured
  size scaled by the exact FLOP ratio, i.e. at the same rate (quadratic in L for causal prefill).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from megactx.analysis.flops import context_label

MEASURED, SAMPLED, EXTRAPOLATED = "measured", "sampled", "extrapolated"
_METHOD_ORDER = (MEASURED, SAMPLED, EXTRAPOLATED)  # weakest evidence last
# A sampled run is sized so that one warm-up plus this many timed repetitions fill the budget.
SAMPLED_REPS = 3
# A ceiling runs for its whole budget (a ~1 ms matmul: ~1000 reps) so that clocks settle under load.
CEILING_MAX_REPS = 2000


# ------------------------------------------------------------------------------------- timing
@dataclass
class Timing:
    """Median and every sample of a timed callable, in seconds; graph: timed as a CUDA graph replay."""

    median_s: float
    samples_s: list[float]
    graph: bool = False


class Clock:
    """Times a callable on one device: CUDA events on a GPU (launches are asynchronous, so a host
    clock would time the launches), the host clock on a CPU.

    flush_bytes: a buffer of that size is zeroed before every repetition (outside the timed
    region) so that a repetition does not find the previous one's data in the L2 cache; 0 = none.
    warmup: untimed runs before the timed ones (compilation, autotuning, the allocator's first
    allocations)."""

    def __init__(self, device: torch.device | str, flush_bytes: int = 0, warmup: int = 1):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warmup = warmup
        self._flush = torch.empty(flush_bytes, dtype=torch.uint8, device=self.device) if flush_bytes else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _one(self, fn: Callable[[], object]) -> float:
        if self._flush is not None:
            self._flush.zero_()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # events count milliseconds
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def time(self, fn: Callable[[], object], *, budget_s: float, min_reps: int = 1, max_reps: int = 100,
             graph: bool = False) -> Timing:
        """Run fn `warmup` times, then repeat it until about budget_s seconds of timed runs (at least
        min_reps, at most max_reps); the median is the figure. graph=True (CUDA only): time the
        replay of fn captured in a CUDA graph, as the engine runs its decode steps, so that a kernel
        of tens of microseconds is not timed with its launch overhead; Timing.graph says whether it
        was (a capture that fails falls back to eager launches)."""
        for _ in range(max(self.warmup, 1 if graph else 0)):
            fn()
        self.sync()
        captured = self._capture(fn) if graph and self.cuda else None
        if captured is not None:
            fn = captured.replay
            fn()
            self.sync()
        samples = [self._one(fn)]
        reps = min(max_reps, max(min_reps, int(budget_s / max(samples[0], 1e-9))))
        samples += [self._one(fn) for _ in range(reps - 1)]
        return Timing(statistics.median(samples), samples, graph=captured is not None)

    def _capture(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
        """fn captured in a CUDA graph (its allocations come from the graph's private pool), or None
        where fn cannot be captured (a host sync inside it)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # a run on a side stream first, as capture wants
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:
            self.sync()
            return None
        return graph


# ------------------------------------------------------------------------------------- figures
@dataclass
class Measurement:
    """One figure of a benchmark.

    name: what ran ("indexer.logits"); context: L in tokens; time_s: the whole work's time (scaled
    for `sampled`, scaled from a smaller size for `extrapolated`); flops / bytes: the whole work's
    FLOPs and counted bytes (None where the figure has none); ceiling: the key of the compute
    ceiling its TFLOP/s is compared with ("bf16_mm", "fp8_mm") or None; detail: how it was run."""

    name: str
    context: int
    time_s: float
    flops: float | None
    bytes: float | None
    method: str
    ceiling: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def tflops(self) -> float | None:
        return None if self.flops is None or self.time_s <= 0 else self.flops / self.time_s / 1e12

    @property
    def gbps(self) -> float | None:
        return None if self.bytes is None or self.time_s <= 0 else self.bytes / self.time_s / 1e9

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"tflops": self.tflops, "gbps": self.gbps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def weakest_method(methods: Sequence[str]) -> str:
    """The method of a figure combined from others: extrapolated > sampled > measured."""
    return max(methods, key=_METHOD_ORDER.index)


def extrapolate(base: Measurement, context: int, flops: float, bytes_: float | None = None,
                reason: str = "") -> Measurement:
    """`base`'s work rate carried to other work of the same kind: time = base.time_s · flops / base.flops."""
    if not base.flops:
        raise ValueError(f"cannot extrapolate {base.name} at {base.context}: it has no FLOP count")
    detail = {"from_context": base.context, "from_method": base.method}
    if reason:
        detail["reason"] = reason
    return Measurement(base.name, context, base.time_s * flops / base.flops, flops, bytes_, EXTRAPOLATED,
                       base.ceiling, detail)


# ------------------------------------------------------------------------------- row sampling
def systematic_pick(n: int, k: int) -> list[int]:
    """k distinct indices of range(n), evenly spread (index ⌊(i + ½)·n/k⌋): a causal prefill's
    chunks differ in cost by position, so the sample takes them from the whole sequence."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot pick {k} of {n} chunks: need 1 <= k <= n")
    return [int((i + 0.5) * n / k) for i in range(k)]


@dataclass
class RowSample:
    """The chunks of query rows that were timed, out of all chunks of a prefill."""

    picked: list[tuple[int, int]]  # (first row, end row) of each timed chunk
    total_chunks: int
    picked_flops: float
    total_flops: float

    @property
    def full(self) -> bool:
        return len(self.picked) == self.total_chunks

    @property
    def scale(self) -> float:
        """Whole-prefill time / timed time, by the exact FLOP ratio."""
        return self.total_flops / self.picked_flops

    def to_detail(self) -> dict[str, Any]:
        rows = sum(e - s for s, e in self.picked)
        return {"timed_chunks": len(self.picked), "total_chunks": self.total_chunks, "timed_rows": rows,
                "flop_fraction": self.picked_flops / self.total_flops}


def sample_size(n_chunks: int, est_full_s: float, target_s: float, max_chunks: int) -> int:
    """How many of n_chunks to time so that one timed run takes about target_s, given an estimate
    of the whole work's time (all of them when it fits)."""
    if est_full_s <= target_s:
        return min(n_chunks, max_chunks)
    return max(1, min(n_chunks, max_chunks, int(n_chunks * target_s / est_full_s)))


def time_row_chunks(clock: Clock, chunks: Sequence[tuple[int, int]], flops_of: Callable[[int, int], float],
                    prepare: Callable[[list[tuple[int, int]]], Callable[[], object]], budget_s: float,
                    max_rows: int, min_reps: int = 1) -> tuple[Timing, RowSample]:
    """Time a prefill made of independent row chunks, sampling chunks when the whole is too long.

    chunks: (start, end) row ranges covering the prefill; flops_of(start, end): exact FLOPs of a
    chunk; prepare(picked): builds the inputs of those chunks (untimed) and returns the callable
    that runs them; max_rows: rows whose inputs a run may hold at once. A pilot run of the last
    chunk (the longest rows) estimates the whole. Returns the timing of the timed chunks and the
    sample, whose `scale` carries that time to the whole prefill. min_reps: timed runs at least."""
    total = float(sum(flops_of(s, e) for s, e in chunks))
    last = chunks[-1]
    pilot = clock.time(prepare([last]), budget_s=0.0, min_reps=1, max_reps=1)  # warm-up compiles
    est_full = pilot.median_s * total / flops_of(*last)
    chunk_rows = max(e - s for s, e in chunks)
    n = sample_size(len(chunks), est_full, budget_s / (1 + SAMPLED_REPS), max(1, max_rows // chunk_rows))
    picked = [chunks[i] for i in systematic_pick(len(chunks), n)]
    timing = clock.time(prepare(picked), budget_s=budget_s * SAMPLED_REPS / (1 + SAMPLED_REPS), min_reps=min_reps)
    return timing, RowSample(picked, len(chunks), float(sum(flops_of(s, e) for s, e in picked)), total)


# ------------------------------------------------------------------------------------ ceilings
@dataclass
class Ceilings:
    """The machine's own ceilings, measured in the same run: bf16 and FP8 matmul TFLOP/s, device
    copy GB/s (read + write bytes). None where the device cannot run the operation."""

    bf16_mm: float | None
    fp8_mm: float | None
    copy: float | None
    detail: dict[str, Any] = field(default_factory=dict)

    def tflops(self, key: str | None) -> float | None:
        return {"bf16_mm": self.bf16_mm, "fp8_mm": self.fp8_mm}.get(key) if key else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ceilings:
        return cls(d.get("bf16_mm"), d.get("fp8_mm"), d.get("copy"), d.get("detail", {}))


def measure_ceilings(clock: Clock, matmul_n: int, copy_bytes: int, budget_s: float, min_reps: int = 3) -> Ceilings:
    """bf16 torch.mm and FP8 torch._scaled_mm (e4m3, per-tensor scales, bf16 out) of n×n×n random
    matrices, 2n³ FLOPs; a device copy of copy_bytes, counting 2·copy_bytes moved. Each runs for
    about budget_s (at least min_reps times)."""
    detail: dict[str, Any] = {"matmul_n": matmul_n, "copy_bytes": copy_bytes}
    bf16 = _matmul_tflops(clock, matmul_n, budget_s, min_reps, fp8=False)
    fp8 = None
    try:
        fp8 = _matmul_tflops(clock, matmul_n, budget_s, min_reps, fp8=True)
    except (RuntimeError, NotImplementedError) as e:  # e.g. no FP8 matmul on this device
        detail["fp8_mm_error"] = str(e).splitlines()[0]
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=clock.device).random_(0, 256)
    dst = torch.empty_like(src)
    cp = clock.time(lambda: dst.copy_(src), budget_s=budget_s, min_reps=min_reps, max_reps=CEILING_MAX_REPS)
    return Ceilings(bf16, fp8, 2 * copy_bytes / cp.median_s / 1e9, detail)


def _matmul_tflops(clock: Clock, n: int, budget_s: float, min_reps: int, fp8: bool) -> float:
    a = torch.randn(n, n, device=clock.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=clock.device, dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=clock.device)
        # _scaled_mm wants the second operand column-major: the transpose of a row-major matrix
        t = clock.time(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16),
                       budget_s=budget_s, min_reps=min_reps, max_reps=CEILING_MAX_REPS)
    else:
        t = clock.time(lambda: torch.mm(a, b), budget_s=budget_s, min_reps=min_reps, max_reps=CEILING_MAX_REPS)
    return 2 * n**3 / t.median_s / 1e12


# ---------------------------------------------------------------------------------- machine
def host_probe_ms(iterations: int = 200_000) -> float:
    """Milliseconds of a fixed pure-Python loop on this thread, now: the host's speed at this moment.
    On the lent H200 host it took either ~12.5 or ~21 ms (2026-12-03), each vCPU switching between
    the two every 1-3 s; a host-bound run is as much slower in the slow state."""
    start, acc = time.perf_counter(), 0
    for i in range(iterations):
        acc += i * i % 7
    return (time.perf_counter() - start) * 1e3


def sync_device(device: torch.device | str) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device | str) -> None:
    """Give the device memory of dropped engines back (the next one, or a server, needs it)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """Device name, memory, library versions and the date: what a reader needs to compare runs."""
    import triton

    device = torch.device(device)
    info: dict[str, Any] = {
        "device": device.type,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "sms": props.multi_processor_count, "cuda": torch.version.cuda}
    else:
        info["gpu"] = None
    return info


def device_slug(info: dict[str, Any]) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'; 'cpu' without a GPU: the suffix of result file names."""
    name = info.get("gpu") or info.get("device", "cpu")
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ---------------------------------------------------------------------------------- reports
def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def fmt_context(n: int) -> str:
    """32768 -> '32K', 1048576 -> '1M', 1000 -> '1000' (megactx's own context label)."""
    return context_label(n)


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (a server drains and exits), then SIGKILL after timeout_s; waits for the exit."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


class Progress:
    """One line per step on stderr, with the seconds since the start, so a long run shows it works."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", file=self.stream, flush=True)

    def measurement(self, m: Measurement) -> None:
        parts = [f"{fmt_context(m.context):>5}", f"{m.name:<30}", f"{fmt_time(m.time_s):>10}"]
        if m.tflops is not None:
            parts.append(f"{m.tflops:9.1f} TFLOP/s")
        if m.gbps is not None:
            parts.append(f"{m.gbps:9.0f} GB/s")
        parts.append(m.method)
        if m.method == SAMPLED and "flop_fraction" in m.detail:
            parts.append(f"({m.detail['timed_chunks']}/{m.detail['total_chunks']} chunks)")
        self.log("  ".join(parts))


def cubin_resource_usage(compiled) -> dict[str, str]:
    """Registers a thread ("REG") and spill stack bytes ("STACK") of a compiled Triton kernel, read
    with the cuobjdump that ships with Triton (no GPU needed); {} where the tool is missing."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return dict(part.split(":") for part in dump.split() if part.startswith(("REG:", "STACK:")))


def write_suite_reports(suite: str, results: dict[str, Any], out_dir: Path, markdown, plot) -> list[Path]:
    """Write <suite>-<device>.json (results, targets included), .md (`markdown(results)`) and .png
    (`plot(results, path)` -> whether it drew; False without matplotlib) into out_dir."""
    stem = Path(out_dir) / f"{suite}-{device_slug(results['machine'])}"
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    write_json(paths[0], results)
    paths[1].write_text(markdown(results))
    if plot(results, stem.with_suffix(".png")):
        paths.append(stem.with_suffix(".png"))
    return paths


def rerender_from_json(prog: str, path: Path, out: Path | None, write_reports) -> int:
    """`--from-json FILE`: write a suite's reports again from its saved figures, measuring nothing."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"{prog}: error: cannot read --from-json {path}: {e}", file=sys.stderr)
        return 2
    for written in write_reports(results, out or Path(path).parent):
        print(written)
    return 0


def int_list(text: str) -> list[int]:
    """argparse type of comma-separated integers, e.g. 1,16,64."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,16,64, got {text!r}") from None


def pyplot():
    """matplotlib.pyplot drawing to files (no display), or None where matplotlib is not installed
    (a report then goes without its figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_machine_ceilings(device: str | torch.device, budget_s: float = 0.5) -> dict[str, Any] | None:
    """The GPU ceilings (8192³ bf16 / FP8 matmul, 1 GiB copy) a suite reports beside its figures;
    None on a CPU, where the suites' runs are smoke runs and a bf16 matmul ceiling takes minutes."""
    if torch.device(device).type != "cuda":
        return None
    return measure_ceilings(Clock(device), 8192, 1 << 30, budget_s).to_dict()


def ceilings_markdown(ceilings: Ceilings) -> str:
    """The '## Ceilings' section of a report."""
    d = ceilings.detail
    fp8 = f"{fmt_num(ceilings.fp8_mm)} TFLOP/s" + (f" ({d['fp8_mm_error']})" if "fp8_mm_error" in d else "")
    return "## Ceilings (measured in this run)\n\n" + md_table(["ceiling", "value"], [
        [f"bf16 matmul ({d.get('matmul_n')}³ `torch.mm`)", f"{fmt_num(ceilings.bf16_mm)} TFLOP/s"],
        [f"FP8 matmul ({d.get('matmul_n')}³ `torch._scaled_mm`, e4m3, per-tensor scales)", fp8],
        [f"device copy ({d.get('copy_bytes', 0) / 2**30:.3g} GiB, read + write counted)",
         f"{fmt_num(ceilings.copy)} GB/s"],
    ])
