"""Small building blocks: RMSNorm and rotary position embeddings (default and YaRN)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from megactx.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused rms_norm: one kernel on CUDA, fp32 inside, one rounding to x's dtype at the
        # end. transformers and DeepSeek normalise in fp32, round, then scale in x's dtype: four
        # kernels (cast, norm, cast, scale) and a second rounding. Norms are ~4 a layer and a decode
        # step is bound by its kernel count, so the fused form, whose error against fp32 is no larger.
        if self.weight.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


# Weights (elements) up to which `linear_fp32` takes the few-row kernel: megactx-tiny's, not GLM-5.2's.
LINEAR_ROWS_MAX_WEIGHT = 1 << 16


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x.to(weight.dtype), weight) (no bias) for the weights a model keeps in fp32 (MoE
    routers, the indexers' head weights), x in the model's dtype: x [..., D], weight [E, D] -> [..., E].

    1-8 rows on a GPU (a decode step's, a speculative verify's, a small batch's) against a small
    weight take one Triton kernel (`megactx.kernels.linear.linear_rows`, which reads x in its own
    dtype), where PyTorch casts x to fp32 and cuBLAS runs a gemv for one row, a SIMT GEMM and a
    split-K reduction for more. On an H100 (2026-12-05, CUDA-graph replays) at megactx-tiny's E = 4,
    D = 256, 4 fp32 rows: 1.56 us against F.linear's 5.20 (one row: the cast ~1.2-1.7 us and the gemv
    ~2.0). For GLM-5.2's (E = 256 or 32, D = 6144) the kernel, one program per output column reading
    its row of W in series, was slower than F.linear (14.5 / 12.6 us against 13.5 / 9.3), so weights
    past LINEAR_ROWS_MAX_WEIGHT keep F.linear, as do more rows, other dtypes, CPUs and autograd."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (not x.is_cuda or weight.dtype != torch.float32 or rows < 1 or weight.numel() > LINEAR_ROWS_MAX_WEIGHT
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x.to(weight.dtype), weight)
    from megactx.kernels.linear import MAX_ROWS, X_DTYPES, linear_rows  # Triton: imported where it runs

    if rows > MAX_ROWS or x.dtype not in X_DTYPES:
        return F.linear(x.to(weight.dtype), weight)
    return linear_rows(x, weight)


def linear_into(x: torch.Tensor, weight: torch.Tensor, into: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """into += F.linear(x, weight, bias), in place: x [..., K], weight [N, K], into [..., N] (x's
    dtype) -> into. A residual add riding in the GEMM that makes its addend: cuBLAS adds `into`
    in the GEMM's epilogue (β = 1, fp32 inside, one rounding), where F.linear and an add are two
    kernels and two roundings. A non-contiguous `into` takes the two kernels. For a buffer the
    caller owns, outside autograd."""
    if not into.is_contiguous():
        return into.add_(F.linear(x, weight, bias))
    flat = into.view(-1, into.shape[-1])
    flat.addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        flat.add_(bias)
    return into


def apply_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(x): the twin of `megactx.kernels.norm.norm_rows` (the paged path passes its backend's)."""
    return norm(x)


def fuse_linears(*linears: nn.Linear) -> torch.Tensor | None:
    """One weight [sum of N_i, D] for bias-free linears that read the same input, so that one GEMM
    computes all of them (a launch-bound decode step pays per GEMM, not per FLOP): their weights
    become views of it, the same values in the same memory, so nothing else changes and in-place
    updates of either reach both. None (nothing changed) if they cannot share one: a bias, another
    dtype, device or input width, or a subclass (quantized linears). F.linear(x, fused).split(
    [N_i]) then gives each one's output."""
    first = linears[0].weight
    if any(type(m) is not nn.Linear or m.bias is not None or m.weight.dtype != first.dtype
           or m.weight.device != first.device or m.weight.shape[1] != first.shape[1] for m in linears):
        return None
    fused = torch.cat([m.weight.detach() for m in linears])  # [sum N_i, D]
    for m, part in zip(linears, fused.split([m.weight.shape[0] for m in linears])):
        m.weight = nn.Parameter(part, requires_grad=m.weight.requires_grad)
    return fused


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [qk_rope_head_dim / 2] fp32 and the cos/sin magnitude factor.

    YaRN blends interpolated and extrapolated frequencies with a linear ramp between the
    dimensions that rotate `beta_fast` and `beta_slow` times over the original context.
    """
    rp = cfg.rope_parameters
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    inv_freq = 1.0 / pos_freqs
    if rp["rope_type"] != "yarn":
        return inv_freq, 1.0

    factor = float(rp["factor"])
    orig = rp["original_max_position_embeddings"]
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    attn_factor = rp.get("attention_factor")
    if attn_factor is None:
        from megactx.config import yarn_mscale

        attn_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                       if mscale and mscale_all else yarn_mscale(factor))
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the trained frequency, 0: interpolate by `factor`
    inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attn_factor)


class Rotary:
    """cos/sin tables for given positions; no state on the module tree (nothing to load)."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq, self.scale = rope_inv_freq(cfg)
        self._on_device: dict[torch.device, torch.Tensor] = {}  # no host-to-device copy a call (CUDA graphs)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [..., S] int -> cos, sin: [..., S, rope_dim] in `dtype`, laid out for apply_rope:
        [cos | cos] and [-sin | sin] (built once a forward, for every layer)."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq
        cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the rope dims of x: [B, S, (H,) D] with cos/sin [B or 1, S, D] from `Rotary`.

    interleave=True pairs dims (0, 1), (2, 3), ... (GLM, DeepSeek MLA); False pairs (i, i + D/2)
    (DeepSeek-V3.2's indexer). Either way the result comes out half-split: [rotated firsts |
    rotated seconds]. Queries and keys go through the same function, so dot products are those of
    the rotation in the checkpoint's own layout.

    [x1 | x2] · [cos | cos] + [x2 | x1] · [-sin | sin] = [x1 cos - x2 sin | x2 cos + x1 sin] in three
    kernels (seven as written): one cat gathers [x1 | x2 | x2 | x1] (or [x2 | x1] alone when x is
    [x1 | x2] already), a mul, and an addcmul whose sum rounds once (fp32 inside for bf16).
    """
    if x.dim() == 4:  # a head axis between S and D
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    d = x.shape[-1]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        both = torch.cat([x1, x2, x2, x1], dim=-1)  # [x1 | x2 | x2 | x1]
        x12, x21 = both[..., :d], both[..., d:]
    else:
        x12, x21 = x, torch.cat([x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return torch.addcmul(x12 * cos, x21, sin)


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
               rope_dims: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope on the first `rope_dims` dims of x (default: all of them), the rest as they are
    (the indexer puts its rope dims first); out: copied into it and returned instead. The
    pure-PyTorch twin of the fused kernel `megactx.kernels.rope.rope_first`."""
    if rope_dims is None or rope_dims == x.shape[-1]:
        roped = apply_rope(x, cos, sin, interleave)
    else:
        rot, rest = x.split([rope_dims, x.shape[-1] - rope_dims], dim=-1)
        roped = torch.cat([apply_rope(rot, cos, sin, interleave), rest], dim=-1)
    return roped if out is None else out.copy_(roped)
