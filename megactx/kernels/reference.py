"""Pure-PyTorch twins of the Triton kernels, and the paged-cache layouts they share.

Every kernel in this package has its twin here with the same signature; tests compare the two.

Paged caches (one pair of tensors per layer, blocks of BLOCK_SIZE = 64 tokens; a token's slot is
block_id * 64 + offset; slot -1 means "no token"):

- MLA cache, bf16: `kv_cache [num_blocks, 64, r + dr]` bf16 — the normed latent c (r = kv_lora_rank,
  512 for GLM) then the roped shared key k_pe (dr = qk_rope_head_dim, 64): 576 × 2 B a token.
- MLA cache, FP8: `kv_cache [num_blocks, 64, r + 4 r/128 + 2 dr]` uint8 (656 B a token for GLM):
  r e4m3 latent values, then r/128 fp32 scales (one per 128 values, latent ≈ e4m3 · scale), then
  dr bf16 rope values (rope keys are kept exact: they carry position).
- MLA cache, exact: the bf16 layout with fp32 (or any float) elements — for checking a model against
  its reference at full precision.
- Indexer cache (full layers only): `index_cache [num_blocks, 64 * (DI + 4)]` uint8: the block's
  64 keys as DI e4m3 values each, then their 64 fp32 scales (132 B a token for DI = 128; splitting
  values from scales keeps every key row 16-byte aligned). Exact variant: `[num_blocks, 64 * DI]`
  of a float dtype, the keys as they are, no scales (queries then come unquantized too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megactx.model.quant import FP8, quantize_rows

BLOCK_SIZE = 64
SCALE_GROUP = 128  # latent values sharing one fp32 scale in the FP8 MLA cache


# ------------------------------------------------------------------------------ layouts
def mla_fp8_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    if kv_lora_rank % SCALE_GROUP:
        raise ValueError(f"the FP8 MLA cache needs kv_lora_rank divisible by {SCALE_GROUP}, got {kv_lora_rank}")
    return kv_lora_rank + 4 * (kv_lora_rank // SCALE_GROUP) + 2 * rope_dim


def alloc_kv_cache(num_blocks: int, kv_lora_rank: int, rope_dim: int, fp8: bool,
                   device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An MLA cache: the FP8 layout when fp8, else [num_blocks, 64, r + dr] of dtype (bf16, or fp32 exact)."""
    if fp8:
        return torch.zeros(num_blocks, BLOCK_SIZE, mla_fp8_bytes(kv_lora_rank, rope_dim), dtype=torch.uint8,
                           device=device)
    return torch.zeros(num_blocks, BLOCK_SIZE, kv_lora_rank + rope_dim, dtype=dtype, device=device)


def alloc_index_cache(num_blocks: int, index_dim: int, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An indexer cache: uint8 = the FP8 layout (132 B a token for DI = 128), a float dtype = exact keys."""
    if dtype == torch.uint8:
        return torch.zeros(num_blocks, BLOCK_SIZE * (index_dim + 4), dtype=torch.uint8, device=device)
    return torch.zeros(num_blocks, BLOCK_SIZE * index_dim, dtype=dtype, device=device)


# ------------------------------------------------------------------------------ KV write
@dataclass(frozen=True)
class KeyPrep:
    """What turns a layer's projections into the keys its caches store, for `write_kv` to apply on
    the way (the paged layer's: the Triton write does it in its own kernel, where a norm and a rope
    each took one): `norm` (the layer's RMSNorm, or the indexer's LayerNorm) on the latent (MLA) or
    the key (indexer); rope with cos / sin [N, rope_dims] (`Rotary`'s rows, a token each) on the
    rope key (MLA) or the key's first rope_dims dims (indexer), `interleave` as the model's; for an
    FP8 indexer cache, `rotation` [DI, DI] fp32 after the rope (the indexer's Hadamard). Each step
    rounds to the input's dtype, as the separate ops do."""

    norm: nn.Module
    cos: torch.Tensor
    sin: torch.Tensor
    interleave: bool
    rotation: torch.Tensor | None = None


def prepare_keys(c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor | None, mla: KeyPrep | None,
                 index: KeyPrep | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The keys `write_kv` stores, from projections and their KeyPreps (None: stored as given): the
    layer's own ops, one after another."""
    from megactx.model.layers import rope_first  # (megactx.model imports this module)

    if mla is not None:
        c = mla.norm(c)
        k_pe = rope_first(k_pe[None], mla.cos[None], mla.sin[None], mla.interleave)[0]
    if index is not None and index_k is not None:
        index_k = rope_first(index.norm(index_k)[None], index.cos[None], index.sin[None], index.interleave,
                             index.cos.shape[-1])[0]
        if index.rotation is not None:
            index_k = index_k.float() @ index.rotation
    return c, k_pe, index_k


def write_kv(c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
             index_k: torch.Tensor | None = None, index_cache: torch.Tensor | None = None, *,
             mla_prep: KeyPrep | None = None, index_prep: KeyPrep | None = None) -> None:
    """Store new tokens into the paged caches, in place. Slots of -1 are skipped.

    c: [N, r] latent, k_pe: [N, dr] roped key, slots: [N] int; index_k: [N, DI] (full layers
    only, with index_cache). The cache dtype picks the layout: bf16, or uint8 = FP8 (656 B).
    mla_prep / index_prep: c, k_pe / index_k are projections, made into those keys first
    (`prepare_keys`)."""
    c, k_pe, index_k = prepare_keys(c, k_pe, index_k, mla_prep, index_prep)
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
        if index_cache.dtype != torch.uint8:  # exact keys
            index_cache.view(-1, BLOCK_SIZE, DI)[block, offset] = index_k.to(index_cache.dtype)
            return
        values, scales = quantize_rows(index_k)  # one scale per key
        cols = offset[:, None] * DI + torch.arange(DI, device=slots.device)
        index_cache[block[:, None], cols] = values.view(torch.uint8)
        scale_cols = BLOCK_SIZE * DI + offset[:, None] * 4 + torch.arange(4, device=slots.device)
        index_cache[block[:, None], scale_cols] = scales.contiguous().view(torch.uint8).view(-1, 4)


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """slots: [...] int (>= 0) -> [..., r + dr] fp32 latent ‖ rope key, dequantized."""
    s = slots.long()
    # the cache's rows by slot (block * BLOCK_SIZE + offset): index_select on CPU is ~4x faster than
    # advanced indexing by (block, offset)
    rows = kv_cache.reshape(-1, kv_cache.shape[-1]).index_select(0, s.reshape(-1)).view(*s.shape, -1)
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
    """slots: [...] int (>= 0) -> (e4m3 values as fp32 [..., DI], fp32 scales [...]); from an exact
    cache, the keys as fp32 and scales of 1."""
    s = slots.long()
    block, offset = s // BLOCK_SIZE, s % BLOCK_SIZE
    if index_cache.dtype != torch.uint8:
        values = index_cache.view(-1, BLOCK_SIZE, index_dim)[block, offset].float()
        return values, torch.ones(values.shape[:-1], device=values.device)
    cols = offset[..., None] * index_dim + torch.arange(index_dim, device=s.device)
    values = index_cache[block[..., None], cols].view(FP8).float()
    scale_cols = BLOCK_SIZE * index_dim + offset[..., None] * 4 + torch.arange(4, device=s.device)
    scales = index_cache[block[..., None], scale_cols].contiguous().view(torch.float32)[..., 0]
    return values, scales


# ------------------------------------------------------------------------------ sparse MLA
SPARSE_MLA_CHUNK_BYTES = 8 << 20  # on a CPU, the twin's gathered keys a row chunk (fp32): they stay in cache


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int, topk_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form sparse MLA: each query token attends to its own top-k slots only.

    q: [T, H, r + dr] (latent-space query ‖ roped query), kv_cache: paged (bf16 or FP8 layout),
    topk_slots: [T, K] int slots, -1 = none. Keys are the cached rows [r + dr], values their first
    r entries. topk_len: [T] or None, token t reads only its first topk_len[t] slots (the rest count
    as -1). Returns out [T, H, r] in q's dtype and lse [T, H] fp32 (natural log of the softmax
    denominator over scaled scores); a row with no valid slot gives out 0 and lse -inf."""
    valid = topk_slots >= 0  # [T, K]
    if topk_len is not None:
        valid &= torch.arange(topk_slots.shape[1], device=valid.device) < topk_len[:, None]
    # Columns past the last valid slot of every row weigh nothing: a context shorter than the top-k
    # (a short prompt) leaves most of them -1, so they are not read.
    cols = valid.any(0).nonzero()
    used = int(cols.max()) + 1 if cols.numel() else 1
    valid, topk_slots = valid[:, :used], topk_slots[:, :used]
    # on a CPU rows at a time, their gathered keys within SPARSE_MLA_CHUNK_BYTES; on a GPU all at once
    step = max(1, SPARSE_MLA_CHUNK_BYTES // (4 * used * kv_cache.shape[-1])) if q.device.type == "cpu" else q.shape[0]
    outs, lses = [], []
    for i in range(0, max(q.shape[0], 1), step):
        rows = slice(i, i + step)
        kv = read_kv(kv_cache, topk_slots[rows].clamp_min(0), kv_lora_rank)  # [rows, K, r + dr] fp32
        scores = torch.einsum("thd,tkd->thk", q[rows].float(), kv) * softmax_scale
        scores = scores.masked_fill(~valid[rows, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [rows, H]
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("thk,tkr->thr", probs, kv[..., :kv_lora_rank]).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# ------------------------------------------------------------------------------ indexer logits
def indexer_logits(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_idx: torch.Tensor, key_len: torch.Tensor, max_keys: int) -> torch.Tensor:
    """Lightning-indexer logits over the paged indexer cache.

    q: [T, HI, DI] e4m3 queries with an FP8 cache, float queries with an exact one; w: [T, HI] fp32
    head weights with q's per-(token, head) scales (FP8), HI^-1/2 and DI^-1/2 folded in;
    index_cache: paged indexer cache (layout above); block_table:
    [B, max_blocks] int32 physical block of each logical block of sequence b; seq_idx: [T] the
    sequence of each query; key_len: [T] how many keys (logical 0..key_len-1) query t may see
    (causal end; prefill and decode alike). Returns [T, max_keys] fp32:
    Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · k_scale[s] for s < key_len[t], -inf beyond."""
    T, HI, DI = q.shape
    pos = torch.arange(max_keys, device=q.device)
    visible = pos[None] < key_len[:, None]  # [T, L]
    sequences = seq_idx.unique().tolist()
    logits = torch.empty(T, max_keys, dtype=torch.float32, device=q.device) if len(sequences) > 1 else None
    for b in sequences:  # the keys of each sequence once, for all of its query rows
        rows = (seq_idx == b).nonzero().squeeze(1)
        table = block_table[b].long()
        slots = table[(pos // BLOCK_SIZE).clamp_max(table.shape[0] - 1)] * BLOCK_SIZE + pos % BLOCK_SIZE  # [L]
        k, k_scale = read_index_k(index_cache, slots, DI)  # [L, DI], [L]: past a row's range masked below
        qb, wb = q[rows].float(), w[rows].float()
        acc = torch.zeros(len(rows), max_keys, dtype=torch.float32, device=q.device)
        for h in range(HI):  # a head at a time: [rows, L] buffers, never [rows, HI, L]
            acc.addcmul_(wb[:, h, None], (qb[:, h] @ k.T).relu_())
        acc.mul_(k_scale)
        if logits is None:  # one sequence (a prefill chunk): its rows are all the rows
            logits = acc
        else:
            logits[rows] = acc
    return logits.masked_fill_(~visible, float("-inf"))


def indexer_logits_contiguous(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                              seq_idx: torch.Tensor, key_start: torch.Tensor, key_len: torch.Tensor,
                              max_keys: int) -> torch.Tensor:
    """Lightning-indexer logits over keys in one tensor (a packed variable-length batch).

    k: [N, DI] e4m3 keys with k_scale [N] fp32, or float keys with k_scale None; key_start: [B]
    sequence b's keys are rows key_start[b], key_start[b] + 1, ... of k; row t sees rows
    key_start[seq_idx[t]] .. + key_len[t] - 1. Other arguments and the result as in
    `indexer_logits`."""
    pos = torch.arange(max_keys, device=q.device)
    visible = pos[None] < key_len[:, None]  # [T, L]
    rows = (key_start[seq_idx.long()].long()[:, None] + pos).masked_fill(~visible, 0)
    keys = k.float()[rows]  # [T, L, DI]
    scale = torch.ones_like(rows, dtype=torch.float32) if k_scale is None else k_scale.float()[rows]
    dots = torch.einsum("thd,tld->thl", q.float(), keys).relu()  # [T, HI, L]
    logits = torch.einsum("th,thl->tl", w.float(), dots) * scale
    return logits.masked_fill(~visible, float("-inf"))


def index_queries_fp8(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                      rope_dims: int, rotation: torch.Tensor, w_scale_heads: float,
                      w_scale_dim: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 indexer queries of a full layer (twin of megactx.kernels.index_queries): q [T, HI, DI]
    before rope, w [T, HI] fp32 -> (rope, then the rotation in fp32, quantized a head a row: e4m3
    [T, HI, DI]; w · w_scale_heads · w_scale_dim · each head's scale [T, HI] fp32)."""
    from megactx.model.layers import rope_first  # (megactx.model imports this module)

    q8, scale = quantize_rows(rope_first(q[None], cos, sin, interleave, rope_dims)[0].float() @ rotation)
    return q8, w * w_scale_heads * w_scale_dim * scale


def logical_to_slots(block_table: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """positions: [T, K] logical key positions (-1 = none) of sequence seq_idx[t] -> slots [T, K], -1 kept."""
    blocks = block_table[seq_idx.long()].long()  # [T, max_blocks]
    p = positions.long().clamp_min(0)
    slots = blocks.gather(1, p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
    return slots.masked_fill(positions < 0, -1)


def topk_rows(logits: torch.Tensor, k: int, key_len: torch.Tensor | None = None, out: torch.Tensor | None = None,
              *, block_table: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [T, L] fp32 (-inf = not a candidate); key_len: [T] or None, only the first key_len[t]
    entries of row t are candidates -> logical key positions [T, k] int32, -1 where the row has
    fewer than k candidates; ties go to the lowest position. Order within a row is unspecified.
    With block_table and seq_idx: physical slots instead (`logical_to_slots`). out: [T, k] int32
    to write into (returned)."""
    pos = _topk_positions(logits, k, key_len)
    if block_table is not None:
        pos = logical_to_slots(block_table, seq_idx, pos).int()
    if out is None:
        return pos
    return out.copy_(pos)


def _topk_positions(logits: torch.Tensor, k: int, key_len: torch.Tensor | None) -> torch.Tensor:
    if key_len is not None:
        cols = torch.arange(logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(cols >= key_len[:, None], float("-inf"))
    if k == 0:
        return torch.zeros(logits.shape[0], 0, dtype=torch.int32, device=logits.device)
    if k + 1 > logits.shape[-1]:
        logits = torch.nn.functional.pad(logits, (0, k + 1 - logits.shape[-1]), value=float("-inf"))
    # The k + 1 largest, largest first (a row's candidates before its -inf): the set is torch.topk's
    # unless the k-th value has ties left out (the (k + 1)-th equals it), among which torch.topk picks
    # in no set order; there the lowest positions are taken, as the kernel does. Ties at -inf need no
    # rule: those positions become -1.
    vals, pos = logits.topk(k + 1, dim=-1)
    kth = vals[:, k - 1 : k]
    spare = (vals[:, k] == kth.squeeze(1)) & (kth.squeeze(1) > float("-inf"))
    vals, pos = vals[:, :k], pos[:, :k]
    rows = spare.nonzero().squeeze(1)
    if rows.numel():
        pos[rows] = _lowest_ties(logits[rows], k, kth[rows])
    return pos.masked_fill(vals == float("-inf"), -1).int()


def _lowest_ties(logits: torch.Tensor, k: int, kth: torch.Tensor) -> torch.Tensor:
    """[T, k] positions, ascending: every key above kth [T, 1], then the lowest positions equal to it."""
    above = logits > kth
    ties = logits == kth
    need = k - above.sum(-1, keepdim=True)  # [T, 1] of the ties a row takes
    chosen = above | (ties & (ties.cumsum(-1) <= need))
    cols = torch.arange(logits.shape[-1], device=logits.device)
    key = torch.where(chosen, -cols, -logits.shape[-1])  # the chosen rank first, lowest position first
    return key.topk(k, dim=-1).values.neg()


def chunked_topk(logits_fn, topk_fn, q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_idx: torch.Tensor, key_len: torch.Tensor, k: int, chunk_tokens: int,
                 key_len_host: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's top-k as physical slots, chunk_tokens query rows at a time, so the logits
    buffer stays [chunk_tokens, longest key range of the chunk] — the loop shared by the twin and
    the Triton path, which pass their own `logits_fn` (indexer_logits) and `topk_fn` (topk_rows).

    Arguments as in `indexer_logits`; k: keys kept per row; key_len_host: key_len on the CPU (the
    engine has it), else it is read back from the device (one sync). Returns slots [T, k] int32,
    -1 where the row has fewer than k visible keys."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    T = q.shape[0]
    out = torch.full((T, k), -1, dtype=torch.int32, device=q.device)
    if T == 0 or k == 0:
        return out
    host = (key_len if key_len_host is None else key_len_host).cpu()
    for i in range(0, T, chunk_tokens):
        rows = slice(i, i + chunk_tokens)
        max_keys = int(host[rows].max())
        if max_keys <= 0:
            continue  # no row of the chunk sees a key
        logits = logits_fn(q[rows], w[rows], index_cache, block_table, seq_idx[rows], key_len[rows], max_keys)
        kept = min(k, max_keys)  # slots [chunk, kept], -1 = none, written in place
        topk_fn(logits, kept, key_len[rows], out[rows, :kept], block_table=block_table, seq_idx=seq_idx[rows])
    return out


def indexer_topk_chunked(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_idx: torch.Tensor, key_len: torch.Tensor, k: int, chunk_tokens: int,
                         key_len_host: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k keys of each query row as physical slots [T, k] int32 (-1 = none); see `chunked_topk`."""
    return chunked_topk(indexer_logits, _topk_of_masked_rows, q, w, index_cache, block_table, seq_idx, key_len, k,
                        chunk_tokens, key_len_host)


def _topk_of_masked_rows(logits: torch.Tensor, k: int, key_len: torch.Tensor, out: torch.Tensor,
                         **slots) -> torch.Tensor:
    """`topk_rows` of `indexer_logits`' rows, which are -inf past key_len already: no second mask."""
    return topk_rows(logits, k, None, out, **slots)


# The counter-based streams of `megactx.kernels.rng` (its module docstring defines the values).
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
MIX1 = 0xBF58476D1CE4E5B9  # and its finalizer's multipliers
MIX2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int in [0, 2^64)."""
    mask = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * MIX1) & mask
    z = ((z ^ (z >> 27)) * MIX2) & mask
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """The key of seed's stream as a signed 64-bit value (what the kernels take in an int64 tensor)."""
    return _signed(mix64(seed % (1 << 64)))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def check_streams(keys: torch.Tensor, offsets: torch.Tensor, width: int, out: torch.Tensor | None) -> None:
    """The arguments of row_random (kernel and twin alike), or ValueError."""
    if keys.dim() != 1 or keys.shape != offsets.shape or keys.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError(f"keys and offsets must be int64 [S], got {keys.dtype} {tuple(keys.shape)} and "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    if out is not None and (out.shape != (keys.shape[0], width) or out.dtype != torch.float32
                            or not out.is_contiguous() or out.device != keys.device):
        raise ValueError(f"out must be a contiguous fp32 [{keys.shape[0]}, {width}] tensor on {keys.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")


def row_random(keys: torch.Tensor, offsets: torch.Tensor, width: int, exponential: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `megactx.kernels.rng.row_random`: the same bits in int64 torch arithmetic (it wraps)."""
    check_streams(keys, offsets, width, out)
    n = offsets[:, None] + torch.arange(1, width + 1, device=keys.device)  # [S, width]
    z = keys[:, None] + n * _signed(GOLDEN)
    z = (z ^ _srl(z, 30)) * _signed(MIX1)
    z = (z ^ _srl(z, 27)) * _signed(MIX2)
    z = z ^ _srl(z, 31)
    u = (2 * _srl(z, 41) + 1).float() * 2.0**-24
    u = -u.log() if exponential else u
    return u if out is None else out.copy_(u)


# ------------------------------------------------------------------------------ rejection sampling
def leading_accepts(accept: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """accept: [B, K] bool -> [B] int64, how many leading entries of each row are True, counting only
    the first num_drafts[b] of row b (None: all K)."""
    if num_drafts is not None:
        accept = accept & (torch.arange(accept.shape[1], device=accept.device)[None, :] < num_drafts[:, None])
    return accept.cumprod(dim=1).sum(dim=1)  # a cumulative product of bools is int64


def rejection_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                   num_drafts: torch.Tensor | None, uniforms: torch.Tensor, noise: torch.Tensor,
                   pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule's arithmetic (megactx.engine.rejection_sampler explains it),
    given its random draws.

    target_probs [B, K + 1, V] fp32; draft_tokens [B, K] int64; draft_probs [B, K, V] fp32 or None
    (q one-hot at the draft); num_drafts [B] int64 or None (every row verifies K); uniforms [B, K]
    in [0, 1); noise [B, V] Exp(1) draws for the token after the accepted drafts (overwritten).
    Draft j is accepted iff u_j · q_j(d) < p_j(d); the token after the a accepted drafts is the
    exponential race argmax(r / E), a sample of normalize(r), over r = max(p_a - q_a, 0) when draft
    a + 1 was rejected, else r = p_a (all accepted: the bonus token). -> (tokens [B, K + 1] int64: the
    accepted drafts, that token, then `pad`; num_accepted [B] int64)."""
    bsz, num_positions, vocab = target_probs.shape
    width = num_positions - 1
    drafts = draft_tokens.clamp(0, vocab - 1)  # ignored columns may hold padding
    p_draft = target_probs[:, :width].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    # q(d) = 1 for a draft picked deterministically, and u · 1 = u exactly: no product to take
    scaled = uniforms if draft_probs is None else uniforms * draft_probs.gather(2, drafts[..., None]).squeeze(2)
    num_accepted = leading_accepts(scaled < p_draft, num_drafts)  # [B]

    def row_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # x[b, index[b]]: [B, V]
        return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[2])).squeeze(1)

    p_next = row_at(target_probs, num_accepted)  # [B, V]: p at the first position not accepted
    if width > 0:
        col = num_accepted.clamp(max=width - 1)  # rows that accepted everything use p_next as is
        if draft_probs is None:
            # q = one-hot(d): max(p - q, 0) is p with p(d) zeroed, exactly (p - 0 = p, and p(d) <= 1:
            # a normalised p has no entry above its sum)
            residual = p_next.scatter(1, drafts.gather(1, col[:, None]), 0.0)
        else:
            residual = (p_next - row_at(draft_probs, col)).clamp_min(0.0)
        # The race below draws from normalize(residual) without normalising it (argmax(r / E) is that
        # of any positive multiple of r); no mass left means p <= q everywhere, i.e. p == q up to
        # rounding: then a rejection had probability ~0, and p itself is the residual's limit.
        residual = torch.where(residual.amax(dim=1, keepdim=True) > 0, residual, p_next)
        rejected = num_accepted < (width if num_drafts is None else num_drafts)  # [B]
        p_next = torch.where(rejected[:, None], residual, p_next)
    # the race (megactx.engine.sampler.race): E can round to 0, a tiny floor keeps p / E finite
    last = (p_next / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    col = torch.arange(width + 1, device=draft_tokens.device)[None, :]  # [1, K + 1]
    tokens = torch.cat([draft_tokens, last[:, None]], dim=1).scatter_(1, num_accepted[:, None], last[:, None])
    return tokens.masked_fill_(col > num_accepted[:, None], pad), num_accepted


def moe_route(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float, norm_topk_prob: bool,
              n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-5 routing (sigmoid scores, noaux_tc): router logits [N, E] fp32, the
    score-correction bias [E] fp32 -> (weights [N, k] fp32, expert ids [N, k] int64). Experts are
    chosen by score + bias (among the topk_group best groups of n_group, by each group's two best),
    weighted by their score alone, normalised over the k when norm_topk_prob, times scaling. The
    order of a row's k is unspecified. Twin of `megactx.kernels.moe_route.moe_route` (n_group 1)."""
    scores = logits.sigmoid()  # [N, E]
    choice = scores + bias
    if n_group > 1:
        E = choice.shape[-1]
        grouped = choice.view(-1, n_group, E // n_group)  # [N, G, E/G]
        group_worth = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
        keep = torch.zeros_like(group_worth, dtype=torch.bool)
        keep.scatter_(1, group_worth.topk(topk_group, dim=-1, sorted=False).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, E)
    ids = choice.topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def swiglu_weighted(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The every-expert MoE form's activation: h [N, G, 2I] (each expert's gate half, then its up
    half), routing weights w [N, G] fp32 -> w · silu(gate) · up [N, G, I] in h's dtype (silu and the
    product in h's dtype, the weight in fp32, then cast). Twin of `megactx.kernels.swiglu.swiglu_weighted`."""
    I = h.shape[-1] // 2
    return (torch.nn.functional.silu(h[..., :I]) * h[..., I:] * w[..., None]).to(h.dtype)
