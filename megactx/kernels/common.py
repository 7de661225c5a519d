"""What every Triton kernel here needs to know about where it runs."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Under TRITON_INTERPRET=1 (CPU CI) kernels run in numpy; a bf16 tl.dot gives garbage there while
# fp32 and fp8 dots are right, so kernels upcast their dot operands to fp32 when this is set.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
