"""One transformer block: RMSNorm → MLA (+ indexer) → RMSNorm → dense MLP or MoE."""

from __future__ import annotations

import torch
from torch import nn

from megactx.config import ModelConfig
from megactx.model.attention import MLA, LayerCache
from megactx.model.layers import RMSNorm
from megactx.model.moe import MLP, MoE
from megactx.model.paged import OutputRows, PagedLayerCache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, has_indexer: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLA(cfg, has_indexer)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                topk: torch.Tensor | None = None, cache: LayerCache | None = None,
                write_kv: bool = True, rows: OutputRows | None = None,
                in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, S, D] -> (x [B, S, D], topk [B, S, K]); arguments as in `MLA.forward`. rows (paged
        caches): only those rows' outputs, x [1, R, D] and topk [R, K] (every row's KV is written).

        in_place: the caller lets x be overwritten. Over a paged cache outside autograd (the
        engine's inference) each residual add then rides in the GEMM that makes its addend, o_proj's
        and the MLP's down projection (cuBLAS's β = 1, `layers.linear_into`), accumulating into x,
        where an add kernel followed each: two kernels a layer, one rounding each instead of two."""
        h = self.input_layernorm(x)
        if in_place and isinstance(cache, PagedLayerCache) and not torch.is_grad_enabled():
            x, topk = self.self_attn(h, cos, sin, positions, topk, cache, write_kv, rows, residual=x)
            if rows is not None and not len(rows):
                return x, topk
            return self.mlp(self.post_attention_layernorm(x), residual=x), topk
        attn, topk = self.self_attn(h, cos, sin, positions, topk, cache, write_kv, rows)
        if rows is not None:
            if not len(rows):  # nothing to compute past the KV
                return attn, topk
            x = x[:, rows.index]
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), topk
