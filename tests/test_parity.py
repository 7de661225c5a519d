"""The reference model equals transformers' own GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM.

Each case builds a tiny random model with transformers (fp32, eager), saves it, loads it with
`load_model`, and compares logits (max abs difference <= 1e-4) in both MLA forms."""

import pytest
import torch

from hf_models import CASES, hf_model
from megactx import load_model
from megactx.model import save_pretrained

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    ref_model = hf_model(model_type, seed=len(case), **overrides)
    ref_model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)

    torch.manual_seed(1)
    input_ids = torch.randint(0, ref_model.config.vocab_size, (3, 24))
    with torch.no_grad():
        ref = ref_model(input_ids).logits
        for absorbed in (False, True):
            ours.set_attention(absorbed=absorbed)
            out = ours(input_ids)
            assert out.shape == ref.shape
            assert (out - ref).abs().max().item() <= 1e-4, f"absorbed={absorbed}"
    assert ref.std() > 0.3, "logits too small for the comparison to mean anything"


def test_topk_selection_changes_the_output(tmp_path):
    """Guard against a vacuous parity test: with top-k below the sequence, dropping the indexer
    (attending to every key) must move the logits far beyond the 1e-4 tolerance."""
    ref_model = hf_model("glm_moe_dsa", index_topk=4)
    ref_model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    input_ids = torch.randint(0, 97, (2, 24))
    sparse = ours(input_ids)
    for attn in ours.attention_modules():
        if attn.indexer is not None:
            attn.indexer.topk = 10**6
    assert (ours(input_ids) - sparse).abs().max() > 1e-2


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_transformers_loads_what_we_save(model_type, tmp_path):
    ref_model = hf_model(model_type, index_topk_freq=2, index_skip_topk_offset=1)
    ref_model.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=40_000)  # several shards + index
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    cls = type(ref_model)
    reloaded = cls.from_pretrained(tmp_path / "ours", attn_implementation="eager").float().eval()
    input_ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert (reloaded(input_ids).logits - ref_model(input_ids).logits).abs().max() <= 1e-5


def test_transformers_loads_our_checkpoint_with_an_mtp_layer(tmp_path):
    """The MTP layer sits at checkpoint index num_hidden_layers, which transformers' backbone skips."""
    from megactx import ModelConfig
    from megactx.model import build_model

    # 16 indexer heads: no exact-zero ties in the top-k (see hf_models.hf_model)
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=128, index_topk=16, index_n_heads=16)
    ours = build_model(cfg, seed=1)
    save_pretrained(ours, tmp_path)
    theirs = transformers.GlmMoeDsaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    input_ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        assert (theirs(input_ids).logits - ours(input_ids)).abs().max() <= 1e-4
