"""Tune the sparse MLA kernels (`megactx.kernels.sparse_mla`) on a GPU.

Times every candidate kernel ("triton", the portable one, "sm90", the hand-pipelined Hopper one, and
"sm90ws", its warp-specialized variant) with its tiling / pipeline depth, and for decode every
split-K count, at GLM-5.2 attention
geometry (H = 64 heads, r = 512 latent + 64 rope, top-k 2048, a paged cache of 1M
tokens), for:

- prefill: T = 4096 query tokens of one sequence at the end of a 1M-token context;
- decode: T = 64 tokens (one for each of 64 sequences of 16K tokens each);
- verify: T = 256 tokens (4 speculative tokens for each of the 64 sequences);

each with a bf16 and an FP8 cache, and with two shapes of top-k rows:

- `local`: a token keeps SHARE (70%) of the previous token's slots (of its own sequence) and draws
  the rest afresh from its causal window, as a real indexer's neighbouring rows overlap;
- `uniform`: every row drawn independently from its causal window;
- `local-sorted` (prefill, the best configuration only): `local` with each row's slots in
  ascending order, to show what an indexer that emits sorted slots would buy;
- `bf16-partials` (decode and verify, the best split launch only): its split-K partial outputs in
  bf16 (`sparse_mla(split_dtype=torch.bfloat16)`) instead of fp32.

Before timing, every candidate is checked against the pure-PyTorch twin on a small case (the
tests' error rule: max error at most 2x that of PyTorch at bf16, plus 1e-5). Peers in the same run:
a 1 GiB device copy (the bandwidth ceiling the table compares with), `torch.index_select` of the
same rows (what gathering them alone costs) and, for decode, the plain-PyTorch twin.

FLOPs are counted as 2·T·H·K·(576 + 512) and bytes as T·K·row (1152 B bf16, 656 B FP8), whether
or not a row was already in L2; `triton.testing.do_bench` flushes L2 before every run.

Usage (CUDA; about 3-4 minutes on an H200 before the "sm90ws" candidates came, much of it
compilation; timings past --budget-s are skipped and marked so):

    python -m benchmarks.tune_sparse_mla [--out benchmarks/results] [--budget-s 300]
    python -m benchmarks.tune_sparse_mla --static   # any machine: shared memory / registers / spills

Prints one table a case, the best configuration of each case and, per case, the best "triton"
against the best "sm90" and "sm90ws" launches, and writes `tune_sparse_mla.json` and
`tune_sparse_mla.md` into --out. The winners belong in `megactx.kernels.sparse_mla._launch_config`
(and `choose_num_splits`); the fastest Hopper kernel in `HOPPER_DEFAULT_KERNEL` there (`WS_FP8`:
whether FP8 follows "sm90ws").
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import cubin_resource_usage
from megactx.kernels import reference
from megactx.kernels.sparse_mla import (
    HOPPER_KERNELS,
    SM90_BLOCK_H,
    SM90_WARPS,
    _launch_config,
    choose_num_splits,
    hopper_kernel,
    num_sms,
    sparse_mla,
)

# GLM-5.2 attention geometry
HEADS, RANK, ROPE, TOPK = 64, 512, 64, 2048
CACHE_TOKENS = 1 << 20
SHARE = 0.7  # of a token's slots that the next token of its sequence keeps (`local` rows)
PREFILL_TOKENS, DECODE_SEQS, VERIFY_TOKENS = 4096, 64, 4
COPY_BYTES = 1 << 30

# (kernel, block_h, block_n, num_stages, num_warps), the same for both caches. "triton": rows requested
# (num_stages - 1) // 2 tiles ahead by Triton's pipeliner; its 32- and 16-row tiles (5-13 stages) and
# 32-head blocks lost to 64 x 64 on the H200 (110-169 TFLOP/s against 216, see `_launch_config`) and
# are no longer timed. "sm90": num_stages shared-memory tile buffers, rows requested num_stages - 1
# tiles ahead (64-row tiles fit 2 buffers at GLM size, 32-row ones 4). "sm90ws": the same tilings,
# side by side with "sm90" (its producer keeps one tile's gather in flight; num_warps: the math warps).
HOPPER_TILINGS = [(64, 2), (32, 4), (32, 3)]  # (block_n, num_stages)
CANDIDATES = [("triton", 64, 64, 2, 8), ("triton", 64, 64, 3, 8)] + [
    (kernel, SM90_BLOCK_H, block_n, stages, SM90_WARPS)
    for block_n, stages in HOPPER_TILINGS for kernel in HOPPER_KERNELS]
SPLITS = (1, 2, 3, 4, 6, 8)  # decode / verify; prefill runs unsplit


@dataclass
class Row:
    """One timed run: `config` is "default" (no overrides), "bn64/s2/w8"-style, or a peer's name;
    `launch` the keyword overrides it passed to sparse_mla; `variant` "" or "sorted" (rows sorted)."""

    case: str
    config: str
    splits: int | None
    ms: float | None
    tflops: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    note: str = ""
    launch: dict | None = None
    variant: str = ""


@dataclass
class Case:
    name: str
    tokens: int
    fp8: bool
    gather: str  # "local" | "uniform"
    seqs: int  # sequences the tokens belong to (consecutive tokens of a sequence are neighbours)
    rows: list[Row] = field(default_factory=list)

    @property
    def decode(self) -> bool:
        return self.seqs > 1

    @property
    def row_bytes(self) -> int:
        return reference.mla_fp8_bytes(RANK, ROPE) if self.fp8 else 2 * (RANK + ROPE)

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * HEADS * TOPK * ((RANK + ROPE) + RANK)

    @property
    def bytes(self) -> float:
        return float(self.tokens * TOPK * self.row_bytes)


def label(kernel: str, block_h: int, block_n: int, num_stages: int, num_warps: int) -> str:
    """"h64/bn64/s3/w8" for "triton" (as in earlier runs), "sm90/bn64/b2" (tile buffers) for "sm90",
    "sm90ws/bn64/b2" for "sm90ws"."""
    if kernel in HOPPER_KERNELS:
        return f"{kernel}/bn{block_n}/b{num_stages}"
    return f"h{block_h}/bn{block_n}/s{num_stages}/w{num_warps}"


def launch_of(kernel: str, block_h: int, block_n: int, num_stages: int, num_warps: int, num_splits: int) -> dict:
    return {"kernel": kernel, "block_h": block_h, "block_n": block_n, "num_stages": num_stages,
            "num_warps": num_warps, "num_splits": num_splits}


# ------------------------------------------------------------------------------------- inputs
def random_cache(tokens: int, fp8: bool, gen: torch.Generator) -> torch.Tensor:
    """A paged MLA cache of `tokens` slots with random rows in its real layout (FP8: finite e4m3
    codes 0..126, positive scales, normal bf16 rope)."""
    blocks = tokens // reference.BLOCK_SIZE
    cache = reference.alloc_kv_cache(blocks, RANK, ROPE, fp8, device=gen.device)
    if not fp8:
        return cache.normal_(generator=gen)
    scales = 4 * (RANK // reference.SCALE_GROUP)
    cache[..., :RANK].random_(0, 0x7F, generator=gen)  # 0x7F is e4m3fn's NaN
    cache[..., RANK : RANK + scales].view(torch.float32).fill_(1.0 / 448)
    cache[..., RANK + scales :].view(torch.bfloat16).normal_(generator=gen)
    return cache


def topk_slots(seqs: int, tokens_per_seq: int, context: int, share: float, gen: torch.Generator) -> torch.Tensor:
    """[seqs · tokens_per_seq, TOPK] int32 physical slots. Sequence s owns `context` tokens in
    shuffled blocks of the cache; its tokens sit at the last positions of that context and each
    sees its causal window. Token i keeps a `share` of token i - 1's positions (each entry
    independently) and draws the others uniformly from its window; share 0 gives independent rows."""
    dev = gen.device
    n = tokens_per_seq
    pos = context - n + torch.arange(n, device=dev)  # [n] positions of a sequence's tokens
    fresh = (torch.rand(seqs, n, TOPK, generator=gen, device=dev) * (pos + 1)[None, :, None]).long()
    renew = torch.rand(seqs, n, TOPK, generator=gen, device=dev) >= share
    renew[:, 0] = True
    # last[s, i, j]: the latest token <= i that renewed entry j; token i holds that token's draw.
    last = torch.where(renew, torch.arange(n, device=dev)[None, :, None], 0).cummax(dim=1).values
    logical = fresh.gather(1, last)  # [seqs, n, TOPK], causal: a draw of token i' <= i is <= pos[i']
    blocks_per_seq = context // reference.BLOCK_SIZE
    table = torch.randperm(seqs * blocks_per_seq, generator=gen, device=dev).view(seqs, 1, blocks_per_seq)
    block = table.expand(-1, n, -1).gather(2, logical // reference.BLOCK_SIZE)
    slots = block * reference.BLOCK_SIZE + logical % reference.BLOCK_SIZE
    return slots.view(seqs * n, TOPK).int()


# ------------------------------------------------------------------------------------- checks
def check_candidate(fp8: bool, kwargs: dict, gen: torch.Generator) -> str:
    """'' if sparse_mla with these overrides matches the twin on a small GLM-shaped case, else why not."""
    T, context = 8, 4096
    cache = random_cache(context, fp8, gen)
    slots = topk_slots(2, T // 2, context // 2, SHARE, gen)
    slots[1, : TOPK // 2] = -1  # a half-empty row
    slots[2] = -1  # an empty row
    q = torch.randn(T, HEADS, RANK + ROPE, generator=gen, device=gen.device).bfloat16()
    scale = (RANK + ROPE) ** -0.5 * 1.5
    try:
        out, lse = sparse_mla(q, cache, slots, scale, RANK, **kwargs)
    except Exception as e:  # out of shared memory on this Triton, a compiler error: report, go on
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    ref_out, ref_lse = reference.sparse_mla(q.float(), cache, slots, scale, RANK)
    # PyTorch at bf16: operands, scores and probabilities rounded (the tests' yardstick)
    valid = slots >= 0
    kv = reference.read_kv(cache, slots.clamp_min(0), RANK).bfloat16()
    s = (torch.einsum("thd,tkd->thk", q, kv) * scale).float().masked_fill(~valid[:, None], float("-inf"))
    pt_lse = torch.logsumexp(s, -1)
    pt_out = torch.einsum("thk,tkr->thr", torch.softmax(s, -1).nan_to_num(0.0).bfloat16(), kv[..., :RANK])
    some = valid.any(-1)
    if not (torch.all(out[~some] == 0) and torch.all(lse[~some] == float("-inf"))):
        return "an empty row did not give out 0, lse -inf"
    err = (out[some].float() - ref_out[some]).abs().max().item()
    pt_err = (pt_out[some].float() - ref_out[some]).abs().max().item()
    lse_err = (lse[some] - ref_lse[some]).abs().max().item()
    pt_lse_err = (pt_lse[some] - ref_lse[some]).abs().max().item()
    if not (err <= 2 * pt_err + 1e-5 and lse_err <= 2 * pt_lse_err + 1e-5):
        return f"error {err:.3g} (PyTorch bf16 {pt_err:.3g}), lse error {lse_err:.3g} ({pt_lse_err:.3g})"
    return ""


# ------------------------------------------------------------------------------------- timing
def bench_ms(fn, graph: bool = False) -> float:
    """Mean ms of fn with triton's do_bench (L2 flushed before each run). graph=True captures fn in a
    CUDA graph first and times its replay, as decode runs in the engine: a ~60 us kernel would
    otherwise be timed with its Python launch overhead."""
    if not graph:
        return do_bench(fn, warmup=10, rep=40)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = do_bench(g.replay, warmup=10, rep=40)
    del g
    return ms


def copy_bandwidth_gbps(device: torch.device) -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9  # read + write


def add_row(case: Case, config: str, splits: int | None, ms: float | None, copy_gbps: float, *, note: str = "",
            launch: dict | None = None, variant: str = "", flops: bool = True, bytes_: float | None = None) -> Row:
    """Record a run; TFLOP/s from the case's FLOPs (unless flops=False), GB/s from its bytes (or bytes_)."""
    row = Row(case.name, config, splits, ms, note=note, launch=launch, variant=variant)
    if ms is not None:
        row.tflops = case.flops / (ms * 1e-3) / 1e12 if flops else None
        row.gbps = (case.bytes if bytes_ is None else bytes_) / (ms * 1e-3) / 1e9
        row.pct_copy = 100 * row.gbps / copy_gbps
    case.rows.append(row)
    return row


def run_case(case: Case, cache: torch.Tensor, copy_gbps: float, failed: dict[str, str], deadline: float,
             gen: torch.Generator) -> None:
    """Time the default launch, every candidate (x every split count for decode) and the peers."""
    tokens_per_seq = case.tokens // case.seqs
    context = CACHE_TOKENS // case.seqs
    slots = topk_slots(case.seqs, tokens_per_seq, context, SHARE if case.gather == "local" else 0.0, gen)
    q = torch.randn(case.tokens, HEADS, RANK + ROPE, generator=gen, device=gen.device).bfloat16()
    scale = (RANK + ROPE) ** -0.5

    def time_launch(slots_: torch.Tensor = slots, **launch) -> float:
        return bench_ms(lambda: sparse_mla(q, cache, slots_, scale, RANK, **launch), graph=case.decode)

    add_row(case, "default", None, time_launch(), copy_gbps, launch={}, note="no overrides: what the model runs")
    for cand in CANDIDATES:
        name = label(*cand)
        if name in failed:
            add_row(case, name, None, None, copy_gbps, note=f"skipped: {failed[name]}")
            continue
        for splits in SPLITS if case.decode else (1,):
            launch = launch_of(*cand, splits)
            if time.perf_counter() > deadline:
                add_row(case, name, splits, None, copy_gbps, note="skipped: past --budget-s", launch=launch)
                continue
            add_row(case, name, splits, time_launch(**launch), copy_gbps, launch=launch)

    best = best_row(case)
    if not case.decode and case.gather == "local" and best is not None and best.launch is not None:
        ms = time_launch(slots.sort(dim=1).values, **best.launch)
        add_row(case, best.config, best.splits, ms, copy_gbps, launch=best.launch, variant="sorted",
                note="local-sorted: each row's slots in ascending order")
    if case.decode and best is not None and best.launch is not None and (best.splits or 0) > 1:
        # the best split launch with bf16 partials: half the scratch the splits write and the combine reads
        ms = time_launch(**best.launch, split_dtype=torch.bfloat16)
        add_row(case, best.config, best.splits, ms, copy_gbps, launch=best.launch, variant="bf16-partials",
                note="the best launch, its partial outputs in bf16 (split_dtype)")

    # Peers: gathering the same rows alone, and (decode) the plain-PyTorch twin.
    flat, index = cache.view(-1, cache.shape[-1]), slots.flatten().long()
    add_row(case, "torch.index_select", None, bench_ms(lambda: torch.index_select(flat, 0, index)), copy_gbps,
            flops=False, bytes_=2 * case.bytes, note="peer: the same rows gathered; GB/s counts read + write")
    if case.decode:
        ms = bench_ms(lambda: reference.sparse_mla(q, cache, slots, scale, RANK))
        add_row(case, "reference.sparse_mla", None, ms, copy_gbps, note="peer: the plain-PyTorch twin")


def best_row(case: Case, kernel: str | None = None) -> Row | None:
    """The fastest sparse_mla launch of a case (rows sorted or not: only as the case draws them), of
    `kernel`'s candidates only when given."""
    timed = [r for r in case.rows if r.ms is not None and r.launch is not None and not r.variant
             and (kernel is None or r.launch.get("kernel") == kernel)]
    return min(timed, key=lambda r: r.ms) if timed else None


def meets_target(case: Case, row: Row) -> str:
    """The issue's targets: prefill >= 350 TFLOP/s (bf16 KV); decode / verify >= 200 TFLOP/s or
    >= 70% of the copy bandwidth."""
    if not case.decode:
        return ("yes" if row.tflops >= 350 else "no") if not case.fp8 else "(none)"
    return "yes" if row.tflops >= 200 or row.pct_copy >= 70 else "no"


# ------------------------------------------------------------------------------------- static
def compile_static(kernel: str, fp8: bool, block_h: int, block_n: int, num_stages: int, num_warps: int,
                   rank: int = RANK, rope: int = ROPE, has_len: bool = False):
    """Compile a candidate for sm_90 without a GPU (ptxas ships with Triton) and return Triton's
    compiled kernel (`.metadata.shared` bytes, `.asm["cubin"]`, ...); has_len: with a topk_len. Uses
    Triton's internal compile API (ASTSource, GluonASTSource), so it may need adjusting on other
    Triton versions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from megactx.kernels import sparse_mla as kernels

    group = reference.SCALE_GROUP
    pointers = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "kv_f32_ptr": "*fp32" if fp8 else "*bf16",
                "kv_bf16_ptr": "*bf16", "slots_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32"}
    constants = {"R": rank, "DR": rope, "BLOCK_H": block_h, "BLOCK_N": block_n, "PAGE": reference.BLOCK_SIZE,
                 "GROUP": group, "FP8": fp8, "HAS_LEN": has_len}
    if kernel in HOPPER_KERNELS:
        fn = kernels._sparse_mla_fwd_sm90 if kernel == "sm90" else kernels._sparse_mla_fwd_sm90ws
        source = GluonASTSource
        constants |= {"NUM_BUF": num_stages, "num_warps": num_warps}
    else:
        fn, source = kernels._sparse_mla_fwd, ASTSource
        constants |= {"BLOCK_R": rank, "BLOCK_DR": rope, "NG": max(1, rank // group), "DOT_F32": False}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers or name.startswith("stride"):  # 16-byte aligned, as at GLM geometry
            attrs[(i,)] = [["tt.divisibility", 16]]
        signature[name] = (pointers.get(name) or ("constexpr" if name in constants else
                           "fp32" if name == "qk_scale" else "i32"))
    return triton.compile(source(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def static_profile(fp8: bool, kernel: str, block_h: int, block_n: int, num_stages: int, num_warps: int) -> str:
    """What the compiled sm_90 kernel of a candidate needs, without a GPU: shared memory, registers
    a thread, and the spill stack (from cuobjdump, which ships with Triton). A warp-specialized
    kernel launches at the registers of its whole CTA and moves them between its partitions with
    setmaxnreg: the math warps lower theirs to one figure (the highest `dec`), the producer raises
    its own to another (the lowest `inc`), both shown."""
    compiled = compile_static(kernel, fp8, block_h, block_n, num_stages, num_warps)
    fields = cubin_resource_usage(compiled)
    usage = f", {fields.get('REG', '?')} registers, {fields.get('STACK', '?')} B spill stack" if fields else ""
    moves = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])
    if moves:
        math = max(int(n) for op, n in moves if op == "dec")
        producer = min(int(n) for op, n in moves if op == "inc")
        usage += f" (setmaxnreg: math warps {math}, producer {producer})"
    return f"{compiled.metadata.shared} B shared{usage}"


# ------------------------------------------------------------------------------------- report
def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(case: Case) -> str:
    lines = ["| config | splits | ms | TFLOP/s | GB/s | % copy | note |", "|---|---|---|---|---|---|---|"]
    for r in case.rows:
        splits = "auto" if r.splits is None and r.config == "default" else fmt(r.splits, "d")
        lines.append(f"| {r.config} | {splits} | {fmt(r.ms, '.4f')} | {fmt(r.tflops, '.1f')} | {fmt(r.gbps, '.0f')} | "
                     f"{fmt(r.pct_copy, '.1f')} | {r.note} |")
    return "\n".join(lines)


def summary(cases: list[Case], copy_gbps: float) -> str:
    lines = [f"Device copy bandwidth (1 GiB, read + write): {copy_gbps:.0f} GB/s", "",
             "| case | default ms | default TFLOP/s | best config | splits | best ms | best TFLOP/s | best % copy "
             "| target met (best) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        d = next(r for r in c.rows if r.config == "default")
        b = best_row(c)
        if b is None or d.ms is None:
            continue
        splits = "auto" if b.config == "default" else fmt(b.splits, "d")
        lines.append(f"| {c.name} | {d.ms:.4f} | {d.tflops:.1f} | {b.config} | {splits} | {b.ms:.4f} | "
                     f"{b.tflops:.1f} | {b.pct_copy:.1f} | {meets_target(c, b)} |")
    return "\n".join(lines)


def kernel_verdict(cases: list[Case]) -> str:
    """The best "triton", "sm90" and "sm90ws" launches of every case, and which Hopper kernel to set."""
    lines = ["| case | best triton | TFLOP/s | best sm90 | TFLOP/s | best sm90ws | TFLOP/s | sm90 / triton | "
             "sm90ws / sm90 |", "|---|---|---|---|---|---|---|---|---|"]
    ws_wins = {False: [0, 0], True: [0, 0]}  # fp8 -> [cases sm90ws won, cases]
    for c in cases:
        t, h, w = best_row(c, "triton"), best_row(c, "sm90"), best_row(c, "sm90ws")
        if h is None or w is None:
            continue
        ws_wins[c.fp8][0] += w.ms < h.ms
        ws_wins[c.fp8][1] += 1
        triton = (f"{t.config} x{t.splits} | {t.tflops:.1f}", f"{t.ms / h.ms:.2f}x") if t else ("- | -", "-")
        lines.append(f"| {c.name} | {triton[0]} | {h.config} x{h.splits} | {h.tflops:.1f} | "
                     f"{w.config} x{w.splits} | {w.tflops:.1f} | {triton[1]} | {h.ms / w.ms:.2f}x |")
    (bf16_won, bf16_cases), (fp8_won, fp8_cases) = ws_wins[False], ws_wins[True]
    if bf16_cases + fp8_cases:
        if bf16_won == bf16_cases and fp8_won == fp8_cases:
            advice = 'set HOPPER_DEFAULT_KERNEL = "sm90ws" (WS_FP8 = True)'
        elif bf16_won == bf16_cases and fp8_won == 0:
            advice = 'set HOPPER_DEFAULT_KERNEL = "sm90ws" and WS_FP8 = False'
        elif bf16_won == fp8_won == 0:
            advice = 'keep HOPPER_DEFAULT_KERNEL = "sm90"'
        else:
            advice = "neither wins every case of a cache type: choose per case (prefill / decode)"
        lines += ["", f"sm90ws faster than sm90 in {bf16_won} of {bf16_cases} bf16 and {fp8_won} of {fp8_cases} "
                      f"FP8 cases: {advice} in megactx/kernels/sparse_mla.py (`_launch_config` gives both 64-row "
                      "tiles and 2 buffers; the table shows each case's best)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="folder for tune_sparse_mla.json and .md (default benchmarks/results)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="wall-clock seconds after which the remaining timings are skipped (default 300)")
    parser.add_argument("--static", action="store_true",
                        help="no GPU needed: compile every candidate for sm_90 and print its shared memory, "
                             "registers and spills")
    args = parser.parse_args(argv)
    if args.static:
        for fp8 in (False, True):
            for cand in CANDIDATES:
                print(f"{'fp8 ' if fp8 else 'bf16'} {label(*cand)}: {static_profile(fp8, *cand)}", flush=True)
        return 0
    if not torch.cuda.is_available():
        print("tune_sparse_mla: needs a CUDA device", file=sys.stderr)
        return 2
    start = time.perf_counter()
    deadline = start + args.budget_s
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    sms = num_sms(dev)
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    copy_gbps = copy_bandwidth_gbps(dev)
    print(f"device copy: {copy_gbps:.0f} GB/s", flush=True)

    # Check every candidate, unsplit and split, before timing anything; a failed one is skipped.
    failed: dict[bool, dict[str, str]] = {False: {}, True: {}}
    for fp8 in (False, True):
        for cand in CANDIDATES:
            name = label(*cand)
            for splits in (1, 3):
                why = check_candidate(fp8, launch_of(*cand, splits), gen)
                if why:
                    failed[fp8][name] = why
                    break
            print(f"check {'fp8 ' if fp8 else 'bf16'} {name}: {failed[fp8].get(name) or 'matches the twin'} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)

    cases = []
    for fp8 in (False, True):
        kind = "fp8" if fp8 else "bf16"
        cases += [Case(f"prefill T={PREFILL_TOKENS} {kind} {g}", PREFILL_TOKENS, fp8, g, 1)
                  for g in ("local", "uniform")]
        # One token a sequence: `local` and `uniform` rows are the same draw.
        cases.append(Case(f"decode T={DECODE_SEQS} {kind}", DECODE_SEQS, fp8, "uniform", DECODE_SEQS))
        cases += [Case(f"verify T={DECODE_SEQS * VERIFY_TOKENS} {kind} {g}", DECODE_SEQS * VERIFY_TOKENS, fp8, g,
                       DECODE_SEQS) for g in ("local", "uniform")]
    for fp8 in (False, True):
        cache = random_cache(CACHE_TOKENS, fp8, gen)
        for case in (c for c in cases if c.fp8 == fp8):
            run_case(case, cache, copy_gbps, failed[fp8], deadline, gen)
            cfg = _launch_config(HEADS, TOPK, RANK, fp8, hopper_kernel(fp8))
            auto = choose_num_splits(case.tokens * math.ceil(HEADS / cfg.block_h), math.ceil(TOPK / cfg.block_n), sms)
            print(f"\n## {case.name}: default "
                  f"{label(cfg.kernel, cfg.block_h, cfg.block_n, cfg.num_stages, cfg.num_warps)}, "
                  f"{auto} split(s) "
                  f"({time.perf_counter() - start:.0f} s)\n{table(case)}", flush=True)
        del cache
        torch.cuda.empty_cache()

    text = summary(cases, copy_gbps)
    verdict = kernel_verdict(cases)
    print("\n## Best configuration a case\n" + text, flush=True)
    print("\n## triton against sm90 and sm90ws\n" + verdict, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"device": props.name, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbps": copy_gbps,
            "geometry": {"heads": HEADS, "rank": RANK, "rope": ROPE, "topk": TOPK, "cache_tokens": CACHE_TOKENS,
                         "share": SHARE},
            "failed_checks": {("fp8" if k else "bf16"): v for k, v in failed.items()},
            "cases": [{"name": c.name, "tokens": c.tokens, "fp8": c.fp8, "gather": c.gather, "seqs": c.seqs,
                       "flops": c.flops, "bytes": c.bytes, "rows": [asdict(r) for r in c.rows]} for c in cases],
            "seconds": time.perf_counter() - start}
    (args.out / "tune_sparse_mla.json").write_text(json.dumps(info, indent=1))
    md = [f"# Sparse MLA tuning on {props.name}", "", f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{sms} SMs; `python -m benchmarks.tune_sparse_mla`", "", text, "", "## triton against sm90 and sm90ws", "",
          verdict, ""]
    for c in cases:
        md += [f"## {c.name}", "", table(c), ""]
    (args.out / "tune_sparse_mla.md").write_text("\n".join(md))
    print(f"\nwrote {args.out / 'tune_sparse_mla.json'} and .md ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
