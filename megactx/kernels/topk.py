"""Exact top-k of long rows (the DSA indexer's top-k) in Triton; twin: `reference.topk_rows`.

A row of L fp32 logits (L up to ~1M) gives the positions of its k largest values (k ~ 2048). The
work is a few reads of the row, so the aim is to read it as few times as possible and to keep the
arithmetic per element small enough that the reads stay the bottleneck.

Algorithm, per row (fp32 values are compared as order-preserving int32 keys, see `_key`):

1. Group maxima. The row is read once for the maxima of its M >= k groups, group g being every
   position p with p mod M = g. The k-th largest group maximum is a lower bound tau of the row's
   k-th largest value (the k groups whose maxima are >= tau hold k distinct elements >= tau); it is
   found on the M maxima alone, by a bitwise search on the top bits of their keys. Strided groups
   keep it tight whatever the row's shape, because any w neighbouring positions fall in min(w, M)
   groups: with M = 4 k, ~1.15 k elements are >= tau on i.i.d. rows, and 1.0-1.3 k on rows that
   trend, are smooth or blocky, sorted, or hold their top-k in one local window.
2. Collect. The row is read again; the elements > tau (positions and keys) are appended to a
   per-row candidate buffer of `candidates` entries, and the elements == tau are counted.
3. Select. When at least k elements are above tau, the buffer is loaded into registers and the exact
   k-th largest key theta is found by narrowing an interval of keys [lo, hi] with counts
   (`count(key >= pivot)`); elements > theta and enough elements == theta are written out, the rest
   of the row's k slots get -1. When fewer are, the k-th largest is tau itself: the whole buffer is
   written, then the lowest-positioned elements == tau, found by reading the row from its start only
   as far as the last one needed. That is the common case of heavy ties: an indexer's logits are
   ReLU'd, so a row with fewer than k positive logits has its k-th largest at 0.0, tied with every
   key the query scores 0 (in megactx-tiny's engine on a 32K needle haystack, 0.03-0.5% of the
   indexers' rows, with 200-800 zeros each, more the more keys the row has).

Rows of at most `candidates` keys skip 1 and 2 (the row itself is the buffer). When the buffer
overflows with elements above tau (an adversarial order of values), the row falls back to
narrowing over the row itself in one program: exact, but it reads the row ~8 more times.

Two launch plans, one set of steps: many short rows run one fused program per row, which also
lets the second read hit L2 (its collect appends in position order, with a scan); long rows
(decode, and prefill chunks from 2 x MIN_SEGMENT keys on) split each row over S programs for steps
1 and 2 (program s owns groups s·M/S .. (s+1)·M/S - 1, writing their maxima to a scratch, and
collects every S-th tile into the buffer, each candidate taking its slot from a per-row atomic
counter), with the threshold and the selection as small per-row kernels in between. No step reads
device data on the host, so the whole call can be captured in a CUDA graph.

Ties at the threshold go to the lowest positions, so the selected set is deterministic; the order
of positions within a row is not (the split plan appends candidates in whatever order the programs
run). NaN logits are not supported (a NaN is ordered by its bits: +NaN above +inf, -NaN below -inf).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from megactx.kernels.common import INTERPRET, cdiv, check_device, next_power_of_2
from megactx.kernels.reference import BLOCK_SIZE

# Key of -inf: masked-off and invisible elements load as -inf and are never selected.
NEG_KEY = tl.constexpr(-2139095041)  # (0xFF800000 ^ 0x7FFFFFFF) as int32
INT32_MAX = tl.constexpr(2**31 - 1)
PAGE = tl.constexpr(BLOCK_SIZE)  # keys a block of the paged cache


# ------------------------------------------------------------------------------ building blocks
@triton.jit
def _key(x):
    """fp32 -> int32 key with the same order (-0.0 sorts just below +0.0): non-negative floats keep
    their bits, negative floats flip their 31 low bits so that larger magnitudes sort lower."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _row_len(key_len_ptr, t, L, HAS_KEY_LEN: tl.constexpr):
    """Candidates of row t: key_len[t] clamped to [0, L] (all L without key_len)."""
    if HAS_KEY_LEN:
        n = tl.minimum(tl.maximum(tl.load(key_len_ptr + t), 0), L).to(tl.int32)
    else:
        n = tl.zeros([], tl.int32) + L  # a tensor even when Triton specializes L == 1
    return n


@triton.jit
def _full_steps(n, first, stride, extent):
    """How many steps i of a strided walk over row[:n] (step i covers first + i·stride up to
    first + i·stride + extent) lie wholly below n. Those load without a mask: a mask against an
    arbitrary row length would stop Triton from vectorizing the loads. At most one more step
    (starting below n) is partial, since stride >= extent."""
    return tl.maximum(n - first - extent + stride, 0) // stride


@triton.jit
def _group_maxima(row_ptr, n, first, M: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr):
    """Maxima of the G groups first .. first + G - 1 (mod M) of row[:n] -> keys [G] int32 (-inf's
    where a group is empty). A step loads ROWS chunks of G neighbours, M apart: [ROWS, G]."""
    chunk = tl.arange(0, ROWS)[:, None] * M + tl.arange(0, G)[None, :]
    m = tl.full([ROWS, G], float("-inf"), tl.float32)
    full = _full_steps(n, first, ROWS * M, (ROWS - 1) * M + G)
    for i in range(0, full):
        m = tl.maximum(m, tl.load(row_ptr + first + i * (ROWS * M) + chunk))
    pos = first + full * (ROWS * M) + chunk
    if first + full * (ROWS * M) < n:
        m = tl.maximum(m, tl.load(row_ptr + pos, mask=pos < n, other=float("-inf")))
    return _key(tl.max(m, axis=0))


@triton.jit
def _lower_bound(gkeys, k, PREFIX_BITS: tl.constexpr):
    """Largest key whose low 32 - PREFIX_BITS bits are 0 with at least k of gkeys >= it: a lower bound
    of the k-th largest of gkeys (within 2^-(PREFIX_BITS - 9) of it, relatively). Never below the key
    just above -inf, so -inf is never a candidate; with fewer than k finite gkeys every finite
    element passes."""
    # The search runs on p = key + 2^31 (the keys as unsigned, same order) in a scalar int64; the
    # comparisons stay in int32 so that the [GROUPS] tile does not double in registers.
    p = tl.zeros([], tl.int64)
    for b in tl.static_range(PREFIX_BITS):
        cand = p + (tl.full([], 1, tl.int64) << (31 - b))
        enough = tl.sum((gkeys >= (cand + (-2147483648)).to(tl.int32)).to(tl.int32)) >= k
        p = tl.where(enough, cand, p)
    return tl.maximum((p + (-2147483648)).to(tl.int32), NEG_KEY + 1)


@triton.jit
def _load_keys(row_ptr, pos, end, MASKED: tl.constexpr):
    """Keys of row[pos] (-inf's key at pos >= end when MASKED; unmasked loads vectorize)."""
    if MASKED:
        x = tl.load(row_ptr + pos, mask=pos < end, other=float("-inf"))
    else:
        x = tl.load(row_ptr + pos)
    return _key(x)


@triton.jit
def _collect_tile(row_ptr, s0, end, tau, buf_key_ptr, buf_idx_ptr, counter_ptr, count, ties, cap,
                  BLOCK: tl.constexpr, SUB: tl.constexpr, MASKED: tl.constexpr, ATOMIC: tl.constexpr):
    """Append the keys > tau of row[s0:s0 + BLOCK] (and their positions) to the buffer, the first
    `cap` of the row's, and count the keys == tau; (count, ties): this program's candidates and
    ties before -> after.

    A light pass over the whole tile only counts; the positions (a scan, and scattered stores with
    a 64-bit address each) are worked out SUB elements at a time, re-reading the tile from L1, so
    that the registers a program holds, and so the loads in flight per multiprocessor, are set by
    the light pass: only ~0.1-1% of the elements are candidates.

    ATOMIC (several programs share the row's buffer, so the order is not the row's anyway): one
    pass, each candidate taking its slot with an atomic increment of the row's counter. No scan: on
    an H200 the scanning collect of a 4096 x 128K causal chunk took 2.0 ms, 4 reads' worth of the
    row, against 0.5 ms for the group-maxima pass that reads it once."""
    if ATOMIC:  # (names of their own: Triton compiles both branches' variables into one scope)
        a_pos = s0 + tl.arange(0, BLOCK)
        a_keys = _load_keys(row_ptr, a_pos, end, MASKED)
        a_take = a_keys > tau
        a_slot = tl.atomic_add(counter_ptr + tl.zeros([BLOCK], tl.int32), 1, mask=a_take, sem="relaxed")
        a_keep = a_take & (a_slot < cap)
        tl.store(buf_key_ptr + a_slot, a_keys, mask=a_keep)
        tl.store(buf_idx_ptr + a_slot, a_pos, mask=a_keep)
        return count + tl.sum(a_take.to(tl.int32)), ties + tl.sum((a_keys == tau).to(tl.int32))
    light = _load_keys(row_ptr, s0 + tl.arange(0, BLOCK), end, MASKED)
    c = tl.sum((light > tau).to(tl.int32))
    e = tl.sum((light == tau).to(tl.int32))  # (counted here, so that the tile's keys die before the loop)
    if c > 0:
        base = count
        sub = tl.arange(0, SUB)
        for j in range(0, BLOCK, SUB):
            pos = s0 + j + sub
            keys = _load_keys(row_ptr, pos, end, MASKED)
            take = (keys > tau).to(tl.int32)
            cj = tl.sum(take)
            if cj > 0:
                slot = base + tl.cumsum(take, 0) - take
                keep = (take > 0) & (slot < cap)
                tl.store(buf_key_ptr + slot, keys, mask=keep)
                tl.store(buf_idx_ptr + slot, pos, mask=keep)
            base += cj
    return count + c, ties + e


@triton.jit
def _collect(row_ptr, n, first, stride, tau, buf_key_ptr, buf_idx_ptr, counter_ptr, cap,
             BLOCK: tl.constexpr, SUB: tl.constexpr, ATOMIC: tl.constexpr, STAGES: tl.constexpr):
    """Append the elements with key > tau of the tiles row[first + i·stride:][:BLOCK] (clipped to n)
    to the buffer -> (how many there were, all of them, also past `cap`; how many keys == tau).
    ATOMIC: several programs share the buffer and reserve space through counter_ptr; else this
    program owns it and appends in position order."""
    count = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    full = _full_steps(n, first, stride, BLOCK)
    for i in tl.range(0, full, num_stages=STAGES):
        count, ties = _collect_tile(row_ptr, first + i * stride, n, tau, buf_key_ptr, buf_idx_ptr, counter_ptr,
                                    count, ties, cap, BLOCK, SUB, False, ATOMIC)
    if first + full * stride < n:
        count, ties = _collect_tile(row_ptr, first + full * stride, n, tau, buf_key_ptr, buf_idx_ptr, counter_ptr,
                                    count, ties, cap, BLOCK, SUB, True, ATOMIC)
    return count, ties


@triton.jit
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """PIVOTS keys spread over (lo, hi] (lo < hi), ascending."""
    j = tl.arange(1, PIVOTS + 1).to(tl.int64)
    width = hi.to(tl.int64) - lo.to(tl.int64)
    return (lo.to(tl.int64) + (width * j + PIVOTS) // (PIVOTS + 1)).to(tl.int32)


@triton.jit
def _count_ge(keys, piv, PIVOTS: tl.constexpr):
    """keys [N], piv [PIVOTS] -> [PIVOTS] int32: how many keys are >= each pivot. Pivots go on the
    slow axis of the comparison: along lanes (the layout Triton picks for [N, P]) every thread
    would hold copies of its neighbours' keys."""
    if PIVOTS == 1:
        return tl.zeros([1], tl.int32) + tl.sum((keys >= tl.max(piv)).to(tl.int32))
    return tl.sum((keys[None, :] >= piv[:, None]).to(tl.int32), axis=1)


@triton.jit
def _narrow(lo, hi, c_lo, c_above, piv, cnt, k):
    """One narrowing step. Invariant: count(key >= lo) = c_lo >= k > c_above = count(key > hi), so the
    k-th largest key theta is in [lo, hi]; cnt[j] = count(key >= piv[j])."""
    ok = cnt >= k
    new_lo = tl.max(tl.where(ok, piv, lo))
    c_lo = tl.min(tl.where(ok, cnt, c_lo))  # counts fall as pivots rise: the one at new_lo
    hi = tl.min(tl.where(ok, hi, piv - 1))
    c_above = tl.max(tl.where(ok, c_above, cnt))
    return new_lo, hi, c_lo, c_above


@triton.jit
def _table_row(table_ptr, seq_ptr, t, stride_bt, HAS_TABLE: tl.constexpr):
    """Row t's block table: table[seq[t]] (unread without a table)."""
    if HAS_TABLE:
        table_ptr += tl.load(seq_ptr + t).to(tl.int64) * stride_bt
    return table_ptr


@triton.jit
def _store_picked(out_ptr, slot, pos, mask, table_ptr, HAS_TABLE: tl.constexpr):
    """out[slot] = pos, or with a block table (one sequence's row) the physical slot of key pos:
    table[pos // 64] · 64 + pos % 64."""
    if HAS_TABLE:
        pos = tl.load(table_ptr + pos // PAGE, mask=mask, other=0) * PAGE + pos % PAGE
    tl.store(out_ptr + slot, pos, mask=mask)


@triton.jit
def _pad(out_ptr, written, k, BLOCK: tl.constexpr):
    """out[written:k] = -1."""
    offs = tl.arange(0, BLOCK)
    for s0 in range(written - written % BLOCK, k, BLOCK):
        pos = s0 + offs
        tl.store(out_ptr + pos, -1, mask=(pos >= written) & (pos < k))


@triton.jit
def _select_tile(keys, idx, out_ptr, k, table_ptr, PIVOTS: tl.constexpr, BLOCK_OUT: tl.constexpr,
                 HAS_TABLE: tl.constexpr):
    """Exact top-k of one register tile of candidates: keys [N] int32 (NEG_KEY = none), idx [N]
    their positions. Writes the k (or all, if fewer) selected positions (slots, with a table) to
    out[0:k], -1 after."""
    finite = keys > NEG_KEY
    count = tl.sum(finite.to(tl.int32))
    theta = tl.full([], NEG_KEY, tl.int32)  # with <= k candidates every finite key is selected
    last_tie = tl.full([], INT32_MAX, tl.int32)
    if count > k:
        lo = tl.min(tl.where(finite, keys, INT32_MAX))
        hi = tl.max(keys)
        c_lo = count
        c_above = tl.zeros([], tl.int32)
        while lo < hi:
            piv = _pivots(lo, hi, PIVOTS)
            lo, hi, c_lo, c_above = _narrow(lo, hi, c_lo, c_above, piv, _count_ge(keys, piv, PIVOTS), k)
        theta = lo
        need = k - c_above  # of the c_lo - c_above keys equal to theta
        if c_lo - c_above > need:
            # Ties straddle k: keep the `need` lowest positions, found by bisecting on the position.
            tie = keys == theta
            first = tl.min(tl.where(tie, idx, INT32_MAX))
            last_tie = tl.max(tl.where(tie, idx, -1))
            while first < last_tie:
                mid = first + (last_tie - first) // 2
                if tl.sum((tie & (idx <= mid)).to(tl.int32)) >= need:
                    last_tie = mid
                else:
                    first = mid + 1
    take = (finite & ((keys > theta) | ((keys == theta) & (idx <= last_tie)))).to(tl.int32)
    slot = tl.cumsum(take, 0) - take
    _store_picked(out_ptr, slot, idx, take > 0, table_ptr, HAS_TABLE)
    _pad(out_ptr, tl.sum(take), k, BLOCK_OUT)


@triton.jit
def _select_stream(row_ptr, n, tau, kmax, count, out_ptr, k, table_ptr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                   COUNT_BLOCK: tl.constexpr, HAS_TABLE: tl.constexpr):
    """Exact top-k of row[0:n] when its candidates overflowed the buffer: count(key >= tau) = count
    > k, no key above kmax. Narrows [tau, kmax] with PIVOTS counts per read of the row (COUNT_BLOCK
    elements a step, so that the [COUNT_BLOCK, PIVOTS] comparison fits in registers), then writes
    elements > theta and the lowest-positioned ties in one more read."""
    lo = tau
    hi = kmax
    c_lo = count
    c_above = tl.zeros([], tl.int32)
    sub = tl.arange(0, COUNT_BLOCK)
    while lo < hi:
        piv = _pivots(lo, hi, PIVOTS)
        cnt = tl.zeros([PIVOTS], tl.int32)
        for s0 in range(0, n, COUNT_BLOCK):
            keys = _key(tl.load(row_ptr + s0 + sub, mask=s0 + sub < n, other=float("-inf")))
            cnt += _count_ge(keys, piv, PIVOTS)
        lo, hi, c_lo, c_above = _narrow(lo, hi, c_lo, c_above, piv, cnt, k)
    need = k - c_above
    offs = tl.arange(0, BLOCK)
    written = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for s0 in range(0, n, BLOCK):
        pos = s0 + offs
        keys = _key(tl.load(row_ptr + pos, mask=pos < n, other=float("-inf")))
        tie = (keys == lo).to(tl.int32)
        rank = ties + tl.cumsum(tie, 0) - tie  # ties met so far, in position order
        take = ((keys > lo) | ((tie > 0) & (rank < need))).to(tl.int32)
        slot = written + tl.cumsum(take, 0) - take
        _store_picked(out_ptr, slot, pos, take > 0, table_ptr, HAS_TABLE)
        written += tl.sum(take)
        ties += tl.sum(tie)
    _pad(out_ptr, written, k, BLOCK)


@triton.jit
def _first_ties(row_ptr, n, tau, need, out_ptr, table_ptr, BLOCK: tl.constexpr, HAS_TABLE: tl.constexpr):
    """The `need` lowest positions of row[0:n] whose key is tau (there are at least that many) ->
    out[0:need], reading the row from its start only as far as the last of them."""
    offs = tl.arange(0, BLOCK)
    found = tl.zeros([], tl.int32)
    s0 = tl.zeros([], tl.int32)
    while (found < need) & (s0 < n):  # (s0 < n: a guard; the ties counted are all in row[0:n])
        pos = s0 + offs
        tie = (_key(tl.load(row_ptr + pos, mask=pos < n, other=float("-inf"))) == tau).to(tl.int32)
        slot = found + tl.cumsum(tie, 0) - tie
        _store_picked(out_ptr, slot, pos, (tie > 0) & (slot < need), table_ptr, HAS_TABLE)
        found += tl.sum(tie)
        s0 += BLOCK


@triton.jit
def _select_row(row_ptr, n, buf_key_ptr, buf_idx_ptr, count, ties, tau, kmax, out_ptr, k, cap, table_ptr,
                CAP_PAD: tl.constexpr, BLOCK: tl.constexpr, TILE_PIVOTS: tl.constexpr, ROW_PIVOTS: tl.constexpr,
                COUNT_BLOCK: tl.constexpr, HAS_TABLE: tl.constexpr):
    """Step 3 for one row: from the row itself (n <= cap); from the buffer of the `count` keys > tau
    (count <= cap), with the lowest-positioned of the `ties` keys == tau after them when fewer than
    k are above tau (the k-th largest is then tau itself); or the fallback."""
    offs = tl.arange(0, CAP_PAD)
    if n <= cap:
        keys = _key(tl.load(row_ptr + offs, mask=offs < n, other=float("-inf")))
        _select_tile(keys, offs, out_ptr, k, table_ptr, TILE_PIVOTS, BLOCK, HAS_TABLE)
    elif count <= cap:
        ok = offs < count
        keys = tl.load(buf_key_ptr + offs, mask=ok, other=NEG_KEY)
        idx = tl.load(buf_idx_ptr + offs, mask=ok, other=0)
        _select_tile(keys, idx, out_ptr, tl.minimum(count, k), table_ptr, TILE_PIVOTS, BLOCK, HAS_TABLE)
        if count < k:
            need = tl.minimum(k - count, ties)
            _first_ties(row_ptr, n, tau, need, out_ptr + count, table_ptr, BLOCK, HAS_TABLE)
            _pad(out_ptr, count + need, k, BLOCK)
    else:
        _select_stream(row_ptr, n, tau, kmax, count + ties, out_ptr, k, table_ptr, BLOCK, ROW_PIVOTS, COUNT_BLOCK,
                       HAS_TABLE)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _topk_fused_kernel(logits_ptr, key_len_ptr, out_ptr, buf_key_ptr, buf_idx_ptr, table_ptr, seq_ptr,
                       L, stride_t, stride_o, stride_bt, k, cap,
                       HAS_KEY_LEN: tl.constexpr, HAS_TABLE: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr,
                       BLOCK: tl.constexpr, SUB: tl.constexpr, CAP_PAD: tl.constexpr, PREFIX_BITS: tl.constexpr,
                       TILE_PIVOTS: tl.constexpr, ROW_PIVOTS: tl.constexpr, COUNT_BLOCK: tl.constexpr,
                       STAGES: tl.constexpr, SELECT_BLOCK: tl.constexpr):
    """One program per row: group maxima, threshold, collect, select."""
    t = tl.program_id(0).to(tl.int64)
    n = _row_len(key_len_ptr, t, L, HAS_KEY_LEN)
    row = logits_ptr + t * stride_t
    buf_key = buf_key_ptr + t * cap
    buf_idx = buf_idx_ptr + t * cap
    tau = tl.full([], NEG_KEY + 1, tl.int32)
    kmax = tl.full([], NEG_KEY, tl.int32)
    count = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    if n > cap:
        gkeys = _group_maxima(row, n, 0, GROUPS, ROWS, GROUPS)
        tau = _lower_bound(gkeys, k, PREFIX_BITS)
        kmax = tl.max(gkeys)
        count, ties = _collect(row, n, 0, BLOCK, tau, buf_key, buf_idx, buf_key, cap, BLOCK, SUB, False, STAGES)
    # The select step reads back buffer entries other warps of this program stored: without a
    # barrier some reads saw stale memory (a few rows in a thousand went wrong on an H200).
    tl.debug_barrier()
    _select_row(row, n, buf_key, buf_idx, count, ties, tau, kmax, out_ptr + t * stride_o, k, cap,
                _table_row(table_ptr, seq_ptr, t, stride_bt, HAS_TABLE), CAP_PAD, SELECT_BLOCK, TILE_PIVOTS,
                ROW_PIVOTS, COUNT_BLOCK, HAS_TABLE)


# The split plan: per-row state [T, 4] int32 = (tau, kmax, candidates (keys > tau), keys == tau).
@triton.jit
def _group_max_kernel(logits_ptr, key_len_ptr, maxima_ptr, L, stride_t, cap,
                      HAS_KEY_LEN: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr):
    """Program (t, s): the maxima of groups s·G .. (s+1)·G - 1 of row t -> maxima[t, s·G:]."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = _row_len(key_len_ptr, t, L, HAS_KEY_LEN)
    if n > cap:  # shorter rows are selected directly
        gkeys = _group_maxima(logits_ptr + t * stride_t, n, s * G, M, ROWS, G)
        tl.store(maxima_ptr + t * M + s * G + tl.arange(0, G), gkeys)


@triton.jit
def _threshold_kernel(key_len_ptr, maxima_ptr, state_ptr, L, k, cap,
                      HAS_KEY_LEN: tl.constexpr, M: tl.constexpr, PREFIX_BITS: tl.constexpr):
    """Program t: tau and kmax of row t from its M group maxima; zero its counters."""
    t = tl.program_id(0).to(tl.int64)
    n = _row_len(key_len_ptr, t, L, HAS_KEY_LEN)
    tau = tl.full([], NEG_KEY + 1, tl.int32)
    kmax = tl.full([], NEG_KEY, tl.int32)
    if n > cap:
        gkeys = tl.load(maxima_ptr + t * M + tl.arange(0, M))
        tau = _lower_bound(gkeys, k, PREFIX_BITS)
        kmax = tl.max(gkeys)
    state = state_ptr + t * 4
    tl.store(state, tau)
    tl.store(state + 1, kmax)
    tl.store(state + 2, 0)
    tl.store(state + 3, 0)


@triton.jit
def _collect_kernel(logits_ptr, key_len_ptr, state_ptr, buf_key_ptr, buf_idx_ptr, L, stride_t, cap,
                    HAS_KEY_LEN: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, STAGES: tl.constexpr):
    """Program (t, s): append the candidates of tiles s, s + S, s + 2 S, ... of row t to its buffer
    (interleaved, so that the programs of a causal row's share stay even)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = _row_len(key_len_ptr, t, L, HAS_KEY_LEN)
    if n > cap:
        state = state_ptr + t * 4
        _, ties = _collect(logits_ptr + t * stride_t, n, s * BLOCK, tl.num_programs(1) * BLOCK, tl.load(state),
                           buf_key_ptr + t * cap, buf_idx_ptr + t * cap, state + 2, cap, BLOCK, SUB, True, STAGES)
        if ties > 0:
            tl.atomic_add(state + 3, ties, sem="relaxed")


@triton.jit
def _select_kernel(logits_ptr, key_len_ptr, state_ptr, buf_key_ptr, buf_idx_ptr, out_ptr, table_ptr, seq_ptr,
                   L, stride_t, stride_o, stride_bt, k, cap,
                   HAS_KEY_LEN: tl.constexpr, HAS_TABLE: tl.constexpr, CAP_PAD: tl.constexpr,
                   SELECT_BLOCK: tl.constexpr, TILE_PIVOTS: tl.constexpr, ROW_PIVOTS: tl.constexpr,
                   COUNT_BLOCK: tl.constexpr):
    """Program t: step 3 for row t."""
    t = tl.program_id(0).to(tl.int64)
    n = _row_len(key_len_ptr, t, L, HAS_KEY_LEN)
    state = state_ptr + t * 4
    count, ties, tau, kmax = tl.load(state + 2), tl.load(state + 3), tl.load(state), tl.load(state + 1)
    _select_row(logits_ptr + t * stride_t, n, buf_key_ptr + t * cap, buf_idx_ptr + t * cap, count, ties, tau, kmax,
                out_ptr + t * stride_o, k, cap, _table_row(table_ptr, seq_ptr, t, stride_bt, HAS_TABLE), CAP_PAD,
                SELECT_BLOCK, TILE_PIVOTS, ROW_PIVOTS, COUNT_BLOCK, HAS_TABLE)


# ------------------------------------------------------------------------------ host side
@dataclass(frozen=True)
class TopkConfig:
    """Tuning knobs of `topk_rows` (benchmarks/tune_topk.py sweeps them). Sizes are in elements and
    powers of two; None = the default of the launch plan the call takes (`FUSED`, `SPLIT`).

    block: tile of a streaming pass that collects candidates (its light, counting part).
    sub_block: tile of the heavy part (scan and scattered stores) of the fused plan's collect pass
        (the split plan's atomic collect has none: it does not read this knob).
    select_block: tile of the select step's reads of the row (rows of at most `candidates` keys, the
        ties at the threshold, the overflow fallback): scans and scattered stores too. None = the
        fused plan's sub_block (at its block, 4096, Triton 3.6 gave the fused kernel 172 registers,
        one program a multiprocessor; 2048: 127, two), the split plan's block.
    max_tile: elements a step of the group-maxima pass loads (at least the program's groups).
        That loop is not pipelined (it did not help), so a step's size sets the bytes in flight.
    num_warps: warps a program.
    stages: tiles of the collect pass in flight in a program (Triton's software pipelining of
        the loop's loads; 1 = none).
    candidates: candidate buffer entries per row (>= k; the select step holds them in registers);
        None = max(512, 2 k rounded up to a power of two). Rows with at most this many keys skip the
        first two steps.
    groups: group maxima per row behind the first threshold (>= k); more make it tighter (fewer
        candidates) at the cost of a longer search. None = 4 k, in [1024, 16384].
    programs_per_row: 1 = the fused plan, > 1 = the split plan with that many programs a row;
        None = about 4 programs a multiprocessor, each on at least `MIN_SEGMENT` elements.
    tile_pivots / row_pivots: counts per narrowing step in the select step, for the register tile and
        for the overflow fallback over the row (a step narrows the key range by pivots + 1).
        tile_pivots None = 1 on a GPU (a step is cheap there; more pivots cost registers) and
        INTERPRETER_TILE_PIVOTS under the interpreter, which pays per operation rather than per
        element (32 one-pivot steps a row made the CPU tests of the whole model crawl).
    max_registers: a thread's register cap for every launch (Triton's maxnreg); None = the
        compiler's choice."""

    block: int | None = None
    sub_block: int | None = None
    max_tile: int | None = None
    num_warps: int | None = None
    stages: int | None = None
    candidates: int | None = None
    groups: int | None = None
    programs_per_row: int | None = None
    tile_pivots: int | None = None
    row_pivots: int = 16
    select_block: int | None = None
    max_registers: int | None = None
    INTERPRETER_TILE_PIVOTS = 64

    def pivots_of_tile(self, interpret: bool) -> int:
        """tile_pivots as a launch takes it: the knob, else 1 on a GPU, INTERPRETER_TILE_PIVOTS under the
        interpreter."""
        return self.tile_pivots or (self.INTERPRETER_TILE_PIVOTS if interpret else 1)

    # The fused plan holds the select step's register tile in the same kernel as the streaming
    # passes: with <= 128 registers a thread two 8-warp programs share a multiprocessor (one's
    # selection overlaps the other's loads) with 64 KB of loads in flight between them. Under
    # Triton 3.6 (the H200 image's; `megactx bench compile`) its select step's passes over the row
    # at the collect's 4096-element block took it to 172-186 registers at k = 128, one program a
    # multiprocessor; at sub_block's 2048 (select_block's default) 125-127. At k = 2048 the
    # [4096] candidate and [8192] group-maxima tiles hold it at 171 (Triton 3.9: 128);
    # max_registers = 128 keeps two programs at 72 B of spill. Timed on the H200 (2026-12-05,
    # tune_topk.py --sweep max_registers select_block --cases short, 4096 x 8K causal) neither
    # buys time: select_block 512 / 2048 / 4096 0.331 / 0.333 / 0.335 ms at k = 128, a cap of 128
    # +1-2% at k = 128 and 2048, a cap of 168 1.5x slower (benchmarks/README.md). The split
    # plan's streaming kernels take ~56 registers and run four programs a multiprocessor. Timed on
    # an H200 (benchmarks/tune_topk.py, k = 2048):
    # fused sub_block 2048 beat 512 by 1.3x (4096 x 64K causal: 1.84 vs 2.40 ms; 1024 x 128K: 0.91
    # vs 1.19 ms); split with 4 warps beat 8 by 1.3x (64 x 1M: 0.33 vs 0.43 ms; 256 x 1M: 1.16 vs
    # 1.59 ms) — 2.6x faster than torch.topk. With the split plan's atomic collect (one read, no
    # scan), 1024-element tiles beat 2048 / 4096 / 8192 on 4096 x 128K causal (1.90 / 2.00 / 3.02 /
    # 3.86 ms; the fused plan 3.38) and on 1024 x 128K (0.57 / 0.61 / 0.86 / 1.03; fused 0.91).
    # Its loop of tiles then waited on each tile's loads (and its atomics) before loading the next:
    # pipelined 3 deep it takes 1.62 ms (512-element tiles; 1024: 1.66, 1 / 2 / 4 / 6 deep 1.90 /
    # 1.74 / 1.73 / 1.74), and 1024 x 512K 1.50 -> 1.26 ms. Pipelining the group-maxima pass (its
    # steps already load 4096 elements) changed nothing, nor did it help the fused plan (slower).
    FUSED = MappingProxyType(dict(block=4096, sub_block=2048, max_tile=8192, num_warps=8, stages=1))
    # no sub_block: its collect has no scan
    SPLIT = MappingProxyType(dict(block=512, max_tile=4096, num_warps=4, stages=3))
    PROGRAMS_PER_SM = 4
    # Elements a program of the split plan, at the least: 4096 x 16K causal chunks took 0.55 ms split
    # in two (pipelined collect) against 0.69 fused.
    MIN_SEGMENT = 8192
    # Programs a row once rows are long enough for two segments, however many rows: the split plan's
    # atomic collect reads a row once, the fused plan's ordered one also scans it (H200, 4096 x 128K
    # causal chunk: 2.8 ms split, 3.4 fused, before the atomic collect).
    MIN_SPLIT = 2
    PREFIX_BITS = 16  # of the first threshold: 7 mantissa bits, within 1% of the k-th group maximum
    MAX_GROUPS = 16384  # the threshold step holds them in registers
    MAX_K = 8192  # 2 k candidates in registers: clean up to k = 4096, spilling (slower) beyond (sm_90)
    CPU_SMS = 4  # multiprocessors assumed under the interpreter
    MIN_COUNT_BLOCK = 256  # elements a step of the fallback's counts, at the least


def _pow2(name: str, value: int) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


@dataclass(frozen=True)
class TopkPlan:
    """Launch geometry of a call, from (T, L, k) and a TopkConfig: `TopkPlan.make(...)` tells which
    plan and sizes `topk_rows` would use (the benchmark prints it)."""

    cap: int
    cap_pad: int
    groups: int
    split: int  # programs a row in the streaming passes; 1 = the fused plan
    seg_groups: int  # group maxima a program
    rows: int  # chunks of seg_groups elements a step of the group-maxima pass loads
    block: int
    sub_block: int
    select_block: int  # elements a step of the select step's passes over the row
    count_block: int  # elements a step of the fallback's counts
    num_warps: int
    stages: int  # collect tiles in flight a program

    @staticmethod
    def make(T: int, L: int, k: int, cfg: TopkConfig, device: torch.device) -> TopkPlan:
        if k > cfg.MAX_K:
            raise ValueError(f"k = {k} is above {cfg.MAX_K}, the most this kernel selects (its select step holds "
                             "2 k candidates in registers); use torch.topk (megactx.kernels.reference.topk_rows)")
        cap = cfg.candidates if cfg.candidates is not None else max(512, next_power_of_2(2 * k))
        if cap < k:
            raise ValueError(f"candidates must be at least k = {k}, got {cap}")
        groups = cfg.groups if cfg.groups is not None else min(max(1024, next_power_of_2(4 * k)), cfg.MAX_GROUPS)
        if _pow2("groups", groups) < k or groups > cfg.MAX_GROUPS:
            raise ValueError(f"groups must be in [k, {cfg.MAX_GROUPS}] = [{k}, {cfg.MAX_GROUPS}], got {groups}")
        if cfg.programs_per_row is not None:
            split = _pow2("programs_per_row", cfg.programs_per_row)
        elif device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            split = next_power_of_2(cdiv(cfg.PROGRAMS_PER_SM * sms, T))
        else:
            split = next_power_of_2(cdiv(cfg.PROGRAMS_PER_SM * cfg.CPU_SMS, T))
        if cfg.programs_per_row is None:
            most = max(1, L // cfg.MIN_SEGMENT)
            split = min(max(split, cfg.MIN_SPLIT), 1 << (most.bit_length() - 1))
        if L <= cap:
            split = 1  # every row is selected directly: nothing to split
        split = min(split, groups)  # at least one group maximum a program
        knobs = {**(cfg.FUSED if split == 1 else cfg.SPLIT),
                 **{name: getattr(cfg, name) for name in ("block", "sub_block", "max_tile", "num_warps", "stages")
                    if getattr(cfg, name) is not None}}
        for name in ("block", "sub_block", "max_tile", "tile_pivots", "row_pivots", "select_block"):
            if knobs.get(name, getattr(cfg, name)) is not None:
                _pow2(name, knobs.get(name, getattr(cfg, name)))
        block = knobs["block"]
        sub_block = min(knobs.get("sub_block", block), block)
        select_block = cfg.select_block or (sub_block if split == 1 else block)
        seg_groups = groups // split
        return TopkPlan(cap=cap, cap_pad=next_power_of_2(cap), groups=groups, split=split, seg_groups=seg_groups,
                        rows=max(1, knobs["max_tile"] // seg_groups), block=block, sub_block=sub_block,
                        select_block=select_block,
                        count_block=max(cfg.MIN_COUNT_BLOCK, block // cfg.row_pivots), num_warps=knobs["num_warps"],
                        stages=knobs["stages"])


def topk_rows(logits: torch.Tensor, k: int, key_len: torch.Tensor | None = None, out: torch.Tensor | None = None,
              *, block_table: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
              config: TopkConfig | None = None) -> torch.Tensor:
    """Exact top-k positions of every row (twin: reference.topk_rows).

    logits: [T, L] fp32, any row stride, last dim contiguous; -inf = not a candidate, NaN not
    allowed. key_len: [T] int32/int64 or None; only the first key_len[t] entries of row t are
    candidates (None = all L; clamped to [0, L]). out: optional [T, k] int32 to write into (last dim
    contiguous). Returns out: [T, k] int32 positions of the k largest candidates of each row, in no
    particular order; a row with fewer than k finite candidates lists them all and then -1s.
    block_table [S, max_blocks] int32 and seq_idx [T] (row t's keys are those of sequence
    seq_idx[t]): out holds the physical slots of the selected keys instead (block · 64 + offset,
    `reference.logical_to_slots`), written by the selection itself.
    The selected values are those of torch.topk; among values equal to the k-th largest, the lowest
    positions are taken. No host syncs (CUDA-graph capturable). Scratch per call: ~2·candidates
    int32 a row (plus `groups` a row when rows are split over programs)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a 2-D float32 tensor [T, L], got {logits.dtype} {tuple(logits.shape)}")
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError("logits' last dim must be contiguous (a row stride is fine); pass logits.contiguous()")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    T, L = logits.shape
    if L >= 2**31:
        raise ValueError(f"rows of {L} keys do not fit int32 positions")
    if key_len is not None and (key_len.shape != (T,) or key_len.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"key_len must be int32/int64 [{T}], got {key_len.dtype} {tuple(key_len.shape)}")
    if out is None:
        out = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    elif out.shape != (T, k) or out.dtype != torch.int32 or (k > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be int32 [{T}, {k}] with a contiguous last dim, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if (block_table is None) != (seq_idx is None):
        raise ValueError("pass block_table and seq_idx together (positions -> physical slots), or neither")
    if block_table is not None and (block_table.dim() != 2 or block_table.dtype != torch.int32
                                    or block_table.stride(1) != 1 or seq_idx.shape != (T,)):
        raise ValueError(f"block_table must be int32 [S, max_blocks] with a contiguous last dim and seq_idx [{T}]; "
                         f"got {block_table.dtype} {tuple(block_table.shape)} and {tuple(seq_idx.shape)}")
    check_device(logits, out, *(t for t in (key_len, block_table, seq_idx) if t is not None))
    if T == 0 or k == 0:
        return out

    cfg = config or TopkConfig()
    plan = TopkPlan.make(T, L, k, cfg, logits.device)
    has_key_len = key_len is not None
    key_len = key_len.contiguous() if has_key_len else out  # unread without HAS_KEY_LEN
    buffer_rows = T if L > plan.cap else 1  # rows of <= cap keys never touch the buffer
    buf_key = torch.empty(buffer_rows, plan.cap, dtype=torch.int32, device=logits.device)
    buf_idx = torch.empty_like(buf_key)
    has_table = block_table is not None
    table, seq = (block_table, seq_idx) if has_table else (out, out)  # unread without HAS_TABLE
    stride_bt = block_table.stride(0) if has_table else 0
    common = dict(HAS_KEY_LEN=has_key_len, num_warps=plan.num_warps,
                  **({"maxnreg": cfg.max_registers} if cfg.max_registers is not None else {}))
    tile_pivots = cfg.pivots_of_tile(INTERPRET)
    select = dict(CAP_PAD=plan.cap_pad, SELECT_BLOCK=plan.select_block, TILE_PIVOTS=tile_pivots,
                  ROW_PIVOTS=cfg.row_pivots, COUNT_BLOCK=plan.count_block)

    if plan.split == 1:
        _topk_fused_kernel[(T,)](
            logits, key_len, out, buf_key, buf_idx, table, seq, L, logits.stride(0), out.stride(0), stride_bt, k,
            plan.cap, HAS_TABLE=has_table, ROWS=plan.rows, GROUPS=plan.groups, BLOCK=plan.block, SUB=plan.sub_block,
            PREFIX_BITS=cfg.PREFIX_BITS, STAGES=plan.stages, **select, **common)
        return out

    maxima = torch.empty(T, plan.groups, dtype=torch.int32, device=logits.device)
    state = torch.empty(T, 4, dtype=torch.int32, device=logits.device)
    _group_max_kernel[(T, plan.split)](
        logits, key_len, maxima, L, logits.stride(0), plan.cap,
        M=plan.groups, ROWS=plan.rows, G=plan.seg_groups, **common)
    _threshold_kernel[(T,)](key_len, maxima, state, L, k, plan.cap, M=plan.groups,
                            PREFIX_BITS=cfg.PREFIX_BITS, **common)
    _collect_kernel[(T, plan.split)](
        logits, key_len, state, buf_key, buf_idx, L, logits.stride(0), plan.cap,
        BLOCK=plan.block, SUB=plan.sub_block, STAGES=plan.stages, **common)
    _select_kernel[(T,)](logits, key_len, state, buf_key, buf_idx, out, table, seq, L, logits.stride(0), out.stride(0),
                         stride_bt, k, plan.cap, HAS_TABLE=has_table, **select, **common)
    return out


def select_paths(logits: torch.Tensor, k: int, key_len: torch.Tensor | None = None,
                 config: TopkConfig | None = None) -> list[str]:
    """Which path of the select step each row of `logits` [T, L] takes in `topk_rows` (same
    arguments), by the kernel's own rule, worked out on the host: "direct" (at most `candidates`
    keys: the row is its own buffer), "buffer" (at least k keys above the first threshold, all in
    the buffer), "ties" (fewer than k above it: those, then the lowest ties at it) or "fallback"
    (the buffer overflowed: one program narrows over the whole row, reading it ~8 more times).
    A row's cost depends on its path: for tests and diagnostics (scripts/layer0-indexer.py)."""
    cfg = config or TopkConfig()
    plan = TopkPlan.make(*logits.shape, k, cfg, torch.device("cpu"))  # (cap and groups: any device's)
    x = logits.float().cpu()
    n = torch.full((x.shape[0],), x.shape[1]) if key_len is None else key_len.cpu().clamp(0, x.shape[1])
    neg = NEG_KEY.value  # the key of -inf
    paths = []
    for row, length in zip(x, n.tolist()):
        if length <= plan.cap:
            paths.append("direct")
            continue
        bits = row[:length].contiguous().view(torch.int32).long()
        keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # `_key`: the order of the values
        pad = (-length) % plan.groups
        groups = torch.cat([keys, torch.full((pad,), neg)]).view(-1, plan.groups).amax(0) + 2**31
        p = 0
        for b in range(cfg.PREFIX_BITS):  # `_lower_bound`, on the keys as unsigned
            if int((groups >= p + (1 << (31 - b))).sum()) >= k:
                p += 1 << (31 - b)
        tau = max(p - 2**31, neg + 1)
        above = int((keys > tau).sum())
        paths.append("fallback" if above > plan.cap else "buffer" if above >= k else "ties")
    return paths


__all__ = ["TopkConfig", "TopkPlan", "select_paths", "topk_rows"]
