"""MoE routing in one kernel: what `reference.moe_route` (its twin) does in ~9 PyTorch kernels.

After the router's GEMM, a token's experts are its top k of sigmoid(logits) + bias, weighted by
sigmoid(logits), normalised over the k and scaled: sigmoid, add, top-k, gather, sum, add, div and
mul in PyTorch. A decode step of a small MoE model is bound by its kernel count (and a CUDA graph's
launch by its node count), and this runs once a MoE layer. Here: BLOCK_N tokens a program, every
expert of a token in registers (E <= 1024), k rounds of max-and-mask; fp32 throughout, the twin's
operations in its order. Ties in score + bias go to the lowest expert id. Only the ungrouped form
(n_group = 1: GLM-5.x, megactx-tiny); grouped routing (DeepSeek-V3.2) stays on the twin.

The logits come from cuBLAS's GEMM (`moe_route(logits, ...)`), or, for a small router weight
(megactx-tiny's 4 x 256), from the kernel itself (`moe_route_x(x, weight, ...)`: the rows' dot
products with the weight's rows in fp32, as `linear.linear_rows` computes them), one launch where
the GEMM took one more a MoE layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import cdiv, check_device, next_power_of_2
from megactx.kernels.linear import X_DTYPES, rows_dot_w
from megactx.model.layers import LINEAR_ROWS_MAX_WEIGHT

MAX_EXPERTS = 1024  # a token's experts sit in one program's registers
# Router weights (elements) whose logits the kernel computes: linear_fp32's bound for the same dot
# products (megactx-tiny's, not GLM's)
MAX_X_WEIGHT = LINEAR_ROWS_MAX_WEIGHT


@triton.jit
def _route_kernel(logits_ptr, stride_l, bias_ptr, w_ptr, ids_ptr, dense_ptr, stride_d, N, E, scaling,
                  rw_ptr, stride_rw, D,  # FROM_X: logits_ptr is x [N, D], rw the router weight [E, D] fp32
                  K: tl.constexpr, NORM: tl.constexpr, DENSE: tl.constexpr, SHARED: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  FROM_X: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    e = tl.arange(0, BLOCK_E)
    live = rows < N
    mask = live[:, None] & (e[None, :] < E)
    if FROM_X:
        logits = rows_dot_w(logits_ptr, stride_l, rows, N, rw_ptr, stride_rw, e, E, D, BLOCK_D)
    else:
        logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + e[None, :], mask=mask, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logits))  # sigmoid, [BLOCK_N, BLOCK_E]
    bias = tl.load(bias_ptr + e, mask=e < E, other=0.0)
    choice = tl.where(mask, scores + bias[None, :], float("-inf"))
    kk = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_N, BLOCK_K], tl.int64)
    total = tl.zeros([BLOCK_N], tl.float32)
    picked = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)  # each chosen expert's score, 0 elsewhere
    for j in tl.static_range(K):
        best = tl.max(choice, axis=1)
        pick = tl.min(tl.where(choice == best[:, None], e[None, :], BLOCK_E), axis=1)  # lowest id of the ties
        hit = e[None, :] == pick[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weights = tl.where(kk == j, w[:, None], weights)
        ids = tl.where(kk == j, pick[:, None].to(tl.int64), ids)
        total += w
        picked = tl.where(hit, scores, picked)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        weights = weights / (total[:, None] + 1e-20)
        picked = picked / (total[:, None] + 1e-20)
    if DENSE:  # the routing weight of every expert, 0 where not routed: what the every-expert form reads
        tl.store(dense_ptr + rows[:, None].to(tl.int64) * stride_d + e[None, :], picked * scaling, mask=mask)
        if SHARED:  # a last column of ones: the shared expert, computed beside the routed ones
            tl.store(dense_ptr + rows.to(tl.int64) * stride_d + E, tl.full([BLOCK_N], 1.0, tl.float32), mask=live)
    out = rows[:, None].to(tl.int64) * K + kk
    keep = live[:, None] & (kk < K)
    tl.store(w_ptr + out, weights * scaling, mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


def moe_route(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float, norm_topk_prob: bool,
              dense: torch.Tensor | None = None, shared_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 (rows contiguous), bias [E] fp32 -> (weights [N, k] fp32, ids [N, k]
    int64, each row's experts by descending score + bias). Arguments as in the twin,
    `megactx.kernels.reference.moe_route` (n_group 1). dense: an [N, E] fp32 tensor to fill with
    every expert's routing weight, 0 where not routed (what `Experts` computing every expert
    reads; the twin's caller scatters it); [N, E + 1] with shared_column, its last column 1 (the
    shared expert's weight, when it runs as one more expert)."""
    check_device(logits, bias)
    if logits.dtype != torch.float32 or bias.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"moe_route takes fp32 logits with contiguous rows and an fp32 bias, got {logits.dtype} "
                         f"(strides {logits.stride()}) and {bias.dtype}")
    return _route(logits, None, bias, k, scaling, norm_topk_prob, dense, shared_column)


def takes_x(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `moe_route_x` computes these logits: a small fp32 router weight, x of a float dtype."""
    return weight.dtype == torch.float32 and weight.numel() <= MAX_X_WEIGHT and x.dtype in X_DTYPES


def moe_route_x(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, scaling: float,
                norm_topk_prob: bool, dense: torch.Tensor | None = None,
                shared_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route` of the logits F.linear(x.float(), weight), computed in the kernel: x [N, D] (fp32,
    bf16 or fp16, last dim contiguous), weight [E, D] fp32 with at most MAX_X_WEIGHT values (`takes_x`)."""
    check_device(x, weight, bias)
    if not takes_x(x, weight) or x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"moe_route_x takes x [N, D] (fp32, bf16 or fp16) and an fp32 weight [E, D] of at most "
                         f"{MAX_X_WEIGHT} values, got x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} "
                         f"{tuple(weight.shape)}: use F.linear and moe_route")
    if bias.dtype != torch.float32:
        raise ValueError(f"moe_route_x takes an fp32 bias, got {bias.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _route(x, weight if weight.stride(-1) == 1 else weight.contiguous(), bias, k, scaling, norm_topk_prob,
                  dense, shared_column)


def _route(src: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor, k: int, scaling: float,
           norm_topk_prob: bool, dense: torch.Tensor | None, shared_column: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch: src the logits [N, E], or x [N, D] with the router weight [E, D]."""
    N, E = src.shape[0], src.shape[1] if weight is None else weight.shape[0]
    if not 1 <= k <= E <= MAX_EXPERTS or bias.shape != (E,):
        raise ValueError(f"moe_route needs 1 <= k <= E <= {MAX_EXPERTS} and a bias of E values; got k = {k}, "
                         f"E = {E}, bias {tuple(bias.shape)}")
    width = E + shared_column
    if dense is not None and (dense.shape != (N, width) or dense.dtype != torch.float32 or not dense.is_contiguous()):
        raise ValueError(f"dense must be a contiguous fp32 [{N}, {width}] tensor, got {dense.dtype} "
                         f"{tuple(dense.shape)}")
    weights = torch.empty(N, k, dtype=torch.float32, device=src.device)
    ids = torch.empty(N, k, dtype=torch.int64, device=src.device)
    if N:
        block_e = next_power_of_2(E)
        block_n = max(1, min(16, 4096 // block_e))  # a program's scores stay ~4K values
        D = src.shape[1] if weight is not None else 1
        block_d = min(next_power_of_2(D), max(16, 4096 // (block_n * block_e)))  # [N, E, D] products: ~4K
        _route_kernel[(cdiv(N, block_n),)](src, src.stride(0), bias, weights, ids,
                                           weights if dense is None else dense, width, N, E, float(scaling),
                                           src if weight is None else weight,
                                           0 if weight is None else weight.stride(0), D,
                                           K=k, NORM=norm_topk_prob, DENSE=dense is not None,
                                           SHARED=dense is not None and shared_column,
                                           BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_K=next_power_of_2(k),
                                           FROM_X=weight is not None, BLOCK_D=block_d)
    return weights, ids
