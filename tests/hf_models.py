"""Tiny random transformers models (GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM) for parity tests."""

from __future__ import annotations

import torch

BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=24, index_n_heads=16, index_head_dim=16, index_topk=8,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1, rms_norm_eps=1e-5,
    max_position_embeddings=4096, tie_word_embeddings=False,
)


def hf_model(model_type: str = "glm_moe_dsa", seed: int = 0, **overrides):
    """A transformers model in fp32 with eager attention and every parameter randomised at a
    scale where routing, top-k selection and logits all matter. 16 indexer heads: with few heads
    many keys score exactly 0 (every head ReLU'd away), and which tied keys fill the top-k is
    arbitrary — transformers takes torch.topk's pick, megactx the lowest positions."""
    import transformers

    kwargs = {**BASE, **overrides}
    if model_type == "glm_moe_dsa":
        config = transformers.GlmMoeDsaConfig(**kwargs)
        cls = transformers.GlmMoeDsaForCausalLM
    else:
        kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
        config = transformers.DeepseekV32Config(**kwargs)
        cls = transformers.DeepseekV32ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


# Parity cases: (model_type, config overrides) covering every IndexShare schedule, routing and rope variant.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

CASES = {
    "glm-all-full": ("glm_moe_dsa", dict(index_topk_freq=1)),
    "glm-freq2-offset1": ("glm_moe_dsa", dict(index_topk_freq=2, index_skip_topk_offset=1)),
    "glm-freq4-offset3": ("glm_moe_dsa", dict(num_hidden_layers=8, index_topk_freq=4, index_skip_topk_offset=3)),
    "glm-freq4-offset2": ("glm_moe_dsa", dict(num_hidden_layers=6, index_topk_freq=4, index_skip_topk_offset=2)),
    "glm-pattern-FSSF": ("glm_moe_dsa", dict(index_topk_pattern="FSSF")),
    "glm-pattern-FFSFSS": ("glm_moe_dsa", dict(num_hidden_layers=6, index_topk_pattern="FFSFSS")),
    "glm-topk-above-seq": ("glm_moe_dsa", dict(index_topk=64, index_topk_freq=2, index_skip_topk_offset=1)),
    "glm-all-dense": ("glm_moe_dsa", dict(first_k_dense_replace=4)),
    "glm-grouped-routing": ("glm_moe_dsa", dict(n_group=4, topk_group=2, num_experts_per_tok=3)),
    "glm-no-norm-topk": ("glm_moe_dsa", dict(norm_topk_prob=False, routed_scaling_factor=1.0)),
    "glm-yarn": ("glm_moe_dsa", dict(rope_parameters=YARN, index_topk_pattern="FSSF")),  # megactx-tiny's extension
    "dsv32-default": ("deepseek_v32", dict()),
    "dsv32-yarn-groups": ("deepseek_v32", dict(rope_parameters=YARN, n_group=4, topk_group=2)),
}
