"""What every Triton kernel here needs to know about where it runs."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Under TRITON_INTERPRET=1 (CPU CI) kernels run in numpy; a bf16 tl.dot gives garbage there while
# fp32 and fp8 dots are right, so kernels upcast their dot operands to fp32 when this is set.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def dot_f32(*dtypes: torch.dtype, interpret: bool = INTERPRET) -> bool:
    """Whether a kernel's tl.dot runs in fp32 (its DOT_F32) for operands of these dtypes: where one is
    fp32 (the exact paths), and under the interpreter where one is 16-bit (fp8 dots are right there).
    interpret: False gives a GPU's choice (`megactx bench compile` compiles for one)."""
    return torch.float32 in dtypes or (interpret and any(d.is_floating_point and d.itemsize == 2 for d in dtypes))


# Launch arithmetic on the host. triton.cdiv and triton.next_power_of_2 are constexpr functions
# since Triton 3.5 (~2.6 us a call on the host): a prefill chunk's indexer and top-k took ~17 of them.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints (triton.cdiv's value)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n, 0 for n <= 0 (triton.next_power_of_2's value)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse CPU tensors unless the interpreter is on (a clear error instead of a Triton crash)."""
    for t in tensors:
        if t.device.type != "cuda" and not INTERPRET:
            raise RuntimeError(f"Triton kernels need CUDA tensors (got one on {t.device}); on a CPU, "
                               "run under TRITON_INTERPRET=1 or use the twins in megactx.kernels.reference")


@triton.jit
def to_bf16(x):
    """x: fp32/fp16/bf16 -> bf16, round to nearest even (finite inputs), on the bits: the interpreter's
    `.to(tl.bfloat16)` truncates where the GPU rounds, so CPU tests would not check the GPU's code."""
    if x.dtype == tl.bfloat16:
        return x
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


# FP8 e4m3 on the bits rather than with `.to(tl.float8e4nv)` (as `to_bf16` does for bf16): the
# interpreter (CPU CI) rounds fp8 ties away from zero and does not carry a rounding into the next
# power of two (126.2 became 64, not 128), while the GPU rounds to nearest even. By hand, the CPU
# tests check exactly the code the GPU runs, and both agree bit for bit with torch's casts.
@triton.jit
def e4m3_bits(x):
    """x: fp32 with |x| <= 448 -> its e4m3fn encoding (int32 in 0..255), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|x| >= 2^-6): keep 3 mantissa bits; an integer add rounds and carries into the
    # exponent, then rebias the exponent from 127 to 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal e4m3 (steps of 2^-9): beside 2^14 an fp32 ulp is 2^-9, so the adder rounds for us
    # and the low mantissa bits count the steps (8 steps = 2^-6 is code 8, the smallest normal)
    subnormal = (tl.abs(x) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return tl.where(mag >= 0x3C800000, normal, subnormal) | sign  # 0x3C800000 = 2^-6


@triton.jit
def quantize_e4m3(x):
    """x: fp32 [G, D] groups (padding lanes 0) -> (e4m3 bytes [G, D] uint8, fp32 scales [G]),
    x ≈ e4m3 · scale with scale = amax / 448, as `megactx.model.quant.quantize_rows` does."""
    amax = tl.max(tl.abs(x), axis=1)
    # div_rn: Triton's `/` is an approximate division on the GPU, the twin's an IEEE one
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    return e4m3_bits(q).to(tl.uint8), scale
