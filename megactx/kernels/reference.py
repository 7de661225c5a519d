"""Pure-PyTorch twins of the Triton kernels, and the paged-cache layouts they share.

Every kernel in this package has its twin here with the same signature; tests compare the two.

Paged caches (one pair of tensors per layer, blocks of BLOCK_SIZE = 64 tokens; a token's slot is
block_id * 64 + offset; slot -1 means "no token"):

- MLA cache, bf16: `kv_cache [num_blocks, 64, r + dr]` bf16 — the normed latent c (r = kv_lora_rank,
  512 for GLM) then the roped shared key k_pe (dr = qk_rope_head_dim, 64): 576 × 2 B a token.
- MLA cache, FP8: `kv_cache [num_blocks, 64, r + 4 r/128 + 2 dr]` uint8 (656 B a token for GLM):
  r e4m3 latent values, then r/128 fp32 scales (one per 128 values, latent ≈ e4m3 · scale), then
  dr bf16 rope values (rope keys are kept exact: they carry position).
- Indexer cache (full layers only): `index_cache [num_blocks, 64 * (DI + 4)]` uint8: the block's
  64 keys as DI e4m3 values each, then their 64 fp32 scales (132 B a token for DI = 128; splitting
  values from scales keeps every key row 16-byte aligned).
"""

from __future__ import annotations

import torch

from megactx.model.quant import FP8, quantize_rows

BLOCK_SIZE = 64
SCALE_GROUP = 128  # latent values sharing one fp32 scale in the FP8 MLA cache


# ------------------------------------------------------------------------------ layouts
def mla_fp8_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    if kv_lora_rank % SCALE_GROUP:
        raise ValueError(f"the FP8 MLA cache needs kv_lora_rank divisible by {SCALE_GROUP}, got {kv_lora_rank}")
    return kv_lora_rank + 4 * (kv_lora_rank // SCALE_GROUP) + 2 * rope_dim


def alloc_kv_cache(num_blocks: int, kv_lora_rank: int, rope_dim: int, fp8: bool,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    if fp8:
        return torch.zeros(num_blocks, BLOCK_SIZE, mla_fp8_bytes(kv_lora_rank, rope_dim), dtype=torch.uint8,
                           device=device)
    return torch.zeros(num_blocks, BLOCK_SIZE, kv_lora_rank + rope_dim, dtype=torch.bfloat16, device=device)


def alloc_index_cache(num_blocks: int, index_dim: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.zeros(num_blocks, BLOCK_SIZE * (index_dim + 4), dtype=torch.uint8, device=device)


# ------------------------------------------------------------------------------ KV write
def write_kv(c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
             index_k: torch.Tensor | None = None, index_cache: torch.Tensor | None = None) -> None:
    """Store new tokens into the paged caches, in place. Slots of -1 are skipped.

    c: [N, r] latent, k_pe: [N, dr] roped key, slots: [N] int; index_k: [N, DI] (full layers
    only, with index_cache). The cache dtype picks the layout: bf16, or uint8 = FP8 (656 B)."""
    keep = slots >= 0
    c, k_pe, slots = c[keep], k_pe[keep], slots[keep].long()
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    if kv_cache.dtype == torch.uint8:
        values, scales = quantize_rows(c.unflatten(-1, (-1, SCALE_GROUP)))  # a scale per 128 values
        values = values.flatten(-2)
        row = torch.cat([values.view(torch.uint8), scales.contiguous().view(torch.uint8),
                         k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)
        kv_cache[block, offset] = row
    else:
        kv_cache[block, offset] = torch.cat([c, k_pe], dim=-1).to(kv_cache.dtype)
    if index_k is not None:
        index_k = index_k[keep]
        DI = index_k.shape[-1]
        values, scales = quantize_rows(index_k)  # one scale per key
        cols = offset[:, None] * DI + torch.arange(DI, device=slots.device)
        index_cache[block[:, None], cols] = values.view(torch.uint8)
        scale_cols = BLOCK_SIZE * DI + offset[:, None] * 4 + torch.arange(4, device=slots.device)
        index_cache[block[:, None], scale_cols] = scales.contiguous().view(torch.uint8).view(-1, 4)


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """slots: [...] int (>= 0) -> [..., r + dr] fp32 latent ‖ rope key, dequantized."""
    s = slots.long()
    rows = kv_cache[s // BLOCK_SIZE, s % BLOCK_SIZE]  # [..., row]
    if kv_cache.dtype != torch.uint8:
        return rows.float()
    r = kv_lora_rank
    n_scales = r // SCALE_GROUP
    values = rows[..., :r].contiguous().view(FP8).float()
    scales = rows[..., r : r + 4 * n_scales].contiguous().view(torch.float32)
    rope = rows[..., r + 4 * n_scales :].contiguous().view(torch.bfloat16).float()
    latent = (values.unflatten(-1, (n_scales, SCALE_GROUP)) * scales[..., None]).flatten(-2)
    return torch.cat([latent, rope], dim=-1)


def read_index_k(index_cache: torch.Tensor, slots: torch.Tensor, index_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots: [...] int (>= 0) -> (e4m3 values as fp32 [..., DI], fp32 scales [...])."""
    s = slots.long()
    block, offset = s // BLOCK_SIZE, s % BLOCK_SIZE
    cols = offset[..., None] * index_dim + torch.arange(index_dim, device=s.device)
    values = index_cache[block[..., None], cols].view(FP8).float()
    scale_cols = BLOCK_SIZE * index_dim + offset[..., None] * 4 + torch.arange(4, device=s.device)
    scales = index_cache[block[..., None], scale_cols].contiguous().view(torch.float32)[..., 0]
    return values, scales


# ------------------------------------------------------------------------------ sparse MLA
def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form sparse MLA: each query token attends to its own top-k slots only.

    q: [T, H, r + dr] (latent-space query ‖ roped query), kv_cache: paged (bf16 or FP8 layout),
    topk_slots: [T, K] int slots, -1 = none. Keys are the cached rows [r + dr], values their first
    r entries. Returns out [T, H, r] in q's dtype and lse [T, H] fp32 (natural log of the softmax
    denominator over scaled scores); a row with no valid slot gives out 0 and lse -inf."""
    valid = topk_slots >= 0  # [T, K]
    kv = read_kv(kv_cache, topk_slots.clamp_min(0), kv_lora_rank)  # [T, K, r + dr] fp32
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("thk,tkr->thr", probs, kv[..., :kv_lora_rank])
    return out.to(q.dtype), lse


# ------------------------------------------------------------------------------ indexer logits
def indexer_logits(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_idx: torch.Tensor, key_len: torch.Tensor, max_keys: int) -> torch.Tensor:
    """Lightning-indexer logits over the paged indexer cache, FP8 inputs.

    q: [T, HI, DI] e4m3 queries; w: [T, HI] fp32 head weights with q's per-(token, head) scales,
    HI^-1/2 and DI^-1/2 folded in; index_cache: paged indexer cache (layout above); block_table:
    [B, max_blocks] int32 physical block of each logical block of sequence b; seq_idx: [T] the
    sequence of each query; key_len: [T] how many keys (logical 0..key_len-1) query t may see
    (causal end; prefill and decode alike). Returns [T, max_keys] fp32:
    Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · k_scale[s] for s < key_len[t], -inf beyond."""
    T, HI, DI = q.shape
    pos = torch.arange(max_keys, device=q.device)
    blocks = block_table[seq_idx.long()].long()  # [T, max_blocks]
    slots = blocks.gather(1, (pos // BLOCK_SIZE).clamp_max(blocks.shape[1] - 1)[None].expand(T, -1)) * BLOCK_SIZE
    slots = slots + pos % BLOCK_SIZE  # [T, max_keys]
    visible = pos[None] < key_len[:, None]
    k, k_scale = read_index_k(index_cache, slots.masked_fill(~visible, 0), DI)  # [T, L, DI], [T, L]
    dots = torch.einsum("thd,tld->thl", q.float(), k).relu()  # [T, HI, L]
    logits = torch.einsum("th,thl->tl", w.float(), dots) * k_scale
    return logits.masked_fill(~visible, float("-inf"))


def logical_to_slots(block_table: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """positions: [T, K] logical key positions (-1 = none) of sequence seq_idx[t] -> slots [T, K], -1 kept."""
    blocks = block_table[seq_idx.long()].long()  # [T, max_blocks]
    p = positions.long().clamp_min(0)
    slots = blocks.gather(1, p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
    return slots.masked_fill(positions < 0, -1)


def indexer_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [T, L] fp32 (-inf = not visible) -> logical key positions [T, k] int32, -1 where the
    row has fewer than k visible keys. Order within a row is unspecified."""
    if k > logits.shape[-1]:
        logits = torch.nn.functional.pad(logits, (0, k - logits.shape[-1]), value=float("-inf"))
    values, idx = logits.topk(k, dim=-1)
    return idx.masked_fill(values == float("-inf"), -1).int()
