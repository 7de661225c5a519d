"""megactx.train.report: the megactx-tiny report from a run directory's own files."""

from __future__ import annotations

import json

import pytest

from megactx.train.report import bpb_checks, ladder_lines, main, write_report
from megactx.train.trainer import CONFIG_FILE

RUNGS = [("baseline", 4.56, "mtp-ce-noshare"), ("+IndexShare+KVShare", 5.10, "mtp-ce-share"),
         ("+rejection sampling", 5.29, "mtp-ce-share"), ("+end-to-end TV loss", 5.47, "mtp-tv-share")]


def _spec(ladder: list[float]) -> dict:
    """A bench spec JSON whose rungs' acceptance lengths at γ = 7 and batch 32 are `ladder`; batch 1
    holds other (noisier) figures that the report must not judge."""
    runs = [{"rung": name, "gamma": 7, "batch": b, "mean_acceptance_length": length if b == 32 else 9.0 - length}
            for (name, _, _), length in zip(RUNGS, ladder) for b in (1, 32)]
    return {"settings": {"gammas": [1, 7], "batches": [1, 32]}, "runs": runs,
            "rungs": [{"name": n, "published": p, "mtp_layer": m} for n, p, m in RUNGS],
            "targets": [{"target": "speed-up at batch 1", "figure": "2.4x", "passed": True}]}


def test_ladder_is_judged_at_the_largest_gamma_and_batch():
    text = "\n".join(ladder_lines(_spec([1.3, 1.4, 2.3, 2.6])))
    assert "batch 32" in text and "| baseline | 4.56 | 1.30 | 1.00x |" in text and "| 2.60 | 2.00x |" in text
    assert "every rung at least the one below it: pass" in text and "= 2.00x (target >= 1.2x): pass" in text
    text = "\n".join(ladder_lines(_spec([1.3, 1.4, 1.35, 1.5])))
    assert "below it: **FAIL**" in text and "1.15x (target >= 1.2x): **FAIL**" in text


def test_bpb_targets_compare_indexshare_with_dsa_and_dense_at_each_context():
    rows = [{"model": f"runs/tiny/{stage}/checkpoint", "context": ctx, "bits_per_byte": bpb}
            for ctx in (1024, 4096) for stage, bpb in (("sparse", 1.015), ("sparse-dsa", 1.0), ("sparse-dense", 0.98))]
    lines = bpb_checks(rows)
    assert len(lines) == 4
    assert lines[0] == "| 1K | sparse-dsa | 1.0150 | 1.0000 | +1.50% | <= +2% | pass |"
    assert lines[1].startswith("| 1K | sparse-dense | 1.0150 | 0.9800 | +3.57% |") and lines[1].endswith("**FAIL** |")
    assert "not run" in bpb_checks(rows[:1])[0]


def test_report_of_a_partial_run_says_what_is_missing(tmp_path):
    run = tmp_path / "run"
    stage = run / "dense"
    stage.mkdir(parents=True)
    (stage / CONFIG_FILE).write_text(json.dumps({"seq_len": 2048, "global_batch": 16}))
    (stage / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": 3.0, "lm": 2.0, "needle": 1.0,
                                                             "tokens_per_s": 32768.0}) + "\n" for i in range(10)))
    (run / "bench").mkdir()
    (run / "bench" / "spec-x.json").write_text(json.dumps(_spec([1.3, 1.4, 2.3, 2.6])))
    (run / "bench" / "spec-x.md").write_text("# spec\n")
    (stage / "init.json").write_text(json.dumps({"init": "models/megactx-tiny", "weights_sha256": "ab" * 32}))
    (run / "eval" / "needle-recall").mkdir(parents=True)
    (run / "eval" / "needle-recall" / "needle_recall.md").write_text("# Needle recall of the indexers: m\n\nx\n")
    served = run / "eval" / "needles-yarn32"
    served.mkdir()
    (served / "needles.md").write_text("# Needle retrieval: m\n\nconfig rope_parameters.factor=32\n")
    (served / "needles.png").write_bytes(b"\x89PNG")
    path = write_report(run, tmp_path / "docs")
    text = path.read_text()
    assert "#### Needle recall of the indexers: m" in text  # under the needle section
    # the same model served with another YaRN factor, under the needle section, with its figure
    assert "#### Needle retrieval: m\n\nconfig rope_parameters.factor=32" in text
    assert "![needles-yarn32.png](megactx-tiny/needles-yarn32.png)" in text
    assert text.index("#### Needle retrieval: m") < text.index("## IndexShare search")
    assert "Stage `dense` started from the weights of `models/megactx-tiny` (sha256 `abababababababab`)" in text
    # 10 steps of 32,768 tokens at 32,768 tokens/s: 10 s
    assert "| dense | 10 | 32,768 | 32,768 | 0.2 | 3.000 | 2.000 | – | 1.000 |" in text
    assert text.count("Not run.") == 3  # bpb, needles, search
    assert "No exported model" in text and "every rung at least the one below it: pass" in text
    assert (tmp_path / "docs" / "megactx-tiny" / "spec.md").is_file()


def test_cli_refuses_a_missing_run(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["config", "metrics"])
def test_stage_rows_tolerate_a_stage_without_its_config(tmp_path, missing):
    from megactx.train.report import stage_rows

    stage = tmp_path / "sparse"
    stage.mkdir()
    (stage / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": 10.0}) + "\n"
                                         if missing == "config" else "")
    rows = stage_rows(tmp_path)
    assert (rows[0]["tokens_per_step"] is None and rows[0]["wall_s"] is None) if missing == "config" else rows == []
