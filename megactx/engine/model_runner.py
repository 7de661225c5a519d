"""Runs the model for one scheduled step over the engine's paged caches.

The runner owns the caches (one MLA cache per layer, an indexer cache per full layer and per MTP
layer, all indexed by the block manager's block ids) and turns a step — a list of
`ScheduledSeq` chunks — into a flattened batch with explicit metadata (`PagedBatch`), runs
`Transformer.hidden_states` over it, and returns the logits of the chunks that sample.

Cache sizing: on CUDA, the blocks fill `gpu_memory_utilization` of the device after the weights
and a profiled forward of `max_num_batched_tokens` tokens (activations); on a CPU, they hold
`max_num_seqs` sequences of `max_model_len` tokens, capped by `cpu_cache_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megactx.engine.scheduler import ScheduledSeq
from megactx.kernels.reference import BLOCK_SIZE
from megactx.model.paged import (
    PagedBatch,
    PagedLayerCache,
    alloc_caches,
    cache_bytes_per_token,
    kernel_ops,
)
from megactx.model.transformer import Transformer


@dataclass
class CacheConfig:
    kv_dtype: torch.dtype  # torch.uint8 = the FP8 layout
    index_dtype: torch.dtype  # torch.uint8 = the FP8 layout
    num_blocks: int

    def bytes_per_block(self, cfg) -> int:
        return cache_bytes_per_token(cfg, self.kv_dtype, self.index_dtype) * BLOCK_SIZE


def plan_num_blocks(model: Transformer, kv_dtype: torch.dtype, index_dtype: torch.dtype, *, max_model_len: int,
                    max_num_seqs: int, max_num_batched_tokens: int, gpu_memory_utilization: float = 0.9,
                    cpu_cache_bytes: int = 4 << 30, backend: str = "torch") -> int:
    """How many KV blocks fit (see the module docstring). Raises if not even one sequence fits."""
    cfg = model.cfg
    per_block = cache_bytes_per_token(cfg, kv_dtype, index_dtype) * BLOCK_SIZE
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        _profile_forward(model, max_num_batched_tokens, kv_dtype, index_dtype, backend)
        peak = torch.cuda.max_memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * gpu_memory_utilization) - used_by_others - peak
        num_blocks = budget // per_block
        where = f"{gpu_memory_utilization:.0%} of the GPU's {total / 2**30:.1f} GiB after weights and activations"
    else:
        wanted = max_num_seqs * -(-max_model_len // BLOCK_SIZE)
        num_blocks = min(wanted, cpu_cache_bytes // per_block)
        where = f"the CPU cache budget of {cpu_cache_bytes / 2**30:.1f} GiB"
    need = -(-max_model_len // BLOCK_SIZE)
    if num_blocks < need:
        raise ValueError(f"the KV cache fits {max(num_blocks, 0)} blocks of {BLOCK_SIZE} tokens in {where}, but one "
                         f"sequence of max_model_len = {max_model_len} needs {need}: lower max_model_len, use "
                         "--kv-cache-dtype fp8, or raise the memory budget")
    return num_blocks


@torch.inference_mode()
def _profile_forward(model: Transformer, num_tokens: int, kv_dtype, index_dtype, backend: str) -> None:
    """One forward of num_tokens positions (one sequence) over a throwaway cache: its peak memory
    is what a step can take besides the KV cache."""
    blocks = -(-num_tokens // BLOCK_SIZE)
    caches = alloc_caches(model.cfg, blocks, kv_dtype, index_dtype, next(model.parameters()).device)
    batch = PagedBatch.build([list(range(blocks))], [0], [num_tokens], caches[0][0].device)
    ops = kernel_ops(backend)
    layers = [PagedLayerCache(kv, index, batch, ops) for kv, index in caches[: model.cfg.num_hidden_layers]]
    ids = torch.zeros(1, num_tokens, dtype=torch.long, device=caches[0][0].device)
    hidden = model.hidden_states(ids, batch.positions[None], layers)
    model.compute_logits(hidden[:, -1])
    del caches, layers, hidden


class ModelRunner:
    def __init__(self, model: Transformer, cache: CacheConfig, backend: str):
        self.model = model
        self.cfg = model.cfg
        self.device = next(model.parameters()).device
        self.cache = cache
        self.ops = kernel_ops(backend)
        self.caches = alloc_caches(self.cfg, cache.num_blocks, cache.kv_dtype, cache.index_dtype, self.device)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv, index in self.caches for t in (kv, index) if t is not None)

    def layer_caches(self, batch: PagedBatch) -> list[PagedLayerCache]:
        return [PagedLayerCache(kv, index, batch, self.ops) for kv, index in self.caches[: self.cfg.num_hidden_layers]]

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, PagedBatch, torch.Tensor]:
        """-> input_ids [1, T], the batch metadata, and the rows [R] of the chunks that sample
        (each chunk's last token), in scheduled order."""
        ids = [t for item in scheduled for t in item.seq.token_ids[item.start : item.end]]
        batch = PagedBatch.build([item.seq.block_table for item in scheduled], [item.start for item in scheduled],
                                 [item.num_tokens for item in scheduled], self.device)
        ends = torch.tensor([item.num_tokens for item in scheduled]).cumsum(0) - 1
        rows = ends[[i for i, item in enumerate(scheduled) if item.samples]]
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)[None]
        return input_ids, batch, rows.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the step's chunks (writing their KV) -> logits [R, vocab] fp32 of the chunks
        that sample, in scheduled order."""
        input_ids, batch, rows = self.prepare(scheduled)
        hidden = self.model.hidden_states(input_ids, batch.positions[None], self.layer_caches(batch))[0]  # [T, D]
        return self.model.compute_logits(hidden.index_select(0, rows))
