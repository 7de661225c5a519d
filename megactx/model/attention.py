"""MLA attention with the DSA lightning indexer and IndexShare, in plain PyTorch.

This is the reference every fast path is checked against. Shapes: B batch, S query tokens,
T key tokens (cached + new), H attention heads, r = kv_lora_rank, dn / dr / dv = qk_nope /
qk_rope / v head dims, HI / DI = indexer heads / dim, K = index_topk.

- `Indexer` scores keys: score[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · DI^-1/2, with
  w = weights_proj(x) · HI^-1/2. A "full" layer owns one; a "shared" layer reuses the top-k of
  the nearest full layer below it (passed in as `topk`) and owns no indexer weights.
- `MLA` attends only to the selected keys. Two equivalent forms: naive (expand the latent to
  per-head keys/values with kv_b_proj) and absorbed (fold kv_b_proj into the query and the output:
  MQA over the 576-wide latent + rope key, which is what the sparse kernels compute).
- `LayerCache` is the reference KV cache: contiguous per-layer tensors that only grow. The MTP
  drafter uses it to share step 1's KV with later steps (KVShare).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megactx.config import ModelConfig
from megactx.kernels import reference as ref  # attributes read at call time (see model/paged.py)
from megactx.model.layers import RMSNorm, apply_norm, fuse_linears, linear_fp32, linear_into, rope_first
from megactx.model.paged import OutputRows, PagedLayerCache
from megactx.model.quant import hadamard, quantize_rows


@dataclass
class LayerCache:
    """Reference cache of one layer. c: [B, T, r], k_pe: [B, T, dr], index_k: [B, T, DI] or None.

    Key positions are 0..T-1 in order (the reference never evicts)."""

    c: torch.Tensor | None = None
    k_pe: torch.Tensor | None = None
    index_k: torch.Tensor | None = None

    @staticmethod
    def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        return new if old is None else torch.cat([old, new], dim=1)

    def append_kv(self, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.c, self.k_pe = self._cat(self.c, c), self._cat(self.k_pe, k_pe)
        return self.c, self.k_pe

    def append_index_k(self, k: torch.Tensor) -> torch.Tensor:
        self.index_k = self._cat(self.index_k, k)
        return self.index_k

    @property
    def length(self) -> int:
        return 0 if self.c is None else self.c.shape[1]


def causal_mask(q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """q_pos: [B or 1, S] absolute positions -> [B or 1, S, T] bool, True where key s <= query t."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    return k_pos[None, None, :] <= q_pos[..., None]


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [B, S, T] fp32, -inf where not allowed -> indices [B, S, min(k, T)] int64, -1 = none.

    A row with fewer than k allowed keys keeps all of them and pads with -1. Ties go to the lowest
    position (a stable sort), as in the Triton top-k: a key set that does not depend on the row's
    length, so chunked prefill selects what the full forward selects."""
    k = min(k, scores.shape[-1])
    values, idx = scores.sort(dim=-1, descending=True, stable=True)
    values, idx = values[..., :k], idx[..., :k]
    return idx.masked_fill(values == float("-inf"), -1)


def topk_mask(topk: torch.Tensor, num_keys: int) -> torch.Tensor:
    """topk: [B, S, K] key indices (-1 = none) -> [B, S, T] bool, True at the selected keys."""
    B, S, _ = topk.shape
    mask = torch.zeros(B, S, num_keys + 1, dtype=torch.bool, device=topk.device)
    mask.scatter_(-1, topk.masked_fill(topk < 0, num_keys), True)  # -1 lands in a spare column
    return mask[..., :num_keys]


class Indexer(nn.Module):
    """The DSA lightning indexer of one full layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        self.rope_interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # kept in fp32

    def rotation(self, device: torch.device) -> torch.Tensor:
        """[DI, DI] fp32 Hadamard rotation applied to q and k before FP8 quantization."""
        return hadamard(self.head_dim, device=device)

    # The first rope_dim dims are rotated (the MLA query puts rope last; the indexer first). The
    # queries' `rope`: layers.rope_first or its fused kernel (the paged path passes its backend's).
    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D] -> k: [B, S, DI], what the indexer cache stores (the paged path: `key_prep`)."""
        return rope_first(self.k_norm(self.wk(x)), cos, sin, self.rope_interleave, self.rope_dim)

    def key_prep(self, cos: torch.Tensor, sin: torch.Tensor, fp8: bool) -> ref.KeyPrep:
        """`keys` past wk, for the paged KV write to apply (cos / sin [1, T, rope_dim]); fp8: the cache's
        rotation too."""
        return ref.KeyPrep(self.k_norm, cos[0], sin[0], self.rope_interleave,
                           self.rotation(cos.device) if fp8 else None)

    def projections(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q: [B, S, HI, DI] before rope, w: [B, S, HI] fp32 head weights before their scaling."""
        B, S, _ = x.shape
        q = self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim)
        w = self.weights_proj.weight
        return q, linear_fp32(x, w).float()

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rope=rope_first) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q: [B, S, HI, DI], w: [B, S, HI] fp32 (head weights with HI^-1/2 folded in)."""
        q, w = self.projections(x, q_resid)
        return rope(q, cos, sin, self.rope_interleave, self.rope_dim), w * self.n_heads**-0.5

    def scores(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, fp8: bool = False) -> torch.Tensor:
        """q: [B, S, HI, DI], w: [B, S, HI], k: [B, T, DI] -> [B, S, T] fp32, no mask applied.

        fp8=True simulates the production path: q and k Hadamard-rotated, quantized to e4m3 with
        one fp32 scale per (token, head) / per key, the scales folded into w and out of the ReLU
        (valid since scales are positive)."""
        if fp8:
            rot = self.rotation(q.device)
            q8, q_scale = quantize_rows(q.float() @ rot)  # [B, S, HI, DI], [B, S, HI]
            k8, k_scale = quantize_rows(k.float() @ rot)  # [B, T, DI], [B, T]
            logits = F.relu(_head_dots(q8.float(), k8.float()))
            logits = logits * k_scale[:, None, None, :] * self.head_dim**-0.5  # [B, S, HI, T]
            w = w * q_scale
        else:
            logits = F.relu(_head_dots(q.float(), k.float()) * self.head_dim**-0.5)  # [B, S, HI, T]
        return torch.matmul(w.unsqueeze(-2), logits).squeeze(-2)  # [B, S, T]


def per_head_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t, h] = a[t, h] @ w[h]: a [T, H, k], w [H, k, n], out [T, H, n] any view whose last dim is
    contiguous (a slice of a wider buffer too). One batched GEMM over the heads writes the result
    token-major in place (cuBLAS takes a strided result), where an einsum returns it head-major and
    a token-major reader then copies it for T > 1. Outside autograd only (out= has no backward)."""
    torch.bmm(a.transpose(0, 1), w, out=out.transpose(0, 1))
    return out


def heads_out(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Absorbed MLA's value projection: o_lat [T, H, r], w_uv [H, dv, r] -> [T, H·dv] token-major,
    out[t, h·dv + v] = Σ_r o_lat[t, h, r] w_uv[h, v, r] (`per_head_matmul` outside autograd, an
    einsum under it)."""
    T, H, _ = o_lat.shape
    if torch.is_grad_enabled():
        return torch.einsum("shr,hvr->shv", o_lat, w_uv).reshape(T, -1)
    return per_head_matmul(o_lat, w_uv.transpose(1, 2), o_lat.new_empty(T, H, w_uv.shape[1])).view(T, -1)


def _head_dots(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q: [B, S, HI, DI], k: [B, T, DI] -> [B, S, HI, T]: one [S·HI, DI] × [DI, T] product a row.
    (torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) computes the same but first copies k once
    per query: DI/HI times the logits' own memory.)"""
    B, S, HI, DI = q.shape
    return torch.bmm(q.reshape(B, S * HI, DI), k.transpose(-1, -2)).view(B, S, HI, -1)


class MLA(nn.Module):
    """Multi-head latent attention with DSA top-k selection."""

    def __init__(self, cfg: ModelConfig, has_indexer: bool):
        super().__init__()
        self.cfg = cfg
        H = self.n_heads = cfg.num_attention_heads
        self.dn, self.dr, self.dv, self.r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.r + self.dr, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.r)
        self.kv_b_proj = nn.Linear(self.r, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, cfg.hidden_size, bias=cfg.attention_bias)
        self.indexer = Indexer(cfg) if has_indexer else None
        self.x_proj: torch.Tensor | None = None  # fused weights of the projections of x (fuse())
        self.x_proj_sizes: list[int] = []
        self.absorbed = False  # which of the two equal forms forward() computes
        self.indexer_fp8 = False  # simulate the FP8 indexer instead of the exact one
        # Opt-in training path: a callable (module, *forward's arguments) -> forward's result that
        # replaces the computation below (megactx.train.losses.TrainingAttention installs one for the
        # duration of a training forward: chunked, recomputed, capturing attention for the indexer
        # losses). None: the reference.
        self.training_attention = None

    # -- projections ------------------------------------------------------------------
    def fuse(self) -> int:
        """Compute the projections that read x (q_a_proj, kv_a_proj_with_mqa and the indexer's wk)
        as one GEMM in the paged forward from now on (the engine's inference; their weights become
        views of one tensor). Returns the GEMMs a paged forward that writes KV saves."""
        if self.x_proj is None:
            linears = [self.q_a_proj, self.kv_a_proj_with_mqa] + ([self.indexer.wk] if self.indexer else [])
            self.x_proj = fuse_linears(*linears)
            self.x_proj_sizes = [m.weight.shape[0] for m in linears] if self.x_proj is not None else []
        return max(len(self.x_proj_sizes) - 1, 0)

    def project_q(self, x, cos, sin, rope=rope_first, q_a_x=None, norm=apply_norm, pe_out=None):
        """x: [B, S, D] -> q_resid [B, S, q_lora], q_nope [B, S, H, dn], q_pe [B, S, H, dr] (roped by
        `rope`: layers.rope_first or its fused kernel; into pe_out when given). q_a_x: q_a_proj(x) when
        computed already (a strided slice of the fused projection's output, which `norm` reads in
        place on the paged path)."""
        B, S, _ = x.shape
        q_resid = norm(self.q_a_proj(x) if q_a_x is None else q_a_x, self.q_a_layernorm)
        q = self.q_b_proj(q_resid).view(B, S, self.n_heads, self.dn + self.dr)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        return q_resid, q_nope, rope(q_pe, cos, sin, self.cfg.rope_interleave, out=pe_out)

    def project_kv(self, x, cos, sin):
        """x: [B, S, D] -> c [B, S, r] (normed latent), k_pe [B, S, dr] (roped): the MLA cache entry
        (the paged path: kv_a_proj_with_mqa, then the KV write applies `key_prep`)."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)
        return self.kv_a_layernorm(c), rope_first(k_pe, cos, sin, self.cfg.rope_interleave)

    def key_prep(self, cos: torch.Tensor, sin: torch.Tensor) -> ref.KeyPrep:
        """`project_kv` past the projection, for the paged KV write to apply (cos / sin [1, T, dr])."""
        return ref.KeyPrep(self.kv_a_layernorm, cos[0], sin[0], self.cfg.rope_interleave)

    def wkv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, dn, r], W_UV [H, dv, r]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, self.r)
        return w[:, : self.dn], w[:, self.dn :]

    # -- attention core -----------------------------------------------------------------
    def attend(self, q_nope, q_pe, c, k_pe, allowed: torch.Tensor) -> torch.Tensor:
        """q_nope [B, S, H, dn], q_pe [B, S, H, dr], c [B, T, r], k_pe [B, T, dr],
        allowed [B, S, T] bool -> [B, S, H * dv]. A row with no allowed key outputs zeros."""
        dtype = q_nope.dtype
        if self.absorbed:
            w_uk, w_uv = self.wkv_b()
            q_lat = torch.einsum("bshd,hdr->bshr", q_nope, w_uk)  # [B, S, H, r]
            scores = (torch.einsum("bshr,btr->bhst", q_lat, c)
                      + torch.einsum("bshd,btd->bhst", q_pe, k_pe))
        else:
            B, T, _ = c.shape
            kv = self.kv_b_proj(c).view(B, T, self.n_heads, self.dn + self.dv)
            k_nope, v = kv.split([self.dn, self.dv], dim=-1)
            q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, S, dn + dr]
            k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.n_heads, -1)], dim=-1).transpose(1, 2)
            scores = q @ k.transpose(-1, -2)  # [B, H, S, T]
        scores = (scores * self.softmax_scale).masked_fill(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(dtype)
        if self.absorbed:
            o_lat = torch.einsum("bhst,btr->bshr", probs, c)  # [B, S, H, r]
            out = torch.einsum("bshr,hvr->bshv", o_lat, w_uv)
        else:
            out = (probs @ v.transpose(1, 2)).transpose(1, 2)  # [B, S, H, dv]
        return out.reshape(*out.shape[:2], -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                topk: torch.Tensor | None = None, cache: LayerCache | None = None,
                write_kv: bool = True, rows: OutputRows | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, S, D]; cos/sin: [B or 1, S, dr] (Rotary); positions: [B or 1, S] absolute.

        topk: [B, S, K] key indices from this layer's full layer (required on shared layers;
        on full layers, given -> reused instead of running the indexer). cache: keys before x
        (positions 0..T0-1); x's own keys are appended when write_kv, else x only reads the cache
        (KVShare draft steps). Returns (out [B, S, D], topk [B, S, K'] used).

        With a `PagedLayerCache` the same layer runs over paged caches instead (see `forward_paged`,
        which alone takes `rows` and `residual`).
        """
        if (rows is not None or residual is not None) and not isinstance(cache, PagedLayerCache):
            raise ValueError("rows (outputs of some rows only) and residual need a paged cache")
        if self.training_attention is not None:
            out, topk = self.training_attention(self, x, cos, sin, positions, topk, cache, write_kv)
            return (out if residual is None else residual.add_(out)), topk
        if isinstance(cache, PagedLayerCache):
            return self.forward_paged(x, cos, sin, topk, cache, write_kv, rows, residual)
        q_resid, q_nope, q_pe = self.project_q(x, cos, sin)
        if cache is None or write_kv:
            c, k_pe = self.project_kv(x, cos, sin)
            if cache is not None:
                c, k_pe = cache.append_kv(c, k_pe)
        else:
            c, k_pe = cache.c, cache.k_pe
        num_keys = c.shape[1]
        allowed = causal_mask(positions, num_keys)  # [B or 1, S, T]

        if topk is None:
            if self.indexer is None:
                raise ValueError("a shared-indexer layer needs the top-k of its full layer")
            if cache is None:
                k_idx = self.indexer.keys(x, cos, sin)  # [B, T, DI]
            elif write_kv:
                k_idx = cache.append_index_k(self.indexer.keys(x, cos, sin))
            else:
                k_idx = cache.index_k
            q_idx, w = self.indexer.queries(x, q_resid, cos, sin)
            scores = self.indexer.scores(q_idx, w, k_idx, fp8=self.indexer_fp8)
            topk = select_topk(scores.masked_fill(~allowed, float("-inf")), self.indexer.topk)
        allowed = allowed & topk_mask(topk, num_keys)
        out = self.attend(q_nope, q_pe, c, k_pe, allowed)
        return self.o_proj(out), topk

    def project_x(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(q_a_proj(x), kv_a_proj_with_mqa(x), indexer wk(x)) from the one GEMM of `fuse`, or Nones
        where the projections are not fused (each then computes its own)."""
        if self.x_proj is None:
            return None, None, None
        q_a_x, kv_a_x, *wk = F.linear(x, self.x_proj).split(self.x_proj_sizes, dim=-1)
        return q_a_x, kv_a_x, wk[0] if wk else None

    def write_paged_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedLayerCache,
                       kv_a_x: torch.Tensor | None = None, wk_x: torch.Tensor | None = None) -> None:
        """Write the KV of x [1, T, D] (and its indexer keys, on a layer with an indexer cache) to
        cache.batch.slots; kv_a_x, wk_x: from `project_x`, when computed. The write normalises and
        ropes the projections on the way (`key_prep`; on an FP8 indexer cache the keys are rotated
        before quantization, as in Indexer.scores(fp8=True))."""
        kv_a = self.kv_a_proj_with_mqa(x) if kv_a_x is None else kv_a_x
        c, k_pe = kv_a[0].split([self.r, self.dr], dim=-1)  # [T, r], [T, dr] projections
        index_k = index_prep = None
        if self.indexer is not None and cache.index is not None:
            index_k = (self.indexer.wk(x) if wk_x is None else wk_x)[0]  # [T, DI]
            index_prep = self.indexer.key_prep(cos, sin, cache.index.dtype == torch.uint8)
        cache.ops.write_kv(c, k_pe, cache.batch.slots, cache.kv, index_k, cache.index,
                           mla_prep=self.key_prep(cos, sin), index_prep=index_prep)

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, topk: torch.Tensor | None,
                      cache: PagedLayerCache, write_kv: bool = True, rows: OutputRows | None = None,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged form: x [1, T, D] is the batch's T tokens flattened (cos/sin [1, T, dr] at
        their positions); cache.batch says where each token sits. Writes the tokens' KV (and
        indexer keys on full layers) unless write_kv is False, selects top-k physical slots with
        the indexer unless `topk` [T, K] is given (shared layers, KVShare steps), and attends in the
        absorbed form through cache.ops. Returns (out [1, T, D], topk slots [T, K] int32, -1 = none).
        rows: compute only these R rows' outputs (out [1, R, D], topk [R, K]); every row's KV is
        written still (a long prompt's last layer needs one row's output, its indexer would
        score the whole context for every row). residual [1, T, D] (outside autograd): return
        residual + out instead, o_proj's GEMM accumulating into residual in place (`linear_into`; with
        rows, into residual's R rows, a copy)."""
        batch, ops = cache.batch, cache.ops
        q_a_x = None  # a draft step that writes no KV needs only q's projection
        if write_kv:
            q_a_x, kv_a_x, wk_x = self.project_x(x)
            self.write_paged_kv(x, cos, sin, cache, kv_a_x, wk_x)
        if rows is not None:
            x, cos, sin = (t[:, rows.index] for t in (x, cos, sin))
            q_a_x = None if q_a_x is None else q_a_x[:, rows.index]
            residual = None if residual is None else residual[:, rows.index]
            topk = None if topk is None else topk.index_select(0, rows.index)
            batch, cache = rows.batch, dataclasses.replace(cache, batch=rows.batch)
            if not len(rows):
                return x, torch.empty(0, self.cfg.index_topk, dtype=torch.int32, device=x.device)
        # The kernel's query q [T, H, r + dr] = [q_nope·W_UK | roped q_pe]: outside autograd both halves
        # are written into it in place (a batched GEMM and the rope), no concatenation after.
        T, H = x.shape[1], self.n_heads
        q = None
        if not torch.is_grad_enabled() and x.dtype in (torch.float32, torch.bfloat16):
            q = x.new_empty(T, H, self.r + self.dr)
        # [1, T, q_lora], [1, T, H, dn], [1, T, H, dr]
        q_resid, q_nope, q_pe = self.project_q(x, cos, sin, ops.rope, q_a_x, ops.norm,
                                               None if q is None else q[None, :, :, self.r :])
        fp8_index = cache.index is not None and cache.index.dtype == torch.uint8

        if topk is None:
            if self.indexer is None or cache.index is None:
                raise ValueError("a shared-indexer layer needs the top-k of its full layer")
            idx = self.indexer
            if fp8_index:  # rope, rotation, FP8 a head a row; the scales (positive) move out of the ReLU into w
                q_idx, w = idx.projections(x, q_resid)  # [1, T, HI, DI] before rope, [1, T, HI] fp32
                q_idx, w = ops.index_queries_fp8(q_idx[0], w[0], cos, sin, idx.rope_interleave, idx.rope_dim,
                                                 idx.rotation(x.device), idx.n_heads**-0.5, idx.head_dim**-0.5)
            else:
                q_idx, w = idx.queries(x, q_resid, cos, sin, ops.rope)  # [1, T, HI, DI], [1, T, HI] fp32
                q_idx, w = q_idx[0].to(cache.index.dtype), w[0] * idx.head_dim**-0.5
            topk = ops.indexer_topk(q_idx, w, cache.index, batch.block_table, batch.seq_idx, batch.key_len,
                                    self.indexer.topk, batch.indexer_chunk(), batch.key_len_host)

        # absorbed MLA: MQA over the latent; the kernel reads the cache in its own layout
        w_uk, w_uv = self.wkv_b()
        if q is not None:  # q_lat [T, H, r] = q_nope·W_UK a head, written into q's first r dims
            per_head_matmul(q_nope[0], w_uk, q[:, :, : self.r])
        else:
            q_lat = torch.einsum("shd,hdr->shr", q_nope[0], w_uk)  # [T, H, r]
            q = torch.cat([q_lat, q_pe[0]], dim=-1)  # [T, H, r + dr]
            if q.dtype not in (torch.float32, torch.bfloat16):
                q = q.to(torch.bfloat16)
        # A row's key count bounds its top-k's valid slots (listed first): the kernel skips the rest.
        # Without write_kv (KVShare draft steps) the batch only names the sequences: no bound.
        out, _ = ops.sparse_mla(q, cache.kv, topk, self.softmax_scale, self.r,
                                batch.key_len if write_kv else None)  # [T, H, r]
        o = heads_out(out.to(x.dtype), w_uv)[None]  # [1, T, H·dv]
        if residual is None:
            return self.o_proj(o), topk
        return linear_into(o, self.o_proj.weight, residual, self.o_proj.bias), topk
