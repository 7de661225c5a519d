"""`megactx bench kernels`: the Triton kernels at GLM-5.2 geometry, contexts 8K to 1M, against the
machine's ceilings and against the same work done by dense SDPA and by plain PyTorch.

Per context L it times: the paged KV write of an L-token prefill; the lightning indexer's logits
and logits + top-k over a causal prefill of L queries (in query chunks) and over a decode batch at
context L; sparse MLA prefill and decode (bf16 and FP8 caches); their plain-PyTorch peers; dense
SDPA on the expanded heads; and a read of exactly the rows bf16 decode gathers, with no math (the
bytes bound its memory-bound target is judged against). From those it composes one IndexShare layer group (1 indexer + 4
sparse attentions) against every layer running its own indexer and against dense attention, and
checks the issue's targets. The decode figures (indexer and sparse MLA, ours and the plain peer) are
CUDA graph replays, as the engine runs decode: eager launches would add ~10 µs of launch overhead
to kernels of tens of µs. The ceilings (bf16 / FP8 matmul, device copy) are measured in the same
run. Results: benchmarks/results/kernels-<gpu>.json, .md, .png (benchmarks/README.md explains
every figure and the FLOP accounting).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    EXTRAPOLATED,
    MEASURED,
    SAMPLED,
    Clock,
    Measurement,
    Progress,
    extrapolate,
    fmt_context,
    machine_info,
    measure_ceilings,
    rerender_from_json,
    time_row_chunks,
)
from benchmarks.inputs import NEIGHBOURS, block_table, num_blocks, random_index_cache, random_kv_cache, realistic_topk
from benchmarks.peers import dense_sdpa, plain_indexer_topk, plain_sparse_mla
from megactx.config import ModelConfig
from megactx.kernels.reference import BLOCK_SIZE, SCALE_GROUP, alloc_index_cache, alloc_kv_cache, logical_to_slots
from megactx.model.quant import FP8

HELP = "time the Triton kernels at long contexts against the GPU's ceilings and dense / plain-PyTorch peers"
SCHEMA = "megactx-bench-kernels/1"
DEFAULT_CONTEXTS = "8k,32k,128k,512k,1m"
QUICK_CONTEXTS = "8k,32k"
DEFAULT_BUDGET_S = 2.0
QUICK_BUDGET_S = 0.5
RESULTS_DIR = Path(__file__).parent / "results"
# The Triton interpreter runs a kernel program by program in numpy: beyond this the CPU run takes hours.
CPU_MAX_CONTEXT = 4096
_GIB, _MIB = 1 << 30, 1 << 20


# ------------------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geometry:
    """The attention shapes the benchmark needs, read from a ModelConfig."""

    heads: int  # H, MLA query heads
    kv_lora_rank: int  # r, latent width (the values of absorbed MLA)
    rope_dim: int  # dr, shared rope key width
    qk_head_dim: int  # expanded q/k head width (nope + rope), for dense SDPA
    v_head_dim: int  # expanded value head width, for dense SDPA
    index_heads: int  # HI
    index_dim: int  # DI
    topk: int  # K
    group_layers: int  # layers sharing one indexer: 1 full + group_layers - 1 shared
    softmax_scale: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Geometry:
        # A group is a full layer and the shared layers above it; the benchmark takes the longest
        # (GLM-5.2: full layers 0, 1, 2, 6, ..., 74 of 78 -> groups of 4).
        bounds = cfg.full_layers + [cfg.num_hidden_layers]
        group = max(b - a for a, b in zip(bounds, bounds[1:]))
        return cls(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim, cfg.v_head_dim,
                   cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, group, cfg.softmax_scale)

    @property
    def fp8_kv(self) -> bool:
        """Whether the FP8 MLA layout exists for this geometry (scales per 128 latent values)."""
        return self.kv_lora_rank % SCALE_GROUP == 0 and self.rope_dim % 2 == 0

    def kv_row_bytes(self, fp8: bool) -> int:
        if fp8:
            return self.kv_lora_rank + 4 * (self.kv_lora_rank // SCALE_GROUP) + 2 * self.rope_dim
        return 2 * (self.kv_lora_rank + self.rope_dim)

    @property
    def index_row_bytes(self) -> int:
        return self.index_dim + 4  # e4m3 key + fp32 scale

    def indexer_flops(self, pairs: int) -> int:
        """q·k dot products of every head over the visible (query, key) pairs."""
        return 2 * self.index_heads * self.index_dim * pairs

    def sparse_flops(self, keys: int) -> int:
        """Scores over the r + dr latent and P·V over the r values, every head, per selected key."""
        return 2 * self.heads * (2 * self.kv_lora_rank + self.rope_dim) * keys

    def sdpa_flops(self, pairs: int) -> int:
        """Q·Kᵀ and P·V of every expanded head over the causal (query, key) pairs."""
        return 2 * self.heads * (self.qk_head_dim + self.v_head_dim) * pairs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def causal_pairs(start: int, end: int) -> int:
    """Visible (query, key) pairs of causal query rows start..end-1 (row t sees keys 0..t)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def sparse_keys(start: int, end: int, k: int) -> int:
    """Selected keys of causal rows start..end-1 with top-k: row t selects min(t + 1, k)."""
    lo, hi = min(start, k), min(end, k)
    return causal_pairs(lo, hi) + k * max(0, end - max(start, k))


# ------------------------------------------------------------------------------ settings
@dataclass
class Settings:
    """Sizes and time budgets. The defaults are for a GPU of ~140 GB (H200); `small` shrinks them
    for a CPU smoke run of the same code."""

    contexts: list[int]
    device: str = "cuda"
    model: str = "glm-5.2"
    batch: int = 64  # decode rows, one sequence each
    budget_s: float = DEFAULT_BUDGET_S  # seconds of timed runs per figure (plus the warm-up)
    seed: int = 0
    warmup: int = 1  # untimed runs before a figure's timed runs
    min_reps: int = 3  # timed runs a figure at least (median of them)
    matmul_n: int = 8192  # ceilings: n×n×n matmuls
    copy_bytes: int = 2 * _GIB  # ceilings: device copy (>= 1 GiB so caches do not help)
    flush_bytes: int = 256 * _MIB  # zeroed before every timed rep: several times an H200's 50 MB L2
    logits_bytes: int = 2 * _GIB  # indexer logits buffer of one query chunk: sets the chunk
    sparse_rows: int = 8192  # query rows of one sparse MLA prefill call
    plain_bytes: int = 1 * _GIB  # largest intermediate of one plain-PyTorch chunk
    pool_bytes: int = 16 * _GIB  # largest decode cache (per cache); beyond, sequences share blocks
    max_sample_rows: int = 256 * 1024  # query rows whose inputs (top-k) one timed run may hold
    sdpa_max_s: float = 3.0  # longest dense SDPA call measured; longer ones are extrapolated

    @classmethod
    def small(cls, contexts: list[int], **overrides: Any) -> Settings:
        """Tiny sizes for the CPU and the Triton interpreter: seconds, not minutes."""
        base = dict(device="cpu", model="tiny", batch=4, budget_s=0.0, warmup=0, min_reps=1, matmul_n=128,
                    copy_bytes=8 * _MIB,
                    flush_bytes=0, logits_bytes=4096, sparse_rows=16, plain_bytes=64 * 1024,
                    pool_bytes=64 * _MIB, max_sample_rows=256, sdpa_max_s=1.0)
        return cls(contexts, **(base | overrides))


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


# ------------------------------------------------------------------------------ kernels
@dataclass(frozen=True)
class Kernels:
    """The entry points under test (their docstrings give the contracts)."""

    write_kv: Callable[..., None]
    indexer_logits: Callable[..., torch.Tensor]
    indexer_topk_chunked: Callable[..., torch.Tensor]
    sparse_mla: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    read_rows: Callable[..., torch.Tensor]  # a bound, not a kernel under test: `benchmarks.bounds`
    sparse_mla_kernel: Callable[..., str]  # which kernel sparse_mla runs for (q, kv_cache, r): recorded


def load_kernels(device: str) -> Kernels:
    """Import the Triton kernels for `device`. Triton decides between compiling and interpreting
    when a kernel module is imported, from TRITON_INTERPRET: so the modules are imported here, after
    that variable is set for a CPU run, not at the top of this file."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megactx.kernels import common, indexer, kv_write, sparse_mla

    if device == "cpu" and not common.INTERPRET:
        raise RuntimeError("the Triton kernels were imported before TRITON_INTERPRET=1 was set; "
                           "start the CPU run with TRITON_INTERPRET=1 in the environment")
    if device != "cpu" and common.INTERPRET:
        raise RuntimeError("TRITON_INTERPRET=1 is set: unset it to time the compiled kernels on the GPU")
    from benchmarks import bounds

    return Kernels(kv_write.write_kv, indexer.indexer_logits, indexer.indexer_topk_chunked, sparse_mla.sparse_mla,
                   bounds.read_rows, sparse_mla.default_kernel)


# ------------------------------------------------------------------------------ the run
class KernelBench:
    """Runs every figure at every context; `run()` returns the raw results (see `SCHEMA`)."""

    def __init__(self, settings: Settings, kernels: Kernels, progress: Progress | None = None):
        self.s = settings
        self.g = Geometry.from_config(ModelConfig.from_pretrained(settings.model))
        self.k = kernels
        self.dev = torch.device(settings.device)
        self.gen = torch.Generator(device=self.dev).manual_seed(settings.seed)
        self.clock = Clock(self.dev, settings.flush_bytes, settings.warmup)
        self.progress = progress or Progress()
        self.results: list[Measurement] = []
        self.skipped: list[dict[str, Any]] = []
        self._largest: dict[str, Measurement] = {}  # largest run figure of each name: the base of extrapolation
        if not self.g.fp8_kv:
            self.skipped.append({"step": "FP8 MLA cache figures", "context": None,
                                 "reason": f"kv_lora_rank {self.g.kv_lora_rank} is not a multiple of {SCALE_GROUP}, "
                                           "which the FP8 layout needs"})

    # -------------------------------------------------------------------------- driver
    def run(self, after_context: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
        """Every figure at every context. after_context(results so far) runs after each context:
        the command line writes the reports there, so a run stopped by a time limit keeps what it
        measured."""
        p = self.progress
        start = time.perf_counter()
        info = machine_info(self.dev)
        p.log(f"megactx bench kernels on {info['gpu'] or info['device']}; model {self.s.model}; contexts "
              + ", ".join(fmt_context(L) for L in self.s.contexts))
        ceilings = measure_ceilings(self.clock, self.s.matmul_n, self.s.copy_bytes, self.s.budget_s, self.s.min_reps)
        p.log(f"ceilings: bf16 matmul {ceilings.bf16_mm:.1f} TFLOP/s, FP8 matmul "
              f"{'–' if ceilings.fp8_mm is None else f'{ceilings.fp8_mm:.1f}'} TFLOP/s, copy {ceilings.copy:.0f} GB/s")
        steps = (self.write_kv, self.indexer_prefill, self.indexer_decode, self.plain_indexer_decode,
                 self.sparse_prefill, self.sparse_decode, self.sdpa)
        for L in self.s.contexts:
            for step in steps:
                try:
                    step(L)
                except torch.cuda.OutOfMemoryError as e:
                    # one figure that does not fit must not lose the minutes of the others
                    self.skipped.append({"step": step.__name__, "context": L, "reason": str(e).splitlines()[0]})
                    p.log(f"{fmt_context(L):>5}  {step.__name__}: skipped, out of memory")
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()  # the next step's tensors have other sizes: no fragmentation
            results = {"schema": SCHEMA, "machine": info, "settings": dataclasses.asdict(self.s),
                       "geometry": self.g.to_dict(), "ceilings": ceilings.to_dict(),
                       "measurements": [m.to_dict() for m in self.results], "skipped": self.skipped,
                       "wall_s": time.perf_counter() - start}
            if after_context is not None:
                after_context(results)
        return results

    def _add(self, m: Measurement) -> None:
        self.results.append(m)
        self.progress.measurement(m)
        if m.method != EXTRAPOLATED:
            self._largest[m.name] = m

    def _timed(self, name: str, L: int, fn: Callable[[], object], flops: float | None, bytes_: float | None,
               ceiling: str | None, detail: dict[str, Any] | None = None, min_reps: int | None = None,
               graph: bool = False) -> None:
        """graph: time a CUDA graph replay (the decode steps, as the engine runs them)."""
        t = self.clock.time(fn, budget_s=self.s.budget_s, min_reps=self.s.min_reps if min_reps is None else min_reps,
                            graph=graph)
        self._add(Measurement(name, L, t.median_s, flops, bytes_, MEASURED, ceiling,
                              {"reps": len(t.samples_s), "cuda_graph": t.graph} | (detail or {})))

    def _rows(self, name: str, L: int, chunk: int, flops_of: Callable[[int, int], int], bytes_: float | None,
              prepare: Callable[[list[tuple[int, int]]], Callable[[], object]], ceiling: str | None,
              detail: dict[str, Any] | None = None) -> None:
        """A causal prefill of L query rows in chunks of `chunk` rows, whole or sampled."""
        chunks = [(s, min(s + chunk, L)) for s in range(0, L, chunk)]
        timing, sample = time_row_chunks(self.clock, chunks, flops_of, prepare, self.s.budget_s,
                                         self.s.max_sample_rows, self.s.min_reps)
        method = MEASURED if sample.full else SAMPLED
        info = {"chunk_rows": chunk, "reps": len(timing.samples_s)} | sample.to_detail() | (detail or {})
        self._add(Measurement(name, L, timing.median_s * sample.scale, sample.total_flops, bytes_, method, ceiling,
                              info))

    def _fits(self, nbytes: int) -> bool:
        if self.dev.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.dev)
        return nbytes <= 0.9 * free  # room for the allocator's rounding and the kernels' workspaces

    def _randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        # drawn in bf16: an fp32 draw of a GiB-sized bf16 tensor would need twice its memory
        x = torch.randn(*shape, generator=self.gen, device=self.dev, dtype=torch.bfloat16)
        return x if dtype == torch.bfloat16 else x.to(dtype)

    def _rand(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen, device=self.dev).to(dtype)

    def _kv_variants(self) -> list[bool]:
        return [False, True] if self.g.fp8_kv else [False]

    def _prefill_slots(self, bt: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """[end - start, K] int32 physical slots of a realistic causal top-k of rows start..end-1."""
        pos = realistic_topk(torch.arange(start, end, device=self.dev), self.g.topk, NEIGHBOURS, self.gen)
        seq = torch.zeros(end - start, dtype=torch.int32, device=self.dev)
        return logical_to_slots(bt, seq, pos).int()

    # -------------------------------------------------------------------------- KV write
    def write_kv(self, L: int) -> None:
        """Store an L-token prefill into the paged MLA cache (bf16, FP8) and the indexer cache."""
        g, nb = self.g, num_blocks(L)
        bt = block_table(1, nb, nb, self.gen)
        pos = torch.arange(L, device=self.dev)[None]
        slots = logical_to_slots(bt, torch.zeros(1, dtype=torch.int32, device=self.dev), pos).view(-1).int()
        c, k_pe, index_k = self._randn(L, g.kv_lora_rank), self._randn(L, g.rope_dim), self._randn(L, g.index_dim)
        read = sum(t.numel() * t.element_size() for t in (c, k_pe, index_k, slots))
        for fp8 in self._kv_variants():
            kv = alloc_kv_cache(nb, g.kv_lora_rank, g.rope_dim, fp8, self.dev)
            idx = alloc_index_cache(nb, g.index_dim, self.dev)
            written = L * (g.kv_row_bytes(fp8) + g.index_row_bytes)
            self._timed(f"write_kv.{'fp8' if fp8 else 'bf16'}", L,
                        lambda kv=kv, idx=idx: self.k.write_kv(c, k_pe, slots, kv, index_k, idx),
                        None, read + written, None, {"tokens": L})
        # as the engine writes: from the projections, the keys made on the way (the latent's RMSNorm,
        # the ropes, the indexer key's LayerNorm and Hadamard rotation; bf16 KV, FP8 indexer cache)
        mla, index = self._key_preps(L)
        kv = alloc_kv_cache(nb, g.kv_lora_rank, g.rope_dim, False, self.dev)
        idx = alloc_index_cache(nb, g.index_dim, self.dev)
        tables = sum(t.numel() * t.element_size() for t in (mla.cos, mla.sin))
        self._timed("write_kv.bf16.keys", L,
                    lambda: self.k.write_kv(c, k_pe, slots, kv, index_k, idx, mla_prep=mla, index_prep=index),
                    None, read + tables + L * (g.kv_row_bytes(False) + g.index_row_bytes), None, {"tokens": L})

    def _key_preps(self, L: int):
        """The KeyPreps of a layer of this geometry over L tokens (bf16 norms, random angles)."""
        from megactx.kernels.reference import KeyPrep
        from megactx.model.layers import RMSNorm
        from megactx.model.quant import hadamard

        g = self.g
        angles = self._rand(L, g.rope_dim // 2) * 6.3
        cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
        sin = torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()
        rms = RMSNorm(g.kv_lora_rank).to(self.dev, torch.bfloat16)
        ln = torch.nn.LayerNorm(g.index_dim).to(self.dev, torch.bfloat16)
        return (KeyPrep(rms, cos, sin, True),
                KeyPrep(ln, cos, sin, True, hadamard(g.index_dim, device=self.dev)))

    # -------------------------------------------------------------------------- indexer
    def indexer_prefill(self, L: int) -> None:
        """Causal prefill of L queries over L keys: Triton logits, logits + top-k, plain PyTorch."""
        g, nb = self.g, num_blocks(L)
        bt = block_table(1, nb, nb, self.gen)
        cache = random_index_cache(nb, g.index_dim, self.gen)
        chunk = min(L, _pow2_floor(self.s.logits_bytes // (4 * L)))  # fp32 logits [chunk, L]
        q8 = self._randn(chunk, g.index_heads, g.index_dim, dtype=FP8)  # reused by every chunk
        w = self._rand(chunk, g.index_heads)
        seq = torch.zeros(chunk, dtype=torch.int32, device=self.dev)
        key_len = torch.arange(1, L + 1, dtype=torch.int32, device=self.dev)
        key_len_host = key_len.cpu()  # the engine knows its key counts: no read-back a chunk

        def flops_of(start: int, end: int) -> int:
            return g.indexer_flops(causal_pairs(start, end))

        def logits(picked: list[tuple[int, int]]) -> Callable[[], None]:
            def run() -> None:
                for s, e in picked:
                    self.k.indexer_logits(q8[: e - s], w[: e - s], cache, bt, seq[: e - s], key_len[s:e], e)
            return run

        def with_topk(picked: list[tuple[int, int]]) -> Callable[[], None]:
            def run() -> None:
                for s, e in picked:
                    self.k.indexer_topk_chunked(q8[: e - s], w[: e - s], cache, bt, seq[: e - s], key_len[s:e],
                                                g.topk, chunk, key_len_host[s:e])
            return run

        self._rows("indexer.logits", L, chunk, flops_of, None, logits, "fp8_mm")
        self._rows("indexer.logits+topk", L, chunk, flops_of, None, with_topk, "fp8_mm")
        self._plain_indexer_prefill(L, chunk, key_len, flops_of)

    def _plain_indexer_prefill(self, L: int, chunk: int, key_len: torch.Tensor,
                               flops_of: Callable[[int, int], int]) -> None:
        """bf16 keys [L, DI]; the dots [rows, HI, L] bf16 of a chunk bounded by plain_bytes."""
        g = self.g
        keys = self._randn(1, L, g.index_dim)
        rows = max(1, min(chunk, _pow2_floor(self.s.plain_bytes // (2 * g.index_heads * L))))
        qb, wb = self._randn(1, rows, g.index_heads, g.index_dim), self._rand(1, rows, g.index_heads,
                                                                               dtype=torch.bfloat16)
        key_len_b = key_len[None].long()

        def plain(picked: list[tuple[int, int]]) -> Callable[[], None]:
            def run() -> None:
                for s, e in picked:
                    plain_indexer_topk(qb[:, : e - s], wb[:, : e - s], keys[:, :e], key_len_b[:, s:e], g.topk)
            return run

        self._rows("plain.indexer+topk", L, rows, flops_of, None, plain, "bf16_mm")

    def indexer_decode(self, L: int) -> None:
        """One query row for each of `batch` sequences at context L, over a paged cache."""
        g, B, nb = self.g, self.s.batch, num_blocks(L)
        pool = min(B * nb, self.s.pool_bytes // (BLOCK_SIZE * g.index_row_bytes))
        bt = block_table(B, nb, pool, self.gen)
        cache = random_index_cache(pool, g.index_dim, self.gen)
        q8, w = self._randn(B, g.index_heads, g.index_dim, dtype=FP8), self._rand(B, g.index_heads)
        seq = torch.arange(B, dtype=torch.int32, device=self.dev)
        key_len = torch.full((B,), L, dtype=torch.int32, device=self.dev)
        key_len_host = key_len.cpu()  # as the engine passes it: no device read, so the step can be a graph
        flops = g.indexer_flops(B * L)
        moved = B * L * (g.index_row_bytes + 4)  # keys and their scales read, fp32 logits written
        detail = {"batch": B, "pool_blocks": pool, "shared_blocks": pool < B * nb}
        self._timed("indexer.decode.logits", L, lambda: self.k.indexer_logits(q8, w, cache, bt, seq, key_len, L),
                    flops, moved, "fp8_mm", detail, graph=True)
        self._timed("indexer.decode.logits+topk", L,
                    lambda: self.k.indexer_topk_chunked(q8, w, cache, bt, seq, key_len, g.topk, B, key_len_host),
                    flops, moved, "fp8_mm", detail, graph=True)

    def plain_indexer_decode(self, L: int) -> None:
        """The indexer decode in plain PyTorch: bf16 keys [batch, L, DI], extrapolated (linear in L)
        where the keys and scores would not fit."""
        g, B, name = self.g, self.s.batch, "plain.indexer.decode+topk"
        flops = g.indexer_flops(B * L)
        need = B * L * 2 * (g.index_dim + 2 * g.index_heads)  # bf16 keys + dots + scores
        if need > self.s.pool_bytes or not self._fits(need):
            reason = f"needs {need / _GIB:.3g} GiB of keys and scores"
            base = self._largest.get(name)
            if base is not None:
                self._add(extrapolate(base, L, flops, reason=reason))
            else:
                self.skipped.append({"step": name, "context": L, "reason": reason})
            return
        keys = self._randn(B, L, g.index_dim)
        qb, wb = self._randn(B, 1, g.index_heads, g.index_dim), self._rand(B, 1, g.index_heads, dtype=torch.bfloat16)
        kl = torch.full((B, 1), L, device=self.dev)
        self._timed(name, L, lambda: plain_indexer_topk(qb, wb, keys, kl, g.topk), flops, None, "bf16_mm",
                    {"batch": B}, graph=True)

    # -------------------------------------------------------------------------- sparse MLA
    def sparse_prefill(self, L: int) -> None:
        """Sparse MLA over a causal prefill of L queries with a realistic top-k (bf16 and FP8
        caches), and its plain-PyTorch peer on the bf16 cache."""
        bt = block_table(1, num_blocks(L), num_blocks(L), self.gen)
        for fp8 in self._kv_variants():
            self._sparse_prefill_one(L, bt, fp8)

    def _sparse_prefill_flops(self, start: int, end: int) -> int:
        return self.g.sparse_flops(sparse_keys(start, end, self.g.topk))

    def _sparse_prefill_one(self, L: int, bt: torch.Tensor, fp8: bool) -> None:
        g = self.g
        cache = random_kv_cache(bt.shape[1], g.kv_lora_rank, g.rope_dim, fp8, self.gen)
        chunk = min(L, self.s.sparse_rows)
        q = self._randn(chunk, g.heads, g.kv_lora_rank + g.rope_dim)  # reused by every chunk

        def prepare(picked: list[tuple[int, int]]) -> Callable[[], None]:
            slots = [self._prefill_slots(bt, s, e) for s, e in picked]
            # each row's key count, as the model passes it: the kernel skips the tiles past a short row's keys
            key_len = [torch.arange(s + 1, e + 1, dtype=torch.int32, device=self.dev) for s, e in picked]

            def run() -> None:
                for (s, e), sl, n in zip(picked, slots, key_len):
                    self.k.sparse_mla(q[: e - s], cache, sl, g.softmax_scale, g.kv_lora_rank, n)
            return run

        gathered = sparse_keys(0, L, g.topk) * g.kv_row_bytes(fp8)
        self._rows(f"sparse_mla.prefill.{'fp8' if fp8 else 'bf16'}", L, chunk, self._sparse_prefill_flops, gathered,
                   prepare, "bf16_mm", {"topk": "realistic (benchmarks/inputs.py)",
                                        "kernel": self.k.sparse_mla_kernel(q, cache, g.kv_lora_rank)})
        if not fp8:
            self._plain_sparse_prefill(L, cache, bt)

    def _plain_sparse_prefill(self, L: int, cache: torch.Tensor, bt: torch.Tensor) -> None:
        """Gather + einsum over the bf16 cache, in chunks whose intermediates fit plain_bytes."""
        g = self.g
        width = g.kv_lora_rank + g.rope_dim
        per_row = g.topk * width * 2 + g.heads * g.topk * (4 + 4 + 2)  # gathered rows, fp32 scores, softmax, bf16 p
        rows = max(1, min(L, self.s.sparse_rows, _pow2_floor(self.s.plain_bytes // per_row)))
        q = self._randn(rows, g.heads, width)
        flat = cache.view(-1, width)  # a paged bf16 cache is a flat [slots, r + dr] table

        def prepare(picked: list[tuple[int, int]]) -> Callable[[], None]:
            slots = [self._prefill_slots(bt, s, e) for s, e in picked]

            def run() -> None:
                for (s, e), sl in zip(picked, slots):
                    plain_sparse_mla(q[: e - s], flat, sl, g.softmax_scale, g.kv_lora_rank)
            return run

        gathered = sparse_keys(0, L, g.topk) * g.kv_row_bytes(False)
        self._rows("plain.sparse.prefill", L, rows, self._sparse_prefill_flops, gathered, prepare, "bf16_mm")

    def sparse_decode(self, L: int) -> None:
        """Sparse MLA for one query row of each of `batch` sequences at context L (bf16 and FP8
        caches); on the bf16 cache its plain-PyTorch peer and the bytes bound: a read of the same rows
        alone."""
        pos = realistic_topk(torch.full((self.s.batch,), L - 1, device=self.dev), self.g.topk, 1, self.gen)
        for fp8 in self._kv_variants():
            self._sparse_decode_one(L, pos, fp8)

    def _sparse_decode_one(self, L: int, pos: torch.Tensor, fp8: bool) -> None:
        g, B, nb = self.g, self.s.batch, num_blocks(L)
        keys = int((pos >= 0).sum())
        row = g.kv_row_bytes(fp8)
        pool = min(B * nb, self.s.pool_bytes // (BLOCK_SIZE * row))
        bt = block_table(B, nb, pool, self.gen)
        cache = random_kv_cache(pool, g.kv_lora_rank, g.rope_dim, fp8, self.gen)
        slots = logical_to_slots(bt, torch.arange(B, dtype=torch.int32, device=self.dev), pos).int()
        q = self._randn(B, g.heads, g.kv_lora_rank + g.rope_dim)
        key_len = torch.full((B,), L, dtype=torch.int32, device=self.dev)  # as the model passes it
        detail = {"batch": B, "pool_blocks": pool, "shared_blocks": pool < B * nb}
        self._timed(f"sparse_mla.decode.{'fp8' if fp8 else 'bf16'}", L,
                    lambda: self.k.sparse_mla(q, cache, slots, g.softmax_scale, g.kv_lora_rank, key_len),
                    g.sparse_flops(keys), keys * row, "bf16_mm",
                    {**detail, "kernel": self.k.sparse_mla_kernel(q, cache, g.kv_lora_rank)}, graph=True)
        if not fp8:
            flat = cache.view(-1, g.kv_lora_rank + g.rope_dim)
            self._timed("plain.sparse.decode", L,
                        lambda: plain_sparse_mla(q, flat, slots, g.softmax_scale, g.kv_lora_rank),
                        g.sparse_flops(keys), keys * row, "bf16_mm", detail, graph=True)
            self._timed("bound.read.decode", L, lambda: self.k.read_rows(flat, slots), None, keys * row, None,
                        detail, graph=True)

    # -------------------------------------------------------------------------- dense peer
    def sdpa(self, L: int) -> None:
        """Dense causal SDPA on the expanded heads: measured while it fits and is short enough,
        beyond that extrapolated from the largest measured context at the same rate."""
        g, name = self.g, "sdpa.prefill"
        flops = g.sdpa_flops(causal_pairs(0, L))
        need = L * g.heads * (2 * g.qk_head_dim + 2 * g.v_head_dim) * 2  # q, k, v, out in bf16
        base = self._largest.get(name)
        estimate = base.time_s * flops / base.flops if base is not None else 0.0
        reason = ""
        if not self._fits(need):
            reason = f"q, k, v and out need {need / _GIB:.3g} GiB"
        elif estimate > self.s.sdpa_max_s:
            reason = f"one call would take ~{estimate:.3g} s"
        if reason:
            if base is not None:
                self._add(extrapolate(base, L, flops, reason=reason))
            else:
                self.skipped.append({"step": "sdpa", "context": L, "reason": reason})
            return
        # [1, L, H, D] viewed as [1, H, L, D]: the layout a model's projections produce
        q = self._randn(1, L, g.heads, g.qk_head_dim).transpose(1, 2)
        k = self._randn(1, L, g.heads, g.qk_head_dim).transpose(1, 2)
        v = self._randn(1, L, g.heads, g.v_head_dim).transpose(1, 2)
        self._timed(name, L, lambda: dense_sdpa(q, k, v), flops, None, "bf16_mm",
                    {"heads": g.heads, "qk_head_dim": g.qk_head_dim, "v_head_dim": g.v_head_dim}, min_reps=1)


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default=None,
                   help=f"comma-separated context lengths, k = 1024, m = 1024² (default: {DEFAULT_CONTEXTS}; "
                        f"with --quick: {QUICK_CONTEXTS})")
    p.add_argument("--quick", action="store_true",
                   help=f"a fast check: contexts {QUICK_CONTEXTS} and {QUICK_BUDGET_S} s a figure")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for kernels-<device>.json, .md and .png (default: {RESULTS_DIR})")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the benchmark), or cpu: the same code under the Triton interpreter on tiny "
                        f"shapes, contexts up to {CPU_MAX_CONTEXT} (a smoke test, not a measurement)")
    p.add_argument("--model", default=None,
                   help="preset or config.json whose attention geometry to use (default: glm-5.2; tiny on cpu)")
    p.add_argument("--batch", type=int, default=None,
                   help="decode batch: rows, one sequence each (default 64; 4 on cpu)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds of timed runs a figure, after one warm-up (default {DEFAULT_BUDGET_S}; "
                        f"--quick {QUICK_BUDGET_S})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="do not measure: write the .md and .png again from a results JSON")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed arguments; ValueError names the bad argument."""
    from megactx.analysis.flops import parse_context

    contexts = parse_context(args.contexts or (QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS))
    overrides: dict[str, Any] = {"seed": args.seed}
    if args.model is not None:
        overrides["model"] = args.model
    if args.batch is not None:
        if args.batch < 1:
            raise ValueError(f"--batch must be a positive number of rows, got {args.batch}")
        overrides["batch"] = args.batch
    budget = args.budget if args.budget is not None else (QUICK_BUDGET_S if args.quick else None)
    if budget is not None:
        if budget < 0:
            raise ValueError(f"--budget must be >= 0 seconds, got {budget}")
        overrides["budget_s"] = budget
    if args.device == "cpu":
        if max(contexts) > CPU_MAX_CONTEXT:
            raise ValueError(f"--device cpu runs the Triton interpreter: give --contexts of at most "
                             f"{CPU_MAX_CONTEXT} tokens (e.g. --contexts 256), got {max(contexts)}")
        return Settings.small(contexts, **overrides)
    return Settings(contexts, **overrides)


def run(args: argparse.Namespace) -> int:
    """`megactx bench kernels`: 0 on success, 2 on bad arguments or a missing GPU."""
    from benchmarks.kernels_report import write_reports

    prog = "megactx bench kernels"
    if args.from_json is not None:
        return rerender_from_json(prog, args.from_json, args.out, write_reports)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: error: this benchmark times Triton kernels on a CUDA GPU, and torch sees none "
              f"(torch {torch.__version__}). To check the harness on a CPU, run the same code under the "
              f"Triton interpreter on tiny shapes: {prog} --device cpu --contexts 256", file=sys.stderr)
        return 2
    try:
        settings = settings_from_args(args)
        kernels = load_kernels(settings.device)
        bench = KernelBench(settings, kernels)
    except (ValueError, OSError, RuntimeError) as e:  # ConfigError is a ValueError
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = args.out or RESULTS_DIR
    written: list[Path] = []

    def write(results: dict[str, Any]) -> None:
        written[:] = write_reports(results, out)

    bench.run(after_context=write)
    for path in written:
        print(path)
    return 0
