"""The per-token FLOPs / KV-bytes model against GLM-5.2's published IndexShare figures."""

import argparse
import json

import pytest

from megactx.analysis.flops import (
    FLOP_BUCKETS,
    add_flops_parser,
    format_table,
    parse_context,
    run_flops,
    to_json,
    token_cost,
)
from megactx.config import ModelConfig

M = 1024 * 1024


@pytest.fixture(scope="module")
def glm52() -> ModelConfig:
    return ModelConfig.from_pretrained("glm-5.2")


@pytest.fixture(scope="module")
def glm51() -> ModelConfig:
    return ModelConfig.from_pretrained("glm-5.1")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megactx")
    add_flops_parser(parser.add_subparsers(dest="command"))
    return run_flops(parser.parse_args(["flops", *argv]))


def test_indexshare_ratio_at_1m_matches_published_2_9x(glm52, glm51):
    ratio = token_cost(glm51, M).flops["total"] / token_cost(glm52, M).flops["total"]
    assert ratio == pytest.approx(2.9, rel=0.10)


@pytest.mark.parametrize("preset", ["glm-5.2", "glm-5.1"])
def test_both_models_cost_about_a_tenth_of_a_tflop_at_32k(preset):
    total = token_cost(ModelConfig.from_pretrained(preset), 32 * 1024).flops["total"]
    assert 0.08e12 <= total <= 0.13e12


def test_indexshare_keeps_21_indexers_of_78(glm52, glm51):
    c52, c51 = token_cost(glm52, 4096), token_cost(glm51, 4096)
    assert (c52.num_indexers, c52.num_layers) == (21, 78)
    assert (c51.num_indexers, c51.num_layers) == (78, 78)
    assert c52.num_layers - c52.num_indexers == 57
    # per key, the indexer work is proportional to the number of indexers
    per_key_52 = token_cost(glm52, 8192).flops["indexer"] - c52.flops["indexer"]
    per_key_51 = token_cost(glm51, 8192).flops["indexer"] - c51.flops["indexer"]
    assert per_key_51 * 21 == per_key_52 * 78


def test_kv_bytes_per_layer_match_cache_layouts(glm52, glm51):
    kv52, kv51 = token_cost(glm52, 1).kv_bytes, token_cost(glm51, 1).kv_bytes
    assert kv52["mla_bf16"] == 78 * 1152
    assert kv52["mla_fp8"] == 78 * 656
    assert kv52["indexer"] == 21 * 132
    assert kv51["indexer"] == 78 * 132
    for kv in (kv52, kv51):
        assert kv["total_bf16"] == kv["mla_bf16"] + kv["indexer"]
        assert kv["total_fp8"] == kv["mla_fp8"] + kv["indexer"]


def test_fp8_kv_bytes_round_scales_up_for_ragged_latent(glm52):
    cfg = glm52.replace(kv_lora_rank=320)  # 2.5 scale blocks -> 3 fp32 scales
    assert token_cost(cfg, 1).kv_bytes["mla_fp8"] == 78 * (320 + 4 * 3 + 2 * 64)


@pytest.mark.parametrize("preset", ["glm-5.2", "glm-5.1", "tiny"])
def test_indexer_grows_linearly_and_attention_is_flat_beyond_topk(preset):
    cfg = ModelConfig.from_pretrained(preset)
    topk = cfg.index_topk
    c1, c2, c4 = (token_cost(cfg, n * topk) for n in (1, 2, 4))
    step = c2.flops["indexer"] - c1.flops["indexer"]
    assert step > 0
    assert c4.flops["indexer"] - c2.flops["indexer"] == 2 * step
    assert c1.flops["attention"] == c2.flops["attention"] == c4.flops["attention"]
    # below top-k, sparse attention reads every key, so it still grows
    assert token_cost(cfg, topk // 2).flops["attention"] < c1.flops["attention"]
    assert c1.flops["mlp"] == c4.flops["mlp"] and c1.flops["head"] == c4.flops["head"]


@pytest.mark.parametrize("context", [1, 2048, 32 * 1024, M])
def test_total_is_sum_of_buckets(glm52, context):
    flops = token_cost(glm52, context).flops
    assert set(flops) == {*FLOP_BUCKETS, "total"}
    assert flops["total"] == sum(flops[k] for k in FLOP_BUCKETS)


def test_head_and_mlp_buckets_by_hand(glm52):
    flops = token_cost(glm52, 1).flops
    assert flops["head"] == 2 * 6144 * 154880
    dense = 3 * 6144 * 12288
    moe = 6144 * 256 + (8 + 1) * 3 * 6144 * 2048
    assert flops["mlp"] == 2 * (3 * dense + 75 * moe)


def test_parse_context_suffixes_and_integers():
    assert parse_context("32k,128k,1m") == [32768, 131072, 1048576]
    assert parse_context(" 4096 , 2K,1M ") == [4096, 2048, M]


@pytest.mark.parametrize("bad", ["", "32k,", "1.5k", "abc", "0", "-5", "10g", "k"])
def test_parse_context_rejects_bad_items(bad):
    with pytest.raises(ValueError, match="bad context length"):
        parse_context(bad)


def test_parse_context_error_names_the_bad_item():
    with pytest.raises(ValueError, match="'12q'"):
        parse_context("32k,12q,1m")


def test_negative_context_is_refused(glm52):
    with pytest.raises(ValueError, match="context"):
        token_cost(glm52, -1)


def test_json_has_numeric_total_per_context(glm52, glm51):
    contexts = [32768, M]
    results = {"glm-5.2": [token_cost(glm52, n) for n in contexts],
               "glm-5.1": [token_cost(glm51, n) for n in contexts]}
    data = json.loads(json.dumps(to_json(results)))
    assert list(data) == ["glm-5.2", "glm-5.1"]
    for rows in data.values():
        assert [r["context"] for r in rows] == contexts
        for r in rows:
            assert isinstance(r["flops"]["total"], (int, float))
            assert r["flops"]["total"] == sum(r["flops"][k] for k in FLOP_BUCKETS)
            assert r["kv_bytes_per_token"]["total_fp8"] > 0


def test_table_reports_ratio_and_indexers(glm52, glm51):
    results = {"glm-5.2": [token_cost(glm52, M)], "glm-5.1": [token_cost(glm51, M)]}
    text = format_table(results)
    assert "glm-5.1 / glm-5.2 FLOPs per token at 1M: 2.74x" in text
    assert "glm-5.2: 21 indexers of 78 layers (IndexShare removes 57)" in text


def test_cli_prints_table(capsys):
    assert _cli([]) == 0
    out = capsys.readouterr().out
    for label in ("32K", "128K", "1M", "GFLOP", "TFLOP", "KB/tok"):
        assert label in out
    assert "glm-5.1 / glm-5.2 FLOPs per token at 1M:" in out
    assert "IndexShare removes 57" in out


def test_cli_json(capsys):
    assert _cli(["--model", "glm-5.2,tiny", "--context", "1k,64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"glm-5.2", "tiny"}
    assert [r["context"] for r in data["tiny"]] == [1024, 64]
    assert all(isinstance(r["flops"]["total"], int) for r in data["glm-5.2"])


def test_cli_accepts_checkpoint_dir(tmp_path, capsys):
    ModelConfig.from_pretrained("tiny").save(tmp_path)
    assert _cli(["--model", str(tmp_path), "--context", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[str(tmp_path)][0]["num_indexers"] == 4


@pytest.mark.parametrize("argv, needle", [
    (["--model", "no-such-model"], "no-such-model"),
    (["--context", "32k,huge"], "'huge'"),
])
def test_cli_bad_input_is_one_line_error_and_exit_2(argv, needle, capsys):
    assert _cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err and captured.err.count("\n") == 1
