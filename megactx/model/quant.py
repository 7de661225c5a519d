"""FP8 (e4m3) helpers: per-row activation quantization for the indexer, and the 128×128 block
format of published FP8 checkpoints (`weight` e4m3 + `weight_scale_inv` fp32 per block)."""

from __future__ import annotations

import functools
import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(x: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (x8: [..., D] e4m3, scale: [...] fp32) with x ≈ x8 * scale per row."""
    scale = x.float().abs().amax(-1).clamp_min(eps) / FP8_MAX
    x8 = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8, scale


@functools.lru_cache(maxsize=16)
def hadamard(n: int, device=None) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix [n, n] fp32; n a power of two. Cached: do not modify it.

    Rotating q and k by it leaves their dot products unchanged but spreads outlier channels over
    all dims, so per-row FP8 scales lose less (DeepSeek-V3.2's indexer does the same)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (w8: [out, in] e4m3, scale_inv: [ceil(out/br), ceil(in/bc)] fp32), w ≈ w8 * scale_inv."""
    out_f, in_f = w.shape
    br, bc = block
    rows, cols = math.ceil(out_f / br), math.ceil(in_f / bc)
    padded = torch.zeros(rows * br, cols * bc, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    tiles = padded.view(rows, br, cols, bc)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [rows, cols]
    w8 = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8.view(rows * br, cols * bc)[:out_f, :in_f].contiguous(), scale


def dequantize_blocks(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Inverse of `quantize_blocks`: w8 [out, in] e4m3 + scale_inv per block -> fp32 [out, in]."""
    out_f, in_f = w8.shape
    br, bc = block
    rows, cols = math.ceil(out_f / br), math.ceil(in_f / bc)
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a [{out_f}, {in_f}] "
                         f"weight in {br}x{bc} blocks needs [{rows}, {cols}]")
    s = scale_inv.float().repeat_interleave(br, 0)[:out_f].repeat_interleave(bc, 1)[:, :in_f]
    return w8.float() * s
