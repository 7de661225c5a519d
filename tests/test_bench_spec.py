"""`megactx bench spec`: a smoke run of every rung on a tiny random MTP checkpoint (the draft counts
must obey the acceptance bookkeeping), the four-rung ladder on MTP-layer files (each rung's engine
runs its own file's MTP layer), summing per-request draft statistics, prompts of held-out code, and
the targets and reports rendered from made-up figures, old result files included."""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import megactx
from benchmarks.spec import (
    GREEDY,
    MTP_LAYER_RUNGS,
    NO_SPEC,
    RUNGS,
    TARGET_SPEEDUP,
    TV_LOSS_RUNG,
    Settings,
    SpecBench,
    SpecFigures,
    evaluate_targets,
    held_out_prompts,
    load_held_out,
    render_markdown,
    speedup,
    sum_draft_stats,
    write_reports,
)
from megactx.cli import BENCH_SUITES, main
from megactx.config import ModelConfig
from megactx.engine.spec_decode import SpecDecodeStats
from megactx.model import build_model, save_pretrained
from megactx.model.weights import checkpoint_tensors, load_model
from megactx.testing import make_random_checkpoint
from megactx.train.corpus import Corpus, SourceFile
from megactx.train.data import CORPUS_SNAPSHOT, prepare_data
from megactx.train.evaluate import held_out_corpus
from megactx.train.recipe import export_mtp_layer, mtp_prefix
from megactx.train.tokenizer import load_tokenizer

GAMMAS, BATCHES, PROMPT_LEN, OUTPUT_LEN = (1, 3), (1, 2), 8, 6
DATA_VOCAB = 300  # the held-out prompts' tokenizer: at most the checkpoint's 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # 4 dense layers (3 full, 1 shared) and a small vocabulary: every engine step stays in milliseconds
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset="tiny", seed=2, vocab_size=512,
                                  num_hidden_layers=4, first_k_dense_replace=5, index_topk=16, index_n_heads=16)


# tiny models on a shared CPU: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _args(model: Path, out: Path, *extra: str, gammas=GAMMAS, batches=BATCHES) -> list[str]:
    return ["bench", "spec", "--device", "cpu", "--model", str(model), "--gammas", ",".join(map(str, gammas)),
            "--batches", ",".join(map(str, batches)), "--prompt-len", str(PROMPT_LEN), "--output-len",
            str(OUTPUT_LEN), "--out", str(out), *extra]


def _check_bookkeeping(results: dict, gammas, batches, output_len: int, rungs=RUNGS, greedy=True) -> None:
    """Every engine ran at every batch (and the greedy runs at batch 1: no speculation and the top
    rung), and its draft counts obey the acceptance bookkeeping."""
    assert results["skipped"] == []
    runs = {(d["rung"], d["gamma"], d["batch"]): SpecFigures.from_dict(d) for d in results["runs"]}
    want = {(NO_SPEC, 0, b) for b in batches} | {(r.name, g, b) for r in rungs for g in gammas for b in batches}
    if greedy:
        want |= {(GREEDY + NO_SPEC, 0, 1)} | {(GREEDY + rungs[-1].name, g, 1) for g in gammas}
    assert set(runs) == want
    for (rung, gamma, batch), f in runs.items():
        assert f.output_tokens == batch * output_len and f.tokens_per_s == pytest.approx(f.output_tokens / f.wall_s)
        if rung.removeprefix(GREEDY) == NO_SPEC:
            assert f.num_drafts == 0 and f.mean_acceptance_length is None
            continue
        # its speed-up pairs each timed run with the no-speculation run on the same prompts just before it
        walls, reference = f.detail["walls_s"], f.detail["reference_walls_s"]
        assert len(walls) == len(reference) == results["settings"]["reps"] and min(reference) > 0
        assert speedup(results, f) == pytest.approx(statistics.median(r / w for r, w in zip(reference, walls)))
        # every decoding step after the prefill's token verifies one draft a request, and emits at
        # least the token after the accepted drafts: no more drafts than tokens after the first
        assert batch <= f.num_drafts <= batch * (output_len - 1)
        # accepted drafts are a prefix of each draft: position j counts only drafts whose tokens 1..j were kept
        assert f.drafted_per_position[0] == f.num_drafts and len(f.drafted_per_position) == gamma
        assert sum(f.accepted_per_position) == f.num_accepted_tokens
        assert all(a <= d for a, d in zip(f.accepted_per_position, f.drafted_per_position))
        assert f.accepted_per_position == sorted(f.accepted_per_position, reverse=True)
        assert 1.0 <= f.mean_acceptance_length <= gamma + 1
        assert f.mean_acceptance_length == pytest.approx(1 + f.num_accepted_tokens / f.num_drafts)


# ------------------------------------------------------------------------------ smoke run, CPU
def test_smoke_run_measures_every_rung_and_writes_the_reports(ckpt, tmp_path, capsys):
    assert "spec" in BENCH_SUITES
    assert main(_args(ckpt, tmp_path)) == 0
    written = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[1] for p in written] == ["spec-cpu.json", "spec-cpu.md", "spec-cpu.png"]
    results = json.loads((tmp_path / "spec-cpu.json").read_text())
    # a --model with tokenizer.json and no --data-dir: held-out stdlib code in its tokenizer
    assert results["prompts"].startswith("held-out code of the Python") and "stdlib" in results["prompts"]
    assert [(r["name"], r["mtp_layer"], r["mtp_file"]) for r in results["rungs"]] == [(r.name, None, None)
                                                                                      for r in RUNGS]
    _check_bookkeeping(results, GAMMAS, BATCHES, OUTPUT_LEN)
    md = (tmp_path / "spec-cpu.md").read_text()
    assert "4.56" in md and "5.10" in md and "5.29" in md and "5.47" in md  # the published ladder beside ours
    assert "not measured without --mtp-layers" in md  # the TV rung: its published figure only
    assert "## Batch 2" in md and "CPU run" in md and "## Greedy decoding, batch 1" in md
    assert len(evaluate_targets(results)) == len(RUNGS)  # the speed-up, and each rung over the one below


@pytest.mark.gpu
def test_cuda_quick_run_measures_every_rung(ckpt, tmp_path):
    """The Triton path end to end (CUDA graphs without speculation, eager speculative steps)."""
    assert main(["bench", "spec", "--device", "cuda", "--model", str(ckpt), "--quick", "--prompt-len", "32",
                 "--output-len", "24", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("spec-*.json")  # named after the GPU
    results = json.loads(path.read_text())
    assert results["machine"]["device"] == "cuda"
    _check_bookkeeping(results, (1, 7), (1,), 24)


def test_bad_settings_are_refused_naming_the_flag(ckpt, tmp_path, capsys):
    for extra, flag in ((["--temperature", "0"], "--temperature"), (["--gammas", "0,2"], "--gammas"),
                        (["--batches", "0"], "--batches"), (["--output-len", "0"], "--output-len")):
        code = main(["bench", "spec", "--device", "cpu", "--model", str(ckpt), "--out", str(tmp_path), *extra])
        assert code == 2
        assert flag in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------ MTP-layer files, CPU
# the files scripts/train-megactx-tiny.sh writes: (seed of the model exported, its MTP sharing)
MTP_FILES = {"mtp-ce-noshare": (11, False), "mtp-ce-share": (12, True), "mtp-tv-share": (13, True),
             "mtp-cetv-share": (14, True)}


@pytest.fixture(scope="module")
def mtp_layers(ckpt, tmp_path_factory):
    """A directory of MTP-layer files for ckpt's backbone, each exported (export_mtp_layer) from a
    model of ckpt's architecture built with a seed of its own, so every file's weights differ."""
    root = tmp_path_factory.mktemp("mtp")
    cfg = ModelConfig.from_pretrained(ckpt)
    for stem, (seed, share) in MTP_FILES.items():
        model = build_model(cfg.replace(index_share_for_mtp_iteration=share), seed=seed)
        save_pretrained(model, root / "models" / stem, dtype=torch.bfloat16)
        export_mtp_layer(root / "models" / stem, root / "layers" / f"{stem}.safetensors")
    return root / "layers"


def _mtp_weights(model) -> dict[str, torch.Tensor]:
    """The MTP layer of a Transformer, by checkpoint name, in fp32."""
    prefix = mtp_prefix(model.cfg)
    return {name: t.detach().float() for name, t in checkpoint_tensors(model) if name.startswith(prefix)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_mtp_layers_measure_four_rungs_each_on_the_mtp_layer_of_its_training_rung(ckpt, mtp_layers, tmp_path,
                                                                                   monkeypatch):
    engines = []  # every engine built, in order: (γ, mtp_mode, draft_acceptance, its model's MTP layer, sharing)
    real_llm = megactx.LLM

    def recording_llm(model, **kwargs):
        engines.append((kwargs.get("num_speculative_tokens", 0), kwargs.get("mtp_mode"),
                        kwargs.get("draft_acceptance"), _mtp_weights(model), model.cfg.index_share_for_mtp_iteration))
        return real_llm(model, **kwargs)

    monkeypatch.setattr(megactx, "LLM", recording_llm)  # SpecBench.engine imports it when called
    assert main(_args(ckpt, tmp_path, "--mtp-layers", str(mtp_layers), gammas=(2,), batches=(1,))) == 0
    results = json.loads((tmp_path / "spec-cpu.json").read_text())
    _check_bookkeeping(results, (2,), (1,), OUTPUT_LEN, rungs=MTP_LAYER_RUNGS)
    stems = ["mtp-ce-noshare", "mtp-ce-share", "mtp-ce-share", "mtp-tv-share"]
    assert [(r["name"], r["mtp_file"]) for r in results["rungs"]] == [
        (rung.name, str(mtp_layers / f"{stem}.safetensors")) for rung, stem in zip(MTP_LAYER_RUNGS, stems)]
    assert results["rungs"][-1]["name"] == TV_LOSS_RUNG.name and results["rungs"][-1]["published"] == 5.47

    # the no-speculation engine runs the checkpoint; each rung's engine its own file's MTP layer
    files = {stem: {n: t.float() for n, t in load_file(mtp_layers / f"{stem}.safetensors").items()}
             for stem in MTP_FILES}
    own = _mtp_weights(load_model(ckpt))
    assert not any(_same(own, files[a]) or (a != b and _same(files[a], files[b])) for a in files for b in files)
    want = [(0, None, None, own)] + [(2, r.mtp_mode, r.draft_acceptance, files[s])
                                     for r, s in zip(MTP_LAYER_RUNGS, stems)]
    top = MTP_LAYER_RUNGS[-1]  # then the greedy runs: no speculation, the top rung
    want += [(0, None, None, own), (2, top.mtp_mode, top.draft_acceptance, files["mtp-tv-share"])]
    assert len(engines) == len(want)
    for (gamma, mode, acceptance, weights, _), (g, m, a, w) in zip(engines, want):
        assert (gamma, mode, acceptance) == (g, m, a) and _same(weights, w)
    assert [share for *_, share in engines[1:5]] == [False, True, True, True]  # the files' config flag too

    targets = evaluate_targets(results)  # the speed-up of the TV rung, and three rung-over-rung pairs
    assert len(targets) == 4 and targets[0]["target"].startswith(TV_LOSS_RUNG.name)
    assert targets[-1]["target"].startswith(f"acceptance length {TV_LOSS_RUNG.name} >= +rejection sampling")
    md = (tmp_path / "spec-cpu.md").read_text()
    assert "`mtp-tv-share.safetensors`" in md and "not measured" not in md
    assert f"{TV_LOSS_RUNG.name} acc. len" in md  # its own columns in the batch table


def test_a_missing_mtp_layer_file_is_refused_naming_it(ckpt, mtp_layers, tmp_path, capsys):
    partial = tmp_path / "layers"
    partial.mkdir()
    for stem in ("mtp-ce-noshare", "mtp-ce-share"):
        shutil.copy(mtp_layers / f"{stem}.safetensors", partial)
    out = tmp_path / "out"
    assert main(_args(ckpt, out, "--mtp-layers", str(partial))) == 2
    err = capsys.readouterr().err
    assert f"mtp-tv-share.safetensors ({TV_LOSS_RUNG.name})" in err and "mtp-ce-share.safetensors" not in err
    assert "scripts/train-megactx-tiny.sh" in err and "export_mtp_layer" in err
    assert main(_args(ckpt, out, "--mtp-layers", str(tmp_path / "nowhere"))) == 2
    assert "--mtp-layers" in capsys.readouterr().err
    assert not out.exists()


def test_own_mtp_layer_runs_its_rungs_on_the_checkpoints_mtp_layer(ckpt, mtp_layers, tmp_path, monkeypatch, capsys):
    """A shipped model whose own MTP layer is the TV-loss variant: --own-mtp-layer mtp-tv-share
    measures that rung on the checkpoint itself, so the directory needs only the other two files."""
    partial = tmp_path / "layers"
    partial.mkdir()
    for stem in ("mtp-ce-noshare", "mtp-ce-share"):
        shutil.copy(mtp_layers / f"{stem}.safetensors", partial)
    engines = []
    real_llm = megactx.LLM

    def recording_llm(model, **kwargs):
        engines.append((kwargs.get("num_speculative_tokens", 0), _mtp_weights(model)))
        return real_llm(model, **kwargs)

    monkeypatch.setattr(megactx, "LLM", recording_llm)
    out = tmp_path / "out"
    assert main(_args(ckpt, out, "--mtp-layers", str(partial), "--own-mtp-layer", "mtp-tv-share", "--no-greedy",
                      gammas=(2,), batches=(1,))) == 0
    results = json.loads((out / "spec-cpu.json").read_text())
    assert [r["mtp_file"] for r in results["rungs"]] == [
        str(partial / "mtp-ce-noshare.safetensors"), str(partial / "mtp-ce-share.safetensors"),
        str(partial / "mtp-ce-share.safetensors"), None]
    own = _mtp_weights(load_model(ckpt))
    tv = engines[-1]  # the TV rung's engine: the checkpoint's own MTP layer
    assert tv[0] == 2 and _same(tv[1], own) and not _same(engines[1][1], own)
    md = (out / "spec-cpu.md").read_text()
    assert "the rungs of `mtp-tv-share` on the checkpoint's own MTP layer" in md
    # a stem that no rung has, or the flag without --mtp-layers: exit 2, naming the flag
    assert main(_args(ckpt, tmp_path / "bad", "--mtp-layers", str(partial), "--own-mtp-layer", "mtp-tv")) == 2
    assert "--own-mtp-layer must be one of" in capsys.readouterr().err
    assert main(_args(ckpt, tmp_path / "bad", "--own-mtp-layer", "mtp-tv-share")) == 2
    assert "give --mtp-layers DIR too" in capsys.readouterr().err


# ------------------------------------------------------------------------------ draft statistics
def test_summed_request_stats_equal_one_stats_that_recorded_every_verify():
    gamma = 4
    g = torch.Generator().manual_seed(0)
    per_request, together = [SpecDecodeStats(gamma) for _ in range(3)], SpecDecodeStats(gamma)
    for _ in range(40):
        i = int(torch.randint(0, 3, (1,), generator=g))
        drafted = int(torch.randint(1, gamma + 1, (1,), generator=g))
        accepted = int(torch.randint(0, drafted + 1, (1,), generator=g))
        per_request[i].record(drafted, accepted)
        together.record(drafted, accepted)
    f = SpecFigures("x", gamma, 1, 1, 1.0, **sum_draft_stats(per_request, gamma))
    assert f.mean_acceptance_length == pytest.approx(together.mean_acceptance_length)
    assert f.acceptance_rate_per_position == pytest.approx(together.acceptance_rate_per_position)
    assert f.num_drafts == together.num_drafts


def test_the_acceptance_lengths_standard_error_is_that_of_the_verifies_it_counted():
    """From the per-position counts alone, the standard error equals the one of the recorded
    verifies' acceptance lengths (population variance / n), and a tie of two rungs is called noise."""
    gamma, g = 7, torch.Generator().manual_seed(1)
    stats, lengths = SpecDecodeStats(gamma), []
    for _ in range(500):
        drafted = int(torch.randint(1, gamma + 1, (1,), generator=g))
        accepted = min(int(torch.distributions.Geometric(0.5).sample()), drafted)
        stats.record(drafted, accepted)
        lengths.append(1.0 + accepted)
    f = SpecFigures("x", gamma, 1, 1, 1.0, **sum_draft_stats([stats], gamma))
    mean = sum(lengths) / len(lengths)
    var = sum((x - mean) ** 2 for x in lengths) / len(lengths)
    assert f.acceptance_length_se == pytest.approx((var / len(lengths)) ** 0.5)
    assert SpecFigures("x", gamma, 1, 1, 1.0, 1, 1, [1] * gamma, [1] + [0] * 6).acceptance_length_se is None

    tie = evaluate_targets(_results((4.56, 4.57, 5.29), speed=2.5))  # 100 verifies a run: SE ~0.1
    assert tie[1]["passed"] is True and "within noise: +0.010 is 0.1 standard errors" in tie[1]["note"]
    assert "noise" not in tie[2]["note"]
    assert "4.57 ± 0.05" in render_markdown(_results((4.56, 4.57, 5.29), speed=2.5), tie)


# ------------------------------------------------------------------------------ reports, fake figures
def _figures(rung: str, gamma: int, batch: int, tokens_per_s: float, acceptance_length: float = 0.0) -> dict:
    """A made-up run: 100 drafts whose acceptance length is the given one, spread over positions."""
    tokens = 64 * batch
    if rung == NO_SPEC:
        return SpecFigures(rung, 0, batch, tokens, tokens / tokens_per_s).to_dict()
    accepted = round((acceptance_length - 1) * 100)
    per_position = [max(0, min(100, accepted - 100 * j)) for j in range(gamma)]
    return SpecFigures(rung, gamma, batch, tokens, tokens / tokens_per_s, 100, accepted, [100] * gamma,
                       per_position).to_dict()


def _results(ladder: tuple[float, ...], speed: float, device: str = "cuda", random_weights: bool = False,
             rungs=None) -> dict:
    """Made-up results of the rungs `rungs` (None: a file written before rungs were recorded, which
    ran RUNGS) whose acceptance lengths at γ = 7 are `ladder`."""
    runs = [_figures(NO_SPEC, 0, b, 100.0) for b in (1, 32)]
    for rung, length in zip(rungs or RUNGS, ladder):
        for gamma in (1, 7):
            for b in (1, 32):
                # γ = 7 is the fastest γ of the top rung; lower rungs are slower by their acceptance lengths
                scale = length / ladder[-1] if gamma == 7 else 0.8
                runs.append(_figures(rung.name, gamma, b, 100.0 * speed * scale,
                                     length if gamma == 7 else min(length, 2.0)))
    machine = {"device": device, "gpu": "NVIDIA H200" if device == "cuda" else None, "date": "2026-01-01",
               "torch": "2.11", "triton": "3.6", "cuda": "12.8" if device == "cuda" else None}
    results = {"machine": machine, "prompts": "held-out code",
               "settings": {"gammas": [1, 7], "batches": [1, 32], "prompt_len": 128, "output_len": 64,
                            "temperature": 1.0, "reps": 1, "dtype": "bfloat16"},
               "model": {"path": "trained", "random_weights": random_weights, "model_type": "glm_moe_dsa",
                         "layers": 8, "hidden_size": 256, "vocab_size": 4096},
               "runs": runs, "skipped": []}
    if rungs:
        results["settings"]["mtp_layers"] = "layers"
        results["rungs"] = [dataclasses.asdict(r) | {"mtp_file": f"layers/{r.mtp_layer}.safetensors"} for r in rungs]
    return results


def test_targets_pass_on_a_rising_ladder_and_a_fast_enough_top_rung():
    results = _results((4.56, 5.10, 5.29), speed=TARGET_SPEEDUP + 0.5)
    targets = evaluate_targets(results)
    assert [t["passed"] for t in targets] == [True, True, True]
    assert targets[0]["figure"].startswith(f"{TARGET_SPEEDUP + 0.5:.2f}x at γ = 7")
    assert targets[2]["figure"] == "5.29 vs 5.10"


def test_the_speed_up_pairs_each_run_with_the_no_speculation_run_before_it():
    """The host slows by 1.5x after the no-speculation row was measured: the speculative runs, each
    paired with a no-speculation run just before it, still show their 2x; a run without pairs
    (an older JSON) falls back to the no-speculation row."""
    results = _results((4.56, 5.10, 5.29), speed=2.0)
    f = next(SpecFigures.from_dict(d) for d in results["runs"] if d["rung"] != NO_SPEC)
    real = speedup(results, f)  # as measured with the host at the no-speculation row's speed
    f.wall_s = slow = 1.5 * f.wall_s
    walls = [slow, slow * 1.1, slow * 0.9]
    f.detail = {"walls_s": walls, "reference_walls_s": [real * w for w in walls]}
    assert speedup(results, f) == pytest.approx(real)
    f.detail = {"walls_s": walls}  # no pairs: against the row, and the drift shows
    assert speedup(results, f) == pytest.approx(real / 1.5)


def test_targets_fail_on_a_falling_rung_or_too_little_speed_up():
    targets = evaluate_targets(_results((4.56, 4.40, 5.29), speed=1.5))
    assert [t["passed"] for t in targets] == [False, False, True]
    md = render_markdown(_results((4.56, 4.40, 5.29), speed=1.5), targets)
    assert md.count("**FAIL**") == 2
    # what bounds the speed-up: the best γ's step (acceptance length 5.29 at 1.5x) costs 5.29 / 1.5 = 3.53
    # steps without speculation, so 2x needs an acceptance length of 7.05
    assert "costs 3.53 steps without speculation, so 2x needs an acceptance length of 7.05; it is 5.29" in md
    # a rung a hair below the one under it fails with figures that show the difference
    results = _results((4.56, 4.56, 5.29), speed=2.5)
    for run in results["runs"]:
        if (run["rung"], run["gamma"], run["batch"]) == (RUNGS[1].name, 7, 32):
            run.update(num_drafts=10_000, num_accepted_tokens=35_599, mean_acceptance_length=4.5599)
    targets = evaluate_targets(results)
    assert targets[1]["passed"] is False and targets[1]["figure"] == "4.5599 vs 4.5600"


def test_random_weights_and_cpu_runs_decide_no_target_but_show_the_figures():
    for results, note in ((_results((4.56, 5.10, 5.29), 3.0, random_weights=True), "random weights"),
                          (_results((4.56, 5.10, 5.29), 3.0, device="cpu"), "CPU run")):
        targets = evaluate_targets(results)
        assert targets[0]["passed"] is None and note in targets[0]["note"] and targets[0]["figure"] != "–"
    assert "meaningless" in render_markdown(results := _results((4.56, 5.10, 5.29), 3.0, random_weights=True),
                                            evaluate_targets(results))


def test_targets_cover_the_tv_rung_when_four_rungs_were_measured():
    results = _results((4.56, 5.10, 5.29, 5.47), speed=TARGET_SPEEDUP + 0.5, rungs=MTP_LAYER_RUNGS)
    targets = evaluate_targets(results)
    assert [t["passed"] for t in targets] == [True] * 4
    assert targets[0]["target"].startswith(TV_LOSS_RUNG.name)  # the speed-up of the top measured rung
    assert TV_LOSS_RUNG.name in targets[3]["target"] and targets[3]["figure"] == "5.47 vs 5.29"
    falling = _results((4.56, 5.10, 5.29, 5.20), speed=TARGET_SPEEDUP + 0.5, rungs=MTP_LAYER_RUNGS)
    assert [t["passed"] for t in evaluate_targets(falling)] == [True, True, True, False]
    md = render_markdown(results, targets)
    assert f"| {TV_LOSS_RUNG.name} | 5.47 | 5.47 ± 0.05 | 5.47 ± 0.05 | `mtp-tv-share.safetensors` |" in md
    assert "| baseline | 4.56 | 4.56 ± 0.05 | 4.56 ± 0.05 | `mtp-ce-noshare.safetensors` |" in md
    assert "not measured" not in md and "MTP layers from `layers`" in md


def test_reports_show_the_published_ladder_beside_ours_and_rewrite_an_old_json(tmp_path, capsys):
    results = _results((4.61, 5.02, 5.33), speed=2.5)
    assert "rungs" not in results  # written before the rungs run were recorded: the three of RUNGS
    paths = write_reports(results, tmp_path)
    assert [p.name for p in paths] == ["spec-nvidia-h200.json", "spec-nvidia-h200.md", "spec-nvidia-h200.png"]
    md = paths[1].read_text()
    for rung, ours in zip(RUNGS, (4.61, 5.02, 5.33)):
        assert f"| {rung.name} | {rung.published:.2f} | {ours:.3g} ± " in md
    assert f"| {TV_LOSS_RUNG.name} | 5.47 | – | – | a training change: not measured without --mtp-layers |" in md
    saved = json.loads(paths[0].read_text())
    assert [t["passed"] for t in saved["targets"]] == [True, True, True]
    paths[1].unlink()
    assert main(["bench", "spec", "--from-json", str(paths[0])]) == 0
    assert (tmp_path / "spec-nvidia-h200.md").read_text() == md
    assert str(paths[1]) in capsys.readouterr().out


# ------------------------------------------------------------------------------ held-out code prompts
def _corpus(num_files: int = 6) -> Corpus:
    """Small Python files, every other one held out."""
    files = []
    for i in range(num_files):
        text = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(12))
        files.append(SourceFile(f"pkg/mod{i}.py", text, held_out=i % 2 == 1))
    return Corpus(tuple(files), "3.12.0", 0.5, "test")


@pytest.fixture(scope="module")
def data_and_model(ckpt, tmp_path_factory):
    """A prepared data directory and a copy of the checkpoint that carries its tokenizer."""
    root = tmp_path_factory.mktemp("data")
    _corpus().save_snapshot(root / CORPUS_SNAPSHOT)
    data = prepare_data(root, vocab_size=DATA_VOCAB)
    model = root.parent / "model"
    shutil.copytree(ckpt, model)
    data.save_tokenizer(model)
    return data, model


def test_held_out_prompts_are_line_aligned_windows_of_held_out_code(data_and_model):
    data, model = data_and_model
    split = load_held_out(data.directory, model, vocab_size=512)
    prompts = held_out_prompts(split, n=5, length=10, seed=3)
    held_out_text = "".join(f.text for f in data.corpus.split("held_out"))
    assert len(prompts) == 5 and all(len(p) == 10 for p in prompts)
    for p in prompts:
        text = data.tokenizer.decode(p)
        assert text in held_out_text and text.startswith(("def ", "    return", "\n"))
    with pytest.raises(ValueError, match="--prompt-len"):
        held_out_prompts(split, n=5, length=split.num_tokens, seed=0)


def test_held_out_prompts_need_the_checkpoints_tokenizer(data_and_model, ckpt):
    data, _ = data_and_model
    with pytest.raises(ValueError, match="another tokenizer"):
        load_held_out(data.directory, ckpt, vocab_size=512)


def test_prompts_are_held_out_stdlib_code_unless_the_weights_are_random(ckpt):
    s = Settings.defaults("cpu", quick=True)
    s.check()
    bench = SpecBench(ckpt, False, s)  # ckpt holds tokenizer.json; no --data-dir
    assert bench.results["prompts"].startswith("held-out code of the Python") and "stdlib" in bench.results["prompts"]
    tok, held_out = load_tokenizer(ckpt), "".join(f.text for f in held_out_corpus().files)
    prompts = bench.prompts(3, 1)
    assert len(prompts) == 3 and all(len(p) == s.prompt_len for p in prompts)
    assert all(tok.decode(p) in held_out for p in prompts)
    assert bench.prompts(3, 1) == prompts and bench.prompts(3, 2) != prompts  # same for every engine, fresh a run
    assert SpecBench(ckpt, True, s).results["prompts"] == "random token ids"


def test_a_run_on_held_out_code_says_so(data_and_model, tmp_path):
    data, model = data_and_model
    assert main(["bench", "spec", "--device", "cpu", "--model", str(model), "--data-dir", str(data.directory),
                 "--quick", "--gammas", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "spec-cpu.json").read_text())
    assert results["skipped"] == [] and results["prompts"] == "held-out code"
    assert "held-out code" in (tmp_path / "spec-cpu.md").read_text()
