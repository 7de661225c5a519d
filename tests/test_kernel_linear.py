"""The few-row fp32 linear kernel (`megactx.kernels.linear.linear_rows`) against its twin F.linear, and
`megactx.model.layers.linear_fp32`, which picks it.

fp32 products summed in fp32 either way, in another order: equal to rounding. Without a GPU the
kernel runs in the Triton interpreter (set by conftest) on small shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megactx.kernels.linear import MAX_ROWS, linear_rows
from megactx.model.layers import linear_fp32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows, E, D, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, D + 3, generator=g)[..., 3:]  # strided rows, as a slice would be
    return x.to(DEVICE), torch.randn(E, D, generator=g).to(DEVICE)


@pytest.mark.parametrize("rows,E,D", [(2, 4, 256), (4, 4, 256), (8, 4, 256), (3, 7, 100), (5, 40, 64), (1, 3, 16)])
def test_matches_f_linear(rows, E, D):
    x, w = _case(rows, E, D)
    got = linear_rows(x, w)
    assert got.shape == (rows, E) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5 * D**0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reads_x_in_the_models_dtype(dtype):
    """A bf16 / fp16 x is widened in the kernel, exactly as x.float() would be (no cast kernel first)."""
    for rows in (1, 4):
        x, w = _case(rows, 4, 64, seed=rows)
        x = x.to(dtype)
        torch.testing.assert_close(linear_rows(x, w), F.linear(x.float(), w), rtol=1e-5, atol=1e-5 * 8)


def test_keeps_leading_dims_and_refuses_what_it_cannot_do():
    x, w = _case(4, 4, 32, lead=(1,))  # [1, 4, 32], the indexer's head weights' input
    x = x.contiguous()
    torch.testing.assert_close(linear_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at most"):
        linear_rows(torch.zeros(MAX_ROWS + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="fp32"):
        linear_rows(x, w.bfloat16())
    with pytest.raises(ValueError, match="fp32"):
        linear_rows(x.to(torch.int32), w)


def test_linear_fp32_is_f_linear_on_a_cpu_and_under_autograd():
    w = torch.randn(4, 16, requires_grad=True)
    x = torch.randn(3, 16)
    assert torch.equal(linear_fp32(x, w), F.linear(x, w))
    assert torch.equal(linear_fp32(x.bfloat16(), w), F.linear(x.bfloat16().float(), w))  # x widened first
    linear_fp32(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(4, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_linear_fp32_on_a_gpu_at_model_sizes():
    # megactx-tiny's router and GLM-5.2's router and indexer head weights, 1 to 32 rows of fp32 or the
    # model's bf16: the kernel for 1-8 rows of a small weight, F.linear otherwise, the same products.
    for E, D in ((4, 256), (256, 6144), (32, 6144)):
        for rows in (1, 2, 4, 8, 9, 32):
            x32, w = _case(rows, E, D, seed=rows)
            for x in (x32, x32.bfloat16()):
                torch.testing.assert_close(linear_fp32(x, w), F.linear(x.float(), w), rtol=1e-5, atol=1e-5 * D**0.5)
        x, w = _case(4, E, D)  # the kernel itself at every size (linear_fp32 keeps F.linear for large W)
        torch.testing.assert_close(linear_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5 * D**0.5)
