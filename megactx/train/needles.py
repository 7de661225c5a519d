"""Synthetic long-context tasks: key -> value needles hidden in code haystacks, generated
deterministically from a seed. The same generator feeds training (prompt + answer, loss on the
answer only) and the needle-retrieval evaluation (prompt ids and the expected answer, exact match).

A needle is one line of Python, `key_static_buffer = "402913"`, inserted between two lines of a
haystack: consecutive code of one corpus split, from a random line on (wrapping around the split when
it is shorter than the context). The question comes after the haystack:

    chat:   <|user|>\\n{haystack with needles}\\n{question}<|end|>\\n<|assistant|>\\n{lead}   -> {answer}<|end|>
    plain:  {haystack with needles}\\n# {question}\\n# Answer:{lead}                        -> {answer}<|end|>

The chat form is what the tokenizer's chat template renders for one user message, then `lead`.
The lead (NeedleTask.lead, on by default) opens the answer of a one-value question (single,
multikey) the way the needle line did: `key_static_buffer = "`, so the first digit follows the
same tokens as in the haystack (the answer prefix of RULER's needle tasks). The value must still be
found among needles whose names differ in one word, at any depth; what the lead removes is the
need for a circuit that maps "the name asked in a question" to "the digits after that name", which
a 10M-parameter model did not learn from ~40K needle tasks. Multi-query and multi-hop questions
have no lead.

Task kinds (`NeedleTask`):
- single:     one needle; ask it.
- multikey:   `num_needles` needles with different names; ask one.
- multiquery: `num_needles` needles; ask `num_queries` of them; answer their values in the asked order,
              joined by ", ".
- multihop:   a value needle and `hops` assignments that chain to it (`B = A`, `C = B`, ... in this
              order, so the haystack stays valid Python); ask the last name; answer the value.
- any kind with `num_distractors`: needles whose name differs from an asked name in one word.

Depth: the first asked needle (the value needle of a chain) goes to the line boundary nearest to
`depth` x the haystack's tokens; the others to random depths (the rest of a chain after it, in order).
Lengths are exact: the prompt has `length` tokens (prompt + answer when `length_includes_answer`);
the haystack fills what the template, question and needles leave, its last line cut to fit and
ended with a newline. The ids are canonical: decoding and re-encoding the prompt may differ at that
cut by a token, so pass `input_ids`, not text, to a model.

Shared haystacks (`NeedleGenerator.shared_haystack_cases`, `cases(..., per_haystack=K)`): K single
cases whose prompts differ only in the question after one haystack that holds all K needles, so
that an engine with prefix caching prefills it once: what makes hundreds of cases at 1M tokens
affordable. Each case then also holds K - 1 unasked needles, as a multikey case does.

Every random choice comes from `random.Random(seed)` (seed an int or a string), whose output Python
keeps stable across versions and machines.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from tokenizers import Tokenizer

from megactx.train.tokenizer import END

if TYPE_CHECKING:
    from megactx.train.data import SplitTokens

KEY_PREFIX = "key_"
KINDS = ("single", "multikey", "multiquery", "multihop")
# Names are key_<adjective>_<noun> from words common in Python source, so that a code tokenizer
# keeps each word one token: a name is then a few tokens, two of them telling it apart from the
# others (with the stdlib tokenizer of megactx.train, `key`, `_`, adjective, `_`, noun for all 1024).
ADJECTIVES = ("active", "base", "blocking", "current", "default", "empty", "external", "final", "first", "global",
              "initial", "last", "local", "lower", "main", "master", "missing", "normal", "open", "parent", "partial",
              "pending", "real", "root", "safe", "shared", "short", "simple", "special", "static", "strict", "total")
NOUNS = ("buffer", "cache", "chunk", "event", "field", "filter", "frame", "group", "handler", "header", "host", "image",
         "index", "limit", "loop", "mask", "message", "node", "offset", "path", "port", "queue", "record", "signal",
         "socket", "stack", "stream", "table", "target", "task", "thread", "token")
MAX_NAMES = 64  # names in one case: far below the 1024 combinations, so near-miss names are always free
NEWLINE_TOKEN = "\u010a"  # "\n" in the byte-level alphabet


@dataclass(frozen=True)
class NeedleTask:
    """What a case hides and asks (see the module docstring for the kinds)."""

    kind: str = "single"
    num_needles: int = 1  # multikey, multiquery: needles with distinct names, the asked ones included
    num_queries: int = 1  # multiquery: how many of them the question asks
    hops: int = 2  # multihop: assignments between the asked name and the value
    num_distractors: int = 0  # needles one word off an asked name, with other values
    value_digits: int = 6  # a value is this many decimal digits (one token each)
    chat: bool = True  # chat-formatted prompt; False: plain text ending in "# Answer:"
    lead: bool = True  # single, multikey: the prompt ends with the asked needle's `name = "` (module docstring)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "single" and (self.num_needles, self.num_queries) != (1, 1):
            raise ValueError("kind='single' has num_needles=1 and num_queries=1; use 'multikey' or 'multiquery'")
        if self.kind == "multikey" and (self.num_needles < 2 or self.num_queries != 1):
            raise ValueError(f"kind='multikey' needs num_needles >= 2 and num_queries=1, got "
                             f"num_needles={self.num_needles}, num_queries={self.num_queries}")
        if self.kind == "multiquery" and not 2 <= self.num_queries <= self.num_needles:
            raise ValueError(f"kind='multiquery' needs 2 <= num_queries <= num_needles, got "
                             f"num_queries={self.num_queries}, num_needles={self.num_needles}")
        if self.kind == "multihop" and self.hops < 1:
            raise ValueError(f"kind='multihop' needs hops >= 1, got {self.hops}")
        if self.num_distractors < 0 or self.value_digits < 1:
            raise ValueError(f"need num_distractors >= 0 and value_digits >= 1, got {self.num_distractors}, "
                             f"{self.value_digits}")
        if self.num_names > MAX_NAMES:
            raise ValueError(f"this task hides {self.num_names} needles; at most {MAX_NAMES}")

    @property
    def num_names(self) -> int:
        chain = self.hops + 1 if self.kind == "multihop" else self.num_needles
        return chain + self.num_distractors

    @property
    def label(self) -> str:
        """A short name for reports: "single", "multikey4", "multiquery2of4", "multihop2", + "+3d", "-plain"."""
        base = {"single": "single", "multikey": f"multikey{self.num_needles}",
                "multiquery": f"multiquery{self.num_queries}of{self.num_needles}",
                "multihop": f"multihop{self.hops}"}[self.kind]
        return (base + (f"+{self.num_distractors}d" if self.num_distractors else "") + ("" if self.chat else "-plain")
                + ("-nolead" if self.has_lead_kind and not self.lead else ""))

    @property
    def has_lead_kind(self) -> bool:
        """One value to answer, read off one needle line: the kinds a lead applies to."""
        return self.kind in ("single", "multikey")


STANDARD_TASKS = {
    "single": NeedleTask(),
    "multikey": NeedleTask("multikey", num_needles=4),
    "multiquery": NeedleTask("multiquery", num_needles=4, num_queries=2),
    "multihop": NeedleTask("multihop", hops=2),
    "distractors": NeedleTask(num_distractors=3),
}


@dataclass(frozen=True)
class Needle:
    name: str
    text: str  # the inserted line, e.g. 'key_static_buffer = "402913"\n' or 'key_main_queue = key_static_buffer\n'
    role: str  # "asked": the answer reads it (a chain's links too); "other": an unasked key; "distractor"
    depth: float  # requested fraction of the haystack's tokens before it
    offset: int = -1  # haystack tokens before it: the line boundary nearest depth * haystack_len
    position: int = -1  # index of its first token in input_ids
    length: int = 0  # its tokens in input_ids


@dataclass(frozen=True)
class NeedleCase:
    input_ids: list[int]  # the prompt
    answer_ids: list[int]  # the expected continuation: the answer's tokens, then <|end|>
    answer: str  # the expected text, e.g. "402913" or "402913, 771250"
    question: str
    needles: tuple[Needle, ...]  # in insertion order (a chain: value first)
    haystack_len: int  # haystack tokens (needles not counted)
    task: NeedleTask = field(default_factory=NeedleTask)

    def is_correct(self, output: str) -> bool:
        """Exact match of a decoded completion (cut at `<|end|>`, whitespace stripped) with the answer."""
        return output.split(END)[0].strip() == self.answer

    def training_example(self) -> dict[str, torch.Tensor]:
        """{"input_ids": int64 [n], "loss_mask": bool [n - 1]} with n = prompt + answer tokens; the
        loss counts only targets that are answer tokens (the final <|end|> included)."""
        ids = torch.tensor(self.input_ids + self.answer_ids, dtype=torch.int64)
        mask = torch.zeros(len(ids) - 1, dtype=torch.bool)
        mask[len(self.input_ids) - 1 :] = True
        return {"input_ids": ids, "loss_mask": mask}


def _name(adjective: int, noun: int) -> str:
    return f"{KEY_PREFIX}{ADJECTIVES[adjective]}_{NOUNS[noun]}"


def _distinct_names(count: int, rng: random.Random) -> list[str]:
    return [_name(*divmod(g, len(NOUNS))) for g in rng.sample(range(len(ADJECTIVES) * len(NOUNS)), count)]


def _one_value_question(name: str) -> str:
    return f"What is the value of {name}? Answer with the value only."


def _haystack_of(index: int, num_cases: int, per_haystack: int) -> int:
    """The haystack case `index` is in when `num_cases` cases share haystacks, `per_haystack` a
    haystack: cases g, g + G, g + 2G, ... share haystack g of G = ceil(num_cases / per_haystack)
    (with one a haystack, case i is haystack i)."""
    return index % -(-num_cases // per_haystack)


class NeedleGenerator:
    """Needle cases whose haystacks are the code of one split (`TrainingData.needles(split)`)."""

    def __init__(self, haystack: SplitTokens, tokenizer: Tokenizer):
        self.haystack = haystack  # the split's token ids, back to back
        self.line_starts = haystack.line_starts[:-1]  # [num_lines]
        self.tokenizer = tokenizer
        self.newline_id = tokenizer.token_to_id(NEWLINE_TOKEN)
        self.end_id = tokenizer.token_to_id(END)
        if self.newline_id is None or self.end_id is None:
            raise ValueError("the tokenizer lacks a newline token or <|end|>; use megactx.train.tokenizer's")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    # -- what to hide and ask -------------------------------------------------------------------
    def _plan(self, task: NeedleTask, depth: float, rng: random.Random) -> tuple[list[Needle], str, str]:
        """The needles (not yet placed), the question and the answer."""
        names = _distinct_names(task.num_names - task.num_distractors, rng)
        used_values: set[str] = set()

        def value() -> str:
            while True:
                v = "".join(rng.choice(string.digits) for _ in range(task.value_digits))
                if v not in used_values or len(used_values) >= 10**task.value_digits:
                    used_values.add(v)
                    return v

        needles: list[Needle] = []
        if task.kind == "multihop":
            root = value()
            depths = [depth, *sorted(rng.uniform(depth, 1.0) for _ in range(task.hops))]
            needles.append(Needle(names[0], f'{names[0]} = "{root}"\n', "asked", depths[0]))
            for prev, name, d in zip(names, names[1:], depths[1:]):
                needles.append(Needle(name, f"{name} = {prev}\n", "asked", d))
            asked, values = [names[-1]], [root]
        else:
            values = [value() for _ in names]
            num_asked = task.num_queries if task.kind == "multiquery" else 1
            for i, (name, v) in enumerate(zip(names, values)):
                needles.append(Needle(name, f'{name} = "{v}"\n', "asked" if i < num_asked else "other",
                                      depth if i == 0 else rng.random()))
            asked, values = names[:num_asked], values[:num_asked]
        taken = set(names)
        for i in range(task.num_distractors):
            near = self._near_miss(asked[i % len(asked)], taken, rng)
            taken.add(near)
            needles.append(Needle(near, f'{near} = "{value()}"\n', "distractor", rng.random()))
        if len(asked) == 1:
            question = _one_value_question(asked[0])
        else:
            question = (f"What are the values of {', '.join(asked)}? Answer with the values only, "
                        "separated by commas, in that order.")
        return needles, question, ", ".join(values)

    @staticmethod
    def _near_miss(name: str, taken: set[str], rng: random.Random) -> str:
        """A free name that shares the adjective or the noun of `name`."""
        adjective, noun = name.removeprefix(KEY_PREFIX).split("_")
        a, n = ADJECTIVES.index(adjective), NOUNS.index(noun)
        candidates = [_name(a, j) for j in range(len(NOUNS))] + [_name(i, n) for i in range(len(ADJECTIVES))]
        return rng.choice([c for c in candidates if c not in taken])

    # -- where to hide it -----------------------------------------------------------------------
    def _haystack(self, length: int, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """[length] ids: whole lines from a random line on (wrapping around), the last cut to
        length - 1 tokens and ended by a newline; and the sorted line boundaries, 0 and length included."""
        n = self.haystack.num_tokens
        first = int(self.line_starts[rng.randrange(len(self.line_starts))])
        body = length - 1
        ids = np.append(self.haystack.around(first, body), self.newline_id)
        rel = (self.line_starts - first) % n  # line starts relative to the first line, one lap
        laps = body // n + 1
        bounds = (rel[None, :] + n * np.arange(laps)[:, None]).ravel()
        return ids, np.union1d(bounds[bounds <= body], [0, length])

    def case(self, task: NeedleTask, length: int, depth: float, seed: int | str,
             length_includes_answer: bool = False) -> NeedleCase:
        """One case with a prompt of exactly `length` tokens (prompt + answer when
        `length_includes_answer`, as training wants), the first asked needle at `depth` in [0, 1]."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        rng = random.Random(seed)
        needles, question, answer = self._plan(task, depth, rng)
        prefix, suffix, answer_ids = self._ends(task, needles[0].name, question, answer)
        needle_ids = [self._encode(n.text) for n in needles]
        fixed = len(prefix) + len(suffix) + sum(map(len, needle_ids))
        fixed += len(answer_ids) if length_includes_answer else 0
        haystack_len = self._haystack_len(task, length, fixed)
        body, placed = self._place(prefix, self._haystack(haystack_len, rng), needles, needle_ids)
        input_ids = np.concatenate([body, np.asarray(suffix, dtype=np.int64)]).tolist()
        return NeedleCase(input_ids, answer_ids, answer, question, tuple(placed), haystack_len, task)

    def _ends(self, task: NeedleTask, first_asked: str, question: str,
              answer: str) -> tuple[list[int], list[int], list[int]]:
        """The ids before the haystack, after it (the question, and the lead that opens the answer
        of the first asked needle), and of the answer with its <|end|>."""
        lead = f'{first_asked} = "' if task.lead and task.has_lead_kind else ""
        if task.chat:
            prefix, suffix = self._encode("<|user|>\n"), self._encode(f"\n{question}{END}\n<|assistant|>\n{lead}")
        else:
            prefix, suffix = [], self._encode(f"\n# {question}\n# Answer:{' ' + lead if lead else ''}")
        return prefix, suffix, [*self._encode(answer if task.chat or lead else f" {answer}"), self.end_id]

    @staticmethod
    def _haystack_len(task: NeedleTask, length: int, fixed: int) -> int:
        if length - fixed < 1:
            raise ValueError(f"length={length} leaves no room for a haystack: task {task.label} needs at least "
                             f"{fixed + 1} tokens")
        return length - fixed

    @staticmethod
    def _place(prefix: list[int], haystack: tuple[np.ndarray, np.ndarray], needles: list[Needle],
               needle_ids: list[list[int]]) -> tuple[np.ndarray, list[Needle]]:
        """prefix + the haystack with every needle at the line boundary nearest its depth (ids), and
        the needles placed, in haystack order."""
        hay, bounds = haystack
        # the boundary nearest to each requested depth; ties and equal offsets keep plan order,
        # which keeps a chain's links after its value
        targets = np.array([n.depth * len(hay) for n in needles])
        right = np.clip(np.searchsorted(bounds, targets), 1, len(bounds) - 1)
        offsets = np.where(targets - bounds[right - 1] <= bounds[right] - targets, bounds[right - 1], bounds[right])
        order = sorted(range(len(needles)), key=lambda i: (offsets[i], i))
        pieces, placed, cursor, position = [np.asarray(prefix, dtype=np.int64)], [], 0, len(prefix)
        for i in order:
            off = int(offsets[i])
            pieces += [hay[cursor:off], np.asarray(needle_ids[i], dtype=np.int64)]
            position += off - cursor
            placed.append(Needle(needles[i].name, needles[i].text, needles[i].role, needles[i].depth, off, position,
                                 len(needle_ids[i])))
            position += len(needle_ids[i])
            cursor = off
        pieces.append(hay[cursor:])
        return np.concatenate(pieces), placed

    def shared_haystack_cases(self, task: NeedleTask, length: int, depths: Sequence[float],
                              seed: int | str) -> list[NeedleCase]:
        """len(depths) single-needle cases that share one haystack, which holds all their needles
        (distinct names and values, case j's at depths[j]) and differs between them only in the
        question after it: an engine with prefix caching prefills it once (a long-context
        evaluation's cost). Each case then also holds the others' needles, as a multikey case does.
        Prompts are at most `length` tokens: the haystack is sized for the longest question."""
        if task.kind != "single" or task.num_distractors:
            raise ValueError(f"cases share a haystack only for the single task without distractors, not {task.label}")
        if not 1 <= len(depths) <= MAX_NAMES or not all(0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"a shared haystack holds 1 to {MAX_NAMES} needles at depths in [0, 1], got {depths}")
        rng = random.Random(seed)
        names = _distinct_names(len(depths), rng)
        values = ["".join(rng.choice(string.digits) for _ in range(task.value_digits)) for _ in names]
        needles = [Needle(n, f'{n} = "{v}"\n', "asked", d) for n, v, d in zip(names, values, depths)]
        questions = [_one_value_question(n) for n in names]
        ends = [self._ends(task, n, q, v) for n, q, v in zip(names, questions, values)]
        needle_ids = [self._encode(n.text) for n in needles]
        fixed = len(ends[0][0]) + max(len(suffix) for _, suffix, _ in ends) + sum(map(len, needle_ids))
        haystack_len = self._haystack_len(task, length, fixed)
        body, placed = self._place(ends[0][0], self._haystack(haystack_len, rng), needles, needle_ids)
        cases = []
        for name, question, value, (_, suffix, answer_ids) in zip(names, questions, values, ends):
            own = tuple(dataclasses.replace(p, role="asked" if p.name == name else "other") for p in placed)
            input_ids = np.concatenate([body, np.asarray(suffix, dtype=np.int64)]).tolist()
            cases.append(NeedleCase(input_ids, answer_ids, value, question, own, haystack_len, task))
        return cases

    def cases(self, task: NeedleTask, length: int, num_cases: int, seed: int,
              indices: Iterable[int] | None = None, per_haystack: int = 1) -> Iterator[NeedleCase]:
        """`num_cases` evaluation cases at `length`, depths evenly spaced over [0, 1], made one at a
        time (200 prompts of 1M ids would not fit in memory at once). Case i depends only on
        (seed, task, length, i) and its depth. indices: only those cases of the num_cases, in that
        order (a shard of an evaluation split over several runs).

        per_haystack K > 1: the cases share haystacks (`shared_haystack_cases`), K a haystack:
        haystack g of G = ceil(num_cases / K) holds cases g, g + G, g + 2G, ... (depths spread over
        [0, 1]); case i then depends on (seed, task, length, K, its haystack). `haystack_groups`
        puts a haystack's cases together."""
        depths = np.linspace(0.0, 1.0, num_cases) if num_cases > 1 else np.array([0.5])
        if per_haystack < 1:
            raise ValueError(f"cases a haystack must be at least 1, got {per_haystack}")
        groups = -(-num_cases // per_haystack)
        made: dict[int, NeedleCase] = {}  # the last haystack's cases, by index
        for i in range(num_cases) if indices is None else indices:
            if per_haystack == 1:
                yield self.case(task, length, float(depths[i]), f"{seed}/{task.label}/{length}/{i}")
            elif i in made:
                yield made[i]
            else:
                g = _haystack_of(i, num_cases, per_haystack)
                members = range(g, num_cases, groups)
                shared = self.shared_haystack_cases(task, length, [float(depths[j]) for j in members],
                                                    f"{seed}/{task.label}/{length}/haystack{g}of{groups}")
                made = dict(zip(members, shared))
                yield made[i]


def haystack_groups(indices: Iterable[int], num_cases: int, per_haystack: int) -> list[list[int]]:
    """`indices` of `NeedleGenerator.cases(..., per_haystack=K)` by the haystack they share, each
    group in index order, the groups in the order of their first index; K = 1: one case a group."""
    by_haystack: dict[int, list[int]] = {}
    for i in indices:
        by_haystack.setdefault(_haystack_of(i, num_cases, per_haystack), []).append(i)
    return [sorted(members) for members in by_haystack.values()]


class NeedleDataset(torch.utils.data.Dataset):
    """Training examples of exactly `seq_len + 1` tokens (prompt + answer; loss on the answer):
    example g uses task g mod len(tasks), a depth uniform in [0, 1] and its own seed. Rank r of W
    takes examples r, r + W, r + 2W, ... of `num_examples`, the same count on every rank."""

    def __init__(self, generator: NeedleGenerator, seq_len: int, num_examples: int,
                 tasks: tuple[NeedleTask, ...] = tuple(STANDARD_TASKS.values()), seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if not tasks:
            raise ValueError("tasks is empty; pass at least one NeedleTask")
        self.generator, self.seq_len, self.tasks, self.seed = generator, seq_len, tasks, seed
        self.rank, self.world_size = rank, world_size
        self.num_examples = num_examples // world_size

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_examples:
            raise IndexError(i)
        g = self.rank + i * self.world_size
        rng = random.Random(f"{self.seed}/train/{g}")
        case = self.generator.case(self.tasks[g % len(self.tasks)], self.seq_len + 1, rng.random(),
                                   seed=f"{self.seed}/{g}", length_includes_answer=True)
        return case.training_example()
