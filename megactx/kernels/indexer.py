"""Lightning-indexer logits over the paged indexer cache or contiguous keys (Triton, FP8 or exact), and a chunked
top-k on top.

One kernel serves prefill (a variable-length batch, each query with its own causal key range) and
decode / speculative verify (a few query tokens a sequence over a long paged cache): every query
row carries its sequence and its key count, nothing else distinguishes the two.

Work split: one program per (BLOCK_M consecutive query rows) x (split of the keys). Rows of the
block that belong to the same sequence and see a key of the split form a group. A group keeps its
queries resident (qᵀ [DI, BLOCK_M·HI] e4m3 in shared memory, loaded once) and loops over its key
tiles, from the split's first key to the last key any of its rows sees, so a causal prefill never
visits its upper triangle. A tile is one 64-key page: its e4m3 keys [64, DI] come by TMA (Hopper;
elsewhere, or for an exact cache, a gather by address), its fp32 scales by a plain load, and
Triton's pipeliner keeps the next pages and scales in flight. Each tile is one FP8 dot
k [64, DI] x qᵀ -> [64, BLOCK_M·HI] fp32 (keys in M, rows x heads in N, head-major), then ReLU,
x w, Σ over heads (inside a thread, then lane shuffles), x k_scale, and a [BLOCK_M, 64] store. A
lone row (plain decode, a sequence boundary) takes a narrow k x qᵀ [DI, HI] dot instead. Whatever
a program's groups did not reach (the upper triangle, rows past their key_len) it fills with -inf
at the end, so every output element is written exactly once.

Contiguous keys (`indexer_logits_contiguous`): the same kernel compiled with CONTIGUOUS reads the
keys of a packed variable-length batch in place, k [N, DI] (e4m3 with k_scale [N] fp32, or exact),
sequence b's keys at rows key_start[b] + n of k — prefill over keys just computed, before (or
without) the paged cache. Only the key tile changes: its rows are key_start[b] + n0 .. + 63 at any
offset, by TMA a [64, DI] box of a 2D descriptor over k (its bounds read rows past the end of k as
zeros), else a gather masked at the end of k; scales come from their own pointer. Rows, groups,
splits, the -inf fill, the output and the knobs are the paged path's.

Why this shape: an FP8 dot of 64 x 128 x 128 takes about as long on the tensor cores as its
epilogue (ReLU, x w, the head sum: ~2.5 CUDA-core instructions an accumulator element) takes to
issue, so the kernel is made to overlap the two across programs: three programs an SM (168
registers a thread), each one's MMAs running while another sums. Splitting the keys (split-K) is
for launches with few row blocks: a decode batch of 64 rows has 16 row blocks, and each program
then streams one slice of its rows' keys; a prefill chunk of thousands of rows runs unsplit.
Defaults (`launch_config`) are tuned with benchmarks/tune_indexer.py.

Before this layout (one program per 128-key tile, q reloaded for every tile, one 4 MFLOP dot a
program) the H200 reached 238-338 TFLOP/s on GLM-5.2 prefill (19-27% of its FP8 matmul ceiling)
and 1.95 TB/s on a 64-row decode batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megactx.kernels.common import INTERPRET, cdiv, check_device, dot_f32, next_power_of_2
from megactx.kernels.reference import BLOCK_SIZE, chunked_topk
from megactx.kernels.sparse_mla import num_sms
from megactx.kernels.topk import topk_rows
from megactx.model.quant import FP8

# Query rows x padded heads of one dot, FP8: 128 columns keep a thread's [64, 128] fp32 accumulator,
# its 32 head weights and the pipeline's state within 168 registers, so three programs share an SM
# and one's MMAs run under another's ReLU-and-sum (the CUDA cores' epilogue, ~2.5 instructions an
# accumulator element, costs about as much issue time as the MMA itself). Each key page read from L2
# then feeds 2 x 128 x DI FLOPs a key. Exact caches take narrower dots: their operands are 2-4x larger.
FP8_COLUMNS = 128
EXACT_COLUMNS = {torch.bfloat16: 128, torch.float32: 64}
FP8_MAX_REGISTERS = 168  # 65,536 registers / (3 programs x 128 threads), rounded down to ptxas' granule
MIN_REGISTERS, MAX_REGISTERS = 24, 255  # what ptxas accepts as a thread's cap
# Pipeline depth of the key loop (Triton's num_stages for it): 5 keeps 3 pages and 2 scale rows in
# flight for prefill rows (L2 hits), 8 keeps 4 pages for a lone decode row streaming from HBM.
STAGES, LONE_STAGES = 5, 8
# Split-K wave model (`choose_num_splits`): programs resident on an SM at the FP8 default, and a
# program's fixed cost (q load, the pipeline's fill and drain) in key tiles.
PROGRAMS_PER_SM = 3
PROGRAM_OVERHEAD_TILES = 2
MAX_WAVES = 16
# A key page by TMA: one box [1, 64, DI] e4m3 whose rows (DI bytes) fit one 128-byte swizzle span.
TMA_ROW_BYTES = 128
# Elements of one -inf fill store: [BLOCK_M, FILL_ELEMENTS / BLOCK_M], 32 a thread at 4 warps.
FILL_ELEMENTS = 4096


@dataclass(frozen=True)
class LogitsLaunch:
    """How `indexer_logits` tiles and launches. block_m: query rows a program, cut into num_dots
    (1 or 2) dots; block_n: keys a tile; tma: key pages come by the tensor-memory accelerator
    (block_n = 64) instead of a gather by address; num_stages / lone_stages: pipeline depth of the
    key loop of a group of rows / of a lone row; max_registers: a thread's cap (None: the
    compiler's choice); num_splits programs share each row block's keys, keys_per_split (a multiple
    of block_n) each."""

    block_m: int
    num_dots: int
    block_n: int
    tma: bool
    num_warps: int
    num_stages: int
    lone_stages: int
    max_registers: int | None
    num_splits: int
    keys_per_split: int


def launch_config(T: int, HI: int, DI: int, max_keys: int, dtype: torch.dtype, sms: int, tma_capable: bool, *,
                  sequences: int | None = None, block_m: int | None = None, num_dots: int | None = None,
                  block_n: int | None = None,
                  tma: bool | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  lone_stages: int | None = None, max_registers: int | None = None,
                  num_splits: int | None = None) -> LogitsLaunch:
    """The launch of `indexer_logits` for T query rows of HI heads x DI over max_keys keys, on a
    device of `sms` SMs, tma_capable if it has TMA (Hopper or newer); the knobs left None take the
    defaults, the others are checked (ValueError). dtype: the queries' (float8_e4m3fn = the FP8
    cache). Defaults: see FP8_COLUMNS, STAGES and `choose_num_splits`; 64-key tiles by TMA where
    the device has it, 4 warps; max_registers = 255 lifts the default cap (ptxas' own limit).
    sequences: how many sequences the rows belong to; T <= sequences (a decode batch: every row
    lone) takes the rows a block of lone rows fills, each padded to 16 heads: with fewer heads,
    more lone rows a block would only lengthen each program's serial scans (measured on the H200 at
    4 heads, 64 rows over 32K keys: 121 against 87 us)."""
    fp8 = dtype == FP8
    columns = FP8_COLUMNS if fp8 else EXACT_COLUMNS.get(dtype, 64)
    if block_m is None:
        lone = sequences is not None and T <= sequences
        block_m = max(1, columns // (_padded_heads(HI, 1) if lone else next_power_of_2(HI)))
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    num_dots = 1 if num_dots is None else num_dots
    if num_dots not in (1, 2) or block_m % num_dots:
        raise ValueError(f"num_dots must be 1 or 2 and divide block_m = {block_m}, got {num_dots}")
    hi_pad = _padded_heads(HI, block_m // num_dots)
    block_n = BLOCK_SIZE if block_n is None else block_n
    if block_n < BLOCK_SIZE or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power-of-two multiple of {BLOCK_SIZE}, got {block_n}")
    tma_ok = fp8 and DI <= TMA_ROW_BYTES and block_n == BLOCK_SIZE and tma_capable
    if tma and not tma_ok:
        raise ValueError(f"tma=True needs an FP8 cache, DI <= {TMA_ROW_BYTES}, block_n = {BLOCK_SIZE} and a Hopper "
                         f"(or newer) GPU; got fp8={fp8}, DI={DI}, block_n={block_n}, tma_capable={tma_capable}")
    tma = tma_ok if tma is None else tma
    num_warps = 4 if num_warps is None else num_warps
    num_stages = (STAGES if fp8 or dtype == torch.bfloat16 else 2) if num_stages is None else num_stages
    lone_stages = (LONE_STAGES if fp8 else num_stages) if lone_stages is None else lone_stages
    if min(num_stages, lone_stages) < 1:
        raise ValueError(f"num_stages and lone_stages must be at least 1, got {num_stages} and {lone_stages}")
    if max_registers is None and fp8 and num_warps == 4 and block_m * hi_pad <= FP8_COLUMNS:
        max_registers = FP8_MAX_REGISTERS
    if max_registers is not None and not MIN_REGISTERS <= max_registers <= MAX_REGISTERS:
        raise ValueError(f"max_registers must be in [{MIN_REGISTERS}, {MAX_REGISTERS}], got {max_registers}")
    tiles = cdiv(max(max_keys, 1), block_n)
    if num_splits is None:
        num_splits = choose_num_splits(cdiv(max(T, 1), block_m), tiles, sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    tiles_per_split = cdiv(tiles, min(num_splits, tiles))
    # Splits that would start past max_keys are dropped: the count is the one actually launched.
    return LogitsLaunch(block_m, num_dots, block_n, tma, num_warps, num_stages, lone_stages, max_registers,
                        cdiv(tiles, tiles_per_split), tiles_per_split * block_n)


@functools.lru_cache(maxsize=4096)
def choose_num_splits(row_blocks: int, tiles: int, sms: int) -> int:
    """Key splits of each row block that finish a launch soonest under a wave model: row_blocks x s
    programs run in ceil(row_blocks x s / slots) waves (slots = PROGRAMS_PER_SM x sms at once), each
    as long as one program, ceil(tiles / s) + PROGRAM_OVERHEAD_TILES tiles. The best s for w waves
    is the largest that fits them, so only those are tried (w <= MAX_WAVES). A prefill chunk
    (row_blocks >> slots) gets 1; a decode batch of 64 rows over 1M keys (16 row blocks, 16K tiles,
    132 SMs) 74."""
    slots = PROGRAMS_PER_SM * sms
    best_cost, best = None, 1
    for waves in range(1, MAX_WAVES + 1):
        s = max(1, min(tiles, waves * slots // row_blocks))
        cost = cdiv(row_blocks * s, slots) * (cdiv(tiles, s) + PROGRAM_OVERHEAD_TILES)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, s
    return best


def kernel_constants(launch: LogitsLaunch, HI: int, DI: int, dtype: torch.dtype, contiguous: bool = False) -> dict:
    """The compile-time arguments of `_indexer_logits_kernel` for a launch (shared with the tuner's
    static compile). dtype: the queries'; contiguous: keys from one [N, DI] tensor, not pages."""
    fp8 = dtype == FP8
    return dict(HI=HI, DI=DI, HI_PAD=_padded_heads(HI, launch.block_m // launch.num_dots),
                LONE_PAD=_padded_heads(HI, 1), PAGE=BLOCK_SIZE, BLOCK_M=launch.block_m, DOTS=launch.num_dots,
                BLOCK_N=launch.block_n, FILL_N=max(launch.block_n, FILL_ELEMENTS // launch.block_m),
                STAGES=launch.num_stages, LONE_STAGES=launch.lone_stages, FP8=fp8,
                DOT_F32=dot_f32(dtype), TMA=launch.tma, CONTIGUOUS=contiguous)


def has_tma(device: torch.device) -> bool:
    """Hopper or newer (the interpreter emulates descriptor loads, so CPU tests cover that path)."""
    if device.type != "cuda":
        return INTERPRET
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _padded_heads(HI: int, rows: int) -> int:
    """Heads padded to a power of two, and far enough that a dot of `rows` query rows has N = rows x
    heads >= 16 (a lone row: 16 heads). megactx-tiny's 4 heads then fill a 128-column FP8 dot with
    32 rows, not 8 rows of 16 mostly empty heads: each page of keys read serves 4x the rows."""
    return max(next_power_of_2(HI), cdiv(16, rows))


@triton.jit
def _queries(q_ptr, w_ptr, first_row, T, stride_qt, stride_qh, stride_wt,
             HI: tl.constexpr, DI: tl.constexpr, HI_PAD: tl.constexpr, ROWS: tl.constexpr, DOT_F32: tl.constexpr):
    """qᵀ [DI, HI_PAD·ROWS] (K-major, as FP8 MMAs need; fp32 with DOT_F32) and w [HI_PAD·ROWS] fp32
    of rows first_row .. first_row + ROWS - 1, columns head-major (column h·ROWS + r): in the MMA's
    accumulator a thread then holds many heads of few rows, and from 4 rows on the Σ over heads
    needs one lane shuffle instead of two. Padded heads and rows past T read q = 0 and w = 0: they
    add nothing."""
    c = tl.arange(0, HI_PAD * ROWS)
    tok = first_row + c % ROWS
    head = c // ROWS
    ok = (tok < T) & (head < HI)
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=ok[:, None], other=0.0)  # [HI_PAD·ROWS, DI] e4m3 (exact cache: float)
    if DOT_F32:  # exact caches (fp32 inputs, or bf16 under the interpreter, whose bf16 dot is wrong)
        q = q.to(tl.float32)
    w = tl.load(w_ptr + tok.to(tl.int64) * stride_wt + head, mask=ok, other=0.0)
    return tl.trans(q), w


@triton.jit
def _row_state(seq_ptr, klen_ptr, first_row, s, key_lo, key_end, T, ROWS: tl.constexpr):
    """Per row of first_row .. first_row + ROWS - 1: its key count cut at key_end, and whether it
    belongs to this group (sequence s, sees a key at or past key_lo)."""
    rows = first_row + tl.arange(0, ROWS)
    row_ok = rows < T
    klen = tl.minimum(tl.load(klen_ptr + rows, mask=row_ok, other=0), key_end)
    member = row_ok & (tl.load(seq_ptr + rows, mask=row_ok, other=-1) == s) & (klen > key_lo)
    return klen, member


@triton.jit
def _head_sum(k, q_t, w, k_scale, ROWS: tl.constexpr, HI_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT_F32: tl.constexpr):
    """Key tile k [BLOCK_N, DI] against qᵀ [DI, HI_PAD·ROWS] (head-major) -> [ROWS, BLOCK_N] fp32
    k_scale[n] · Σ_h w[r, h] · ReLU(q[r, h] · k[n])."""
    # Keys in the MMA's M, rows·heads in its N: the Σ over heads then stays inside a thread and its
    # lane quad (heads in M needed a cross-warp reduction and ran 1.7-2.6x slower). The FP8 tensor
    # cores accumulate with reduced precision (as DeepGEMM's): ~4e-4 of a row's max logit at
    # DI = 128; max_num_imprecise_acc=0 made it exact to fp32 but 2.5-3x slower, and top-k
    # selection does not need it.
    if DOT_F32:
        dots = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")  # [BLOCK_N, HI_PAD·ROWS] fp32
    else:
        dots = tl.dot(k, q_t)
    x = tl.maximum(dots, 0.0) * w[None, :]
    return tl.trans(tl.sum(tl.reshape(x, (BLOCK_N, HI_PAD, ROWS)), axis=1)) * k_scale[None, :]


@triton.jit
def _store_rows(out_ptr, logits, first_row, klen, member, n, key_end, stride_ot, ROWS: tl.constexpr):
    """logits [ROWS, BLOCK_N] of keys n into the member rows of first_row .. + ROWS - 1: -inf from
    each row's key_len on, nothing at or past key_end."""
    rows = first_row + tl.arange(0, ROWS)
    logits = tl.where(n[None, :] < klen[:, None], logits, float("-inf"))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + n[None, :], logits,
             mask=member[:, None] & (n[None, :] < key_end))


@triton.jit
def _key_tile(k_ptr, k_desc, ks_ptr, seq_keys, n0, kmax, key_bound, stride_kb, stride_sb,
              DI: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr,
              CONTIGUOUS: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N - 1 of a sequence -> (keys [BLOCK_N, DI] in the cache's dtype, e4m3
    for FP8; their fp32 scales [BLOCK_N], 1 for exact keys). Paged: seq_keys is the sequence's
    block-table row, key_bound its length (max_blocks). CONTIGUOUS: seq_keys is the sequence's first
    row of k [N, DI] (int32), key_bound = N. TMA: the tile is BLOCK_N = PAGE rows copied whole by
    the tensor-memory accelerator (paged: one page; contiguous: rows seq_keys + n0 ..., at any
    offset), so keys at or past kmax hold whatever the page or the next sequence holds (callers
    mask them) and rows past the end of k read 0 (the descriptor's bounds); otherwise a gather by
    address that reads them as 0. Their scales read 0 either way."""
    n = n0 + tl.arange(0, BLOCK_N)
    key_ok = n < kmax
    if CONTIGUOUS:
        row = seq_keys.to(tl.int64) + n
        key_ok = key_ok & (row < key_bound)  # never past the end of k, whatever key_len claims
        if TMA:
            k = k_desc.load([seq_keys + n0, 0])  # [BLOCK_N, DI]; TMA coordinates are int32
        else:
            d = tl.arange(0, DI)
            k = tl.load(k_ptr + row[:, None] * stride_kb + d[None, :], mask=key_ok[:, None], other=0.0)
        scale_at = row  # k_scale [N], a key's scale at its row
    else:
        if TMA:
            page = tl.load(seq_keys + n0 // PAGE, mask=n0 // PAGE < key_bound, other=0)
            k = k_desc.load([page, 0, 0]).reshape(BLOCK_N, DI)
            phys = page.to(tl.int64)
        else:
            phys = tl.load(seq_keys + n // PAGE, mask=key_ok & (n // PAGE < key_bound), other=0).to(tl.int64)
            d = tl.arange(0, DI)
            k = tl.load(k_ptr + phys[:, None] * stride_kb + (n % PAGE)[:, None] * DI + d[None, :],
                        mask=key_ok[:, None], other=0.0)
        # A page: 64 · DI e4m3 bytes, then the 64 keys' fp32 scales.
        scale_at = phys * stride_sb + (PAGE * DI // 4) + n % PAGE
    if FP8:
        k_scale = tl.load(ks_ptr + scale_at, mask=key_ok, other=0.0)
    else:
        k_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
    return k, k_scale


@triton.jit
def _rows_over_keys(q_ptr, w_ptr, k_ptr, k_desc, ks_ptr, bt_ptr, seq_ptr, klen_ptr, out_ptr,
                    first_row, s, key_lo, key_end, T, key_bound,
                    stride_qt, stride_qh, stride_wt, stride_kb, stride_sb, stride_bt, stride_ot,
                    HI: tl.constexpr, DI: tl.constexpr, HI_PAD: tl.constexpr, PAGE: tl.constexpr,
                    ROWS: tl.constexpr, DOTS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                    FP8: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr, CONTIGUOUS: tl.constexpr):
    """Logits of the rows first_row .. first_row + ROWS - 1 that belong to sequence s and see a key
    at or past key_lo (a multiple of BLOCK_N), over the key tiles from key_lo up to the last key any
    of them sees below key_end; each row gets -inf past its key_len in those tiles. Other rows of
    the range are not written. DOTS (1 or 2): the rows' dot is cut in that many column blocks of
    ROWS / DOTS rows, each with its own ReLU-and-sum (fewer live accumulators than one wide dot).
    STAGES: software-pipeline depth of the key tiles."""
    SUB: tl.constexpr = ROWS // DOTS
    klen_a, member_a = _row_state(seq_ptr, klen_ptr, first_row, s, key_lo, key_end, T, SUB)
    kmax = tl.max(tl.where(member_a, klen_a, 0))
    # Queries stay resident for the whole key loop. Rows of other groups compute along (the dot is
    # one piece) but are not stored.
    q_a, w_a = _queries(q_ptr, w_ptr, first_row, T, stride_qt, stride_qh, stride_wt, HI, DI, HI_PAD, SUB, DOT_F32)
    if DOTS == 2:
        klen_b, member_b = _row_state(seq_ptr, klen_ptr, first_row + SUB, s, key_lo, key_end, T, SUB)
        kmax = tl.maximum(kmax, tl.max(tl.where(member_b, klen_b, 0)))
        q_b, w_b = _queries(q_ptr, w_ptr, first_row + SUB, T, stride_qt, stride_qh, stride_wt, HI, DI, HI_PAD,
                            SUB, DOT_F32)
    if CONTIGUOUS:
        seq_keys = tl.load(bt_ptr + s)  # key_start[s]: the sequence's first row of k
    else:
        seq_keys = bt_ptr + s.to(tl.int64) * stride_bt  # its block-table row

    # With num_stages on the loop, Triton's pipeliner prefetches every load in it (block-table
    # entries, key pages, scales), STAGES - 1 tiles deep in all, shared out along the load chain.
    # Contiguous keys have no block-table load in the chain: the pipeliner then buffers STAGES key
    # tiles (sm_90 compile: 5 / 8 at the defaults, 70-74 KiB shared, against 3 / 4 and 42 KiB paged).
    for n0 in tl.range(key_lo, kmax, BLOCK_N, num_stages=STAGES):
        k, k_scale = _key_tile(k_ptr, k_desc, ks_ptr, seq_keys, n0, kmax, key_bound, stride_kb, stride_sb,
                               DI, PAGE, BLOCK_N, FP8, TMA, CONTIGUOUS)
        n = n0 + tl.arange(0, BLOCK_N)
        logits = _head_sum(k, q_a, w_a, k_scale, SUB, HI_PAD, BLOCK_N, DOT_F32)
        _store_rows(out_ptr, logits, first_row, klen_a, member_a, n, key_end, stride_ot, SUB)
        if DOTS == 2:
            logits = _head_sum(k, q_b, w_b, k_scale, SUB, HI_PAD, BLOCK_N, DOT_F32)
            _store_rows(out_ptr, logits, first_row + SUB, klen_b, member_b, n, key_end, stride_ot, SUB)


@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr, k_ptr, k_desc, ks_ptr, bt_ptr, seq_ptr, klen_ptr, out_ptr,
                           T, max_keys, key_bound, keys_per_split,
                           stride_qt, stride_qh, stride_wt, stride_kb, stride_sb, stride_bt, stride_ot,
                           HI: tl.constexpr, DI: tl.constexpr, HI_PAD: tl.constexpr, LONE_PAD: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_M: tl.constexpr, DOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                           FILL_N: tl.constexpr,
                           STAGES: tl.constexpr, LONE_STAGES: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr,
                           TMA: tl.constexpr, CONTIGUOUS: tl.constexpr):
    # Keys come paged (bt_ptr: the block table [B, key_bound]; k_ptr / ks_ptr / k_desc: the cache) or,
    # with CONTIGUOUS, as one tensor k [key_bound, DI] (bt_ptr: key_start [B]; ks_ptr: k_scale [N]).
    # Row blocks in reverse: under a causal prefill the last rows see the most keys, and starting
    # the longest programs first keeps the tail of the launch short.
    first_row = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    key_lo = tl.program_id(1) * keys_per_split
    key_end = tl.minimum(key_lo + keys_per_split, max_keys)
    ids = tl.arange(0, BLOCK_M)
    rows = first_row + ids
    row_ok = rows < T
    seq = tl.load(seq_ptr + rows, mask=row_ok, other=-1)
    klen = tl.minimum(tl.load(klen_ptr + rows, mask=row_ok, other=0), key_end)

    # Rows that see a key of this split form groups by sequence; a group's leader is its first row.
    active = row_ok & (klen > key_lo)
    same = (seq[:, None] == seq[None, :]) & active[:, None] & active[None, :]  # [BLOCK_M, BLOCK_M]
    leader = active & (tl.min(tl.where(same, ids[None, :], BLOCK_M), axis=1) == ids)
    size = tl.sum(same.to(tl.int32), axis=1)  # rows in each row's group
    group_end = tl.max(tl.where(same, klen[None, :], 0), axis=1)  # last key its group sees, + 1

    for i in range(BLOCK_M):
        if tl.sum(tl.where(ids == i, leader, False).to(tl.int32)) > 0:
            s = tl.sum(tl.where(ids == i, seq, 0))
            if tl.sum(tl.where(ids == i, size, 0)) == 1:  # a lone row (plain decode): a narrow dot
                _rows_over_keys(q_ptr, w_ptr, k_ptr, k_desc, ks_ptr, bt_ptr, seq_ptr, klen_ptr, out_ptr,
                                first_row + i, s, key_lo, key_end, T, key_bound,
                                stride_qt, stride_qh, stride_wt, stride_kb, stride_sb, stride_bt, stride_ot,
                                HI, DI, LONE_PAD, PAGE, 1, 1, BLOCK_N, LONE_STAGES, FP8, DOT_F32, TMA, CONTIGUOUS)
            else:  # prefill, speculative verify: the group's rows share every key tile
                _rows_over_keys(q_ptr, w_ptr, k_ptr, k_desc, ks_ptr, bt_ptr, seq_ptr, klen_ptr, out_ptr,
                                first_row, s, key_lo, key_end, T, key_bound,
                                stride_qt, stride_qh, stride_wt, stride_kb, stride_sb, stride_bt, stride_ot,
                                HI, DI, HI_PAD, PAGE, BLOCK_M, DOTS, BLOCK_N, STAGES, FP8, DOT_F32, TMA, CONTIGUOUS)

    # -inf over the rest of the split: past each group's last tile, and all of it for rows that see
    # no key here (the causal upper triangle of a prefill, rows with key_len 0).
    done = tl.where(active, key_lo + tl.cdiv(group_end - key_lo, BLOCK_N) * BLOCK_N, key_lo)
    done = tl.minimum(done, key_end)
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_ot
    for n0 in range(tl.min(tl.where(row_ok, done, key_end)), key_end, FILL_N):
        n = n0 + tl.arange(0, FILL_N)
        fill = row_ok[:, None] & (n[None, :] >= done[:, None]) & (n[None, :] < key_end)
        tl.store(out_rows + n[None, :], tl.full((BLOCK_M, FILL_N), float("-inf"), tl.float32), mask=fill)


def _check_queries(q: torch.Tensor, w: torch.Tensor, fp8: bool, key_dtype: torch.dtype, keys: str) -> None:
    """The checks both forms share: q's dtype against the keys' (keys: how to name them in errors),
    q's head dim, w's shape."""
    if q.dim() != 3:
        raise ValueError(f"queries must be [T, HI, DI], got shape {tuple(q.shape)}")
    T, HI, DI = q.shape
    if fp8 and q.dtype != FP8:
        raise ValueError(f"queries over {keys} must be float8_e4m3fn, got {q.dtype}")
    if not fp8 and (q.dtype != key_dtype or q.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"{keys} must be fp32 or bf16 and match the queries' dtype, got keys {key_dtype} and "
                         f"queries {q.dtype}")
    if DI < 16 or DI & (DI - 1):
        raise ValueError(f"the indexer kernel needs a power-of-two head dim >= 16, got {DI}")
    if tuple(w.shape) != (T, HI):
        raise ValueError(f"head weights have shape {tuple(w.shape)}; queries [{T}, {HI}, {DI}] need [{T}, {HI}]")


def _launch(out: torch.Tensor, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k_desc: TensorDescriptor | None,
            scales: torch.Tensor, seq_keys: torch.Tensor, seq_idx: torch.Tensor, key_len: torch.Tensor,
            launch: LogitsLaunch, key_bound: int, stride_sb: int, stride_bt: int, contiguous: bool) -> None:
    """Run `_indexer_logits_kernel` into out [T, max_keys]; seq_keys: the block table (paged) or
    key_start (contiguous), key_bound: its columns (paged) or the rows of keys (contiguous)."""
    T, HI, DI = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = w.float().contiguous()
    seq_idx, key_len = seq_idx.contiguous(), key_len.contiguous()
    grid = (cdiv(T, launch.block_m), launch.num_splits)
    _indexer_logits_kernel[grid](
        q, w, keys, k_desc, scales, seq_keys, seq_idx, key_len, out,
        T, out.shape[1], key_bound, launch.keys_per_split,
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), stride_sb, stride_bt, out.stride(0),
        **kernel_constants(launch, HI, DI, q.dtype, contiguous), num_warps=launch.num_warps,
        **({"maxnreg": launch.max_registers} if launch.max_registers else {}),
    )


def indexer_logits(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_idx: torch.Tensor, key_len: torch.Tensor, max_keys: int, *,
                   block_m: int | None = None, num_dots: int | None = None, block_n: int | None = None,
                   tma: bool | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   lone_stages: int | None = None, max_registers: int | None = None,
                   num_splits: int | None = None) -> torch.Tensor:
    """Lightning-indexer logits over the paged indexer cache (twin: reference.indexer_logits).

    q: [T, HI, DI] e4m3 queries over an FP8 cache ([num_blocks, 64 · (DI + 4)] uint8), or float
    queries over an exact cache ([num_blocks, 64 · DI] of q's dtype; layouts in
    megactx.kernels.reference); w: [T, HI] fp32 head weights with q's per-(token, head) scales
    (FP8), HI^-1/2 and DI^-1/2 folded in; block_table: [B, max_blocks] int32 physical block of each
    logical block of sequence b; seq_idx: [T] the sequence of each query row (rows of one sequence
    need not be adjacent, but adjacent rows share key loads); key_len: [T] how many keys (logical
    0 .. key_len - 1) row t sees. Returns [T, max_keys] fp32:
    Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · k_scale[s] for s < key_len[t], -inf beyond.

    Tuning knobs (None = `launch_config`'s default; fields of `LogitsLaunch`): block_m, num_dots,
    block_n, tma, num_warps, num_stages, lone_stages, max_registers, num_splits."""
    fp8 = index_cache.dtype == torch.uint8
    _check_queries(q, w, fp8, index_cache.dtype, "an FP8 indexer cache" if fp8 else "an exact indexer cache")
    T, HI, DI = q.shape
    row = BLOCK_SIZE * (DI + 4) if fp8 else BLOCK_SIZE * DI
    if index_cache.dim() != 2 or index_cache.shape[1] != row:
        raise ValueError(f"index_cache must be [num_blocks, {row}] for DI = {DI} ({'FP8' if fp8 else 'exact'} "
                         f"layout), got {index_cache.dtype} {tuple(index_cache.shape)}")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache must be contiguous (a copy of the whole cache a call would be silent and slow)")
    check_device(q, w, index_cache, block_table, seq_idx, key_len)
    launch = launch_config(T, HI, DI, max_keys, q.dtype, num_sms(q.device), has_tma(q.device),
                           sequences=block_table.shape[0], block_m=block_m,
                           num_dots=num_dots, block_n=block_n, tma=tma, num_warps=num_warps, num_stages=num_stages,
                           lone_stages=lone_stages, max_registers=max_registers, num_splits=num_splits)
    out = torch.empty(T, max_keys, dtype=torch.float32, device=q.device)
    if T == 0 or max_keys == 0:
        return out

    if fp8:
        # The same bytes seen two ways: e4m3 key rows, and the fp32 scales that start at byte 64 · DI
        # of each block (4-byte aligned since the block size 64 · (DI + 4) is); .view checks it.
        keys, scales = index_cache.view(FP8), index_cache.view(torch.float32)
    else:
        keys = scales = index_cache  # no scales
    # Key pages as a [num_blocks, 64, DI] tensor inside the cache rows (strides in elements).
    k_desc = TensorDescriptor(keys, [keys.shape[0], BLOCK_SIZE, DI], [keys.stride(0), DI, 1],
                              [1, BLOCK_SIZE, DI]) if launch.tma else None
    block_table = block_table.contiguous()
    _launch(out, q, w, keys, k_desc, scales, block_table, seq_idx, key_len, launch, key_bound=block_table.shape[1],
            stride_sb=scales.stride(0), stride_bt=block_table.stride(0), contiguous=False)
    return out


def indexer_logits_contiguous(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                              seq_idx: torch.Tensor, key_start: torch.Tensor, key_len: torch.Tensor, max_keys: int,
                              **knobs: int | bool | None) -> torch.Tensor:
    """Lightning-indexer logits over keys in one tensor, a packed variable-length batch (twin:
    reference.indexer_logits_contiguous); the same kernel as `indexer_logits`, keys read in place.

    q, w, seq_idx, key_len, max_keys and the result as in `indexer_logits`; k: [N, DI] keys, e4m3
    with k_scale [N] fp32 (q e4m3 too), or fp32 / bf16 of q's dtype with k_scale None; the last dim
    contiguous. key_start: [B] int, sequence b's keys are rows key_start[b], key_start[b] + 1, ...
    of k (any offsets, in any order, gaps allowed): row t sees rows key_start[s] .. key_start[s] +
    key_len[t] - 1, s = seq_idx[t]. Rows past the end of k read as zero keys (never out of bounds),
    so key_start[s] + key_len[t] <= N is the caller's to keep. Knobs: those of `indexer_logits`;
    TMA needs k's base address and row stride 16-byte aligned (else the default gathers)."""
    fp8 = k.dtype == FP8
    _check_queries(q, w, fp8, k.dtype, "FP8 keys" if fp8 else "exact keys")
    T, HI, DI = q.shape
    if k.dim() != 2 or k.shape[1] != DI:
        raise ValueError(f"keys must be [N, {DI}] (the queries' head dim), got {tuple(k.shape)}")
    if k.shape[0] and k.stride(1) != 1:
        raise ValueError("keys must be contiguous in their last dim (a copy of every key a call would be silent "
                         "and slow)")
    N = k.shape[0]
    if N >= 1 << 31:
        raise ValueError(f"at most 2^31 - 1 keys (TMA coordinates are int32), got {N}")
    if fp8 and (k_scale is None or k_scale.dtype != torch.float32 or tuple(k_scale.shape) != (N,)):
        got = None if k_scale is None else f"{k_scale.dtype} {tuple(k_scale.shape)}"
        raise ValueError(f"FP8 keys need k_scale: [N] = [{N}] fp32 (one scale a key), got {got}")
    if not fp8 and k_scale is not None:
        raise ValueError("exact keys have no scales: k_scale must be None")
    if key_start.dim() != 1 or key_start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"key_start must be [B] int32 or int64, got {key_start.dtype} {tuple(key_start.shape)}")
    if tuple(seq_idx.shape) != (T,) or tuple(key_len.shape) != (T,):
        raise ValueError(f"seq_idx and key_len must be [T] = [{T}], got {tuple(seq_idx.shape)} and "
                         f"{tuple(key_len.shape)}")
    check_device(q, w, k, key_start, seq_idx, key_len, *([k_scale] if fp8 else []))
    aligned = k.data_ptr() % 16 == 0 and k.stride(0) * k.element_size() % 16 == 0
    if knobs.get("tma") and not aligned:
        raise ValueError(f"tma=True needs k's base address and row stride 16-byte aligned, got address "
                         f"{k.data_ptr():#x} and a row stride of {k.stride(0) * k.element_size()} bytes")
    launch = launch_config(T, HI, DI, max_keys, q.dtype, num_sms(q.device), has_tma(q.device) and aligned,
                           sequences=key_start.shape[0], **knobs)
    out = torch.empty(T, max_keys, dtype=torch.float32, device=q.device)
    if T == 0 or max_keys == 0:
        return out
    if N == 0:  # no key to see (a descriptor over no rows is not allowed)
        return out.fill_(float("-inf"))

    # Tiles of block_n (= 64) rows at row key_start[s] + n0: any offset, TMA addresses rows.
    k_desc = TensorDescriptor(k, [N, DI], [k.stride(0), 1], [launch.block_n, DI]) if launch.tma else None
    scales = k_scale.contiguous() if fp8 else k  # exact keys: never read
    key_start = key_start.to(torch.int32).contiguous()  # N < 2^31: every valid start fits
    _launch(out, q, w, k, k_desc, scales, key_start, seq_idx, key_len, launch, key_bound=N, stride_sb=1,
            stride_bt=1, contiguous=True)
    return out


def indexer_topk_chunked(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_idx: torch.Tensor, key_len: torch.Tensor, k: int, chunk_tokens: int,
                         key_len_host: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k keys of each query row as physical slots [T, k] int32 (block_id · 64 + offset), -1 where
    the row has fewer than k visible keys; chunk_tokens rows at a time so the logits buffer stays
    [chunk_tokens, longest key range of the chunk], each chunk's rows cut to k by the Triton
    selection of `megactx.kernels.topk`. Arguments as in `indexer_logits` and
    `reference.chunked_topk` (the twin is `reference.indexer_topk_chunked`)."""
    return chunked_topk(indexer_logits, topk_rows, q, w, index_cache, block_table, seq_idx, key_len, k,
                        chunk_tokens, key_len_host)
