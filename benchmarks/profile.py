"""`megactx bench profile`: where the time of the engine's steps goes, by torch.profiler.

One workload, run by the engine once untimed (compiles, CUDA graph captures), once timed, once
under torch.profiler, each computing the whole of every prompt (the prefix cache is off: with it the
later runs would compute only a prompt's last block, a shape the warm-up never met):

    decode   B prompts of P tokens of held-out code (random ids for a checkpoint without a
             tokenizer), M tokens generated each; one engine per γ of --num-speculative-tokens
             (0 = no speculation), so that a speculative step is seen beside a plain one
    prefill  --prefill L: one prompt of L tokens of held-out code, around again as often as it
             takes (random ids without a tokenizer), 1 token generated (the long-context prefill of
             a needle case: the indexers score every earlier key)

Per engine step (the engine's step log counts them): the wall time of the timed run; the host
span of each part of a step (schedule, forward, sample or verify + propose, emit: the engine names
them for the profiler, `megactx.engine.steplog.phase`; a part that waits for the device includes
the wait) and the device's idle time under each (where the device ran dry while the host worked on
that part: the host time a faster host would save); the device's busy time, kernels summed (CUDA
graph replays included); the kernels
taking it, most first; the CUDA runtime and driver calls the host made (kernel and graph launches, copies,
synchronisations); and the host's own work, the PyTorch ops by self CPU time. A profiled run is
slower than the timed one (the profiler's host time), so walls come from the timed run and the
breakdown from the profiled one. On a CPU only the host side exists.

    megactx bench profile --num-speculative-tokens 0,3             # batch-1 decode, shipped model
    megactx bench profile --prefill 262144 --max-num-batched-tokens 65536
    megactx bench profile --batch 32 --trace                      # + a Chrome/Perfetto trace per engine

Results: benchmarks/results/profile-<device>.json, .md, .png (a bar per engine: wall and device
time a step, the top kernels stacked), with the GPU's ceilings measured in the same run (bf16 and
FP8 matmul, device copy) to hold the kernels' times against. Figures are of this run; they are not
targets, and a profile has no peers: it explains a benchmark's figure.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Ceilings,
    Progress,
    ceilings_markdown,
    fmt_num,
    free_device_memory,
    int_list,
    machine_info,
    md_table,
    measure_machine_ceilings,
    pyplot,
    rerender_from_json,
    save_figure,
    sync_device,
    write_suite_reports,
)
from megactx.engine.steplog import DEVICE_WAIT, PHASE_PREFIX, recording_phases, timing_phases

HELP = "where engine steps spend their time (torch.profiler): kernels, launches, host ops"
RESULTS_DIR = Path(__file__).parent / "results"
RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]\w*$")  # cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch, ...


@dataclass
class Workload:
    batch: int = 1
    prompt_len: int = 256  # P (decode)
    output_len: int = 64  # M (decode)
    prefill: int | None = None  # L: one prompt of L tokens instead, 1 generated
    temperature: float = 1.0
    seed: int = 0

    def describe(self) -> str:
        if self.prefill:
            return f"prefill of one prompt of {self.prefill:,} tokens, 1 token generated"
        return (f"decode: {self.batch} prompt(s) of {self.prompt_len} tokens, {self.output_len} generated each at "
                f"temperature {self.temperature:g}")


def prompts_for(model_dir: Path, vocab_size: int, w: Workload) -> tuple[list[list[int]], str]:
    """(prompts, what they are): held-out code when the checkpoint has a tokenizer, random ids
    otherwise. A prefill's one prompt runs through the held-out code from a line start and around
    again as often as it takes, as a needle haystack does: its cost depends on the text, because the
    indexers' top-k selects faster on some rows (ReLU'd logits with few keys above 0) than others."""
    from benchmarks.engine import random_prompts
    from benchmarks.spec import held_out_prompts, stdlib_held_out

    if not (model_dir / "tokenizer.json").is_file():
        return random_prompts(w.batch if not w.prefill else 1, w.prefill or w.prompt_len, vocab_size, w.seed), \
            "random token ids"
    split, version = stdlib_held_out(model_dir, vocab_size)
    what = f"held-out code of the Python {version} stdlib"
    if not w.prefill:
        return held_out_prompts(split, w.batch, w.prompt_len, w.seed), what
    first = int(split.line_starts[w.seed % (len(split.line_starts) - 1)])
    ids = split.around(first, w.prefill).astype("int64").tolist()
    laps = f", {w.prefill / split.num_tokens:.1f} times over its {split.num_tokens:,} tokens" \
        if w.prefill > split.num_tokens else ""
    return [ids], what + laps


def _steps(log: Path, skip: int) -> list[dict]:
    from megactx.engine.steplog import read

    return read(log)[skip:] if log.is_file() else []


@contextlib.contextmanager
def timed_replays(graphs):
    """Within it, the host time of every replay of the CUDA graphs `graphs` (a runner's StepGraphs,
    or None) holds, by graph kind -> {kind: [replays, µs]}: what a launch of each graph costs the
    host without a profiler (which slows graph launches itself). Graphs captured inside are not
    timed (the warm-up should have met them all)."""
    times: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    held = list(graphs.graphs.items()) if graphs is not None else []

    def timed(kind: str, replay):
        def run() -> None:
            start = time.perf_counter()
            replay()
            row = times[kind]
            row[0] += 1
            row[1] += 1e6 * (time.perf_counter() - start)
        return run

    own = [graph.replay for _, graph in held]
    for key, graph in held:
        graph.replay = timed(str(key[0]), graph.replay)
    try:
        yield times
    finally:
        for (_, graph), replay in zip(held, own):
            graph.replay = replay


def graphs_alone(graphs, reps: int = 20, kernel_reps: int = 3) -> list[dict[str, Any]]:
    """Each CUDA graph of `graphs` (a runner's StepGraphs, or None) replayed alone, `reps` times, the
    device idle before each: medians of the host's time in replay() and of the device's time from
    launch to end (CUDA events around it); then `kernel_reps` replays under torch.profiler, for the
    kernels one replay runs -> [{"graph", "kind", "batch", "keys", "host_us", "device_us", "kernels"
    (a replay), "by_kernel" (name -> [calls, device µs] a replay)}], in key order. What a step's
    graphs cost the device by themselves, their launches the host outside a step, and what one
    graph runs that another does not (`kernels_beyond`). Run after the engine's work: a replay
    recomputes the graph's last inputs (the same KV again)."""
    if graphs is None or not torch.cuda.is_available():
        return []
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for key, graph in sorted(graphs.graphs.items(), key=lambda kv: str(kv[0])):
        host, device = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            graph.replay()
            host.append(1e6 * (time.perf_counter() - t))
            end.record()
            torch.cuda.synchronize()
            device.append(1e3 * start.elapsed_time(end))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(kernel_reps):
                graph.replay()
            torch.cuda.synchronize()
        by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if is_kernel(e):
                by_kernel[e.name][0] += 1 / kernel_reps
                by_kernel[e.name][1] += e.time_range.elapsed_us() / kernel_reps
        rows.append({"graph": str(key), "kind": key[0], "batch": key[1], "keys": key[2] if len(key) > 2 else None,
                     "host_us": statistics.median(host), "device_us": statistics.median(device),
                     "kernels": sum(n for n, _ in by_kernel.values()), "by_kernel": dict(by_kernel)})
    return rows


def kernels_beyond(rows: list[dict[str, Any]], bases: list[dict[str, Any]], top: int = 10) -> list[dict[str, Any]]:
    """For each verify graph of graphs_alone's rows, the kernels it runs beyond the decode graph of
    its batch among `bases` (graphs_alone's rows of any engine: a speculative engine has no decode
    graph of its own; the nearest key bucket): [{"graph", "base", "rows": [{"kernel", "base_calls",
    "base_us", "calls", "us"}] the `top` kernels by the device time added, most first, then an
    "other (n)" row, "added_us" (all kernels')}]. Why a verify of q rows a sequence costs more than
    a decode."""
    out = []
    for row in rows:
        if row.get("kind") != "verify" or not row.get("by_kernel"):
            continue
        same = [b for b in bases if b.get("kind") == "decode" and b.get("batch") == row["batch"] and b.get("by_kernel")]
        if not same:
            continue
        other = min(same, key=lambda b: abs((b.get("keys") or 0) - (row.get("keys") or 0)))
        mine, theirs, none = row["by_kernel"], other["by_kernel"], (0, 0.0)
        diff = [dict(zip(("kernel", "base_calls", "base_us", "calls", "us"),
                         (name, *theirs.get(name, none), *mine.get(name, none)))) for name in set(mine) | set(theirs)]
        diff.sort(key=lambda d: (-(d["us"] - d["base_us"]), d["kernel"]))
        head, rest = diff[:top], diff[top:]
        if rest:
            head.append({"kernel": f"other ({len(rest)})", **{f: sum(d[f] for d in rest)
                                                               for f in ("base_calls", "base_us", "calls", "us")}})
        out.append({"graph": row["graph"], "base": other["graph"], "rows": head,
                    "added_us": sum(d["us"] - d["base_us"] for d in diff)})
    return out


def is_kernel(e) -> bool:
    """A profiler event is a kernel's (or a copy's) on the device, not a range's shadow on the GPU
    timeline (a phase's, say: the kernels in it count)."""
    return e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)


def timed_steps(warm: list[dict], timed: list[dict], wall_s: float, slowest: int = 5) -> dict[str, Any]:
    """What a timed run's mean step is made of, beyond its median: the steps' own time against the
    run's wall (the rest is generate()'s work outside steps), CUDA graphs captured during the run
    (the warm-up should have met every shape), and the slowest steps with what they computed."""
    if not timed:
        return {}
    before = warm[-1].get("graphs", 0) if warm else 0
    return {"steps_ms": sum(r["ms"] for r in timed), "outside_steps_ms": 1e3 * wall_s - sum(r["ms"] for r in timed),
            "graphs_captured": timed[-1].get("graphs", 0) - before,
            "slowest_steps": [{"step": i, **{k: r.get(k) for k in ("ms", "tokens", "keys", "prefill")},
                               "captured": r.get("graphs", 0) - (timed[i - 1].get("graphs", 0) if i else before)}
                              for i, r in sorted(enumerate(timed), key=lambda ir: -ir[1]["ms"])[:slowest]]}


def breakdown(events, steps: int, top: int) -> dict[str, Any]:
    """Per-step figures of a profiler's events: the engine's step phases (host spans, in step
    order), kernels (device time, most first), runtime/driver calls, and PyTorch ops by self CPU
    time; the last three cut to `top` rows plus an 'other' row."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [calls, us]
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    phases: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # first seen first: step order
    busy, spans = [], []  # the kernels' (start, end) and the phases' (start, end, name), µs
    for e in events:
        if is_kernel(e):
            row = kernels[e.name]
            busy.append((e.time_range.start, e.time_range.end))
        elif e.device_type.name == "CUDA":
            continue  # a range's shadow on the GPU timeline (is_kernel)
        elif e.name.startswith(PHASE_PREFIX):
            row = phases[e.name.removeprefix(PHASE_PREFIX)]
            spans.append((e.time_range.start, e.time_range.end, e.name.removeprefix(PHASE_PREFIX)))
        elif RUNTIME_CALL.match(e.name):
            row = calls[e.name]
        else:  # an op: its own time, not its children's
            row = ops[e.name]
            row[0] += 1
            row[1] += e.self_cpu_time_total
            continue
        row[0] += 1
        row[1] += e.time_range.elapsed_us()

    def table(rows: dict[str, list[float]]) -> list[dict[str, Any]]:
        ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
        out = [{"name": name, "calls_per_step": n / steps, "us_per_step": us / steps} for name, (n, us) in ranked[:top]]
        rest = ranked[top:]
        if rest:
            out.append({"name": f"other ({len(rest)})", "calls_per_step": sum(n for _, (n, _) in rest) / steps,
                        "us_per_step": sum(us for _, (_, us) in rest) / steps})
        return out

    idle = device_idle(busy, spans)
    return {"phases": [{"name": name, "calls_per_step": n / steps, "us_per_step": us / steps}
                       | ({"device_idle_us_per_step": idle.get(name, 0.0) / steps} if idle else {})
                       for name, (n, us) in phases.items()],
            "device_us_per_step": sum(us for _, us in kernels.values()) / steps,
            **({"device_idle_us_per_step": sum(idle.values()) / steps,
                "device_idle_between_steps_us_per_step": idle[BETWEEN_STEPS] / steps} if idle else {}),
            "kernels_per_step": sum(n for n, _ in kernels.values()) / steps,
            "kernels": table(kernels), "runtime_calls": table(calls), "host_ops": table(ops)}


BETWEEN_STEPS = "(between steps)"


def device_idle(busy: list[tuple[float, float]], spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Where the device sat idle, by the part of a step the host was in: busy, the kernels'
    (start, end); spans, the step parts' (start, end, name) (they follow one another) -> name ->
    idle µs under it, with BETWEEN_STEPS for idle time in none (the engine's loop, generate()'s
    own work). From the first part's start to the end of the last kernel or part; {} without
    kernels or parts (a CPU run). Idle under a part that launches is the host's cost: the device
    ran dry while it worked."""
    if not busy or not spans:
        return {}
    busy, spans = sorted(busy), sorted(spans)
    gaps, edge = [], spans[0][0]  # [(start, end)] in order, none overlapping
    for start, end in busy:
        if start > edge:
            gaps.append((edge, start))
        edge = max(edge, end)
    last = max(edge, max(end for _, end, _ in spans))
    if last > edge:
        gaps.append((edge, last))
    idle: dict[str, float] = defaultdict(float)
    ends = [end for _, end in gaps]
    for start, end, name in spans:
        for a, b in gaps[bisect.bisect_right(ends, start):]:
            if a >= end:
                break
            idle[name] += min(b, end) - max(a, start)
    idle[BETWEEN_STEPS] = max(sum(b - a for a, b in gaps) - sum(idle.values()), 0.0)
    return dict(idle)


def python_functions(llm, prompts: list[list[int]], params: list, device: torch.device, top: int
                     ) -> list[dict[str, Any]]:
    """One more run of the workload under cProfile -> the `top` functions by own host time a step
    (Python functions, and the C calls they make: kernel launches, copies, syncs), with their
    cumulative time: which code a host-bound step spends its time in. (cProfile slows Python code
    about twofold; compare functions with each other, not with the timed run's wall.)"""
    import cProfile
    import pstats

    steps = llm.stats.steps
    sync_device(device)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    sync_device(device)
    prof.disable()
    n = max(llm.stats.steps - steps, 1)
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = name if path == "~" else f"{Path(path).name}:{line}({name})"
        rows.append({"function": where, "calls_per_step": calls / n, "own_us_per_step": 1e6 * own / n,
                     "cum_us_per_step": 1e6 * cum / n})
    return sorted(rows, key=lambda r: -r["own_us_per_step"])[:top]


def profile_engine(llm, prompts: list[list[int]], params: list, device: torch.device, log: Path, top: int,
                   trace: Path | None = None, python_profile: bool = False) -> dict[str, Any]:
    """Warm-up, timed and profiled runs of one engine on the same prompts; figures per step.
    python_profile: one more run under cProfile (`python_functions`)."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts, params, use_tqdm=False)  # compiles and captures what the runs meet
    llm.step_log.flush()
    warm = _steps(log, 0)
    seen = len(warm)
    sync_device(device)
    with timed_replays(getattr(llm.runner, "graphs", None)) as replays, timing_phases() as parts:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync_device(device)
        wall = time.perf_counter() - start
    llm.step_log.flush()
    timed = _steps(log, seen)
    seen += len(timed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with recording_phases(), profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        sync_device(device)
    llm.step_log.flush()
    profiled = _steps(log, seen)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    steps = max(len(profiled), 1)
    stats = [o.spec_decode for o in outs if o.spec_decode is not None]
    accepted = sum(s.num_accepted_tokens for s in stats)
    verifies = sum(s.num_drafts for s in stats)
    return {"steps": len(timed), "wall_s": wall, "wall_ms_per_step": 1e3 * wall / max(len(timed), 1),
            "step_ms_median": statistics.median(r["ms"] for r in timed) if timed else None,
            **timed_steps(warm, timed, wall),
            "graph_replays": [{"kind": kind, "replays_per_step": n / max(len(timed), 1), "host_us_per_replay": us / n}
                              for kind, (n, us) in replays.items() if n],
            "host_parts": [{"name": name, "calls_per_step": n / max(len(timed), 1),
                            "us_per_step": 1e6 * s / max(len(timed), 1)} for name, (n, s) in parts.items()],
            "output_tokens": sum(len(o.token_ids) for o in outs),
            "mean_acceptance_length": 1 + accepted / verifies if verifies else None,
            "profiled_steps": len(profiled), **breakdown(prof.events(), steps, top),
            "graphs_alone": graphs_alone(getattr(llm.runner, "graphs", None) if device.type == "cuda" else None),
            **({"python_functions": python_functions(llm, prompts, params, device, 2 * top)} if python_profile else {})}


def run_profiles(model_dir: Path, w: Workload, gammas: list[int], device: str, top: int, trace_dir: Path | None,
                 engine_args: dict[str, Any], progress: Progress, overlap: bool = False,
                 python_profile: bool = False) -> dict[str, Any]:
    from megactx import LLM, SamplingParams
    from megactx.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir, engine_args.get("hf_overrides"))
    prompts, source = prompts_for(model_dir, cfg.vocab_size, w)
    new_tokens = 1 if w.prefill else w.output_len
    params = [SamplingParams(temperature=w.temperature, max_tokens=new_tokens, ignore_eos=True, seed=w.seed + i)
              for i in range(len(prompts))]
    shown = os.path.relpath(model_dir) if Path(model_dir).resolve().is_relative_to(Path.cwd()) else str(model_dir)
    results: dict[str, Any] = {"schema": 1, "machine": machine_info(device), "model": shown,
                               "workload": w.describe() + ("" if engine_args.get("cuda_graphs", True) else
                                                           ", no CUDA graphs")
                               + ("" if engine_args.get("fuse", True) else ", unfused (LLM(fuse=False))")
                               + (", speculative steps overlapped (LLM(async_scheduling=True))" if overlap else ""),
                               "prompts": source, "top": top, "engines": [], "prefix_caching": False,
                               "ceilings": measure_machine_ceilings(device)}  # what the kernels' times compare with
    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        for gamma in gammas:
            log = Path(tmp) / f"steps-{gamma}.jsonl"
            progress.log(f"engine γ = {gamma}: {w.describe()}")
            llm = LLM(model_dir, device=device, max_model_len=max(map(len, prompts)) + new_tokens + gamma + 1,
                      max_num_seqs=max(len(prompts), 1), num_speculative_tokens=gamma, seed=w.seed,
                      warm_up=False, step_log=log, enable_prefix_caching=False, **engine_args,
                      **({"async_scheduling": True} if gamma and overlap else {}))
            trace = trace_dir / f"profile-trace-g{gamma}.json" if trace_dir else None
            figures = profile_engine(llm, prompts, params, dev, log, top, trace, python_profile)
            results["engines"].append({"gamma": gamma, **figures} | ({"trace": str(trace)} if trace else {}))
            progress.log(f"  {figures['steps']} steps, {fmt_num(figures['wall_ms_per_step'])} ms a step, device "
                         f"{fmt_num(figures['device_us_per_step'] / 1e3)} ms a step")
            del llm
            free_device_memory(dev)
    return results


# ------------------------------------------------------------------------------ reports
def _table(rows: list[dict[str, Any]], what: str) -> str:
    if not rows:
        return f"(no {what} recorded)\n"
    return md_table([what, "calls a step", "µs a step"],
                    [[f"`{r['name'][:90]}`", fmt_num(r["calls_per_step"]), fmt_num(r["us_per_step"])] for r in rows])


def _phase_table(e: dict[str, Any]) -> str:
    """The parts of a step, with the device's idle time under each where a device was profiled."""
    rows = e.get("phases", [])
    if "device_idle_us_per_step" not in e:
        return _table(rows, "part")
    body = [[f"`{r['name']}`", fmt_num(r["calls_per_step"]), fmt_num(r["us_per_step"]),
             fmt_num(r.get("device_idle_us_per_step", 0.0))] for r in rows]
    body += [[BETWEEN_STEPS, "–", "–", fmt_num(e["device_idle_between_steps_us_per_step"])],
             ["**all**", "–", "–", f"**{fmt_num(e['device_idle_us_per_step'])}**"]]
    return md_table(["part", "calls a step", "µs a step", "device idle under it, µs a step"], body)


def _timed_lines(e: dict[str, Any], graphs: list[dict[str, Any]]) -> list[str]:
    """The timed run beyond its median step (timed_steps) and its graph launches (timed_replays),
    for a report's engine section; graphs: every engine's graphs replayed alone."""
    if "steps_ms" not in e:
        return []
    launches = []
    if e.get("graph_replays"):
        launches = ["CUDA graph launches of the timed run (the host's time in `replay()`, no profiler):", "",
                    md_table(["graph kind", "replays a step", "host µs a replay"],
                             [[f"`{r['kind']}`", fmt_num(r["replays_per_step"]), fmt_num(r["host_us_per_replay"])]
                              for r in e["graph_replays"]]), ""]
    if e.get("graphs_alone"):
        launches += ["Each CUDA graph replayed alone after the runs (the device idle before; medians of 20; "
                     "device µs from an event before the launch to one after it, so a large graph's launch "
                     "latency is in it; its kernels and their summed time from 3 more replays under the "
                     "profiler):", "",
                     md_table(["graph (kind, batch or rows, keys, ...)", "host µs a launch", "device µs",
                               "kernels a replay", "kernel µs a replay"],
                              [[f"`{r['graph']}`", fmt_num(r["host_us"]), fmt_num(r["device_us"]),
                                fmt_num(r["kernels"]) if "kernels" in r else "–",
                                fmt_num(sum(us for _, us in r["by_kernel"].values())) if "by_kernel" in r else "–"]
                               for r in e["graphs_alone"]]), ""]
        for d in kernels_beyond(e["graphs_alone"], graphs):
            launches += [f"What `{d['graph']}` runs beyond `{d['base']}` (a replay each, the kernels by the device "
                         f"time they add, most first; {fmt_num(d['added_us'])} µs added in all):", "",
                         md_table(["kernel", "calls (decode)", "µs (decode)", "calls", "µs", "µs added"],
                                  [[f"`{r['kernel'][:90]}`", fmt_num(r["base_calls"]), fmt_num(r["base_us"]),
                                    fmt_num(r["calls"]), fmt_num(r["us"]), fmt_num(r["us"] - r["base_us"])]
                                   for r in d["rows"]]), ""]
    slow = "; ".join(f"step {r['step']}: {fmt_num(r['ms'])} ms ({r['tokens']} tokens"
                     + (", a prefill" if r.get("prefill") else "") + (f", {r['captured']} graph(s) captured"
                                                                      if r.get("captured") else "") + ")"
                     for r in e["slowest_steps"])
    parts = []
    if e.get("host_parts"):
        rows = e["host_parts"]
        waits = sum(r["us_per_step"] for r in rows if r["name"] == DEVICE_WAIT)
        busy = sum(r["us_per_step"] for r in rows) - 2 * waits  # the waits are inside the parts
        parts = [f"Parts of a step in the timed run (host time, no profiler; `{DEVICE_WAIT}` is the host "
                 f"waiting for the device's tokens, inside its part): the host works {fmt_num(busy)} µs a step "
                 f"and waits {fmt_num(waits)}.", "",
                 md_table(["part", "calls a step", "µs a step"],
                          [[f"`{r['name']}`", fmt_num(r["calls_per_step"]), fmt_num(r["us_per_step"])] for r in rows]),
                 ""]
    return [f"Timed run: its {e['steps']} steps took {fmt_num(e['steps_ms'])} ms of its "
            f"{fmt_num(1e3 * e['wall_s'])} ms wall ({fmt_num(e['outside_steps_ms'])} ms outside steps: "
            f"`generate()`'s own work); {e['graphs_captured']} CUDA graph(s) captured during it. "
            f"Slowest steps: {slow}.", ""] + parts + launches


def render_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [f"# megactx engine profile: {m.get('gpu') or 'CPU'}", "",
             f"{m.get('date', '')}; torch {m.get('torch')}, triton {m.get('triton')}. Model `{results['model']}`; "
             f"{results['workload']} ({results['prompts']}). Per engine step: walls of a timed run, the rest from "
             "a profiled run of the same prompts (kernel times summed, CUDA graph replays included)"
             + ("; each run computes every prompt (no prefix cache)." if results.get("prefix_caching") is False
                else "."), ""]
    if results.get("ceilings"):
        lines += [ceilings_markdown(Ceilings.from_dict(results["ceilings"])), ""]
    summary = []
    for e in results["engines"]:
        device_ms = e["device_us_per_step"] / 1e3
        summary.append([e["gamma"], e["steps"], fmt_num(e["wall_ms_per_step"]), fmt_num(e.get("step_ms_median")),
                        fmt_num(device_ms),
                        f"{device_ms / e['wall_ms_per_step']:.0%}" if e["wall_ms_per_step"] else "–",
                        fmt_num(e["kernels_per_step"]), fmt_num(e["mean_acceptance_length"]),
                        fmt_num(e["output_tokens"] / e["wall_s"])])
    lines += [md_table(["γ", "steps", "wall ms a step", "median step ms", "device ms a step", "device busy",
                        "kernels a step", "acceptance length", "output tokens/s"], summary), ""]
    graphs = [r for e in results["engines"] for r in e.get("graphs_alone", [])]
    for e in results["engines"]:
        lines += [f"## γ = {e['gamma']}", ""] + _timed_lines(e, graphs) + [
                  "Parts of a step (host spans, profiled; a part that waits for the device "
                  "includes the wait" + ("; the profiler slows CUDA graph launches, so the device's idle time "
                                         "under a part that launches one is larger than in the timed run: "
                                         "its launches' own host time is above" if e.get("graph_replays") else "")
                  + "):", "", _phase_table(e),
                  "Kernels, by device time:", "", _table(e["kernels"], "kernel"),
                  "CUDA runtime / driver calls:", "", _table(e["runtime_calls"], "call"),
                  "Host: PyTorch ops by self CPU time:", "", _table(e["host_ops"], "op")]
        if e.get("python_functions"):
            lines += ["Host: functions by own time a step, under cProfile (a further run; cProfile slows Python "
                      "about twofold, so compare the rows with each other):", "",
                      md_table(["function", "calls a step", "own µs a step", "cumulative µs a step"],
                               [[f"`{r['function'][:90]}`", fmt_num(r["calls_per_step"]),
                                 fmt_num(r["own_us_per_step"]), fmt_num(r["cum_us_per_step"])]
                                for r in e["python_functions"]]), ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    engines = results["engines"]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.9 * len(engines)))
    for i, e in enumerate(engines):
        wall = e.get("step_ms_median") or e["wall_ms_per_step"]  # the median step: a run's edges aside
        ax.barh(i + 0.2, wall, height=0.35, color="lightgray", label="wall (median step)" if i == 0 else None)
        left = 0.0
        for j, k in enumerate(e["kernels"]):  # the top kernels, then the rest as one: the device's time
            ms = k["us_per_step"] / 1e3
            rest = k["name"].startswith("other (")
            ax.barh(i - 0.2, ms, left=left, height=0.35, color="darkgray" if rest else plt.cm.tab10(j % 10))
            if ms > 0.1 * max(wall, 1e-9):
                ax.text(left + ms / 2, i - 0.2, "other" if rest else k["name"][:14], ha="center", va="center",
                        fontsize=6)
            left += ms
    ax.set_yticks(range(len(engines)), [f"γ = {e['gamma']}" for e in engines])
    ax.set(xlabel="ms a step (gray: median wall; colours: device time by kernel, most first, then the rest)",
           title=results["workload"][:90])
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def write_reports(results: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_suite_reports("profile", results, Path(out_dir), render_markdown, plot)


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    from megactx.cli import add_hf_overrides_argument

    p.add_argument("--model", default=None, help="checkpoint directory (default: models/megactx-tiny)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when torch sees a GPU")
    p.add_argument("--num-speculative-tokens", type=int_list, default=[0], metavar="G[,G...]",
                   help="γ of each engine profiled, e.g. 0,3 (default 0: no speculation)")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded at once (default 1)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens a request (default 256)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated a request (default 64)")
    p.add_argument("--prefill", type=int, default=None, metavar="L",
                   help="profile the prefill of one prompt of L tokens instead of decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0; 0 = greedy)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's chunk of prefill tokens")
    p.add_argument("--top", type=int, default=15, help="rows of each table (default 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run the engine's steps eagerly (each kernel launched by the host), e.g. to see what a "
                        "graph replay holds")
    p.add_argument("--overlap", action="store_true",
                   help="speculative engines overlap their steps (LLM(async_scheduling=True): a step of KVShare "
                        "drafts launches the next verify before its host sync)")
    p.add_argument("--python-profile", action="store_true",
                   help="one more run per engine under cProfile: the Python functions (and the C calls they "
                        "make) by host time a step, for a step bound by its host")
    p.add_argument("--no-fuse", dest="fuse", action="store_false",
                   help="the engine without its fused GEMMs and routing kernel (LLM(fuse=False)): what they save")
    p.add_argument("--trace", action="store_true", help="also write a Chrome/Perfetto trace per engine into --out")
    p.add_argument("--out", type=Path, default=None, help=f"directory for the reports (default: {RESULTS_DIR})")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="do not measure: write the .md and .png again from a results JSON")
    add_hf_overrides_argument(p)


def run(args: argparse.Namespace) -> int:
    prog = "megactx bench profile"
    if args.from_json is not None:
        return rerender_from_json(prog, args.from_json, args.out, write_reports)
    from megactx.generate import resolve_model

    progress = Progress()
    try:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
        if not args.num_speculative_tokens or min(args.num_speculative_tokens) < 0:
            raise ValueError("--num-speculative-tokens takes γ >= 0, e.g. 0,3")
        if args.prefill is not None and (args.prefill < 1 or any(args.num_speculative_tokens)):
            raise ValueError("--prefill L takes L >= 1 and profiles one engine without speculation (γ = 0)")
        for name in ("batch", "prompt_len", "output_len", "top", "max_num_batched_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        w = Workload(args.batch, args.prompt_len, args.output_len, args.prefill, args.temperature, args.seed)
        path, _ = resolve_model(args.model, progress.log)
        out = args.out or RESULTS_DIR
        out.mkdir(parents=True, exist_ok=True)
        engine_args = {"max_num_batched_tokens": args.max_num_batched_tokens, "hf_overrides": args.hf_overrides,
                       "cuda_graphs": args.cuda_graphs, "fuse": args.fuse}
        results = run_profiles(path, w, args.num_speculative_tokens, device, args.top, out if args.trace else None,
                               engine_args, progress, args.overlap, args.python_profile)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for written in write_reports(results, out):
        print(written)
    return 0
