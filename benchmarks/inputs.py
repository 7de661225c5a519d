"""Synthetic inputs for the kernel benchmark: paged caches filled with random data, shuffled block
tables, and top-k selections shaped like real ones.

Layouts are those of `megactx.kernels.reference` (blocks of 64 tokens). Random FP8 data is written
as raw e4m3 codes: positive codes 0..126 (127 is NaN), with finite positive fp32 scales, so every
value a kernel decodes is a finite number in [0, 1] (speed does not depend on the values).
"""

from __future__ import annotations

import torch

from megactx.kernels.reference import BLOCK_SIZE, SCALE_GROUP, alloc_index_cache, alloc_kv_cache
from megactx.model.quant import FP8_MAX

_E4M3_NAN = 0x7F  # e4m3fn's only NaN code (with either sign); random codes stay below it
_SCALE = 1.0 / FP8_MAX  # keeps decoded values in [0, 1], like a scale of amax / 448 with amax = 1

# Top-k shape (see `realistic_topk`): a quarter of a row's keys are its most recent tokens (a local
# window), the rest a spread of earlier tokens shared by NEIGHBOURS consecutive query rows.
LOCAL_FRACTION = 4
NEIGHBOURS = 16


def num_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def block_table(num_seqs: int, blocks_per_seq: int, pool_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """[num_seqs, blocks_per_seq] int32 physical blocks, shuffled as an allocator leaves them after
    churn. Distinct when the pool holds every block; otherwise drawn with repetition (sequences
    then share blocks, as with a shared prefix)."""
    need = num_seqs * blocks_per_seq
    if pool_blocks >= need:
        phys = torch.randperm(pool_blocks, generator=gen, device=gen.device)[:need]
    else:
        phys = torch.randint(0, pool_blocks, (need,), generator=gen, device=gen.device)
    return phys.view(num_seqs, blocks_per_seq).int()


def _random_e4m3_(codes: torch.Tensor, gen: torch.Generator) -> None:
    codes.random_(0, _E4M3_NAN, generator=gen)  # in place: no temporary as large as a cache


def random_index_cache(blocks: int, index_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Indexer cache [blocks, 64 · (DI + 4)] uint8 with random keys and finite positive scales."""
    cache = alloc_index_cache(blocks, index_dim, device=gen.device)
    _random_e4m3_(cache[:, : BLOCK_SIZE * index_dim], gen)
    cache[:, BLOCK_SIZE * index_dim :].view(torch.float32).fill_(_SCALE)
    return cache


def random_kv_cache(blocks: int, kv_lora_rank: int, rope_dim: int, fp8: bool, gen: torch.Generator) -> torch.Tensor:
    """MLA cache (bf16 [blocks, 64, r + dr], or the FP8 layout [blocks, 64, r + 4 r/128 + 2 dr] uint8)
    with random rows: normal bf16; or e4m3 latent codes, fp32 scales, normal bf16 rope values."""
    cache = alloc_kv_cache(blocks, kv_lora_rank, rope_dim, fp8, device=gen.device)
    if not fp8:
        return cache.normal_(generator=gen)
    r, scales = kv_lora_rank, 4 * (kv_lora_rank // SCALE_GROUP)
    _random_e4m3_(cache[..., :r], gen)
    cache[..., r : r + scales].view(torch.float32).fill_(_SCALE)
    cache[..., r + scales :].view(torch.bfloat16).normal_(generator=gen)
    return cache


def realistic_topk(positions: torch.Tensor, k: int, share: int, gen: torch.Generator) -> torch.Tensor:
    """Top-k key positions shaped like an indexer's output for causal queries.

    positions: [C] int64 query positions; with share > 1 they must be consecutive (a prefill chunk),
    and each run of `share` rows (aligned to multiples of share) shares its far picks. Returns [C, k]
    int64 logical key positions, -1 = none; a row at position t gets min(t + 1, k) distinct valid
    keys, all <= t:
    - t + 1 <= k: every key 0..t;
    - otherwise its k / 4 most recent tokens (a local window, which neighbouring rows largely share)
      and k - k / 4 far picks, one at random in each of k - k / 4 equal strata of the tokens before
      the window of the group's first row: spread over the whole past, identical for the `share`
      neighbouring rows (neighbouring tokens attend to overlapping sets), different between groups.
    Rows whose group starts too early for that many distinct far picks take their k most recent
    tokens."""
    C = positions.shape[0]
    dev = positions.device
    window = k // LOCAL_FRACTION
    n_far = k - window
    t = positions.long()[:, None]  # [C, 1]
    j = torch.arange(k, device=dev)
    recent = t - j  # [C, k]: t, t - 1, ..., t - k + 1
    rows = torch.arange(C, device=dev)
    first = positions.long()[rows - rows % share]  # [C] position of the group's first row
    far_end = (first - window + 1).clamp_min(0)[:, None]  # far picks come from [0, far_end)
    i = torch.arange(n_far, device=dev)
    lo = i * far_end // n_far  # stratum i = [lo, hi); far_end >= n_far keeps every stratum non-empty
    hi = (i + 1) * far_end // n_far
    u = torch.rand(-(-C // share), n_far, generator=gen, device=dev)[rows // share]  # [C, n_far]
    far = lo + (u * (hi - lo)).long()
    spread = torch.cat([far, recent[:, :window]], dim=1)
    out = torch.where(far_end >= n_far, spread, recent)
    return out.masked_fill(out < 0, -1)
