"""Checkpoint I/O: sharded and single-file safetensors, the FP8 block format, the MTP layer at
index num_hidden_layers, and clear reports of missing / unexpected tensors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megactx import ModelConfig, load_model
from megactx.model import CheckpointError, build_model, draft, save_pretrained
from megactx.model.quant import FP8, dequantize_blocks, quantize_blocks


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=300)
    return build_model(cfg, seed=3)


def ids(seqlen=24, seed=0):
    return torch.randint(0, 300, (2, seqlen), generator=torch.Generator().manual_seed(seed))


def all_keys(directory):
    keys = {}
    for f in directory.glob("*.safetensors"):
        with safe_open(f, framework="pt") as fh:
            keys.update({k: fh.get_slice(k).get_dtype() for k in fh.keys()})
    return keys


@pytest.mark.parametrize("shard_bytes", [1 << 40, 2_000_000])
def test_save_then_load_is_exact(tiny, tmp_path, shard_bytes):
    save_pretrained(tiny, tmp_path, max_shard_bytes=shard_bytes)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (shard_bytes < 1 << 40)
    loaded = load_model(tmp_path)
    assert torch.equal(loaded(ids()), tiny(ids()))
    assert torch.equal(draft(loaded, ids(), 3).tokens, draft(tiny, ids(), 3).tokens)


def test_mtp_layer_is_checkpoint_layer_num_hidden_layers(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    keys = all_keys(tmp_path)
    n = tiny.cfg.num_hidden_layers
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.indexer.wk.weight", "mlp.experts.0.gate_proj.weight"):
        assert f"model.layers.{n}.{name}" in keys
    assert not any(k.startswith("mtp.") for k in keys)


def test_mtp_copies_of_shared_tensors_are_accepted(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    n = tiny.cfg.num_hidden_layers
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors")
    assert torch.equal(load_model(tmp_path)(ids()), tiny(ids()))


def test_fp8_block_format_round_trip(tiny, tmp_path):
    save_pretrained(tiny, tmp_path, quantize="fp8")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    keys = all_keys(tmp_path)
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert keys[q_b] == "F8_E4M3" and keys[q_b + "_scale_inv"] == "F32"
    with safe_open(tmp_path / "model.safetensors", framework="pt") as fh:
        out_f, in_f = fh.get_slice(q_b).get_shape()
        assert fh.get_slice(q_b + "_scale_inv").get_shape() == [-(-out_f // 128), -(-in_f // 128)]
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.4.mlp.gate.weight",
                 "model.layers.0.self_attn.indexer.weights_proj.weight", "model.layers.8.eh_proj.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert keys[kept] in ("F32", "BF16") and kept + "_scale_inv" not in keys

    loaded = load_model(tmp_path)
    ref, out = tiny(ids()), loaded(ids())
    assert loaded.cfg.quantization_config is not None
    # Each dequantized weight is within e4m3's half-ulp (2^-4 of its block max) of the original ...
    for (name, w), (_, w0) in zip(loaded.named_parameters(), tiny.named_parameters()):
        assert (w - w0).abs().max() <= w0.abs().max() * 2**-4, name
    # ... and the model still computes nearly the same function (MoE routing may flip here and there).
    assert 0.95 < torch.cosine_similarity(out.flatten(), ref.flatten(), dim=0) < 1


def test_block_quantization_error_is_bounded_per_block():
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # columns of very different magnitude
    w8, scale = quantize_blocks(w)
    assert w8.dtype == FP8 and scale.shape == (3, 2)
    back = dequantize_blocks(w8, scale)
    # e4m3 keeps 3 mantissa bits: relative error of a value near its block max is <= 2^-4
    for (r, c) in [(0, 0), (2, 1)]:
        block = (slice(128 * r, 128 * (r + 1)), slice(128 * c, 128 * (c + 1)))
        assert (back[block] - w[block]).abs().max() <= w[block].abs().max() * 2**-4


def test_missing_and_unexpected_tensors_are_named(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.3.self_attn.kv_b_proj.weight"]
    tensors["model.layers.3.self_attn.indexer.wk.weight"] = torch.zeros(64, 256)  # layer 3 is shared
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert "model.layers.3.self_attn.kv_b_proj.weight" in str(err.value)
    assert "model.layers.3.self_attn.indexer.wk.weight" in str(err.value)
    model = load_model(tmp_path, strict=False)  # loads the rest
    assert torch.equal(model.model.layers[0].self_attn.q_a_proj.weight, tiny.model.layers[0].self_attn.q_a_proj.weight)


def test_shape_mismatch_is_named(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(7,\)"):
        load_model(tmp_path)


def test_bf16_load(tiny, tmp_path):
    save_pretrained(tiny, tmp_path, dtype=torch.bfloat16)
    assert all_keys(tmp_path)["model.layers.0.self_attn.q_a_proj.weight"] == "BF16"
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.model.layers[4].mlp.gate.weight.dtype == torch.float32
    # Against fp32 compute on the same (bf16-rounded) weights. A random tiny model is chaotic: near-tied
    # expert routing flips under any rounding (rounding its weights alone moves the fp32 logits by
    # 5-8%), so one prompt's relative error ranges 5-20%; a wrong load (an unrelated model) is ~140%.
    exact = load_model(tmp_path, dtype=torch.float32)
    other = build_model(tiny.cfg, seed=4)

    def error(m):
        pairs = [(m(ids_s).float(), exact(ids_s)) for ids_s in (ids(seed=s) for s in range(4))]
        return sum(((a - b).norm() / b.norm()).item() for a, b in pairs) / len(pairs)

    with torch.no_grad():
        assert error(model) < 0.25 and error(other) > 0.8
