"""The FP8 indexer-queries kernel (megactx.kernels.index_queries) against its twin
`reference.index_queries_fp8`, and the engine's dispatch to it.

The error rule (DESIGN.md) on the dequantized queries: against the roped, rotated queries computed in
float64, the kernel's max error is at most 2x the twin's (plus a small atol); the per-head scales and
the scaled head weights agree to fp32 rounding. Without a GPU the kernel runs in the Triton
interpreter (set by conftest) on small shapes; GLM-5.2's geometry (32 heads of 128, rope 64) on a GPU."""

from __future__ import annotations

import pytest
import torch

from megactx.kernels import reference as ref
from megactx.kernels.index_queries import fits, index_queries_fp8
from megactx.model.layers import rope_first
from megactx.model.paged import kernel_ops
from megactx.model.quant import hadamard

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, HI, DI, rope_dims, dtype, device, seed=0):
    """q [T, HI, DI] as a strided view (the wq_b output's heads), w [T, HI] fp32, cos / sin as Rotary
    lays them out ([cos | cos], [-sin | sin]), the Hadamard rotation."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, HI, DI + 8, generator=g) * 2
    wide[:, 0, 3] = 40.0  # an outlier channel, what the rotation spreads
    q = wide.to(device, dtype)[..., 8:]
    w = torch.randn(T, HI, generator=g).to(device)
    angles = torch.rand(1, T, rope_dims // 2, generator=g) * 1000 * torch.logspace(0, -4, rope_dims // 2)
    cos, sin = angles.cos() * 1.1, angles.sin() * 1.1
    cos, sin = torch.cat([cos, cos], -1).to(device, dtype), torch.cat([-sin, sin], -1).to(device, dtype)
    return q, w, cos, sin, hadamard(DI, device=device)


def _check(q, w, cos, sin, rot, interleave, rope_dims, got, want):
    """The error rule on each head's scale and on the dequantized queries (bf16 queries: the kernel's
    rope rounds once, the twin's mul and addcmul twice, so the roped values may differ by an ulp);
    fp32 queries: the same scales to rounding and nearly all the same e4m3 values."""
    HI, DI = q.shape[1:]
    a, b = HI**-0.5, DI**-0.5
    exact = rope_first(q[None].double(), cos.double(), sin.double(), interleave, rope_dims)[0] @ rot.double()
    exact_scale = exact.abs().amax(-1) / torch.finfo(torch.float8_e4m3fn).max
    (q8, w8), (q8_ref, w8_ref) = got, want
    assert q8.dtype == q8_ref.dtype == torch.float8_e4m3fn and q8.shape == q.shape and w8.shape == w.shape
    scale, scale_ref = w8 / (w.double() * a * b), w8_ref / (w.double() * a * b)  # each head's scale, recovered
    for mine, twin in [(scale, scale_ref), (q8.double() * scale[..., None], q8_ref.double() * scale_ref[..., None])]:
        truth = exact_scale if mine is scale else exact
        err, err_ref = (mine - truth).abs().max(), (twin - truth).abs().max()
        assert err <= 2 * err_ref + 1e-6 * truth.abs().max(), f"kernel error {err:.3g} against the twin's {err_ref:.3g}"
    if q.dtype == torch.float32:
        torch.testing.assert_close(scale, scale_ref, rtol=2e-5, atol=0)
        assert (q8.float() == q8_ref.float()).float().mean() > 0.99  # the same e4m3 values but rare roundings


CASES = [  # (T, HI, DI, rope_dims)
    (5, 4, 64, 32),    # megactx-tiny: 4 heads (padded to 16 rows), rope 32 of 64
    (3, 17, 32, 32),   # every dim roped, an odd head count (32 rows)
    (2, 8, 128, 64),   # GLM-5.2's head dim and rope dims, fewer heads
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_twin(case, interleave, dtype):
    T, HI, DI, rope_dims = case
    q, w, cos, sin, rot = _inputs(T, HI, DI, rope_dims, dtype, DEVICE)
    args = (q, w, cos, sin, interleave, rope_dims, rot, HI**-0.5, DI**-0.5)
    _check(q.cpu(), w.cpu(), cos.cpu(), sin.cpu(), rot.cpu(), interleave, rope_dims,
           [t.cpu() for t in index_queries_fp8(*args)], [t.cpu() for t in ref.index_queries_fp8(*args)])


def test_the_twin_is_the_paged_forward_before_the_kernel():
    """The twin computes what the paged forward did: rope, the rotation, quantize_rows, w scaled."""
    from megactx.model.quant import quantize_rows

    q, w, cos, sin, rot = _inputs(4, 4, 64, 32, torch.float32, "cpu")
    q8, w8 = ref.index_queries_fp8(q, w, cos, sin, True, 32, rot, 0.5, 0.125)
    want_q8, scale = quantize_rows(rope_first(q[None], cos, sin, True, 32)[0].float() @ rot)
    assert torch.equal(q8.float(), want_q8.float()) and torch.equal(w8, w * 0.5 * 0.125 * scale)


def test_no_tokens():
    q, w, cos, sin, rot = _inputs(1, 4, 64, 32, torch.bfloat16, DEVICE)
    q8, w8 = index_queries_fp8(q[:0], w[:0], cos[:, :0], sin[:, :0], True, 32, rot, 1.0, 1.0)
    assert q8.shape == (0, 4, 64) and w8.shape == (0, 4)


@pytest.mark.parametrize("DI, rope_dims, ok", [(64, 32, True), (128, 64, True), (64, 64, True), (32, 16, False),
                                               (64, 48, False), (64, 40, False)])
def test_fits_and_the_engine_dispatch(DI, rope_dims, ok):
    """The engine's ops take the kernel where it fits (dots of >= 16 along powers of two), the twin
    otherwise: the same results either way, and the kernel itself refuses what does not fit."""
    assert fits(DI, rope_dims) == ok
    q, w, cos, sin, rot = _inputs(3, 4, DI, rope_dims, torch.float32, DEVICE)
    args = (q, w, cos, sin, False, rope_dims, rot, 0.5, DI**-0.5)
    got = kernel_ops("triton").index_queries_fp8(*args)
    if ok:
        _check(*[t.cpu() for t in (q, w, cos, sin, rot)], False, rope_dims, [t.cpu() for t in got],
               [t.cpu() for t in ref.index_queries_fp8(*args)])
    else:
        want = ref.index_queries_fp8(*args)
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
        with pytest.raises(ValueError, match="powers of two"):
            index_queries_fp8(*args)


def test_bad_arguments_are_refused():
    q, w, cos, sin, rot = _inputs(2, 4, 64, 32, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="w must be fp32"):
        index_queries_fp8(q, w.half(), cos, sin, True, 32, rot, 1.0, 1.0)
    with pytest.raises(ValueError, match="cos and sin"):
        index_queries_fp8(q, w, cos[:, :1], sin[:, :1], True, 32, rot, 1.0, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("T, HI", [(1, 32), (64, 32), (4096, 32), (64, 4)])
def test_glm_geometry_and_batches_on_the_gpu(T, HI):
    q, w, cos, sin, rot = _inputs(T, HI, 128, 64, torch.bfloat16, "cuda", seed=T)
    args = (q, w, cos, sin, True, 64, rot, HI**-0.5, 128**-0.5)
    _check(*[t.cpu() for t in (q, w, cos, sin, rot)], True, 64, [t.cpu() for t in index_queries_fp8(*args)],
           [t.cpu() for t in ref.index_queries_fp8(*args)])
