"""Bounds that `megactx bench kernels` measures beside the kernels, for work no library times for us.

- `read_rows`: read the selected cache rows and nothing else. Sparse MLA decode at batch 64 moves
  ~151 MB of gathered rows (64 rows x 2048 slots x 1152 B) and does 18 GFLOP: near the roofline's
  ridge, so the issue judges it by bytes, against the device copy. A read of the same rows with no
  math at all, timed the same way (a CUDA graph replay, L2 flushed), is what that traffic alone
  costs here: the kernel reads the same bytes, so it cannot beat it, and the ratio of the two times
  is how much of the kernel's time is not the rows' reading.

Triton decides between compiling and interpreting when a kernel is defined, so import this module
only after TRITON_INTERPRET is settled (`benchmarks.kernels.load_kernels` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows a program and its warps: many small programs keep the most loads in flight. On an H200 at
# GLM geometry (64 x 2048 bf16 rows), 8 rows on 4 warps ran within 2% of the best of 4-32 rows
# on 2-8 warps (47.8 us, 74% of the device copy's bandwidth).
ROWS = 8
NUM_WARPS = 4


@triton.jit
def _read_rows_kernel(rows_ptr, slots_ptr, out_ptr, n, row_words, ROWS: tl.constexpr, HEAD: tl.constexpr,
                      TAIL: tl.constexpr):
    """out[program] = the wrapping int32 sum of the words of its ROWS rows (so no load is dead). A row
    is read as its first HEAD words (a power of two) and the rest (TAIL, a power of two >= them), so
    that a 288-word bf16 GLM row is not padded to 512."""
    pid = tl.program_id(0)
    i = pid * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slots_ptr + i, mask=i < n, other=-1)
    row = rows_ptr + slot.to(tl.int64)[:, None] * row_words  # [ROWS, 1]
    valid = (slot >= 0)[:, None]
    head = tl.arange(0, HEAD)[None, :]
    tail = HEAD + tl.arange(0, TAIL)[None, :]
    x = tl.load(row + head, mask=valid, other=0)
    y = tl.load(row + tail, mask=valid & (tail < row_words), other=0)
    tl.store(out_ptr + pid, tl.sum(tl.sum(x, 1), 0) + tl.sum(tl.sum(y, 1), 0))


def read_rows(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read rows[slots] and reduce each program's rows to one int32 word.

    rows: [N, row] cache rows, contiguous, of any dtype, row bytes a multiple of 4 (a paged cache
    viewed flat: row = physical slot); slots: int32 row ids of any shape, -1 = none. Returns
    [programs] int32 (a checksum no one reads: it only keeps the loads alive)."""
    if rows.dim() != 2 or not rows.is_contiguous() or rows.shape[1] * rows.element_size() % 4:
        raise ValueError(f"rows must be a contiguous [N, row] tensor with rows of whole 4-byte words, "
                         f"got shape {tuple(rows.shape)} of {rows.dtype}")
    if slots.dtype != torch.int32:
        raise ValueError(f"slots must be int32, got {slots.dtype}")
    words = rows.view(torch.int32)  # [N, row bytes / 4]
    flat = slots.reshape(-1).contiguous()
    n, row_words = flat.numel(), words.shape[1]
    out = torch.empty(triton.cdiv(n, ROWS), dtype=torch.int32, device=rows.device)
    if n:
        head = 1 << (row_words.bit_length() - 1)  # the largest power of two <= row_words
        tail = triton.next_power_of_2(max(1, row_words - head))
        _read_rows_kernel[(out.numel(),)](words, flat, out, n, row_words, ROWS=ROWS, HEAD=head, TAIL=tail,
                                          num_warps=NUM_WARPS)
    return out
