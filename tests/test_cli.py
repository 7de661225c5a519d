"""The command line: --help, the engine's and SamplingParams' errors, and `megactx serve` choosing
its model (--model, else the shipped megactx-tiny, else an error saying how to pass one). The demo's
tests are in test_demo.py, generate's in test_generate.py."""

import pytest
import torch

from megactx import LLM, SamplingParams
from megactx.cli import main
from megactx.serve import CPU_MAX_MODEL_LEN, DEFAULT_GC_THRESHOLD
from megactx.testing import make_random_checkpoint


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "flops" in out


def test_engine_names_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        LLM(tmp_path / "no-such-checkpoint")


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(min_p=2)])
def test_sampling_params_refuse_out_of_range_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_serve_without_a_model_or_the_shipped_one_says_how_to_pass_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", tmp_path / "absent")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "megactx serve: error: no --model given" in err
    assert f"megactx-tiny model is not at {tmp_path / 'absent'}" in err and "--model PATH is required" in err


def test_serve_defaults_to_the_shipped_model(tmp_path, monkeypatch):
    shipped = make_random_checkpoint(tmp_path / "megactx-tiny", vocab_size=512, num_hidden_layers=2,
                                     first_k_dense_replace=1, dtype=torch.float32)
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", shipped)
    served = {}

    def build_app(llm, served_model_name, max_queued_requests, max_handovers_per_s, gc_threshold):
        served.update(llm=llm, name=served_model_name, handovers=max_handovers_per_s, gc=gc_threshold)
        return "app"

    monkeypatch.setattr("megactx.serve.api.build_app", build_app)
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.update(app=app, **kwargs))
    # the engine in a thread here (serve's default runs it in a process of its own: below)
    assert main(["serve", "--device", "cpu", "--max-num-seqs", "1", "--port", "8123", "--no-engine-process"]) == 0
    assert served["name"] == "megactx-tiny" and served["app"] == "app" and served["port"] == 8123
    assert served["llm"].cfg.num_hidden_layers == 2 and served["llm"].tokenizer is not None
    assert served["llm"].max_model_len == CPU_MAX_MODEL_LEN  # not the model's 65536 positions, on a CPU
    assert served["llm"].spec.config.num_speculative_tokens == 7  # the checkpoint has an MTP layer
    assert served["handovers"] == 2000.0  # the event budget's default
    assert served["gc"] == DEFAULT_GC_THRESHOLD
    assert main(["serve", "--device", "cpu", "--max-num-seqs", "1", "--max-model-len", "128",
                 "--num-speculative-tokens", "0", "--max-handovers-per-s", "0", "--no-engine-process"]) == 0
    assert served["llm"].max_model_len == 128 and served["llm"].spec is None and served["handovers"] == 0

    class FakeEngineProcess:  # records what serve would spawn a process for
        def __init__(self, llm_kwargs, log_level, gc_threshold):
            self.llm_kwargs, self.gc_threshold = llm_kwargs, gc_threshold

    monkeypatch.setattr("megactx.serve.engine_process.EngineProcess", FakeEngineProcess)
    assert main(["serve", "--device", "cpu", "--max-num-seqs", "1", "--gc-threshold", "9000"]) == 0  # by default:
    assert isinstance(served["llm"], FakeEngineProcess) and served["llm"].llm_kwargs["max_num_seqs"] == 1  # a process
    assert served["llm"].gc_threshold == served["gc"] == 9000  # the engine process's collector too
