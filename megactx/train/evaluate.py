"""`megactx eval`: held-out bits per byte and needle-retrieval accuracy of any checkpoint.

    megactx eval bpb --model runs/dense --model runs/dsa --model runs/indexshare --contexts 4k --out runs/eval
    megactx eval needles --model runs/tiny/export --contexts 4k,16k,64k --cases 200 --seed 1 --out runs/eval
    megactx eval needle-recall --model runs/tiny/export --contexts 64k --cases 100   # indexer or attention?
    megactx eval needles --model M --contexts 1m --shard 0/2 --out runs/eval/s0   # half the cases here,
    megactx eval needles --model M --contexts 1m --shard 1/2 --out runs/eval/s1   # half there (another GPU),
    megactx eval needles-merge runs/eval/s0/needles.json runs/eval/s1/needles.json --out runs/eval/1m
    megactx eval needles --model M --contexts 1m --shard 0/2 --out runs/eval/s0 --resume   # after a stop

Every evaluation takes --model, --contexts and --seed, so anyone can run it on fresh cases and on
other checkpoints.

bpb: the held-out split of the code corpus, tokenized with the model's own tokenizer, documents in
the order hashed from --seed, packed into rows of --contexts tokens (+1), scored by the reference
forward (batched, no grad). Bits per byte do not depend on the tokenizer, so models with different
vocabularies compare. With the tokenizer of a prepared data directory the rows are exactly
`prepare_data(dir).pretraining_sequences(seq_len, "held_out", seed)`.

needles: `NeedleGenerator.cases(task, length, cases, seed)` per task and context, greedy decoding
with the engine (token-id prompts, temperature 0), exact match (`NeedleCase.is_correct`). A case at
context L has a prompt of L minus the task's answer budget, so prompt and answer fit in L tokens.
Writes needles.json, needles.md and needles.png (accuracy vs context; depth x context heatmaps).
A shard (--shard I/N) runs cases I, I + N, I + 2N, ... of each task and context, the same cases as
in the whole run; `needles-merge` joins shards' (or other contexts') needles.json into one report.
needles.json is saved after every batch: a run stopped (a time limit, a lost machine) continues
with the same command and --resume, losing at most the batch it was in.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from megactx.analysis.flops import context_label, parse_context
from megactx.train.needles import STANDARD_TASKS, NeedleCase, NeedleGenerator, NeedleTask, haystack_groups

PROG = "megactx eval"
CONTEXT_LADDER = (1 << 12, 1 << 14, 1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20)  # 4K, 16K, 64K, 128K ... 1M
DEFAULT_BPB_CONTEXT = "1k"
DEFAULT_CASES = 200  # the issue asks for at least 200 cases a context
DEFAULT_DEPTH_BUCKETS = 10
DEFAULT_THRESHOLD = 0.95  # accuracy a context must reach to count as "holds"
ANSWER_SLACK = 4  # tokens decoded beyond the expected answer, so a longer wrong answer is seen as wrong
Z_95 = 1.959963984540054  # two-sided 95% normal quantile, for Wilson intervals


# ------------------------------------------------------------------------------ shared helpers
def parse_contexts(text: str) -> list[int]:
    """"4k,16k,1m" -> [4096, 16384, 1048576] (k = 1024, m = 1024**2; plain numbers are tokens),
    sorted and without repeats."""
    try:
        return sorted(set(parse_context(text)))
    except ValueError as e:
        raise ValueError(f"--contexts takes lengths like 4k,16k,1m or 4096: {e}") from None


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion: (low, high); (0, 1) for total = 0."""
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    denom = 1 + z * z / total
    center = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------ bits per byte
def held_out_corpus(corpus=None):
    """The held-out files of `corpus` (default: this interpreter's stdlib) as a Corpus of their own:
    files are tokenized one by one, so their ids are the same as in the whole corpus, in a
    twentieth of the time."""
    from megactx.train.corpus import Corpus

    corpus = corpus or Corpus.from_stdlib()
    return corpus.subset([f.path for f in corpus.split("held_out")])


def held_out_rows(tokenizer, seq_len: int, seed: int = 0, data_dir: str | Path | None = None) -> torch.Tensor:
    """[N, seq_len + 1] int64: the held-out split tokenized with `tokenizer` (a tokenizers.Tokenizer),
    documents ordered by `seed`, packed as training packs them. data_dir: a prepared data directory,
    whose corpus snapshot (else the stdlib, checked against its manifest) and token cache are used;
    None: the held-out files of this interpreter's stdlib, tokenized without a cache."""
    from megactx.train.corpus import MANIFEST, Corpus
    from megactx.train.data import CORPUS_SNAPSHOT, TokenizedCorpus, document_stream, pack_sequences
    from megactx.train.tokenizer import END

    if data_dir is not None:
        data_dir = Path(data_dir)
        snapshot = data_dir / CORPUS_SNAPSHOT
        corpus = Corpus.from_directory(snapshot) if (snapshot / MANIFEST).is_file() else Corpus.from_stdlib()
        if (data_dir / MANIFEST).is_file():
            try:
                corpus.verify(data_dir / MANIFEST)
            except ValueError as e:
                raise ValueError(f"--data-dir {data_dir} was prepared from another corpus than this machine "
                                 f"reads: {e}; copy its corpus/ snapshot along") from None
        tokens = TokenizedCorpus.load_or_build(corpus, tokenizer, data_dir)
    else:
        tokens = TokenizedCorpus.build(held_out_corpus(), tokenizer)
    end_id = tokenizer.token_to_id(END)
    if end_id is None:
        raise ValueError(f"the model's tokenizer has no {END} token; bpb needs megactx's document separator")
    return pack_sequences(document_stream(tokens.split("held_out"), end_id, seed), seq_len)


@torch.inference_mode()
def bits_per_byte_of(model: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, byte_lengths: torch.Tensor,
                     batch_size: int = 8, max_tokens: int | None = None,
                     device: str | torch.device = "cpu") -> dict[str, float]:
    """Held-out bits per byte of `model` on `rows`.

    model: input_ids [B, L] int64 -> logits [B, L, vocab]. rows: [N, L + 1] int64 (row[:-1] is read,
    row[1:] predicted). byte_lengths: [vocab] int64 bytes of text per token (0 for special tokens,
    which count neither loss nor bytes). max_tokens: score only the first ceil(max_tokens / L) rows.
    Returns {"bits_per_byte", "nats_per_token", "tokens", "bytes", "rows"}."""
    from megactx.train.data import BitsPerByte

    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    seq_len = rows.shape[1] - 1
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
        rows = rows[: -(-max_tokens // seq_len)]
    meter = BitsPerByte(byte_lengths)
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size].to(device)  # [B, L + 1]
        logits = model(batch[:, :-1]).float()  # [B, L, vocab]
        targets = batch[:, 1:]  # [B, L]
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        meter.update(nll, targets.flatten())
    nats, num_bytes, num_tokens = (float(v) for v in meter.totals)
    return {"bits_per_byte": meter.value, "nats_per_token": nats / max(num_tokens, 1.0), "tokens": int(num_tokens),
            "bytes": int(num_bytes), "rows": len(rows)}


def evaluate_bpb(model_dir: str | Path, contexts: Sequence[int], seed: int = 0, data_dir: str | Path | None = None,
                 batch_size: int = 8, max_tokens: int | None = None, device: str | None = None,
                 dtype: torch.dtype | None = None, backend: str = "torch", log: Callable[[str], object] = print,
                 hf_overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One result dict (see `bits_per_byte_of`, plus "model", "context", "seed") per context for
    the checkpoint `model_dir` (which must hold its tokenizer.json); hf_overrides: config fields
    changed first (`megactx.config.apply_overrides`), named in "model"."""
    from megactx.config import describe_overrides
    from megactx.model.weights import load_model
    from megactx.train.tokenizer import load_tokenizer, token_byte_lengths

    device = device or _default_device()
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, device=device, dtype=dtype, backend=backend, hf_overrides=hf_overrides)
    name = f"{model_dir} ({describe_overrides(hf_overrides)})" if hf_overrides else str(model_dir)
    if tokenizer.get_vocab_size() > model.cfg.vocab_size:
        raise ValueError(f"{model_dir}: tokenizer.json has {tokenizer.get_vocab_size()} tokens but the model only "
                         f"{model.cfg.vocab_size}; the checkpoint's tokenizer does not belong to it")
    byte_lengths = token_byte_lengths(tokenizer)
    results = []
    for seq_len in contexts:
        rows = held_out_rows(tokenizer, seq_len, seed, data_dir)
        result = bits_per_byte_of(model, rows, byte_lengths, batch_size, max_tokens, device)
        results.append({"model": name, "context": seq_len, "seed": seed, **result})
        log(f"{name} @ {context_label(seq_len)}: {result['bits_per_byte']:.4f} bits/byte "
            f"({result['tokens']} tokens, {result['bytes']} bytes)")
    return results


def model_label(model: str | Path) -> str:
    """A short name for a checkpoint path: its directory, or the stage above a `checkpoint` dir."""
    path = Path(model)
    return path.parent.name if path.name == "checkpoint" and path.parent.name else path.name


def bpb_markdown(results: Sequence[dict[str, Any]]) -> str:
    """One row per (model, context); "vs first" compares with the first model at the same context."""
    first = {}
    for r in results:
        first.setdefault(r["context"], r["bits_per_byte"])
    lines = ["# Held-out bits per byte", "", "| model | context | bits/byte | vs first | nats/token | tokens | bytes |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rel = r["bits_per_byte"] / first[r["context"]] - 1
        lines.append(f"| {r['model']} | {context_label(r['context'])} | {r['bits_per_byte']:.4f} | {rel:+.2%} | "
                     f"{r['nats_per_token']:.4f} | {r['tokens']} | {r['bytes']} |")
    return "\n".join(lines) + "\n"


def bpb_plot(results: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Bits per byte, one group of bars per context, one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    contexts = sorted({r["context"] for r in results})
    value = {(r["model"], r["context"]): r["bits_per_byte"] for r in results}
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(2 + 1.2 * len(models) * len(contexts), 4))
    for i, model in enumerate(models):
        xs = [c + (i - (len(models) - 1) / 2) * width for c in range(len(contexts))]
        ys = [value.get((model, c), float("nan")) for c in contexts]
        bars = ax.bar(xs, ys, width, label=model_label(model))
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(range(len(contexts)), [context_label(c) for c in contexts])
    low = min(value.values())
    ax.set(xlabel="context (tokens)", ylabel="held-out bits per byte", ylim=(low * 0.9, max(value.values()) * 1.03),
           title="held-out bits per byte (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ needles
class Answerer(Protocol):
    """Answers needle cases: one decoded completion per case, in order."""

    def __call__(self, cases: Sequence[NeedleCase]) -> list[str]: ...


def _batches(generator: NeedleGenerator, task: NeedleTask, context: int, num_cases: int, seed: int,
             todo: list[int], batch_size: int, per_haystack: int) -> Iterator[list[tuple[int, NeedleCase]]]:
    """(index, case) batches of the `todo` cases: batch_size at a time, or, when cases share
    haystacks, a haystack's first case alone and then its others batch_size at a time."""
    groups = haystack_groups(todo, num_cases, per_haystack)
    order = [i for group in groups for i in group]
    cases = zip(order, needle_cases(generator, task, context, num_cases, seed, order, per_haystack))
    if per_haystack == 1:
        while batch := list(itertools.islice(cases, batch_size)):
            yield batch
        return
    for group in groups:
        members = list(itertools.islice(cases, len(group)))
        yield members[:1]  # its prefill leaves the haystack in the prefix cache for the others
        for start in range(1, len(members), batch_size):
            yield members[start:start + batch_size]


class EngineAnswerer:
    """Greedy completions of the cases' token-id prompts with a `megactx.LLM`: at most the answer's
    tokens + ANSWER_SLACK, stopping at the answer's final `<|end|>`. use_tqdm: the engine's progress
    bar (prompt tokens prefilled) for each call, where nothing else shows the prefill's progress."""

    def __init__(self, llm, use_tqdm: bool = False):
        self.llm = llm
        self.use_tqdm = use_tqdm

    def __call__(self, cases: Sequence[NeedleCase]) -> list[str]:
        from megactx import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=len(c.answer_ids) + ANSWER_SLACK,
                                 stop_token_ids=[c.answer_ids[-1]]) for c in cases]
        outs = self.llm.generate([c.input_ids for c in cases], params, use_tqdm=self.use_tqdm)
        return [o.text for o in outs]


def answer_budget(task: NeedleTask) -> int:
    """Tokens an answer of `task` may take: at most one a character of its text (byte-level BPE
    never takes more), a leading space (plain prompts), `<|end|>` and the decoding slack."""
    num_values = task.num_queries if task.kind == "multiquery" else 1
    chars = num_values * task.value_digits + len(", ") * (num_values - 1)
    return chars + 2 + ANSWER_SLACK


def case_depths(num_cases: int) -> np.ndarray:
    """[num_cases] the requested depth of each case of `NeedleGenerator.cases` (its contract:
    evenly spaced over [0, 1], 0.5 for a single case)."""
    return np.linspace(0.0, 1.0, num_cases) if num_cases > 1 else np.array([0.5])


@dataclass
class NeedleOutcome:
    task: str  # NeedleTask.label
    context: int  # the context the case was made for (prompt + answer budget)
    index: int  # case index within (task, context)
    depth: float  # requested depth of the first asked needle, in [0, 1]
    prompt_tokens: int
    answer: str
    output: str
    correct: bool


@dataclass
class NeedleReport:
    """Outcomes of every case, and the summaries the reports show."""

    model: str
    seed: int
    contexts: list[int]
    tasks: list[str]
    depth_buckets: int
    threshold: float
    trained_length: int | None
    outcomes: list[NeedleOutcome] = field(default_factory=list)
    engine: str = ""  # how the answers were computed (backend, cache formats): a figure depends on it
    num_cases: int = 0  # cases asked for a task and context (a shard holds some of them; 0: not recorded)
    per_haystack: int = 1  # cases sharing one haystack (NeedleGenerator.cases)

    # what the reports of one evaluation share, so that their outcomes may be merged
    SAME = ("model", "seed", "tasks", "depth_buckets", "threshold", "trained_length", "engine", "num_cases",
            "per_haystack")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NeedleReport:
        """The report that `to_json` wrote. Files from before num_cases was recorded (whole runs, no
        shards) take the most cases any task and context has."""
        trained = data["trained_length"]
        report = cls(data["model"], data["seed"], list(data["contexts"]), list(data["tasks"]), data["depth_buckets"],
                     data["threshold"], trained["length"] if trained else None,
                     [NeedleOutcome(**o) for o in data["outcomes"]], data.get("engine", ""),
                     per_haystack=data.get("per_haystack", 1))
        report.num_cases = data.get("num_cases", max(report._counts().values(), default=0))
        return report

    def _counts(self) -> Counter[tuple[str, int]]:
        """(task, context) -> the cases this report holds."""
        return Counter((o.task, o.context) for o in self.outcomes)

    def missing(self) -> dict[tuple[str, int], int]:
        """(task, context) -> how many of its num_cases cases this report lacks (a shard's, or
        nothing when num_cases is not recorded)."""
        have = self._counts()
        return {(t, c): self.num_cases - have[t, c] for t in self.tasks for c in self.contexts
                if have[t, c] < self.num_cases}

    def _select(self, task: str | None = None, context: int | None = None,
                bucket: int | None = None) -> list[NeedleOutcome]:
        return [o for o in self.outcomes
                if (task is None or o.task == task) and (context is None or o.context == context)
                and (bucket is None or self.bucket_of(o.depth) == bucket)]

    def bucket_of(self, depth: float) -> int:
        return min(int(depth * self.depth_buckets), self.depth_buckets - 1)

    def accuracy(self, task: str | None = None, context: int | None = None, bucket: int | None = None) -> float:
        """Fraction correct over the selected cases (None = all of them); NaN when none is selected."""
        chosen = self._select(task, context, bucket)
        return sum(o.correct for o in chosen) / len(chosen) if chosen else float("nan")

    def holds_up_to(self, task: str | None = None) -> int | None:
        """The longest context up to which every context (from the shortest) reaches the threshold;
        None when even the shortest misses it."""
        longest = None
        for length in self.contexts:
            if not self.accuracy(task, length) >= self.threshold:
                break
            longest = length
        return longest

    def summary(self) -> dict[str, Any]:
        rows = {}
        for task in [*self.tasks, None]:
            name = task or "all"
            per_context = {}
            for length in self.contexts:
                chosen = self._select(task, length)
                correct = sum(o.correct for o in chosen)
                low, high = wilson_interval(correct, len(chosen))
                per_context[str(length)] = {
                    "accuracy": correct / len(chosen) if chosen else None, "cases": len(chosen),
                    "ci95": [low, high],
                    "by_depth": [None if math.isnan(a := self.accuracy(task, length, b)) else a
                                 for b in range(self.depth_buckets)]}
            rows[name] = {"per_context": per_context, "holds_up_to": self.holds_up_to(task)}
        trained = None
        if self.trained_length is not None:
            within = [c for c in self.contexts if c <= self.trained_length]
            trained = {"length": self.trained_length,  # passes: None when no context up to it was measured
                       "passes": all(self.accuracy(None, c) >= self.threshold for c in within) if within else None}
        return {"model": self.model, "seed": self.seed, "contexts": self.contexts, "tasks": self.tasks,
                "depth_buckets": self.depth_buckets, "threshold": self.threshold, "trained_length": trained,
                "engine": self.engine, "num_cases": self.num_cases, "per_haystack": self.per_haystack,
                "results": rows}

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "outcomes": [asdict(o) for o in self.outcomes]}

    def markdown(self) -> str:
        heads = " | ".join(context_label(c) for c in self.contexts)
        lines = [f"# Needle retrieval: {self.model}", "",
                 f"seed {self.seed}; exact match; greedy; threshold {self.threshold:.0%}"
                 + (f"; {self.engine}" if self.engine else "")
                 + (f"; {self.per_haystack} cases a haystack (each holds the needles of all of them)"
                    if self.per_haystack > 1 else ""), "",
                 f"| task | {heads} | holds up to |", "|---|" + "---:|" * (len(self.contexts) + 1)]
        summary = self.summary()
        for name, row in summary["results"].items():
            cells = []
            for c in self.contexts:
                r = row["per_context"][str(c)]
                cells.append("–" if r["accuracy"] is None else f"{r['accuracy']:.1%} (n={r['cases']})")
            holds = row["holds_up_to"]
            lines.append(f"| {name} | {' | '.join(cells)} | {context_label(holds) if holds else 'none'} |")
        if summary["trained_length"]:
            t = summary["trained_length"]
            holds = summary["results"]["all"]["holds_up_to"]
            verdict = ("no context up to it measured" if t["passes"] is None else
                       f"{'passes' if t['passes'] else 'FAILS'} >= {self.threshold:.0%} at every context up to it")
            lines += ["", f"Trained length {context_label(t['length'])}: {verdict}; all tasks hold up to "
                          f"{context_label(holds) if holds else 'none'} of the contexts measured."]
        if missing := self.missing():
            some = ", ".join(f"{task} @ {context_label(c)}: {self.num_cases - n} of {self.num_cases}"
                             for (task, c), n in missing.items())
            lines += ["", f"Partial: cases run {some} (a shard, which `megactx eval needles-merge` joins to the "
                          f"others, or a stopped run, which `megactx eval needles --resume` continues)."]
        lines += ["", f"Accuracy by depth of the asked needle (all tasks; rows: depth buckets of "
                      f"1/{self.depth_buckets})", "", f"| depth | {heads} |", "|---|" + "---:|" * len(self.contexts)]
        for b in range(self.depth_buckets):
            cells = ["–" if math.isnan(a := self.accuracy(None, c, b)) else f"{a:.0%}" for c in self.contexts]
            lines.append(f"| {b / self.depth_buckets:.1f}–{(b + 1) / self.depth_buckets:.1f} | {' | '.join(cells)} |")
        return "\n".join(lines) + "\n"

    def plot(self, path: str | Path) -> None:
        """Accuracy vs context (one line per task and all) and a depth x context heatmap (all tasks)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        xs = range(len(self.contexts))
        for task in [*self.tasks, None]:
            left.plot(xs, [self.accuracy(task, c) for c in self.contexts], marker="o", label=task or "all",
                      linewidth=2.5 if task is None else 1.2)
        left.axhline(self.threshold, color="gray", linestyle="--", linewidth=0.8)
        if self.trained_length is not None:
            trained_x = sum(c <= self.trained_length for c in self.contexts) - 0.5
            left.axvline(trained_x, color="red", linestyle=":", linewidth=0.8, label="trained length")
        left.set_xticks(list(xs), [context_label(c) for c in self.contexts])
        left.set(xlabel="context (tokens)", ylabel="exact-match accuracy", ylim=(-0.02, 1.02),
                 title="needle retrieval vs context")
        left.legend(fontsize=8)
        grid = np.array([[self.accuracy(None, c, b) for c in self.contexts] for b in range(self.depth_buckets)])
        image = right.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="upper")
        right.set_xticks(list(xs), [context_label(c) for c in self.contexts])
        buckets = range(self.depth_buckets)
        right.set_yticks(buckets, [f"{b / self.depth_buckets:.1f}" for b in buckets])
        right.set(xlabel="context (tokens)", ylabel="depth of the asked needle", title="accuracy, depth x context")
        fig.colorbar(image, ax=right)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def needle_cases(generator: NeedleGenerator, task: NeedleTask, context: int, num_cases: int,
                 seed: int, indices: Sequence[int] | None = None, per_haystack: int = 1) -> Iterator[NeedleCase]:
    """The cases of `task` at `context` (only `indices` of them, when given): prompts of
    context - answer_budget(task) tokens (at most, when cases share haystacks)."""
    prompt_len = context - answer_budget(task)
    if prompt_len < 1:
        raise ValueError(f"--contexts {context} is shorter than task {task.label}'s answer budget of "
                         f"{answer_budget(task)} tokens; use longer contexts")
    return generator.cases(task, prompt_len, num_cases, seed, indices, per_haystack)


def parse_shard(text: str) -> tuple[int, int]:
    """'1/4' -> (1, 4): shard 1 of 4 (0-based), or a ValueError that says the form."""
    index, _, count = text.partition("/")
    if not (index.strip().isdigit() and count.strip().isdigit()) or not 0 <= int(index) < int(count):
        raise ValueError(f"--shard takes I/N with 0 <= I < N, e.g. 0/2 and 1/2 for two halves, got {text!r}")
    return int(index), int(count)


def evaluate_needles(answer: Answerer, generator: NeedleGenerator, tasks: Sequence[NeedleTask],
                     contexts: Sequence[int], num_cases: int, seed: int, model: str = "", batch_size: int = 8,
                     depth_buckets: int = DEFAULT_DEPTH_BUCKETS, threshold: float = DEFAULT_THRESHOLD,
                     trained_length: int | None = None, log: Callable[[str], object] | None = None,
                     engine: str = "", shard: tuple[int, int] = (0, 1), progress: bool = False,
                     resume: NeedleReport | None = None, on_batch: Callable[[NeedleReport], object] | None = None,
                     per_haystack: int = 1) -> NeedleReport:
    """Run `num_cases` cases of every task at every context through `answer`, `batch_size` cases
    at a time (a 1M-token prompt is large: cases are made as they are needed), and score them by
    exact match. shard (I, N): only cases I, I + N, ... of each task and context (their indices and
    depths those of the whole run), for `merge_needle_reports` to join with the other shards.
    progress: a bar over every case (on a terminal), with the context, the accuracy so far there
    and the prompt tokens a second. on_batch: called with the report so far after every batch (to
    save it); resume: such a report of this same evaluation, from a run that stopped: its cases are
    kept and not run again (a ValueError if it is of another evaluation or shard).
    per_haystack K > 1: cases share haystacks, K a haystack (`NeedleGenerator.cases`); a haystack's
    first case is answered alone, then the others, batch_size at a time, so that an engine with
    prefix caching prefills each haystack once."""
    if num_cases < 1:
        raise ValueError(f"--cases must be at least 1, got {num_cases}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if depth_buckets < 1:
        raise ValueError(f"--depth-buckets must be at least 1, got {depth_buckets}")
    if per_haystack < 1:
        raise ValueError(f"--cases-per-haystack must be at least 1, got {per_haystack}")
    first, every = shard
    indices = list(range(first, num_cases, every))
    if not indices:
        raise ValueError(f"--shard {first}/{every} holds none of the {num_cases} cases; use fewer shards")
    report = NeedleReport(model, seed, sorted(contexts), [t.label for t in tasks], depth_buckets, threshold,
                          trained_length, engine=engine, num_cases=num_cases, per_haystack=per_haystack)
    if resume is not None:
        _check_resumable(resume, report, shard)
        report.outcomes.extend(resume.outcomes)
    finished = {(o.task, o.context, o.index) for o in report.outcomes}
    depths = case_depths(num_cases)
    bar = tqdm(total=len(report.contexts) * len(tasks) * len(indices) - len(finished), unit="case", desc="needles",
               disable=None if progress else True, dynamic_ncols=True)
    start, tokens = time.perf_counter(), 0
    for context in report.contexts:
        for task in tasks:
            todo = [i for i in indices if (task.label, context, i) not in finished]
            for batch in _batches(generator, task, context, num_cases, seed, todo, batch_size, per_haystack):
                outputs = answer([case for _, case in batch])
                for (index, case), output in zip(batch, outputs, strict=True):
                    report.outcomes.append(NeedleOutcome(task.label, context, index, float(depths[index]),
                                                         len(case.input_ids), case.answer, output,
                                                         case.is_correct(output)))
                tokens += sum(len(case.input_ids) for _, case in batch)
                bar.set_postfix_str(f"{task.label} @ {context_label(context)}: "
                                    f"{report.accuracy(task.label, context):.1%}, "
                                    f"{tokens / (time.perf_counter() - start):,.0f} prompt tokens/s", refresh=False)
                bar.update(len(batch))
                if on_batch:
                    on_batch(report)
            if log:
                log(f"{task.label} @ {context_label(context)}: {report.accuracy(task.label, context):.1%} "
                    f"of {len(indices)}")
    bar.close()
    return report


def _first_difference(a: NeedleReport, b: NeedleReport, names: Sequence[str]) -> str | None:
    """The first of the fields `names` in which two reports differ (None: they agree in all)."""
    return next((name for name in names if getattr(a, name) != getattr(b, name)), None)


def _check_resumable(saved: NeedleReport, run: NeedleReport, shard: tuple[int, int]) -> None:
    """A ValueError unless `saved` holds cases of the evaluation `run` is (and of its shard)."""
    if name := _first_difference(saved, run, (*NeedleReport.SAME, "contexts")):
        raise ValueError(f"the saved report is of another evaluation: its {name} is {getattr(saved, name)!r}, "
                         f"this run's {getattr(run, name)!r}; give another --out, or leave out --resume to "
                         "start again")
    first, every = shard
    stray = [o.index for o in saved.outcomes if o.index % every != first]
    if stray:
        raise ValueError(f"the saved report holds case {stray[0]}, which is not in --shard {first}/{every}; "
                         "resume a shard with its own --out")


def merge_needle_reports(reports: Sequence[NeedleReport]) -> NeedleReport:
    """One report of the outcomes of several: the shards of one evaluation, or runs of it at other
    contexts. They must agree on everything but their contexts and cases (NeedleReport.SAME), and
    no case may come twice; a ValueError says what differs."""
    if not reports:
        raise ValueError("needles-merge needs at least one needles.json")
    first = reports[0]
    for other in reports[1:]:
        if name := _first_difference(first, other, NeedleReport.SAME):
            raise ValueError(f"the reports differ in {name}: {getattr(first, name)!r} and "
                             f"{getattr(other, name)!r}; merge only runs of one evaluation")
    seen, outcomes = set(), []
    for report in reports:
        for o in report.outcomes:
            key = (o.task, o.context, o.index)
            if key in seen:
                raise ValueError(f"case {o.index} of {o.task} @ {context_label(o.context)} is in two of the "
                                 "reports; merge each shard once")
            seen.add(key)
            outcomes.append(o)
    order = {task: i for i, task in enumerate(first.tasks)}
    outcomes.sort(key=lambda o: (o.context, order[o.task], o.index))
    contexts = sorted({c for r in reports for c in r.contexts})
    return NeedleReport(first.model, first.seed, contexts, first.tasks, first.depth_buckets, first.threshold,
                        first.trained_length, outcomes, first.engine, first.num_cases, first.per_haystack)


def save_needle_json(report: NeedleReport, out: str | Path) -> Path:
    """out/needles.json (out created), replaced whole: a run stopped while writing leaves the last one."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path, partial = out / "needles.json", out / "needles.json.partial"
    partial.write_text(json.dumps(report.to_json(), indent=1))
    os.replace(partial, path)
    return path


def write_needle_report(report: NeedleReport, out: str | Path) -> list[Path]:
    """needles.json, needles.md and needles.png under `out` (created); returns their paths."""
    paths = [save_needle_json(report, out), Path(out) / "needles.md", Path(out) / "needles.png"]
    paths[1].write_text(report.markdown())
    report.plot(paths[2])
    return paths


def parse_tasks(text: str) -> list[NeedleTask]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in STANDARD_TASKS]
    if unknown or not names:
        raise ValueError(f"--tasks takes names from {', '.join(STANDARD_TASKS)}, got {text!r}")
    return [STANDARD_TASKS[n] for n in names]


# ------------------------------------------------------------------------------ CLI
def add_eval_parser(subparsers: Any) -> None:
    """Register `eval` with its `bpb`, `needles` and `needle-recall` subcommands on an argparse
    subparsers object."""
    from megactx.cli import add_gpu_memory_argument, add_hf_overrides_argument

    p = subparsers.add_parser("eval", help="evaluate a checkpoint: held-out bits per byte, needle retrieval",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="evaluation", metavar="EVALUATION")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    def common(sp: argparse.ArgumentParser, default_contexts: str | None, *aliases: str) -> None:
        sp.add_argument("--seed", type=int, default=0, help="seed of the cases / document order (default 0)")
        sp.add_argument("--contexts", *aliases, dest="contexts", default=default_contexts,
                        help="comma-separated lengths, e.g. 4k,16k,1m (k = 1024)"
                             + (f" (default {default_contexts})" if default_contexts else
                                " (default: 4K, 16K, 64K, 128K, ... 1M up to the model's context)"))
        sp.add_argument("--batch-size", type=int, default=8, help="rows / cases in flight at once (default 8)")
        sp.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        sp.add_argument("--out", type=Path, default=None, help="directory for the JSON + Markdown (+ PNG) reports")
        add_hf_overrides_argument(sp)

    b = kinds.add_parser("bpb", help="held-out bits per byte (one or several checkpoints)",
                         description="Held-out bits per byte of the code corpus, reference forward, no grad.")
    b.add_argument("--model", action="append", required=True, help="checkpoint directory; repeat to compare models")
    b.add_argument("--data-dir", type=Path, default=None,
                   help="prepared data directory: its corpus snapshot and token cache (default: the stdlib)")
    b.add_argument("--max-tokens", type=int, default=None, help="score at most about this many tokens a context")
    b.add_argument("--backend", choices=("torch", "triton"), default="torch",
                   help="torch: the reference forward (default); triton: the paged kernels (long contexts)")
    common(b, DEFAULT_BPB_CONTEXT, "--seq-len")
    b.set_defaults(func=run_bpb)

    n = kinds.add_parser("needles", help="needle-retrieval accuracy per context and depth (greedy, exact match)",
                         description="Needle retrieval: accuracy per context and per depth bucket.")
    n.add_argument("--model", required=True, help="checkpoint directory (with tokenizer.json)")
    n.add_argument("--cases", type=int, default=DEFAULT_CASES, help=f"cases per task and context "
                                                                    f"(default {DEFAULT_CASES})")
    n.add_argument("--tasks", default="single", help=f"comma-separated, from {', '.join(STANDARD_TASKS)} "
                                                     "(default single)")
    n.add_argument("--corpus", type=Path, default=None,
                   help="corpus snapshot directory for the haystacks (default: this interpreter's stdlib, held out)")
    n.add_argument("--depth-buckets", type=int, default=DEFAULT_DEPTH_BUCKETS, help="rows of the depth heatmap")
    n.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="accuracy a context must reach")
    n.add_argument("--trained-length", type=int, default=None,
                   help="the model's trained context: the report says whether every context up to it passes")
    n.add_argument("--max-num-batched-tokens", type=int, default=8192, help="engine prefill chunk budget")
    add_gpu_memory_argument(n, "; lower it to evaluate beside a training run")
    n.add_argument("--kv-cache-dtype", choices=("auto", "bf16", "fp8"), default="auto",
                   help="MLA cache: auto (= the model's dtype), bf16 or fp8 (default auto)")
    n.add_argument("--index-cache-dtype", choices=("auto", "fp8"), default=None,
                   help="indexer keys (and queries): fp8 as production runs them, or auto (exact, the model's "
                        "dtype, as training scores them) (default: fp8 on CUDA, auto on a CPU)")
    n.add_argument("--shard", default=None, metavar="I/N",
                   help="run only cases I, I + N, I + 2N, ... of each task and context (0 <= I < N), the same "
                        "cases the whole run has; join the shards' needles.json with `megactx eval "
                        "needles-merge` (default: every case)")
    n.add_argument("--resume", action="store_true",
                   help="continue the run whose needles.json is in --out (saved after every batch, so a run that "
                        "was stopped loses at most its last batch): its cases are kept, the rest are run; it must "
                        "be the same evaluation (model, seed, tasks, contexts, cases, shard, engine, cases a haystack)")
    n.add_argument("--cases-per-haystack", type=int, default=1, metavar="K",
                   help="K single-needle cases share one haystack, which holds all their needles and differs "
                        "between them only in the question: prefix caching prefills it once, so 200 cases at 1M "
                        "cost 200/K prefills (the single task; default 1: a haystack each)")
    n.add_argument("--step-log", metavar="PATH", default=None,
                   help="append a JSON line for every engine step to PATH (its time and work: where a long "
                        "context's time goes; `megactx steplog PATH` summarizes it)")
    n.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")
    common(n, None)
    n.set_defaults(func=run_needles)

    m = kinds.add_parser("needles-merge", help="join needles.json of shards (or of other contexts) into one report",
                         description="Join the needles.json of several runs of one needle evaluation (its "
                                     "--shard parts, or other --contexts) into one report: JSON, Markdown, PNG.")
    m.add_argument("reports", nargs="+", type=Path, metavar="NEEDLES_JSON", help="needles.json files to join")
    m.add_argument("--out", type=Path, required=True, help="directory for the joined report")
    m.set_defaults(func=run_needles_merge)

    from megactx.train.needle_recall import add_recall_parser

    add_recall_parser(kinds)


def engine_description(llm) -> str:
    """"triton kernels, MLA cache bf16, indexer cache FP8": what a needle figure was computed with."""
    from megactx.config import describe_overrides

    def name(dtype: torch.dtype) -> str:
        return "FP8" if dtype == torch.uint8 else str(dtype).removeprefix("torch.")

    cache = llm.runner.cache
    kernels = "Triton kernels" if llm.backend == "triton" else "PyTorch twins of the kernels"
    overrides = f", config {describe_overrides(llm.hf_overrides)}" if llm.hf_overrides else ""
    return f"{kernels}, MLA cache {name(cache.kv_dtype)}, indexer cache {name(cache.index_dtype)}{overrides}"


def _checkpoint_dir(model: str | Path) -> Path:
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"--model {model} is not a checkpoint directory (config.json, *.safetensors, "
                                "tokenizer.json)")
    return Path(model)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run_bpb(args: argparse.Namespace) -> int:
    try:
        contexts = parse_contexts(args.contexts)
        results = []
        for model in map(_checkpoint_dir, args.model):
            results += evaluate_bpb(model, contexts, args.seed, args.data_dir, args.batch_size, args.max_tokens,
                                    args.device, backend=args.backend, hf_overrides=args.hf_overrides)
    except (OSError, ValueError) as e:
        return _fail(str(e))
    for r in results:
        print(f"{r['model']}\t{r['context']}\t{r['bits_per_byte']:.6f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bpb.json").write_text(json.dumps(results, indent=1))
        (args.out / "bpb.md").write_text(bpb_markdown(results))
        bpb_plot(results, args.out / "bpb.png")
    return 0


def model_contexts(model_dir: Path, text: str | None, hf_overrides: dict[str, Any] | None = None) -> list[int]:
    """--contexts of a needle evaluation (default: CONTEXT_LADDER up to the model's context), or a
    ValueError if one is longer than the model's context."""
    from megactx import ModelConfig

    limit = ModelConfig.from_pretrained(model_dir, hf_overrides).max_position_embeddings
    contexts = parse_contexts(text) if text else [c for c in CONTEXT_LADDER if c <= limit]
    if not contexts or max(contexts) > limit:
        raise ValueError(f"--contexts must be at most the model's context of {limit} tokens, got "
                         f"{text or 'none below it'}")
    return contexts


def run_needles(args: argparse.Namespace) -> int:
    from megactx import LLM
    from megactx.train.corpus import Corpus
    from megactx.train.data import needle_generator

    try:
        tasks = parse_tasks(args.tasks)
        if not 0.0 <= args.threshold <= 1.0:
            raise ValueError(f"--threshold must be an accuracy in [0, 1], got {args.threshold}")
        contexts = model_contexts(_checkpoint_dir(args.model), args.contexts, args.hf_overrides)
        shard = parse_shard(args.shard) if args.shard else (0, 1)
        if not (Path(args.model) / "tokenizer.json").is_file():
            raise ValueError(f"{args.model} has no tokenizer.json; needle cases are made with the model's tokenizer")
        corpus = held_out_corpus(Corpus.from_directory(args.corpus) if args.corpus else None)
        generator = needle_generator(args.model, "held_out", corpus)
        out = args.out or Path("runs") / "eval" / Path(args.model).name
        saved = _saved_needles(out / "needles.json") if args.resume else None
        llm = LLM(args.model, device=args.device, max_model_len=max(contexts), max_num_seqs=args.batch_size,
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
                  index_cache_dtype=args.index_cache_dtype, hf_overrides=args.hf_overrides,
                  gpu_memory_utilization=args.gpu_memory_utilization, step_log=args.step_log)
        report = evaluate_needles(EngineAnswerer(llm), generator, tasks, contexts, args.cases, args.seed,
                                  str(args.model), args.batch_size, args.depth_buckets, args.threshold,
                                  args.trained_length, log=tqdm.write, engine=engine_description(llm), shard=shard,
                                  progress=not args.no_progress, resume=saved,
                                  on_batch=lambda so_far: save_needle_json(so_far, out),
                                  per_haystack=args.cases_per_haystack)
    except (OSError, ValueError) as e:
        return _fail(str(e))
    print(report.markdown())
    for path in write_needle_report(report, out):
        print(f"wrote {path}")
    return 0


def _saved_needles(path: Path) -> NeedleReport | None:
    """The report a stopped `eval needles` saved at `path` (None, said, when there is none)."""
    if not path.is_file():
        print(f"nothing to resume in {path.parent}: starting from the first case", file=sys.stderr)
        return None
    report = _read_needles(path)
    print(f"resuming {path}: {len(report.outcomes)} cases done", file=sys.stderr)
    return report


def _read_needles(path: Path) -> NeedleReport:
    try:
        return NeedleReport.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a needles.json of `megactx eval needles` ({e!r})") from None


def run_needles_merge(args: argparse.Namespace) -> int:
    try:
        report = merge_needle_reports([_read_needles(path) for path in args.reports])
    except (OSError, ValueError) as e:
        return _fail(str(e))
    print(report.markdown())
    for path in write_needle_report(report, args.out):
        print(f"wrote {path}")
    return 0
