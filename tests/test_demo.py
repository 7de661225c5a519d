"""`megactx demo`: every section runs on a checkpoint (FLOPs table, needle retrieval through the
engine, a streamed completion with and without MTP speculation, whose greedy texts agree), the text
sections are skipped without a tokenizer, the random-model demo stands in (labelled) when the
shipped model is absent, and bad flags fail with the flag named. On the shipped model, when present,
only properties are checked, never particular outputs."""

from __future__ import annotations

import re

import pytest
import torch

from megactx.cli import main
from megactx.demo import COMPLETION_PROMPT
from megactx.models import shipped_model
from megactx.testing import make_random_checkpoint
from megactx.train.evaluate import answer_budget
from megactx.train.needles import STANDARD_TASKS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["--needle-context", "512", "--max-tokens", "16", "--context", "32k"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random four-layer tiny model (indexer schedule FFFS) with a tokenizer and an MTP layer."""
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset="tiny", seed=3, vocab_size=1024,
                                  num_hidden_layers=4, first_k_dense_replace=1, dtype=torch.float32)


def _demo(capsys, *flags: str) -> tuple[int, str, str]:
    threads = [] if "--threads" in flags else ["--threads", "1"]  # the suite's workers share the cores
    code = main(["demo", *flags, *threads])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_demo_runs_every_section_on_a_checkpoint(ckpt, capsys):
    code, out, err = _demo(capsys, "--model", str(ckpt), *SMALL)
    assert code == 0, err
    assert "IndexShare removes 57" in out  # the FLOPs table
    assert "4 layers, IndexShare schedule FFFS" in out and "top-k 64" in out
    # the needle case, as `megactx eval needles` makes it: a prompt of the context less the answer budget
    n = 512 - answer_budget(STANDARD_TASKS["single"])
    assert "== Needle retrieval at 512 tokens, sparse attention ==" in out
    assert re.search(rf"hidden at token [\d,]+ of {n} \(depth 0\.\d\d\): key_[a-z]+_[a-z]+ = \"\d{{6}}\"", out)
    assert re.search(r"expected:  \d{6}\nanswer:    '.*'  ->  (correct|WRONG)\n", out)
    assert f"each query attends to at most 64 of up to {n} keys ({64 / n:.1%})" in out
    # the completion: prompt streamed, then both runs' summaries and the greedy check
    assert COMPLETION_PROMPT in out
    assert "with speculation (γ = 7): " in out and "without speculation: " in out
    acceptance = float(re.search(r"mean acceptance length (\d+\.\d+)", out).group(1))
    assert 1.0 <= acceptance <= 8.0
    assert "greedy texts identical with and without speculation: True" in out
    assert torch.get_num_threads() == 1  # the demo's --threads 1 was restored to the fixture's


def test_demo_skips_the_text_sections_without_a_tokenizer(ckpt, tmp_path, capsys):
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(ckpt / name)
    code, out, err = _demo(capsys, "--model", str(bare), *SMALL)
    assert code == 0, err
    assert "has no tokenizer.json: skipping needle retrieval and code completion" in out
    assert "Needle retrieval" not in out and "speculation" not in out


def test_demo_without_the_shipped_model_shows_a_labelled_random_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", tmp_path / "absent")
    code, out, err = _demo(capsys, "--seqlen", "80", "--context", "32k")
    assert code == 0, err
    assert "megactx-tiny model is not at" in out and "showing a RANDOM model instead" in out
    assert "Reference forward of a RANDOM tiny model" in out
    assert "top-k of layer 2" in out and "FFFSSSFS" in out
    # the engine (with and without MTP speculation) reproduces the reference's greedy tokens
    assert out.count("equal to the reference's greedy tokens: True") == 2


@pytest.mark.parametrize("flags,named", [
    (["--needle-context", "0"], "--needle-context"),
    (["--needle-context", "lots"], "--needle-context"),
    (["--needle-context", "4k,100"], "--needle-context must be at least"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens"),
    (["--threads", "0"], "--threads"),
    (["--random", "--model", "somewhere"], "--random"),
    (["--device", "tpu"], "tpu"),
])
def test_bad_flags_fail_with_the_flag_named(flags, named, capsys):
    code, out, err = _demo(capsys, *flags)
    assert code == 2 and out == ""
    assert "megactx demo: error:" in err and named in err


def test_a_needle_context_beyond_the_model_or_a_missing_model_is_refused(ckpt, tmp_path, capsys):
    code, _, err = _demo(capsys, "--model", str(ckpt), "--needle-context", "128k", "--context", "32k")
    assert code == 2 and "--needle-context 131072 exceeds the model's context of 65536 tokens" in err
    code, _, err = _demo(capsys, "--model", str(tmp_path / "missing"), "--context", "32k")
    assert code == 2 and "missing" in err and "config.json" in err
    # without --needle-context, a model shorter than the default's 64K shows a needle at its whole context
    short = make_random_checkpoint(tmp_path / "short", preset="tiny", seed=3, vocab_size=1024, num_hidden_layers=2,
                                   max_position_embeddings=768, dtype=torch.float32)
    code, out, err = _demo(capsys, "--model", str(short), "--max-tokens", "4", "--context", "32k")
    assert code == 0, err
    assert "== Needle retrieval at 768 tokens, sparse attention ==" in out


@pytest.mark.skipif(shipped_model() is None, reason="the shipped megactx-tiny model is not in models/")
def test_demo_on_the_shipped_model(capsys):
    code, out, err = _demo(capsys, "--needle-context", "512", "--max-tokens", "24", "--context", "32k")
    assert code == 0, err
    assert f"== megactx-tiny ({shipped_model()})" in out
    assert "== Needle retrieval at 512 tokens, sparse attention ==" in out
    assert re.search(r"answer:    '.*'  ->  (correct|WRONG)\n", out)
    acceptance = float(re.search(r"mean acceptance length (\d+\.\d+)", out).group(1))
    assert acceptance >= 1.0
    assert "greedy texts identical with and without speculation: True" in out


def test_by_default_the_needle_prefill_takes_every_core_and_the_rest_one(ckpt, capsys, monkeypatch):
    import megactx.demo as demo
    import megactx.generate as generate

    seen, needle_demo = [], demo.needle_demo

    def watched(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return needle_demo(*args, **kwargs)

    monkeypatch.setattr(demo, "needle_demo", watched)
    monkeypatch.setattr(generate, "usable_cores", lambda: 2)
    assert main(["demo", "--model", str(ckpt), *SMALL]) == 0, capsys.readouterr().err
    assert seen == [2] and torch.get_num_threads() == 1  # back to the fixture's one thread
    assert main(["demo", "--model", str(ckpt), *SMALL, "--threads", "1"]) == 0
    assert seen == [2, 1]
