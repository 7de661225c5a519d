"""The Triton top-k (megactx.kernels.topk.topk_rows) against torch.topk.

Every check: positions in range and candidates (below key_len, finite), no duplicates, the right
number of -1s, the multiset of selected values equal to torch.topk's, and the selected set equal to
the one the kernel documents (ties at the threshold go to the lowest positions): the first k of a
stable descending sort. On a CPU the kernel runs in the Triton interpreter, so rows stay short and
the configs small enough that every path runs: rows selected directly (<= `candidates` keys), from
the candidate buffer, from the buffer and the lowest ties at the threshold (fewer than k above it),
and the overflow fallback, each in the fused and the split launch plan (`select_paths` says which rows take
which, by the kernel's own rule)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megactx.kernels import reference as ref
from megactx.kernels.topk import TopkConfig, TopkPlan, select_paths, topk_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles so that rows of ~1000 keys take many steps (two sub-tiles a tile in the collect pass);
# 512 candidates with 256 group maxima leave i.i.d. rows (k <= 100) far from overflowing, so they
# take the buffer path.
_SMALL = dict(block=64, sub_block=32, num_warps=4, candidates=512, groups=256)
FUSED = TopkConfig(max_tile=512, programs_per_row=1, **_SMALL)  # steps of 2 chunks of 256 groups
SPLIT = TopkConfig(max_tile=128, programs_per_row=4, **_SMALL)  # 2 chunks of 64 groups a program
PLANS = {"fused": FUSED, "split": SPLIT}


def _masked(logits: torch.Tensor, key_len: torch.Tensor | None) -> torch.Tensor:
    if key_len is None:
        return logits
    cols = torch.arange(logits.shape[1], device=logits.device)
    return logits.masked_fill(cols[None, :] >= key_len[:, None].clamp_min(0), float("-inf"))


def _check(logits: torch.Tensor, k: int, key_len: torch.Tensor | None, got: torch.Tensor) -> None:
    T, L = logits.shape
    assert got.shape == (T, k) and got.dtype == torch.int32
    x = _masked(logits, key_len).float().cpu()
    got = got.cpu().long()
    finite = torch.isfinite(x).sum(-1)  # [T] candidates a row
    want_vals = torch.nn.functional.pad(x, (0, max(0, k - L)), value=float("-inf")).topk(k, dim=-1).values
    order = x.sort(dim=-1, descending=True, stable=True).indices  # ties: lowest position first
    for t in range(T):
        row = got[t]
        n_sel = min(k, int(finite[t]))
        assert int((row == -1).sum()) == k - n_sel, f"row {t}: {int((row == -1).sum())} -1s, want {k - n_sel}"
        sel = row[row != -1]
        assert ((sel >= 0) & (sel < L)).all(), f"row {t}: position out of range"
        assert sel.unique().numel() == sel.numel(), f"row {t}: duplicate positions"
        vals = x[t, sel]
        assert torch.isfinite(vals).all(), f"row {t}: selected a non-candidate (-inf or beyond key_len)"
        assert torch.equal(vals.sort(descending=True).values, want_vals[t, :n_sel]), f"row {t}: values != torch.topk's"
        assert set(sel.tolist()) == set(order[t, :n_sel].tolist()), f"row {t}: ties not at the lowest positions"


def _key_len(T: int, L: int, gen: torch.Generator, k: int) -> torch.Tensor:
    """Row lengths covering the edge cases: 0, below k, all of L, and random ones."""
    lens = torch.randint(0, L + 1, (T,), generator=gen)
    lens[0] = L
    if T > 1:
        lens[1] = 0
    if T > 2:
        lens[2] = max(k - 1, 0)
    return lens.to(torch.int32)


# ------------------------------------------------------------------------------ paths
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("k", [1, 7, 64, 100])
def test_random_rows_match_torch_topk(plan, k):
    gen = torch.Generator().manual_seed(k)
    T, L = 4, 1000  # not a multiple of the tile
    logits = torch.randn(T, L, generator=gen) * 3 - 1  # negative and positive values
    key_len = _key_len(T, L, gen, k)
    key_len[3] = L - 1
    _check(logits, k, key_len, topk_rows(logits.to(DEVICE), k, key_len.to(DEVICE), config=PLANS[plan]))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("levels, candidates, path", [(50, 512, "buffer"), (3, 128, "ties"), (200, 64, "fallback")])
def test_ties_go_to_lowest_positions(plan, levels, candidates, path):
    """Integer logits: ties straddle the threshold. With 50 levels (~20 copies each) the ~80
    candidates fit the buffer and ties are settled there (in one row; in the other the k-th value
    is the threshold itself); with 3 levels the ~300 copies of the top value are the threshold,
    so the lowest of them are found by reading the row from its start; with 200 levels and
    candidates = k the elements above the threshold overflow the buffer, so the fallback over the
    row settles them."""
    gen = torch.Generator().manual_seed(levels)
    T, L, k = 4, 900, 64
    logits = torch.randint(-levels // 2, levels - levels // 2, (T, L), generator=gen).float()
    key_len = torch.tensor([L, 0, k - 1, 700], dtype=torch.int32)
    cfg = dataclasses.replace(PLANS[plan], candidates=candidates)
    paths = select_paths(logits, k, key_len, cfg)
    assert path in paths and paths[1:3] == ["direct", "direct"], paths
    _check(logits, k, key_len, topk_rows(logits.to(DEVICE), k, key_len.to(DEVICE), config=cfg))


@pytest.mark.parametrize("plan", PLANS)
def test_relu_rows_with_fewer_than_k_positive(plan):
    """Rows shaped like an indexer's ReLU'd logits where the query scores few keys above 0: a few
    positive values among exact zeros (and negatives, as head weights of both signs give), so the
    k-th largest is 0.0 with hundreds of ties — the rows that overflowed the buffer into the
    fallback before the threshold's ties were kept out of it. Also a row of zeros only, one with
    its zeros sparse and the last ones needed near its end, and one past key_len."""
    gen = torch.Generator().manual_seed(7)
    T, L, k = 5, 1000, 64
    noise = torch.randn(T, L, generator=gen).clamp_max(-0.01)
    logits = torch.where(torch.rand(T, L, generator=gen) < 0.5, noise, 0.0)  # < 0, ~half +0.0 (no -0.0: see _key)
    for t in (0, 3, 4):
        logits[t, torch.randperm(L, generator=gen)[:40]] = torch.rand(40, generator=gen) + 0.1  # 40 positive < k
    logits[1] = 0.0
    logits[2] = -torch.rand(L, generator=gen) - 0.1  # negative, bar 50 positive and 30 zeros near the end
    logits[2, torch.randperm(L - 100, generator=gen)[:50]] = torch.rand(50, generator=gen) + 1
    logits[2, -100::3][:30] = 0.0  # the 14 taken end ~60 keys before the row's end
    key_len = torch.tensor([L, L, L, L, 777], dtype=torch.int32)
    assert select_paths(logits, k, key_len, PLANS[plan]) == ["ties"] * T
    _check(logits, k, key_len, topk_rows(logits.to(DEVICE), k, key_len.to(DEVICE), config=PLANS[plan]))


@pytest.mark.parametrize("plan", PLANS)
def test_overflowing_buffer_falls_back_exactly(plan):
    """candidates = k: the ~1.1 k elements above the first threshold overflow it, so the rows
    take the fallback (here with 4 pivots a read of the row), bar the odd row that just fits."""
    gen = torch.Generator().manual_seed(1)
    T, L, k = 3, 700, 40
    logits = torch.randn(T, L, generator=gen)
    cfg = dataclasses.replace(PLANS[plan], candidates=k, row_pivots=4)
    key_len = torch.tensor([L, 600, 333], dtype=torch.int32)
    _check(logits, k, key_len, topk_rows(logits.to(DEVICE), k, key_len.to(DEVICE), config=cfg))


@pytest.mark.parametrize("plan", PLANS)
def test_structured_rows(plan):
    """Rows shaped like attention scores rather than noise: sorted, a hot local window, blocks of
    near-equal neighbours, a rising trend."""
    gen = torch.Generator().manual_seed(6)
    L, k = 1000, 64
    noise = torch.randn(4, L, generator=gen)
    logits = torch.stack([
        noise[0].sort().values,
        torch.cat([noise[1, :-100], noise[1, -100:] + 4]),
        torch.randn(L // 50, generator=gen).repeat_interleave(50) + 1e-3 * noise[2],
        noise[3] + torch.linspace(0, 3, L),
    ])
    _check(logits, k, None, topk_rows(logits.to(DEVICE), k, config=PLANS[plan]))


@pytest.mark.parametrize("plan", PLANS)
def test_sparse_and_empty_rows(plan):
    """Rows of all -inf, rows with a few finite values among -inf (fewer than k), -inf holes."""
    gen = torch.Generator().manual_seed(2)
    T, L, k = 4, 800, 100
    logits = torch.randn(T, L, generator=gen)
    logits[0] = float("-inf")
    logits[1, torch.randperm(L, generator=gen)[: L - 30]] = float("-inf")  # 30 candidates < k
    logits[2, ::3] = float("-inf")
    _check(logits, k, None, topk_rows(logits.to(DEVICE), k, config=PLANS[plan]))


@pytest.mark.parametrize("plan", PLANS)
def test_short_rows_and_k_beyond_the_row(plan):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen)
    key_len = torch.tensor([50, 7, 0], dtype=torch.int64)  # int64 accepted
    _check(logits, 100, key_len, topk_rows(logits.to(DEVICE), 100, key_len.to(DEVICE), config=PLANS[plan]))
    one = logits[:, :1]
    _check(one, 1, None, topk_rows(one.to(DEVICE), 1, config=PLANS[plan]))


def test_default_config_and_key_len_beyond_the_row():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 300, generator=gen)
    key_len = torch.tensor([10_000, 200], dtype=torch.int32)  # clamped to L
    _check(logits, 7, key_len, topk_rows(logits.to(DEVICE), 7, key_len.to(DEVICE)))


def test_default_config_splits_long_rows():
    """Few long rows: the default plan splits them over programs (2 here, under the interpreter)."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 40_000, generator=gen)
    key_len = torch.tensor([40_000, 33_333], dtype=torch.int32)
    _check(logits, 100, key_len, topk_rows(logits.to(DEVICE), 100, key_len.to(DEVICE)))


def test_plan_of_many_long_rows_is_split():
    """Prefill chunks (many rows): rows of two segments or more take the split plan (its collect reads
    a row once), shorter rows the fused one; a row that fits the buffer is never split."""
    cfg, cpu = TopkConfig(), torch.device("cpu")
    long_rows = 2 * cfg.MIN_SEGMENT
    assert TopkPlan.make(4096, long_rows, 2048, cfg, cpu).split == cfg.MIN_SPLIT
    assert TopkPlan.make(4096, long_rows - 1, 2048, cfg, cpu).split == 1
    assert TopkPlan.make(4096, 4096, 2048, cfg, cpu).split == 1
    assert TopkPlan.make(4096, 1 << 20, 2048, TopkConfig(programs_per_row=1), cpu).split == 1  # asked for
    # the select step's passes over a row take the fused plan's scan tile (fewer registers), the split plan's block
    fused, split = TopkPlan.make(64, 8192, 128, cfg, cpu), TopkPlan.make(4, 1 << 18, 128, cfg, cpu)
    assert (fused.split, fused.select_block) == (1, cfg.FUSED["sub_block"])
    assert split.split > 1 and split.select_block == cfg.SPLIT["block"]
    assert TopkPlan.make(64, 8192, 128, TopkConfig(select_block=512), cpu).select_block == 512


def test_many_long_rows_default_plan():
    """The default plan on more rows than the interpreter's SMs x PROGRAMS_PER_SM, each of two
    segments: split by MIN_SPLIT, exact."""
    gen = torch.Generator().manual_seed(8)
    rows = 2 * TopkConfig.PROGRAMS_PER_SM * TopkConfig.CPU_SMS
    L = 2 * TopkConfig.MIN_SEGMENT
    logits = torch.randn(rows, L, generator=gen)
    key_len = torch.randint(L // 2, L + 1, (rows,), generator=gen, dtype=torch.int32)
    assert TopkPlan.make(rows, L, 50, TopkConfig(), torch.device(DEVICE)).split == TopkConfig.MIN_SPLIT
    _check(logits, 50, key_len, topk_rows(logits.to(DEVICE), 50, key_len.to(DEVICE)))


def test_row_stride_and_out_buffer():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 900, generator=gen).to(DEVICE)
    logits = wide[:, 100:800]  # row stride 900
    out = torch.full((2, 32), 7, dtype=torch.int32, device=DEVICE)
    got = topk_rows(logits, 32, out=out, config=FUSED)
    assert got.data_ptr() == out.data_ptr()
    _check(logits, 32, None, got)


@pytest.mark.parametrize("path", ["fused", "split", "direct", "overflow", "ties"])
def test_slots_through_a_block_table(path):
    """With a block table the selection writes physical slots (block · 64 + offset of each row's
    sequence), exactly the twin's positions mapped by `logical_to_slots`, -1 kept, on every path
    (rows from the buffer, a row of <= candidates keys, the overflow fallback, the ties at the
    threshold after the buffer)."""
    gen = torch.Generator().manual_seed(11)
    T, L, k = 5, 64 if path == "direct" else 1000, 40
    logits = torch.randn(T, L, generator=gen)
    if path == "ties":  # 20 positive values < k among zeros: the 0.0s are the threshold
        hot = torch.randperm(L, generator=gen)[:20].expand(T, 20)
        logits = torch.zeros(T, L).scatter_(1, hot, 1.0 + logits[:, :20])
    key_len = torch.tensor([L, 0, 30, L - 7, 3 * L // 4], dtype=torch.int32)
    seq_idx = torch.tensor([2, 0, 1, 2, 0], dtype=torch.int32)
    width = -(-L // ref.BLOCK_SIZE)
    table = torch.randperm(3 * width + 5, generator=gen)[: 3 * width].view(3, width).int()
    cfg = PLANS["split" if path in ("split", "ties") else "fused"]
    if path == "overflow":
        cfg = dataclasses.replace(cfg, candidates=k, row_pivots=4)
    got = topk_rows(logits.to(DEVICE), k, key_len.to(DEVICE), block_table=table.to(DEVICE),
                    seq_idx=seq_idx.to(DEVICE), config=cfg).cpu()
    want = ref.logical_to_slots(table, seq_idx, ref.topk_rows(logits, k, key_len)).int()
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    assert torch.equal(ref.topk_rows(logits, k, key_len, block_table=table, seq_idx=seq_idx), want)


def test_no_rows_or_no_k():
    assert topk_rows(torch.zeros(0, 10, device=DEVICE), 5).shape == (0, 5)
    assert topk_rows(torch.zeros(3, 10, device=DEVICE), 0).shape == (3, 0)


@pytest.mark.parametrize("bad, match", [
    (lambda x: topk_rows(x.half(), 4), "float32"),
    (lambda x: topk_rows(x.t(), 4), "contiguous"),
    (lambda x: topk_rows(x, -1), "k must be"),
    (lambda x: topk_rows(x, 4, torch.zeros(3, dtype=torch.int32, device=x.device)), "key_len"),
    (lambda x: topk_rows(x, 4, out=torch.empty(2, 5, dtype=torch.int32, device=x.device)), "out must be"),
    (lambda x: topk_rows(x, 4, config=TopkConfig(candidates=2)), "candidates"),
    (lambda x: topk_rows(x, 4, config=TopkConfig(groups=3)), "groups"),
    (lambda x: topk_rows(x, 4, config=TopkConfig(block=100)), "block"),
    (lambda x: topk_rows(x, 4, config=TopkConfig(select_block=100)), "select_block"),
    (lambda x: topk_rows(x, 4, config=TopkConfig(programs_per_row=3)), "programs_per_row"),
    (lambda x: topk_rows(x, 10_000), "k = 10000"),
    (lambda x: topk_rows(x, 4, block_table=torch.zeros(1, 1, dtype=torch.int32, device=x.device)), "together"),
    (lambda x: topk_rows(x, 4, block_table=torch.zeros(1, 1, dtype=torch.int64, device=x.device),
                         seq_idx=torch.zeros(2, dtype=torch.int32, device=x.device)), "block_table must be int32"),
])
def test_bad_arguments_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(torch.randn(2, 64, device=DEVICE))


# ------------------------------------------------------------------------------ GPU, real sizes
def _check_values(logits: torch.Tensor, k: int, key_len: torch.Tensor | None, got: torch.Tensor) -> None:
    """The vectorized check for large rows: ranges, duplicates, -1 counts, and the multiset of values."""
    x = _masked(logits, key_len)
    sel = got.long()
    valid = sel >= 0
    n_sel = torch.isfinite(x).sum(-1).clamp_max(k)
    assert torch.equal(valid.sum(-1), n_sel), "wrong number of -1s"
    assert (sel[valid] < x.shape[1]).all()
    vals = x.gather(1, sel.clamp_min(0)).masked_fill(~valid, float("-inf"))
    assert torch.isfinite(vals[valid]).all(), "selected a non-candidate"
    srt = sel.masked_fill(~valid, -1).sort(-1).values
    assert not ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(), "duplicate positions"
    want = x.topk(k, dim=-1).values
    assert torch.equal(vals.sort(-1, descending=True).values, want), "values differ from torch.topk"


@pytest.mark.gpu
def test_decode_rows_of_1m():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 1 << 20, generator=gen, device="cuda")
    _check_values(logits, 2048, None, topk_rows(logits, 2048))
    key_len = torch.randint(0, 1 << 20, (64,), generator=gen, device="cuda", dtype=torch.int32)
    key_len[:4] = torch.tensor([0, 100, 2048, 5000], device="cuda")
    _check_values(logits, 2048, key_len, topk_rows(logits, 2048, key_len))


@pytest.mark.gpu
def test_causal_prefill_chunk_of_64k():
    gen = torch.Generator(device="cuda").manual_seed(1)
    T, L = 4096, 1 << 16
    logits = torch.randn(T, L, generator=gen, device="cuda")
    key_len = torch.arange(L - T + 1, L + 1, device="cuda", dtype=torch.int32)  # the last chunk of a prefill
    _check_values(logits, 2048, key_len, topk_rows(logits, 2048, key_len))
    early = torch.arange(1, T + 1, device="cuda", dtype=torch.int32)  # the first chunk: rows shorter than k
    _check_values(logits, 2048, early, topk_rows(logits, 2048, early))


@pytest.mark.gpu
@pytest.mark.parametrize("levels", [1000, 10])
@pytest.mark.parametrize("T, L", [(8, 1 << 18), (1024, 1 << 16)])
def test_ties_at_scale(T, L, levels):
    """Integer logits on long rows, in the split plan (few rows) and the fused one (many). With 1000
    levels ~2.4 k elements pass the first threshold, ties are settled in the buffer; with 10 levels
    the top level alone has 6.5-26 K copies: it is the threshold, its lowest copies read from the row's
    start."""
    gen = torch.Generator(device="cuda").manual_seed(T + levels)
    logits = torch.randint(0, levels, (T, L), generator=gen, device="cuda").float()
    got = topk_rows(logits, 2048)
    _check_values(logits, 2048, None, got)
    _check(logits[:2], 2048, None, got[:2])  # and the lowest positions among ties


@pytest.mark.gpu
@pytest.mark.parametrize("T, L", [(64, 1 << 20), (2048, 1 << 16)])
def test_relu_rows_at_scale(T, L):
    """An indexer's ReLU'd rows at a decode of 1M keys (split plan) and a causal chunk of 64K (fused):
    1000 positive values among ~L / 2 exact zeros and negatives, k = 2048: the k-th largest is 0.0,
    and the lowest ~1000 of its ties are taken."""
    gen = torch.Generator(device="cuda").manual_seed(T)
    noise = torch.randn(T, L, generator=gen, device="cuda").abs().neg().sub(0.01)
    logits = noise.masked_fill(torch.rand(T, L, generator=gen, device="cuda") < 0.5, 0.0)
    hot = torch.randint(0, L - T + 1, (T, 1000), generator=gen, device="cuda")
    logits.scatter_(1, hot, torch.rand(T, 1000, generator=gen, device="cuda") + 1)
    key_len = torch.arange(L - T + 1, L + 1, device="cuda", dtype=torch.int32)
    got = topk_rows(logits, 2048, key_len)
    _check_values(logits, 2048, key_len, got)
    _check(logits[:2], 2048, key_len[:2], got[:2])  # and the lowest positions among the zeros


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(64, 1 << 18, generator=gen, device="cuda")
    key_len = torch.randint(1, 1 << 18, (64,), generator=gen, device="cuda")
    out = torch.empty(64, 2048, dtype=torch.int32, device="cuda")
    topk_rows(logits, 2048, key_len, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_rows(logits, 2048, key_len, out)
    logits.copy_(torch.randn(64, 1 << 18, generator=gen, device="cuda"))
    key_len.copy_(torch.randint(1, 1 << 18, (64,), generator=gen, device="cuda"))
    graph.replay()
    _check_values(logits, 2048, key_len, out)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [8, 64, 128])
def test_fused_plan_small_k_many_rows_cuda(k):
    """Many rows of 8K keys with a small k take the fused plan's buffer path: each row's selection
    reads back candidates other warps stored (a missing barrier once made a few rows wrong)."""
    g = torch.Generator(device="cuda").manual_seed(k)
    T, L = 1000, 8192
    logits = torch.randn(T, L, device="cuda", generator=g)
    key_len = (torch.arange(T, device="cuda") * L // T + 1).int()
    logits = logits.masked_fill(torch.arange(L, device="cuda")[None] >= key_len[:, None], float("-inf"))
    for kl in (None, key_len):
        out = topk_rows(logits, k, kl)
        assert bool(((out == -1) | ((out >= 0) & (out < key_len[:, None]))).all())
        got = logits.gather(1, out.clamp(min=0).long()).masked_fill(out < 0, float("-inf"))
        want = logits.topk(k, dim=-1).values
        assert torch.equal(got.sort(1, descending=True).values, want.sort(1, descending=True).values)


@pytest.mark.parametrize("levels", [3, 50, None])  # integer logits of few or many levels (ties), or Gaussian
def test_the_twin_selects_what_the_kernel_documents(levels):
    """reference.topk_rows (the CPU engine's path and the kernel's twin) takes torch.topk's set, and
    in rows whose k-th value has ties left out the lowest positions among them, as the kernel does."""
    from megactx.kernels import reference as ref

    gen = torch.Generator().manual_seed(levels or 0)
    for T, L, k in ((9, 300, 64), (5, 40, 100), (3, 128, 128), (4, 70, 0)):
        x = (torch.randn(T, L, generator=gen) if levels is None
             else torch.randint(0, levels, (T, L), generator=gen).float())
        x[torch.rand(T, L, generator=gen) < 0.2] = float("-inf")
        key_len = _key_len(T, L, gen, k)
        _check(x, k, key_len, ref.topk_rows(x, k, key_len))


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches")
@pytest.mark.parametrize("programs_per_row", [1, 2])
def test_max_registers_caps_every_launch_of_either_plan(programs_per_row):
    from benchmarks.compile import recording

    logits = torch.randn(2, 1024)
    cfg = TopkConfig(max_registers=128, programs_per_row=programs_per_row, candidates=256, groups=512)
    with recording() as recorder:
        got = topk_rows(logits, 64, config=cfg)
    _check(logits, 64, None, got)
    launches = list(recorder.launches.values())
    assert len(launches) == (1 if programs_per_row == 1 else 4)
    assert all(x.options.get("maxnreg") == 128 for x in launches)
