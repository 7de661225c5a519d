"""`megactx bench chunk`: where the time of the indexer's top-k over one long prefill chunk goes.

A prompt of C tokens prefilled in chunks of R rows (the engine's --max-num-batched-tokens) ends with a
chunk whose rows see C - R + 1 .. C keys. Every full layer's indexer scores and selects over them
with `indexer_topk_chunked`, the engine's call, a buffer of logits at a time: budget / (4 C) rows
(`megactx.model.paged.LOGITS_BUDGET_BYTES`, 1 GiB: 256 rows at 1M keys; 256 MiB until 2026-12-05),
so a 64K-row chunk at 1M is 256 logits launches and 256 selections, for each full layer. This
suite runs that call alone, over a paged FP8 index cache of random keys in shuffled pages, for each
context and logits budget:

- wall: the call, synchronised (median of --reps runs);
- enqueue: from the call to its return, before synchronising: the host's own time where it is the
  shorter (once the launch queue is full the host waits for the device, and enqueue reads as wall);
- device: its kernels' summed time under torch.profiler, by kernel;
- floor: the bytes the device must move (the logits written once and read by the top-k's two
  streaming passes, each logits launch's key pages read once a row block) at the copy bandwidth
  measured in the same run, or the FP8 FLOPs at the FP8 matmul ceiling, whichever is longer.

wall ≈ device: the kernels bound it (the floor says how far they are from the hardware); wall well
above device: the host does (its Python and launches for every buffer of rows). Random keys and
queries give i.i.d.-like rows; a real model's rows can select differently (ties at 0.0, see
megactx.kernels.topk). Defaults: megactx-tiny's indexer (4 heads x 64, top-k 128); GLM-5.2's is
--heads 32 --head-dim 128 --k 2048 (then fewer rows: 16x the FLOPs a query-key pair).

    megactx bench chunk                                  # contexts 128K, 512K and 1M; budgets 256 MiB and 1 GiB
    megactx bench chunk --contexts 1m --budgets 64M,256M,1G
    megactx bench chunk --heads 32 --head-dim 128 --k 2048 --rows 4096

Results: benchmarks/results/chunk-<device>.json, .md, .png (per context: wall, enqueue, device and
floor of each budget), with the GPU's ceilings measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import inputs
from benchmarks.common import (
    Ceilings,
    Progress,
    ceilings_markdown,
    fmt_context,
    fmt_num,
    machine_info,
    md_table,
    measure_machine_ceilings,
    pyplot,
    rerender_from_json,
    save_figure,
    sync_device,
    write_suite_reports,
)
from benchmarks.profile import breakdown
from megactx.analysis.flops import parse_context
from megactx.model.paged import LOGITS_BUDGET_BYTES

HELP = "the indexer's top-k over one long prefill chunk: host, device and floor time by logits budget"
RESULTS_DIR = Path(__file__).parent / "results"
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
TOP_KERNELS = 6


def parse_size(text: str) -> int:
    """'256M' -> 268435456 (K, M, G: binary units; a bare number is bytes)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = SIZE_UNITS.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in SIZE_UNITS else t
    if not number.isdigit() or int(number) < 1:
        raise ValueError(f"a size is a positive number with K, M or G, e.g. 256M or 1G; got {text!r}")
    return int(number) * scale


def parse_contexts(text: str) -> list[int]:
    """'128k,1m' -> [131072, 1048576] (`megactx.analysis.flops.parse_context`), errors naming the flag."""
    try:
        return parse_context(text)
    except ValueError as e:
        raise ValueError(f"--contexts takes token counts like 128k,1m: {e}") from None


def chunk_inputs(context: int, rows: int, heads: int, head_dim: int, device: torch.device,
                 gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The last chunk of `rows` query rows of a causal prefill of `context` tokens, one sequence, over
    a paged FP8 index cache of random keys in shuffled pages: indexer_topk_chunked's arguments."""
    blocks = inputs.num_blocks(context)
    cache = inputs.random_index_cache(blocks + 1, head_dim, gen)  # a spare block nobody owns
    table = inputs.block_table(1, blocks, blocks + 1, gen)
    q = torch.empty(rows, heads, head_dim, dtype=torch.uint8, device=device)
    inputs._random_e4m3_(q, gen)
    key_len = torch.arange(context - rows + 1, context + 1, dtype=torch.int32, device=device)
    return {"q": q.view(torch.float8_e4m3fn), "w": torch.rand(rows, heads, generator=gen, device=device) / heads,
            "index_cache": cache, "block_table": table, "seq_idx": torch.zeros(rows, dtype=torch.int32, device=device),
            "key_len": key_len, "key_len_host": key_len.cpu()}


def floor_figures(context: int, rows: int, heads: int, head_dim: int, chunk_rows: int, device: torch.device,
                  ceilings: dict[str, Any] | None) -> dict[str, Any]:
    """Bytes and FLOPs the call cannot do without, and the time they take at the run's ceilings."""
    from megactx.kernels import indexer
    from megactx.kernels.sparse_mla import num_sms

    pairs = rows * context - rows * (rows - 1) // 2  # (query, key) pairs a causal chunk sees
    logits_bytes = 3 * 4 * pairs  # fp32, written once, read by the top-k's two streaming passes
    key_bytes = 0
    for first in range(0, rows, chunk_rows):  # each logits launch reads its keys once a row block
        n = min(chunk_rows, rows - first)
        keys = context - rows + first + n
        launch = indexer.launch_config(n, heads, head_dim, keys, torch.float8_e4m3fn, num_sms(device),
                                       indexer.has_tma(device), sequences=1)
        key_bytes += -(-n // launch.block_m) * keys * (head_dim + 4)
    flops = 2 * heads * head_dim * pairs
    out: dict[str, Any] = {"pairs": pairs, "bytes": logits_bytes + key_bytes, "key_bytes": key_bytes,
                           "flops": flops, "floor_ms": None}
    if ceilings and ceilings.get("copy") and ceilings.get("fp8_mm"):
        out["bytes_ms"] = 1e3 * out["bytes"] / (ceilings["copy"] * 1e9)
        out["flops_ms"] = 1e3 * flops / (ceilings["fp8_mm"] * 1e12)
        out["floor_ms"] = max(out["bytes_ms"], out["flops_ms"])
    return out


def time_call(call, device: torch.device, reps: int) -> dict[str, float]:
    """Median enqueue and wall milliseconds of `call` over reps runs, after one warm-up run."""
    call()
    sync_device(device)
    enqueue, wall = [], []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        enqueue.append(time.perf_counter() - start)
        sync_device(device)
        wall.append(time.perf_counter() - start)
    return {"enqueue_ms": 1e3 * statistics.median(enqueue), "wall_ms": 1e3 * statistics.median(wall)}


def profile_call(call, device: torch.device) -> dict[str, Any]:
    """One run of `call` under torch.profiler: kernels by device time, runtime calls, host ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        sync_device(device)
    return breakdown(prof.events(), 1, TOP_KERNELS)


def run_chunks(contexts: list[int], budgets: list[int], rows: int, heads: int, head_dim: int, k: int, reps: int,
               device: torch.device, progress: Progress) -> dict[str, Any]:
    from megactx.kernels.indexer import indexer_topk_chunked

    ceilings = measure_machine_ceilings(device)
    results: dict[str, Any] = {"schema": 1, "machine": machine_info(device), "ceilings": ceilings,
                               "settings": {"rows": rows, "heads": heads, "head_dim": head_dim, "k": k,
                                            "reps": reps, "engine_budget": LOGITS_BUDGET_BYTES},
                               "cases": []}
    gen = torch.Generator(device=device).manual_seed(0)
    for context in contexts:
        if rows > context:
            raise ValueError(f"--rows {rows} is more than the context {context}: the chunk is the prompt's last rows")
        a = chunk_inputs(context, rows, heads, head_dim, device, gen)
        for budget in budgets:
            chunk_rows = max(1, budget // (4 * context))  # PagedBatch.indexer_chunk's rule
            call = functools.partial(indexer_topk_chunked, a["q"], a["w"], a["index_cache"], a["block_table"],
                                     a["seq_idx"], a["key_len"], k, chunk_rows, a["key_len_host"])
            times = time_call(call, device, reps)
            prof = profile_call(call, device)
            chunks = -(-rows // chunk_rows)
            case = {"context": context, "budget": budget, "chunk_rows": chunk_rows, "chunks": chunks, **times,
                    "device_ms": prof["device_us_per_step"] / 1e3, "kernels": prof["kernels_per_step"],
                    "top_kernels": prof["kernels"], "runtime_calls": prof["runtime_calls"],
                    **floor_figures(context, rows, heads, head_dim, chunk_rows, device, ceilings)}
            results["cases"].append(case)
            progress.log(f"{fmt_context(context)} keys, budget {_budget(budget)} ({chunk_rows} rows x {chunks}): "
                         f"wall {fmt_num(case['wall_ms'])} ms, enqueue {fmt_num(case['enqueue_ms'])}, device "
                         f"{fmt_num(case['device_ms'])}, floor {fmt_num(case['floor_ms'])}")
        del a, call
    return results


# ------------------------------------------------------------------------------ reports
def _budget(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and n % (1 << 30) == 0 else \
        f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def render_markdown(results: dict[str, Any]) -> str:
    m, s = results["machine"], results["settings"]
    lines = [f"# megactx bench chunk: {m.get('gpu') or 'CPU'}", "",
             f"{m.get('date', '')}; torch {m.get('torch')}, triton {m.get('triton')}. `indexer_topk_chunked` over "
             f"the last {s['rows']:,}-row chunk of a causal prefill (one sequence, a paged FP8 index cache of random "
             f"keys), {s['heads']} heads x {s['head_dim']}, top-k {s['k']}; the engine's logits budget is "
             f"{_budget(s['engine_budget'])}. Wall and enqueue: the median of {s['reps']} run(s); device: the "
             "kernels of a profiled run, summed; floor: bytes at the copy bandwidth or FLOPs at the FP8 ceiling.", ""]
    if results.get("ceilings"):
        lines += [ceilings_markdown(Ceilings.from_dict(results["ceilings"])), ""]
    rows = []
    for c in results["cases"]:
        per = 1e3 / c["chunks"]  # ms -> µs a buffer of rows
        rows.append([fmt_context(c["context"]), _budget(c["budget"]), c["chunk_rows"], c["chunks"],
                     fmt_num(c["wall_ms"]), fmt_num(c["enqueue_ms"]), fmt_num(c["device_ms"]),
                     f"{c['device_ms'] / c['wall_ms']:.0%}" if c["wall_ms"] else "–", fmt_num(c["floor_ms"]),
                     fmt_num(c["wall_ms"] / c["floor_ms"]) if c.get("floor_ms") else "–",
                     fmt_num(c["wall_ms"] * per), fmt_num(c["device_ms"] * per), fmt_num(c["kernels"] / c["chunks"])])
    lines += [md_table(["keys", "budget", "rows a buffer", "buffers", "wall ms", "enqueue ms", "device ms",
                        "device busy", "floor ms", "wall / floor", "wall µs a buffer", "device µs a buffer",
                        "kernels a buffer"], rows), ""]
    for c in results["cases"]:
        kernels = [[f"`{r['name'][:80]}`", fmt_num(r["calls_per_step"]), fmt_num(r["us_per_step"] / 1e3)]
                   for r in c["top_kernels"]]
        lines += [f"## {fmt_context(c['context'])} keys, {_budget(c['budget'])}", "",
                  md_table(["kernel", "calls", "ms"], kernels) if kernels else "(no device kernels: a CPU run)", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    contexts = sorted({c["context"] for c in results["cases"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        cases = [c for c in results["cases"] if c["context"] == context]
        x = range(len(cases))
        for i, (key, label) in enumerate((("wall_ms", "wall"), ("enqueue_ms", "enqueue (host)"),
                                          ("device_ms", "device (kernels)"), ("floor_ms", "floor"))):
            ax.bar([j + (i - 1.5) * 0.2 for j in x], [c.get(key) or 0 for c in cases], width=0.2, label=label)
        ax.set_xticks(list(x), [_budget(c["budget"]) for c in cases])
        ax.set_xlabel("logits budget")
        ax.set_ylabel("ms a chunk")
        ax.set_title(f"{fmt_context(context)} keys")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    s = results["settings"]
    device = results["machine"].get("gpu") or "CPU"
    fig.suptitle(f"indexer top-k over the last {s['rows']:,}-row prefill chunk: {device}")
    save_figure(fig, path)
    return True


def write_reports(results: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_suite_reports("chunk", results, out_dir, render_markdown, plot)


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=parse_contexts, default=parse_contexts("128k,512k,1m"),
                   help="keys the chunk's last row sees, e.g. 512k,1m (default 128k,512k,1m)")
    p.add_argument("--budgets", type=lambda t: [parse_size(x) for x in t.split(",")],
                   default=[256 << 20, 1 << 30],
                   help="logits buffer sizes, e.g. 64M,256M,1G (default: 256M, and 1G, the engine's since 2026-12-05)")
    p.add_argument("--rows", type=int, default=65536, help="query rows of the chunk (default 65536)")
    p.add_argument("--heads", type=int, default=4, help="indexer heads (default 4, megactx-tiny's)")
    p.add_argument("--head-dim", type=int, default=64, help="indexer head dim (default 64, megactx-tiny's)")
    p.add_argument("--k", type=int, default=128, help="top-k (default 128, megactx-tiny's)")
    p.add_argument("--reps", type=int, default=3, help="timed runs a case (default 3)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when torch sees a GPU (cpu runs the kernels under TRITON_INTERPRET=1: "
                        "small shapes only)")
    p.add_argument("--out", type=Path, default=None, help=f"directory for the reports (default: {RESULTS_DIR})")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="do not measure: write the .md and .png again from a results JSON")


def run(args: argparse.Namespace) -> int:
    prog = "megactx bench chunk"
    if args.from_json is not None:
        return rerender_from_json(prog, args.from_json, args.out, write_reports)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU")
        from megactx.kernels.common import INTERPRET

        if device.type == "cpu" and not INTERPRET:
            raise ValueError("on a CPU the Triton kernels run only under the interpreter: set TRITON_INTERPRET=1 "
                             "(and keep the shapes small), or run on a GPU")
        for name in ("rows", "heads", "head_dim", "k", "reps"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        out = args.out or RESULTS_DIR
        out.mkdir(parents=True, exist_ok=True)
        results = run_chunks(args.contexts, args.budgets, args.rows, args.heads, args.head_dim, args.k, args.reps,
                             device, Progress())
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for written in write_reports(results, out):
        print(written)
    return 0
