"""The MTP (multi-token prediction) layer and γ-step recursive drafting, in plain PyTorch.

Alignment: the MTP layer's input at position i combines the target's hidden state h_i (after the
final norm) with the embedding of token x_{i+1}, and predicts x_{i+2}; its rope position is i.
Step 1 runs over every position of the context (so the MTP layer's KV is computed from target
hidden states); step j ≥ 2 runs one position further on, on step j-1's output hidden state and
its drafted token. The same weights run at every step.

With `index_share_for_mtp_iteration` (IndexShare + KVShare): steps ≥ 2 reuse step 1's top-k (its
last row) and attend only to step 1's KV, writing nothing — so no draft attends to draft-made KV,
as in training. Without it (the baseline), every step runs the indexer and appends its own KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megactx.config import ModelConfig
from megactx.model.attention import LayerCache
from megactx.model.decoder import DecoderLayer
from megactx.model.layers import RMSNorm
from megactx.model.paged import OutputRows


class SharedHead(nn.Module):
    """The MTP layer's own final norm; the vocabulary projection is the model's lm_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx, has_indexer=True)  # the MTP layer has its own indexer
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, topk: torch.Tensor | None = None, cache: LayerCache | None = None,
                write_kv: bool = True, rows: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [B, S, D] previous hidden states, embeds: [B, S, D] embeddings of the next tokens
        -> (output hidden [B, S, D] before shared_head.norm, topk [B, S, K]); rows as in
        `DecoderLayer.forward`."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return super().forward(x, cos, sin, positions, topk, cache, write_kv, rows, in_place=True)  # x is ours


@dataclass
class Drafts:
    next_token: torch.Tensor  # [B] the target's greedy token after the context
    tokens: torch.Tensor  # [B, γ] greedy drafts for the positions after next_token
    logits: torch.Tensor  # [B, γ, V] fp32 draft logits, step by step


@torch.no_grad()
def draft(model, input_ids: torch.Tensor, num_steps: int, kv_share: bool | None = None) -> Drafts:
    """Greedy γ-step recursive drafting with the first MTP layer, no paged cache.

    input_ids: [B, S]. kv_share: IndexShare + KVShare across steps; None takes the config's
    `index_share_for_mtp_iteration`."""
    if not model.mtp:
        raise ValueError("this checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    cfg, mtp = model.cfg, model.mtp[0]
    share = cfg.index_share_for_mtp_iteration if kv_share is None else kv_share
    B, S = input_ids.shape
    hidden = model.hidden_states(input_ids)  # [B, S, D]
    next_token = model.compute_logits(hidden[:, -1]).argmax(-1)  # [B]

    cache = LayerCache()
    positions = torch.arange(S, device=input_ids.device)[None]
    shifted = torch.cat([input_ids[:, 1:], next_token[:, None]], dim=1)  # x_{i+1} at position i
    cos, sin = model.rotary(positions, hidden.dtype)
    g, topk = mtp(hidden, model.embed(shifted), cos, sin, positions, cache=cache)
    topk_last = topk[:, -1:]  # [B, 1, K]: step 1's selection, reused by later steps under KVShare

    tokens, logits = [], []
    for step in range(num_steps):
        if step > 0:
            pos = torch.full((1, 1), S + step - 1, device=input_ids.device)
            cos, sin = model.rotary(pos, hidden.dtype)
            g, _ = mtp(g[:, -1:], model.embed(tokens[-1][:, None]), cos, sin, pos,
                       topk=topk_last if share else None, cache=cache, write_kv=not share)
        step_logits = model.compute_logits(mtp.shared_head.norm(g[:, -1]))  # [B, V]
        logits.append(step_logits)
        tokens.append(step_logits.argmax(-1))
    return Drafts(next_token, torch.stack(tokens, 1), torch.stack(logits, 1))
