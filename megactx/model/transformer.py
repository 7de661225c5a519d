"""The GLM-5.x / DeepSeek-V3.2 causal LM in plain PyTorch: the reference forward.

`Transformer(cfg)(input_ids)` -> logits [B, S, vocab], no cache. With `set_backend("triton")`
(what `load_model(..., backend="triton")` does) the same call runs the model over paged caches
through the Triton kernels instead (see model/paged.py); "torch" is the reference. Parameter names follow the
Hugging Face checkpoints (`model.layers.{i}...`, `lm_head.weight`), except that routed experts are
stacked (see moe.Experts) and the MTP layers live in `mtp.{j}` (checkpoint layer
`num_hidden_layers + j`); weights.py maps between the two.
"""

from __future__ import annotations

import torch
from torch import nn

from megactx.config import ModelConfig
from megactx.kernels import reference as ref  # attributes read at call time (see model/paged.py)
from megactx.model.attention import MLA, LayerCache
from megactx.model.decoder import DecoderLayer
from megactx.model.layers import RMSNorm, Rotary
from megactx.model.moe import MLP, MoE, Router
from megactx.model.mtp import MTPLayer
from megactx.model.paged import (
    KernelOps,
    OutputRows,
    PagedBatch,
    PagedLayerCache,
    alloc_caches,
    kernel_ops,
    resolve_cache_dtype,
)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, has_indexer=cfg.indexer_types[i] == "full") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    # Modules whose parameters stay fp32 in a bf16 model, as in the published checkpoints.
    FP32_PARAMS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + j) for j in range(cfg.num_nextn_predict_layers))
        self.rotary = Rotary(cfg)
        self.backend = "torch"  # what forward() runs: the reference, or the paged Triton path
        self.kv_cache_dtype = self.index_cache_dtype = "auto"  # caches of the paged forward
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- configuration of the reference computation --------------------------------------
    def set_attention(self, absorbed: bool | None = None, indexer_fp8: bool | None = None) -> None:
        """Pick the MLA form (naive / absorbed) and the indexer (exact / FP8-simulated)."""
        for attn in self.attention_modules():
            if absorbed is not None:
                attn.absorbed = absorbed
            if indexer_fp8 is not None:
                attn.indexer_fp8 = indexer_fp8

    def set_backend(self, backend: str, kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto") -> None:
        """backend "torch": forward() is the dense reference; "triton": forward() runs the paged path
        through the Triton kernels, with caches of the given dtypes ("auto" = the model's dtype,
        exact; "bf16", "fp32", "fp8")."""
        kernel_ops(backend)  # refuses unknown names
        for name in (kv_cache_dtype, index_cache_dtype):
            resolve_cache_dtype(name, torch.float32)  # refuses unknown names
        self.backend, self.kv_cache_dtype, self.index_cache_dtype = backend, kv_cache_dtype, index_cache_dtype

    def attention_modules(self):
        return [layer.self_attn for layer in [*self.model.layers, *self.mtp]]

    def fuse_projections(self) -> int:
        """For inference: linears that read the same input become one GEMM each (MLA's q_a / kv_a /
        indexer wk, an MLP's gate / up), their weights views of the fused ones (same values, no
        extra memory); MoE routing runs as one Triton kernel on CUDA, and a MoE whose experts run
        densely computes its shared expert as one more of them. A decode step's time is its kernel
        count on a small model. Returns the GEMMs a step saves; training never calls it."""
        # modules() visits a MoE before its shared MLP, which MoE.fuse stacks first
        return sum(m.fuse() for m in self.modules() if isinstance(m, (MLA, MoE, MLP, Router)))

    def cast(self, dtype: torch.dtype) -> Transformer:
        """Cast floating parameters to dtype, keeping router and indexer head weights in fp32."""
        for name, p in self.named_parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if name.endswith(self.FP32_PARAMS) else dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # -- forward ---------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      caches: list[LayerCache] | None = None, rows: OutputRows | None = None) -> torch.Tensor:
        """input_ids: [B, S] -> final-normed hidden states [B, S, D].

        positions: [B or 1, S] (default 0..S-1). caches: one LayerCache per layer to extend
        (tokens before input_ids), or None for a cache-free forward; or one PagedLayerCache per
        layer for a paged forward, where input_ids [1, T] are the batch's tokens flattened and
        positions [1, T] must be given. rows (paged): the rows whose hidden states are wanted,
        -> [1, R, D]; the last layer computes only them past writing every row's KV."""
        B, S = input_ids.shape
        if caches is not None and isinstance(caches[0], PagedLayerCache) and positions is None:
            raise ValueError("a paged forward needs the tokens' positions")
        if positions is None:
            start = caches[0].length if caches else 0
            positions = torch.arange(start, start + S, device=input_ids.device)[None]
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        topk_of: dict[int, torch.Tensor] = {}  # full layer -> its top-k, reused by shared layers
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            src = self.cfg.topk_source(i)
            cache = caches[i] if caches is not None else None
            x, topk_of[src] = layer(x, cos, sin, positions, topk_of.get(src), cache, rows=rows if i == last else None,
                                    in_place=True)  # x: the embedding's output, then the layers'; ours
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, S] int -> logits [B, S, vocab] fp32: the reference forward, no cache, or
        (backend "triton") a one-shot paged forward of the B prompts."""
        if self.backend == "torch":
            return self.compute_logits(self.hidden_states(input_ids))
        return self.forward_paged_prompts(input_ids, kernel_ops(self.backend))

    def forward_paged_prompts(self, input_ids: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """input_ids: [B, S] -> logits [B, S, vocab] fp32, by prefilling the B prompts into fresh
        paged caches (kv_cache_dtype / index_cache_dtype) through `ops`: the paged path end to end."""
        B, S = input_ids.shape
        blocks = -(-S // ref.BLOCK_SIZE)
        kv_dtype = resolve_cache_dtype(self.kv_cache_dtype, self.dtype)
        index_dtype = resolve_cache_dtype(self.index_cache_dtype, self.dtype)
        caches = alloc_caches(self.cfg, B * blocks, kv_dtype, index_dtype, input_ids.device)
        tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(B)]
        batch = PagedBatch.build(tables, [0] * B, [S] * B, input_ids.device)
        layers = [PagedLayerCache(kv, index, batch, ops) for kv, index in caches[: self.cfg.num_hidden_layers]]
        hidden = self.hidden_states(input_ids.reshape(1, B * S), batch.positions[None], layers)
        return self.compute_logits(hidden).view(B, S, -1)


@torch.no_grad()
def init_weights(model: Transformer, std: float = 0.02, seed: int | None = None) -> Transformer:
    """Random init for tests and demos: normal(0, std) matrices, unit norms, zero biases."""
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            p.zero_()
        elif p.dim() == 1:  # RMSNorm / LayerNorm scales
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
