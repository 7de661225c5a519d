import json

import pytest

from megactx import ConfigError, ModelConfig
from megactx.config import PRESETS


def test_glm52_preset_has_21_full_layers_of_78():
    cfg = ModelConfig.from_pretrained("glm-5.2")
    assert cfg.num_hidden_layers == 78
    assert cfg.full_layers == [0, 1, 2] + list(range(6, 78, 4))
    assert len(cfg.full_layers) == 21
    assert cfg.index_share_for_mtp_iteration and cfg.num_nextn_predict_layers == 1
    assert cfg.kv_cache_dim == 576 and cfg.rope_theta == 8_000_000


def test_glm51_preset_indexes_every_layer():
    cfg = ModelConfig.from_pretrained("glm-5.1")
    assert cfg.full_layers == list(range(78))


def test_freq_offset_rule_matches_the_published_indexer_types():
    published = json.loads(PRESETS["glm-5.2"].read_text())
    raw = {k: v for k, v in published.items() if k != "indexer_types"}
    assert ModelConfig.from_dict(raw).indexer_types == published["indexer_types"]


def test_shared_layer_takes_topk_from_nearest_full_layer_below():
    cfg = ModelConfig.from_pretrained("tiny").replace(num_hidden_layers=6, index_topk_pattern="FSFSSF")
    assert [cfg.topk_source(i) for i in range(6)] == [0, 0, 2, 2, 2, 5]


def test_pattern_string_sets_indexer_types():
    cfg = ModelConfig.from_pretrained("tiny").replace(index_topk_pattern="FSSSFSSS")
    assert cfg.indexer_types == ["full", "shared", "shared", "shared"] * 2


def test_dict_round_trip_keeps_every_field():
    cfg = ModelConfig.from_pretrained("glm-5.2")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_legacy_rope_scaling_is_read_as_yarn():
    raw = ModelConfig.from_pretrained("tiny").to_dict()
    raw.pop("rope_parameters")
    raw.update(rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                               "mscale": 1.0, "mscale_all_dim": 1.0})
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 40
    assert cfg.softmax_scale > cfg.qk_head_dim**-0.5  # mscale^2 folded into the attention scale


def test_deepseek_v32_has_an_indexer_in_every_layer():
    raw = ModelConfig.from_pretrained("tiny").to_dict()
    raw.update(model_type="deepseek_v32", index_topk_freq=4)
    raw.pop("indexer_rope_interleave")  # a DeepSeek-V3.2 config does not carry it
    cfg = ModelConfig.from_dict(raw)
    assert cfg.full_layers == list(range(cfg.num_hidden_layers))
    assert cfg.indexer_rope_interleave is False


@pytest.mark.parametrize("change, field", [
    (dict(model_type="llama"), "model_type"),
    (dict(indexer_types=["full", "shared"]), "indexer_types"),
    (dict(indexer_types=["shared"] + ["full"] * 7), "indexer_types[0]"),
    (dict(index_topk_pattern="FSX"), "index_topk_pattern"),
    (dict(index_topk_pattern="FSSSFSSS", indexer_types=["full"] * 8), "index_topk_pattern"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config.quant_method"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "rope_type"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types"),
])
def test_inconsistent_config_is_refused_naming_the_field(change, field):
    raw = ModelConfig.from_pretrained("tiny").to_dict()
    raw.update(change)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(raw)


def test_unknown_path_explains_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="preset"):
        ModelConfig.from_pretrained(tmp_path / "nope")


def test_invalid_json_is_reported(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_overrides_merge_nested_fields_and_refuse_unknown_names(tmp_path):
    from megactx.config import apply_overrides, describe_overrides, parse_overrides

    raw = ModelConfig.from_pretrained("tiny").to_dict()
    factor = 16.0
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": factor, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_pretrained(tmp_path, {"rope_parameters": {"factor": 2 * factor}, "index_topk": 512})
    assert cfg.rope_parameters == {**raw["rope_parameters"], "factor": 2 * factor}  # the other yarn fields kept
    assert cfg.index_topk == 512 and raw["index_topk"] != 512  # the checkpoint's dict untouched
    assert cfg.softmax_scale > ModelConfig.from_dict(raw).softmax_scale  # YaRN's mscale follows the factor
    # `rope_scaling` (the older name) lands where the checkpoint keeps its rope, and so does rope_theta
    assert apply_overrides(raw, {"rope_scaling": {"factor": 8}})["rope_parameters"]["factor"] == 8
    assert ModelConfig.from_dict(apply_overrides(raw, {"rope_theta": 5e5})).rope_theta == 5e5
    legacy = {**{k: v for k, v in raw.items() if k != "rope_parameters"}, "rope_scaling": raw["rope_parameters"]}
    assert ModelConfig.from_dict(apply_overrides(legacy, {"rope_parameters": {"factor": 8}})).rope_parameters[
        "factor"] == 8
    with pytest.raises(ConfigError, match="unknown field 'index_top_k'; did you mean 'index_topk'"):
        apply_overrides(raw, {"index_top_k": 512})
    with pytest.raises(ConfigError, match="not valid JSON.*factor"):
        parse_overrides("{rope_parameters: 1}")
    with pytest.raises(ConfigError, match="JSON object"):
        parse_overrides("[1]")
    assert describe_overrides({"rope_parameters": {"factor": 32}, "index_topk": 512}) == (
        "rope_parameters.factor=32, index_topk=512")
    assert describe_overrides(None) == ""
