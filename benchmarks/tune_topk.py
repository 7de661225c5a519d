"""Time and tune the Triton top-k (megactx.kernels.topk.topk_rows) against torch.topk on a GPU.

    python3 benchmarks/tune_topk.py            # every case, a one-knob-at-a-time sweep around the defaults
    python3 benchmarks/tune_topk.py --quick    # defaults only
    python3 benchmarks/tune_topk.py --cases decode prefill --no-logits
    python3 benchmarks/tune_topk.py --k 128 --cases prefill --no-logits   # megactx-tiny's top-k
    python3 benchmarks/tune_topk.py --sweep max_registers stages          # only these knobs

Cases (k = 2048 unless --k): decode 64 x 1M, the last 4096-row chunk of a causal 64K prefill, 1024 x 128K and
256 x 1M (all on the split plan); with --cases short, a causal 8K prefill (rows under two segments:
the fused plan), on i.i.d. normal logits (-inf beyond each row's key_len, as the indexer writes them). Each
line: ms (triton.testing.do_bench, L2 flushed between repetitions), GB/s = visible logits bytes
(read once) / time, next to the device copy bandwidth measured in the same run, the speed-up over
torch.topk, and whether the selected values equal torch.topk's. Per case it also times the default
config in a CUDA graph (no launch overhead); on ties (integer logits: with 1000 levels ties are
settled in the candidate buffer, with 10 the top level is the threshold itself and its lowest
copies are read from the row's start); on ReLU'd indexer-like rows (k / 2 positive values among
exact zeros and negatives: the k-th largest is 0.0, tied ~L / 2 times); and on normal logits with
`candidates = k`, so that the buffer overflows and the fallback over the row runs (the cost tie-heavy
rows paid before their ties were kept out of the buffer). Once, the indexer logits of the prefill
case alone and followed by the top-k (the target: top-k within 0.5x of the logits). Prints a table;
this is a tuning tool, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megactx.kernels.topk import TopkConfig, TopkPlan, topk_rows  # noqa: E402

K = 2048
MiB = 1 << 20


@dataclass(frozen=True)
class Case:
    name: str
    T: int
    L: int
    causal: bool  # key_len = L - T + 1 .. L (the last chunk of a causal prefill); else all L

    def inputs(self, gen: torch.Generator, levels: int = 0,
               relu: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """i.i.d. normal logits; integers in [0, levels) (ties) when levels > 0; relu: K / 2 positive
        values a row (at most; where every row sees them) among exact zeros (half the row) and negatives."""
        shape = (self.T, self.L)
        if levels:
            logits = torch.randint(0, levels, shape, generator=gen, device="cuda").float()
        elif relu:
            zero = torch.rand(shape, generator=gen, device="cuda") < 0.5
            logits = torch.randn(shape, generator=gen, device="cuda").abs().neg().sub(0.01).masked_fill(zero, 0.0)
            visible = self.L - self.T + 1 if self.causal else self.L  # keys every row sees
            hot = torch.randint(0, visible, (self.T, K // 2), generator=gen, device="cuda")
            logits.scatter_(1, hot, torch.rand(hot.shape, generator=gen, device="cuda") + 1)
        else:
            logits = torch.randn(shape, generator=gen, device="cuda")
        if not self.causal:
            return logits, None
        key_len = torch.arange(self.L - self.T + 1, self.L + 1, device="cuda", dtype=torch.int32)
        cols = torch.arange(self.L, device="cuda")
        logits.masked_fill_(cols[None, :] >= key_len[:, None], float("-inf"))
        return logits, key_len

    def visible_bytes(self) -> int:
        rows = self.T * self.L - (self.T * (self.T - 1) // 2 if self.causal else 0)
        return rows * 4


CASES = {
    "short": Case("short rows 4096 x 8K causal (the fused plan)", 4096, 1 << 13, True),
    "decode": Case("decode 64 x 1M", 64, 1 << 20, False),
    "prefill": Case("prefill 4096 x 64K causal", 4096, 1 << 16, True),
    "mid": Case("1024 x 128K", 1024, 1 << 17, False),
    "long": Case("256 x 1M", 256, 1 << 20, False),
}


def sweep(plan: TopkPlan, knobs: list[str] | None = None) -> list[TopkConfig]:
    """The default config, then one knob at a time around it (the knobs of the plan the case takes;
    only `knobs` where given, "programs_per_row" among them for the other plan)."""
    base = TopkConfig()
    out = [base]
    variants = {
        "num_warps": [4, 8, 16],
        "block": [512, 1024, 4096, 8192],
        "stages": [1, 2, 3, 4],
        "max_tile": [4096, 8192, 16384, 32768],
        "sub_block": [512, 1024, 2048],
        "groups": [4096, 8192, 16384],
        "tile_pivots": [1, 2, 4],
        "candidates": [4096, 8192],
        "max_registers": [128, 168],
        "select_block": [512, 4096],
    }
    current = {"num_warps": plan.num_warps, "block": plan.block, "stages": plan.stages,
               "max_tile": plan.rows * plan.seg_groups,
               "sub_block": plan.sub_block, "groups": plan.groups, "tile_pivots": base.tile_pivots,
               "candidates": plan.cap, "max_registers": base.max_registers, "select_block": plan.select_block}
    for knob, values in variants.items():
        if knobs is None or knob in knobs:
            out += [dataclasses.replace(base, **{knob: v}) for v in values if v != current[knob]]
    splits = (plan.split // 2, plan.split * 2) if plan.split > 1 else (2, 4)  # fused: against the split plan
    if knobs is None or "programs_per_row" in knobs:
        out += [dataclasses.replace(base, programs_per_row=p) for p in splits if p >= 2]
    return out


def describe(plan: TopkPlan) -> str:
    kind = "fused" if plan.split == 1 else f"split x{plan.split}"
    return (f"{kind:9s} warps={plan.num_warps:<2d} block={plan.block:<5d} stages={plan.stages} "
            f"sub={plan.sub_block:<4d} sel={plan.select_block:<4d} tile={plan.rows * plan.seg_groups:<5d} "
            f"groups={plan.groups:<5d} cand={plan.cap}")


def values_match(logits: torch.Tensor, got: torch.Tensor, rows: int = 64) -> bool:
    """The multiset of selected values equals torch.topk's (on the first `rows` rows)."""
    x, sel = logits[:rows], got[:rows].long()
    vals = x.gather(1, sel.clamp_min(0)).masked_fill(sel < 0, float("-inf"))
    return torch.equal(vals.sort(-1, descending=True).values, x.topk(got.shape[1], dim=-1).values)


def time_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written / time, GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src)) / 1e6


def run_case(case: Case, quick: bool, ceiling: float, knobs: list[str] | None = None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits, key_len = case.inputs(gen)
    time_configs(case, logits, key_len, quick, ceiling, knobs)
    # 1000 levels: ties straddle the threshold inside the buffer; 10: the top level is the threshold
    # itself, its lowest copies read from the row's start (so are the ReLU rows' zeros)
    for levels in (1000, 10):
        time_ties(case, f"integer logits in [0, {levels})", *case.inputs(gen, levels))
    time_ties(case, f"ReLU rows, {K // 2} positive", *case.inputs(gen, relu=True))
    time_ties(case, "the fallback: normal logits, candidates = k", logits, key_len, TopkConfig(candidates=K))


def time_configs(case: Case, logits: torch.Tensor, key_len: torch.Tensor | None, quick: bool, ceiling: float,
                 knobs: list[str] | None = None) -> None:
    gb = case.visible_bytes() / 1e9
    t_torch = time_ms(lambda: torch.topk(logits, K, dim=-1))
    print(f"\n== {case.name}: {case.visible_bytes() / MiB:.0f} MiB visible logits; torch.topk {t_torch:.3f} ms "
          f"({gb / t_torch * 1e3:.0f} GB/s); copy ceiling {ceiling:.0f} GB/s")
    print(f"{'plan':78s} {'ms':>8s} {'GB/s':>6s} {'vs torch':>8s}  values")
    out = torch.empty(case.T, K, dtype=torch.int32, device="cuda")
    results = []
    default_plan = TopkPlan.make(case.T, case.L, K, TopkConfig(), logits.device)
    for cfg in [TopkConfig()] if quick else sweep(default_plan, knobs):
        try:
            plan = TopkPlan.make(case.T, case.L, K, cfg, logits.device)
            topk_rows(logits, K, key_len, out, config=cfg)
            ok = values_match(logits, out)
            ms = time_ms(lambda cfg=cfg: topk_rows(logits, K, key_len, out, config=cfg))
        except Exception as e:  # a config the compiler or the device refuses: report it, keep sweeping
            print(f"{str(cfg):78.78s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        results.append((ms, plan, cfg))
        knobs = f" pivots={cfg.tile_pivots}" + (f" maxnreg={cfg.max_registers}" if cfg.max_registers else "")
        print(f"{describe(plan) + knobs:78s} {ms:8.3f} {gb / ms * 1e3:6.0f} "
              f"{t_torch / ms:7.1f}x  {'ok' if ok else 'WRONG'}", flush=True)
    if results:
        ms, plan, cfg = min(results, key=lambda r: r[0])
        print(f"best: {ms:.3f} ms ({gb / ms * 1e3:.0f} GB/s, {t_torch / ms:.1f}x torch.topk): {cfg}")
    # Launch overhead (4 kernels in the split plan) off the clock, as in the engine's decode graphs.
    try:
        graphed = do_bench_cudagraph(lambda: topk_rows(logits, K, key_len, out))
        print(f"default config in a CUDA graph: {graphed:.3f} ms ({gb / graphed * 1e3:.0f} GB/s)")
    except Exception as e:  # a capture failure is a finding (a host sync crept in): report it
        print(f"default config in a CUDA graph: FAILED {type(e).__name__}: {str(e).splitlines()[0][:100]}")


def time_ties(case: Case, label: str, logits: torch.Tensor, key_len: torch.Tensor | None,
              config: TopkConfig | None = None) -> None:
    out = torch.empty(case.T, K, dtype=torch.int32, device="cuda")
    t_ties = time_ms(lambda: topk_rows(logits, K, key_len, out, config=config))
    t_torch = time_ms(lambda: torch.topk(logits, K, dim=-1))
    print(f"{label}: {t_ties:.3f} ms, torch.topk {t_torch:.3f} ms, values "
          f"{'ok' if values_match(logits, out) else 'WRONG'}")


def logits_then_topk(ceiling: float) -> None:
    """The indexer logits of the prefill case (GLM-5.2 geometry: 32 heads x 128, FP8) alone, then
    followed by topk_rows and by torch.topk."""
    import inputs  # benchmarks/inputs.py, beside this file

    from megactx.kernels.indexer import indexer_logits
    from megactx.model.quant import FP8

    case = CASES["prefill"]
    T, L, HI, DI = case.T, case.L, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    blocks = inputs.num_blocks(L)
    cache = inputs.random_index_cache(blocks, DI, gen)
    table = inputs.block_table(1, blocks, blocks, gen)
    q = torch.randn(T, HI, DI, generator=gen, device="cuda").to(FP8)
    w = torch.randn(T, HI, generator=gen, device="cuda") * (HI * DI) ** -0.5
    seq = torch.zeros(T, dtype=torch.int32, device="cuda")
    key_len = torch.arange(L - T + 1, L + 1, device="cuda", dtype=torch.int32)
    logits = indexer_logits(q, w, cache, table, seq, key_len, L)
    out = torch.empty(T, K, dtype=torch.int32, device="cuda")
    t_logits = time_ms(lambda: indexer_logits(q, w, cache, table, seq, key_len, L))
    t_topk = time_ms(lambda: topk_rows(logits, K, key_len, out))
    ok = values_match(logits, out)
    t_both = time_ms(lambda: topk_rows(indexer_logits(q, w, cache, table, seq, key_len, L), K, key_len, out))
    t_torch = time_ms(lambda: torch.topk(logits, K, dim=-1))
    print(f"\n== indexer logits + top-k, {case.name}, HI={HI} DI={DI}: logits {t_logits:.3f} ms; topk_rows on them "
          f"{t_topk:.3f} ms (values {'ok' if ok else 'WRONG'}); both {t_both:.3f} ms = {t_both / t_logits:.2f}x the "
          f"logits (target <= 1.5x); with torch.topk {(t_logits + t_torch) / t_logits:.2f}x")


def main() -> None:
    global K
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="time the default config only")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=[c for c in CASES if c != "short"])
    parser.add_argument("--no-logits", action="store_true", help="skip the indexer logits + top-k comparison")
    parser.add_argument("--sweep", nargs="+", default=None, metavar="KNOB",
                        help="sweep only these TopkConfig knobs (e.g. max_registers programs_per_row)")
    parser.add_argument("--k", type=int, default=K, help=f"rows' top-k (default {K}, GLM-5.2's; megactx-tiny: 128)")
    args = parser.parse_args()
    K = args.k
    if not torch.cuda.is_available():
        sys.exit("tune_topk.py times CUDA kernels: no CUDA device here")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, k = {K}")
    start = time.time()
    ceiling = copy_bandwidth()
    for name in args.cases:
        run_case(CASES[name], args.quick, ceiling, args.sweep)
        torch.cuda.empty_cache()
        print(f"({time.time() - start:.0f} s so far)", flush=True)
    if not args.no_logits:
        try:
            logits_then_topk(ceiling)
        except Exception as e:  # an optional section: its inputs come from other modules
            print(f"indexer logits + top-k skipped: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
