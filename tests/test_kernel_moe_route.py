"""The MoE routing kernel against its twin `megactx.kernels.reference.moe_route` (fp32 both: the
same experts, the same weights up to rounding). Without a GPU the kernel runs in the Triton
interpreter (set by conftest) on small shapes; GLM-5.2's 256 experts, top 8, run there too."""

from __future__ import annotations

import pytest
import torch

from megactx.kernels import reference as ref
from megactx.kernels.moe_route import MAX_X_WEIGHT, moe_route, moe_route_x

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _by_expert(weights, ids):
    """A row's (ids, weights) sorted by expert id: the twin's order is unspecified."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("N, E, k, norm", [(5, 4, 2, True),      # megactx-tiny
                                           (37, 256, 8, True),   # GLM-5.2, rows past a block's
                                           (9, 10, 3, False),    # E not a power of two, unnormalised
                                           (3, 6, 6, True),      # every expert
                                           (0, 8, 2, True)])     # no tokens
def test_routes_as_the_twin(N, E, k, norm):
    g = torch.Generator().manual_seed(N * 1000 + E)
    logits = (torch.randn(N, E, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE)
    dense = torch.full((N, E), float("nan"), device=DEVICE)  # every value must be written
    weights, ids = moe_route(logits, bias, k, 2.5, norm, dense)
    want_w, want_ids = ref.moe_route(logits, bias, k, 2.5, norm)
    # the every-expert form's weights: the routed weights scattered, 0 elsewhere, as Experts would build them
    torch.testing.assert_close(dense, torch.zeros(N, E, device=DEVICE).scatter(1, want_ids, want_w),
                               rtol=1e-6, atol=1e-6)
    assert weights.shape == ids.shape == (N, k) and ids.dtype == torch.int64 and weights.dtype == torch.float32
    got_ids, got_w = _by_expert(weights, ids)
    ref_ids, ref_w = _by_expert(want_w, want_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-6)
    if N:  # the kernel's order: descending score + bias
        choice = torch.sigmoid(logits) + bias
        assert (choice.gather(1, ids).diff(dim=-1) <= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, E, D, k", [(1, 4, 256, 2), (37, 4, 256, 2), (5, 10, 72, 3)])
def test_routes_from_x_as_the_router_gemm_and_the_twin(N, E, D, k, dtype):
    """moe_route_x computes the logits F.linear(x.float(), W) in the kernel (a small router: megactx-tiny's
    4 x 256, rows strided as a slice would be): the twin's experts and weights, the dense weights with
    the shared expert's column."""
    _check_route_x(N, E, D, k, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_routes_from_x_on_cuda(dtype):
    for N in (1, 4, 300):
        _check_route_x(N, 4, 256, 2, dtype)  # megactx-tiny's router: a decode step, a verify, a prefill chunk


def _check_route_x(N, E, D, k, dtype):
    g = torch.Generator().manual_seed(N + E + D)
    x = torch.randn(N, D + 5, generator=g)[:, 5:].to(DEVICE, dtype)
    w = (torch.randn(E, D, generator=g) * 0.1).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE)
    dense = torch.full((N, E + 1), float("nan"), device=DEVICE)
    weights, ids = moe_route_x(x, w, bias, k, 2.5, True, dense, True)
    want_w, want_ids = ref.moe_route(torch.nn.functional.linear(x.float(), w), bias, k, 2.5, True)
    got_ids, got_w = _by_expert(weights, ids)
    ref_ids, ref_w = _by_expert(want_w, want_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
    want_dense = torch.cat([torch.zeros(N, E, device=DEVICE).scatter(1, want_ids, want_w),
                            torch.ones(N, 1, device=DEVICE)], dim=1)
    torch.testing.assert_close(dense, want_dense, rtol=1e-5, atol=1e-6)


def test_routes_from_x_only_for_small_routers():
    x, bias = torch.zeros(2, 512, device=DEVICE), torch.zeros(256, device=DEVICE)
    with pytest.raises(ValueError, match="use F.linear"):
        moe_route_x(x, torch.zeros(256, 512, device=DEVICE), bias, 8, 1.0, True)  # GLM-size: 131,072 > MAX_X_WEIGHT
    assert 256 * 512 > MAX_X_WEIGHT
    with pytest.raises(ValueError, match="use F.linear"):
        moe_route_x(x.to(torch.int32), torch.zeros(4, 512, device=DEVICE), bias[:4], 2, 1.0, True)


def test_ties_go_to_the_lowest_expert():
    logits = torch.zeros(2, 6, device=DEVICE)  # every score 0.5; the bias makes experts 1, 3 and 4 tie
    bias = torch.tensor([0.0, 0.2, 0.0, 0.2, 0.2, 0.0], device=DEVICE)
    weights, ids = moe_route(logits, bias, 2, 1.0, True)
    assert ids.tolist() == [[1, 3], [1, 3]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5, device=DEVICE))


def test_refuses_what_it_does_not_compute():
    logits, bias = torch.zeros(2, 4, device=DEVICE), torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="fp32 logits"):
        moe_route(logits.bfloat16(), bias, 2, 1.0, True)
    with pytest.raises(ValueError, match="1 <= k <= E"):
        moe_route(logits, bias, 5, 1.0, True)
    with pytest.raises(ValueError, match="dense must be"):
        moe_route(logits, bias, 2, 1.0, True, torch.zeros(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="bias of E values"):
        moe_route(logits, torch.zeros(3, device=DEVICE), 2, 1.0, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_fused_router_routes_as_the_reference_on_cuda():
    from megactx import ModelConfig
    from megactx.model.moe import Router

    cfg = ModelConfig.from_pretrained("glm-5.2").replace(hidden_size=512)
    router = Router(cfg).cuda()
    torch.nn.init.normal_(router.weight, std=0.05)
    torch.nn.init.normal_(router.e_score_correction_bias, std=0.01)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = router(x)
        router.fuse()
        got = router(x)
    for a, b in zip(_by_expert(*got), _by_expert(*want)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_fused_moe_computes_as_the_reference_on_cuda():
    from megactx import ModelConfig
    from megactx.model.moe import MoE

    cfg = ModelConfig.from_pretrained("tiny")
    moe = MoE(cfg).cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(2, 33, cfg.hidden_size, device="cuda")
    assert moe.experts.runs_dense(x)  # few experts: every expert on every token, weights from the kernel
    with torch.no_grad():
        want = moe(x)
        moe.gate.fuse()
        got = moe(x)  # the kernel's weights for the every-expert form
        moe.fuse()
        folded = moe(x)  # and the shared expert computed as one more expert, at weight 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(folded, want, rtol=1e-4, atol=1e-5)


def test_the_shared_column_is_ones():
    g = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(7, 4, generator=g).to(DEVICE), torch.zeros(4, device=DEVICE)
    dense = torch.full((7, 5), float("nan"), device=DEVICE)
    weights, ids = moe_route(logits, bias, 2, 2.5, True, dense, shared_column=True)
    assert torch.equal(dense[:, 4], torch.ones(7, device=DEVICE))
    torch.testing.assert_close(dense[:, :4], torch.zeros(7, 4, device=DEVICE).scatter(1, ids, weights))
    with pytest.raises(ValueError, match=r"\[7, 5\]"):
        moe_route(logits, bias, 2, 2.5, True, torch.zeros(7, 4, device=DEVICE), shared_column=True)
