"""The strided-row norm kernel (`megactx.kernels.norm.norm_rows`) against its twin, the module itself.

fp32: the same values up to rounding. bf16, the error rule (DESIGN.md): against the norm done in
fp32, the kernel's max error is at most 2x the module's in bf16 (plus a small atol). Without a GPU the
kernel runs in the Triton interpreter (set by conftest) on small shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megactx.kernels import norm
from megactx.kernels.norm import _rows_stride, norm_rows
from megactx.model.layers import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _modules(D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rms, ln = RMSNorm(D, eps=1e-6), nn.LayerNorm(D, eps=1e-5)
    with torch.no_grad():
        rms.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
        ln.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
        ln.bias.copy_(0.2 * torch.randn(D, generator=g))
    return [m.to(DEVICE, dtype).requires_grad_(False) for m in (rms, ln)]  # inference, as the engine's


@pytest.fixture
def launches(monkeypatch):
    """The norm kernel's launches in a test (so that a test of the kernel fails if the module ran)."""
    count = [0]
    kernel = norm._norm_rows_kernel

    class Counting:
        def __getitem__(self, grid):
            count[0] += 1
            return kernel[grid]

    monkeypatch.setattr(norm, "_norm_rows_kernel", Counting())
    return count


def _slice(T, D, offset, width, dtype, seed=1, batch=1):
    """Columns [offset, offset + D) of a fused projection's [batch, T, width] output: strided rows."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, T, width, generator=g) * 3 + 0.5
    return wide.to(DEVICE, dtype)[..., offset : offset + D]


CASES = [  # (T, D, offset, width): megactx-tiny's q_a / latent / indexer-key slices, odd widths
    (4, 128, 0, 256),
    (4, 64, 128, 256),
    (7, 64, 192, 256),
    (3, 48, 5, 100),
    (1, 100, 0, 200),
]


@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_the_modules_on_strided_rows(case, launches):
    T, D, offset, width = case
    x = _slice(T, D, offset, width, torch.float32)
    assert not x.is_contiguous() or T == 1
    for module in _modules(D, torch.float32):
        got, want = norm_rows(x, module), module(x)
        assert got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert launches[0] == (0 if x.is_contiguous() else 2)  # the kernel ran (a contiguous x: the module)


def test_batched_rows_and_what_goes_to_the_module(launches):
    rms, ln = _modules(32, torch.float32)
    x = _slice(5, 32, 8, 64, torch.float32, batch=3)  # [3, 5, 32] rows 64 apart: one stride
    assert _rows_stride(x) == 64
    torch.testing.assert_close(norm_rows(x, ln), ln(x), rtol=1e-5, atol=1e-5)
    assert launches[0] == 1
    # rows that no single stride walks (a batch slice of a transposed tensor) and contiguous x: the module
    y = torch.randn(4, 6, 32, device=DEVICE).transpose(0, 1)  # [6, 4, 32], strides (32, 192, 1)
    assert _rows_stride(y) is None
    assert torch.equal(norm_rows(y, rms), rms(y))
    c = torch.randn(3, 32, device=DEVICE)
    assert torch.equal(norm_rows(c, rms), rms(c))
    # under autograd (the kernel has no backward): the module, and its gradient
    ln.requires_grad_(True)
    g = _slice(4, 32, 8, 64, torch.float32).requires_grad_()
    out = norm_rows(g, ln)
    assert out.grad_fn is not None
    out.sum().backward()
    assert g.grad is not None and ln.weight.grad is not None
    # a norm module of another kind (torch's own RMSNorm): the module
    other = nn.RMSNorm(32, eps=1e-6).to(DEVICE)
    torch.testing.assert_close(norm_rows(x, other), other(x))
    # a weight in another dtype than x (RMSNorm's fp32-weight branch): the module
    x16 = _slice(4, 32, 8, 64, torch.bfloat16)
    assert torch.equal(norm_rows(x16, rms), rms(x16))
    assert launches[0] == 1  # none of these launched the kernel


@pytest.mark.parametrize("case", CASES[:3])
def test_bf16_within_the_error_rule(case, launches):
    T, D, offset, width = case
    x = _slice(T, D, offset, width, torch.bfloat16, seed=3)
    for m16, m32 in zip(_modules(D, torch.bfloat16), _modules(D, torch.float32)):
        exact = m32(x.float())
        kernel_err = (norm_rows(x, m16).float() - exact).abs().max().item()
        module_err = (m16(x).float() - exact).abs().max().item()
        assert norm_rows(x, m16).dtype == torch.bfloat16
        assert kernel_err <= 2 * module_err + 1e-3, (type(m16).__name__, kernel_err, module_err)
    assert launches[0] == 4  # two modules, two calls each
