"""Tune the FP8 lightning-indexer logits kernel (`megactx.kernels.indexer.indexer_logits`) on a GPU.

Times candidate launch configurations (tile shape, TMA or gathered key pages, pipeline depth,
register cap, key splits) at GLM-5.2 (32 indexer heads) and DeepSeek-V3.2 (64 heads) geometry,
DI = 128, FP8 cache, for:

- prefill: a causal prefill in 4096-row chunks, each chunk over all the keys its rows see (as the
  engine runs it): the whole 8K and 32K prefills, and the last chunk of a 128K one;
- decode: 64 rows, one per sequence, each over its own L keys (32K, 128K, 1M) in shuffled pages;

and, once, the default config's logits + Triton top-k (k = 2048) of the last 4096-row chunk of a
64K prefill with 64 heads, against DeepGEMM's published ~300 TFLOP/s effective (logits + torch.topk,
FACTS.md).

Before timing, every candidate is checked against the pure-PyTorch twin (reference.indexer_logits)
on a small mixed case: a causal chunk, speculative-verify rows, lone decode rows and a row with no
key, interleaved, with random per-key scales (max error 2e-3 of the row's max logit, the tests'
bound for FP8 tensor-core accumulation). A candidate the compiler refuses is reported and skipped.

Each line: ms (triton.testing.do_bench, L2 flushed between runs), TFLOP/s = 2 x HI x DI x visible
(query, key) pairs / time, % of the FP8 matmul ceiling measured in the same run (torch._scaled_mm,
8192^3 e4m3, per-tensor scales), and for decode GB/s = (132 B key page bytes + 4 B fp32 logit) a
(row, key) / time, % of the device copy bandwidth (1 GiB, read + write). After each candidate's
first run it prints what the compiler made of it: registers a thread, spilled bytes, shared memory
and the key-page buffers of the software pipeline (if those read 1, the loop was not pipelined).
The best configuration per case closes each table. Targets (issue 3): prefill logits >= 50% of
the FP8 ceiling at >= 32K; decode >= 70% of copy bandwidth.

Usage (CUDA; about 4 minutes on an H200, much of it compilation):

    python benchmarks/tune_indexer.py [--budget-s 230] [--quick] [--out benchmarks/results]
    python benchmarks/tune_indexer.py --static    # any machine: sm_90 registers / spills / shared / pipeline
    python benchmarks/tune_indexer.py --heads 4 --head-dim 64   # megactx-tiny's indexer
    python benchmarks/tune_indexer.py --heads 4 --head-dim 64 --only "a program a row" "lone stages"  # some

Writes tune_indexer.json and tune_indexer.md into --out. The winners belong in the defaults of
`megactx.kernels.indexer` (FP8_COLUMNS, STAGES, LONE_STAGES, FP8_MAX_REGISTERS, PROGRAMS_PER_SM).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import inputs  # noqa: E402
from benchmarks.common import cubin_resource_usage  # noqa: E402
from megactx.kernels import indexer, reference  # noqa: E402
from megactx.kernels.topk import topk_rows  # noqa: E402
from megactx.model.quant import FP8  # noqa: E402

DI = 128
HEADS = (32, 64)  # GLM-5.2, DeepSeek-V3.2
CHUNK = 4096  # prefill query rows a launch
PREFILL = {8 << 10: "whole", 32 << 10: "whole", 128 << 10: "last chunk"}
DECODE_BATCH, DECODE = 64, (32 << 10, 128 << 10, 1 << 20)
TOPK, TOPK_CONTEXT = 2048, 64 << 10
KEY_BYTES = DI + 4  # e4m3 key + fp32 scale, a token
CHECK_TOL = 2e-3  # of a row's max logit (tests/test_kernel_indexer.py)
CHECK_LENS, CHECK_PREFILL_ROWS = (3000, 1500, 700, 64, 1), 200  # sequences of the check; causal rows of the first
DEEPGEMM_TFLOPS = 300  # logits + torch.topk, 64 heads, 64K (shared/reference/FACTS.md)
GiB = 1 << 30
DEVICE = torch.device("cuda")


@dataclass(frozen=True)
class Candidate:
    """A launch to time: `knobs` are indexer_logits keywords (the rest default); decode_only: its
    knobs only matter to lone rows (decode), so prefill is not timed."""

    name: str
    knobs: dict = field(default_factory=dict)
    decode_only: bool = False


def candidates(HI: int, quick: bool, only: list[str] | None = None) -> list[Candidate]:
    """The default, then one knob at a time around it (max_registers=255: no cap, the compiler's
    choice; 128: four programs an SM, with some spills). only: the default and the candidates whose
    name contains one of these strings."""
    out = [Candidate("default")]
    if quick:
        return out
    wide = 256 // HI  # rows of a 256-column program
    if HI < 16:  # few heads (megactx-tiny): the default's 128 rows x 64 keys of fp32 spill at the cap
        out += [Candidate(f"64 cols (bm {64 // HI})", {"block_m": 64 // HI}),
                Candidate(f"64 cols (bm {64 // HI}), regs 255", {"block_m": 64 // HI, "max_registers": 255})]
    out += [
        Candidate("regs 255", {"max_registers": 255}),
        Candidate("regs 128", {"max_registers": 128}),
        Candidate("stages 3", {"num_stages": 3}),
        Candidate("stages 8", {"num_stages": 8}),
        Candidate(f"256 cols (bm {wide}, 2 dots)", {"block_m": wide, "num_dots": 2, "max_registers": 255}),
        Candidate("gather bn 64", {"tma": False}),
        Candidate("gather bn 128", {"tma": False, "block_n": 128, "max_registers": 255}),
        Candidate("lone stages 4", {"lone_stages": 4}, decode_only=True),
        Candidate("lone stages 12", {"lone_stages": 12}, decode_only=True),
        Candidate("bm 1 (a program a row)", {"block_m": 1}, decode_only=True),
        # at 4 heads (2026-12-05, H200, 64 rows) bm 1 read 64 x 1M at 92% of copy (default 81%), 12 lone
        # stages 64 x 32K at 47% (default 26%), each slower at the other end: both together
        Candidate("a program a row, lone stages 12", {"block_m": 1, "lone_stages": 12}, decode_only=True),
    ]
    if HI == 64:  # fewer variants: DeepSeek geometry is the second priority
        keep = {"default", "regs 255", f"256 cols (bm {wide}, 2 dots)", "gather bn 64", "bm 1 (a program a row)"}
        out = [c for c in out if c.name in keep]
    if only:
        out = [c for c in out if c.name == "default" or any(part in c.name for part in only)]
    return out


@dataclass
class Row:
    case: str
    HI: int
    config: str
    ms: float | None = None
    tflops: float | None = None
    pct_fp8: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    note: str = ""


# ------------------------------------------------------------------------------------- inputs
def random_cache(blocks: int, gen: torch.Generator) -> torch.Tensor:
    """FP8 indexer cache with random e4m3 keys and random positive per-key scales (a kernel that
    takes another key's scale is caught by the check)."""
    cache = inputs.random_index_cache(blocks, DI, gen)
    scales = cache[:, reference.BLOCK_SIZE * DI:].view(torch.float32)
    scales.uniform_(0.5, 2.0, generator=gen).div_(448.0)
    return cache


def random_queries(T: int, HI: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(T, HI, DI, generator=gen, device=DEVICE).mul_(64).to(FP8)  # signed: ReLU clips half
    w = torch.randn(T, HI, generator=gen, device=DEVICE) * (HI * DI) ** -0.5 / 448
    return q, w


@dataclass
class Work:
    """One timed case: run() does the work, flops / bytes_ count it; variant: what the candidate's
    name leaves out (a key-split count)."""

    name: str
    run: object
    flops: float
    bytes_: float | None = None
    variant: str = ""


def tokens(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def prefill_work(L: int, HI: int, gen: torch.Generator, knobs: dict, q, w, cache, table) -> Work:
    """Causal prefill of one L-token sequence in CHUNK-row launches: all of them, or the last."""
    starts = range(0, L, CHUNK) if PREFILL[L] == "whole" else [L - CHUNK]
    chunks = [(s, min(s + CHUNK, L)) for s in starts]
    seq = torch.zeros(CHUNK, dtype=torch.int32, device=DEVICE)
    key_len = torch.arange(1, L + 1, dtype=torch.int32, device=DEVICE)

    def run() -> None:
        for s, e in chunks:
            indexer.indexer_logits(q[: e - s], w[: e - s], cache, table, seq[: e - s], key_len[s:e], e, **knobs)

    pairs = sum((e * (e + 1) - s * (s + 1)) // 2 for s, e in chunks)
    return Work(f"prefill {tokens(L)} ({PREFILL[L]})", run, 2.0 * HI * DI * pairs)


def decode_work(L: int, HI: int, knobs: dict, q, w, cache, table) -> Work:
    seq = torch.arange(DECODE_BATCH, dtype=torch.int32, device=DEVICE)
    key_len = torch.full((DECODE_BATCH,), L, dtype=torch.int32, device=DEVICE)

    def run() -> None:
        indexer.indexer_logits(q, w, cache, table, seq, key_len, L, **knobs)

    keys = DECODE_BATCH * L
    return Work(f"decode {DECODE_BATCH} x {tokens(L)}", run, 2.0 * HI * DI * keys, float(keys * (KEY_BYTES + 4)))


# ------------------------------------------------------------------------------------- check
def check(HI: int, knobs: dict, gen: torch.Generator) -> str:
    """'ok' or what is wrong, against the twin on a small mixed batch (see the module docstring)."""
    lens = CHECK_LENS
    blocks = [-(-n // reference.BLOCK_SIZE) for n in lens]
    cache = random_cache(sum(blocks) + 2, gen)
    table = inputs.block_table(len(lens), max(blocks), sum(blocks) + 2, gen)
    seq, klen = [], []
    seq += [0] * CHECK_PREFILL_ROWS  # the last rows of a causal prefill of sequence 0
    klen += list(range(lens[0] - CHECK_PREFILL_ROWS + 1, lens[0] + 1))
    for b, n in ((1, 4), (2, 1), (3, 1), (4, 1)):  # verify rows, lone decode rows
        seq += [b] * n
        klen += list(range(lens[b] - n + 1, lens[b] + 1))
    seq.append(2)
    klen.append(0)  # a row that sees no key
    order = torch.randperm(len(seq), generator=gen, device=DEVICE)
    order[: len(order) // 2] = order[: len(order) // 2].sort().values  # half in order (groups), half shuffled
    seq = torch.tensor(seq, dtype=torch.int32, device=DEVICE)[order]
    klen = torch.tensor(klen, dtype=torch.int32, device=DEVICE)[order]
    q, w = random_queries(len(seq), HI, gen)
    max_keys = lens[0] + 37  # past every row: the tail must be -inf
    got = indexer.indexer_logits(q, w, cache, table, seq, klen, max_keys, **knobs)
    want = reference.indexer_logits(q, w, cache, table, seq, klen, max_keys)
    visible = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), visible) or not (got[~visible] == float("-inf")).all():
        return "WRONG mask"
    row_max = want.masked_fill(~visible, 0).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((got - want).abs() / row_max)[visible].max().item()
    return "ok" if err < CHECK_TOL else f"WRONG (error {err:.1e} of the row max)"


# ------------------------------------------------------------------------------------- compiled
def compiled_kernels() -> dict[int, object]:
    """The compiled variants of the kernel so far (Triton's JIT cache; internal, so best effort)."""
    found = {}
    for entry in getattr(indexer._indexer_logits_kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            found.update({id(k): k for k in cache.values()})
    return found


def describe_compiled(kernel) -> str:
    """Registers a thread, spills, shared memory and key-page pipeline buffers of a compiled kernel."""
    try:
        ttgir = kernel.asm.get("ttgir", "")
        pages = [int(n) for n in re.findall(rf"memdesc<(\d+)x\d+x{DI}xf8E4M3FN", ttgir)]
        return (f"{kernel.n_regs} regs, {kernel.n_spills} spills, {kernel.metadata.shared / 1024:.0f} KiB shared, "
                f"page buffers {sorted(set(pages)) or '?'}")
    except Exception as e:  # the JIT's internals differ between Triton versions
        return f"(compiled kernel not readable: {type(e).__name__})"


# ------------------------------------------------------------------------------------- timing
def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40)


def fp8_ceiling_tflops() -> float:
    """torch._scaled_mm of 8192^3 e4m3 (per-tensor scales, bf16 out), 2 n^3 FLOPs."""
    n = 8192
    a = torch.randn(n, n, device=DEVICE).to(FP8)
    b = torch.randn(n, n, device=DEVICE).to(FP8)
    one = torch.ones((), device=DEVICE)
    # _scaled_mm wants the second operand column-major: the transpose of a row-major matrix
    ms = time_ms(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
    return 2 * n**3 / ms / 1e9


def copy_gbps() -> float:
    src = torch.empty(GiB, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * GiB / time_ms(lambda: dst.copy_(src)) / 1e6


def timed(work: Work, HI: int, config: str, ceiling: float, copy: float) -> Row:
    ms = time_ms(work.run)
    tflops = work.flops / ms / 1e9
    row = Row(work.name, HI, config + work.variant, ms, tflops, 100 * tflops / ceiling)
    if work.bytes_:
        row.gbps = work.bytes_ / ms / 1e6
        row.pct_copy = 100 * row.gbps / copy
    return row


def device_name() -> str:
    return torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else str(DEVICE)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], header: bool = True) -> None:
    if header:
        print(f"{'case':30s} {'HI':>3s} {'config':40s} {'ms':>9s} {'TFLOP/s':>8s} {'%fp8':>5s} {'GB/s':>6s} "
              f"{'%copy':>5s}")
    for r in rows:
        print(f"{r.case:30s} {r.HI:3d} {r.config:40s} {fmt(r.ms, '9.3f')} {fmt(r.tflops, '8.0f')} "
              f"{fmt(r.pct_fp8, '5.1f')} {fmt(r.gbps, '6.0f')} {fmt(r.pct_copy, '5.1f')} {r.note}", flush=True)


def best_rows(rows: list[Row]) -> list[Row]:
    best: dict[tuple[str, int], Row] = {}
    for r in rows:
        if r.ms is not None and ((r.case, r.HI) not in best or r.ms < best[r.case, r.HI].ms):
            best[r.case, r.HI] = r
    return list(best.values())


# ------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> list[Row]:
    start = time.time()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ceiling, copy = fp8_ceiling_tflops(), copy_gbps()
    sms = indexer.num_sms(DEVICE)
    print(f"{device_name()}, torch {torch.__version__}, triton {triton.__version__}, {sms} SMs: "
          f"FP8 matmul {ceiling:.0f} TFLOP/s, copy {copy:.0f} GB/s")
    rows: list[Row] = []
    # Inputs once: a prefill cache per context (one sequence) and a decode pool per context (every
    # sequence its own pages, so the bytes read are the bytes counted).
    prefill_inputs = {}
    for L in PREFILL:
        blocks = inputs.num_blocks(L)
        prefill_inputs[L] = (random_cache(blocks, gen), inputs.block_table(1, blocks, blocks, gen))
    decode_inputs = {}
    for L in DECODE:
        blocks = inputs.num_blocks(L)
        pool = DECODE_BATCH * blocks
        decode_inputs[L] = (random_cache(pool, gen), inputs.block_table(DECODE_BATCH, blocks, pool, gen))
    print(f"inputs ready ({time.time() - start:.0f} s)", flush=True)

    for HI in HEADS:
        q_pre, w_pre = random_queries(CHUNK, HI, gen)
        q_dec, w_dec = random_queries(DECODE_BATCH, HI, gen)
        for cand in candidates(HI, args.quick, args.only):
            if time.time() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: skipping HI={HI} {cand.name} and the rest")
                break
            before = compiled_kernels()
            try:
                verdict = check(HI, cand.knobs, gen)
            except Exception as e:  # the compiler or the device refuses it: report, go on
                print(f"HI={HI} {cand.name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
                rows.append(Row("check", HI, cand.name, note=f"failed: {type(e).__name__}"))
                continue
            new = [k for i, k in compiled_kernels().items() if i not in before]
            print(f"\nHI={HI} {cand.name} {cand.knobs}: check {verdict}; "
                  f"{'; '.join(describe_compiled(k) for k in new) or 'compiled kernel not found'}", flush=True)
            works = [] if cand.decode_only else [prefill_work(L, HI, gen, cand.knobs, q_pre, w_pre, *prefill_inputs[L])
                                                 for L in PREFILL]
            works += [decode_work(L, HI, cand.knobs, q_dec, w_dec, *decode_inputs[L]) for L in DECODE]
            if cand.name == "default" and not args.quick:  # decode key splits around the wave model's choice
                for L in DECODE:
                    s = indexer.launch_config(DECODE_BATCH, HI, DI, L, FP8, sms, indexer.has_tma(DEVICE)).num_splits
                    for splits in (max(1, s // 2), 2 * s):
                        work = decode_work(L, HI, {"num_splits": splits}, q_dec, w_dec, *decode_inputs[L])
                        work.variant = f", {splits} splits (not {s})"
                        works.append(work)
            for i, work in enumerate(works):
                row = timed(work, HI, cand.name, ceiling, copy)
                row.note = "" if verdict == "ok" else verdict
                rows.append(row)
                print_table([row], header=i == 0)
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
        print(f"({time.time() - start:.0f} s so far)", flush=True)

    rows += logits_then_topk(gen, ceiling)
    print("\n== best per case")
    print_table(best_rows(rows))
    return rows


def logits_then_topk(gen: torch.Generator, ceiling: float) -> list[Row]:
    """Default logits, then + Triton top-k, of the last CHUNK rows of a 64K prefill at 64 heads."""
    HI, L = 64, TOPK_CONTEXT
    blocks = inputs.num_blocks(L)
    cache, table = random_cache(blocks, gen), inputs.block_table(1, blocks, blocks, gen)
    q, w = random_queries(CHUNK, HI, gen)
    seq = torch.zeros(CHUNK, dtype=torch.int32, device=DEVICE)
    key_len = torch.arange(L - CHUNK + 1, L + 1, dtype=torch.int32, device=DEVICE)
    out = torch.empty(CHUNK, TOPK, dtype=torch.int32, device=DEVICE)
    pairs = (L * (L + 1) - (L - CHUNK) * (L - CHUNK + 1)) // 2
    flops = 2.0 * HI * DI * pairs
    rows = []
    def logits() -> torch.Tensor:
        return indexer.indexer_logits(q, w, cache, table, seq, key_len, L)

    for name, fn in (("logits", logits), ("+ top-k", lambda: topk_rows(logits(), TOPK, key_len, out))):
        ms = time_ms(fn)
        tflops = flops / ms / 1e9
        rows.append(Row(f"{tokens(L)} last chunk, {name}", HI, "default", ms, tflops, 100 * tflops / ceiling,
                        note=f"DeepGEMM + torch.topk ~{DEEPGEMM_TFLOPS} TFLOP/s effective" if "top-k" in name else ""))
    print("\n== logits + top-k (k = 2048), 64 heads")
    print_table(rows)
    return rows


def write(rows: list[Row], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_indexer.json").write_text(json.dumps(
        {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "rows": [asdict(r) for r in rows]}, indent=1))
    lines = ["# tune_indexer", "", f"{device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}", "",
             "| case | HI | config | ms | TFLOP/s | % FP8 mm | GB/s | % copy | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.case} | {r.HI} | {r.config} | {fmt(r.ms, '.3f')} | {fmt(r.tflops, '.0f')} "
              f"| {fmt(r.pct_fp8, '.1f')} | {fmt(r.gbps, '.0f')} | {fmt(r.pct_copy, '.1f')} | {r.note} |" for r in rows]
    (out / "tune_indexer.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'tune_indexer.json'} and .md")


# ------------------------------------------------------------------------------------- static
def static_profile(HI: int, knobs: dict) -> str:
    """What the compiled sm_90 kernel of a candidate needs, without a GPU: registers a thread, spill
    stack, shared memory and key-page buffers. Uses Triton's internal compile API
    (triton.compiler.ASTSource), so it may need adjusting on other Triton versions."""

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = indexer.launch_config(CHUNK, HI, DI, 1 << 17, FP8, 132, True, **knobs)
    constants = indexer.kernel_constants(launch, HI, DI, FP8)
    fn = indexer._indexer_logits_kernel
    pointers = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "bt_ptr": "*i32",
                "seq_ptr": "*i32", "klen_ptr": "*i32", "out_ptr": "*fp32"}
    if launch.tma:
        pointers["k_desc"] = f"tensordesc<fp8e4nv[1, {reference.BLOCK_SIZE}, {DI}]>"
    else:
        constants["k_desc"] = None
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if (name in pointers and name != "k_desc") or name.startswith("stride"):  # 16-byte aligned, as at GLM geometry
            attrs[(i,)] = [["tt.divisibility", 16]]
        signature[name] = pointers.get(name) or ("constexpr" if name in constants else "i32")
    options = {"num_warps": launch.num_warps}
    if launch.max_registers:
        options["maxnreg"] = launch.max_registers
    compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    fields = cubin_resource_usage(compiled)
    usage = f"{fields.get('REG', '?')} registers, {fields.get('STACK', '?')} B spill stack, " if fields else ""
    pages = [int(n) for n in re.findall(rf"memdesc<(\d+)x\d+x{DI}xf8E4M3FN", compiled.asm["ttgir"])]
    return f"{usage}{compiled.metadata.shared / 1024:.0f} KiB shared, page buffers {sorted(set(pages))}"


def main(argv: list[str] | None = None) -> int:
    global HEADS, DI, KEY_BYTES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="folder for tune_indexer.json and .md (default benchmarks/results)")
    parser.add_argument("--budget-s", type=float, default=230.0,
                        help="wall-clock seconds after which the remaining candidates are skipped (default 230)")
    parser.add_argument("--quick", action="store_true", help="the default config only")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="the default and the candidates whose name contains one of these, e.g. "
                             '--only "a program a row" "lone stages"')
    parser.add_argument("--heads", type=int, nargs="+", default=list(HEADS),
                        help=f"indexer heads (default {' '.join(map(str, HEADS))}; megactx-tiny: 4)")
    parser.add_argument("--head-dim", type=int, default=DI, help=f"indexer head dim (default {DI}; megactx-tiny: 64)")
    parser.add_argument("--static", action="store_true",
                        help="no GPU needed: compile every candidate for sm_90 and print registers, spills, shared "
                             "memory and pipeline buffers")
    args = parser.parse_args(argv)
    HEADS, DI = tuple(args.heads), args.head_dim
    KEY_BYTES = DI + 4
    if args.static:
        for HI in HEADS:
            for cand in candidates(HI, args.quick, args.only):
                try:
                    print(f"HI={HI} {cand.name:28s} {static_profile(HI, cand.knobs)}", flush=True)
                except Exception as e:  # report and go on: one candidate the compiler refuses
                    print(f"HI={HI} {cand.name:28s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return 0
    if not torch.cuda.is_available():
        print("tune_indexer.py times CUDA kernels: no CUDA device here (try --static)", file=sys.stderr)
        return 2
    write(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
