"""`megactx eval`: bits per byte match a hand computation and the training pipeline's held-out rows,
needle accuracy is counted right per context and depth (an oracle scores 100%, a wrong answerer 0%,
a depth-limited one exactly its depth range), and both commands run on a random tiny checkpoint
and write their reports.

A small corpus (the held-out stdlib files and a few training files), a 512-token tokenizer and a
two-layer random model keep the file to seconds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megactx.analysis.flops import context_label
from megactx.cli import main
from megactx.train.corpus import Corpus
from megactx.train.data import needle_generator, prepare_data
from megactx.train.evaluate import (
    ANSWER_SLACK,
    answer_budget,
    bits_per_byte_of,
    case_depths,
    evaluate_needles,
    held_out_rows,
    needle_cases,
    parse_contexts,
    wilson_interval,
)
from megactx.train.needles import STANDARD_TASKS
from megactx.train.tokenizer import SPECIAL_TOKENS, load_tokenizer, token_byte_lengths

VOCAB = 512
SEQ_LEN = 64
CONTEXT = 512


@pytest.fixture(scope="module")
def small() -> Corpus:
    stdlib = Corpus.from_stdlib()
    return stdlib.subset([f.path for f in stdlib.split("held_out")] + [f.path for f in stdlib.split("train")[::60]])


@pytest.fixture(scope="module")
def data(small, tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    small.save_snapshot(directory / "corpus")
    return prepare_data(directory, corpus=small, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory):
    """A random two-layer tiny model that carries the data directory's tokenizer."""
    from megactx.testing import make_random_checkpoint

    path = make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), vocab_size=VOCAB, num_hidden_layers=2,
                                  first_k_dense_replace=1, dtype=torch.float32)
    data.save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def generator(checkpoint, small):
    return needle_generator(checkpoint, corpus=small)


# -- shared helpers -------------------------------------------------------------------------------

def test_contexts_parse_binary_suffixes_and_refuse_nonsense():
    assert parse_contexts("16k,4k, 1m,4096") == [4096, 16384, 1 << 20]
    for bad in ("", "4q", "0", "1.5"):
        with pytest.raises(ValueError, match="--contexts"):
            parse_contexts(bad)


def test_wilson_interval_matches_the_formula_and_brackets_the_rate():
    low, high = wilson_interval(190, 200)
    p, n, z = 0.95, 200, 1.959963984540054
    center = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z / (1 + z**2 / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    assert low == pytest.approx(center - half) and high == pytest.approx(center + half)
    assert low < p < high and wilson_interval(0, 0) == (0.0, 1.0)


# -- bits per byte --------------------------------------------------------------------------------

def test_held_out_rows_are_the_training_pipelines_held_out_rows(data, checkpoint):
    rows = held_out_rows(load_tokenizer(checkpoint), SEQ_LEN, seed=3, data_dir=data.directory)
    assert torch.equal(rows, data.pretraining_sequences(SEQ_LEN, "held_out", seed=3))
    # without a data directory: the stdlib's held-out files, which the small corpus holds all of
    assert torch.equal(held_out_rows(load_tokenizer(checkpoint), SEQ_LEN, seed=3), rows)


def test_bits_per_byte_matches_a_hand_computation(data):
    tok = data.tokenizer
    rows = data.pretraining_sequences(SEQ_LEN, "held_out")[:5]
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(VOCAB, generator=gen)  # the same logits at every position

    def model(ids):
        return bias.expand(*ids.shape, VOCAB)

    got = bits_per_byte_of(model, rows, token_byte_lengths(tok), batch_size=2)
    # by hand: nll(t) = logsumexp(bias) - bias[t]; special tokens count neither loss nor bytes
    log_z = float(np.log(np.exp(bias.double().numpy()).sum()))
    special = {tok.token_to_id(s) for s in SPECIAL_TOKENS}
    targets = [t for t in rows[:, 1:].flatten().tolist() if t not in special]
    nats = sum(log_z - float(bias[t]) for t in targets)
    num_bytes = sum(len(tok.id_to_token(t)) for t in targets)  # byte-level: one character a byte
    assert got["tokens"] == len(targets) and got["bytes"] == num_bytes and got["rows"] == 5
    # the loss is computed from fp32 logits: agreement to fp32 rounding over a few hundred terms
    assert got["bits_per_byte"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-6)
    # --max-tokens scores whole rows: ceil(max_tokens / seq_len) of them
    assert bits_per_byte_of(model, rows, token_byte_lengths(tok), max_tokens=SEQ_LEN + 1)["rows"] == 2


def test_eval_bpb_command_prints_and_writes_the_reports(checkpoint, data, tmp_path, capsys):
    out = tmp_path / "bpb"
    code = main(["eval", "bpb", "--model", str(checkpoint), "--data-dir", str(data.directory), "--seq-len", "64",
                 "--max-tokens", "256", "--out", str(out), "--device", "cpu"])
    assert code == 0
    results = json.loads((out / "bpb.json").read_text())
    assert len(results) == 1 and results[0]["context"] == SEQ_LEN and results[0]["rows"] == 4
    assert math.isfinite(results[0]["bits_per_byte"]) and results[0]["bits_per_byte"] > 0
    assert f"{results[0]['bits_per_byte']:.6f}" in capsys.readouterr().out
    assert "bits/byte" in (out / "bpb.md").read_text() and (out / "bpb.png").stat().st_size > 0


def test_bpb_report_compares_every_model_with_the_first_at_its_context():
    from megactx.train.evaluate import bpb_markdown, model_label

    rows = [{"model": "runs/t/sparse/checkpoint", "context": 1024, "bits_per_byte": 2.0, "nats_per_token": 1.0,
             "tokens": 1, "bytes": 1},
            {"model": "runs/t/sparse-dense/checkpoint", "context": 1024, "bits_per_byte": 1.9, "nats_per_token": 1.0,
             "tokens": 1, "bytes": 1}]
    text = bpb_markdown(rows)
    assert "| +0.00% |" in text and "| -5.00% |" in text
    assert model_label(rows[1]["model"]) == "sparse-dense" and model_label("models/megactx-tiny") == "megactx-tiny"


# -- needles --------------------------------------------------------------------------------------

TASKS = [STANDARD_TASKS["single"], STANDARD_TASKS["multikey"]]  # one asked needle, at the case's depth
NUM_CASES = 5


def _depth_of(case) -> float:
    return next(n.depth for n in case.needles if n.role == "asked")


def test_case_depths_follow_the_generators_contract(generator):
    for task in TASKS:
        cases = list(generator.cases(task, 300, NUM_CASES, seed=1))
        assert [_depth_of(c) for c in cases] == pytest.approx(case_depths(NUM_CASES).tolist())


def test_prompt_and_answer_fit_the_context(generator):
    for task in STANDARD_TASKS.values():
        for case in needle_cases(generator, task, CONTEXT, 2, seed=0):
            assert len(case.input_ids) == CONTEXT - answer_budget(task)
            assert len(case.answer_ids) + ANSWER_SLACK <= answer_budget(task)


ANSWERERS = {
    "oracle": lambda cases: [c.answer + "<|end|>trailing" for c in cases],  # text after <|end|> does not count
    "wrong": lambda cases: [c.answer + "0" for c in cases],  # one digit more is no exact match
    "shallow": lambda cases: [c.answer if _depth_of(c) < 0.5 else "" for c in cases],
}


@pytest.mark.parametrize("kind", sorted(ANSWERERS))
def test_needle_accuracy_is_counted_per_context_and_depth(generator, kind):
    report = evaluate_needles(ANSWERERS[kind], generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2, batch_size=2,
                              depth_buckets=2)
    assert len(report.outcomes) == len(TASKS) * 2 * NUM_CASES
    # depths 0, .25, .5, .75, 1: the shallow answerer knows the first two
    expected = {"oracle": 1.0, "wrong": 0.0, "shallow": 2 / NUM_CASES}[kind]
    for task in report.tasks:
        for context in (384, CONTEXT):
            assert report.accuracy(task, context) == pytest.approx(expected)
    assert [o.depth for o in report.outcomes[:NUM_CASES]] == pytest.approx(case_depths(NUM_CASES).tolist())
    if kind == "shallow":
        assert report.accuracy(None, CONTEXT, bucket=0) == 1.0 and report.accuracy(None, CONTEXT, bucket=1) == 0.0
        assert report.holds_up_to() is None
    if kind == "oracle":
        assert report.holds_up_to() == CONTEXT and report.summary()["results"]["all"]["holds_up_to"] == CONTEXT
        # the progress bar (shown on a terminal only) and the log of each task and context change nothing
        said = []
        again = evaluate_needles(ANSWERERS[kind], generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2, batch_size=2,
                                 depth_buckets=2, progress=True, log=said.append)
        assert again == report and len(said) == len(TASKS) * 2 and said[0].endswith(f"100.0% of {NUM_CASES}")


@pytest.mark.parametrize("kind, trained, verdict", [("oracle", CONTEXT, "passes >= 95%"),
                                                     ("wrong", CONTEXT, "FAILS >= 95%"),
                                                     ("oracle", 256, "no context up to it measured")])
def test_trained_length_verdict_counts_only_contexts_up_to_it(generator, kind, trained, verdict):
    # contexts 384 and 512: a trained length below both has no verdict (not a failure)
    report = evaluate_needles(ANSWERERS[kind], generator, TASKS[:1], [CONTEXT, 384], 2, seed=2, batch_size=2,
                              trained_length=trained)
    assert report.summary()["trained_length"]["passes"] == {"passes": True, "FAILS": False}.get(verdict.split()[0])
    assert f"Trained length {context_label(trained)}: {verdict}" in report.markdown()


def test_cases_sharing_a_haystack_run_its_first_case_alone_then_the_others(generator):
    from megactx.train.evaluate import NeedleReport

    seen = []

    def recorder(cases):
        seen.append([round(_depth_of(c) * 6) for c in cases])  # 7 cases: depth i/6 is case i
        return [c.answer for c in cases]

    run = dict(seed=2, batch_size=2, per_haystack=3)
    report = evaluate_needles(recorder, generator, TASKS[:1], [CONTEXT], 7, **run)
    # haystacks {0, 3, 6}, {1, 4}, {2, 5}: the first case's prefill serves the rest from the prefix cache
    assert seen == [[0], [3, 6], [1], [4], [2], [5]]
    assert report.accuracy() == 1.0 and sorted(o.index for o in report.outcomes) == list(range(7))
    assert "3 cases a haystack" in report.markdown()
    assert NeedleReport.from_json(json.loads(json.dumps(report.to_json()))).per_haystack == 3
    with pytest.raises(ValueError, match="per_haystack"):  # a run of another layout is not resumed
        evaluate_needles(recorder, generator, TASKS[:1], [CONTEXT], 7, seed=2, resume=report)
    with pytest.raises(ValueError, match="single task"):
        evaluate_needles(recorder, generator, TASKS[1:], [CONTEXT], 7, **run)


def test_the_engine_prefills_a_shared_haystack_once(checkpoint, generator):
    from megactx import LLM, SamplingParams
    from megactx.kernels.reference import BLOCK_SIZE

    cases = generator.shared_haystack_cases(STANDARD_TASKS["single"], 400, [0.2, 0.5, 0.9], seed=1)
    first = cases[0].needles[0]
    body = first.position - first.offset + cases[0].haystack_len + sum(n.length for n in cases[0].needles)
    llm = LLM(checkpoint, device="cpu", max_model_len=512, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    (lead,) = llm.generate([cases[0].input_ids], params, use_tqdm=False)
    rest = llm.generate([c.input_ids for c in cases[1:]], [params] * 2, use_tqdm=False)
    assert lead.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [body // BLOCK_SIZE * BLOCK_SIZE] * 2


def test_shards_run_the_whole_runs_cases_and_merge_back_into_it(generator):
    from megactx.train.evaluate import NeedleReport, merge_needle_reports, parse_shard

    run = dict(depth_buckets=2, batch_size=2)
    whole = evaluate_needles(ANSWERERS["shallow"], generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2, **run)
    shards = [evaluate_needles(ANSWERERS["shallow"], generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2,
                               shard=(i, 2), **run) for i in (0, 1)]
    # shard 0 of 2 runs cases 0, 2, 4 of each task and context: the whole run's, at the same depths
    assert [o.index for o in shards[0].outcomes[:3]] == [0, 2, 4]
    assert [o.depth for o in shards[0].outcomes[:3]] == pytest.approx(case_depths(NUM_CASES)[[0, 2, 4]].tolist())
    assert shards[0].missing() == {(t.label, c): 2 for t in TASKS for c in (384, CONTEXT)}
    assert "Partial" in shards[0].markdown() and "Partial" not in whole.markdown() and not whole.missing()
    # a report read back from its JSON is the same report; the shards' JSON merge into the whole run's
    back = [NeedleReport.from_json(json.loads(json.dumps(s.to_json()))) for s in shards]
    assert back[0] == shards[0]
    legacy = whole.to_json()
    del legacy["num_cases"]  # written before the field: a whole run, its case count read off its outcomes
    assert NeedleReport.from_json(legacy).num_cases == NUM_CASES
    merged = merge_needle_reports(back[::-1])
    assert merged.to_json() == whole.to_json() and merged.markdown() == whole.markdown()
    # runs of other contexts join too; a case twice, or runs of different evaluations, do not
    longer = evaluate_needles(ANSWERERS["shallow"], generator, TASKS, [640], NUM_CASES, seed=2, **run)
    assert merge_needle_reports([whole, longer]).contexts == [384, CONTEXT, 640]
    with pytest.raises(ValueError, match="two of the reports"):
        merge_needle_reports([shards[0], whole])
    other = evaluate_needles(ANSWERERS["shallow"], generator, TASKS, [CONTEXT], NUM_CASES, seed=3, shard=(1, 2), **run)
    with pytest.raises(ValueError, match="differ in seed"):
        merge_needle_reports([shards[0], other])
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "1", "-1/2", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    with pytest.raises(ValueError, match="--shard 5/6 holds none"):
        evaluate_needles(ANSWERERS["oracle"], generator, TASKS, [CONTEXT], NUM_CASES, seed=2, shard=(5, 6))


def test_a_stopped_run_resumes_from_its_saved_report_to_the_whole_runs_report(generator):
    from megactx.train.evaluate import NeedleReport

    run = dict(depth_buckets=2, batch_size=2)
    whole = evaluate_needles(ANSWERERS["shallow"], generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2, **run)
    saved, asked = [], []

    def stops_after_three_batches(cases):
        if len(asked) == 3:
            raise KeyboardInterrupt  # the run is stopped in its fourth batch
        asked.append([c.answer for c in cases])
        return ANSWERERS["shallow"](cases)

    def save(report):  # what the CLI writes after every batch: the report's JSON
        saved.append(json.loads(json.dumps(report.to_json())))

    with pytest.raises(KeyboardInterrupt):
        evaluate_needles(stops_after_three_batches, generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2,
                         on_batch=save, **run)
    last = NeedleReport.from_json(saved[-1])
    assert len(saved) == 3 and len(last.outcomes) == NUM_CASES  # the first (task, context): batches of 2, 2, 1

    def counted(cases):
        asked.append([c.answer for c in cases])
        return ANSWERERS["shallow"](cases)

    asked.clear()
    resumed = evaluate_needles(counted, generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2, resume=last, **run)
    assert resumed.to_json() == whole.to_json()  # the same outcomes, in the same order
    assert sum(map(len, asked)) == len(whole.outcomes) - NUM_CASES  # the saved cases are not run again
    # a report of another evaluation, or of another shard, is refused
    with pytest.raises(ValueError, match="another evaluation: its seed is 2"):
        evaluate_needles(counted, generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=3, resume=last, **run)
    with pytest.raises(ValueError, match="another evaluation: its contexts"):
        evaluate_needles(counted, generator, TASKS, [CONTEXT], NUM_CASES, seed=2, resume=last, **run)
    with pytest.raises(ValueError, match="not in --shard 1/2"):
        evaluate_needles(counted, generator, TASKS, [CONTEXT, 384], NUM_CASES, seed=2, resume=last, shard=(1, 2),
                         **run)


def test_engine_answerer_is_the_reference_models_greedy_decode(checkpoint, generator):
    from megactx import LLM, load_model
    from megactx.train.evaluate import EngineAnswerer

    cases = list(needle_cases(generator, STANDARD_TASKS["single"], 128, 2, seed=4))
    outputs = EngineAnswerer(LLM(checkpoint, device="cpu", max_model_len=128, max_num_seqs=2))(cases)
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    for case, output in zip(cases, outputs):
        ids, new = list(case.input_ids), []
        while len(new) < len(case.answer_ids) + ANSWER_SLACK:  # greedy, stopping at <|end|>
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token == case.answer_ids[-1]:
                break
            ids.append(token)
            new.append(token)
        assert output == tok.decode(new)


def test_eval_needles_command_runs_the_engine_and_writes_reports(checkpoint, data, tmp_path, capsys):
    out = tmp_path / "needles"
    code = main(["eval", "needles", "--model", str(checkpoint), "--contexts", "256", "--cases", "2", "--seed", "1",
                 "--tasks", "single", "--corpus", str(data.directory / "corpus"), "--out", str(out),
                 "--device", "cpu", "--trained-length", "256", "--depth-buckets", "2", "--index-cache-dtype", "fp8",
                 "--hf-overrides", '{"rope_parameters": {"rope_theta": 20000}}', "--cases-per-haystack", "2",
                 "--step-log", str(tmp_path / "steps.jsonl")])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "needles.json").read_text())
    assert report["per_haystack"] == 2  # both cases in one haystack
    # the step log: the first case prefills its whole prompt, the second only what its haystack's
    # cached blocks leave (the prefix cache served the rest)
    from megactx.engine.steplog import read

    prefills = [r["tokens"] for r in read(tmp_path / "steps.jsonl") if r["prefill"]]
    first, second = (o["prompt_tokens"] for o in report["outcomes"])
    assert len(prefills) == 2 and prefills[0] == first and 0 < prefills[1] < second // 2
    # the figure says what computed it: FP8 indexer keys change which keys a query selects, and a
    # config override (here the rope base) changes the model
    assert report["engine"] == ("PyTorch twins of the kernels, MLA cache float32, indexer cache FP8, "
                                "config rope_parameters.rope_theta=20000")
    outcomes = report["outcomes"]
    assert len(outcomes) == 2 and all(o["context"] == 256 for o in outcomes)
    assert [o["correct"] for o in outcomes] == [o["output"].strip() == o["answer"] for o in outcomes]
    accuracy = report["results"]["single"]["per_context"]["256"]["accuracy"]
    assert accuracy == sum(o["correct"] for o in outcomes) / 2
    assert (out / "needles.md").read_text().startswith("# Needle retrieval")
    assert "indexer cache FP8" in (out / "needles.md").read_text()
    assert (out / "needles.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_needles_shards_and_needles_merge_give_the_whole_runs_report(checkpoint, data, tmp_path, capsys):
    run = ["eval", "needles", "--model", str(checkpoint), "--contexts", "256", "--cases", "3", "--seed", "1",
           "--corpus", str(data.directory / "corpus"), "--device", "cpu", "--depth-buckets", "2"]
    for name, extra in (("whole", []), ("s0", ["--shard", "0/2"]), ("s1", ["--shard", "1/2"])):
        assert main([*run, *extra, "--out", str(tmp_path / name)]) == 0, capsys.readouterr().err
    assert len(json.loads((tmp_path / "s0" / "needles.json").read_text())["outcomes"]) == 2
    code = main(["eval", "needles-merge", str(tmp_path / "s1" / "needles.json"), str(tmp_path / "s0" / "needles.json"),
                 "--out", str(tmp_path / "merged")])
    assert code == 0, capsys.readouterr().err
    for name in ("needles.json", "needles.md"):
        assert (tmp_path / "merged" / name).read_text() == (tmp_path / "whole" / name).read_text()
    assert main(["eval", "needles-merge", str(tmp_path / "s0" / "needles.md"), "--out", str(tmp_path / "bad")]) == 2
    assert "not a needles.json" in capsys.readouterr().err


def test_eval_needles_resume_keeps_the_saved_cases(checkpoint, data, tmp_path, capsys):
    run = ["eval", "needles", "--model", str(checkpoint), "--contexts", "256", "--cases", "3", "--seed", "1",
           "--corpus", str(data.directory / "corpus"), "--device", "cpu", "--batch-size", "1", "--no-progress"]
    out = tmp_path / "run"
    assert main([*run, "--out", str(out), "--resume"]) == 0, capsys.readouterr().err  # nothing saved: a whole run
    assert "nothing to resume" in capsys.readouterr().err
    whole = json.loads((out / "needles.json").read_text())
    stopped = dict(whole, outcomes=whole["outcomes"][:2])  # as a run stopped in its third batch leaves it
    stopped["outcomes"][0] = dict(stopped["outcomes"][0], output="kept", correct=False)  # not run again: kept
    (out / "needles.json").write_text(json.dumps(stopped))
    assert main([*run, "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    assert "2 cases done" in capsys.readouterr().err
    resumed = json.loads((out / "needles.json").read_text())
    assert resumed["outcomes"] == stopped["outcomes"] + whole["outcomes"][2:]
    assert not list(out.glob("*.partial"))
    assert main([*run, "--seed", "2", "--out", str(out), "--resume"]) == 2
    assert "another evaluation: its seed is 1" in capsys.readouterr().err


def test_eval_needles_refuses_contexts_beyond_the_model(checkpoint, capsys):
    assert main(["eval", "needles", "--model", str(checkpoint), "--contexts", "2m", "--cases", "1"]) == 2
    assert "--contexts" in capsys.readouterr().err


@pytest.mark.parametrize("fraction", ["0", "1.5"])
def test_eval_needles_refuses_a_memory_fraction_outside_0_1(checkpoint, capsys, fraction):
    assert main(["eval", "needles", "--model", str(checkpoint), "--contexts", "256", "--cases", "1",
                 "--gpu-memory-utilization", fraction]) == 2
    assert "gpu_memory_utilization" in capsys.readouterr().err


def test_needle_recall_reads_the_full_layers_selection_at_the_answer_positions(data, small, tmp_path, capsys):
    """The teacher-forced verdict is the reference forward's argmax at the answer positions, and each
    flag says whether the reference forward's top-k of that full layer, at that position, holds a
    needle token equal to the one the position must produce."""
    from megactx import load_model
    from megactx.model.paged import kernel_ops
    from megactx.testing import make_random_checkpoint
    from megactx.train.needle_recall import answer_sources, recall_case

    path = make_random_checkpoint(tmp_path / "ckpt", vocab_size=VOCAB, num_hidden_layers=3, first_k_dense_replace=1,
                                  dtype=torch.float32, index_topk=16, index_topk_pattern="FSF")
    data.save_tokenizer(path)
    model = load_model(path)
    generator = needle_generator(path, corpus=small)
    for case in needle_cases(generator, STANDARD_TASKS["single"], 256, 3, seed=2):
        got = recall_case(model, kernel_ops("torch"), case, 256)
        caught = {}
        hooks = [model.model.layers[i].register_forward_hook(
            lambda m, a, out, i=i, caught=caught: caught.__setitem__(i, out[1])) for i in (0, 2)]
        ids = torch.tensor([case.input_ids + case.answer_ids[:-1]])
        with torch.no_grad():
            logits = model(ids)[0, len(case.input_ids) - 1:]  # the reference forward (no cache)
        for h in hooks:
            h.remove()
        assert got.correct == bool((logits.argmax(-1) == torch.tensor(case.answer_ids)).all())
        sources = answer_sources(case)
        assert any(len(s) for s in sources)  # the value's tokens are in the needle's line
        for layer in (0, 2):
            rows = caught[layer][0, len(case.input_ids) - 1:]
            assert got.selected[layer] == [bool(set(s.tolist()) & set(r.tolist())) for s, r in zip(sources, rows)
                                           if len(s)]
    out = tmp_path / "recall"
    assert main(["eval", "needle-recall", "--model", str(path), "--contexts", "256", "--cases", "2", "--device", "cpu",
                 "--corpus", str(data.directory / "corpus"), "--no-progress", "--out", str(out)]) == 0
    report = json.loads((out / "needle_recall.json").read_text())
    assert len(report["cases"]) == 2 and set(report["cases"][0]["selected"]) == {"0", "2"}
    assert "| 256 | 2 |" in (out / "needle_recall.md").read_text()
    assert main(["eval", "needle-recall", "--model", str(path), "--contexts", "2m"]) == 2
    assert "--contexts must be at most" in capsys.readouterr().err


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_bpb_of_the_paged_triton_forward_matches_the_reference_on_gpu(checkpoint, data):
    from megactx.train.evaluate import evaluate_bpb

    def bpb(backend):
        return evaluate_bpb(checkpoint, [256], data_dir=data.directory, max_tokens=2048, device="cuda",
                            dtype=torch.bfloat16, backend=backend, log=lambda _: None)[0]

    reference, paged = bpb("torch"), bpb("triton")
    assert paged["tokens"] == reference["tokens"] and paged["bytes"] == reference["bytes"]
    # bf16 activations and an FP8 indexer cache move the loss a little, never by percent
    assert paged["bits_per_byte"] == pytest.approx(reference["bits_per_byte"], rel=2e-2)


@pytest.mark.gpu
def test_eval_needles_runs_on_gpu_at_4k(checkpoint, data, tmp_path):
    out = tmp_path / "needles"
    assert main(["eval", "needles", "--model", str(checkpoint), "--contexts", "1k,4k", "--cases", "8", "--seed", "0",
                 "--tasks", "single,multihop", "--corpus", str(data.directory / "corpus"), "--out", str(out)]) == 0
    report = json.loads((out / "needles.json").read_text())
    assert len(report["outcomes"]) == 2 * 2 * 8
    assert all(o["correct"] == (o["output"].strip() == o["answer"]) for o in report["outcomes"])
