"""Training objectives of the DSA / IndexShare recipe: the loss formulas, and the memory-bounded
training forward that produces what they need.

Formulas (../shared/reference/FACTS.md):
- indexer warm-up (DeepSeek-V3.2, dense stage): mean_t KL(p_t ‖ softmax(I_t)) over every causal
  key, p_t = the layer's attention of query t summed over heads and L1-normalised;
- multi-layer distillation (IndexCache, sparse stage): the indexer of full layer ℓ, serving layers
  ℓ..ℓ+m, is trained with Σ_j 1/(m+1) mean_t KL(p_t^(ℓ+j) ‖ softmax(I_t^(ℓ))), over the selected
  keys only; its gradient is that of KL(mean_j p^(ℓ+j) ‖ softmax(I)). With `kl_candidates` C > K,
  p and I span each query's top-C keys by indexer score instead (p: the layer's attention as it
  would be over those C; the layer itself still attends to the top-K), so a key the indexer ranks
  just outside its selection, which the attention would have weighed, still gets a gradient. With
  `indexer_needle_weight`, the KL's mean over the needle answers' query rows alone is a second
  term. The indexer's inputs are detached, so these losses train the indexer alone, and the LM
  loss never reaches it (top-k is not differentiable);
- MTP: cross-entropy of each of γ draft steps, and the end-to-end TV loss (Eq. 13)
  L = 1 − (1/γ) Σ_j Π_{i≤j} α_i with α_i = 1 − TV(p_i, q_i), p (the target) detached.

The training forward runs the reference model's own modules; only attention is replaced, for the
duration of a forward, by `TrainingAttention` (installed through `MLA.training_attention`). It
attends in query chunks, each recomputed in the backward (torch.utils.checkpoint), densely or
over the gathered top-k keys, so no [heads, S, S] tensor ever exists. Memory of one sequence of S
tokens (fp32 sizes; bf16 halves the activations):
- kept for the backward: the layers' activations outside attention (about 20·D + 4·I floats a
  token a layer: x, norms, q/kv projections, MLP/MoE intermediates) + S·K int64 top-k per full
  layer + S·K fp32 attention sum per trained indexer group (S·S in a dense warm-up);
- transient, one chunk at a time: at most `chunk_bytes` (the gathered [rows, K, r + dr] latents,
  or the [rows, HI, S] indexer scores of the selection, whichever is larger per row);
- the LM head and the MTP heads are chunked the same way, so [S, vocab] logits are never kept.
For the tiny model (D = 256, I = 512, 8 layers, K = 2048) that is about 0.2 MB a token: 64K
tokens ≈ 13 GB, 512K ≈ 100 GB of a 139 GB H200.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megactx.model.attention import MLA, LayerCache, select_topk
from megactx.model.transformer import Transformer

IGNORE = -100  # label of a position without a next token (F.cross_entropy's ignore_index)
DEFAULT_CHUNK_BYTES = 256 << 20  # transient memory of one attention / indexer chunk


# ---------------------------------------------------------------------------------------------
# Loss formulas on explicit tensors (the training forward computes the same values streaming)
# ---------------------------------------------------------------------------------------------
def _kl_rows(p: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ softmax(logits over valid)) per row. p, logits, valid: [..., T] -> [...] fp32."""
    log_q = torch.log_softmax(logits.float().masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1)


def indexer_warmup_loss(attn_probs: torch.Tensor, index_scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The dense warm-up KL, averaged over queries.

    attn_probs: [B, H, S, T] the layer's attention (rows sum to 1 over the allowed keys);
    index_scores: [B, S, T] the indexer's logits I; allowed: [B, S, T] bool (causal mask).
    Returns mean_{b,t} KL(p_t ‖ softmax(I_t)) with p = Σ_h probs / Σ_{h,s} probs."""
    p = attn_probs.float().sum(1)
    p = p / p.sum(-1, keepdim=True)
    return _kl_rows(p, index_scores, allowed).mean()


def multi_layer_distillation_loss(attn_probs: list[torch.Tensor], index_scores: torch.Tensor,
                                  valid: torch.Tensor) -> torch.Tensor:
    """IndexCache's loss of one full layer's indexer, averaged over queries.

    attn_probs: one [B, H, S, K] a served layer (the full layer first), attention over the K
    selected keys; index_scores: [B, S, K] the indexer's logits at those keys; valid: [B, S, K]
    bool (False where the top-k slot is -1). Returns Σ_j 1/(m+1) mean_t KL(p_t^(j) ‖ softmax(I_t))."""
    losses = [indexer_warmup_loss(probs, index_scores, valid) for probs in attn_probs]
    return torch.stack(losses).mean()


def tv_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """α = 1 − TV(p, q) per draft step: the probability that rejection sampling accepts step j's
    draft. target_logits (p, detached here) and draft_logits (q): [N, γ, V] -> α [N, γ] fp32."""
    p = torch.softmax(target_logits.detach().float(), dim=-1)
    q = torch.softmax(draft_logits.float(), dim=-1)
    return 1.0 - 0.5 * (p - q).abs().sum(-1)


def tv_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """The end-to-end TV loss (Eq. 13): mean over the N anchors of 1 − (1/γ) Σ_j Π_{i≤j} α_i.

    target_logits, draft_logits: [N, γ, V]; row n, step j holds the target's and the drafter's
    logits for the token drafted at step j from anchor n. 1 − L is the expected number of
    accepted drafts over γ (the bonus token not counted)."""
    alpha = tv_acceptance(target_logits, draft_logits)  # [N, γ]
    return 1.0 - alpha.cumprod(-1).mean(-1).mean()


def expected_accept_length(alpha: torch.Tensor) -> torch.Tensor:
    """alpha: [N, γ] per-step acceptance probabilities -> [N] expected accepted drafts Σ_j Π_{i≤j} α_i
    (γ · (1 − tv_loss); the acceptance length of speculative decoding is this + 1, the bonus token)."""
    return alpha.cumprod(-1).sum(-1)


def mtp_cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over steps and anchors of −log q_j(label). draft_logits: [N, γ, V], labels: [N, γ]
    (IGNORE = no label)."""
    return F.cross_entropy(draft_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)


# ---------------------------------------------------------------------------------------------
# Streaming attention targets and the chunked training attention
# ---------------------------------------------------------------------------------------------
def indexer_scores_at(indexer: nn.Module, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                      idx: torch.Tensor) -> torch.Tensor:
    """The indexer's logits at selected keys, `Indexer.scores` gathered without the [S, T] matrix.

    q: [B, Q, HI, DI], w: [B, Q, HI] fp32, k: [B, T, DI], idx: [B, Q, K] key rows (-1 = none)
    -> [B, Q, K] fp32 (0 at -1 slots)."""
    k_sel = _gather_rows(k, idx.clamp(min=0))  # [B, Q, K, DI]
    dots = torch.einsum("bqhd,bqkd->bqhk", q.float(), k_sel.float()) * indexer.head_dim**-0.5
    return torch.einsum("bqh,bqhk->bqk", w, F.relu(dots)).masked_fill(idx < 0, 0.0)


def _rows_per_chunk(total_rows: int, bytes_per_row: int, budget: int) -> int:
    return max(1, min(total_rows, budget // max(1, bytes_per_row)))


def _causal(r0: int, r1: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """[r1 - r0, num_keys] bool: key s is visible to row t when s <= t (rows are token indices)."""
    return torch.arange(num_keys, device=device)[None, :] <= torch.arange(r0, r1, device=device)[:, None]


class _RowGather(torch.autograd.Function):
    """rows[i] = t[flat[i]] over the first dim: the forward by advanced indexing, the backward by an
    index_add. Each is the faster of the two on the H200 (a tiny-recipe sparse step, B 8 x S 4096,
    FSSSSSSF, fwd + bwd): advanced indexing gathers in 40 ms where index_select takes 91, but its
    own backward, an index_put with accumulation, sorts the indices first (97 ms against
    index_add's 28)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flat)
        ctx.num_rows = t.shape[0]
        return t[flat]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (flat,) = ctx.saved_tensors
        return grad.new_zeros(ctx.num_rows, *grad.shape[1:]).index_add_(0, flat, grad), None


def _gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t: [B, T, ...], idx: [B, Q, K] in 0..T-1 -> [B, Q, K, ...] (t[b, idx[b, q, k]]), one gather
    over the flattened rows (_RowGather). The gathers of 256-byte rows are most of what that sparse
    step costs beyond a dense step of the same rows (52 ms on the H200)."""
    B, T = t.shape[:2]
    flat = (idx + torch.arange(B, device=idx.device)[:, None, None] * T).reshape(-1)  # [B·Q·K]
    rows = t.reshape(B * T, *t.shape[2:])
    out = _RowGather.apply(rows, flat) if torch.is_grad_enabled() and t.requires_grad else rows[flat]
    return out.view(*idx.shape, *t.shape[2:])


class AttentionTarget:
    """Running Σ_j p^(j) of the layers one indexer serves, and Σ_j Σ p^(j) log p^(j), which is all
    Σ_j KL(p^(j) ‖ q) = Σ_j Σ p^(j) log p^(j) − Σ (Σ_j p^(j)) log q needs: no layer's p is kept.

    p_sum: [B, S, W] fp32, W = K selected slots (sparse) or S keys (dense). focus: [B, S] bool,
    query rows whose sums are also kept apart (the needle answers: `TrainingAttention.focus`)."""

    def __init__(self, shape: tuple[int, int, int], device: torch.device, focus: torch.Tensor | None = None):
        self.p_sum = torch.zeros(shape, dtype=torch.float32, device=device)
        self.focus = torch.zeros(shape[:2], dtype=torch.bool, device=device) if focus is None else focus
        self.neg_entropy = torch.zeros(2, dtype=torch.float32, device=device)  # every row, the focus rows
        self.layers = 0

    def add(self, r0: int, p: torch.Tensor) -> None:
        """p: [B, Q, w] attention (summed over heads, L1-normalised) of rows r0..r0+Q-1 over the
        first w columns."""
        Q, w = p.shape[1], p.shape[2]
        self.p_sum[:, r0 : r0 + Q, :w] += p
        rows = torch.xlogy(p, p).sum(-1)  # [B, Q]
        self.neg_entropy += torch.stack([rows.sum(), (rows * self.focus[:, r0 : r0 + Q]).sum()])

    def cross_entropy(self, r0: int, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[2]: Σ over rows r0.. (all of them; the focus rows) of Σ_j p^(j) · log softmax(logits);
        logits, valid: [B, Q, w]."""
        Q, w = logits.shape[1], logits.shape[2]
        log_q = torch.log_softmax(logits.float().masked_fill(~valid, float("-inf")), -1).masked_fill(~valid, 0.0)
        rows = (self.p_sum[:, r0 : r0 + Q, :w] * log_q).sum(-1)  # [B, Q]
        return torch.stack([rows.sum(), (rows * self.focus[:, r0 : r0 + Q]).sum()])


@dataclass
class _Group:
    """A trained full layer's indexer and the attention of the layers it has served so far."""

    layer: int
    indexer: nn.Module
    q: torch.Tensor  # [B, S, HI, DI] indexer queries (graph to the indexer weights only)
    w: torch.Tensor  # [B, S, HI] fp32 head weights
    k: torch.Tensor  # [B, S, DI] indexer keys
    topk: torch.Tensor  # [B, S, K] the selection (width 0: dense, every causal key)
    candidates: torch.Tensor  # [B, S, C] the keys the KL spans: the selection, then the indexer's next-best
    target: AttentionTarget  # over the candidates (over every causal key when dense)


class TrainingAttention:
    """Replaces `MLA.forward` during a training forward (see `installed`).

    dense_layers: layer indices (MTP layers count from num_hidden_layers) that attend to every
    causal key; the others attend to the top-k of their full layer. trained_indexers: full layers
    whose indexer gets a KL loss: the warm-up KL on dense layers, the distillation KL over the
    selected keys on sparse ones, in both cases against the mean attention of every call that
    reused the layer's selection (its shared layers; MTP steps ≥ 2 under KVShare). chunk_bytes:
    transient memory of one chunk. select_fp8: select the top-k from FP8-simulated indexer scores
    (`Indexer.scores(fp8=True)`: what the serving engine's FP8 indexer cache computes); the KL still
    trains the exact scores, which FP8 only rounds. kl_candidates: C > K widens a sparse group's KL
    to each query's top-C keys by indexer score (module docstring); the layers attend to the top-K.
    Sparse layers gather their selected keys' rows (`_gather_rows`). A masked form (dense matmuls
    over every causal key, the unselected masked out; the same values) ran 2.2x faster on a CPU but
    2.3x slower on an H200 (megactx-tiny's sparse step, 8 x 4096 tokens, top-k 128: 48,886 against
    110,220 tokens/s), and was removed.

    Rows are token indices: key row s is visible to query row t when s <= t, whatever the rope
    positions (MTP steps ≥ 2 rope at t + j − 1). A dense layer returns a top-k of width 0 so that
    the layers sharing its selection (and the identity test of the group) still receive one.
    """

    def __init__(self, model: Transformer, dense_layers: set[int], trained_indexers: set[int],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, select_fp8: bool = False, kl_candidates: int = 0):
        self.layer_of = {id(attn): i for i, attn in enumerate(model.attention_modules())}
        for i in trained_indexers:
            if model.attention_modules()[i].indexer is None:
                raise ValueError(f"trained_indexers names layer {i}, which has no indexer (a shared layer)")
        self.dense_layers, self.trained_indexers = set(dense_layers), set(trained_indexers)
        self.chunk_bytes = chunk_bytes
        self.select_fp8 = select_fp8
        self.kl_candidates = kl_candidates
        self._open: _Group | None = None
        self.indexer_losses: list[torch.Tensor] = []
        self.focus: torch.Tensor | None = None

    @contextmanager
    def installed(self, model: Transformer, focus: torch.Tensor | None = None) -> Iterator[TrainingAttention]:
        """Route every attention module of `model` through this object for the block; per-forward
        state (open group, collected losses) starts empty. focus: [B, S] bool query rows whose
        indexer KL is also averaged apart (the needle answers), or None."""
        modules = model.attention_modules()
        self._open, self.indexer_losses, self.focus = None, [], focus
        for attn in modules:
            attn.training_attention = self
        try:
            yield self
        finally:
            for attn in modules:
                attn.training_attention = None

    def finish(self) -> list[torch.Tensor]:
        """Close the last group; returns the indexer losses of this forward, one a group: [2], the
        KL's mean over every query row and over the focus rows (0 without any)."""
        self._close()
        losses, self.indexer_losses = self.indexer_losses, []
        return losses

    # -- the replacement of MLA.forward ----------------------------------------------------------
    def __call__(self, attn: MLA, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 topk: torch.Tensor | None, cache: LayerCache | None, write_kv: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Arguments and result as `MLA.forward` (no paged cache; a cache may only be empty and
        written, or read without writing, as the MTP steps do)."""
        layer = self.layer_of[id(attn)]
        B, S, _ = x.shape
        q_resid, q_nope, q_pe = attn.project_q(x, cos, sin)
        if cache is None or write_kv:
            if cache is not None and cache.length:
                raise ValueError("the training forward appends to an empty cache only (MTP step 1)")
            c, k_pe = attn.project_kv(x, cos, sin)  # [B, S, r], [B, S, dr]
            if cache is not None:
                cache.append_kv(c, k_pe)
        else:
            if topk is None:
                raise ValueError("a read-only cache (an MTP step under KVShare) needs the step-1 top-k")
            c, k_pe = cache.c, cache.k_pe
        if c.shape[1] != S:
            raise ValueError(f"keys ({c.shape[1]}) and queries ({S}) must be the same rows in training")

        dense = layer in self.dense_layers
        group = None
        if topk is None:
            if attn.indexer is None:
                raise ValueError("a shared-indexer layer needs the top-k of its full layer")
            self._close()
            topk, group = self._run_indexer(attn, layer, x, q_resid, cos, sin, dense)
        elif self._open is not None and self._open.topk is topk:
            group = self._open
        if group is not None:
            group.target.layers += 1
        if dense != (topk.shape[-1] == 0):
            raise ValueError(f"layer {layer} attends {'densely' if dense else 'sparsely'} but the selection "
                             "it reuses was made the other way; dense_layers must hold whole layer groups")

        if dense and group is None:
            out = self._dense_sdpa(attn, q_nope, q_pe, c, k_pe)
        else:
            out = self._chunked(attn, q_nope, q_pe, c, k_pe, None if dense else topk, group)
        return attn.o_proj(out), topk

    # -- indexer: selection and the group it opens -----------------------------------------------
    def _run_indexer(self, attn: MLA, layer: int, x, q_resid, cos, sin, dense: bool):
        indexer, trained = attn.indexer, layer in self.trained_indexers
        B, S, _ = x.shape
        with torch.set_grad_enabled(trained and torch.is_grad_enabled()):
            # detached inputs: the indexer learns from its KL only, and never moves the model
            q, w = indexer.queries(x.detach(), q_resid.detach(), cos, sin)  # [B, S, HI, DI], [B, S, HI]
            k = indexer.keys(x.detach(), cos, sin)  # [B, S, DI]
        learns = trained and torch.is_grad_enabled()
        if dense:
            topk = candidates = torch.empty(B, S, 0, dtype=torch.long, device=x.device)
        else:
            width = min(indexer.topk, S)
            candidates = self._select(indexer, q, w, k, max(width, min(self.kl_candidates, S)) if learns else width)
            topk = candidates[..., :width]  # the sorted selection's first K columns are its top-K
        group = None
        if learns:
            target = AttentionTarget((B, S, S if dense else candidates.shape[-1]), x.device, self.focus)
            group = _Group(layer, indexer, q, w, k, topk, candidates, target)
            self._open = group
        return topk, group

    @torch.no_grad()
    def _select(self, indexer: nn.Module, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                width: int) -> torch.Tensor:
        """The top-`width` (<= S) of the indexer scores over the causal keys, best first, chunked over
        query rows. -> [B, S, width] int64, -1 = no key (rows with fewer than `width` causal keys)."""
        B, S, HI, _ = q.shape
        rows = _rows_per_chunk(S, B * HI * S * 4 * 2, self.chunk_bytes)
        out = []
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            scores = indexer.scores(q[:, r0:r1], w[:, r0:r1], k[:, :r1], fp8=self.select_fp8)  # [B, Q, r1]
            scores = scores.masked_fill(~_causal(r0, r1, r1, q.device), float("-inf"))
            idx = select_topk(scores, width)
            out.append(F.pad(idx, (0, width - idx.shape[-1]), value=-1))
        return torch.cat(out, dim=1)

    def _close(self) -> None:
        """Turn the open group's accumulated attention into its indexer's loss."""
        group, self._open = self._open, None
        if group is None:
            return
        B, S, HI, DI = group.q.shape
        dense = group.topk.shape[-1] == 0
        width = S if dense else group.candidates.shape[-1]
        rows = _rows_per_chunk(S, B * width * (HI + DI + 4) * 4, self.chunk_bytes)
        cross = torch.zeros(2, device=group.q.device)
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            idx = None if dense else group.candidates[:, r0:r1]
            cross = cross + checkpoint(self._indexer_cross, group, r0, r1, group.q[:, r0:r1], group.w[:, r0:r1],
                                       group.k, idx, use_reentrant=False)
        counted = torch.stack([torch.tensor(B * S, device=cross.device), group.target.focus.sum().clamp(min=1)])
        self.indexer_losses.append((group.target.neg_entropy - cross) / (counted * group.target.layers))

    @staticmethod
    def _indexer_cross(group: _Group, r0: int, r1: int, q, w, k, idx) -> torch.Tensor:
        """[2]: Σ_j p^(j) · log softmax(I) over rows r0..r1-1 (all; the focus rows). q: [B, Q, HI, DI], w: [B, Q, HI],
        k: [B, S, DI], idx: [B, Q, K] or None (dense: keys 0..r1-1)."""
        indexer = group.indexer
        if idx is None:
            logits = indexer.scores(q, w, k[:, :r1])  # [B, Q, r1]
            valid = _causal(r0, r1, r1, q.device).expand_as(logits)
        else:
            valid = idx >= 0
            logits = indexer_scores_at(indexer, q, w, k, idx)
        return group.target.cross_entropy(r0, logits, valid)

    # -- attention cores ---------------------------------------------------------------------------
    @staticmethod
    def _dense_sdpa(attn: MLA, q_nope, q_pe, c, k_pe) -> torch.Tensor:
        """Causal attention over every key, naive MLA form through SDPA (no probabilities kept)."""
        B, S, H, _ = q_nope.shape
        kv = attn.kv_b_proj(c).view(B, S, H, attn.dn + attn.dv)
        k_nope, v = kv.split([attn.dn, attn.dv], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, S, dn + dr]
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, H, -1)], dim=-1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=attn.softmax_scale)
        return out.transpose(1, 2).reshape(B, S, H * attn.dv)

    def _chunked(self, attn: MLA, q_nope, q_pe, c, k_pe, topk: torch.Tensor | None,
                 group: _Group | None) -> torch.Tensor:
        """Absorbed MLA over query chunks, each recomputed in the backward. topk: [B, S, K] (sparse)
        or None (dense, keys 0..t). Adds each chunk's head-mean attention over `group`'s candidates
        to its target."""
        B, S, H, _ = q_nope.shape
        want_p = group is not None
        more = None  # [B, S, C - K]: the KL's candidates beyond the selection
        if topk is not None and want_p and group.candidates.shape[-1] > topk.shape[-1]:
            more = group.candidates[..., topk.shape[-1]:]
        width = S if topk is None else topk.shape[-1] + (0 if more is None else more.shape[-1])
        latent = attn.r + attn.dr
        rows = _rows_per_chunk(S, B * width * (H * 4 * 3 + (0 if topk is None else latent * 4 * 2)),
                               self.chunk_bytes)
        outs = []
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            idx = None if topk is None else topk[:, r0:r1]
            extra = None if more is None else more[:, r0:r1]
            args = (attn, r0, r1, q_nope[:, r0:r1], q_pe[:, r0:r1], c, k_pe, idx, want_p, extra)
            if torch.is_grad_enabled():
                out, p = checkpoint(self._attend_chunk, *args, use_reentrant=False)
            else:
                out, p = self._attend_chunk(*args)
            if want_p:
                group.target.add(r0, p)
            outs.append(out)
        return torch.cat(outs, dim=1)

    @staticmethod
    def _attend_chunk(attn: MLA, r0: int, r1: int, q_nope, q_pe, c, k_pe, idx, want_p: bool, extra=None):
        """Rows r0..r1-1. q_nope: [B, Q, H, dn], q_pe: [B, Q, H, dr], c: [B, S, r], k_pe: [B, S, dr],
        idx: [B, Q, K] key rows (-1 = none) or None (dense over keys 0..r1-1); extra: [B, Q, E] more
        key rows that p spans too (the KL's candidates beyond the selection) or None.
        -> out [B, Q, H * dv], p [B, Q, K + E or r1] fp32 head-mean probabilities (detached) or None."""
        dtype = q_nope.dtype
        w_uk, w_uv = attn.wkv_b()
        q_lat = torch.einsum("bqhd,hdr->bqhr", q_nope, w_uk)  # [B, Q, H, r]

        def gathered_scores(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """rows: [B, Q, W] (-1 = none) -> latents [B, Q, W, r], masked scaled scores [B, Q, H, W]."""
            safe = rows.clamp(min=0)
            keys_c, keys_pe = _gather_rows(c, safe), _gather_rows(k_pe, safe)  # [B, Q, W, r], [B, Q, W, dr]
            s = torch.einsum("bqhr,bqkr->bqhk", q_lat, keys_c) + torch.einsum("bqhd,bqkd->bqhk", q_pe, keys_pe)
            return keys_c, (s * attn.softmax_scale).masked_fill((rows < 0)[:, :, None, :], float("-inf"))

        if idx is None:
            keys_c, keys_pe = c[:, :r1], k_pe[:, :r1]  # [B, r1, r], [B, r1, dr]
            scores = torch.einsum("bqhr,btr->bqht", q_lat, keys_c) + torch.einsum("bqhd,btd->bqht", q_pe, keys_pe)
            allowed = _causal(r0, r1, r1, c.device)[None, :, None, :]
            scores = (scores * attn.softmax_scale).masked_fill(~allowed, float("-inf"))
        else:
            keys_c, scores = gathered_scores(idx)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).nan_to_num(0.0)  # [B, Q, H, W]
        p = None
        if want_p:
            with torch.no_grad():
                if extra is None:
                    p = probs.mean(2)
                else:  # the attention as it would be over the selection and the extra rows (a target only)
                    wide = torch.cat([scores, gathered_scores(extra)[1]], dim=-1)
                    p = torch.softmax(wide, dim=-1, dtype=torch.float32).nan_to_num(0.0).mean(2)
        probs = probs.to(dtype)
        if idx is None:
            o_lat = torch.einsum("bqht,btr->bqhr", probs, keys_c)
        else:
            o_lat = torch.einsum("bqhk,bqkr->bqhr", probs, keys_c)
        out = torch.einsum("bqhr,hvr->bqhv", o_lat, w_uv)  # [B, Q, H, dv]
        return out.reshape(*out.shape[:2], -1), p


# ---------------------------------------------------------------------------------------------
# The objectives
# ---------------------------------------------------------------------------------------------
def token_losses(model: Transformer, hidden: torch.Tensor, labels: torch.Tensor,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """[B, S] fp32 next-token cross-entropy of each position (0 where labels is IGNORE).
    hidden: [B, S, D] final-normed, labels: [B, S]. The head runs over row chunks recomputed in
    the backward: [S, vocab] logits are never kept."""
    B, S, _ = hidden.shape
    rows = _rows_per_chunk(S, B * model.cfg.vocab_size * 4 * 3, chunk_bytes)

    def chunk(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model.compute_logits(h)  # [B, Q, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE,
                               reduction="none").view(y.shape)

    grad = torch.is_grad_enabled()
    return torch.cat([checkpoint(chunk, hidden[:, r0 : r0 + rows], labels[:, r0 : r0 + rows], use_reentrant=False)
                      if grad else chunk(hidden[:, r0 : r0 + rows], labels[:, r0 : r0 + rows])
                      for r0 in range(0, S, rows)], dim=1)


def lm_loss(model: Transformer, hidden: torch.Tensor, labels: torch.Tensor,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Mean next-token cross-entropy over the targets that are not IGNORE (see token_losses)."""
    return token_losses(model, hidden, labels, chunk_bytes).sum() / (labels != IGNORE).sum().clamp(min=1)


def mtp_hidden(model: Transformer, input_ids: torch.Tensor, hidden: torch.Tensor, steps: int,
               share: bool) -> list[torch.Tensor]:
    """The first MTP layer run γ = `steps` times over every anchor, teacher-forced.

    input_ids: [B, S]; hidden: [B, S, D] the target's final-normed hidden states. Row i of step j
    (1-based) is the draft for token x_{i+j+1}: its input is step j−1's output at row i (h_i for
    j = 1) and the embedding of x_{i+j}; it ropes at position i + j − 1, as `mtp.draft` does.
    share (IndexShare + KVShare, exactly as at inference): steps ≥ 2 reuse step 1's top-k row i
    and read step 1's KV without writing any; else every step runs its own indexer over its own
    keys (rows ≤ i). Rows whose inputs run past the sequence hold padding; the losses skip them.
    Returns the γ outputs [B, S, D], before shared_head.norm."""
    if not model.mtp:
        raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0)")
    mtp = model.mtp[0]
    B, S = input_ids.shape
    rows = torch.arange(S, device=input_ids.device)[None]
    cache = LayerCache()
    outs, topk1 = [], None
    for j in range(1, steps + 1):
        nxt = F.pad(input_ids[:, j:], (0, min(j, S)))  # x_{i+j} at row i (0 past the end)
        positions = rows + (j - 1)
        cos, sin = model.rotary(positions, hidden.dtype)
        prev = hidden if j == 1 else outs[-1]
        if j == 1:
            g, topk1 = mtp(prev, model.embed(nxt), cos, sin, positions, cache=cache if share else None)
        elif share:
            g, _ = mtp(prev, model.embed(nxt), cos, sin, positions, topk=topk1, cache=cache, write_kv=False)
        else:
            g, _ = mtp(prev, model.embed(nxt), cos, sin, positions)
        outs.append(g)
    return outs


@dataclass
class LossConfig:
    """What one stage optimises.

    lm: the backbone's next-token cross-entropy. attention / mtp_attention: "dense" (every causal
    key) or "sparse" (top-k of the indexers, IndexShare as configured) for the backbone / the MTP
    layer. indexers: whose indexers get the KL loss: "none", "backbone" (every full backbone layer)
    or "mtp". mtp_steps: γ (0: no MTP objective); mtp_loss: "ce", "tv" or "ce+tv"; mtp_share:
    IndexShare + KVShare across steps. indexer_weight: the KL's weight in the total (it shares no
    parameters with the other terms). needle_weight: weight of the needle rows' LM loss (the mean
    over their answer tokens), kept apart from the code rows' mean, where a few answer tokens
    among thousands of code tokens would carry almost no gradient. copy_weight: weight of the copy
    rows' LM loss (a code window's second occurrence, `recipe.CodeSource`), kept apart likewise.
    chunk_bytes: transient memory of one attention chunk. kl_candidates: the sparse indexer KL spans
    each query's top-`kl_candidates` keys by indexer score when that is more than the top-k (0: the
    top-k only; TrainingAttention). indexer_needle_weight: weight of a second indexer KL term, the
    KL's mean over the needle rows' answer positions alone ("indexer_kl_needle"; 0: none): among
    the 64K query rows of a long row the few that retrieve would otherwise carry no weight.
    """

    lm: bool = True
    attention: str = "dense"
    indexers: str = "none"
    mtp_steps: int = 0
    mtp_attention: str = "sparse"
    mtp_loss: str = "ce"
    mtp_share: bool = True
    indexer_weight: float = 1.0
    needle_weight: float = 1.0
    copy_weight: float = 1.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    select_fp8: bool = False  # sparse layers select with FP8-simulated indexer scores, as serving does
    kl_candidates: int = 0
    indexer_needle_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.indexer_needle_weight < 0:
            raise ValueError(f"indexer_needle_weight must be >= 0, got {self.indexer_needle_weight}")
        if self.kl_candidates < 0:
            raise ValueError(f"kl_candidates must be >= 0 keys (0: the top-k only), got {self.kl_candidates}")
        for name in ("attention", "mtp_attention"):
            if getattr(self, name) not in ("dense", "sparse"):
                raise ValueError(f"{name} must be 'dense' or 'sparse', got {getattr(self, name)!r}")
        if self.indexers not in ("none", "backbone", "mtp"):
            raise ValueError(f"indexers must be 'none', 'backbone' or 'mtp', got {self.indexers!r}")
        if self.mtp_loss not in ("ce", "tv", "ce+tv"):
            raise ValueError(f"mtp_loss must be 'ce', 'tv' or 'ce+tv', got {self.mtp_loss!r}")
        if self.mtp_steps < 0:
            raise ValueError(f"mtp_steps must be >= 0, got {self.mtp_steps}")
        if not (self.lm or self.mtp_steps or self.indexers != "none"):
            raise ValueError("a LossConfig must optimise something: lm, mtp_steps > 0 or indexers")


class Objective(nn.Module):
    """One stage's loss on a batch: `forward(input_ids [B, S], loss_mask=None) -> (loss, metrics)`.

    Wraps the model (as the child `model`, so that DDP / FSDP see every parameter under one root)
    and runs its modules through `TrainingAttention`. metrics: detached scalars, "loss" and each
    term: "lm", "indexer_kl" (and "indexer_kl_needle"), "mtp_ce", "mtp_tv", and "mtp_accept" (expected accepted drafts
    Σ_j Π_{i≤j} α_i, logged whatever the objective). Parameters not meant to train must have
    requires_grad=False (recipe.set_trainable); the backbone runs without a graph when nothing
    in it trains (the MTP stages)."""

    def __init__(self, model: Transformer, cfg: LossConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        n = model.cfg.num_hidden_layers
        mtp_layers = set(range(n, n + len(model.mtp)))
        if cfg.mtp_steps and not mtp_layers:
            raise ValueError("mtp_steps > 0 needs a model with an MTP layer (num_nextn_predict_layers >= 1)")
        dense = (set(range(n)) if cfg.attention == "dense" else set()) | (
            mtp_layers if cfg.mtp_attention == "dense" else set())
        trained = {"none": set(), "backbone": set(model.cfg.full_layers), "mtp": {n} if mtp_layers else set()}
        self.attention = TrainingAttention(model, dense, trained[cfg.indexers], cfg.chunk_bytes, cfg.select_fp8,
                                           cfg.kl_candidates)

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor | None = None,
                needle_rows: torch.Tensor | None = None,
                copy_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """input_ids: [B, S]; loss_mask: [B, S − 1] bool, True where target input_ids[:, j + 1]
        counts in the LM loss (None: all); needle_rows / copy_rows: [B] bool, rows that are needle
        tasks / repeated code windows: their LM loss is the term "needle" / "copy" (weights
        cfg.needle_weight / cfg.copy_weight), the other rows' is "lm". The MTP terms count every
        anchor."""
        cfg, model = self.cfg, self.model
        backbone_graph = cfg.lm or cfg.indexers == "backbone"
        terms: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor] = {}
        by_kind: dict[str, torch.Tensor] = {}  # per-kind metrics: NaN for a kind without rows in this batch
        focus = None  # [B, S]: the query rows that predict a needle answer token
        if cfg.indexer_needle_weight and loss_mask is not None and needle_rows is not None:
            focus = F.pad(loss_mask, (0, 1), value=False) & needle_rows[:, None]
        with self.attention.installed(model, focus):
            with torch.set_grad_enabled(backbone_graph and torch.is_grad_enabled()):
                hidden = model.hidden_states(input_ids)  # [B, S, D]
            if cfg.lm:
                labels = input_ids[:, 1:] if loss_mask is None else input_ids[:, 1:].masked_fill(~loss_mask, IGNORE)
                labels = F.pad(labels, (0, 1), value=IGNORE)  # [B, S]: the last position has no target
                kinds = {name: rows for name, rows in (("needle", needle_rows), ("copy", copy_rows))
                         if rows is not None}
                if not kinds:
                    terms["lm"] = lm_loss(model, hidden, labels, cfg.chunk_bytes)
                else:  # every term always (0 for no rows, reported as NaN), so every rank has the same metrics
                    kinds = {"lm": ~torch.stack(list(kinds.values())).any(0)} | kinds
                    nll = token_losses(model, hidden, labels, cfg.chunk_bytes)  # [B, S]
                    counted = labels != IGNORE  # [B, S]
                    for name, rows in kinds.items():  # masks, not row indexing: no host sync
                        n = (counted & rows[:, None]).sum()
                        terms[name] = (nll * rows[:, None]).sum() / n.clamp(min=1)
                        by_kind[name] = torch.where(n > 0, terms[name].detach().float(), float("nan"))
            if cfg.mtp_steps:
                terms.update(self._mtp_terms(input_ids, hidden.detach(), metrics))
            losses = self.attention.finish()
        if losses:
            kl = torch.stack(losses)  # [groups, 2]: over every query row, over the focus rows
            terms["indexer_kl"] = kl[:, 0].mean()
            if focus is not None:
                terms["indexer_kl_needle"] = kl[:, 1].mean()
                by_kind["indexer_kl_needle"] = torch.where(focus.any(), kl[:, 1].mean().detach(), float("nan"))
        weights = {"indexer_kl": cfg.indexer_weight, "indexer_kl_needle": cfg.indexer_needle_weight,
                   "needle": cfg.needle_weight, "copy": cfg.copy_weight}
        loss = sum(weights.get(name, 1.0) * t for name, t in terms.items())
        metrics.update({name: t.detach().float() for name, t in terms.items()} | by_kind)
        metrics["loss"] = loss.detach().float()
        return loss, metrics

    def _mtp_terms(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                   metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The MTP losses over every anchor, the heads chunked as in token_losses: chunks of anchor
        rows, each recomputed in the backward, give the drafter's logits of their γ steps and the
        target's over the rows those steps predict, and keep only α and the cross-entropy per anchor
        and step ([B, A, γ]), never the [B·A, γ, V] logits (tens of GB at 32K tokens a step). The
        terms equal mtp_cross_entropy and tv_loss on the stacked logits."""
        cfg, model = self.cfg, self.model
        gamma, (B, S) = cfg.mtp_steps, input_ids.shape
        anchors = S - gamma - 1  # every step of anchor i has its input x_{i+j} and label x_{i+j+1}
        if anchors < 1:
            raise ValueError(f"sequences of {S} tokens are too short for {gamma} MTP steps (need >= {gamma + 2})")
        outs = mtp_hidden(model, input_ids, hidden, gamma, cfg.mtp_share)
        norm = model.mtp[0].shared_head.norm
        losses = cfg.mtp_loss.split("+")
        # an anchor's transient: γ rows of draft logits, their softmax, |p - q| and the CE's log-softmax,
        # the target's softmax at the same rows
        rows = _rows_per_chunk(anchors, B * gamma * model.cfg.vocab_size * 4 * 6, cfg.chunk_bytes)

        def chunk(h: torch.Tensor, y: torch.Tensor, *g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            # g: γ × [B, r, D] the drafts of anchors i = a0..a1-1; h: [B, r + γ - 1, D] the target's hidden
            # at rows a0 + 1 ..: the p of token x_{i+j+1} sits at row i + j; y: [B, r + γ - 1] those tokens
            r = g[0].shape[1]
            draft = model.compute_logits(norm(torch.stack(g, dim=2)))  # [B, r, γ, V]
            with torch.no_grad():
                target = model.compute_logits(h)  # [B, r + γ - 1, V]
                target = torch.stack([target[:, j : j + r] for j in range(gamma)], dim=2)  # [B, r, γ, V]
            with torch.set_grad_enabled(torch.is_grad_enabled() and "tv" in losses):
                alpha = tv_acceptance(target, draft)  # [B, r, γ]
            if "ce" not in losses:
                return alpha, None
            labels = torch.stack([y[:, j : j + r] for j in range(gamma)], dim=2)  # [B, r, γ]
            ce = F.cross_entropy(draft.flatten(0, 2).float(), labels.flatten(), reduction="none")
            return alpha, ce.view(labels.shape)

        grad = torch.is_grad_enabled()
        parts = []
        for a0 in range(0, anchors, rows):
            a1 = min(a0 + rows, anchors)
            args = (hidden[:, a0 + 1 : a1 + gamma], input_ids[:, a0 + 2 : a1 + gamma + 1],
                    *(g[:, a0:a1] for g in outs))
            parts.append(checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
        accept = expected_accept_length(torch.cat([a for a, _ in parts], dim=1)).mean()  # of [B, A, γ] alphas
        metrics["mtp_accept"] = accept.detach()
        terms = {}
        if "ce" in losses:
            terms["mtp_ce"] = torch.cat([c for _, c in parts], dim=1).mean()
        if "tv" in losses:
            terms["mtp_tv"] = 1.0 - accept / gamma  # tv_loss: 1 − (1/γ) Σ_j Π_{i≤j} α_i, over the anchors
        return terms
