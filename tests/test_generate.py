"""`megactx generate`: what it streams is the model's completion (checked against step-by-step
greedy decoding with the reference model), --chat / --stop / --prompt - do what they say, bad flags
fail with the flag named, and without --model it uses the shipped megactx-tiny, or where that is
absent makes, caches and announces a random checkpoint."""

from __future__ import annotations

import io

import pytest
import torch

from megactx.cli import main
from megactx.engine.tokenizer import Tokenizer
from megactx.generate import NO_TRAINED_MODEL, context_length, random_checkpoint, read_prompt, resolve_model
from megactx.model import load_model
from megactx.models import shipped_model
from megactx.testing import make_random_checkpoint

PROMPT = "def fib(n):"
TOKENS = 8


# tiny models on a shared CPU: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset="tiny", seed=1)


@pytest.fixture(scope="module")
def greedy_text(ckpt) -> str:
    """The reference model's greedy continuation of PROMPT, decoded in one go."""
    tok = Tokenizer(ckpt)
    model = load_model(ckpt)
    ids = tok.encode(PROMPT)
    out = []
    with torch.no_grad():
        for _ in range(TOKENS):
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
    return tok.decode(out)


def _generate(capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["generate", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_streams_the_greedy_completion_and_a_summary(ckpt, greedy_text, capsys):
    code, out, err = _generate(capsys, "--model", str(ckpt), "--prompt", PROMPT, "--max-tokens", str(TOKENS),
                               "--temperature", "0", "--device", "cpu")
    assert code == 0
    assert out == greedy_text + ("" if greedy_text.endswith("\n") else "\n")
    n_prompt = len(Tokenizer(ckpt).encode(PROMPT))
    summary = err.strip().splitlines()[-1]
    assert f"{TOKENS} tokens in" in summary and "tokens/s" in summary and "TTFT" in summary
    assert f"finish: length ({n_prompt} prompt tokens)" in summary
    assert NO_TRAINED_MODEL not in err  # a model was given


def test_a_stop_string_cuts_the_completion_before_it(ckpt, greedy_text, capsys):
    stop = next(c for c in greedy_text[1:] if not c.isspace())  # a character past the first that is visible
    expected = greedy_text[: greedy_text.index(stop)]
    code, out, err = _generate(capsys, "--model", str(ckpt), "--prompt", PROMPT, "--max-tokens", str(TOKENS),
                               "--temperature", "0", "--stop", stop)
    assert code == 0
    assert out.removesuffix("\n") == expected.removesuffix("\n")
    assert "finish: stop" in err


def test_chat_wraps_the_prompt_in_the_chat_template(ckpt, capsys):
    tok = Tokenizer(ckpt)
    templated = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert templated != "hello" and "hello" in templated
    code, _, err = _generate(capsys, "--model", str(ckpt), "--prompt", "hello", "--chat", "--max-tokens", "1")
    assert code == 0
    assert f"({len(tok.encode(templated))} prompt tokens)" in err


def test_prompt_dash_reads_stdin(ckpt, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\n"))
    code, _, err = _generate(capsys, "--model", str(ckpt), "--prompt", "-", "--max-tokens", "1")
    assert code == 0
    assert f"({len(Tokenizer(ckpt).encode('hello world'))} prompt tokens)" in err
    assert read_prompt("-", io.StringIO("a\n\n")) == "a\n"  # only the newline echo adds is dropped
    assert read_prompt("as given\n", io.StringIO("ignored")) == "as given\n"


@pytest.mark.parametrize("flags,named", [
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--top-k", "-3"], "--top-k"),
    (["--device", "tpu"], "--device"),
    (["--max-model-len", "1"], "--max-model-len"),
    (["--max-tokens", "100000"], "--max-tokens"),  # past the tiny model's 65536 positions
    (["--max-model-len", "8", "--max-tokens", "16"], "--max-tokens"),
    (["--threads", "0"], "--threads"),
])
def test_bad_flags_fail_with_the_flag_named(ckpt, capsys, flags, named):
    code, out, err = _generate(capsys, "--model", str(ckpt), "--prompt", PROMPT, *flags)
    assert code == 2 and out == ""
    assert "megactx generate: error:" in err and named in err


def test_bad_inputs_say_what_is_wrong(ckpt, tmp_path, capsys, monkeypatch):
    code, _, err = _generate(capsys, "--model", str(tmp_path / "missing"), "--prompt", PROMPT)
    assert code == 2 and "--model" in err and "missing" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, _, err = _generate(capsys, "--model", str(ckpt), "--prompt", "-")
    assert code == 2 and "--prompt is empty" in err
    no_template = tmp_path / "no-template"
    no_template.mkdir()
    for f in ckpt.iterdir():
        if f.name != "tokenizer_config.json":
            (no_template / f.name).symlink_to(f)
    code, _, err = _generate(capsys, "--model", str(no_template), "--prompt", PROMPT, "--chat")
    assert code == 2 and "--chat" in err and "chat template" in err


def test_context_length_fits_the_request_or_refuses_it():
    assert context_length(10, 20, model_len=100, max_model_len=None) == 30  # just the request
    assert context_length(10, 20, model_len=100, max_model_len=64) == 64
    with pytest.raises(ValueError, match="--max-tokens 90 or less"):
        context_length(10, 91, model_len=100, max_model_len=None)
    with pytest.raises(ValueError, match="shorten the prompt"):
        context_length(64, 1, model_len=100, max_model_len=64)
    with pytest.raises(ValueError, match="--max-model-len 200 exceeds"):
        context_length(1, 1, model_len=100, max_model_len=200)


def test_without_a_model_the_shipped_model_is_the_default(ckpt, monkeypatch, capsys):
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", ckpt)
    said: list[str] = []
    assert resolve_model(None, said.append) == (ckpt, False) and said == []
    assert resolve_model(str(ckpt.parent), said.append) == (ckpt.parent, False)  # --model wins
    code, out, err = _generate(capsys, "--prompt", PROMPT, "--max-tokens", "2", "--device", "cpu")
    assert code == 0 and f"loaded {ckpt} on cpu" in err and NO_TRAINED_MODEL not in err


def test_the_shipped_model_counts_as_absent_without_its_config(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", ckpt)
    assert shipped_model() == ckpt
    half = tmp_path / "megactx-tiny"
    half.mkdir()
    (half / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", half)
    assert shipped_model() is None


def test_without_a_model_or_the_shipped_one_a_random_checkpoint_is_made_once_and_announced(tmp_path, monkeypatch):
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", tmp_path / "absent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    said: list[str] = []
    path, random_weights = resolve_model(None, said.append)
    assert random_weights and path == tmp_path / "cache" / "megactx" / "random-tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in path.iterdir()}
    assert any("making" in s for s in said) and any(NO_TRAINED_MODEL in s for s in said)
    assert any(f"megactx-tiny model is not at {tmp_path / 'absent'}" in s for s in said)
    assert [p.name for p in path.parent.iterdir()] == ["random-tiny"]  # no temporary directory left behind
    said.clear()
    weights = (path / "model.safetensors").stat().st_mtime_ns
    assert random_checkpoint(log=said.append) == path
    assert said == [] and (path / "model.safetensors").stat().st_mtime_ns == weights  # cached, not made again


@pytest.mark.gpu
def test_generates_on_the_gpu(ckpt, capsys):
    code, out, err = _generate(capsys, "--model", str(ckpt), "--prompt", PROMPT, "--max-tokens", "16",
                               "--temperature", "0", "--device", "cuda")
    assert code == 0, err
    assert "on cuda" in err and "(bfloat16)" in err
    assert "16 tokens in" in err and "finish: length" in err


def test_hf_overrides_change_the_config_before_the_model_is_built(ckpt, capsys):
    # the override reaches the context check: 16 positions cannot hold the prompt and 100 tokens
    code, _, err = _generate(capsys, "--model", str(ckpt), "--prompt", PROMPT, "--max-tokens", "100",
                             "--hf-overrides", '{"max_position_embeddings": 16}')
    assert code == 2 and "--max-tokens" in err
    # an override that no longer fits the weights is refused by the loader, naming a tensor
    code, _, err = _generate(capsys, "--model", str(ckpt), "--prompt", PROMPT, "--hf-overrides",
                             '{"hidden_size": 96}')
    assert code == 2 and "shape" in err
    code, _, err = _generate(capsys, "--model", str(ckpt), "--prompt", PROMPT, "--hf-overrides", '{"hiden_size": 1}')
    assert code == 2 and "did you mean 'hidden_size'" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--hf-overrides", "{not json"])
    assert e.value.code == 2 and "--hf-overrides is not valid JSON" in capsys.readouterr().err
