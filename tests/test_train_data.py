"""The training data pipeline: the stdlib file list is fixed and its split disjoint and path-determined,
the tokenizer round-trips text and loads with megactx's and transformers' loaders, packing covers every
token once and shards are disjoint, bits per byte follow the formula, and needle cases are exact in
length, place needles at the requested depth, and have answers that the prompt's own lines compute.

A small corpus (the held-out files and every 20th training file) and a 512-token vocabulary keep the
whole file to a few seconds."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from megactx.train.corpus import EXCLUDED_DIRS, Corpus, is_held_out
from megactx.train.data import (
    BitsPerByte,
    PackedDataset,
    TokenizedCorpus,
    bits_per_byte,
    document_stream,
    main,
    needle_generator,
    pack_sequences,
    prepare_data,
)
from megactx.train.needles import STANDARD_TASKS, NeedleDataset, NeedleTask
from megactx.train.tokenizer import (
    CHAT_TEMPLATE,
    END,
    SPECIAL_TOKENS,
    fingerprint,
    save_tokenizer,
    token_byte_lengths,
    train_tokenizer,
)

VOCAB = 512
NEEDLE_LINE = re.compile(r'^(key_[a-z]+_[a-z]+) = (?:"(\d+)"|(key_[a-z]+_[a-z]+))$', re.MULTILINE)


def _lines(text: str) -> list[str]:
    """`text` cut after every "\\n" (str.splitlines would also cut at "\\r", "\\x0c", ...)."""
    return [line + "\n" for line in text.split("\n")[:-1]]


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return Corpus.from_stdlib()


@pytest.fixture(scope="module")
def small(stdlib) -> Corpus:
    return stdlib.subset([f.path for f in stdlib.split("held_out")] + [f.path for f in stdlib.split("train")[::20]])


@pytest.fixture(scope="module")
def data(small, tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("data"), corpus=small, vocab_size=VOCAB)


# -- corpus ---------------------------------------------------------------------------------------

def test_file_list_is_sorted_filtered_and_stable(stdlib):
    paths = [f.path for f in stdlib.files]
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    assert all(p.endswith(".py") and not set(p.split("/")[:-1]) & set(EXCLUDED_DIRS) for p in paths)
    assert all(f.text.endswith("\n") for f in stdlib.files)
    assert Corpus.from_stdlib().sha256 == stdlib.sha256
    manifest = stdlib.manifest()
    assert manifest["num_files"] == len(paths) and [f["path"] for f in manifest["files"]] == paths
    assert sum(manifest["num_bytes"].values()) == sum(f.num_bytes for f in stdlib.files)


def test_split_is_disjoint_complete_and_decided_by_path(stdlib, small):
    train, held = ({f.path for f in stdlib.split(s)} for s in ("train", "held_out"))
    assert not train & held and train | held == {f.path for f in stdlib.files}
    assert all(f.held_out == is_held_out(f.path, stdlib.held_out_fraction) for f in stdlib.files)
    assert 0 < len(held) < 0.2 * len(stdlib.files)
    assert {f.path for f in small.split("held_out")} == held  # a subset keeps every file's split
    with pytest.raises(ValueError, match="split"):
        stdlib.split("validation")


def test_snapshot_loads_the_same_corpus_and_verify_names_differences(small, tmp_path):
    small.save_snapshot(tmp_path / "snap")
    loaded = Corpus.from_directory(tmp_path / "snap")
    assert loaded.sha256 == small.sha256 and loaded.split("held_out") == small.split("held_out")
    small.verify(tmp_path / "snap" / "manifest.json")
    other = small.subset([f.path for f in small.files[1:]])
    with pytest.raises(ValueError, match=small.files[0].path):
        other.verify(small.manifest())


# -- tokenizer ------------------------------------------------------------------------------------

def test_tokenizer_round_trips_text_and_loads_with_both_loaders(data, small):
    from transformers import AutoTokenizer

    from megactx.engine.tokenizer import Tokenizer
    from megactx.testing import CHAT_TEMPLATE as TESTING_TEMPLATE

    tok = data.tokenizer
    assert tok.get_vocab_size() == VOCAB
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    texts = [f.text for f in small.files[:5]] + ["naïve café — 東京 🚀\r\n\ttab 0123456789 \n\n  "]
    for text in texts:
        assert tok.decode(tok.encode(text).ids) == text
    ours, hf = Tokenizer(data.tokenizer_dir), AutoTokenizer.from_pretrained(str(data.tokenizer_dir))
    sample = texts[0][:2000] + "<|end|>"
    assert ours.encode(sample) == hf(sample, add_special_tokens=False)["input_ids"] == tok.encode(sample).ids
    assert hf.decode(ours.encode(texts[-1])) == texts[-1]
    assert hf.eos_token == END and ours.special_tokens["eos_token"] == END
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert CHAT_TEMPLATE == TESTING_TEMPLATE  # one chat format for random and trained checkpoints
    assert rendered == "<|system|>\nbe brief<|end|>\n<|user|>\ndef f(x):<|end|>\n<|assistant|>\n"


def test_tokenizer_training_is_deterministic_and_checks_vocab_size(small, tmp_path):
    texts = [f.text for f in small.split("held_out")]
    first, second = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert first.to_str() == second.to_str()
    save_tokenizer(first, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, 100)


def test_no_token_spans_a_line_boundary(data, small):
    """What the needle haystacks rely on: a text's ids are its lines' ids, one after another."""
    tok = data.tokenizer
    for f in small.files[:4]:
        lines = _lines(f.text)
        per_line = [i for line in lines for i in tok.encode(line).ids]
        assert tok.encode(f.text).ids == per_line


def test_token_byte_lengths_add_up_to_the_text_bytes(data):
    lengths = token_byte_lengths(data.tokenizer)
    assert (lengths[: len(SPECIAL_TOKENS)] == 0).all() and (lengths[len(SPECIAL_TOKENS) :] > 0).all()
    for name in ("train", "held_out"):
        split = data.split(name)
        assert int(lengths[torch.from_numpy(split.tokens.astype(np.int64))].sum()) == split.num_bytes


def test_token_cache_reloads_identically_and_marks_lines(data, small):
    again = TokenizedCorpus.load_or_build(small, data.tokenizer, data.directory)
    assert len(list(data.directory.glob("tokens-*.npz"))) == 1
    for name in ("tokens", "file_starts", "line_starts", "held_out"):
        assert np.array_equal(getattr(again, name), getattr(data.tokens, name))
    split = data.split("held_out")
    starts = split.line_starts
    lines = [data.tokenizer.decode(split.tokens[a:b].tolist()) for a, b in zip(starts, starts[1:])]
    text = "".join(f.text for f in small.split("held_out"))
    assert "".join(lines) == text and lines == _lines(text)


def test_prepare_data_reuses_its_directory_and_refuses_another_corpus(data, small):
    again = prepare_data(data.directory, corpus=small, vocab_size=VOCAB)
    assert again.tokenizer.to_str() == data.tokenizer.to_str()
    with pytest.raises(ValueError, match="another corpus"):
        prepare_data(data.directory, corpus=small.subset([f.path for f in small.files[1:]]), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_data(data.directory, corpus=small, vocab_size=VOCAB * 2)


def test_a_model_s_tokenizer_prepares_its_data_and_another_is_refused(data, small, tmp_path):
    """Training a model further (megactx train --init) needs its own token ids: a new data directory
    takes the model's tokenizer instead of training one, and one with another tokenizer is refused."""
    from megactx.train.recipe import prepare_recipe_data, tiny_recipe

    other = train_tokenizer([f.text for f in small.split("held_out")], VOCAB)  # another corpus, other ids
    assert fingerprint(other) != fingerprint(data.tokenizer)
    save_tokenizer(other, tmp_path / "model")
    small.save_snapshot(tmp_path / "data" / "corpus")
    recipe = tiny_recipe()
    recipe = dataclasses.replace(recipe, model=recipe.model.replace(vocab_size=VOCAB))
    _, taken, files = prepare_recipe_data(recipe, tmp_path / "data", tmp_path / "run", init=tmp_path / "model")
    assert fingerprint(taken.tokenizer) == fingerprint(other)  # taken, not trained
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json") in files
    own = tmp_path / "own"  # the same corpus with its own tokenizer
    small.save_snapshot(own / "corpus")
    prepare_data(own, vocab_size=VOCAB, tokenizer=data.tokenizer)
    with pytest.raises(ValueError, match="another tokenizer than --init .*model's"):
        prepare_recipe_data(recipe, own, tmp_path / "run2", init=tmp_path / "model")
    with pytest.raises(ValueError, match="the run's tokenizer"):  # a run trained with another tokenizer
        prepare_recipe_data(recipe, own, tmp_path / "run")
    main([str(tmp_path / "cli"), "--corpus", str(tmp_path / "data" / "corpus"), "--tokenizer", str(tmp_path / "model")])
    assert fingerprint(prepare_data(tmp_path / "cli", vocab_size=VOCAB, corpus=small).tokenizer) == fingerprint(other)
    with pytest.raises(SystemExit, match="2"):  # a directory without tokenizer.json: an error, no traceback
        main([str(tmp_path / "none"), "--tokenizer", str(tmp_path / "data")])


def test_processes_preparing_one_directory_at_once_all_get_it(data, small, tmp_path):
    """Stages started side by side from --init on a fresh machine prepare the same data directory at
    once: each process succeeds with the same tokenizer, and no partial file is left."""
    import subprocess
    import sys

    small.save_snapshot(tmp_path / "data" / "corpus")
    data.save_tokenizer(tmp_path / "model")
    code = ("import sys; from megactx.train.data import prepare_data; from megactx.train.tokenizer import "
            "fingerprint, load_tokenizer; tok = load_tokenizer(sys.argv[2]); "
            "print(fingerprint(prepare_data(sys.argv[1], vocab_size=tok.get_vocab_size(), tokenizer=tok).tokenizer))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "data"), str(tmp_path / "model")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-400:] for _, err in results]
    assert {out.strip() for out, _ in results} == {fingerprint(data.tokenizer)}
    assert not list((tmp_path / "data").glob("*partial*"))


def test_a_prepared_directory_that_cannot_be_written_still_loads(data, small, monkeypatch):
    """The lock is a file in the directory: where it cannot be made (a shared, read-only data
    directory), the prepared directory is read without one."""
    import builtins

    import megactx.train.data as data_module

    real_open = builtins.open

    def read_only(path, mode="r", *args, **kwargs):
        if "r" not in mode:
            raise PermissionError(13, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(data_module, "open", read_only, raising=False)
    again = prepare_data(data.directory, corpus=small, vocab_size=VOCAB)
    assert fingerprint(again.tokenizer) == fingerprint(data.tokenizer)


# -- packing, sharding, bits per byte -------------------------------------------------------------

def test_packed_rows_overlap_by_one_so_every_token_is_a_target_once():
    stream = torch.arange(23)
    rows = pack_sequences(stream, seq_len=5)  # (23 - 1) // 5 = 4 rows of 6
    assert rows.shape == (4, 6)
    assert torch.equal(rows[:, 1:].flatten(), torch.arange(1, 21))
    assert torch.equal(rows[1:, 0], rows[:-1, -1])
    with pytest.raises(ValueError, match="seq_len"):
        pack_sequences(stream, seq_len=30)


def test_document_stream_holds_every_document_once_in_a_seeded_order(data):
    split, end = data.split("train"), data.end_id
    stream = document_stream(split, end, seed=0)
    assert len(stream) == split.num_tokens + len(split.paths) and int((stream == end).sum()) == len(split.paths)
    docs = sorted(tuple(d.tolist()) for d in torch.tensor_split(stream, torch.nonzero(stream == end).flatten() + 1)
                  if len(d))
    assert docs == sorted(tuple(split.document(j).tolist()) + (end,) for j in range(len(split.paths)))
    assert torch.equal(stream, document_stream(split, end, seed=0))
    assert not torch.equal(stream, document_stream(split, end, seed=1))


def test_shards_are_disjoint_equal_and_deterministic(data):
    seq_len, world = 64, 3
    rows = data.pretraining_sequences(seq_len, seed=5)
    shards = [data.pretraining_dataset(seq_len, seed=5, rank=r, world_size=world) for r in range(world)]
    assert {len(s) for s in shards} == {len(rows) // world}
    taken = [int(i) for s in shards for i in s.rows]
    assert len(set(taken)) == len(taken)
    example = shards[1][0]
    assert example["input_ids"].shape == (seq_len + 1,) and example["loss_mask"].shape == (seq_len,)
    assert example["input_ids"].dtype == torch.int64 and bool(example["loss_mask"].all())
    assert torch.equal(example["input_ids"], rows[shards[1].rows[0]])
    batch = next(iter(torch.utils.data.DataLoader(shards[0], batch_size=4)))
    assert batch["input_ids"].shape == (4, seq_len + 1)
    again = data.pretraining_dataset(seq_len, seed=5, rank=1, world_size=world)
    assert torch.equal(again.rows, shards[1].rows)
    with pytest.raises(ValueError, match="rank"):
        PackedDataset(rows, rank=3, world_size=3)


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_over_bytes_per_token(data):
    seq = data.pretraining_sequences(128, split="held_out")[:4]  # [4, 129]
    inputs, targets = seq[:, :-1], seq[:, 1:]
    logits = torch.zeros(*inputs.shape, VOCAB)
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    meter = data.bits_per_byte()
    meter.update(nll, targets.flatten())
    lengths = token_byte_lengths(data.tokenizer)[targets]
    text_tokens = int((lengths > 0).sum())  # <|end|> between documents counts neither loss nor bytes
    assert meter.num_bytes == int(lengths.sum())
    assert meter.value == pytest.approx(text_tokens * math.log2(VOCAB) / int(lengths.sum()), rel=1e-6)  # nll is fp32
    assert bits_per_byte(math.log(2) * 10, 10) == pytest.approx(1.0)
    masked = BitsPerByte(token_byte_lengths(data.tokenizer))
    masked.update(nll, targets.flatten(), mask=torch.zeros_like(targets.flatten(), dtype=torch.bool))
    assert masked.num_bytes == 0


# -- needle tasks ---------------------------------------------------------------------------------

def _needle_lines(text: str) -> list[tuple[str, str | None, str | None]]:
    return NEEDLE_LINE.findall(text)


def _resolve(text: str, name: str) -> str:
    """Run the prompt's needle lines as Python, in prompt order, and read `name`."""
    namespace: dict = {}
    exec("".join(f"{m.group(0)}\n" for m in NEEDLE_LINE.finditer(text)), namespace)
    return namespace[name]


ALL_TASKS = [*STANDARD_TASKS.values(), NeedleTask("multihop", hops=4, num_distractors=2),
             NeedleTask("multiquery", num_needles=6, num_queries=3, chat=False)]


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: t.label)
def test_needle_answer_is_what_the_prompt_computes(data, task):
    gen, tok = data.needles(), data.tokenizer
    for seed in range(3):
        case = gen.case(task, 600, depth=seed / 2, seed=seed)
        text = tok.decode(case.input_ids, skip_special_tokens=False)
        found = _needle_lines(text)
        assert len(found) == task.num_names == len(case.needles)  # the haystack holds no needle of its own
        asked = re.findall(r"key_[a-z]+_[a-z]+", case.question)
        assert ", ".join(_resolve(text, name) for name in asked) == case.answer
        assert tok.decode(case.answer_ids, skip_special_tokens=True).strip() == case.answer
        assert case.answer_ids[-1] == data.end_id and case.is_correct(case.answer + END)
        assert not case.is_correct(case.answer[:-1])
        for needle in case.needles:
            at = case.input_ids[needle.position : needle.position + len(tok.encode(needle.text).ids)]
            assert tok.decode(at) == needle.text
        if task.num_distractors:
            distractors = [n.name for n in case.needles if n.role == "distractor"]
            assert all(len(set(d.split("_")) & set(asked[0].split("_"))) == 2 for d in distractors)  # one word off


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: t.label)
def test_one_value_questions_end_with_the_asked_needles_lead(data, task):
    """single / multikey prompts end with `name = "` of the asked needle, tokenized as in its needle
    line, so the answer continues it; multi-query and multi-hop prompts end at the question."""
    gen, tok = data.needles(), data.tokenizer
    case = gen.case(task, 400, depth=0.3, seed=1)
    text = tok.decode(case.input_ids, skip_special_tokens=False)
    asked = next(n for n in case.needles if n.role == "asked")
    lead = f'{asked.name} = "'
    if task.kind in ("single", "multikey"):
        assert text.endswith(lead) and task.label == NeedleTask(**{**task.__dict__, "lead": True}).label
        lead_ids = tok.encode(lead, add_special_tokens=False).ids
        assert case.input_ids[-len(lead_ids):] == lead_ids == case.input_ids[asked.position:][:len(lead_ids)]
        plain = gen.case(dataclasses.replace(task, lead=False), 400, depth=0.3, seed=1)
        assert not tok.decode(plain.input_ids, skip_special_tokens=False).endswith(lead)
        assert plain.answer == case.answer and plain.task.label.endswith("-nolead")
    else:
        assert not text.endswith(lead) and "-nolead" not in dataclasses.replace(task, lead=False).label


def test_multihop_chain_is_in_order_and_ends_at_the_value(data):
    case = data.needles().case(NeedleTask("multihop", hops=3), 800, depth=0.2, seed=7)
    chain = [n for n in case.needles if n.role == "asked"]
    assert len(chain) == 4 and chain[0].text.endswith(f'"{case.answer}"\n')
    assert [n.position for n in chain] == sorted(n.position for n in chain)
    for prev, link in zip(chain, chain[1:]):
        assert link.text == f"{link.name} = {prev.name}\n"
    assert chain[-1].name in case.question


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.37, 0.5, 0.9, 1.0])
def test_needle_sits_at_the_line_boundary_nearest_the_requested_depth(data, depth):
    tok = data.tokenizer
    case = data.needles().case(NeedleTask(), 1500, depth=depth, seed=3)
    (needle,) = case.needles
    needle_len = len(tok.encode(needle.text).ids)
    # the haystack is what lies between the "<|user|>\n" prefix and the question, minus the needle
    prefix = len(tok.encode("<|user|>\n").ids)
    hay = case.input_ids[prefix : needle.position] + case.input_ids[needle.position + needle_len :]
    hay = hay[: case.haystack_len]
    assert tok.decode(hay[: case.haystack_len]).endswith("\n") and needle.offset == needle.position - prefix
    boundaries = [0] + [i + 1 for i, t in enumerate(hay) if tok.id_to_token(t).endswith("\u010a")]
    assert needle.offset in boundaries
    target = depth * case.haystack_len
    assert abs(needle.offset - target) == min(abs(b - target) for b in boundaries)


@pytest.mark.parametrize("task", [STANDARD_TASKS["single"], STANDARD_TASKS["multiquery"],
                                  NeedleTask("multihop", hops=2, chat=False)], ids=lambda t: t.label)
@pytest.mark.parametrize("length", [300, 1000, 4096])
def test_needle_prompt_length_is_exact(data, task, length):
    gen, tok = data.needles(), data.tokenizer
    case = gen.case(task, length, depth=0.5, seed=1)
    assert len(case.input_ids) == length
    assert abs(len(tok.encode(tok.decode(case.input_ids, skip_special_tokens=False)).ids) - length) <= 2
    train = gen.case(task, length, depth=0.5, seed=1, length_includes_answer=True)
    example = train.training_example()
    assert example["input_ids"].shape == (length,) and example["loss_mask"].shape == (length - 1,)
    targets = example["input_ids"][1:][example["loss_mask"]]
    assert targets.tolist() == train.answer_ids


def test_haystack_longer_than_the_split_wraps_around(data):
    split = data.split("held_out")
    length = 2 * split.num_tokens + 1000
    case = data.needles("held_out").case(STANDARD_TASKS["multikey"], length, depth=0.75, seed=0)
    assert len(case.input_ids) == length
    asked = next(n for n in case.needles if n.role == "asked")
    assert asked.offset == pytest.approx(0.75 * case.haystack_len, abs=200)


def test_needle_cases_are_deterministic_and_spread_over_depths(data):
    gen = data.needles()
    task = STANDARD_TASKS["distractors"]
    cases = list(gen.cases(task, 500, num_cases=5, seed=11))
    assert [c.needles for c in cases] == [c.needles for c in gen.cases(task, 500, num_cases=5, seed=11)]
    assert [c.input_ids for c in cases] == [c.input_ids for c in gen.cases(task, 500, num_cases=5, seed=11)]
    assert [c.input_ids for c in cases] != [c.input_ids for c in gen.cases(task, 500, num_cases=5, seed=12)]
    depths = [next(n.depth for n in c.needles if n.role == "asked") for c in cases]
    assert depths == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert len({c.answer for c in cases}) == len(cases)


def test_cases_of_a_shared_haystack_differ_only_in_their_question(data):
    gen, tok = data.needles(), data.tokenizer
    task, depths = STANDARD_TASKS["single"], [0.0, 0.3, 0.6, 1.0]
    cases = gen.shared_haystack_cases(task, 700, depths, seed="h")
    assert max(len(c.input_ids) for c in cases) == 700 and len({c.haystack_len for c in cases}) == 1
    first = cases[0].needles[0]  # in haystack order: its position less its offset is the prefix
    body = first.position - first.offset + cases[0].haystack_len + sum(n.length for n in cases[0].needles)
    shared = cases[0].input_ids[:body]
    for case, depth in zip(cases, depths):
        assert case.input_ids[:len(shared)] == shared  # one prefill serves them all
        text = tok.decode(case.input_ids, skip_special_tokens=False)
        assert len(_needle_lines(text)) == len(depths) == len(case.needles)  # every case's needle, no other
        (asked,) = [n for n in case.needles if n.role == "asked"]
        assert asked.depth == depth and asked.name in case.question and _resolve(text, asked.name) == case.answer
        assert asked.offset == pytest.approx(depth * case.haystack_len, abs=80)  # the nearest line boundary
        assert text.endswith(f'{asked.name} = "')  # the lead of its own needle
    assert len({c.answer for c in cases}) == len({n.name for n in cases[0].needles}) == len(depths)
    assert all(c.input_ids[body:] != cases[0].input_ids[body:] for c in cases[1:])  # each its own question
    with pytest.raises(ValueError, match="single task"):
        gen.shared_haystack_cases(STANDARD_TASKS["multikey"], 700, depths, seed=0)
    with pytest.raises(ValueError, match="depths"):
        gen.shared_haystack_cases(task, 700, [0.5, 1.5], seed=0)


def test_cases_per_haystack_spread_each_haystack_over_depths_and_shards_make_the_same_cases(data):
    from megactx.train.needles import haystack_groups

    gen, task = data.needles(), STANDARD_TASKS["single"]
    cases = list(gen.cases(task, 400, num_cases=7, seed=3, per_haystack=3))  # 3 haystacks: cases {0,3,6} {1,4} {2,5}
    assert [next(n.depth for n in c.needles if n.role == "asked") for c in cases] == pytest.approx(
        np.linspace(0, 1, 7).tolist())
    assert [len(c.needles) for c in cases] == [3, 2, 2, 3, 2, 2, 3]
    assert cases[0].input_ids[:300] == cases[3].input_ids[:300] == cases[6].input_ids[:300]
    assert cases[0].input_ids[:300] != cases[1].input_ids[:300]
    assert haystack_groups(range(7), 7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert haystack_groups([6, 5, 4], 7, 3) == [[6], [5], [4]] and haystack_groups([2, 0], 7, 1) == [[2], [0]]
    # any subset, in any order, gets the cases of the whole run
    some = list(gen.cases(task, 400, num_cases=7, seed=3, indices=[6, 1, 3], per_haystack=3))
    assert [c.input_ids for c in some] == [cases[6].input_ids, cases[1].input_ids, cases[3].input_ids]
    assert [c.input_ids for c in gen.cases(task, 400, 7, seed=3)] != [c.input_ids for c in cases]


def test_needle_task_rejects_impossible_settings(data):
    with pytest.raises(ValueError, match="kind"):
        NeedleTask("haystack")
    with pytest.raises(ValueError, match="multikey"):
        NeedleTask(num_needles=3)
    with pytest.raises(ValueError, match="num_queries"):
        NeedleTask("multiquery", num_needles=2, num_queries=3)
    with pytest.raises(ValueError, match="length"):
        data.needles().case(STANDARD_TASKS["multiquery"], 40, depth=0.5, seed=0)
    with pytest.raises(ValueError, match="depth"):
        data.needles().case(STANDARD_TASKS["single"], 400, depth=1.5, seed=0)


def test_needle_dataset_gives_exact_length_examples_split_between_ranks(data):
    seq_len = 300
    ranks = [NeedleDataset(data.needles("train"), seq_len, num_examples=10, seed=2, rank=r, world_size=2)
             for r in range(2)]
    assert [len(r) for r in ranks] == [5, 5]
    examples = [r[i] for r in ranks for i in range(len(r))]
    assert all(e["input_ids"].shape == (seq_len + 1,) and e["loss_mask"].shape == (seq_len,) for e in examples)
    assert all(0 < int(e["loss_mask"].sum()) < seq_len // 4 for e in examples)
    assert len({tuple(e["input_ids"].tolist()) for e in examples}) == len(examples)
    assert torch.equal(ranks[1][2]["input_ids"], NeedleDataset(data.needles("train"), seq_len, 10, seed=2, rank=1,
                                                                world_size=2)[2]["input_ids"])
    batch = next(iter(torch.utils.data.DataLoader(ranks[0], batch_size=5)))
    assert batch["input_ids"].shape == (5, seq_len + 1)


def test_needle_generator_serves_any_checkpoint_tokenizer(data, small, tmp_path):
    checkpoint = data.save_tokenizer(tmp_path / "ckpt")
    gen = needle_generator(checkpoint, split="held_out", corpus=small, cache_dir=tmp_path / "cache")
    case = next(gen.cases(STANDARD_TASKS["single"], 700, num_cases=3, seed=0))
    assert case.input_ids == next(data.needles("held_out").cases(STANDARD_TASKS["single"], 700, 3, seed=0)).input_ids
    assert len(list((tmp_path / "cache").glob("tokens-*.npz"))) == 1


def test_command_line_prepares_a_directory_from_its_snapshot(small, tmp_path, capsys):
    small.save_snapshot(tmp_path / "data" / "corpus")  # DIR/corpus/ is used instead of the stdlib
    main([str(tmp_path / "data"), "--vocab-size", "300"])
    out = capsys.readouterr().out
    assert f"{len(small.files)} files" in out and "held_out" in out and "bytes/token" in out
    assert (tmp_path / "data" / "tokenizer" / "tokenizer.json").is_file()
    prepare_data(tmp_path / "data", vocab_size=300).corpus.verify(small.manifest())
