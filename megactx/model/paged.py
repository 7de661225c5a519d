"""The model over a paged KV cache: batch metadata, per-layer caches, and the kernels a forward calls.

A paged forward runs the tokens of several sequences flattened into one row, `input_ids [1, T]`,
through the same `Transformer.hidden_states` as the reference; what changes is the cache each
layer gets: a `PagedLayerCache` instead of a `LayerCache`. Its MLA then writes the new tokens' KV
into paged blocks, runs the indexer over the paged indexer cache (full layers), and attends with
sparse MLA to the selected slots — through `KernelOps`, the pure-torch twins (`backend="torch"`,
any device) or the Triton kernels (`backend="triton"`, CUDA or the interpreter).

Everything a kernel needs about the batch travels in `PagedBatch`, built on the host by the
caller (the engine's model runner, or `Transformer.forward` for a one-shot paged forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from megactx.config import ModelConfig

# A module object, not names from it: kernels.reference imports model.quant, so while it loads first
# this module can be imported with it half-initialised; its attributes are only read at call time.
from megactx.kernels import reference as ref
from megactx.model.layers import apply_norm, rope_first

# The indexer computes logits for this many bytes of [query rows × keys] at a time (fp32), then
# keeps each row's top-k: a 1M-token prefill never materialises its [1M × 1M] logits. Each buffer
# costs the host a logits launch and a four-kernel top-k (~0.5-0.6 ms of host time on the H100's
# machine): at 256 MiB (64 rows at 1M keys) megactx-tiny's indexer was bound by the host, the GPU
# busy 55-57% of a 64K chunk (`megactx bench chunk`, H100, 2026-12-05: 624 ms at 1M keys); at 1 GiB
# 97-99% busy and at its bytes' floor (313 ms). GLM-5.2's indexer (16x the FLOPs a pair) is bound by
# the device at both (59.6 and 55.9 ms for 4096 rows at 1M).
LOGITS_BUDGET_BYTES = 1 << 30
# On a CPU (the PyTorch twins) chunks whose temporaries stay in cache: a 16K-token prefill of
# megactx-tiny on 2 cores took 12.1 s at 8 MiB, 13.2 s at 32 MiB and 18.1 s at 256 MiB.
CPU_LOGITS_BUDGET_BYTES = 8 << 20

CACHE_DTYPES = {"fp8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class KernelOps:
    """The kernels of a paged attention layer; both backends share these signatures."""

    write_kv: Callable  # (c, k_pe, slots, kv_cache, index_k, index_cache, *, mla_prep, index_prep) -> None
    indexer_topk: Callable  # (q, w, index_cache, block_table, seq_idx, key_len, k, chunk_tokens, key_len_host)
    sparse_mla: Callable  # (q, kv_cache, topk_slots, softmax_scale, kv_lora_rank, topk_len) -> (out, lse)
    rope: Callable = rope_first  # (x, cos, sin, interleave, rope_dims=None) -> roped copy of x
    norm: Callable = apply_norm  # (x, norm module) -> module(x); a strided x (q_a's slice) in one kernel
    # (q, w, cos, sin, interleave, rope_dims, rotation, w_scale_heads, w_scale_dim) -> (q8, w): FP8 indexer queries
    index_queries_fp8: Callable = field(default_factory=lambda: ref.index_queries_fp8)  # (read at call time)


def kernel_ops(backend: str) -> KernelOps:
    """"torch": the pure-PyTorch twins (megactx.kernels.reference); "triton": the Triton kernels."""
    if backend == "torch":
        return KernelOps(ref.write_kv, ref.indexer_topk_chunked, ref.sparse_mla)
    if backend == "triton":
        from megactx.kernels.index_queries import index_queries_fp8, takes
        from megactx.kernels.indexer import indexer_topk_chunked
        from megactx.kernels.kv_write import write_kv
        from megactx.kernels.norm import norm_rows
        from megactx.kernels.rope import rope_first as fused_rope
        from megactx.kernels.sparse_mla import sparse_mla

        def index_queries(q, w, cos, sin, interleave, rope_dims, *scales):
            """The kernel where it takes the geometry and dtype (megactx-tiny's, GLM-5.x's), else the twin."""
            return (index_queries_fp8 if takes(q, rope_dims) else ref.index_queries_fp8)(
                q, w, cos, sin, interleave, rope_dims, *scales)

        return KernelOps(write_kv, indexer_topk_chunked, sparse_mla, rope=fused_rope, norm=norm_rows,
                         index_queries_fp8=index_queries)
    raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")


def to_device(t: torch.Tensor | np.ndarray | Sequence, device: str | torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor or array (or values for torch.tensor(t, dtype=dtype)) on `device` without stalling the
    GPU. A copy from pageable host memory first synchronises the CUDA stream (CUDA's rule), so in a
    decode step the host would wait for every queued kernel and the GPU then wait for the host.
    Staged in pinned memory the copy is asynchronous; PyTorch's caching host allocator keeps the
    pinned block until the copy that reads it has run, so the staging tensor may be dropped at once."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    elif not isinstance(t, torch.Tensor):
        t = torch.tensor(t, dtype=dtype)
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_from_host_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) from a host tensor, asynchronous when dst is on a GPU (see to_device)."""
    return dst.copy_(src.pin_memory() if dst.is_cuda and src.device.type == "cpu" else src, non_blocking=True)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}
_NUMPY_DTYPES = {torch_dtype: numpy_dtype for numpy_dtype, torch_dtype in _TORCH_DTYPES.items()}


def _layout(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of arrays (shape, dtype) packed one after another, each 8-byte aligned (a view of
    the bytes as int64 needs it), and the total."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-math.prod(shape) * np.dtype(dtype).itemsize // 8) * 8
    return offsets, total


def _views(buffer: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], np.dtype]],
           offsets: Sequence[int]) -> list[torch.Tensor]:
    """The arrays `specs` (shape, numpy dtype) at `offsets` of the bytes `buffer` [N] uint8, as tensors."""
    return [buffer[o : o + math.prod(shape) * np.dtype(dtype).itemsize]
            .view(_TORCH_DTYPES[np.dtype(dtype)]).view(shape) for (shape, dtype), o in zip(specs, offsets)]


def to_device_packed(arrays: Sequence[np.ndarray], device: str | torch.device) -> list[torch.Tensor]:
    """Host arrays (int64, int32 or fp32) on `device` in one copy: packed into one block of pinned
    memory (on CUDA), sent with one to_device, returned as views of it with their shapes and dtypes.
    A step's small metadata arrays cost one pinned staging block and one copy, not a block and a copy each."""
    specs = [(a.shape, a.dtype) for a in arrays]
    offsets, total = _layout(specs)
    cuda = torch.device(device).type == "cuda"
    host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=cuda)  # pinned up front: no pin_memory() copy
    raw = host.numpy()
    for a, offset in zip(arrays, offsets):
        raw[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    return _views(host.to(device, non_blocking=True) if cuda else to_device(host, device), specs, offsets)


class StagedBuffers:
    """Named device buffers (fields) in one block of device memory, with a host twin of the same
    layout: the host writes the twin with numpy (`host()`), and send() copies all of it over in one
    asynchronous copy. For a graph's static inputs, sent every step: the twin is pinned once (on
    CUDA), where to_device would pin a staging copy every time (~15-20 us of host time on an H200
    host), and a step's inputs go in one copy however many fields they fill.

    Reuse is guarded: host() first waits for the copy that last read the twin (an event recorded
    behind it, normally long done: the engine syncs with the device once a step). Between sends,
    the twin holds what the last send sent, field by field; device-side writes into the fields
    (a graph's clear, tokens put in place on the device) are not seen by it."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: str | torch.device):
        """fields: name -> (shape, dtype: int64, int32 or fp32), all zeros at first."""
        specs = [(shape, _NUMPY_DTYPES[dtype]) for shape, dtype in fields.values()]
        offsets, total = _layout(specs)
        cuda = torch.device(device).type == "cuda"
        self._device = torch.zeros(max(total, 8), dtype=torch.uint8, device=device)
        self._host = torch.zeros(max(total, 8), dtype=torch.uint8, pin_memory=cuda)
        self.device = dict(zip(fields, _views(self._device, specs, offsets)))  # name -> device tensor (static)
        self._twin = {name: t.numpy() for name, t in zip(fields, _views(self._host, specs, offsets))}
        self._sent = torch.cuda.Event() if cuda else None  # recorded behind the last copy from the twin

    def host(self) -> dict[str, np.ndarray]:
        """name -> the field's host twin (numpy, writable) once the last send has read it."""
        if self._sent is not None:
            self._sent.synchronize()
        return self._twin

    def send(self) -> None:
        """Copy the whole twin to the device (asynchronously on CUDA: stream-ordered before what follows)."""
        self._device.copy_(self._host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()


class HostCopy:
    """Device tensors' copies to the host, queued behind the work that makes them (pinned memory and
    an event on CUDA), so the host need not wait now; lists() waits for them, once, -> each as
    tolist()."""

    def __init__(self, *values: torch.Tensor):
        self._event = None
        if values and values[0].is_cuda:
            self._host = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                          for v in values]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = list(values)
        self._lists: list[list] | None = None

    def lists(self) -> list[list]:
        if self._lists is None:
            if self._event is not None:
                self._event.synchronize()
            self._lists = [h.tolist() for h in self._host]
        return self._lists


def host_block_table(tables: Sequence[Sequence[int]], bsz: int) -> torch.Tensor:
    """Block tables of the first len(tables) of bsz sequences -> [bsz, width] int32 on the host,
    0-padded; width = the longest table (at least 1)."""
    width = max(1, max((len(t) for t in tables), default=0))
    rows = [list(t) + [0] * (width - len(t)) for t in tables] + [[0] * width] * (bsz - len(tables))
    return torch.tensor(rows, dtype=torch.int32).view(bsz, width)  # one tensor a step, not one a sequence


def slots_of_positions(tables: Sequence[Sequence[int]], positions: Sequence[int]) -> list[int]:
    """The KV slot of one position of each sequence (a decode step's), over its physical blocks tables[b]."""
    return [blocks[p // ref.BLOCK_SIZE] * ref.BLOCK_SIZE + p % ref.BLOCK_SIZE for p, blocks in zip(positions, tables)]


def slots_of_range(blocks: Sequence[int], start: int, n: int) -> list[int]:
    """The KV slots (block * 64 + offset) of one sequence's consecutive positions start .. start + n - 1
    over its physical blocks, built one range a block (the engine fills its step inputs this way every step)."""
    out: list[int] = []
    position, end = start, start + n
    while position < end:
        block, offset = divmod(position, ref.BLOCK_SIZE)
        take = min(ref.BLOCK_SIZE - offset, end - position)
        base = blocks[block] * ref.BLOCK_SIZE + offset
        out.extend(range(base, base + take))
        position += take
    return out


@dataclass
class PagedBatch:
    """Metadata of one forward over paged caches: T tokens of B sequences, flattened in one row.

    Token t of sequence seq_idx[t] sits at `positions[t]`, writes its KV to `slots[t]` (-1 = write
    nothing) and sees keys 0 .. key_len[t] - 1 of its sequence (causal: position + 1), whose
    physical blocks are `block_table[seq_idx[t]]`."""

    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, block * 64 + offset
    seq_idx: torch.Tensor  # [T] int32
    key_len: torch.Tensor  # [T] int32
    block_table: torch.Tensor  # [B, max_blocks] int32, 0 past a sequence's blocks
    key_len_host: torch.Tensor  # [T] int32 on the CPU: bounds the indexer's logits without a sync

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], starts: Sequence[int], num_tokens: Sequence[int],
              device: str | torch.device = "cpu") -> PagedBatch:
        """Sequence b computes positions starts[b] .. starts[b] + num_tokens[b] - 1 over its physical
        blocks block_tables[b] (which must cover them)."""
        if not len(block_tables) == len(starts) == len(num_tokens):
            raise ValueError("block_tables, starts and num_tokens need one entry per sequence")
        positions: list[int] = []
        slots: list[int] = []
        seq_idx: list[int] = []
        for b, (table, start, n) in enumerate(zip(block_tables, starts, num_tokens)):
            if start < 0 or n < 0:
                raise ValueError(f"sequence {b}: start {start} and num_tokens {n} must be >= 0")
            if start + n > len(table) * ref.BLOCK_SIZE:
                raise ValueError(f"sequence {b}: positions up to {start + n - 1} need "
                                 f"{-(-(start + n) // ref.BLOCK_SIZE)} blocks, its block table has {len(table)}")
            positions.extend(range(start, start + n))
            slots.extend(slots_of_range(table, start, n))
            seq_idx.extend([b] * n)
        pos = np.array(positions, dtype=np.int64)
        key_len = (pos + 1).astype(np.int32)
        table = host_block_table(block_tables, len(block_tables)).numpy()
        # one copy for all of it (on a GPU, each to_device would pin a staging block and queue a copy)
        pos_d, slots_d, seq_d, key_len_d, table_d = to_device_packed(
            [pos, np.array(slots, dtype=np.int64), np.array(seq_idx, dtype=np.int32), key_len, table], device)
        return cls(pos_d, slots_d, seq_d, key_len_d, table_d, torch.from_numpy(key_len))

    def select(self, index: torch.Tensor, key_len_host: torch.Tensor) -> PagedBatch:
        """The batch of the tokens at index ([R] int64 on the batch's device; device ops only, so a
        CUDA graph may capture it), key_len_host [R] being theirs on the host. Same block table."""
        picked = (t.index_select(0, index) for t in (self.positions, self.slots, self.seq_idx, self.key_len))
        return PagedBatch(*picked, self.block_table, key_len_host)

    def output_rows(self, rows: Sequence[int], index: torch.Tensor | None = None) -> OutputRows:
        """Some of the batch's tokens as the rows whose outputs a forward computes: rows (host
        indices, any order; index: the same on the batch's device, when the caller has it there)."""
        index = to_device(np.asarray(rows, dtype=np.int64), self.positions.device) if index is None else index
        return OutputRows(index, self.select(index, self.key_len_host[torch.as_tensor(rows, dtype=torch.int64)]))

    def indexer_chunk(self) -> int:
        """Query rows per indexer logits chunk under LOGITS_BUDGET_BYTES (CPU_LOGITS_BUDGET_BYTES on a CPU)."""
        max_keys = int(self.key_len_host.max()) if self.num_tokens else 1
        budget = CPU_LOGITS_BUDGET_BYTES if self.key_len.device.type == "cpu" else LOGITS_BUDGET_BYTES
        return max(1, budget // (4 * max(max_keys, 1)))


@dataclass(frozen=True)
class OutputRows:
    """The rows of a paged forward whose outputs are wanted (`PagedBatch.output_rows`): a layer given
    them writes the KV of all its T rows and computes the rest (indexer, attention, MLP) for these
    alone. index: [R] int64 on the device, into the T rows; batch: those rows' own PagedBatch."""

    index: torch.Tensor
    batch: PagedBatch

    def __len__(self) -> int:
        return self.batch.num_tokens


@dataclass
class PagedLayerCache:
    """What one layer's attention needs for a paged forward: its caches, the batch, the kernels.

    kv: MLA cache (layouts in megactx.kernels.reference: uint8 = FP8, else exact bf16/fp32);
    index: the indexer cache on full layers (uint8 = FP8, else exact), None on shared layers."""

    kv: torch.Tensor
    index: torch.Tensor | None
    batch: PagedBatch
    ops: KernelOps


def alloc_caches(cfg: ModelConfig, num_blocks: int, kv_dtype: torch.dtype, index_dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(kv, index) caches of every layer, then of every MTP layer; index only where the layer
    has an indexer (full layers and MTP layers). dtypes: torch.uint8 = FP8 layout."""
    has_indexer = [t == "full" for t in cfg.indexer_types] + [True] * cfg.num_nextn_predict_layers
    caches = []
    for full in has_indexer:
        kv = ref.alloc_kv_cache(num_blocks, cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_dtype == torch.uint8,
                                device, kv_dtype if kv_dtype != torch.uint8 else torch.bfloat16)
        index = ref.alloc_index_cache(num_blocks, cfg.index_head_dim, device, index_dtype) if full else None
        caches.append((kv, index))
    return caches


def cache_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype, index_dtype: torch.dtype,
                          indexer_in_every_layer: bool = False) -> int:
    """Bytes a token occupies across all layers' caches (MTP layers included); with
    indexer_in_every_layer, what it would take without IndexShare."""
    r, dr, DI = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    kv = ref.mla_fp8_bytes(r, dr) if kv_dtype == torch.uint8 else (r + dr) * kv_dtype.itemsize
    index = DI + 4 if index_dtype == torch.uint8 else DI * index_dtype.itemsize
    num_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    num_indexers = (num_layers if indexer_in_every_layer else len(cfg.full_layers) + cfg.num_nextn_predict_layers)
    return num_layers * kv + num_indexers * index


def resolve_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """"auto" (the model's dtype: exact), "bf16", "fp32" or "fp8" -> the cache tensor dtype."""
    if name == "auto":
        return model_dtype if model_dtype in (torch.float32, torch.bfloat16) else torch.bfloat16
    if name not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of auto, {', '.join(CACHE_DTYPES)}; got {name!r}")
    return CACHE_DTYPES[name]
