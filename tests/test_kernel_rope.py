"""The fused rope kernel against its twin `megactx.model.layers.rope_first`.

fp32: the same values up to rounding. bf16, the error rule (DESIGN.md): against the rotation done in
fp32, the kernel's max error is at most 2x the twin's in bf16 (plus a small atol). Without a GPU the
kernel runs in the Triton interpreter (set by conftest) on small shapes; the GLM-5.2 geometry and
the queries' strided views run on a GPU too."""

from __future__ import annotations

import pytest
import torch

from megactx.kernels.rope import rope_first as fused
from megactx.model.layers import rope_first as twin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(B, S, rope_dims, dtype, device, seed=0):
    """cos / sin laid out as Rotary makes them ([cos | cos], [-sin | sin]) at random positions."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(B, S, rope_dims // 2, generator=g) * 1000 * torch.logspace(0, -4, rope_dims // 2)
    cos, sin = angles.cos() * 1.2, angles.sin() * 1.2  # a YaRN-style magnitude factor
    return (torch.cat([cos, cos], -1).to(device, dtype), torch.cat([-sin, sin], -1).to(device, dtype))


def _x(shape, dtype, device, seed=1, extra=0):
    """x as a slice of a wider projection (the model's q_pe is the last dims of q): strided rows."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(*shape[:-1], shape[-1] + extra, generator=g) * 3
    return wide.to(device, dtype)[..., extra:]


CASES = [  # (B, S, H or None, D, rope_dims, cos batch)
    (1, 5, 4, 32, None, 1),     # MLA query rope: [1, T, H, dr]
    (1, 7, None, 32, None, 1),  # MLA key rope: [1, T, dr]
    (2, 3, 3, 64, 32, 2),       # indexer: rope first, the rest passed through; batched tables
    (3, 4, 2, 16, 16, 1),       # one table for every batch row
    (1, 1, 17, 64, 48, 1),      # odd head count (two head blocks), rope_dims not a power of two
]


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_the_twin(case, interleave):
    B, S, H, D, rope_dims, cb = case
    shape = (B, S, D) if H is None else (B, S, H, D)
    x = _x(shape, torch.float32, DEVICE, extra=8)
    cos, sin = _tables(cb, S, rope_dims or D, torch.float32, DEVICE)
    got, want = fused(x, cos, sin, interleave, rope_dims), twin(x, cos, sin, interleave, rope_dims)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    if rope_dims:  # the passed-through dims are copied exactly
        assert torch.equal(got[..., rope_dims:], x[..., rope_dims:])


def _bf16_rule(x, cos, sin, interleave, rope_dims):
    exact = twin(x.float(), cos.float(), sin.float(), interleave, rope_dims)
    kernel_err = (fused(x, cos, sin, interleave, rope_dims).float() - exact).abs().max().item()
    twin_err = (twin(x, cos, sin, interleave, rope_dims).float() - exact).abs().max().item()
    assert kernel_err <= 2 * twin_err + 1e-3, (kernel_err, twin_err)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("case", CASES[:3])
def test_bf16_within_the_error_rule(case, interleave):
    B, S, H, D, rope_dims, cb = case
    shape = (B, S, D) if H is None else (B, S, H, D)
    x = _x(shape, torch.bfloat16, DEVICE, extra=4)
    cos, sin = _tables(cb, S, rope_dims or D, torch.bfloat16, DEVICE)
    _bf16_rule(x, cos, sin, interleave, rope_dims)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [fused, twin], ids=["kernel", "twin"])
def test_out_takes_a_strided_slice(rope, dtype):
    # MLA's query [T, H, r + dr] is assembled in place: the rope writes q_pe into its last dr dims.
    T, H, r, dr = 5, 4, 32, 16
    x = _x((1, T, H, dr), dtype, DEVICE, extra=8)
    cos, sin = _tables(1, T, dr, dtype, DEVICE)
    q = torch.full((T, H, r + dr), 7.0, dtype=dtype, device=DEVICE)
    got = rope(x, cos, sin, True, out=q[None, :, :, r:])
    assert got.data_ptr() == q[:, :, r:].data_ptr()
    assert torch.equal(q[..., r:], rope(x, cos, sin, True)[0])
    assert torch.all(q[..., :r] == 7.0)  # nothing else written


def test_bad_widths_are_refused():
    x = torch.zeros(1, 2, 3, 32, device=DEVICE)
    cos, sin = _tables(1, 2, 32, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="even count"):
        fused(x, cos, sin, True, 31)
    with pytest.raises(ValueError, match="cos/sin of that width"):
        fused(x, cos[..., :16], sin[..., :16], True, 32)
    with pytest.raises(ValueError, match="out must be like x"):
        fused(x, cos, sin, True, out=torch.empty(1, 2, 3, 16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [True, False])
def test_glm52_geometry_on_gpu(interleave):
    """GLM-5.2: 64 query heads with a 64-dim rope slice of 192, the 32 x 128 indexer (rope first 64),
    a 1K-token prefill and a batch-64 decode, bf16."""
    for T in (1024, 64):
        cos, sin = _tables(1, T, 64, torch.bfloat16, "cuda")
        q = _x((1, T, 64, 64), torch.bfloat16, "cuda", extra=128)  # q_pe: the last 64 of 192 per head
        _bf16_rule(q, cos, sin, interleave, None)
        idx = _x((1, T, 32, 128), torch.bfloat16, "cuda")
        _bf16_rule(idx, cos, sin, interleave, 64)
        k = _x((1, T, 64), torch.bfloat16, "cuda", extra=512)  # k_pe: the last 64 of the 576 projection
        _bf16_rule(k, cos, sin, interleave, None)
