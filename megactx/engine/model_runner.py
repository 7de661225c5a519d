"""Runs the model for one scheduled step over the engine's paged caches.

The runner owns the caches (one MLA cache per layer, an indexer cache per full layer and per MTP
layer, all indexed by the block manager's block ids) and turns a step — a list of
`ScheduledSeq` chunks — into a flattened batch with explicit metadata (`PagedBatch`), runs
`Transformer.hidden_states` over it, and returns the logits of the chunks that sample.

Graphs (`StepGraphs`). On CUDA the steps whose shapes repeat are replayed as CUDA graphs, because
at small batches a step is bound by kernel launches, not by the GPU: plain decode steps (B
sequences x 1 token), and with speculative decoding the verify forward (B x (γ + 1) tokens) and
the MTP draft steps (`spec_graphs.DraftGraphs`). A graph is captured lazily per (kind, batch
bucket, key-count bucket): the smallest batch bucket >= B and the smallest key bucket >= the
longest key range the step reads. It reads its inputs from static buffers (`StaticBatch`) the
runner fills before each replay: sequence b's tokens sit in rows b·q .. b·q + q - 1, and every row
past a sequence's tokens (and every row of the sequences past B) is a padding row: no keys
(key_len 0), no KV write (slot -1), its outputs dropped.

Steps with prefill chunks (a prompt, or new arrivals mixed with decodes: most steps of a server
under load) replay "mixed" graphs, one per (row bucket, key bucket): the step's tokens in ragged
rows (each sequence's consecutive, `StaticBatch.fill_ragged`), padded to the next power-of-two row
count up to the step token budget (at most MAX_ROWS), the logits taken at the rows that sample.
On the H200 an eager decode step of the tiny model took ~13 ms (hundreds of launches), its graphed
one ~1.2 ms; an eager step of 64 new 128-token prompts 17 ms (15 ms of it host time, 3.7 ms of
device time). Steps past the largest row bucket or with a large indexer logits buffer (long
prefills, bound by the device) run eagerly, as does everything on a CPU; there the last layer
computes only the rows that sample (`OutputRows`: every row writes its KV, one row of a long
prompt's chunk, or none, runs its indexer and attention).

Capture and replay go through a `Capture`: `CudaGraphCapture` (torch.cuda.CUDAGraph, one memory
pool for all graphs) on CUDA; `EagerCapture` calls the captured function again at each replay, so
that a CPU runs the graphed code path — buckets, static buffers, padding rows — exactly (tests
install it with `ModelRunner.use_graphs`). Rules every graphed step keeps, because the graphs share
one pool and capture freezes what the host decides: nothing inside syncs with the host; buffers
are made inert (slot -1, key_len 0) before a capture, whose warm-up run and recording would
otherwise write into live KV blocks; state one graph hands to another goes through static buffers
allocated outside the pool, and a graph's own outputs are read before any other graph replays.

Cache sizing: on CUDA, the blocks fill `gpu_memory_utilization` of the device after the weights
and a profiled forward of `max_num_batched_tokens` tokens (activations), counted twice when CUDA
graphs are on: the graphs' memory pool holds a mixed step's activations beside the ones an eager
step allocates. On a CPU the blocks hold `max_num_seqs` sequences of `max_model_len` tokens,
capped by `cpu_cache_bytes`.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from megactx.engine.scheduler import ScheduledSeq
from megactx.kernels.reference import BLOCK_SIZE
from megactx.model.paged import (
    OutputRows,
    PagedBatch,
    PagedLayerCache,
    StagedBuffers,
    alloc_caches,
    cache_bytes_per_token,
    kernel_ops,
    slots_of_positions,
    slots_of_range,
    to_device_packed,
)
from megactx.model.transformer import Transformer


@dataclass
class CacheConfig:
    kv_dtype: torch.dtype  # torch.uint8 = the FP8 layout
    index_dtype: torch.dtype  # torch.uint8 = the FP8 layout
    num_blocks: int


def plan_num_blocks(model: Transformer, kv_dtype: torch.dtype, index_dtype: torch.dtype, *, max_model_len: int,
                    max_num_seqs: int, max_num_batched_tokens: int, gpu_memory_utilization: float = 0.9,
                    cpu_cache_bytes: int = 4 << 30, backend: str = "torch", cuda_graphs: bool = False,
                    shrink_to_fit: bool = False) -> int:
    """How many KV blocks fit (see the module docstring). Raises if not even one sequence of
    max_model_len fits, unless shrink_to_fit (the caller then lowers max_model_len to what fits).
    cuda_graphs: the runner will capture graphs (their pool is counted)."""
    cfg = model.cfg
    per_block = cache_bytes_per_token(cfg, kv_dtype, index_dtype) * BLOCK_SIZE
    device = next(model.parameters()).device
    if device.type == "cuda":
        gc.collect()  # an engine dropped earlier may sit in a reference cycle, its KV cache still allocated
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
        before = torch.cuda.memory_allocated(device)
        held = before - weights  # by this process, besides this model
        _profile_forward(model, max_num_batched_tokens, kv_dtype, index_dtype, backend)
        peak = torch.cuda.max_memory_allocated(device)
        if cuda_graphs and backend == "triton":
            peak += peak - before  # the graph pool's activations, beside an eager step's
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * gpu_memory_utilization) - used_by_others - peak
        num_blocks = budget // per_block
        where = f"{gpu_memory_utilization:.0%} of the GPU's {total / 2**30:.1f} GiB after weights and activations"
        if held > 1 << 30:
            where += f", the {held / 2**30:.1f} GiB this process holds besides the model (another engine alive?)"
        if used_by_others > 1 << 30:
            where += f" and the {used_by_others / 2**30:.1f} GiB that other processes hold"
    else:
        wanted = max_num_seqs * -(-max_model_len // BLOCK_SIZE)
        num_blocks = min(wanted, cpu_cache_bytes // per_block)
        where = f"the CPU cache budget of {cpu_cache_bytes / 2**30:.1f} GiB"
    need = -(-max_model_len // BLOCK_SIZE)
    if num_blocks < need and not (shrink_to_fit and num_blocks > 0):
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
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192, cuda_graphs: bool = True):
        self.model = model
        self.cfg = model.cfg
        self.device = next(model.parameters()).device
        self.cache = cache
        self.ops = kernel_ops(backend)
        self.caches = alloc_caches(self.cfg, cache.num_blocks, cache.kv_dtype, cache.index_dtype, self.device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or self.cfg.max_position_embeddings
        self.max_num_batched_tokens = max_num_batched_tokens
        self.graphs: StepGraphs | None = None
        # the torch twins select with boolean masks (a host sync): only the Triton kernels capture
        if cuda_graphs and self.device.type == "cuda" and backend == "triton":
            self.use_graphs(CudaGraphCapture())

    def use_graphs(self, capture: Capture, min_keys: int | None = None) -> StepGraphs:
        """Run decode steps (and a speculative engine's verify and draft steps) as graphs captured
        through `capture` from now on; what cuda_graphs=True does on CUDA. Tests pass an
        `EagerCapture` (and a small min_keys, the smallest key bucket) to run that path on a CPU."""
        self.graphs = StepGraphs(self, capture, self.max_num_seqs, self.max_model_len,
                                 StepGraphs.MIN_KEYS if min_keys is None else min_keys, self.max_num_batched_tokens)
        return self.graphs

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv, index in self.caches for t in (kv, index) if t is not None)

    def layer_caches(self, batch: PagedBatch) -> list[PagedLayerCache]:
        return [PagedLayerCache(kv, index, batch, self.ops) for kv, index in self.caches[: self.cfg.num_hidden_layers]]

    def prepare(self, scheduled: list[ScheduledSeq], device_tokens: DeviceTokens | None = None
                ) -> tuple[torch.Tensor, PagedBatch, OutputRows]:
        """-> input_ids [1, T], the batch metadata, and the rows of the chunks that sample (each
        chunk's last token), in scheduled order."""
        ids = [t for item in scheduled for t in item.seq.token_ids[item.start : item.end]]
        batch = PagedBatch.build([item.seq.block_table for item in scheduled], [item.start for item in scheduled],
                                 [item.num_tokens for item in scheduled], self.device)
        ends = np.cumsum([item.num_tokens for item in scheduled]) - 1
        rows = ends[[i for i, item in enumerate(scheduled) if item.samples]].astype(np.int64)
        input_ids, rows_d = input_ids_on_device(ids, device_tokens, self.device, rows)
        return input_ids[None], batch, batch.output_rows(rows, rows_d)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], device_tokens: DeviceTokens | None = None) -> torch.Tensor:
        """Compute the step's chunks (writing their KV) -> logits [R, vocab] fp32 of the chunks
        that sample, in scheduled order. device_tokens: the step's tokens that are still on the
        device (sampled by the step before)."""
        if self.graphs is not None and all(item.num_tokens == 1 and item.samples for item in scheduled):
            logits = self.graphs.forward("decode", [item.seq.block_table for item in scheduled],
                                         [item.start for item in scheduled],
                                         [[item.seq.token_ids[item.start]] for item in scheduled],
                                         device_tokens=device_tokens)
            if logits is not None:
                return logits
        elif self.graphs is not None:
            logits = self.graphs.forward_mixed([item.seq.block_table for item in scheduled],
                                               [item.start for item in scheduled],
                                               [item.seq.token_ids[item.start : item.end] for item in scheduled],
                                               [i for i, item in enumerate(scheduled) if item.samples],
                                               device_tokens)
            if logits is not None:
                return logits
        input_ids, batch, rows = self.prepare(scheduled, device_tokens)
        # the last layer computes the sampling rows alone: of a long prompt's chunk, one row or none
        hidden = self.model.hidden_states(input_ids, batch.positions[None], self.layer_caches(batch), rows)  # [1, R, D]
        return self.model.compute_logits(hidden[0])


@dataclass
class DeviceTokens:
    """A step's input tokens that are on the device, not the host: the step's token positions[j]
    (counted in its flattened order, chunk after chunk) is values[j]. The host's copy of the step's
    tokens holds placeholders there. (Tokens the step before sampled, with overlapped steps; the
    draft tokens a speculative verify checks.)"""

    positions: list[int]
    values: torch.Tensor  # [J] int64 on the device; with `rows`, [S] of which token j is values[rows[j]]
    rows: list[int] | None = None  # (host) which of values each position takes: gathered where they are put

    def on_device(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The J tokens in order; rows: `self.rows` on the device, when given."""
        return self.values if rows is None else self.values.index_select(0, rows)



def input_ids_on_device(ids: Sequence[int], device_tokens: DeviceTokens | None, device: torch.device,
                        *more: np.ndarray) -> list[torch.Tensor]:
    """A step's token ids [T] int64 on `device` with the device's tokens put in their places (token
    t in row t), and the host arrays `more`, in one copy -> [input_ids, *more on the device]."""
    at = device_tokens.positions if device_tokens is not None else []
    take = device_tokens.rows if device_tokens is not None and device_tokens.rows is not None else []
    input_ids, rows, take, *rest = to_device_packed([np.array(ids, dtype=np.int64), np.array(at, dtype=np.int64),
                                                     np.array(take, dtype=np.int64), *more], device)
    if device_tokens is not None:
        input_ids.index_copy_(0, rows, device_tokens.on_device(take if device_tokens.rows is not None else None))
    return [input_ids, *rest]


# ---------------------------------------------------------------------------------- graphs
class Graph:
    """A captured step. replay() recomputes `outputs` — what the captured function returned:
    a tensor, a tuple of tensors, or None — in place, from the static buffers the function reads.
    It holds the function, and so every tensor the function reads: a CUDA graph reads them at
    their addresses, and one that only the function's closure held (an index tensor made for the
    graph, say) would be freed after the capture and its memory taken by others."""

    def __init__(self, replay: Callable[[], None], outputs: Any, fn: Callable[[], Any]):
        self.replay = replay
        self.outputs = outputs
        self.fn = fn


class Capture(Protocol):
    def capture(self, fn: Callable[[], Any]) -> Graph:
        """Record fn (no arguments; it reads static buffers) for later replays. Runs it at least
        once, with the buffers as they are: the caller makes them inert first."""
        ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, every graph in one memory pool: graphs never run at once, so each may
    reuse the memory of the others' intermediates."""

    def __init__(self):
        self.pool = None

    def capture(self, fn: Callable[[], Any]) -> Graph:
        torch.cuda.synchronize()
        fn()  # compiles the Triton kernels and warms the allocator outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: a dead cycle collected then (another engine's
        # graphs, say) would destroy its graphs and memory mid-capture, which invalidates this one.
        # (torch.cuda.graph no longer collects before it begins.)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                # a synchronizing call would invalidate the capture and surface later as "operation
                # failed due to a previous error during capture"; in this mode it raises where it is made
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    outputs = fn()
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
        finally:
            if collecting:
                gc.enable()
        self.pool = graph.pool()
        return Graph(graph.replay, outputs, fn)


class EagerCapture:
    """The graphed code path without graphs: replay() calls fn again and copies its results into
    the tensors the capture returned (a graph's outputs are fixed tensors refilled in place)."""

    def __init__(self):
        self.num_replays = 0

    def capture(self, fn: Callable[[], Any]) -> Graph:
        outputs = fn()

        def replay() -> None:
            self.num_replays += 1
            for held, new in zip(_tensors(outputs), _tensors(fn()), strict=True):
                held.copy_(new)

        return Graph(replay, outputs, fn)


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if outputs is None:
        return []
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


def _buckets(largest: int, first: int) -> list[int]:
    """first, 2 first, 4 first, ... up to and including largest."""
    out = [first]
    while out[-1] < largest:
        out.append(min(out[-1] * 2, largest))
    return out


class StaticBatch:
    """Static device buffers of one forward's inputs for up to max_seqs sequences of at most q
    tokens each, flattened: token i of sequence b is row b·q + i. Rows a fill() leaves empty are
    padding rows (key_len 0, slot -1: they see no keys and write nothing).

    A fill runs every step on the host: it builds the rows in Python lists (per sequence, with
    C-speed list extends: a decode step is 64 rows, a prefill chunk one range), writes them with
    numpy into the pinned host twin of the buffers (`StagedBuffers`: every per-row buffer, and the
    `extra` ones a caller asks for, are fields of one block of device memory), and sends it in one
    copy. The block table has a pinned host twin and copies of its own, only of the rows whose
    table changed (a new block once in 64 tokens, a new sequence); with `stable_rows` (the plain
    engine's decode and mixed steps) a sequence keeps its row while it runs, so a request that ends
    moves no other."""

    def __init__(self, max_seqs: int, q: int, max_blocks: int, device: torch.device, rows: int | None = None,
                 extra: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None, stable_rows: bool = False):
        """rows: a ragged batch of that many rows (fill_ragged), where q = 1 and a sequence's tokens
        are consecutive rows, however many; else max_seqs · q rows of q a sequence (fill). extra:
        more static buffers, name -> (shape, dtype), sent with each fill (`buffers`: see fill).
        stable_rows (q = 1): each sequence keeps its block-table row from step to step (its rows'
        `seq_idx` say which), so a step copies only the tables that are new or grew; else sequence
        b of a fill uses row b, and a sequence that ends moves every later one up a row (for a
        server, whose oldest request ends first, most steps would copy the whole table)."""
        assert not stable_rows or q == 1, "stable block-table rows are for one token a sequence (decode, ragged)"
        n = rows or max_seqs * q
        self.q = q
        self.ragged = rows is not None
        self.stable_rows = stable_rows
        self.buffers = StagedBuffers({
            "rows64": ((3, n), torch.long),  # token, position, slot of each row
            "rows32": ((2, n), torch.int32),  # sequence, key count of each row
            "put": ((n,), torch.long),  # rows of the tokens a fill puts in place from the device
            "take": ((n,), torch.long),  # which of DeviceTokens.values each of them is (DeviceTokens.rows)
            "sample_rows": ((max_seqs,), torch.long),  # ragged: rows that sample
            **(extra or {})}, device)
        self._rows64, self._rows32 = self.buffers.device["rows64"], self.buffers.device["rows32"]
        self.input_ids, self.positions, self.slots = self._rows64  # [n] views
        self.seq_idx, self.key_len = self._rows32
        host = self.buffers.host()
        host["rows64"][2] = -1
        if not self.ragged:
            host["rows32"][0] = np.repeat(np.arange(max_seqs, dtype=np.int32), q)
        self.buffers.send()
        self.sample_rows = self.buffers.device["sample_rows"]
        self.block_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self._tables: list[list[int]] = [[] for _ in range(max_seqs)]  # what block_table's rows hold (_tables_in)
        # the block table's host twin (pinned on CUDA), rows copied from it when they change; an
        # event behind the last copy guards its reuse, as StagedBuffers' does
        cuda = torch.device(device).type == "cuda"
        self._table_twin = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, pin_memory=cuda)
        self._table_rows = self._table_twin.numpy()
        self._table_sent = torch.cuda.Event() if cuda else None
        self._row_of: dict[int, int] = {}  # stable_rows: id(a sequence's block table) -> its row
        self._free = list(range(max_seqs - 1, -1, -1))  # stable_rows: rows no sequence holds (pop: the lowest)

    def view(self, bsz: int, max_keys: int, rows: int | None = None) -> PagedBatch:
        """The metadata of the first bsz sequences' rows (ragged: of the first `rows` rows); max_keys
        (the key bucket) bounds every row's key range without a sync, and sizes the indexer's
        logits buffer."""
        rows = rows or bsz * self.q
        table = self.block_table if self.stable_rows else self.block_table[:bsz]
        return PagedBatch(self.positions[:rows], self.slots[:rows], self.seq_idx[:rows], self.key_len[:rows],
                          table, torch.full((rows,), max_keys, dtype=torch.int32))

    def clear(self) -> None:
        """Make every row a padding row (before a capture: its runs must not write live blocks)."""
        self.slots.fill_(-1)
        self.key_len.zero_()
        self.sample_rows.zero_()  # a smaller row bucket's graph must not index past its rows

    def fill(self, bsz: int, tables: Sequence[Sequence[int]], starts: Sequence[int],
             token_ids: Sequence[Sequence[int]], device_tokens: DeviceTokens | None = None) -> list[int]:
        """Sequence b < len(starts) computes positions starts[b] .. starts[b] + len(token_ids[b]) - 1
        (1 to q tokens) over its physical blocks tables[b]; sequences len(starts) .. bsz - 1 (the
        batch bucket) are padding, and so is every row past them. device_tokens: the tokens still on
        the device, put in their rows after the copy. -> the rows of the sequences' tokens, in
        order: row b·q + i holds token i of sequence b.

        The copy sends the whole host twin: a caller that fills `extra` buffers writes them into
        `buffers.host()` before the fill, and reads them on the device after it."""
        q = self.q
        m = bsz * q
        n = len(starts)
        if q == 1:  # a decode step, one token a sequence: each field in one pass
            assert all(len(toks) == 1 for toks in token_ids), "a decode fill computes one position a sequence"
            pad = m - n
            ids = [toks[0] for toks in token_ids] + [0] * pad
            pos = [*starts, *[0] * pad]
            slots = slots_of_positions(tables, starts) + [-1] * pad
            key_len = [p + 1 for p in starts] + [0] * pad
            table_rows = self._tables_in(tables)
            if self.stable_rows:  # else the rows' seq_idx stay 0, 1, ..., set once
                self.buffers.host()["rows32"][0, :m] = table_rows + [0] * pad
            return self._write(m, ids, pos, slots, key_len, device_tokens, list(range(n)))
        ids, pos, slots, key_len = [0] * m, [0] * m, [-1] * m, [0] * m
        rows = []
        for b, (start, toks, blocks) in enumerate(zip(starts, token_ids, tables)):
            k, first = len(toks), b * q
            assert k <= q, f"a sequence computes more than q = {q} positions"
            ids[first : first + k] = toks
            pos[first : first + k] = range(start, start + k)
            pos[first + k : first + q] = [start] * (q - k)  # padding rows sit at their sequence's start
            slots[first : first + k] = slots_of_range(blocks, start, k)
            key_len[first : first + k] = range(start + 1, start + k + 1)
            rows.extend(range(first, first + k))
        self._tables_in(tables)
        return self._write(m, ids, pos, slots, key_len, device_tokens, rows)

    def shift(self, n: int, by: torch.Tensor) -> None:
        """After a fill (q tokens each): move sequence b's rows (b < n) by[b] positions on, on the
        device, for a step filled before the host knew where its sequences stand (an overlapped
        speculative step: each starts after the previous verify's accepted drafts). Their slots
        follow from the block table, which must cover the moved positions. by: [n] int64."""
        q, m = self.q, n * self.q
        steps = by.repeat_interleave(q)  # [m]
        positions = self.positions[:m]
        positions.add_(steps)
        self.key_len[:m].add_(steps.to(torch.int32))
        blocks = self.block_table[:n].gather(1, positions.view(n, q) // BLOCK_SIZE)  # [n, q] int32
        self.slots[:m].copy_(blocks.view(-1) * BLOCK_SIZE + positions % BLOCK_SIZE)

    def _write(self, m: int, ids: list[int], pos: list[int], slots: list[int], key_len: list[int],
               device_tokens: DeviceTokens | None, rows: list[int]) -> list[int]:
        """fill()'s first m rows into the host twin, the rows past them made padding, then sent."""
        host = self.buffers.host()
        rows64, key_lens = host["rows64"], host["rows32"][1]
        rows64[:, :m] = (ids, pos, slots)
        key_lens[:m] = key_len
        rows64[:2, m:], rows64[2, m:], key_lens[m:] = 0, -1, 0  # the rows past the bucket are padding too
        self._send(device_tokens, rows)
        return rows

    def _send(self, device_tokens: DeviceTokens | None, rows: Sequence[int] | None = None) -> None:
        """After a fill wrote the host twin: the twin in one copy, and the device's tokens put in
        their rows (token p of the step in rows[p]; None: in row p)."""
        if device_tokens is not None:
            at = device_tokens.positions if rows is None else [rows[p] for p in device_tokens.positions]
            host = self.buffers.host()
            host["put"][: len(at)] = at
            if device_tokens.rows is not None:
                host["take"][: len(at)] = device_tokens.rows
        self.buffers.send()
        if device_tokens is not None:
            take = self.buffers.device["take"][: len(at)] if device_tokens.rows is not None else None
            self.input_ids.index_copy_(0, self.buffers.device["put"][: len(at)], device_tokens.on_device(take))

    def _tables_in(self, tables: Sequence[Sequence[int]]) -> list[int]:
        """Bring the device block table up to date for a fill of these sequences' tables -> the
        table row of each (the rows' seq_idx). Only rows whose content changed are copied: a new
        block comes once in 64 tokens. Without stable_rows sequence b is row b. With them a sequence
        keeps the row it got at its first fill while it is in every fill (known by its table's
        identity: the list that grows in place); the rows of sequences missing from a fill are
        free again. Rows are compared by content, so a row is right whatever it held before."""
        held = self._tables
        if self.stable_rows:
            row_of = self._row_of
            rows = [row_of.pop(id(t), -1) for t in tables]
            self._free.extend(row_of.values())  # sequences gone since the last fill
            self._row_of = row_of = {}
            for b, t in enumerate(tables):
                if rows[b] < 0:
                    rows[b] = self._free.pop()
                row_of[id(t)] = rows[b]
        else:
            rows = list(range(len(tables)))
        changed = [(r, t) for r, t in zip(rows, tables) if held[r] != t]
        if not changed:
            return rows
        if self._table_sent is not None:
            self._table_sent.synchronize()  # the twin's last copy has run (long since, normally)
        twin = self._table_rows
        for r, t in changed:
            held[r] = list(t)
            twin[r, : len(t)] = t  # columns past a table keep older entries: no row reads past its key_len
        if len(changed) > 4:  # the span of the changed rows in one copy, whole rows: a contiguous
            # source (a strided one would be staged in pageable memory, a copy that stalls the host)
            first, end = min(r for r, _ in changed), max(r for r, _ in changed) + 1
            self.block_table[first:end].copy_(self._table_twin[first:end], non_blocking=True)
        else:  # a row a copy
            for r, t in changed:
                self.block_table[r, : len(t)].copy_(self._table_twin[r, : len(t)], non_blocking=True)
        if self._table_sent is not None:
            self._table_sent.record()
        return rows

    def fill_ragged(self, tables: Sequence[Sequence[int]], starts: Sequence[int], token_ids: Sequence[Sequence[int]],
                    rows: int, samples: Sequence[int], device_tokens: DeviceTokens | None = None) -> None:
        """The ragged form of fill(): sequence b's tokens take the next len(token_ids[b]) rows, the
        rows after the last sequence's are padding; sample_rows[j] is the last row of sequence
        samples[j] (the chunks whose last token samples); rows: the row bucket."""
        table_rows = self._tables_in(tables)
        # the leading one-token sequences (a step's decodes come first), each field in one pass
        d = next((b for b, toks in enumerate(token_ids) if len(toks) != 1), len(token_ids))
        ids = [toks[0] for toks in token_ids[:d]]
        pos = list(starts[:d])
        slots = slots_of_positions(tables, pos)
        seq = table_rows[:d]
        key_len = [p + 1 for p in pos]
        last = list(range(d))  # each sequence's last row
        for start, toks, blocks, b in zip(starts[d:], token_ids[d:], tables[d:], table_rows[d:]):
            n = len(toks)
            ids.extend(toks)
            pos.extend(range(start, start + n))
            slots.extend(slots_of_range(blocks, start, n))
            seq.extend([b] * n)
            key_len.extend(range(start + 1, start + n + 1))
            last.append(len(ids) - 1)
        n = len(ids)
        assert self.ragged and n <= rows <= self.input_ids.shape[0], f"{n} tokens in a batch of {rows} rows"
        host = self.buffers.host()
        rows64, rows32, sample_rows = host["rows64"], host["rows32"], host["sample_rows"]
        rows64[:, :n], rows32[:, :n] = (ids, pos, slots), (seq, key_len)
        rows64[:2, n:], rows64[2, n:], rows32[:, n:] = 0, -1, 0  # padding rows
        sample_rows[: len(samples)] = [last[j] for j in samples]
        sample_rows[len(samples) :] = 0
        self._send(device_tokens)  # ragged rows: token t sits in row t


class StepGraphs:
    """The runner's captured steps, `graphs[(kind, batch bucket, key bucket, ...)]`, and the
    buckets. Kinds: "decode" (the target over 1 token a sequence -> logits), "verify" (the target
    over the γ + 1 verified tokens of each sequence -> final-normed hidden states; SpecDecoder.verify
    then computes the logits it needs), "mixed" (any step of the plain engine as ragged rows ->
    logits of the rows that sample; `forward_mixed`), "mixed-hidden" (the same for the speculative
    engine -> the final-normed hidden states of every row: prefill chunks beside decodes and their
    drafts), "draft" (spec_graphs.DraftGraphs).

    The key bucket bounds the indexer's logits buffer ([rows, keys] fp32): one graph for every
    context up to max_model_len would make a short-context step pay for 1M keys."""

    MIN_KEYS = 4096  # the smallest key-count bucket
    BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    MIN_ROWS, MAX_ROWS = 32, 8192  # the row buckets of "mixed" steps: 32, 64, ... tokens, up to the step budget
    MIXED_LOGITS_BYTES = 256 << 20  # a mixed graph's indexer logits, rows x key bucket fp32, at most

    def __init__(self, runner: ModelRunner, capture: Capture, max_num_seqs: int, max_model_len: int,
                 min_keys: int = MIN_KEYS, max_rows: int = MAX_ROWS):
        self.runner = runner
        self.capture = capture
        self.max_num_seqs = max_num_seqs
        self.batch_buckets = [b for b in self.BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.key_buckets = _buckets(max_model_len, min(min_keys, max_model_len))
        # max_rows: the step token budget, the most rows a step has
        self.row_buckets = _buckets(max(self.MIN_ROWS, min(max_rows, self.MAX_ROWS)), self.MIN_ROWS)
        self.max_blocks = -(-max_model_len // BLOCK_SIZE)
        self.graphs: dict[tuple, Graph] = {}
        self._batches: dict[str, StaticBatch] = {}
        self._outputs: dict[str, torch.Tensor] = {}

    def bucket(self, bsz: int, max_keys: int) -> tuple[int, int] | None:
        """(batch bucket, key bucket) of a step of bsz sequences reading at most max_keys keys,
        None if the step exceeds the largest buckets."""
        bs = next((b for b in self.batch_buckets if b >= bsz), None)
        keys = next((k for k in self.key_buckets if k >= max_keys), None)
        return None if bs is None or keys is None else (bs, keys)

    def static_batch(self, name: str, q: int, rows: int | None = None,
                     extra: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                     stable_rows: bool = False) -> StaticBatch:
        """The static inputs named `name` (one set per use, allocated at first use; rows: ragged;
        extra, stable_rows: see StaticBatch)."""
        if name not in self._batches:
            self._batches[name] = StaticBatch(self.max_num_seqs, q, self.max_blocks, self.runner.device, rows, extra,
                                              stable_rows)
        return self._batches[name]

    def output(self, name: str, rows: int, width: int, dtype: torch.dtype = torch.float32,
               capacity: int | None = None) -> torch.Tensor:
        """The first `rows` (<= capacity, default max_num_seqs) rows of the static [capacity, width]
        buffer `name` that graphs write an output into, shared by all of them: outputs returned from a
        capture would each stay allocated in the pool (a [batch, V] fp32 of logits per graph)."""
        if name not in self._outputs:
            self._outputs[name] = torch.zeros(capacity or self.max_num_seqs, width, dtype=dtype,
                                              device=self.runner.device)
        return self._outputs[name][:rows]

    def hidden_rows(self, q: int) -> torch.Tensor:
        """The static buffer [max_num_seqs · q, D] that the "verify" graphs of q rows a sequence write
        their hidden states into (spec_graphs.DraftGraphs reads them there)."""
        cfg = self.runner.cfg
        return self.output(f"hidden-{q}", self.max_num_seqs, q * cfg.hidden_size, self.runner.model.dtype).view(
            -1, cfg.hidden_size)

    def captured(self, key: tuple, build: Callable[[], Callable[[], Any]], clear: Callable[[], None]) -> Graph:
        """The graph of `key`, captured now from build()'s function if it is new; clear() makes
        its static inputs inert first. Fill the inputs after this call, then replay."""
        graph = self.graphs.get(key)
        if graph is None:
            clear()
            graph = self.graphs[key] = self.capture.capture(build())
        return graph

    @torch.inference_mode()
    def forward(self, kind: str, tables: Sequence[Sequence[int]], starts: Sequence[int],
                token_ids: Sequence[Sequence[int]], q: int = 1, device_tokens: DeviceTokens | None = None,
                shift: tuple[torch.Tensor, int] | None = None) -> torch.Tensor | None:
        """The target over B sequences, sequence b computing tokens token_ids[b] (1 to q of them)
        at positions starts[b] .. over its blocks tables[b], from the graph of `kind` ("decode":
        q = 1 and logits out; "verify": final-normed hidden states out) -> logits [T, V] fp32 or
        hidden [T, D] of the T = Σ len(token_ids[b]) tokens in order: what the eager forward of
        the same flattened batch returns, up to summation order; None when no bucket fits (run
        eagerly). For q > 1 the hidden states of the graph's rows instead, [bs·q, D] for the batch
        bucket bs: token i of sequence b at row b·q + i (StaticBatch.fill), padding rows after each
        sequence's tokens. Outputs are views of a static buffer: read them before the next replay.
        shift: (by [B] int64 on the device, its most): each sequence starts by[b] positions later
        than starts[b] says (q tokens each; StaticBatch.shift)."""
        most = 0 if shift is None else shift[1]
        buckets = self.bucket(len(tables), max(s + len(ids) for s, ids in zip(starts, token_ids)) + most)
        if buckets is None:
            return None
        bs, max_keys = buckets
        batch = self.static_batch(kind, q, stable_rows=kind == "decode")
        graph = self.captured((kind, bs, max_keys), lambda: self._target(batch, bs, max_keys, kind == "decode"),
                              batch.clear)
        batch.fill(bs, tables, starts, token_ids, device_tokens)
        if shift is not None:
            batch.shift(len(tables), shift[0])
        graph.replay()
        return graph.outputs[: len(tables)] if q == 1 else graph.outputs

    @torch.inference_mode()
    def forward_mixed(self, tables: Sequence[Sequence[int]], starts: Sequence[int],
                      token_ids: Sequence[Sequence[int]], samples: Sequence[int],
                      device_tokens: DeviceTokens | None = None, hidden: bool = False) -> torch.Tensor | None:
        """Any step (prefill chunks, decodes, both) as a ragged batch: sequence b computes tokens
        token_ids[b] at positions starts[b] .. over its blocks tables[b] -> logits [S, V] fp32 of
        the last token of sequences samples[0 .. S-1] (a view of a static buffer, as forward's);
        None when the step is past the largest row bucket or its indexer logits would exceed
        MIXED_LOGITS_BYTES (a long prefill: bound by the device, not by launches; run eagerly).
        One graph per (row bucket, key bucket), whatever the number of sequences. hidden: instead
        the final-normed hidden states [T, D] of all T tokens, in order (token t in row t; kind
        "mixed-hidden"; samples unused; `mixed_input_ids` then holds the step's tokens)."""
        n = sum(len(ids) for ids in token_ids)
        rows = next((r for r in self.row_buckets if r >= n), None)
        keys = next((k for k in self.key_buckets if k >= max(s + len(ids) for s, ids in zip(starts, token_ids))), None)
        if rows is None or keys is None or len(tables) > self.max_num_seqs or rows * keys * 4 > self.MIXED_LOGITS_BYTES:
            return None
        batch = self._mixed_batch()
        kind = "mixed-hidden" if hidden else "mixed"
        graph = self.captured((kind, rows, keys), lambda: self._mixed(batch, rows, keys, hidden), batch.clear)
        batch.fill_ragged(tables, starts, token_ids, rows, samples, device_tokens)
        graph.replay()
        return graph.outputs[:n] if hidden else graph.outputs[: len(samples)]

    def mixed_input_ids(self, n: int) -> torch.Tensor:
        """The last mixed step's first n input tokens [n] int64 (device tokens in place)."""
        return self._mixed_batch().input_ids[:n]

    def _mixed_batch(self) -> StaticBatch:
        """The mixed steps' static inputs: ragged rows up to the largest row bucket."""
        return self.static_batch("mixed", 1, self.row_buckets[-1], stable_rows=True)

    def _mixed(self, batch: StaticBatch, rows: int, max_keys: int, hidden: bool) -> Callable[[], torch.Tensor]:
        model, cfg = self.runner.model, self.runner.cfg
        paged = batch.view(self.max_num_seqs, max_keys, rows)
        layers = self.runner.layer_caches(paged)
        if hidden:  # every row's, in a buffer of the largest row bucket
            out = self.output("hidden-ragged", rows, cfg.hidden_size, model.dtype, capacity=self.row_buckets[-1])
        else:
            out = self.output("logits", self.max_num_seqs, cfg.vocab_size)

        def step() -> torch.Tensor:
            states = model.hidden_states(batch.input_ids[None, :rows], paged.positions[None], layers)[0]  # [rows, D]
            return out.copy_(states if hidden else model.compute_logits(states.index_select(0, batch.sample_rows)))

        return step

    def _target(self, batch: StaticBatch, bs: int, max_keys: int, logits: bool) -> Callable[[], torch.Tensor]:
        model = self.runner.model
        paged = batch.view(bs, max_keys)
        layers = self.runner.layer_caches(paged)
        rows = bs * batch.q
        out = self.output("logits", bs, self.runner.cfg.vocab_size) if logits else self.hidden_rows(batch.q)[:rows]

        def step() -> torch.Tensor:
            hidden = model.hidden_states(batch.input_ids[None, :rows], paged.positions[None], layers)[0]  # [rows, D]
            return out.copy_(model.compute_logits(hidden) if logits else hidden)

        return step
