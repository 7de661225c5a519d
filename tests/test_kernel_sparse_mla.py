"""The Triton sparse MLA kernel against its twin, `megactx.kernels.reference.sparse_mla`.

Error rule (DESIGN.md, the FlashAttention way): against the fp32 twin, the kernel's max error is at
most 2x that of the same computation done in PyTorch at the kernel's precision (bf16 operands,
bf16 scores and probabilities; fp32 when q or the cache is fp32), plus a small atol. Without a GPU
the portable kernel runs in the Triton interpreter, so the CPU cases stay small; the GLM-5.2
geometry runs only on a GPU. The Hopper kernels (kernel="sm90" and its warp-specialized variant
"sm90ws", Gluon: no interpreter) run only on an sm_90 GPU, every Hopper test on both; on a CPU their
builds for sm_90 are still checked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megactx.kernels import reference
from megactx.kernels import sparse_mla as sparse_mla_module
from megactx.kernels.sparse_mla import (
    HOPPER_SMEM_BYTES,
    MAX_SPLITS,
    SM90_BLOCK_H,
    SM90_WARPS,
    WS_ALIGN_BYTES,
    _launch_config,
    choose_num_splits,
    hopper_kernel,
    sm90_smem_bytes,
    sm90_unsupported,
    sparse_mla,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Hopper kernels need a Hopper GPU")
# The Hopper kernels, one contract: every Hopper test runs on each.
SM90_KERNELS = ["sm90", "sm90ws"]


def _paged_case(T: int, H: int, r: int, dr: int, K: int, *, fp8: bool, context: int = 80,
                q_dtype: torch.dtype = torch.bfloat16, cache_dtype: torch.dtype = torch.bfloat16,
                device: str = DEVICE, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """A paged cache holding `context` random tokens in shuffled blocks, and top-k rows over them.

    Row 0 selects nothing (all -1), row 2 has half its entries knocked out; every row has -1
    padding wherever K exceeds the context. Returns q [T, H, r + dr], kv_cache, topk_slots [T, K]
    int32, softmax_scale."""
    g = torch.Generator().manual_seed(seed)
    used = math.ceil(context / reference.BLOCK_SIZE)
    num_blocks = 2 * used + 1  # spare blocks, so that slots are neither dense nor in order
    cache = reference.alloc_kv_cache(num_blocks, r, dr, fp8)
    if not fp8:
        cache = cache.to(cache_dtype)
    blocks = torch.randperm(num_blocks, generator=g)[:used]
    pos = torch.arange(context)
    ctx_slots = blocks[pos // reference.BLOCK_SIZE] * reference.BLOCK_SIZE + pos % reference.BLOCK_SIZE
    reference.write_kv(torch.randn(context, r, generator=g), torch.randn(context, dr, generator=g), ctx_slots, cache)

    n = min(K, context)
    slots = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        row = torch.full((K,), -1, dtype=torch.int32)
        row[:n] = ctx_slots[torch.randperm(context, generator=g)[:n]]
        slots[t] = row[torch.randperm(K, generator=g)]  # padding scattered through the row
    slots[0] = -1
    if T > 2:
        slots[2, torch.randperm(K, generator=g)[: K // 2]] = -1
    q = torch.randn(T, H, r + dr, generator=g).to(q_dtype)
    softmax_scale = 1.5 * (r + dr) ** -0.5  # scores of std ~1.5: a peaked but not one-hot softmax
    return q.to(device), cache.to(device), slots.to(device), softmax_scale


def _torch_at_precision(q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, softmax_scale: float,
                        r: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's computation with operands, scores and probabilities rounded to `dtype` (as in
    FlashAttention's tests): the error a plain PyTorch implementation at that precision makes."""
    valid = topk_slots >= 0
    kv = reference.read_kv(kv_cache, topk_slots.clamp_min(0), r).to(dtype)  # [T, K, r + dr]
    scores = torch.einsum("thd,tkd->thk", q.to(dtype), kv) * softmax_scale  # rounded to dtype
    scores = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(dtype)
    out = torch.einsum("thk,tkr->thr", probs, kv[..., :r])
    return out.to(q.dtype), lse


def _check_against_twin(q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, softmax_scale: float,
                        r: int, atol: float = 1e-5, topk_len: torch.Tensor | None = None, **launch) -> None:
    out, lse = sparse_mla(q, kv_cache, topk_slots, softmax_scale, r, topk_len, **launch)
    T, H, _ = q.shape
    assert out.shape == (T, H, r) and out.dtype == q.dtype
    assert lse.shape == (T, H) and lse.dtype == torch.float32

    ref_out, ref_lse = reference.sparse_mla(q.float(), kv_cache, topk_slots, softmax_scale, r, topk_len)  # fp32
    if topk_len is not None:  # the slots a token reads: its first topk_len, the rest as -1
        topk_slots = _truncate(topk_slots, topk_len)
    low = torch.float32 if torch.float32 in (q.dtype, kv_cache.dtype) else torch.bfloat16
    pt_out, pt_lse = _torch_at_precision(q, kv_cache, topk_slots, softmax_scale, r, low)

    empty = (topk_slots < 0).all(-1)
    assert torch.all(out[empty] == 0), "rows without a valid slot must give out = 0"
    assert torch.all(lse[empty] == float("-inf")), "rows without a valid slot must give lse = -inf"
    some = ~empty
    if not some.any():
        return
    out_err = (out[some].float() - ref_out[some]).abs().max().item()
    pt_out_err = (pt_out[some].float() - ref_out[some]).abs().max().item()
    assert out_err <= 2 * pt_out_err + atol, f"out error {out_err:.3g} vs PyTorch-at-precision {pt_out_err:.3g}"
    lse_err = (lse[some] - ref_lse[some]).abs().max().item()
    pt_lse_err = (pt_lse[some] - ref_lse[some]).abs().max().item()
    assert lse_err <= 2 * pt_lse_err + atol, f"lse error {lse_err:.3g} vs PyTorch-at-precision {pt_lse_err:.3g}"


# ------------------------------------------------------------------------------ small shapes (CPU interpreter too)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("K", [5, 64, 100])
@pytest.mark.parametrize("r,dr", [(128, 32), (256, 64)])
@pytest.mark.parametrize("H", [1, 3, 16])
def test_sparse_mla_matches_twin(H, r, dr, K, fp8):
    q, cache, slots, scale = _paged_case(6, H, r, dr, K, fp8=fp8, seed=H * 1000 + r + K)
    _check_against_twin(q, cache, slots, scale, r)


@pytest.mark.parametrize("q_dtype,cache_dtype,fp8", [
    (torch.float32, torch.float32, False),
    (torch.float32, torch.bfloat16, False),
    (torch.bfloat16, torch.float32, False),
    (torch.float32, None, True),
], ids=["fp32-q-fp32-cache", "fp32-q-bf16-cache", "bf16-q-fp32-cache", "fp32-q-fp8-cache"])
def test_sparse_mla_fp32_inputs_match_twin(q_dtype, cache_dtype, fp8):
    q, cache, slots, scale = _paged_case(5, 4, 128, 32, 40, fp8=fp8, q_dtype=q_dtype,
                                         cache_dtype=cache_dtype or torch.bfloat16)
    _check_against_twin(q, cache, slots, scale, 128)


@pytest.mark.parametrize("H,r,dr", [(4, 64, 32), (5, 96, 24)], ids=["tiny-preset", "non-power-of-two"])
def test_sparse_mla_small_and_odd_latents(H, r, dr):
    q, cache, slots, scale = _paged_case(7, H, r, dr, 50, fp8=False, seed=7)
    _check_against_twin(q, cache, slots, scale, r)


def test_sparse_mla_several_head_blocks_and_key_tiles():
    # H = 20 in blocks of 16 heads: the second block is mostly padding; K = 100 spans 7 tiles of 16.
    q, cache, slots, scale = _paged_case(4, 20, 128, 32, 100, fp8=True, context=130, seed=3)
    _check_against_twin(q, cache, slots, scale, 128, block_h=16, block_n=16)


def test_sparse_mla_decode_rows_of_one_sequence():
    # Decode of 4 tokens of one sequence (MTP verify): token t sees the context plus new tokens 0..t.
    q, cache, slots, scale = _paged_case(4, 16, 128, 64, 8, fp8=False, context=70, seed=11)
    seen = torch.arange(8, device=q.device)[None, :] < torch.arange(5, 9, device=q.device)[:, None]
    topk = torch.where(seen, slots[1][None, :], -1)  # row 1 of the case: 8 valid slots
    _check_against_twin(q, cache, topk.contiguous(), scale, 128)


def test_sparse_mla_accepts_strided_q_and_int64_slots():
    q, cache, slots, scale = _paged_case(5, 6, 128, 32, 30, fp8=False, seed=5)
    q_strided = torch.cat([q, q], dim=1)[:, ::2]  # [T, H, D] with a head stride of 2 D
    assert not q_strided.is_contiguous()
    _check_against_twin(q_strided, cache, slots.long(), scale, 128)


def test_sparse_mla_empty_batch_and_empty_topk():
    q, cache, slots, scale = _paged_case(3, 2, 128, 32, 8, fp8=False)
    out, lse = sparse_mla(q[:0], cache, slots[:0], scale, 128)
    assert out.shape == (0, 2, 128) and lse.shape == (0, 2)
    out, lse = sparse_mla(q, cache, slots[:, :0], scale, 128)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def _truncate(slots: torch.Tensor, topk_len: torch.Tensor) -> torch.Tensor:
    """slots with every entry at or past topk_len[t] of its row t set to -1."""
    cols = torch.arange(slots.shape[1], device=slots.device)
    return torch.where(cols[None, :] < topk_len[:, None], slots, -1)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sparse_mla_topk_len_reads_only_leading_slots(num_splits):
    # Valid slots scattered through every row (row 0 empty, row 2 half empty): a token with
    # topk_len n reads its first n slots only (0, within a tile, at a tile edge, past K), the
    # same as the slots with the rest set to -1; with split-K some splits lie wholly past n.
    q, cache, slots, scale = _paged_case(6, 16, 128, 32, 100, fp8=False, context=130, seed=41,
                                         q_dtype=torch.float32, cache_dtype=torch.float32)
    topk_len = torch.tensor([5, 0, 17, 32, 70, 300], dtype=torch.int32)
    _check_against_twin(q, cache, slots, scale, 128, topk_len=topk_len, block_n=16, num_splits=num_splits)
    out, lse = sparse_mla(q, cache, slots, scale, 128, topk_len, block_n=16, num_splits=num_splits)
    out_m, lse_m = sparse_mla(q, cache, _truncate(slots, topk_len), scale, 128, block_n=16, num_splits=num_splits)
    # skipped tiles would only have added exp2(-inf) = 0 terms: the same result to the last bit
    assert torch.equal(out, out_m) and torch.equal(lse, lse_m)
    assert torch.all(lse[1] == float("-inf")) and torch.all(out[1] == 0)


def test_sparse_mla_rejects_a_bad_topk_len():
    q, cache, slots, scale = _paged_case(3, 2, 128, 32, 8, fp8=False)
    for bad in (torch.ones(2, dtype=torch.int32), torch.ones(3, dtype=torch.int64)):
        with pytest.raises(ValueError, match="topk_len must be"):
            sparse_mla(q, cache, slots, scale, 128, bad)


# ------------------------------------------------------------------------------ split-K (flash-decoding)
def _pad_at_end(slots: torch.Tensor) -> torch.Tensor:
    """Each row's valid slots first, its -1 padding last (as the indexer's top-k returns them): the
    trailing splits of a short row then hold no valid slot at all."""
    order = torch.sort((slots < 0).int(), dim=1, stable=True).indices
    return slots.gather(1, order).contiguous()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("num_splits,split_dtype", [(2, None), (3, None), (7, None), (3, torch.bfloat16)])
def test_sparse_mla_split_k_matches_twin(num_splits, split_dtype, fp8):
    # K = 100 in tiles of 16 is 7 tiles: 2 splits of 4 + 3 tiles, 3 of 3 + 3 + 1 (the last split holds
    # only K's 4 leftover slots), 7 of one tile. Row 0 is empty, row 2 half empty. bf16 partials:
    # within the same error rule.
    q, cache, slots, scale = _paged_case(5, 16, 128, 32, 100, fp8=fp8, context=130, seed=20 + num_splits)
    _check_against_twin(q, cache, slots, scale, 128, block_n=16, num_splits=num_splits, split_dtype=split_dtype)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_sparse_mla_split_k_with_empty_splits(fp8):
    # Context 40 < K = 100, padding at the end of each row: of 4 splits of 32 slots (2 tiles of 16),
    # split 0 is full, split 1 holds 8 valid slots, splits 2-3 none; row 3 keeps only its last
    # valid slot, in split 1, so its split 0 is empty and its empty splits sit on both sides.
    q, cache, slots, scale = _paged_case(4, 16, 128, 32, 100, fp8=fp8, context=40, seed=31)
    slots = _pad_at_end(slots)
    slots[3, :39] = -1
    _check_against_twin(q, cache, slots, scale, 128, block_n=16, num_splits=4)


def test_sparse_mla_split_k_more_splits_than_tiles_and_one_token():
    # One decode token (the batch-1 case split-K exists for), 50 splits asked for 3 tiles: 3 are used.
    q, cache, slots, scale = _paged_case(1, 3, 128, 32, 40, fp8=False, context=60, seed=32)
    _check_against_twin(q, cache, slots, scale, 128, block_n=16, num_splits=50)


def test_sparse_mla_split_k_several_head_blocks():
    # H = 20 in blocks of 16 (the second block mostly padding) times 3 splits: programs in
    # head-block, split, token order must each find their own rows of the scratch.
    q, cache, slots, scale = _paged_case(3, 20, 128, 32, 64, fp8=True, context=90, seed=33)
    _check_against_twin(q, cache, slots, scale, 128, block_h=16, block_n=16, num_splits=3)


def test_sparse_mla_split_k_agrees_with_one_split():
    # The same problem with and without splitting: the combine must reproduce the single pass (fp32
    # under the interpreter, so only rounding separates them).
    q, cache, slots, scale = _paged_case(4, 16, 128, 32, 96, fp8=False, context=100, seed=34, q_dtype=torch.float32,
                                         cache_dtype=torch.float32)
    out1, lse1 = sparse_mla(q, cache, slots, scale, 128, block_n=16, num_splits=1)
    out6, lse6 = sparse_mla(q, cache, slots, scale, 128, block_n=16, num_splits=6)
    torch.testing.assert_close(out6, out1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse6, lse1, rtol=1e-6, atol=1e-6)


def test_choose_num_splits_follows_the_wave_model():
    sms, tiles = 132, 64  # an H200; K = 2048 in tiles of 32
    # Prefill fills the GPU many times over: no split.
    assert choose_num_splits(4096, tiles, sms) == 1
    # 64 decode tokens (one head block each) are half a wave: 2 splits make one full wave of half-length
    # programs (cost 32 + 2 + 1 tiles against 64 + 2).
    assert choose_num_splits(64, tiles, sms) == 2
    # 256 verify tokens already take ~2 waves: splitting would only add waves.
    assert choose_num_splits(256, tiles, sms) == 1
    # One token: as many splits as tiles (capped), each program a single tile.
    assert choose_num_splits(1, tiles, sms) == min(tiles, MAX_SPLITS)
    assert choose_num_splits(1, 3, sms) == 3
    for programs in (1, 7, 64, 130, 1000):
        assert 1 <= choose_num_splits(programs, 5, sms) <= 5


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "q": a["q"][0]}, "q must be"),
    (lambda a: {**a, "q": a["q"].half()}, "q must be bf16 or fp32"),
    (lambda a: {**a, "kv_cache": a["kv_cache"][:, :32]}, "kv_cache must be"),
    (lambda a: {**a, "kv_cache": a["kv_cache"].half()}, "kv_cache must be bf16, fp32 or uint8"),
    (lambda a: {**a, "kv_cache": a["kv_cache"][..., :-1]}, "kv_cache rows must hold"),
    (lambda a: {**a, "topk_slots": a["topk_slots"][1:]}, "topk_slots must be"),
    (lambda a: {**a, "topk_slots": a["topk_slots"].float()}, "topk_slots must be int32 or int64"),
    (lambda a: {**a, "kv_lora_rank": 160}, "kv_lora_rank"),
    (lambda a: {**a, "kv_lora_rank": 96, "kv_cache": torch.zeros(2, 64, 96 + 3 * 4 + 2 * 64, dtype=torch.uint8,
                                                                  device=a["q"].device)}, "FP8 kv_cache needs"),
    (lambda a: {**a, "num_splits": 0}, "num_splits must be >= 1"),
    (lambda a: {**a, "block_n": 24}, "block_n must be a power of two"),
    (lambda a: {**a, "num_stages": 0}, "num_stages must be >= 1"),
    (lambda a: {**a, "kernel": "cuda"}, "kernel must be one of"),
    (lambda a: {**a, "split_dtype": torch.float16}, "split_dtype must be"),
    # fp32 q: no device runs it with a Hopper kernel (bf16 wgmma operands)
    (lambda a: {**a, "q": a["q"].float(), "kernel": "sm90"}, "kernel='sm90' cannot run this problem"),
    (lambda a: {**a, "q": a["q"].float(), "kernel": "sm90ws"}, "kernel='sm90ws' cannot run this problem"),
], ids=["q-rank", "q-dtype", "cache-page", "cache-dtype", "cache-row", "slots-rows", "slots-dtype", "rank",
        "fp8-rank", "splits", "block-n", "stages", "kernel-name", "split-dtype", "sm90-fp32-q", "sm90ws-fp32-q"])
def test_sparse_mla_rejects_bad_arguments(change, match):
    q, cache, slots, scale = _paged_case(3, 2, 128, 32, 8, fp8=False)
    args = change({"q": q, "kv_cache": cache, "topk_slots": slots, "softmax_scale": scale, "kv_lora_rank": 128})
    with pytest.raises(ValueError, match=match):
        sparse_mla(**args)


# ------------------------------------------------------------------------------ GLM-5.2 geometry (GPU only)
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("H", [64, 16, 1])
def test_sparse_mla_matches_twin_glm52_geometry(H, fp8):
    q, cache, slots, scale = _paged_case(64, H, 512, 64, 2048, fp8=fp8, context=4096, device="cuda", seed=52)
    _check_against_twin(q, cache, slots, scale, 512)


@pytest.mark.gpu
def test_sparse_mla_glm52_padded_topk_gpu():
    # Short contexts (early prefill, short requests): K = 2048 rows with only 300 valid slots.
    q, cache, slots, scale = _paged_case(64, 64, 512, 64, 2048, fp8=True, context=300, device="cuda", seed=53)
    _check_against_twin(q, cache, slots, scale, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("T,num_splits", [(64, None), (64, 5), (256, None), (1, None), (8, 16)],
                         ids=["decode64-auto", "decode64-5", "verify256-auto", "decode1-auto", "decode8-16"])
def test_sparse_mla_split_k_glm52_decode(T, num_splits, fp8):
    # Decode / verify batch sizes at GLM geometry, with the default split choice (2 for 64 tokens on
    # an H200, 64 for one token) and forced ones.
    q, cache, slots, scale = _paged_case(T, 64, 512, 64, 2048, fp8=fp8, context=4096, device="cuda", seed=54 + T)
    _check_against_twin(q, cache, slots, scale, 512, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_sparse_mla_split_k_glm52_empty_trailing_splits(fp8):
    # 300 valid slots of 2048, padding at the end (the indexer's order): with 8 splits of 256 slots,
    # split 0 is full, split 1 holds 44 valid slots and splits 2-7 none.
    q, cache, slots, scale = _paged_case(64, 64, 512, 64, 2048, fp8=fp8, context=300, device="cuda", seed=55)
    _check_against_twin(q, cache, _pad_at_end(slots), scale, 512, num_splits=8)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("block_n,num_stages", [(64, 2), (64, 3), (32, 5), (32, 7), (16, 9)])
def test_sparse_mla_pipeline_configs_glm52(block_n, num_stages, fp8):
    # The Triton kernel's tile / pipeline-depth candidates of benchmarks/tune_sparse_mla.py: deeper
    # pipelines keep several gathered tiles in flight, which must not change the result.
    q, cache, slots, scale = _paged_case(64, 64, 512, 64, 2048, fp8=fp8, context=4096, device="cuda", seed=56)
    _check_against_twin(q, cache, slots, scale, 512, block_n=block_n, num_stages=num_stages, num_splits=1,
                        kernel="triton")


# ------------------------------------------------------------------------------ the Hopper kernels ("sm90", "sm90ws")
@pytest.mark.parametrize("kernel", SM90_KERNELS)
def test_sm90_kernel_builds_for_hopper_within_shared_memory(kernel):
    # Any machine: compile the Gluon kernel for sm_90 at GLM-5.2 geometry (ptxas ships with Triton),
    # with a bf16 and an FP8 cache, the FP8 one with a topk_len. Its shared memory must be what
    # `sm90_smem_bytes` (the eligibility check) predicts — exactly for "sm90", an upper bound by its
    # alignment slack for "sm90ws" — and fit. In a subprocess: the interpreter that conftest turns
    # on without a GPU cannot compile for a device.
    code = ("import json; from benchmarks.tune_sparse_mla import compile_static; "
            f"print(json.dumps([compile_static('{kernel}', fp8, {SM90_BLOCK_H}, 64, 2, {SM90_WARPS}, rank=512, "
            "rope=64, has_len=fp8).metadata.shared for fp8 in (False, True)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    bound = [sm90_smem_bytes(512, 64, 64, 2, fp8, warp_specialized=kernel == "sm90ws") for fp8 in (False, True)]
    if kernel == "sm90":
        assert shared == bound
    else:
        for got, most in zip(shared, bound):
            assert got <= most <= got + 4 * WS_ALIGN_BYTES, f"{got} B compiled, {most} B predicted"
    assert max(shared) <= HOPPER_SMEM_BYTES


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's refusal (a GPU runs or refuses by itself)")
@pytest.mark.parametrize("kernel", SM90_KERNELS)
def test_hopper_kernels_refuse_the_interpreter(kernel):
    # Gluon kernels do not run in the interpreter: asked for one on a CPU, sparse_mla says so.
    q, cache, slots, scale = _paged_case(3, 2, 128, 32, 8, fp8=False)
    with pytest.raises(ValueError, match=f"kernel='{kernel}' cannot run this problem: it needs a CUDA device"):
        sparse_mla(q, cache, slots, scale, 128, kernel=kernel)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_sm90ws_launches_with_the_sm90_tiling(fp8):
    sm90 = _launch_config(64, 2048, 512, fp8, "sm90")
    ws = _launch_config(64, 2048, 512, fp8, "sm90ws")
    assert ws.kernel == "sm90ws" and (ws.block_h, ws.block_n, ws.num_warps, ws.num_stages) == (
        sm90.block_h, sm90.block_n, sm90.num_warps, sm90.num_stages)


@pytest.mark.parametrize("default,ws_fp8,expected", [
    ("sm90", True, ("sm90", "sm90")),
    ("sm90ws", True, ("sm90ws", "sm90ws")),
    ("sm90ws", False, ("sm90ws", "sm90")),
    ("triton", True, ("triton", "triton")),
])
def test_hopper_kernel_follows_the_default_and_ws_fp8(monkeypatch, default, ws_fp8, expected):
    # (bf16 cache, FP8 cache) -> the Hopper default kernel: flipping it is one constant, WS_FP8 keeps FP8 on "sm90".
    monkeypatch.setattr(sparse_mla_module, "HOPPER_DEFAULT_KERNEL", default)
    monkeypatch.setattr(sparse_mla_module, "WS_FP8", ws_fp8)
    assert (hopper_kernel(False), hopper_kernel(True)) == expected


def test_default_kernel_keeps_small_latents_on_triton(monkeypatch):
    # where a Hopper kernel could serve, it is the default only from HOPPER_MIN_RANK on (GLM's r = 512);
    # megactx-tiny's r = 64 prefilled faster on "triton"
    monkeypatch.setattr(sparse_mla_module, "sm90_unsupported", lambda *args, **kwargs: "")
    cache = torch.empty(1, 64, 1, dtype=torch.bfloat16)
    for r, expected in ((64, "triton"), (256, "triton"), (512, hopper_kernel(False))):
        assert sparse_mla_module.default_kernel(torch.empty(1, 4, r + 64, dtype=torch.bfloat16), cache, r) == expected


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("K", [5, 64, 100])
@pytest.mark.parametrize("r,dr", [(128, 32), (256, 64)])
@pytest.mark.parametrize("H", [1, 3, 16, 80])
def test_sm90_matches_twin(H, r, dr, K, fp8, kernel):
    # The CPU cases on the Hopper kernels, plus H = 80: two blocks of 64 heads, the second mostly padding.
    q, cache, slots, scale = _paged_case(6, H, r, dr, K, fp8=fp8, device="cuda", seed=H * 1000 + r + K)
    if fp8:  # the FP8 path gave wrong results below r = 512 on the H200: it must refuse, not compute
        assert "FP8" in sm90_unsupported(q, cache, r, kernel=kernel)
        return
    _check_against_twin(q, cache, slots, scale, r, kernel=kernel)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
def test_sm90_accepts_strided_q_and_int64_slots(kernel):
    q, cache, slots, scale = _paged_case(5, 6, 128, 32, 30, fp8=False, device="cuda", seed=5)
    q_strided = torch.cat([q, q], dim=1)[:, ::2]  # [T, H, D] with a head stride of 2 D
    _check_against_twin(q_strided, cache, slots.long(), scale, 128, kernel=kernel)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("H", [64, 16, 1])
def test_sm90_matches_twin_glm52_geometry(H, fp8, kernel):
    q, cache, slots, scale = _paged_case(64, H, 512, 64, 2048, fp8=fp8, context=4096, device="cuda", seed=52)
    _check_against_twin(q, cache, slots, scale, 512, kernel=kernel)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
def test_sm90_glm52_padded_topk(kernel):
    # 300 valid slots of 2048: most tiles hold no valid slot at all.
    q, cache, slots, scale = _paged_case(64, 64, 512, 64, 2048, fp8=True, context=300, device="cuda", seed=53)
    _check_against_twin(q, cache, slots, scale, 512, kernel=kernel)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("T,num_splits,split_dtype", [(64, None, None), (64, 5, None), (256, None, None),
                                                       (1, None, None), (64, 2, torch.bfloat16)],
                         ids=["decode64-auto", "decode64-5", "verify256-auto", "decode1-auto", "decode64-2-bf16"])
def test_sm90_split_k_glm52_decode(T, num_splits, split_dtype, fp8, kernel):
    q, cache, slots, scale = _paged_case(T, 64, 512, 64, 2048, fp8=fp8, context=4096, device="cuda", seed=54 + T)
    _check_against_twin(q, cache, slots, scale, 512, num_splits=num_splits, kernel=kernel, split_dtype=split_dtype)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_sm90_split_k_glm52_empty_trailing_splits(fp8, kernel):
    # Of 8 splits of 256 slots, split 0 is full, split 1 holds 44 valid slots and splits 2-7 none.
    q, cache, slots, scale = _paged_case(64, 64, 512, 64, 2048, fp8=fp8, context=300, device="cuda", seed=55)
    _check_against_twin(q, cache, _pad_at_end(slots), scale, 512, num_splits=8, kernel=kernel)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("block_n,num_stages", [(64, 2), (32, 4), (32, 3)])
def test_sm90_pipeline_configs_glm52(block_n, num_stages, fp8, kernel):
    # The candidates of benchmarks/tune_sparse_mla.py: 1-3 tiles in flight while one is computed,
    # every buffer (and "sm90"'s ring entry) reused many times over the 2048 slots; 3 buffers give
    # "sm90ws" barrier phases that do not line up with powers of two.
    q, cache, slots, scale = _paged_case(64, 64, 512, 64, 2048, fp8=fp8, context=4096, device="cuda", seed=56)
    _check_against_twin(q, cache, slots, scale, 512, block_n=block_n, num_stages=num_stages, num_splits=1,
                        kernel=kernel)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", [*SM90_KERNELS, "triton"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_topk_len_glm52(num_splits, fp8, kernel):
    # A causal prefill near K: token t at position p has p + 1 keys, its valid slots listed first;
    # topk_len = p + 1 skips the tiles past them. Rows from empty to past K, some mid-tile.
    T, K = 64, 2048
    q, cache, slots, scale = _paged_case(T, 64, 512, 64, K, fp8=fp8, context=4096, device="cuda", seed=58)
    positions = torch.linspace(0, 2 * K, T, device="cuda").int()
    positions[0] = -1  # no keys at all
    topk_len = positions + 1
    slots = _truncate(slots, topk_len)  # what an indexer's top-k would hold
    _check_against_twin(q, cache, slots, scale, 512, topk_len=topk_len, num_splits=num_splits, kernel=kernel)
    out, lse = sparse_mla(q, cache, slots, scale, 512, topk_len, num_splits=num_splits, kernel=kernel)
    out_all, lse_all = sparse_mla(q, cache, slots, scale, 512, num_splits=num_splits, kernel=kernel)
    assert torch.equal(out, out_all) and torch.equal(lse, lse_all)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kernel", SM90_KERNELS)
def test_sm90_and_triton_kernels_agree_glm52(kernel):
    # Both kernels at bf16 on the same problem: each within the error rule, and near each other
    # (their difference is rounding: p and c in bf16 either way, different summation orders).
    q, cache, slots, scale = _paged_case(64, 64, 512, 64, 2048, fp8=False, context=4096, device="cuda", seed=57)
    out_t, lse_t = sparse_mla(q, cache, slots, scale, 512, kernel="triton")
    out_h, lse_h = sparse_mla(q, cache, slots, scale, 512, kernel=kernel)
    torch.testing.assert_close(out_h.float(), out_t.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(lse_h, lse_t, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("T,num_splits", [(64, 1), (64, 4), (1, None)], ids=["prefill64", "decode64-4", "decode1"])
def test_sm90ws_matches_sm90_bit_for_bit_glm52(T, num_splits, fp8):
    # The same math in the same order (the shared helpers), only the copies moved to a producer
    # warpgroup: the outputs must be identical, not just close.
    q, cache, slots, scale = _paged_case(T, 64, 512, 64, 2048, fp8=fp8, context=4096, device="cuda", seed=59)
    out_a, lse_a = sparse_mla(q, cache, slots, scale, 512, num_splits=num_splits, kernel="sm90")
    out_b, lse_b = sparse_mla(q, cache, slots, scale, 512, num_splits=num_splits, kernel="sm90ws")
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
