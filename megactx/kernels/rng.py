"""Counter-based random numbers for many rows in one launch; twin: `reference.row_random`.

A seeded request must draw the same numbers whatever else shares its batch, so it keeps a stream
of its own. With a torch.Generator a request, a batch of S seeded rows costs S launches a draw
(and a speculative step draws several times: every draft step, the acceptance tests, the
replacement token). Here a stream is a key and a counter, and its values are a hash of them, so
the rows of a batch are one launch whatever S is, and the kernel reads the counters from memory
(a CUDA graph can replay it with new ones).

Stream of key K (`reference.stream_key(seed)`: splitmix64 of the seed, on the host): its n-th value
(n = 1, 2, ...) is z = mix64(K + n·G mod 2^64) (G the golden-ratio increment, mix64 splitmix64's
finalizer); the top 23 bits b of z give u = (2b + 1) / 2^24, uniform on (0, 1) and never 0 or 1,
exact in fp32; the exponential draw is -log(u). The twin computes the same bits in int64 torch
arithmetic (wrapping), so the uniforms are equal bit for bit and the exponentials up to log's
rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megactx.kernels.common import cdiv, check_device
from megactx.kernels.reference import check_streams

BLOCK = 1024


@triton.jit
def _mix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _values(key, first, cols, EXPONENTIAL: tl.constexpr):
    """Values first + cols of the stream of `key` (both int64). (The constants are reference.GOLDEN,
    MIX1, MIX2.)"""
    n = (first + cols.to(tl.int64)).to(tl.uint64, bitcast=True)
    z = _mix64(key.to(tl.uint64, bitcast=True) + n * 0x9E3779B97F4A7C15)
    bits = (z >> 41).to(tl.int32)
    u = (2 * bits + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    if EXPONENTIAL:
        u = -tl.log(u)
    return u


@triton.jit
def _row_random_kernel(keys_ptr, offsets_ptr, stride_k, stride_o, out_ptr, width, EXPONENTIAL: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program (row, block): values offset + 1 + j of the row's stream, j in the block, -> out[row, j]."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row * stride_k)
    u = _values(key, tl.load(offsets_ptr + row * stride_o) + 1, cols, EXPONENTIAL)
    tl.store(out_ptr + row.to(tl.int64) * width + cols, u, mask=cols < width)


@triton.jit(do_not_specialize=["key", "offset"])
def _one_row_kernel(key, offset, out_ptr, width, EXPONENTIAL: tl.constexpr, BLOCK: tl.constexpr):
    """One stream whose key and offset come as arguments (no copy to the device): out[j]."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = _values(key.to(tl.int64), offset.to(tl.int64) + 1, cols, EXPONENTIAL)
    tl.store(out_ptr + cols, u, mask=cols < width)


def one_row_random(key: int, offset: int, width: int, exponential: bool, out: torch.Tensor) -> torch.Tensor:
    """row_random for one stream given on the host (key from `reference.stream_key`, values drawn
    before) into out: contiguous fp32 [width] on the GPU. One launch, no host-to-device copy (a
    batch of one seeded request draws as cheaply as from a torch.Generator)."""
    if out.dtype != torch.float32 or out.numel() != width or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of {width} values, got {out.dtype} {tuple(out.shape)}")
    check_device(out)
    if width:
        _one_row_kernel[(cdiv(width, BLOCK),)](key, offset, out, width, EXPONENTIAL=exponential, BLOCK=BLOCK)
    return out


def row_random(keys: torch.Tensor, offsets: torch.Tensor, width: int, exponential: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """keys, offsets: [S] int64 (stream keys from `reference.stream_key`, values each stream drew
    before; any strides) -> [S, width] fp32: the next `width` values of each stream, uniform on
    (0, 1) or, with exponential, Exp(1), written into `out` when given (contiguous [S, width]
    fp32). The caller advances its counters by width."""
    check_streams(keys, offsets, width, out)
    check_device(keys, offsets)
    if out is None:
        out = torch.empty(keys.shape[0], width, dtype=torch.float32, device=keys.device)
    if out.numel():
        _row_random_kernel[(keys.shape[0], cdiv(width, BLOCK))](
            keys, offsets, keys.stride(0), offsets.stride(0), out, width, EXPONENTIAL=exponential, BLOCK=BLOCK)
    return out
