"""The peers the kernels are measured against: the same work written plainly in PyTorch.

- `plain_indexer_topk`: the lightning indexer as a bf16 einsum + ReLU + weighted head sum, then
  `torch.topk` (what a straightforward implementation of DSA's indexer does, chunk by chunk).
- `plain_sparse_mla`: absorbed sparse MLA as gather + einsum over the 576-wide latent + softmax +
  einsum with the 512-wide values.
- `dense_sdpa`: dense causal attention through `torch.nn.functional.scaled_dot_product_attention`
  on the expanded (naive-form) MLA heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def plain_indexer_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_len: torch.Tensor,
                       k: int) -> torch.Tensor:
    """Top-k key positions of each query row by the indexer score, in plain bf16 PyTorch.

    q: [B, C, HI, DI] bf16 queries (C rows of each of B sequences), w: [B, C, HI] bf16 head
    weights, keys: [B, L, DI] bf16 indexer keys, key_len: [B, C] keys each row sees (causal end).
    Returns [B, C, min(k, L)] int64 positions, -1 where a row sees fewer keys."""
    dots = torch.einsum("bchd,bld->bchl", q, keys).relu_()  # [B, C, HI, L]: the big intermediate
    scores = torch.einsum("bch,bchl->bcl", w, dots)  # [B, C, L]
    pos = torch.arange(keys.shape[1], device=keys.device)
    scores = scores.masked_fill(pos >= key_len[..., None], float("-inf"))
    values, idx = scores.topk(min(k, keys.shape[1]), dim=-1)
    return idx.masked_fill(values == float("-inf"), -1)


def plain_sparse_mla(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, softmax_scale: float,
                     kv_lora_rank: int) -> torch.Tensor:
    """Absorbed sparse MLA in plain PyTorch: gather the selected latent rows, then two einsums.

    q: [T, H, r + dr] bf16, kv: [N, r + dr] bf16 cache rows (a paged bf16 cache viewed flat: row =
    physical slot), slots: [T, K] int slots, -1 = none. Returns [T, H, r] bf16."""
    rows = kv[slots.clamp_min(0).long()]  # [T, K, r + dr]: the gather
    scores = torch.einsum("thd,tkd->thk", q, rows).float() * softmax_scale
    scores = scores.masked_fill(slots[:, None, :] < 0, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.einsum("thk,tkr->thr", probs, rows[..., :kv_lora_rank])


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention. q, k: [B, H, L, qk_head_dim], v: [B, H, L, v_head_dim] (any strides
    with a contiguous last dim). Returns [B, H, L, v_head_dim]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
