"""Runs the model for one scheduled step over the engine's paged caches.

The runner owns the caches (one MLA cache per layer, an indexer cache per full layer and per MTP
layer, all indexed by the block manager's block ids) and turns a step — a list of
`ScheduledSeq` chunks — into a flattened batch with explicit metadata (`PagedBatch`), runs
`Transformer.hidden_states` over it, and returns the logits of the chunks that sample.

Decode steps on CUDA replay CUDA graphs (`DecodeGraphs`): a step of B sequences decoding one token
each runs the graph captured for the smallest batch bucket >= B and the smallest key-count bucket
>= the longest sequence, over static input buffers the runner fills; padded rows see no keys and
write nothing. Everything else (prefill chunks, mixed steps, CPU) runs eagerly.

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
    def __init__(self, model: Transformer, cache: CacheConfig, backend: str, *, max_num_seqs: int = 64,
                 max_model_len: int | None = None, cuda_graphs: bool = True):
        self.model = model
        self.cfg = model.cfg
        self.device = next(model.parameters()).device
        self.cache = cache
        self.ops = kernel_ops(backend)
        self.caches = alloc_caches(self.cfg, cache.num_blocks, cache.kv_dtype, cache.index_dtype, self.device)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len or self.cfg.max_position_embeddings)

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
        if self.graphs is not None and self.graphs.can_run(scheduled):
            return self.graphs.run(scheduled)
        input_ids, batch, rows = self.prepare(scheduled)
        hidden = self.model.hidden_states(input_ids, batch.positions[None], self.layer_caches(batch))[0]  # [T, D]
        return self.model.compute_logits(hidden.index_select(0, rows))


def _buckets(largest: int, first: int) -> list[int]:
    """first, 2 first, 4 first, ... up to and including largest."""
    out = [first]
    while out[-1] < largest:
        out.append(min(out[-1] * 2, largest))
    return out


class DecodeGraphs:
    """CUDA graphs of decode steps (one token a sequence), captured lazily per (batch bucket,
    key-count bucket). The key bucket bounds the indexer's logits buffer ([batch, keys] fp32): one
    graph for every context up to max_model_len would make a short-context step pay for 1M keys."""

    MIN_KEYS = 4096  # the smallest key-count bucket

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.batch_buckets = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < max_num_seqs]
        self.batch_buckets.append(max_num_seqs)
        self.key_buckets = _buckets(max_model_len, min(self.MIN_KEYS, max_model_len))
        self.max_blocks = -(-max_model_len // BLOCK_SIZE)
        n, dev = max_num_seqs, runner.device
        self.input_ids = torch.zeros(1, n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_idx = torch.arange(n, dtype=torch.int32, device=dev)
        self.key_len = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by every graph (they never run at once)

    def can_run(self, scheduled: list[ScheduledSeq]) -> bool:
        return (len(scheduled) <= self.batch_buckets[-1]
                and all(item.num_tokens == 1 and item.samples for item in scheduled))

    def _bucket(self, buckets: list[int], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def _batch(self, bs: int, max_keys: int) -> PagedBatch:
        return PagedBatch(self.positions[:bs], self.slots[:bs], self.seq_idx[:bs], self.key_len[:bs],
                          self.block_table[:bs], torch.full((bs,), max_keys, dtype=torch.int32))

    def _capture(self, bs: int, max_keys: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        model, runner = self.runner.model, self.runner
        batch = self._batch(bs, max_keys)
        layers = runner.layer_caches(batch)

        def step() -> torch.Tensor:
            hidden = model.hidden_states(self.input_ids[:, :bs], self.positions[None, :bs], layers)[0]
            return model.compute_logits(hidden)

        self.slots[:bs].fill_(-1)  # warm-up and capture must not write into live KV blocks
        self.key_len[:bs].fill_(0)
        torch.cuda.synchronize()
        step()  # compiles the Triton kernels and warms the allocator outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        self.pool = graph.pool()
        return graph, logits

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        n = len(scheduled)
        positions = [item.start for item in scheduled]
        bs = self._bucket(self.batch_buckets, n)
        max_keys = self._bucket(self.key_buckets, max(positions) + 1)
        key = (bs, max_keys)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bs, max_keys)
        graph, logits = self.graphs[key]

        # fill the static inputs; rows n..bs-1 see no keys, write nothing, and their logits are dropped
        table = torch.zeros(bs, self.max_blocks, dtype=torch.int32)
        for i, item in enumerate(scheduled):
            table[i, : len(item.seq.block_table)] = torch.as_tensor(item.seq.block_table, dtype=torch.int32)
        pos = torch.zeros(bs, dtype=torch.long)
        pos[:n] = torch.tensor(positions)
        ids = torch.zeros(bs, dtype=torch.long)
        ids[:n] = torch.tensor([item.seq.token_ids[item.start] for item in scheduled])
        slots = torch.full((bs,), -1, dtype=torch.long)
        slots[:n] = table[torch.arange(n), pos[:n] // BLOCK_SIZE].long() * BLOCK_SIZE + pos[:n] % BLOCK_SIZE
        key_len = torch.zeros(bs, dtype=torch.int32)
        key_len[:n] = (pos[:n] + 1).int()
        self.block_table[:bs].copy_(table, non_blocking=True)
        self.positions[:bs].copy_(pos, non_blocking=True)
        self.input_ids[0, :bs].copy_(ids, non_blocking=True)
        self.slots[:bs].copy_(slots, non_blocking=True)
        self.key_len[:bs].copy_(key_len, non_blocking=True)
        graph.replay()
        return logits[:n]
