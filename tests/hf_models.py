"""Tiny random transformers models (GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM) for parity tests."""

from __future__ import annotations

import torch

BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=24, index_n_heads=4, index_head_dim=16, index_topk=8,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1, rms_norm_eps=1e-5,
    max_position_embeddings=4096, tie_word_embeddings=False,
)


def hf_model(model_type: str = "glm_moe_dsa", seed: int = 0, **overrides):
    """A transformers model in fp32 with eager attention and every parameter randomised at a
    scale where routing, top-k selection and logits all matter."""
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
