"""The training-free IndexShare search: its greedy rounds against losses measured on independently
built shared-layer models (no indexer weights, cfg from the pattern), the exact no-op of flipping a
layer whose attention output is zero, the stopping rules (target full layers, loss budget), and
`megactx indexshare-search` end to end (the written checkpoint loads with strict load_model and
reproduces the reported loss).

Models are micro (hidden 48, 4 layers, all full, top-k 8 under 32-token sequences so that
selection is real), drawn at std 0.2 so that different top-k sets change the loss well above fp32
rounding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megactx import ModelConfig, load_model
from megactx.cli import main
from megactx.model import build_model, init_weights, save_pretrained
from megactx.train.indexshare_search import (
    FULL,
    REPORT_JSON,
    REPORT_MD,
    calibration_loss,
    default_num_full,
    flip,
    indexshare_search,
    pattern_of,
    random_calibration,
    set_pattern,
    uniform_pattern,
    write_checkpoint,
)
from megactx.train.recipe import adapt_model

VOCAB = 64
SEQ_LEN = 32
NUM_SEQUENCES = 3
INIT_STD = 0.2
SAME_COMPUTATION_ATOL = 1e-5  # one model vs another holding the same weights: identical ops


# tiny models on a shared CPU: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def micro_config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, index_n_heads=4, index_head_dim=32, index_topk=8, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, index_topk_pattern="FFFF", max_position_embeddings=128, num_nextn_predict_layers=0,
        eos_token_id=[0])
    fields.update(overrides)
    return ModelConfig.from_pretrained("tiny").replace(**fields)


def micro_model(seed: int = 0, **overrides):
    return init_weights(build_model(micro_config(**overrides)), std=INIT_STD, seed=seed)


def independent_loss(model, pattern: str, sequences: torch.Tensor) -> float:
    """The loss of `pattern` on a separately built model of that architecture: shared layers
    without indexer weights, routing derived by ModelConfig from the pattern."""
    shared_model = adapt_model(model, model.cfg.replace(index_topk_pattern=pattern))
    assert pattern_of(shared_model.cfg) == pattern
    with torch.no_grad():
        logits = shared_model(sequences[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), sequences[:, 1:].flatten()).item()


def test_uniform_pattern_is_glm_5_2_rule():
    glm = ModelConfig.from_pretrained("glm-5.2")
    assert uniform_pattern(glm.num_hidden_layers) == pattern_of(glm)
    assert default_num_full(glm.num_hidden_layers) == len(glm.full_layers) == 21


def test_greedy_rounds_match_losses_of_independently_built_models():
    model = micro_model()
    sequences = random_calibration(VOCAB, NUM_SEQUENCES, SEQ_LEN)
    result = indexshare_search(model, sequences, num_full=1, progress=False)

    assert result.start_loss == pytest.approx(independent_loss(model, "FFFF", sequences), abs=SAME_COMPUTATION_ATOL)
    pattern = "FFFF"
    for r in result.rounds:
        # every remaining full layer but 0 was tried, each at its own architecture's loss
        full = [i for i, c in enumerate(pattern) if c == FULL and i > 0]
        assert sorted(r.candidates) == full
        brute = {i: independent_loss(model, flip(pattern, i), sequences) for i in full}
        for i in full:
            assert r.candidates[i] == pytest.approx(brute[i], abs=SAME_COMPUTATION_ATOL)
        assert r.flipped == min(brute, key=brute.get)
        pattern = flip(pattern, r.flipped)
        assert r.pattern == pattern
        assert r.loss == r.candidates[r.flipped]
    assert result.pattern == "FSSS" and len(result.rounds) == 3
    assert "reached 1 full" in result.stop_reason
    # the model is left as it was given
    assert pattern_of(model.cfg) == "FFFF"


def test_losses_really_differ_between_patterns():
    """Guards the other tests against a vacuous setup (top-k selecting every key)."""
    model = micro_model()
    sequences = random_calibration(VOCAB, NUM_SEQUENCES, SEQ_LEN)
    result = indexshare_search(model, sequences, num_full=3, progress=False)
    losses = [result.start_loss, *result.rounds[0].candidates.values()]
    assert max(losses) - min(losses) > 100 * SAME_COMPUTATION_ATOL


def test_flipping_a_layer_whose_attention_output_is_zero_leaves_the_loss_unchanged():
    model = micro_model()
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()  # its top-k cannot matter
    sequences = random_calibration(VOCAB, NUM_SEQUENCES, SEQ_LEN)
    result = indexshare_search(model, sequences, num_full=3, progress=False)
    assert result.rounds[0].candidates[2] == result.start_loss
    assert result.rounds[0].candidates[1] != result.start_loss


def test_default_target_and_no_op_when_already_sparse():
    model = micro_model()
    sequences = random_calibration(VOCAB, 1, SEQ_LEN)
    result = indexshare_search(model, sequences, progress=False)
    assert result.num_full == default_num_full(4) == uniform_pattern(4).count(FULL)
    assert result.pattern.count(FULL) == result.num_full
    assert result.uniform_loss == pytest.approx(independent_loss(model, uniform_pattern(4), sequences),
                                                abs=SAME_COMPUTATION_ATOL)
    again = indexshare_search(micro_model(index_topk_pattern="FSFS"), sequences, num_full=2, progress=False)
    assert again.rounds == [] and again.pattern == "FSFS" and "not more than the target 2" in again.stop_reason
    assert again.uniform_loss is None  # FFFS needs layer 1's indexer, which FSFS has not
    mine = indexshare_search(model, sequences, num_full=2, progress=False, compare=["FSFS", "FFSS"])
    assert mine.uniform_pattern == uniform_pattern(4) and mine.uniform_loss == result.uniform_loss
    assert list(mine.compared) == ["FSFS", "FFSS"]
    for pattern, loss in mine.compared.items():
        assert loss == pytest.approx(independent_loss(model, pattern, sequences), abs=SAME_COMPUTATION_ATOL)
    assert "| compared | - | 2 |" in mine.table() and "`FFSS`" in mine.table()
    sparse = indexshare_search(micro_model(index_topk_pattern="FSFS"), sequences, num_full=2, progress=False,
                               compare=["FFSS"])
    assert sparse.compared == {"FFSS": None}  # layer 1 has no indexer there
    with pytest.raises(ValueError, match="compare"):
        indexshare_search(model, sequences, progress=False, compare=["SFSF"])


def test_loss_budget_stops_before_the_first_flip_over_budget():
    model = micro_model(seed=3)  # a seed whose last greedy flip raises the loss above the start
    sequences = random_calibration(VOCAB, NUM_SEQUENCES, SEQ_LEN, seed=3)
    free = indexshare_search(model, sequences, num_full=1, progress=False)
    rises = [r.loss - free.start_loss for r in free.rounds]
    budget = max(rises[0], 0.0)
    over = next((k for k, d in enumerate(rises) if d > budget), len(rises))
    assert over < len(rises), "the setup must have a round over budget"
    capped = indexshare_search(model, sequences, num_full=1, loss_budget=budget, progress=False)
    assert capped.rounds == free.rounds[:over]
    assert "loss budget" in capped.stop_reason


def test_bad_arguments_are_refused_with_their_names():
    model = micro_model(index_topk_pattern="FSFS")
    sequences = random_calibration(VOCAB, 1, SEQ_LEN)
    with pytest.raises(ValueError, match="num_full"):
        indexshare_search(model, sequences, num_full=0, progress=False)
    with pytest.raises(ValueError, match="loss_budget"):
        indexshare_search(model, sequences, loss_budget=-1.0, progress=False)
    with pytest.raises(ValueError, match="sequences"):
        indexshare_search(model, sequences[0], progress=False)
    with pytest.raises(ValueError, match="no indexer weights"):
        set_pattern(model, "FFFS")
    with pytest.raises(ValueError, match="layer 0"):
        flip("FSFS", 0)
    with pytest.raises(ValueError, match="model_type"):
        write_checkpoint(model.__class__(model.cfg.replace(model_type="deepseek_v32")), "FFFF", "unused")


def test_cli_writes_a_checkpoint_that_loads_and_reproduces_the_reported_loss(tmp_path, capsys):
    model = micro_model()
    save_pretrained(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")  # copied along, not parsed
    out = tmp_path / "searched"
    rc = main(["indexshare-search", "--model", str(tmp_path / "ckpt"), "--out", str(out), "--num-full", "2",
               "--seq-len", str(SEQ_LEN), "--num-sequences", str(NUM_SEQUENCES), "--device", "cpu",
               "--no-progress"])
    assert rc == 0
    report = json.loads((out / REPORT_JSON).read_text())
    md = (out / REPORT_MD).read_text()
    assert "| uniform |" in md
    assert report["pattern"].count(FULL) == 2 and len(report["rounds"]) == 2
    for layer, loss in report["rounds"][0]["candidates"].items():  # each layer shared alone
        assert f"| {layer} | {loss:.4f} | {loss - report['start_loss']:+.4f} |" in md
    assert report["calibration"]["num_sequences"] == NUM_SEQUENCES and report["calibration"]["seq_len"] == SEQ_LEN
    assert report["pattern"] in capsys.readouterr().out

    cfg = ModelConfig.from_pretrained(out)
    assert cfg.index_topk_pattern == report["pattern"] == pattern_of(cfg)
    loaded = load_model(out, dtype=torch.float32)  # strict: flipped layers carry no indexer tensors
    has_indexer = [layer.self_attn.indexer is not None for layer in loaded.model.layers]
    assert has_indexer == [c == FULL for c in cfg.index_topk_pattern]
    sequences = random_calibration(VOCAB, NUM_SEQUENCES, SEQ_LEN)
    assert calibration_loss(loaded, sequences) == pytest.approx(report["loss"], abs=SAME_COMPUTATION_ATOL)
    assert (out / "tokenizer.json").read_text() == "{}"


def test_cli_calibrates_on_the_held_out_split_of_a_data_dir(tmp_path):
    from megactx.train.corpus import Corpus
    from megactx.train.data import CORPUS_SNAPSHOT, prepare_data
    from megactx.train.needles import NeedleDataset

    stdlib = Corpus.from_stdlib()
    small = stdlib.subset([f.path for f in stdlib.split("held_out")[:2]] + [f.path for f in stdlib.split("train")[:4]])
    small.save_snapshot(tmp_path / "data" / CORPUS_SNAPSHOT)
    data_vocab = 300  # a byte-level BPE needs at least its 256 byte tokens
    seq_len = 256  # room for every needle task's haystack
    prepare_data(tmp_path / "data", vocab_size=data_vocab)
    save_pretrained(micro_model(vocab_size=data_vocab), tmp_path / "ckpt")
    data = prepare_data(tmp_path / "data", vocab_size=data_vocab)
    held_out = data.pretraining_sequences(seq_len, "held_out")[:2]
    tasks = NeedleDataset(data.needles("held_out"), seq_len, num_examples=2)
    needles = [tasks[i] for i in range(2)]
    for extra in (["--needles", "0"], []):  # code only; code and (by default as many) needle tasks
        out = tmp_path / f"searched{len(extra)}"
        rc = main(["indexshare-search", "--model", str(tmp_path / "ckpt"), "--out", str(out), "--num-full", "3",
                   "--data-dir", str(tmp_path / "data"), "--seq-len", str(seq_len), "--num-sequences", "2",
                   "--device", "cpu", "--no-progress", *extra])
        assert rc == 0
        report = json.loads((out / REPORT_JSON).read_text())
        loaded = load_model(out, dtype=torch.float32)
        want = calibration_loss(loaded, held_out)
        if not extra:  # plus the answers' loss alone
            assert report["calibration"]["needle_tasks"] == 2
            answers = torch.stack([n["loss_mask"] for n in needles])
            assert 0 < answers.sum() < 20
            want += calibration_loss(loaded, torch.stack([n["input_ids"] for n in needles]), mask=answers)
        assert want == pytest.approx(report["loss"], abs=SAME_COMPUTATION_ATOL)


def test_cli_help_and_refusals(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["indexshare-search", "--help"])
    assert exit_info.value.code == 0
    assert "--num-full" in capsys.readouterr().out
    rc = main(["indexshare-search", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o"),
               "--device", "cpu", "--no-progress"])
    assert rc == 2 and "error" in capsys.readouterr().err
    save_pretrained(micro_model(), tmp_path / "ckpt")
    rc = main(["indexshare-search", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o"),
               "--data-dir", str(tmp_path / "no-data"), "--device", "cpu", "--no-progress"])
    assert rc == 2 and "--data-dir" in capsys.readouterr().err
    assert not (tmp_path / "no-data").exists()


@pytest.mark.gpu
def test_search_through_the_triton_paged_path_matches_the_reference_losses():
    """On the GPU the search may measure losses through the paged Triton forward (--backend triton):
    every candidate's loss must agree with the reference forward of the same pattern."""
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=512, index_topk_pattern="F" * 8,
                                                      num_nextn_predict_layers=0)
    model = init_weights(build_model(cfg, device="cuda"), std=INIT_STD, seed=0)
    seq_len = 4 * cfg.index_topk  # so that selection is real
    sequences = random_calibration(cfg.vocab_size, 2, seq_len)
    model.set_backend("triton")
    result = indexshare_search(model, sequences, num_full=5, progress=False)
    model.set_backend("torch")
    pattern = result.start_pattern
    for r in result.rounds:
        for layer, loss in r.candidates.items():
            set_pattern(model, flip(pattern, layer))
            assert loss == pytest.approx(calibration_loss(model, sequences), rel=2e-2)
        pattern = r.pattern
