"""The Triton indexer kernel against its twin (reference.indexer_logits) and against the exact,
unquantized indexer. On a CPU the kernel runs in the Triton interpreter, so shapes stay small."""

from __future__ import annotations

import pytest
import torch

from megactx.kernels import reference as ref
from megactx.kernels.indexer import (
    FP8_COLUMNS,
    FP8_MAX_REGISTERS,
    MAX_WAVES,
    PROGRAM_OVERHEAD_TILES,
    PROGRAMS_PER_SM,
    choose_num_splits,
    indexer_logits,
    indexer_logits_contiguous,
    indexer_topk_chunked,
    launch_config,
)
from megactx.model.quant import FP8, hadamard, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Kernel vs twin on the same FP8 inputs. The interpreter differs only in fp32 summation order;
# Hopper's FP8 tensor cores accumulate with fewer bits (measured ~4e-4 of a row's max at DI = 128).
TOL = 2e-3 if DEVICE == "cuda" else 1e-5
LENS = (1, 63, 64, 65, 200)  # around the 64-token block edges, in one batch


def _paged_keys(lens, DI, gen, device=DEVICE, spare=3, dtype=torch.uint8):
    """Random keys of each sequence [L_b, DI] fp32 written into an indexer cache whose physical
    blocks are shuffled; spare blocks hold garbage keys that no query may see.
    -> (index_cache, block_table [B, max_blocks] int32 (-1 past the end), keys list)."""
    counts = [-(-L // ref.BLOCK_SIZE) for L in lens]
    num_blocks = sum(counts) + spare
    cache = ref.alloc_index_cache(num_blocks, DI, device=device, dtype=dtype)
    kv = ref.alloc_kv_cache(num_blocks, 128, 64, fp8=False, device=device)  # write_kv needs one; unused here
    block_table = torch.full((len(lens), max(counts)), -1, dtype=torch.int32, device=device)
    perm = torch.randperm(num_blocks, generator=gen).to(device)
    keys, used = [], 0
    for b, (L, c) in enumerate(zip(lens, counts)):
        block_table[b, :c] = perm[used : used + c].int()
        used += c
        keys.append(torch.randn(L, DI, generator=gen).to(device))
    garbage = perm[used:].repeat_interleave(ref.BLOCK_SIZE) * ref.BLOCK_SIZE + torch.arange(
        ref.BLOCK_SIZE, device=device).repeat(spare)
    for slots, k in [(_slots(block_table[b], len(k)), k) for b, k in enumerate(keys)] + [
            (garbage, 100 * torch.randn(len(garbage), DI, generator=gen).to(device))]:
        n = len(slots)
        ref.write_kv(torch.zeros(n, 128, device=device), torch.zeros(n, 64, device=device), slots, kv, k, cache)
    return cache, block_table, keys


def _slots(table_row, L):
    pos = torch.arange(L, device=table_row.device)
    return table_row[pos // ref.BLOCK_SIZE].long() * ref.BLOCK_SIZE + pos % ref.BLOCK_SIZE


def _rows(lens, prefill, decode):
    """Query rows: causal prefill of the whole of each sequence in `prefill`, and the last
    `decode[b]` positions of sequence b (speculative verify; a count > L also gives rows seeing no
    key). -> (seq_idx [T], key_len [T]) int32."""
    seq, klen = [], []
    for b in prefill:
        seq += [b] * lens[b]
        klen += range(1, lens[b] + 1)
    for b, n in decode.items():
        seq += [b] * n
        klen += [max(lens[b] - n + 1 + j, 0) for j in range(n)]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return as_tensor(seq), as_tensor(klen)


def _fp8_queries(T, HI, DI, gen):
    q = torch.randn(T, HI, DI, generator=gen) * 3
    q8, q_scale = quantize_rows(q)
    w = torch.randn(T, HI, generator=gen) * q_scale * (HI * DI) ** -0.5  # scales folded in, as the model does
    return q8.to(DEVICE), w.to(DEVICE)


def _assert_close_to_twin(got, want):
    visible = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), visible), "the kernel masks other keys than the twin"
    assert (got[~visible] == float("-inf")).all()
    row_max = want.masked_fill(~visible, 0).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((got - want).abs() / row_max)[visible]  # only the fp32 summation order differs
    assert err.numel() == 0 or err.max() < TOL, f"max error {err.max():.2e} of the row max"


# ------------------------------------------------------------------------------ kernel vs twin
@pytest.mark.parametrize("HI,DI", [(4, 64), (32, 64), (16, 128)])  # padded and unpadded heads, both widths
def test_logits_match_twin_prefill_and_decode_rows(HI, DI):
    gen = torch.Generator().manual_seed(HI * 1000 + DI)
    cache, block_table, _ = _paged_keys(LENS, DI, gen)
    # causal prefill of the short sequences, a speculative-verify batch of several rows on the rest
    seq_idx, key_len = _rows(LENS, prefill=[0, 1, 3], decode={2: 3, 4: 5})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    max_keys = 256  # past every key_len: those columns must be -inf
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, max_keys)
    assert got.shape == (len(seq_idx), max_keys) and got.dtype == torch.float32
    _assert_close_to_twin(got, ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, max_keys))


# Launch variants: every tile shape and path of the kernel (None = the defaults: pages by TMA,
# which the interpreter emulates; tma=False gathers by address; num_splits cuts every row's keys
# at split boundaries that fall inside sequences and inside causal ranges).
TILINGS = {
    "bm1": dict(block_m=1), "bm2-bn128": dict(block_m=2, block_n=128), "gather": dict(tma=False),
    "two-dots": dict(block_m=16, num_dots=2),
    "splits3": dict(num_splits=3), "gather-splits2-dots": dict(tma=False, block_m=4, num_dots=2, num_splits=2),
    "stages1": dict(num_stages=1, lone_stages=1),
}


@pytest.mark.parametrize("knobs", TILINGS.values(), ids=TILINGS.keys())
def test_logits_match_twin_any_tiling_and_row_order(knobs):
    """Rows of different sequences interleaved (tiles of several groups), rows that see no key,
    and tiles both narrower and wider than a sequence, under every launch variant."""
    HI, DI = 16, 64
    gen = torch.Generator().manual_seed(len(str(knobs)))
    cache, block_table, _ = _paged_keys(LENS, DI, gen)
    seq_idx, key_len = _rows(LENS, prefill=[1], decode={0: 3, 2: 4, 3: 2, 4: 6})
    order = torch.randperm(len(seq_idx), generator=gen).to(DEVICE)
    order[:20] = order[:20].sort().values  # some adjacent rows of one sequence: tiles of one group
    seq_idx, key_len = seq_idx[order], key_len[order]
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, 300, **knobs)
    _assert_close_to_twin(got, ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, 300))


@pytest.mark.parametrize("HI,knobs", [(4, {}), (2, {}), (4, dict(block_m=2)), (2, dict(block_m=4, num_dots=2)),
                                      (4, dict(block_m=1)), (1, dict(block_m=8, tma=False))])
def test_logits_match_twin_few_heads(HI, knobs):
    """Fewer than 16 heads (megactx-tiny has 4): a block of rows pads its heads only as far as its
    dot needs (N = rows x heads >= 16), a lone row to 16; groups, lone rows and rows of other
    sequences in one block."""
    DI = 64
    gen = torch.Generator().manual_seed(HI * 100 + len(str(knobs)))
    cache, block_table, _ = _paged_keys(LENS, DI, gen)
    seq_idx, key_len = _rows(LENS, prefill=[0, 3], decode={1: 1, 2: 3, 4: 5})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, 256, **knobs)
    _assert_close_to_twin(got, ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, 256))


def test_logits_causal_prefill_with_key_splits():
    """A causal prefill cut into key splits: programs of the upper triangle only write -inf, the
    split holding a row's diagonal ends mid-tile, and every element is written exactly once
    (the output starts as torch.empty, so a missed element would not be -inf or the twin's)."""
    HI, DI = 4, 64
    gen = torch.Generator().manual_seed(3)
    lens = (150,)
    cache, block_table, _ = _paged_keys(lens, DI, gen)
    seq_idx, key_len = _rows(lens, prefill=[0], decode={})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, 150, num_splits=3)
    _assert_close_to_twin(got, ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, 150))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_exact_cache_match_twin(dtype):
    """The exact (unquantized) path: float queries over a float cache, no scales."""
    HI, DI = 4, 64
    gen = torch.Generator().manual_seed(11)
    cache, block_table, _ = _paged_keys(LENS, DI, gen, dtype=dtype)
    seq_idx, key_len = _rows(LENS, prefill=[0, 1, 3], decode={2: 3, 4: 5})
    q = torch.randn(len(seq_idx), HI, DI, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(len(seq_idx), HI, generator=gen) * (HI * DI) ** -0.5).to(DEVICE)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, 256)
    want = ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, 256)
    _assert_close_to_twin(got, want)
    if dtype == torch.float32:  # exact dots: only the summation order differs from the twin
        visible = torch.isfinite(want)
        torch.testing.assert_close(got[visible], want[visible], rtol=1e-5, atol=1e-6)


def test_logits_cut_at_max_keys_below_key_len():
    HI, DI = 16, 64
    gen = torch.Generator().manual_seed(5)
    cache, block_table, _ = _paged_keys(LENS, DI, gen)
    seq_idx, key_len = _rows(LENS, prefill=[], decode={4: 4, 3: 2})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, 100)
    _assert_close_to_twin(got, ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, 100))


def test_logits_refuse_bad_inputs():
    cache = ref.alloc_index_cache(2, 64, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    w = torch.zeros(1, 4, device=DEVICE)
    q8 = lambda DI: torch.zeros(1, 4, DI, device=DEVICE).to(FP8)  # noqa: E731
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        indexer_logits(torch.zeros(1, 4, 64, device=DEVICE), w, cache, table, one * 0, one, 64)
    with pytest.raises(ValueError, match="exact indexer cache"):
        indexer_logits(q8(64), w, ref.alloc_index_cache(2, 64, DEVICE, torch.float32), table, one * 0, one, 64)
    with pytest.raises(ValueError, match="index_cache"):
        indexer_logits(q8(128), w, cache, table, one * 0, one, 64)
    with pytest.raises(ValueError, match="contiguous"):
        indexer_logits(q8(32), w, cache[:, : 64 * (32 + 4)], table, one * 0, one, 64)
    with pytest.raises(ValueError, match="block_n"):
        indexer_logits(q8(64), w, cache, table, one * 0, one, 64, block_n=96)
    for knobs, name in [(dict(block_m=3), "block_m"), (dict(num_dots=3), "num_dots"),
                        (dict(block_m=1, num_dots=2), "num_dots"), (dict(num_splits=0), "num_splits"),
                        (dict(num_stages=0), "num_stages"), (dict(tma=True, block_n=128), "tma"),
                        (dict(max_registers=300), "max_registers")]:
        with pytest.raises(ValueError, match=name):
            indexer_logits(q8(64), w, cache, table, one * 0, one, 64, **knobs)


# ------------------------------------------------------------------------------ contiguous keys
CONTIG_LENS = (1, 63, 64, 65, 130)


def _packed_keys(keys, gen):
    """The sequences' keys (list of [L_b, DI]) packed into one k [N, DI] fp32, in shuffled order at
    odd offsets behind runs of garbage keys (x100, no query may see them); the last sequence placed
    ends k, so its tiles run past the end of k. -> (k, key_start [B] int32)."""
    DI = keys[0].shape[1]
    parts, starts, at = [], [0] * len(keys), 0
    for b in torch.randperm(len(keys), generator=gen).tolist():
        gap = 2 * int(torch.randint(0, 5, (1,), generator=gen)) + 1
        parts += [100 * torch.randn(gap, DI, generator=gen), keys[b].cpu()]
        starts[b] = at + gap
        at += gap + len(keys[b])
    return torch.cat(parts).to(DEVICE), torch.tensor(starts, dtype=torch.int32, device=DEVICE)


def _fp8_keys(k):
    """k [N, DI] fp32 -> (e4m3 [N, DI], k_scale [N] fp32): one scale a key, as write_kv stores them."""
    k8, k_scale = quantize_rows(k)
    return k8, k_scale.contiguous()


def test_contiguous_varlen_causal_prefill_matches_paged_and_twin():
    """The main use: a causal prefill of a packed variable-length batch (lengths around the 64-key
    tile edges, odd offsets in k; whole sequences, and the last chunk of the 130-key one). The
    contiguous kernel gives the paged kernel's logits on the same keys written into shuffled pages
    (same tiles, same arithmetic: bit for bit in the interpreter), and its twin the paged twin's."""
    HI, DI = 4, 64
    gen = torch.Generator().manual_seed(21)
    cache, block_table, keys = _paged_keys(CONTIG_LENS, DI, gen)
    k, key_start = _packed_keys(keys, gen)
    k8, k_scale = _fp8_keys(k)
    seq_idx, key_len = _rows(CONTIG_LENS, prefill=[0, 1, 3], decode={2: 2, 4: 20})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    max_keys = 140  # past every key_len: those columns must be -inf
    want = ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, max_keys)
    twin = ref.indexer_logits_contiguous(q, w, k8, k_scale, seq_idx, key_start, key_len, max_keys)
    # Two fp32 twins whose matmuls sum in orders of the backend's choosing: they round apart by a few
    # ulps (seen: 1.6e-7 of a logit on an AMD CPU, 8e-6 on a GPU).
    torch.testing.assert_close(twin, want, rtol=1e-5, atol=1e-6)
    got = indexer_logits_contiguous(q, w, k8, k_scale, seq_idx, key_start, key_len, max_keys)
    assert got.shape == (len(seq_idx), max_keys) and got.dtype == torch.float32
    _assert_close_to_twin(got, twin)
    paged = indexer_logits(q, w, cache, block_table, seq_idx, key_len, max_keys)
    if DEVICE == "cpu":
        assert torch.equal(got, paged)
    else:
        _assert_close_to_twin(got, paged)


# Every key-tile path of the contiguous mode: rows by TMA (the interpreter emulates the 2D
# descriptor, bounds included), a gather, tiles wider than a page, lone rows, key splits, two dots.
CONTIG_TILINGS = {
    "default": {}, "gather": dict(tma=False), "bm1-splits3": dict(block_m=1, num_splits=3),
    "gather-bn128-dots-splits2": dict(tma=False, block_n=128, block_m=8, num_dots=2, num_splits=2),
}


@pytest.mark.parametrize("knobs", CONTIG_TILINGS.values(), ids=CONTIG_TILINGS.keys())
def test_contiguous_matches_paged_any_tiling_and_row_order(knobs):
    """Interleaved rows of all sequences (speculative-verify runs, lone decode rows, rows with
    key_len 0), against the paged kernel on the same keys under the same launch, and the twin."""
    HI, DI = 16, 64
    gen = torch.Generator().manual_seed(len(str(knobs)))
    cache, block_table, keys = _paged_keys(CONTIG_LENS, DI, gen)
    k, key_start = _packed_keys(keys, gen)
    k8, k_scale = _fp8_keys(k)
    seq_idx, key_len = _rows(CONTIG_LENS, prefill=[], decode={0: 3, 1: 2, 2: 1, 3: 4, 4: 6})  # 2 rows see no key
    order = torch.randperm(len(seq_idx), generator=gen).to(DEVICE)
    order[:8] = order[:8].sort().values
    seq_idx, key_len = seq_idx[order], key_len[order]
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits_contiguous(q, w, k8, k_scale, seq_idx, key_start, key_len, 200, **knobs)
    _assert_close_to_twin(got, ref.indexer_logits_contiguous(q, w, k8, k_scale, seq_idx, key_start, key_len, 200))
    paged = indexer_logits(q, w, cache, block_table, seq_idx, key_len, 200, **knobs)
    if DEVICE == "cpu":
        assert torch.equal(got, paged)
    else:
        _assert_close_to_twin(got, paged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_contiguous_exact_keys_match_twin(dtype):
    """Float keys without scales; fp32 exact up to the summation order. A key_start whose sequence
    ends k exercises the gather's mask at the end of k."""
    HI, DI = 4, 64
    gen = torch.Generator().manual_seed(12)
    keys = [torch.randn(L, DI, generator=gen) for L in CONTIG_LENS]
    k, key_start = _packed_keys(keys, gen)
    k = k.to(dtype)
    seq_idx, key_len = _rows(CONTIG_LENS, prefill=[3], decode={0: 2, 1: 1, 2: 3, 4: 5})
    q = torch.randn(len(seq_idx), HI, DI, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(len(seq_idx), HI, generator=gen) * (HI * DI) ** -0.5).to(DEVICE)
    got = indexer_logits_contiguous(q, w, k, None, seq_idx, key_start, key_len, 131)
    want = ref.indexer_logits_contiguous(q, w, k, None, seq_idx, key_start, key_len, 131)
    _assert_close_to_twin(got, want)
    if dtype == torch.float32:
        visible = torch.isfinite(want)
        torch.testing.assert_close(got[visible], want[visible], rtol=1e-5, atol=1e-6)


def test_contiguous_rows_never_read_past_the_end_of_k():
    """A key_len that runs past the end of k (a broken contract) reads zero keys there on both the
    TMA and the gather path, instead of out-of-bounds memory: logits 0, no NaN."""
    HI, DI = 4, 64
    gen = torch.Generator().manual_seed(5)
    k8, k_scale = _fp8_keys(torch.randn(70, DI, generator=gen).to(DEVICE))
    key_start = torch.tensor([40], dtype=torch.int32, device=DEVICE)  # 30 keys from row 40 on
    seq_idx = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    key_len = torch.tensor([30, 100], dtype=torch.int32, device=DEVICE)
    q, w = _fp8_queries(2, HI, DI, gen)
    want = ref.indexer_logits_contiguous(q, w, k8, k_scale, seq_idx, key_start, key_len.clamp_max(30), 100)
    for knobs in ({}, dict(tma=False)):
        got = indexer_logits_contiguous(q, w, k8, k_scale, seq_idx, key_start, key_len, 100, **knobs)
        _assert_close_to_twin(got[:, :30], want[:, :30])
        assert (got[1, 30:] == 0).all()


def test_contiguous_refuses_bad_inputs():
    k8 = torch.zeros(10, 64, device=DEVICE).to(FP8)
    scale = torch.ones(10, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    w = torch.zeros(1, 4, device=DEVICE)
    q8 = torch.zeros(1, 4, 64, device=DEVICE).to(FP8)
    qf = torch.zeros(1, 4, 64, device=DEVICE)
    bad = [
        ((qf, w, k8, scale, one * 0, one * 0, one, 8), "float8_e4m3fn"),
        ((q8, w, k8.float(), None, one * 0, one * 0, one, 8), "exact keys"),
        ((q8, w, k8[:, :32], scale, one * 0, one * 0, one, 8), r"\[N, 64\]"),
        ((q8, w, torch.zeros(64, 10, device=DEVICE).to(FP8).t(), scale, one * 0, one * 0, one, 8), "last dim"),
        ((q8, w, k8, None, one * 0, one * 0, one, 8), "k_scale"),
        ((q8, w, k8, scale[:5], one * 0, one * 0, one, 8), "k_scale"),
        ((qf, w, k8.float(), scale, one * 0, one * 0, one, 8), "k_scale must be None"),
        ((q8, w, k8, scale, one * 0, one.float(), one, 8), "key_start"),
        ((q8, w, k8, scale, one * 0, one * 0, one.repeat(2), 8), "key_len"),
        ((q8, w[:, :2], k8, scale, one * 0, one * 0, one, 8), "head weights"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            indexer_logits_contiguous(*args)
    with pytest.raises(ValueError, match="block_m"):
        indexer_logits_contiguous(q8, w, k8, scale, one * 0, one * 0, one, 8, block_m=3)
    with pytest.raises(ValueError, match="16-byte aligned"):  # rows 72 bytes apart
        indexer_logits_contiguous(q8, w, torch.zeros(5, 72, device=DEVICE).to(FP8)[:, :64], scale[:5], one * 0,
                                  one * 0, one, 8, tma=True)
    with pytest.raises(TypeError):
        indexer_logits_contiguous(q8, w, k8, scale, one * 0, one * 0, one, 8, blockm=4)


def test_contiguous_no_keys_gives_all_inf():
    q8, w = _fp8_queries(3, 4, 64, torch.Generator().manual_seed(0))
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    empty = torch.zeros(0, 64, device=DEVICE).to(FP8)
    got = indexer_logits_contiguous(q8, w, empty, torch.zeros(0, device=DEVICE), zeros, zeros[:1], zeros, 5)
    assert got.shape == (3, 5) and (got == float("-inf")).all()


# ------------------------------------------------------------------------------ launch config
def test_launch_defaults_fill_one_fp8_dot_and_three_programs_an_sm():
    """GLM-5.2 (32 heads) and DeepSeek-V3.2 (64) FP8 defaults: rows x heads = FP8_COLUMNS in one dot,
    pages by TMA only where the device has it, the register cap that fits PROGRAMS_PER_SM programs."""
    for HI in (32, 64):
        cfg = launch_config(4096, HI, 128, 1 << 17, FP8, sms=132, tma_capable=True)
        assert cfg.block_m * HI == FP8_COLUMNS and cfg.num_dots == 1 and cfg.tma and cfg.block_n == ref.BLOCK_SIZE
        assert cfg.max_registers == FP8_MAX_REGISTERS and PROGRAMS_PER_SM * 128 * FP8_MAX_REGISTERS <= 65536
        assert not launch_config(4096, HI, 128, 1 << 17, FP8, sms=132, tma_capable=False).tma
    for HI in (1, 4, 8):  # few heads: more rows a dot, not padded heads
        cfg = launch_config(4096, HI, 64, 1 << 17, FP8, sms=132, tma_capable=True)
        assert cfg.block_m * HI == FP8_COLUMNS and cfg.max_registers == FP8_MAX_REGISTERS
        # a decode batch (every row lone, padded to 16 heads): no more rows a block than 16 heads fill
        assert launch_config(64, HI, 64, 1 << 17, FP8, sms=132, tma_capable=True, sequences=64).block_m == 8
    exact = launch_config(64, 4, 64, 1000, torch.float32, sms=8, tma_capable=True)
    assert not exact.tma and exact.max_registers is None  # TMA is for the FP8 layout only


@pytest.mark.parametrize("T,max_keys", [(1, 1), (64, 1 << 20), (4096, 1 << 17), (8192, 8192), (300, 129)])
def test_launch_splits_cover_every_key_once(T, max_keys):
    cfg = launch_config(T, 32, 128, max_keys, FP8, sms=132, tma_capable=True)
    assert cfg.keys_per_split % cfg.block_n == 0
    assert (cfg.num_splits - 1) * cfg.keys_per_split < max_keys <= cfg.num_splits * cfg.keys_per_split


@pytest.mark.parametrize("row_blocks,tiles,sms", [(16, 16384, 132), (16, 512, 132), (1024, 512, 132), (3, 7, 8),
                                                   (2048, 128, 132), (100, 1, 8)])
def test_splits_minimise_the_wave_model(row_blocks, tiles, sms):
    """The chosen split count costs no more, under the documented wave model, than any count a
    launch of at most MAX_WAVES waves could use (the search only visits each wave count's largest)."""
    slots = PROGRAMS_PER_SM * sms

    def cost(s):
        return -(-row_blocks * s // slots) * (-(-tiles // s) + PROGRAM_OVERHEAD_TILES)

    allowed = [s for s in range(1, tiles + 1) if -(-row_blocks * s // slots) <= MAX_WAVES] or [1]
    chosen = choose_num_splits(row_blocks, tiles, sms)
    assert 1 <= chosen <= max(tiles, 1)
    assert cost(chosen) == min(cost(s) for s in allowed)


# ------------------------------------------------------------------------------ FP8 vs exact
@pytest.mark.parametrize("HI,DI", [(16, 64), (32, 128)])
def test_fp8_logits_track_the_exact_indexer(HI, DI):
    """The production path (Hadamard rotation, e4m3 q and k with per-row scales) against fp32
    logits of the unquantized q and k: correlation >= 0.99, top-k overlap >= 0.95."""
    gen = torch.Generator().manual_seed(HI + DI)
    L, T, topk = 512, 16, 64
    q = torch.randn(T, HI, DI, generator=gen)
    k = torch.randn(L, DI, generator=gen)
    q[..., :2] *= 6  # a few outlier channels, as real activations have: the rotation spreads them
    k[:, :2] *= 6
    w = torch.randn(T, HI, generator=gen) * (HI * DI) ** -0.5
    exact = torch.einsum("th,thl->tl", w, torch.einsum("thd,ld->thl", q, k).relu())

    rot = hadamard(DI)
    q8, q_scale = quantize_rows(q @ rot)
    table = torch.randperm(L // ref.BLOCK_SIZE, generator=gen).int()[None].to(DEVICE)
    cache = ref.alloc_index_cache(L // ref.BLOCK_SIZE, DI, device=DEVICE)
    kv = ref.alloc_kv_cache(L // ref.BLOCK_SIZE, 128, 64, fp8=False, device=DEVICE)
    zeros = torch.zeros(L, 128 + 64, device=DEVICE)
    ref.write_kv(zeros[:, :128], zeros[:, 128:], _slots(table[0], L), kv, (k @ rot).to(DEVICE), cache)
    seq_idx = torch.zeros(T, dtype=torch.int32, device=DEVICE)
    key_len = torch.full((T,), L, dtype=torch.int32, device=DEVICE)
    got = indexer_logits(q8.to(DEVICE), (w * q_scale).to(DEVICE), cache, table, seq_idx, key_len, L).cpu()

    corr = torch.corrcoef(torch.stack([got.flatten(), exact.flatten()]))[0, 1]
    assert corr >= 0.99, f"correlation {corr:.4f}"
    mine, best = got.topk(topk).indices, exact.topk(topk).indices
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(mine, best)) / (T * topk)
    assert overlap >= 0.95, f"top-{topk} overlap {overlap:.3f}"


# ------------------------------------------------------------------------------ chunked top-k
def _assert_same_topk(got, want, logits, block_table, seq_idx, tol=2 * TOL):
    """Same slot sets per row, up to near-ties: slots in one set only must score (by the twin's
    logits) within tol (of the row max) of the row's k-th best. Logits off by TOL each can swap
    keys up to 2 TOL apart."""
    assert got.shape == want.shape and got.dtype == torch.int32
    got, want, logits = got.cpu(), want.cpu(), logits.cpu()
    for t in range(got.shape[0]):
        g, wt = got[t][got[t] >= 0].tolist(), want[t][want[t] >= 0].tolist()
        assert len(g) == len(set(g)) == len(wt), f"row {t}: {len(g)} slots (distinct {len(set(g))}), want {len(wt)}"
        differ = set(g) ^ set(wt)
        if not differ:
            continue
        table = block_table[seq_idx[t]].long().cpu()
        pos_of = {int(table[p // ref.BLOCK_SIZE]) * ref.BLOCK_SIZE + p % ref.BLOCK_SIZE: p
                  for p in range(logits.shape[1]) if torch.isfinite(logits[t, p])}
        assert differ <= set(pos_of), f"row {t} picks slots it may not see"
        kth = min(logits[t, pos_of[s]] for s in wt)
        scale = logits[t].masked_fill(~torch.isfinite(logits[t]), 0).abs().max()
        assert all(abs(logits[t, pos_of[s]] - kth) <= tol * scale for s in differ), f"row {t}: different top-k"


@pytest.mark.parametrize("k,chunk_tokens", [(16, 7), (300, 64), (1, 1000)])
def test_topk_chunked_matches_twin(k, chunk_tokens):
    HI, DI = 16, 64
    gen = torch.Generator().manual_seed(k + chunk_tokens)
    cache, block_table, _ = _paged_keys(LENS, DI, gen)
    # rows of sequence 0 past its one key see nothing (empty rows); k = 300 exceeds every context
    seq_idx, key_len = _rows(LENS, prefill=[1], decode={0: 3, 3: 4, 4: 5})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_topk_chunked(q, w, cache, block_table, seq_idx, key_len, k, chunk_tokens)
    logits = ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, int(key_len.max()))
    want = ref.logical_to_slots(block_table, seq_idx, ref.topk_rows(logits, k))
    assert ((got >= 0).sum(-1) == key_len.clamp_max(k)).all()
    _assert_same_topk(got, want, logits, block_table, seq_idx)


def test_topk_chunked_all_rows_empty():
    gen = torch.Generator().manual_seed(0)
    cache, block_table, _ = _paged_keys((64,), 64, gen)
    q, w = _fp8_queries(3, 4, 64, gen)
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    got = indexer_topk_chunked(q, w, cache, block_table, zeros, zeros, 8, 2)
    assert got.shape == (3, 8) and (got == -1).all()


# ------------------------------------------------------------------------------ GPU, GLM geometry
@pytest.mark.gpu
@pytest.mark.parametrize("HI", [32, 64])  # GLM-5.2, DeepSeek-V3.2
def test_glm_geometry_8k_matches_twin(HI):
    DI, L, topk = 128, 8192, 2048
    gen = torch.Generator().manual_seed(HI)
    lens = (L, L - 100, 3000, 1)
    cache, block_table, _ = _paged_keys(lens, DI, gen)
    # 64 rows: a prefill chunk ending the 8K sequence, a speculative verify of 8 rows on the second,
    # single-token decodes on the others
    seq_idx, key_len = _rows(lens, prefill=[], decode={0: 48, 1: 8, 2: 7, 3: 1})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, L)
    logits = ref.indexer_logits(q, w, cache, block_table, seq_idx, key_len, L)
    _assert_close_to_twin(got, logits)
    slots = indexer_topk_chunked(q, w, cache, block_table, seq_idx, key_len, topk, chunk_tokens=16)
    want = ref.logical_to_slots(block_table, seq_idx, ref.topk_rows(logits, topk))
    _assert_same_topk(slots, want, logits, block_table, seq_idx)


def _twin_by_rows(q, w, cache, block_table, seq_idx, key_len, max_keys, rows=16):
    """reference.indexer_logits a few rows at a time: it gathers [rows, max_keys, DI] fp32 keys."""
    return torch.cat([ref.indexer_logits(q[i : i + rows], w[i : i + rows], cache, block_table, seq_idx[i : i + rows],
                                         key_len[i : i + rows], max_keys) for i in range(0, len(q), rows)])


GPU_VARIANTS = {"default": {}, "gather": dict(tma=False), "gather-bn128": dict(tma=False, block_n=128),
                "wide-two-dots": dict(num_dots=2, max_registers=255), "splits7": dict(num_splits=7),
                "a-program-a-row": dict(block_m=1)}


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_VARIANTS.values(), ids=GPU_VARIANTS.keys())
@pytest.mark.parametrize("HI", [32, 64])
def test_glm_geometry_launch_variants_match_twin(HI, knobs):
    """Every launch variant at GLM-5.2 / DeepSeek-V3.2 geometry on the compiled GPU path: the last
    rows of a 20K causal prefill, speculative-verify rows, lone decode rows over 9K keys, a row with
    no key, interleaved; max_keys past every row."""
    DI = 128
    if knobs.get("num_dots") == 2:
        knobs = dict(knobs, block_m=2 * FP8_COLUMNS // HI)  # 256 rows x heads in two dots
    gen = torch.Generator().manual_seed(HI + len(knobs))
    lens = (20000, 9001, 3000, 64, 1)
    cache, block_table, _ = _paged_keys(lens, DI, gen)
    seq_idx, key_len = _rows(lens, prefill=[], decode={0: 96, 1: 1, 2: 4, 3: 1, 4: 2})
    order = torch.randperm(len(seq_idx), generator=gen).to(DEVICE)
    order[:64] = order[:64].sort().values
    seq_idx, key_len = seq_idx[order], key_len[order]
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, 20100, **knobs)
    _assert_close_to_twin(got, _twin_by_rows(q, w, cache, block_table, seq_idx, key_len, 20100))


@pytest.mark.gpu
def test_glm_geometry_causal_chunk_matches_twin():
    """A 512-row causal chunk at the end of a 16K prefill (the engine's shape, default launch)."""
    HI, DI, L, C = 32, 128, 16384, 512
    gen = torch.Generator().manual_seed(7)
    cache, block_table, _ = _paged_keys((L,), DI, gen)
    seq_idx = torch.zeros(C, dtype=torch.int32, device=DEVICE)
    key_len = torch.arange(L - C + 1, L + 1, dtype=torch.int32, device=DEVICE)
    q, w = _fp8_queries(C, HI, DI, gen)
    got = indexer_logits(q, w, cache, block_table, seq_idx, key_len, L)
    _assert_close_to_twin(got, _twin_by_rows(q, w, cache, block_table, seq_idx, key_len, L))


GPU_CONTIG_VARIANTS = {"default": {}, "gather": dict(tma=False), "splits5": dict(num_splits=5),
                       "paged-depth": dict(num_stages=3, lone_stages=4)}  # 3 / 4 tiles in flight, as paged


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_CONTIG_VARIANTS.values(), ids=GPU_CONTIG_VARIANTS.keys())
def test_glm_geometry_contiguous_matches_paged(knobs):
    """GLM-5.2's indexer (32 heads x 128, FP8) on the compiled path (keys by a 2D TMA descriptor at
    odd row offsets on Hopper): a packed prefill batch — the last 512 rows of an 8K causal prefill,
    a 64-row chunk of a 3K one, whole short sequences — against the paged kernel on the same keys in
    shuffled pages, and against the twin."""
    HI, DI, L = 32, 128, 8192
    gen = torch.Generator().manual_seed(52)
    lens = (L, 3001, 130, 65, 1)
    cache, block_table, keys = _paged_keys(lens, DI, gen)
    k, key_start = _packed_keys(keys, gen)
    k8, k_scale = _fp8_keys(k)
    seq_idx, key_len = _rows(lens, prefill=[2, 3, 4], decode={0: 512, 1: 64})
    q, w = _fp8_queries(len(seq_idx), HI, DI, gen)
    got = indexer_logits_contiguous(q, w, k8, k_scale, seq_idx, key_start, key_len, L, **knobs)
    _assert_close_to_twin(got, indexer_logits(q, w, cache, block_table, seq_idx, key_len, L, **knobs))
    twin = torch.cat([ref.indexer_logits_contiguous(q[i : i + 16], w[i : i + 16], k8, k_scale, seq_idx[i : i + 16],
                                                    key_start, key_len[i : i + 16], L) for i in range(0, len(q), 16)])
    _assert_close_to_twin(got, twin)
