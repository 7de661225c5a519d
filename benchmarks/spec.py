"""`megactx bench spec`: MTP speculative decoding against no speculation — mean acceptance length,
acceptance rate per draft position and output tokens/s for γ = 1 … 7 at batch 1 and 32, for each
rung of the published GLM ablation ladder:

    rung                  engine settings                                       MTP layer        published (γ = 7)
    baseline              mtp_mode="baseline", draft_acceptance="target-only"   mtp-ce-noshare   4.56
    +IndexShare+KVShare   mtp_mode="kvshare",  draft_acceptance="target-only"   mtp-ce-share     5.10
    +rejection sampling   mtp_mode="kvshare",  draft_acceptance="rejection"     mtp-ce-share     5.29
    +end-to-end TV loss   mtp_mode="kvshare",  draft_acceptance="rejection"     mtp-tv-share     5.47

target-only: greedy drafts, each accepted with probability p(x) under the target; rejection: drafts
sampled from the MTP distribution q, accepted with probability min(1, p/q). Both need sampling
(--temperature > 0): at temperature 0 every rung accepts greedily, and +IndexShare+KVShare and
+rejection sampling coincide. Greedy decoding is timed on its own beside the ladder (unless
--no-greedy): at batch 1, no speculation and the top rung at every γ, both at temperature 0.

MTP layer: the ladder is also a training ladder. With --mtp-layers DIR every rung runs on the
checkpoint with the MTP layer its training rung produced, DIR/<MTP layer>.safetensors (CE without
IndexShare/KVShare, CE with them, the end-to-end TV loss with them (megactx-tiny's: CE + TV, which
drafted better at equal budget than TV alone); scripts/train-megactx-tiny.sh
writes these with megactx.train.recipe.export_mtp_layer), put on the backbone of --model with
megactx.train.recipe.with_mtp_layer, so all four rungs are measured (--own-mtp-layer STEM: the
rungs of that file run on the checkpoint's own MTP layer instead, when it is that variant, as the
shipped model's layer is; its file may then be absent). Without it the first three
rungs run on the checkpoint's own MTP layer and the TV rung, a training change, is shown as its
published figure only.

The backbone is loaded once, and each MTP-layer variant once (assembled in a temporary directory);
every (rung, γ) gets an engine of its own over its model, and so does the no-speculation reference
(γ = 0, the checkpoint itself). For each batch size B: B prompts of P tokens each generate exactly
M tokens (ignore_eos) — one untimed warm-up run, then --reps timed runs on prompts of their own
(the same prompts for every engine; on a GPU 3 by default, so that a batch-1 figure pools the
drafts of 3 prompts: one prompt's acceptance length swung by +-0.5 between neighbouring γ). On a
GPU every engine replays CUDA graphs: decode steps without speculation, verify and draft steps
with it. Figures: the median run's output tokens/s (B·M / wall), the speed-up over no
speculation at the same batch (the no-speculation engine stays loaded, and a timed run of it on the
same prompts goes just before every timed run of a speculative engine: the speed-up is the median
of those pairs' ratios, since the host's speed drifts within a run by more than the differences
measured), and from the timed runs' drafts: mean acceptance length (tokens a
verify emits: accepted drafts + 1) and, per draft position j, the fraction of drafts with a token
j whose token j was accepted.

Prompts, windows of held-out code starting at line starts: with --data-dir (a directory prepared
by megactx.train.data, with the tokenizer the checkpoint was trained with), of its held-out split;
else, for a --model holding tokenizer.json, of the held-out files of this interpreter's stdlib
(megactx.train.corpus) tokenized with that tokenizer; else (the random checkpoint) random token
ids. Without --model the shipped models/megactx-tiny is used; where it is absent, a random tiny
checkpoint, whose acceptance lengths are meaningless (its MTP layer drafts noise): only the engine's
mechanics are measured then.

Targets (the issue's, on the shipped trained model on a GPU): >= 2x output tokens/s at batch 1 over
no speculation (the best γ of the top measured rung); each measured rung's acceptance length at
the largest γ and the largest batch (the most requests, so the least sampling noise: a batch-1
figure rests on one request's few hundred tokens) at least the one below it.

Default sizes:

    device      γ           batches  P    M
    GPU         1 … 7       1, 32    256  256
    GPU --quick 1, 7        1        128  64
    CPU         1 … 7       1, 32    16   16
    CPU --quick 1, 7        1        8    8

The whole ladder on the shipped model:

    megactx bench spec --model models/megactx-tiny --mtp-layers models/megactx-tiny/mtp-ablations \
        --gammas 7 --batches 1

Results: benchmarks/results/spec-<device>.json (the rungs run and their MTP files under "rungs"),
.md, .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Ceilings,
    Progress,
    ceilings_markdown,
    fmt_num,
    fmt_time,
    free_device_memory,
    int_list,
    machine_info,
    md_table,
    measure_machine_ceilings,
    pyplot,
    rerender_from_json,
    save_figure,
    sync_device,
    write_suite_reports,
)
from benchmarks.engine import random_prompts

HELP = "MTP speculative decoding: acceptance length and tokens/s for γ = 1..7 per rung of the GLM ablation"
SCHEMA = "megactx-bench-spec/2"  # /2 records the rungs run ("rungs"); /1 files ran RUNGS
RESULTS_DIR = Path(__file__).parent / "results"
# Targets of the issue (benchmark figures, not tests).
TARGET_SPEEDUP = 2.0  # output tokens/s with speculation >= 2x without ...
TARGET_SPEEDUP_BATCH = 1  # ... at this batch
NO_SPEC = "no speculation"
GREEDY = "greedy: "  # prefix of the rung names of the greedy runs ("greedy: no speculation", ...)
PUBLISHED_GAMMA = 7  # the published ablation's γ (7 MTP steps in training and inference)
RANDOM_WEIGHTS_NOTE = "random weights: acceptance lengths are meaningless"


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder: the engine settings that switch it on, the MTP layer its training
    produced, and the published acceptance length at γ = 7 (GLM-5.1 backbone, coding data)."""

    name: str
    mtp_mode: str  # LLM(mtp_mode=...)
    draft_acceptance: str  # LLM(draft_acceptance=...)
    published: float
    # stem of the MTP-layer file in --mtp-layers (export_mtp_layer's output); None: the checkpoint's own
    mtp_layer: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rung:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# The ladder on one checkpoint's MTP layer (what runs without --mtp-layers) ...
RUNGS = (Rung("baseline", "baseline", "target-only", 4.56),
         Rung("+IndexShare+KVShare", "kvshare", "target-only", 5.10),
         Rung("+rejection sampling", "kvshare", "rejection", 5.29))
# ... and its last rung, a training change: measurable only on an MTP layer trained with it
TV_LOSS_RUNG = Rung("+end-to-end TV loss", "kvshare", "rejection", 5.47, mtp_layer="mtp-tv-share")
# With --mtp-layers: every rung on the MTP layer of its training rung (scripts/train-megactx-tiny.sh)
MTP_LAYER_RUNGS = (dataclasses.replace(RUNGS[0], mtp_layer="mtp-ce-noshare"),
                   dataclasses.replace(RUNGS[1], mtp_layer="mtp-ce-share"),
                   dataclasses.replace(RUNGS[2], mtp_layer="mtp-ce-share"),
                   TV_LOSS_RUNG)
MTP_LAYER_SUFFIX = ".safetensors"


def rungs_of(results: dict[str, Any]) -> tuple[Rung, ...]:
    """The rungs a run measured, bottom to top (files without a rung list ran RUNGS)."""
    return tuple(Rung.from_dict(d) for d in results["rungs"]) if results.get("rungs") else RUNGS


# ------------------------------------------------------------------------------ settings
GPU_REPS = 3  # timed runs of every (engine, batch) on a GPU by default


@dataclass
class Settings:
    """Sizes of a run (see the module docstring for the defaults by device)."""

    device: str = "cuda"
    gammas: list[int] = field(default_factory=lambda: list(range(1, PUBLISHED_GAMMA + 1)))
    batches: list[int] = field(default_factory=lambda: [1, 32])
    prompt_len: int = 256  # P
    output_len: int = 256  # M
    warmup_len: int = 256  # tokens of the untimed warm-up run (a GPU compiles every kernel size there)
    reps: int = 1  # timed runs of every (engine, batch); the figure is the median run's
    temperature: float = 1.0
    seed: int = 0
    threads: int | None = None  # torch intra-op threads (None: torch's default; a CPU run uses 1)
    data_dir: str | None = None
    mtp_layers: str | None = None  # directory of MTP-layer files: run MTP_LAYER_RUNGS instead of RUNGS
    own_mtp_layer: str | None = None  # with mtp_layers: the stem whose rungs run the checkpoint's own MTP layer
    greedy: bool = True  # also time greedy decoding at batch TARGET_SPEEDUP_BATCH (no speculation, top rung)
    overlap: bool = False  # speculative engines with LLM(async_scheduling=True): overlapped steps

    @property
    def rungs(self) -> tuple[Rung, ...]:
        if not self.mtp_layers:
            return RUNGS
        return tuple(dataclasses.replace(r, mtp_layer=None) if r.mtp_layer == self.own_mtp_layer else r
                     for r in MTP_LAYER_RUNGS)

    @classmethod
    def defaults(cls, device: str, quick: bool) -> Settings:
        few = [1, PUBLISHED_GAMMA]
        if device == "cuda":
            return cls(device, few, [1], 128, 64, 64) if quick else cls(device, reps=GPU_REPS)
        if quick:
            return cls(device, few, [1], 8, 8, warmup_len=2, threads=1)
        return cls(device, prompt_len=16, output_len=16, warmup_len=2, threads=1)

    def check(self) -> None:
        """ValueError naming the flag of a bad setting."""
        if not self.gammas or any(g < 1 for g in self.gammas):
            raise ValueError(f"--gammas must be draft lengths >= 1, e.g. 1,2,3,4,5,6,7; got {self.gammas}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"--batches must be positive batch sizes, e.g. 1,32; got {self.batches}")
        for flag, value in (("--prompt-len", self.prompt_len), ("--output-len", self.output_len),
                            ("--reps", self.reps), ("--threads", 1 if self.threads is None else self.threads)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (at 0 every rung accepts greedily), got {self.temperature}")
        if self.own_mtp_layer is not None:
            if not self.mtp_layers:
                raise ValueError("--own-mtp-layer names which --mtp-layers file the checkpoint's own MTP layer "
                                 "stands for; give --mtp-layers DIR too")
            stems = sorted({r.mtp_layer for r in MTP_LAYER_RUNGS})
            if self.own_mtp_layer not in stems:
                raise ValueError(f"--own-mtp-layer must be one of {', '.join(stems)}; got {self.own_mtp_layer}")
        self.gammas, self.batches = sorted(set(self.gammas)), sorted(set(self.batches))
        self.warmup_len = min(self.warmup_len, self.output_len)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"dtype": str(self.dtype).removeprefix("torch.")}


# ------------------------------------------------------------------------------ figures
@dataclass
class SpecFigures:
    """One engine at one batch size. rung: a RUNGS name, or NO_SPEC (gamma 0). Draft counts are
    summed over the timed runs (SpecDecodeStats' meaning: a draft is one verify of one sequence)."""

    rung: str
    gamma: int
    batch: int
    output_tokens: int  # a run's, B·M
    wall_s: float  # the median timed run's
    num_drafts: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [γ]
    accepted_per_position: list[int] = field(default_factory=list)  # [γ]
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def mean_acceptance_length(self) -> float | None:
        """Accepted drafts + 1 a verify; None without drafts."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate_per_position(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def acceptance_length_se(self) -> float | None:
        """The standard error of mean_acceptance_length. A verify accepts a prefix of its drafts, so
        accepted_per_position[j] verifies accepted at least j + 1: that is the whole distribution of
        accepted drafts a verify, E[X²] = Σ_j (2j + 1) P(X > j). Verifies are taken as independent
        (neighbours in one sequence are not quite, so it is a lower bound). None without 2 verifies."""
        n, counts = self.num_drafts, self.accepted_per_position
        if n < 2 or not counts:
            return None
        mean = sum(counts) / n
        second = sum((2 * j + 1) * c for j, c in enumerate(counts)) / n
        return math.sqrt(max(second - mean * mean, 0.0) / n)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"tokens_per_s": self.tokens_per_s,
                                           "mean_acceptance_length": self.mean_acceptance_length,
                                           "acceptance_rate_per_position": self.acceptance_rate_per_position,
                                           "acceptance_length_se": self.acceptance_length_se}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecFigures:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def sum_draft_stats(stats: Sequence[Any], gamma: int) -> dict[str, Any]:
    """The draft counts of many requests' `SpecDecodeStats` added up (SpecFigures' fields)."""
    drafted, accepted = [0] * gamma, [0] * gamma
    for s in stats:
        drafted = [a + b for a, b in zip(drafted, s.drafted_per_position)]
        accepted = [a + b for a, b in zip(accepted, s.accepted_per_position)]
    return {"num_drafts": sum(s.num_drafts for s in stats), "num_accepted_tokens": sum(s.num_accepted_tokens
                                                                                         for s in stats),
            "drafted_per_position": drafted, "accepted_per_position": accepted}


# ------------------------------------------------------------------------------ prompts
def load_held_out(data_dir: str | Path, model_dir: Path, vocab_size: int):
    """The held-out split (megactx.train.data.SplitTokens) of a prepared megactx.train.data
    directory. ValueError when its tokenizer is not the checkpoint's (the ids would mean other text)
    or does not fit the model's vocabulary of `vocab_size`."""
    from megactx.train.data import TOKENIZER_DIR, prepare_data
    from megactx.train.tokenizer import fingerprint, load_tokenizer

    tok_dir = Path(data_dir) / TOKENIZER_DIR
    if not (tok_dir / "tokenizer.json").is_file():
        raise ValueError(f"--data-dir {data_dir} has no {TOKENIZER_DIR}/tokenizer.json; prepare it with "
                         "python -m megactx.train.data")
    data = prepare_data(data_dir, vocab_size=load_tokenizer(tok_dir).get_vocab_size())
    if not (model_dir / "tokenizer.json").is_file() or fingerprint(load_tokenizer(model_dir)) != fingerprint(
            data.tokenizer):
        raise ValueError(f"--data-dir {data_dir} has another tokenizer than --model {model_dir}; pass the data "
                         "directory the checkpoint was trained from")
    if data.tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"--data-dir {data_dir}'s tokenizer has {data.tokenizer.get_vocab_size()} tokens, more than "
                         f"the model's vocabulary of {vocab_size}")
    return data.split("held_out")


def stdlib_held_out(model_dir: Path, vocab_size: int):
    """(SplitTokens, Python version): the held-out files of this interpreter's stdlib
    (megactx.train.corpus, the corpus megactx trains on) tokenized with the checkpoint's
    tokenizer.json. ValueError when that tokenizer does not fit the model's vocabulary."""
    from megactx.train.data import TokenizedCorpus
    from megactx.train.evaluate import held_out_corpus
    from megactx.train.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"--model {model_dir}'s tokenizer.json has {tok.get_vocab_size()} tokens, more than its "
                         f"vocabulary of {vocab_size}")
    corpus = held_out_corpus()  # only the held-out files: their ids are those of the whole corpus
    return TokenizedCorpus.build(corpus, tok).split("held_out"), corpus.python_version


def held_out_prompts(split, n: int, length: int, seed: int) -> list[list[int]]:
    """n windows of `length` token ids of a SplitTokens, each starting at a line start, spread
    evenly over the split and shifted by `seed` line starts. ValueError when the split is short."""
    starts = split.line_starts[split.line_starts + length <= split.num_tokens]
    if len(starts) < n:
        raise ValueError(f"the held-out code has {len(starts)} windows of {length} tokens at line starts; {n} are "
                         "needed: lower --prompt-len or the batch")
    step = len(starts) / n
    picks = [int(starts[(int((i + 0.5) * step) + seed) % len(starts)]) for i in range(n)]
    return [split.tokens[p:p + length].astype("int64").tolist() for p in picks]


# ------------------------------------------------------------------------------ MTP layers
def mtp_layer_files(mtp_dir: str | Path, rungs: Sequence[Rung]) -> dict[str, Path]:
    """{stem: file} of the rungs' MTP layers in `mtp_dir`. ValueError naming every missing file
    and how it is made."""
    stems = dict.fromkeys(r.mtp_layer for r in rungs if r.mtp_layer)  # ordered, each once
    files = {stem: Path(mtp_dir) / f"{stem}{MTP_LAYER_SUFFIX}" for stem in stems}
    missing = [f"{f.name} ({', '.join(r.name for r in rungs if r.mtp_layer == stem)})"
               for stem, f in files.items() if not f.is_file()]
    if missing:
        raise ValueError(f"--mtp-layers {mtp_dir} lacks {'; '.join(missing)}: scripts/train-megactx-tiny.sh writes "
                         "these MTP layers (its OUT/export/), or write one from a checkpoint with "
                         "megactx.train.recipe.export_mtp_layer(checkpoint, out_file)")
    return files


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ the run
class SpecBench:
    """Every engine in turn (no speculation first, then each rung and γ), each over every batch;
    `after_part` gets the results after each engine (to write them as they come).

    With s.mtp_layers, each rung's MTP layer is put on the checkpoint here (with_mtp_layer, into a
    temporary directory removed when `run` ends), so a file that is missing or does not fit the
    backbone is a ValueError before anything is measured; `run` loads each variant once."""

    def __init__(self, path: Path, random_weights: bool, s: Settings, progress: Progress | None = None):
        from megactx.model.weights import load_model

        self.path, self.s, self.rungs = path, s, s.rungs
        self.progress = progress or Progress()
        self.progress.log(f"loading {path} on {s.device}")
        self.model = load_model(path, device=s.device, dtype=s.dtype)
        cfg = self.cfg = self.model.cfg
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError(f"--model {path} has no MTP layer (num_nextn_predict_layers = 0): nothing drafts")
        # room for P + M tokens and the drafts verified past them
        self.max_model_len = s.prompt_len + s.output_len + max(s.gammas) + 1
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"--prompt-len + --output-len + γ = {self.max_model_len} exceeds the model's context "
                             f"{cfg.max_position_embeddings}")
        self.variants: dict[str, Path] = {}  # MTP-layer stem -> the checkpoint with that MTP layer
        self._variant: tuple[str, Any] | None = None  # the variant loaded now: (stem, Transformer)
        # the no-speculation engine, kept for the whole run: a timed run of it, on the same prompts,
        # goes just before every timed run of a speculative engine (the speed-ups' reference)
        self.reference = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        files = mtp_layer_files(s.mtp_layers, self.rungs) if s.mtp_layers else {}
        if files:
            self._assemble(files)
        self.held_out, prompts = None, "random token ids"
        if s.data_dir:
            self.held_out, prompts = load_held_out(s.data_dir, path, cfg.vocab_size), "held-out code"
        elif not random_weights and (path / "tokenizer.json").is_file():
            self.held_out, version = stdlib_held_out(path, cfg.vocab_size)
            prompts = f"held-out code of the Python {version} stdlib, tokenized with the checkpoint's tokenizer"
        self._prompts: dict[tuple[int, int], list[list[int]]] = {}
        self.results: dict[str, Any] = {
            "schema": SCHEMA, "machine": machine_info(s.device), "settings": s.to_dict(),
            "model": {"path": str(path), "random_weights": random_weights, "model_type": cfg.model_type,
                      "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                      "params": sum(p.numel() for p in self.model.parameters())},
            "prompts": prompts,
            # the rungs run, each with its MTP file (None: the checkpoint's own MTP layer)
            "rungs": [dataclasses.asdict(r) | {"mtp_file": str(files[r.mtp_layer]) if r.mtp_layer else None,
                                               "mtp_sha256": _sha256(files[r.mtp_layer]) if r.mtp_layer else None}
                      for r in self.rungs],
            "runs": [], "skipped": []}

    def _assemble(self, files: dict[str, Path]) -> None:
        from megactx.train.recipe import with_mtp_layer

        self._tmp = tempfile.TemporaryDirectory(prefix="megactx-bench-spec-")
        try:
            for stem, file in files.items():
                self.progress.log(f"putting {file} on {self.path}")
                self.variants[stem] = with_mtp_layer(self.path, file, Path(self._tmp.name) / stem)
        except Exception:
            self._tmp.cleanup()
            raise

    def model_for(self, rung: Rung | None):
        """The Transformer an engine of `rung` runs (None: no speculation): the checkpoint, or the
        variant with the rung's MTP layer, loaded on first use and kept until another is needed."""
        from megactx.model.weights import load_model

        if rung is None or rung.mtp_layer is None:
            return self.model
        if self._variant is None or self._variant[0] != rung.mtp_layer:
            self._variant = None
            free_device_memory(self.s.device)
            self.progress.log(f"loading the {rung.mtp_layer} variant")
            self._variant = (rung.mtp_layer, load_model(self.variants[rung.mtp_layer], device=self.s.device,
                                                        dtype=self.s.dtype))
        return self._variant[1]

    def prompts(self, batch: int, run: int) -> list[list[int]]:
        """The prompts of run `run` (0 = the warm-up) at `batch`: the same for every engine."""
        key = (batch, run)
        if key not in self._prompts:
            seed = hash((self.s.seed, batch, run)) & (2**31 - 1)
            if self.held_out is not None:
                self._prompts[key] = held_out_prompts(self.held_out, batch, self.s.prompt_len, seed)
            else:
                self._prompts[key] = random_prompts(batch, self.s.prompt_len, self.cfg.vocab_size, seed)
        return self._prompts[key]

    def engine(self, gamma: int, rung: Rung | None):
        from megactx import LLM
        from megactx.kernels.reference import BLOCK_SIZE

        # KV for the largest batch at full length, plus a block a sequence for the drafts' lookahead
        num_blocks = max(self.s.batches) * (-(-self.max_model_len // BLOCK_SIZE) + 1)
        spec = dict(num_speculative_tokens=gamma, mtp_mode=rung.mtp_mode,
                    draft_acceptance=rung.draft_acceptance) if rung else {}
        if rung and self.s.overlap:
            spec["async_scheduling"] = True
        return LLM(self.model_for(rung), device=self.s.device, dtype=self.s.dtype, max_model_len=self.max_model_len,
                   max_num_seqs=max(self.s.batches), num_blocks=num_blocks, seed=self.s.seed,
                   warm_up=False, **spec)  # every measurement has an untimed run of its own shape first

    def measure(self, llm, gamma: int, rung: Rung | None, batch: int, greedy: bool = False) -> SpecFigures:
        """One warm-up and `reps` timed runs of `batch` prompts on one engine (at temperature 0 and
        named GREEDY + the rung with greedy). A speculative engine's timed runs each follow a timed
        run of the no-speculation engine (self.reference) on the same prompts, seconds apart: their
        walls (detail "reference_walls_s") pair with its own, so that its speed-up does not move
        with the host's speed between this measurement and the no-speculation row's."""
        from megactx import SamplingParams

        s = self.s
        temperature = 0.0 if greedy else s.temperature
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=s.seed + i)
                  for n in (s.warmup_len, s.output_len) for i in range(batch)]
        llm.generate(self.prompts(batch, 0), params[:batch], use_tqdm=False)
        walls, stats, tokens = [], [], 0
        paired = rung is not None and self.reference is not None
        reference_walls = []
        for run in range(1, s.reps + 1):
            prompts = self.prompts(batch, run)
            if paired:
                reference_walls.append(self._timed(self.reference, prompts, params[batch:])[0])
            wall, outs = self._timed(llm, prompts, params[batch:])
            walls.append(wall)
            tokens += sum(len(o.token_ids) for o in outs)
            stats += [o.spec_decode for o in outs if o.spec_decode is not None]
        if tokens != batch * s.output_len * s.reps:  # ignore_eos: only the length ends a request
            raise RuntimeError(f"{tokens} tokens generated in {s.reps} runs of {batch} requests, asked for "
                               f"{s.output_len} a request")
        counts = sum_draft_stats(stats, gamma) if rung else {}
        name = (GREEDY if greedy else "") + (rung.name if rung else NO_SPEC)
        detail = {"walls_s": walls} | ({"reference_walls_s": reference_walls} if paired else {})
        return SpecFigures(name, gamma, batch, batch * s.output_len, statistics.median(walls), **counts,
                           detail=detail)

    def _timed(self, llm, prompts: list[list[int]], params) -> tuple[float, list]:
        """(wall seconds, outputs) of one llm.generate, the device idle at both ends."""
        sync_device(self.s.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync_device(self.s.device)
        return time.perf_counter() - start, outs

    def run(self, after_part: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
        start, threads = time.perf_counter(), torch.get_num_threads()
        if self.s.threads:
            torch.set_num_threads(self.s.threads)
        try:
            self.results["ceilings"] = measure_machine_ceilings(self.s.device)  # beside the engines, same run
            engines = [(0, None, False)] + [(g, r, False) for r in self.rungs for g in self.s.gammas]
            if self.s.greedy:
                engines += [(0, None, True)] + [(g, self.rungs[-1], True) for g in self.s.gammas]
            for gamma, rung, greedy in engines:
                name = (GREEDY if greedy else "") + (f"{rung.name} γ={gamma}" if rung else NO_SPEC)
                try:
                    llm = self.engine(gamma, rung)
                    for batch in [TARGET_SPEEDUP_BATCH] if greedy else self.s.batches:
                        f = self.measure(llm, gamma, rung, batch, greedy)
                        self.results["runs"].append(f.to_dict())
                        self.progress.log(f"{name:<28} batch {batch:3d}: {fmt_num(f.tokens_per_s):>8} tokens/s, "
                                          f"acceptance length {fmt_num(f.mean_acceptance_length)}")
                    if rung is None and not greedy:
                        self.reference = llm  # measured; from here on the speculative runs' partner
                except Exception as e:  # an engine that fails is reported, and the others still run
                    reason = f"{type(e).__name__}: {e}"
                    self.progress.log(f"{name}: not run: {reason}")
                    self.results["skipped"].append({"step": name, "reason": reason})
                llm = None
                free_device_memory(self.s.device)
                self.results["wall_s"] = time.perf_counter() - start
                if after_part:
                    after_part(self.results)
        finally:
            torch.set_num_threads(threads)
            self._variant = self.reference = None
            if self._tmp is not None:
                self._tmp.cleanup()
        return self.results


# ------------------------------------------------------------------------------ lookups
def _runs(results: dict[str, Any]) -> list[SpecFigures]:
    return [SpecFigures.from_dict(d) for d in results["runs"]]


def _find(results: dict[str, Any], rung: str, gamma: int, batch: int) -> SpecFigures | None:
    return next((f for f in _runs(results) if f.rung == rung and f.gamma == gamma and f.batch == batch), None)


def speedup(results: dict[str, Any], f: SpecFigures) -> float | None:
    """f's output tokens/s over no speculation's at the same batch and temperature: the median over
    its timed runs of the no-speculation run just before each (same prompts) over it, where it has
    them; else (a run from before they were recorded) against the no-speculation row. None without
    either."""
    walls, reference = f.detail.get("walls_s"), f.detail.get("reference_walls_s")
    if walls and reference and len(walls) == len(reference):
        return statistics.median(r / w for r, w in zip(reference, walls))  # the same tokens in both
    base = _find(results, (GREEDY if f.rung.startswith(GREEDY) else "") + NO_SPEC, 0, f.batch)
    return f.tokens_per_s / base.tokens_per_s if base else None


# ------------------------------------------------------------------------------ targets
def _target(target: str, figure: str, needs: str, passed: bool | None, note: str = "") -> dict[str, Any]:
    return {"target": target, "figure": figure, "needs": needs, "passed": passed, "note": note}


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets over the rungs the run measured (rungs_of): the speed-up of the top one,
    and each rung against the one below. passed is None where the run cannot decide: not run, a
    CPU run, or random weights (the figures are still shown)."""
    on_gpu = results["machine"]["device"] == "cuda"
    random_weights = results["model"].get("random_weights", False)
    undecided = "random weights" if random_weights else ("a GPU target; CPU run" if not on_gpu else "")
    s, rungs = results["settings"], rungs_of(results)
    rows = []

    b, top = TARGET_SPEEDUP_BATCH, rungs[-1].name
    t = f"{top} >= {TARGET_SPEEDUP:.0f}x output tokens/s over no speculation at batch {b} (best γ)"
    ratios = [(speedup(results, f), f) for f in _runs(results) if f.rung == top and f.batch == b]
    ratios = [(r, f) for r, f in ratios if r is not None]
    if ratios:
        r, f = max(ratios, key=lambda x: x[0])
        a, bound = f.mean_acceptance_length, ""
        if a and r < TARGET_SPEEDUP:  # what bounds it: a step's cost against the tokens it emits
            cost = a / r  # this γ's step, in steps without speculation
            bound = (f"a step at γ = {f.gamma} costs {cost:.2f} steps without speculation, so "
                     f"{TARGET_SPEEDUP:.0f}x needs an acceptance length of {TARGET_SPEEDUP * cost:.2f}; it is {a:.2f}")
        rows.append(_target(t, f"{r:.2f}x at γ = {f.gamma} ({fmt_num(f.tokens_per_s)} tokens/s)",
                            f">= {TARGET_SPEEDUP:.0f}x", None if undecided else r >= TARGET_SPEEDUP,
                            "; ".join(x for x in (undecided, bound) if x)))
    else:
        rows.append(_target(t, "–", f">= {TARGET_SPEEDUP:.0f}x", None,
                            f"batch {b} not in this run" if b not in s["batches"] else "not run"))

    gamma, batch = max(s["gammas"]), max(s["batches"])  # acceptance does not depend on the batch: most samples
    for lower, upper in zip(rungs, rungs[1:]):
        t = f"acceptance length {upper.name} >= {lower.name} (γ = {gamma}, batch {batch})"
        lo, hi = _find(results, lower.name, gamma, batch), _find(results, upper.name, gamma, batch)
        if lo and hi and lo.mean_acceptance_length and hi.mean_acceptance_length:
            a, c = lo.mean_acceptance_length, hi.mean_acceptance_length
            digits = next((d for d in range(2, 7) if f"{c:.{d}f}" != f"{a:.{d}f}"), 2)  # a verdict shows why
            rows.append(_target(t, f"{c:.{digits}f} vs {a:.{digits}f}", ">=", None if random_weights else c >= a,
                                "random weights" if random_weights else _within_noise(lo, hi)))
        else:
            rows.append(_target(t, "–", ">=", None, "not run"))
    return rows


def _within_noise(lo: SpecFigures, hi: SpecFigures) -> str:
    """A note where two acceptance lengths differ by less than two standard errors of their
    difference: the ordering of such rungs is not settled by this run's samples."""
    if lo.acceptance_length_se is None or hi.acceptance_length_se is None:
        return ""
    diff, se = hi.mean_acceptance_length - lo.mean_acceptance_length, math.hypot(lo.acceptance_length_se,
                                                                                hi.acceptance_length_se)
    return f"within noise: {diff:+.3f} is {abs(diff) / se:.1f} standard errors" if se and abs(diff) < 2 * se else ""


def _length(f: SpecFigures) -> str:
    """An acceptance length with its standard error."""
    se = f.acceptance_length_se
    return fmt_num(f.mean_acceptance_length) + (f" ± {se:.2f}" if se is not None else "")


# ------------------------------------------------------------------------------ Markdown
def _rates(f: SpecFigures) -> str:
    return " ".join("–" if r is None else f"{r:.2f}" for r in f.acceptance_rate_per_position)


def render_markdown(results: dict[str, Any], targets: list[dict[str, Any]]) -> str:
    m, s, model = results["machine"], results["settings"], results["model"]
    device = m.get("gpu") or m["device"]
    out = [f"# megactx speculative decoding benchmark: {device}\n"]
    versions = f"torch {m['torch']}, triton {m['triton']}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "")
    params = f", {model['params'] / 1e6:.1f}M parameters" if model.get("params") else ""
    out.append(f"{m['date']}; {versions}. Model `{model['path']}` ({model['model_type']}, {model['layers']} layers, "
               f"hidden {model['hidden_size']}, vocabulary {model['vocab_size']}{params}), {s['dtype']}. "
               f"Every request: {s['prompt_len']} prompt tokens ({results.get('prompts', 'random token ids')}), "
               f"exactly {s['output_len']} generated at temperature {s['temperature']} (EOS ignored); "
               f"{s['reps']} timed run(s) after a warm-up"
               + (f"; whole run {results['wall_s']:.0f} s" if "wall_s" in results else "") + ".\n")
    if model.get("random_weights"):
        out.append(f"**{RANDOM_WEIGHTS_NOTE.capitalize()}** (no trained model yet): the MTP layer drafts noise; "
                   "the figures measure the engine's mechanics only.\n")
    if m["device"] != "cuda":
        out.append("**CPU run**: megactx runs its pure-torch kernel twins here; the targets are GPU targets.\n")
    out.append("Acceptance length: tokens a verify emits (accepted drafts + 1); in the ladder ± its standard error "
               "(verifies taken as independent). Speed-up: output tokens/s over "
               "no speculation at the same batch, on the same prompts (the median over the timed runs, each "
               "against a run of the no-speculation engine just before it: the host's speed drifts within a run)"
               + (" (every engine replays CUDA graphs for its decode, verify and draft steps)"
                  if m["device"] == "cuda" else "")
               + (". The speculative engines overlap their steps (`LLM(async_scheduling=True)`: a step of "
                  "KVShare drafts launches the next verify before its host sync)" if s.get("overlap") else "")
               + ".\n")

    if results.get("ceilings"):
        out.append(ceilings_markdown(Ceilings.from_dict(results["ceilings"])) + "\n")
    rungs = rungs_of(results)
    out.append("## Ladder against the published GLM ablation\n")
    gamma = max(s["gammas"])
    rows = []
    for rung in rungs:
        cells = [rung.name, f"{rung.published:.2f}" if gamma == PUBLISHED_GAMMA else f"{rung.published:.2f} (γ = 7)"]
        for b in s["batches"]:
            f = _find(results, rung.name, gamma, b)
            cells.append(_length(f) if f else "–")
        rows.append([*cells, f"`{rung.mtp_layer}{MTP_LAYER_SUFFIX}`" if rung.mtp_layer else "the checkpoint's"])
    if TV_LOSS_RUNG.name not in {r.name for r in rungs}:
        rows.append([TV_LOSS_RUNG.name, f"{TV_LOSS_RUNG.published:.2f}", *["–"] * len(s["batches"]),
                     "a training change: not measured without --mtp-layers"])
    out.append(md_table(["rung", "published", *[f"ours, γ = {gamma}, batch {b}" for b in s["batches"]],
                         "MTP layer"], rows))
    if s.get("mtp_layers"):
        own = s.get("own_mtp_layer")
        out.append(f"\nMTP layers from `{s['mtp_layers']}`, each on the backbone of `{model['path']}`"
                   + (f"; the rungs of `{own}` on the checkpoint's own MTP layer, trained so" if own else "")
                   + ".\n")

    for b in s["batches"]:
        base = _find(results, NO_SPEC, 0, b)
        out.append(f"\n## Batch {b}\n")
        out.append(f"No speculation: {fmt_num(base.tokens_per_s) if base else '–'} output tokens/s"
                   + (f" (wall {fmt_time(base.wall_s)})" if base else "") + ".\n")
        rows = []
        for g in s["gammas"]:
            cells: list[Any] = [g]
            for rung in rungs:
                f = _find(results, rung.name, g, b)
                r = f and speedup(results, f)
                cells += [fmt_num(f.mean_acceptance_length), fmt_num(f.tokens_per_s),
                          f"{r:.2f}x" if r else "–"] if f else ["–"] * 3
            rows.append(cells)
        heads = [f"{rung.name} {what}" for rung in rungs for what in ("acc. len", "tokens/s", "speed-up")]
        out.append(md_table(["γ", *heads], rows))

    greedy_runs = [f for f in _runs(results) if f.rung.startswith(GREEDY) and f.gamma]
    if greedy_runs:
        b = TARGET_SPEEDUP_BATCH
        base = _find(results, GREEDY + NO_SPEC, 0, b)
        out.append(f"\n## Greedy decoding, batch {b}\n")
        out.append(f"Temperature 0 (every rung accepts greedily: drafts are the MTP argmax, kept while they equal "
                   f"the target's), {rungs[-1].name}'s MTP layer. No speculation: "
                   f"{fmt_num(base.tokens_per_s) if base else '–'} output tokens/s.\n")
        rows = [[f.gamma, fmt_num(f.mean_acceptance_length), fmt_num(f.tokens_per_s),
                 f"{r:.2f}x" if (r := speedup(results, f)) else "–"]
                for f in sorted(greedy_runs, key=lambda f: f.gamma)]
        out.append(md_table(["γ", "acc. len", "tokens/s", "speed-up"], rows))

    out.append(f"\n## Acceptance rate per draft position (γ = {gamma})\n")
    rows = [[rung.name, b, _rates(f)] for rung in rungs for b in s["batches"]
            if (f := _find(results, rung.name, gamma, b))]
    out.append(md_table(["rung", "batch", "positions 1 … γ"], rows))

    out.append("\n## Targets\n")
    mark = {True: "pass", False: "**FAIL**", None: "n/a"}
    out.append(md_table(["target", "figure", "needs", "result"],
                        [[t["target"], t["figure"], t["needs"],
                          mark[t["passed"]] + (f" ({t['note']})" if t["note"] else "")] for t in targets]))
    if results.get("skipped"):
        out.append("\n## Not run\n")
        out.append(md_table(["part", "why"], [[x["step"], x["reason"].replace("\n", " ")]
                                              for x in results["skipped"]]))
    return "\n".join(out)


# ------------------------------------------------------------------------------ PNG
def plot(results: dict[str, Any], path: Path) -> bool:
    """Two panels: acceptance length by γ for each measured rung (one line style per batch, the
    published ladder at γ = 7 as stars); speed-up over no speculation by γ. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    s, rungs = results["settings"], rungs_of(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    styles = ["-", "--", ":", "-."]
    for k, rung in enumerate(rungs):
        color = f"C{k}"
        for j, b in enumerate(s["batches"]):
            found = [f for g in s["gammas"] if (f := _find(results, rung.name, g, b))]
            acc = [(f.gamma, f.mean_acceptance_length) for f in found if f.mean_acceptance_length]
            spd = [(f.gamma, r) for f in found if (r := speedup(results, f))]
            label = f"{rung.name}, batch {b}"
            if acc:
                ax1.plot(*zip(*acc), "o" + styles[j % len(styles)], color=color, label=label)
            if spd:
                ax2.plot(*zip(*spd), "o" + styles[j % len(styles)], color=color, label=label)
        ax1.plot([PUBLISHED_GAMMA], [rung.published], "*", color=color, markersize=13,
                 label=f"{rung.name}, published")
    if TV_LOSS_RUNG.name not in {r.name for r in rungs}:
        ax1.plot([PUBLISHED_GAMMA], [TV_LOSS_RUNG.published], "*", color=f"C{len(rungs)}", markersize=13,
                 label=f"{TV_LOSS_RUNG.name}, published")
    gammas = s["gammas"]
    ax1.plot(gammas, [g + 1 for g in gammas], color="grey", lw=0.8, alpha=0.6, label="γ + 1 (every draft accepted)")
    ax1.set(xlabel="γ (draft tokens a step)", ylabel="mean acceptance length (tokens a verify)",
            title="Acceptance length (higher is better)")
    ax2.axhline(1.0, color="grey", lw=0.8, label="no speculation")
    ax2.axhline(TARGET_SPEEDUP, color="red", lw=0.8, ls="--", label=f"target {TARGET_SPEEDUP:.0f}x at batch "
                                                                      f"{TARGET_SPEEDUP_BATCH}")
    ax2.set(xlabel="γ (draft tokens a step)", ylabel="output tokens/s ÷ no speculation's",
            title="Speed-up over no speculation (same batch)")
    for ax in (ax1, ax2):
        ax.set_xticks(s["gammas"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    device = results["machine"].get("gpu") or results["machine"]["device"]
    title = f"megactx bench spec: {device}, {s['prompt_len']} prompt + {s['output_len']} output tokens"
    if results["model"].get("random_weights"):
        title += f" ({RANDOM_WEIGHTS_NOTE})"
    fig.suptitle(title)
    save_figure(fig, path)
    return True


def write_reports(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Evaluate the targets, then write spec-<device>.json (raw figures + targets), .md and .png
    (when matplotlib is installed) into out_dir. Returns the paths written."""
    targets = evaluate_targets(results)
    return write_suite_reports("spec", results | {"targets": targets}, out_dir,
                               lambda r: render_markdown(r, targets), plot)


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"checkpoint directory with an MTP layer (default: models/megactx-tiny, else a cached "
                        f"random tiny checkpoint: {RANDOM_WEIGHTS_NOTE})")
    p.add_argument("--data-dir", default=None,
                   help="a megactx.train.data directory: prompts are its held-out code (default: held-out stdlib "
                        "code in the checkpoint's tokenizer; random token ids for the random checkpoint)")
    p.add_argument("--mtp-layers", default=None, metavar="DIR",
                   help="directory of MTP-layer files (mtp-ce-noshare, mtp-ce-share, mtp-tv-share .safetensors, "
                        "from scripts/train-megactx-tiny.sh): every rung runs on the MTP layer its training rung "
                        "produced, and the +end-to-end TV loss rung is measured too (default: three rungs on the "
                        "checkpoint's own MTP layer)")
    p.add_argument("--own-mtp-layer", default=None, metavar="STEM",
                   help="with --mtp-layers: the rungs of this MTP-layer file (e.g. mtp-tv-share) run on the "
                        "checkpoint's own MTP layer, which that training rung produced, so DIR need not hold the "
                        "file (a shipped model whose MTP layer is that variant)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda or cpu (default: cuda when torch sees a GPU); sizes default by device, see above")
    p.add_argument("--quick", action="store_true", help="γ in {1, 7}, batch 1, fewer tokens")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for spec-<device>.json, .md and .png (default: {RESULTS_DIR})")
    p.add_argument("--gammas", type=int_list, default=None, help="draft lengths γ, e.g. 1,2,3,4,5,6,7")
    p.add_argument("--batches", type=int_list, default=None, help="batch sizes, e.g. 1,32")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens a request (P)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens a request (M)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default 1.0)")
    p.add_argument("--reps", type=int, default=None,
                   help=f"timed runs of every engine and batch, each on prompts of its own (default {GPU_REPS} on a "
                        "GPU, 1 with --quick or on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the sampling (default 0)")
    p.add_argument("--no-greedy", dest="greedy", action="store_false",
                   help="skip the greedy runs (temperature 0, batch 1: no speculation and the top rung at every γ)")
    p.add_argument("--overlap", action="store_true",
                   help="speculative engines overlap their steps (LLM(async_scheduling=True): a step of KVShare "
                        "drafts launches the next verify before its host sync); default: as the engine defaults")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on a CPU, torch's own on a GPU)")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="do not measure: write the .md and .png again from a results JSON")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed arguments; ValueError names the bad argument."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    s = Settings.defaults(device, args.quick)
    for name in ("gammas", "batches", "prompt_len", "output_len", "reps", "threads", "data_dir", "mtp_layers",
                 "own_mtp_layer"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    s.temperature, s.seed, s.greedy, s.overlap = args.temperature, args.seed, args.greedy, args.overlap
    if s.data_dir is not None and not Path(s.data_dir).is_dir():
        raise ValueError(f"--data-dir {s.data_dir} is not a directory; prepare one with python -m megactx.train.data")
    if s.mtp_layers is not None and not Path(s.mtp_layers).is_dir():
        raise ValueError(f"--mtp-layers {s.mtp_layers} is not a directory of MTP-layer files; "
                         "scripts/train-megactx-tiny.sh writes them (megactx.train.recipe.export_mtp_layer)")
    s.check()
    return s


def run(args: argparse.Namespace) -> int:
    """`megactx bench spec`: 0 on success (engines that could not run are reported in the
    results), 2 on bad arguments or an unusable checkpoint."""
    prog = "megactx bench spec"
    if args.from_json is not None:
        return rerender_from_json(prog, args.from_json, args.out, write_reports)
    from megactx.generate import resolve_model

    progress = Progress()
    try:
        settings = settings_from_args(args)
        path, random_weights = resolve_model(args.model, progress.log)
        if random_weights:
            progress.log(RANDOM_WEIGHTS_NOTE)
        bench = SpecBench(path, random_weights, settings, progress)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = args.out or RESULTS_DIR
    written: list[Path] = []

    def write(results: dict[str, Any]) -> None:  # after every engine, so a later crash keeps the figures
        written[:] = write_reports(results, out)

    bench.run(after_part=write)
    for path in written:
        print(path)
    return 0
