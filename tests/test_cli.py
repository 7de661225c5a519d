import pytest

from megactx import LLM, SamplingParams
from megactx.cli import main


def test_demo_runs_and_shows_indexshare(capsys):
    assert main(["demo", "--seqlen", "80"]) == 0
    out = capsys.readouterr().out
    assert "IndexShare removes 57" in out
    assert "top-k of layer 2" in out and "FFFSSSFS" in out
    # the engine (with and without MTP speculation) reproduces the reference's greedy tokens
    assert out.count("equal to the reference's greedy tokens: True") == 2


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
