"""The DSA / IndexShare training recipe as separate, resumable stages.

| stage      | attention                        | trains                   | loss                                    |
|------------|----------------------------------|--------------------------|-----------------------------------------|
| dense      | dense, an indexer in every layer | backbone (not indexers)  | LM cross-entropy                        |
| warmup     | dense, IndexShare from here on   | kept indexers only       | KL(served layers' attention ‖ index)    |
| sparse     | top-k                            | backbone + kept indexers | LM + multi-layer distillation KL        |
| extend     | top-k, the longest context       | backbone + kept indexers | as sparse (+ needle tasks, code data)   |
| indexers   | top-k, the longest context       | kept indexers only       | distillation KL                         |
| mtp_warmup | backbone top-k, MTP dense        | MTP layer (+ indexer)    | MTP CE and/or TV (γ steps) + KL warm-up |
| mtp        | top-k, IndexShare + KVShare      | MTP layer (+ indexer)    | MTP CE and/or TV + distillation KL      |

A stage may mix needle tasks into its code rows (`Stage.needle_fraction`, loss on the answer only).
`indexers` goes on training the kept indexers alone at the extended length, the backbone frozen,
with `Stage.kl_candidates` (the KL over more keys than each selects, so that a key ranked just
outside the top-k still gets a gradient) and `Stage.indexer_needle_weight` (the KL's mean over the
needle answers as a term of its own: the few queries that retrieve in a 64K row).

`Recipe.attention` picks the architecture of the stages from `sparse` on: "indexshare" (the
recipe's pattern), "dsa" (an indexer in every layer) or "dense" (no sparsity: every layer full with
index_topk = max_position_embeddings, so every causal key is selected, and the indexers frozen).
The last two are the held-out-loss ablations at equal budget; their stage directories carry the
variant (`warmup-dsa`, `sparse-dsa`, `sparse-dense`; the dense one has no warm-up) and share the
`dense` stage.

`dense` runs the recipe's architecture with `indexer_types` all "full" (an untrained indexer in
every layer); `warmup` converts it to the recipe's IndexShare pattern, keeping the indexers of the
full layers and dropping the others, and from then on each kept indexer learns the mean attention
of the layers it serves: over every causal key in `warmup`, over its selection from `sparse` on.
The warm-up must see the whole group: an indexer warmed up on its own layer alone, then asked to
serve six, selects keys the later layers never needed and the distillation over its own selection
cannot find the ones they do (a run so trained started `sparse` 1.5 nats/token above DSA in every
layer, and its retrieval never came back). The MTP stages set `index_share_for_mtp_iteration` to
the recipe's `mtp_share`, so the checkpoint drafts at inference exactly as it was trained.

Each stage lives in `<out>/<stage>/` (checkpoint, metrics.jsonl, loss.png; the MTP stages' names
carry their loss and sharing, e.g. `mtp-tv-share`, so ablations share the backbone stages), starts
from the previous stage's finished checkpoint, and resumes its own checkpoint when one exists. A
stage may start from a model directory instead (`megactx train --init`, e.g. more steps on a shipped
model); its init.json names that model and the sha256 of its weights. The MTP warm-up always starts
from the recipe's seeded, untrained MTP layer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megactx.config import ModelConfig
from megactx.model import build_model, init_weights, load_model, save_pretrained
from megactx.model.transformer import Transformer
from megactx.train.losses import DEFAULT_CHUNK_BYTES, LossConfig, Objective
from megactx.train.needles import STANDARD_TASKS, NeedleDataset
from megactx.train.trainer import (
    CHECKPOINT,
    STATE_FILE,
    DistContext,
    FitResult,
    RandomTokens,
    TokenSource,
    TrainConfig,
    Trainer,
    agree,
    compile_blocks,
    init_distributed,
)

STAGE_KINDS = ("dense", "warmup", "sparse", "extend", "indexers", "mtp_warmup", "mtp")
MTP_KINDS = ("mtp_warmup", "mtp")
INDEXER_KL_KINDS = ("warmup", "sparse", "extend", "indexers")  # train the backbone's indexers by a KL
LONG_KINDS = ("extend", "indexers")  # at the longest context (megactx train --context sets their rows)
INIT_FILE = "init.json"  # a stage started from given weights (run_stage's init) names them here
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


ATTENTION_VARIANTS = ("indexshare", "dsa", "dense")
COPY_FORMS = ("half", "window")  # CodeSource's copy rows


def needle_lengths(needle_len: int | tuple[int, ...] | None) -> tuple[int | None, ...]:
    """Stage.needle_len as the cycle of lengths the needle rows go through."""
    return needle_len if isinstance(needle_len, tuple) else (needle_len,)


@dataclass
class Stage:
    """kind: one of STAGE_KINDS. needle_fraction: share of the stage's sequences that are needle
    tasks instead of code (code data only); needle_len: tokens a needle task, several packed a row
    when shorter than the rows (None: one task a row), or a tuple of such lengths that the needle
    rows cycle through (a row of long tasks, a row of short ones, ...); needle_tasks: names of
    megactx.train.needles.STANDARD_TASKS the needle rows cycle through (None: all of them);
    copy_fraction: share of the other (code) rows that are copy rows, a code window followed by
    itself (see CodeSource). yarn: this stage lengthens the context by YaRN (the rotary
    frequencies that do not complete their turns within the earlier stages' longest rows are
    interpolated, by this stage's rows over those); the model keeps it from here on.
    kl_candidates, indexer_needle_weight (kinds in INDEXER_KL_KINDS): the indexer KL spans each
    query's top-`kl_candidates` keys by indexer score, more than the top-k it selects (0: the top-k
    only; `warmup`'s dense KL spans every key anyway), and a second KL term, the mean over the
    needle answers alone, is added with this weight (0: none); see losses.TrainingAttention and
    losses.LossConfig."""

    kind: str
    train: TrainConfig
    needle_fraction: float = 0.0
    needle_len: int | tuple[int, ...] | None = None
    needle_tasks: tuple[str, ...] | None = None
    copy_fraction: float = 0.0
    yarn: bool = False
    kl_candidates: int = 0
    indexer_needle_weight: float = 0.0

    def __post_init__(self) -> None:
        lengths = needle_lengths(self.needle_len)
        if not lengths or any(n is not None and n < 1 for n in lengths):
            raise ValueError(f"needle_len must be a positive number of tokens or a tuple of them, "
                             f"got {self.needle_len}")
        if self.kind not in STAGE_KINDS:
            raise ValueError(f"stage kind must be one of {', '.join(STAGE_KINDS)}, got {self.kind!r}")
        if self.kl_candidates < 0 or self.indexer_needle_weight < 0:
            raise ValueError(f"kl_candidates and indexer_needle_weight must be >= 0, got {self.kl_candidates} "
                             f"and {self.indexer_needle_weight}")
        for name in ("needle_fraction", "copy_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        unknown = set(self.needle_tasks or ()) - set(STANDARD_TASKS)
        if unknown or self.needle_tasks == ():
            raise ValueError(f"needle_tasks must name some of {', '.join(STANDARD_TASKS)}, got {self.needle_tasks}")


@dataclass
class Recipe:
    """A model architecture and its stages.

    model: the final architecture (its indexer_types is the IndexShare pattern of the stages from
    `sparse` on). data: "synthetic" (RandomTokens) or "code" (megactx.train.data: the stdlib corpus
    and its tokenizer, whose vocabulary replaces the model's). attention: one of ATTENTION_VARIANTS
    (module docstring). mtp_steps: γ; mtp_loss: "ce", "tv" or "ce+tv"; mtp_share: IndexShare +
    KVShare across the MTP steps. copy_forms: the forms of COPY_FORMS the copy rows cycle through
    (CodeSource). seed: the model's initialisation and the data's order, needles and copy windows.
    select_fp8: the sparse stages select keys as the serving engine's FP8 indexer cache does (the
    indexers' KL still trains their exact scores). compile: each stage compiles its model's layer
    blocks (trainer.compile_blocks) before training: the same math, fewer kernels. yarn_factor: the
    YaRN factor of the stages from the first with `yarn` on (default: the stretch, their longest
    rows over the longest rows before it, times yarn_headroom); a factor above the stretch trains
    the positions the model will be served with past its trained rows."""

    name: str
    model: ModelConfig
    stages: list[Stage]
    data: str = "synthetic"
    attention: str = "indexshare"
    mtp_steps: int = 7
    mtp_loss: str = "ce"
    mtp_share: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    copy_forms: tuple[str, ...] = COPY_FORMS
    seed: int = 0
    select_fp8: bool = False  # sparse layers select their top-k from FP8-simulated indexer scores
    compile: bool = False
    yarn_factor: float | None = None
    yarn_headroom: float = 1.0

    def __post_init__(self) -> None:
        if not self.copy_forms or set(self.copy_forms) - set(COPY_FORMS):
            raise ValueError(f"copy_forms must name some of {', '.join(COPY_FORMS)}, got {self.copy_forms}")
        if self.data not in ("synthetic", "code"):
            raise ValueError(f"data must be 'synthetic' or 'code', got {self.data!r}")
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_VARIANTS)}, got {self.attention!r}")
        for i, stage in enumerate(self.stages):
            if stage.yarn and (i == 0 or stage.train.seq_len <= max(s.train.seq_len for s in self.stages[:i])):
                raise ValueError(f"stage {stage.kind!r} has yarn on: it must come after a stage and train longer rows "
                                 "than every stage before it (YaRN stretches the positions of those)")
        if self.yarn_headroom < 1:
            raise ValueError(f"yarn_headroom must be at least 1 (positions for the trained rows), "
                             f"got {self.yarn_headroom:g}")
        if self.yarn_factor is not None:
            rows = self.yarn_rows()
            if rows is None:
                raise ValueError("yarn_factor needs a stage with yarn on (extend)")
            stretch = rows[1] / rows[0]
            if self.yarn_factor < stretch:
                raise ValueError(f"yarn_factor must be at least the stretch of the yarn stages' rows, {stretch:g} "
                                 f"(their longest over the longest before them), got {self.yarn_factor:g}")
        if any(s.kind in MTP_KINDS for s in self.stages) and not self.model.num_nextn_predict_layers:
            raise ValueError("MTP stages need model.num_nextn_predict_layers >= 1")
        LossConfig(mtp_steps=self.mtp_steps, mtp_loss=self.mtp_loss)  # validates both

    def yarn_rows(self, upto: int | None = None) -> tuple[int, int] | None:
        """(original, stretched): the longest rows before the first yarn stage among stages 0..upto
        (default: all) and the longest rows of those yarn stages (None without one)."""
        stages = self.stages if upto is None else self.stages[: upto + 1]
        yarn = [i for i, stage in enumerate(stages) if stage.yarn]
        if not yarn:
            return None
        return max(s.train.seq_len for s in stages[: yarn[0]]), max(stages[i].train.seq_len for i in yarn)

    def stage_name(self, index: int) -> str:
        kind = self.stages[index].kind.replace("_", "-")
        variant = "" if self.attention == "indexshare" or not self.converted(index) else f"-{self.attention}"
        if self.stages[index].kind in MTP_KINDS:
            return f"{kind}-{self.mtp_loss.replace('+', '')}-{'share' if self.mtp_share else 'noshare'}{variant}"
        return kind + variant

    def runs(self, index: int) -> bool:
        """Whether stage `index` exists in this variant: the dense ablation has no indexer to train."""
        return not (self.attention == "dense" and self.stages[index].kind in ("warmup", "indexers"))

    def previous(self, index: int) -> int | None:
        """The stage that stage `index` starts from: the last earlier stage that runs (None: none)."""
        return next((i for i in range(index - 1, -1, -1) if self.runs(i)), None)

    def converted(self, index: int) -> bool:
        """Whether stage `index` runs the attention variant's architecture: every stage after `dense`."""
        return self.stages[index].kind != "dense"

    def stage_index(self, name_or_kind: str) -> int:
        for i, stage in enumerate(self.stages):
            if name_or_kind in (stage.kind, self.stage_name(i)):
                return i
        names = ", ".join(self.stage_name(i) for i in range(len(self.stages)))
        raise ValueError(f"recipe {self.name!r} has no stage {name_or_kind!r}; its stages: {names}")

    def scaled(self, factor: float) -> Recipe:
        """The same recipe with every stage's steps (and warm-up) times `factor` (at least 1)."""
        stages = [dataclasses.replace(s, train=dataclasses.replace(
            s.train, steps=max(1, round(s.train.steps * factor)), warmup_steps=round(s.train.warmup_steps * factor)))
            for s in self.stages]
        return dataclasses.replace(self, stages=stages)


# ---------------------------------------------------------------------------------------------
# What each stage means for the model
# ---------------------------------------------------------------------------------------------
def stage_model_config(recipe: Recipe, index: int) -> ModelConfig:
    """The architecture stage `index` trains: every layer full in `dense`, the recipe's IndexShare
    pattern from `warmup` on (or its attention variant's); max_position_embeddings raised to
    the longest sequence trained so far; MTP sharing as the recipe says; YaRN rotary positions from
    the first stage with `yarn` on."""
    cfg = recipe.model
    kind = recipe.stages[index].kind
    longest = max(s.train.seq_len for s in recipe.stages[: index + 1])
    if longest > cfg.max_position_embeddings:
        cfg = cfg.replace(max_position_embeddings=longest)
    if not recipe.converted(index) or recipe.attention != "indexshare":
        cfg = cfg.replace(indexer_types=["full"] * cfg.num_hidden_layers, index_topk_pattern=None)
    if recipe.converted(index) and recipe.attention == "dense":
        cfg = cfg.replace(index_topk=cfg.max_position_embeddings)  # every causal key: dense attention
    if kind in MTP_KINDS:
        cfg = cfg.replace(index_share_for_mtp_iteration=recipe.mtp_share)
    rows = recipe.yarn_rows(index)
    if rows is not None:
        original, stretched = rows
        factor = recipe.yarn_factor or recipe.yarn_headroom * stretched / original
        cfg = cfg.replace(rope_parameters={
            "rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": factor,
            "original_max_position_embeddings": original, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0})  # DeepSeek-V3's YaRN settings
    return cfg


def trained_kind(recipe: Recipe, index: int) -> str:
    """The stage kind whose loss and trainable parameters stage `index` uses: its own, except that
    the dense variant's sparse / extend stages train as `dense` does."""
    kind = recipe.stages[index].kind
    return "dense" if recipe.attention == "dense" and kind in ("sparse", "extend") else kind


def loss_config(recipe: Recipe, kind: str, stage: Stage | None = None) -> LossConfig:
    """What a stage of `kind` optimises; `stage` adds its own indexer KL settings (kl_candidates,
    indexer_needle_weight) where its kind trains the backbone's indexers by a KL."""
    common = dict(chunk_bytes=recipe.chunk_bytes, select_fp8=recipe.select_fp8)
    if stage is not None and kind in INDEXER_KL_KINDS:
        common |= dict(kl_candidates=stage.kl_candidates, indexer_needle_weight=stage.indexer_needle_weight)
    mtp = dict(lm=False, attention="sparse", indexers="mtp", mtp_steps=recipe.mtp_steps, mtp_loss=recipe.mtp_loss,
               mtp_share=recipe.mtp_share, **common)
    return {
        "dense": LossConfig(lm=True, attention="dense", **common),
        "warmup": LossConfig(lm=False, attention="dense", indexers="backbone", **common),
        "sparse": LossConfig(lm=True, attention="sparse", indexers="backbone", **common),
        "extend": LossConfig(lm=True, attention="sparse", indexers="backbone", **common),
        "indexers": LossConfig(lm=False, attention="sparse", indexers="backbone", **common),
        "mtp_warmup": LossConfig(**mtp, mtp_attention="dense"),
        "mtp": LossConfig(**mtp, mtp_attention="sparse"),
    }[kind]


def stage_loss_config(recipe: Recipe, index: int) -> LossConfig:
    return loss_config(recipe, trained_kind(recipe, index), recipe.stages[index])


def set_trainable(model: Transformer, kind: str) -> None:
    """requires_grad for stage `kind`: dense trains the backbone without its (unused) indexers;
    warmup and indexers only the backbone's indexers; sparse / extend the backbone with its indexers; the MTP
    stages only the MTP layer (embedding and head are the backbone's, frozen). The routers'
    e_score_correction_bias never takes gradients (trainer.ExpertBalancer moves it)."""
    if kind not in STAGE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(STAGE_KINDS)}, got {kind!r}")
    for name, p in model.named_parameters():
        indexer, mtp = ".indexer." in name, name.startswith("mtp.")
        trains = {"dense": not mtp and not indexer, "warmup": indexer and not mtp, "indexers": indexer and not mtp,
                  "sparse": not mtp, "extend": not mtp}.get(kind, mtp)
        p.requires_grad_(trains and not name.endswith("e_score_correction_bias"))


def adapt_model(model: Transformer, cfg: ModelConfig, fresh_indexers: bool = False, seed: int = 0) -> Transformer:
    """`model`'s weights in architecture `cfg`: the same tensors, minus the indexers of layers that
    `cfg` makes shared (the IndexShare conversion). fresh_indexers: a layer that `cfg` makes full
    gets a new indexer (seeded random init), for a stage that trains indexers from scratch (warmup:
    an indexer in every layer of an IndexShare model, `--attention dsa --init`). Any other
    difference in tensors is refused."""
    if model.cfg.to_dict() == cfg.to_dict():
        return model
    with torch.device("meta"):
        new = Transformer(cfg)
    new.to_empty(device=model.lm_head.weight.device)
    old = model.state_dict()
    wanted = new.state_dict()
    missing = sorted(set(wanted) - set(old))
    dropped = sorted(set(old) - set(wanted))
    if ((missing and not (fresh_indexers and all(".indexer." in name for name in missing)))
            or any(".indexer." not in name for name in dropped)):
        raise ValueError(f"cannot convert {model.cfg.indexer_types} to {cfg.indexer_types}: missing {missing[:4]}, "
                         f"unexpected {[n for n in dropped if '.indexer.' not in n][:4]} (a layer that turns full "
                         "has no trained indexer to keep; only the warmup stage gives it a new one)")
    bad = [name for name in wanted if name in old and old[name].shape != wanted[name].shape]
    if bad:
        raise ValueError(f"cannot convert: shapes differ for {bad[:4]}")
    if missing:
        init_weights(new, seed=seed)  # the new indexers' init; every other tensor is loaded over it
    new.load_state_dict({name: old[name] for name in wanted if name in old}, strict=not missing)
    return new


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
@dataclass
class CodeSource:
    """The stdlib code corpus (megactx.train.data) as a TokenSource: packed rows of the train split
    in the hashed order of epoch e's seed, epoch after epoch; with needle_fraction > 0, every
    round(1 / needle_fraction)-th example is a needle task instead (loss on its answer only;
    "needle_rows" marks those rows, whose loss the Objective weighs apart from the code's).
    needle_len: when shorter than the rows, a needle row packs seq_len // needle_len tasks of
    needle_len tokens (the last one takes the remainder), each with its own needles: many cheap
    retrieval examples a row, the earlier tasks' needles acting as distractors for the later. A
    tuple of lengths: needle row m takes needle_len[m mod len], so that retrieval is trained both
    across the whole row and, cheaply, many times at shorter distances.
    needle_tasks: the STANDARD_TASKS names the tasks cycle through (None: all).

    copy_fraction > 0: every round(1 / copy_fraction)-th code row is a copy row instead: code seen
    earlier in the row repeated at its end, the loss on the repeat only ("copy_rows"). Predicting
    text seen before is what retrieval needs (an induction head: find the earlier occurrence of the
    current context, continue it), and a small model trained on ~40M code tokens does not learn it
    from code alone: an earlier megactx-tiny run predicted a repeated 100-token code window no
    better than its first occurrence. Copy rows cycle through `copy_forms` (COPY_FORMS):
    - "half": the first half of the row, then the same tokens again. A model learns these fast, as a
      head attending half a row back, which also trains the copying of what a head attends to. Two
      H200 runs with only these rows learnt them by step ~800, then copied no better than the code's
      loss at other row lengths; one learnt the needles at steps 1650-1860 of 2000, the other never
      did (answer digits at 2.3 nats, chance among ten);
    - "window": a window of L // 4 tokens repeated from a start drawn per row, so at a varying
      distance, which only a head that matches content predicts. These alone are learnt slowly: at
      16 × 256 tokens a step on a CPU, their loss was still that of the code after 1000 steps."""

    data: object  # megactx.train.data.TrainingData
    seed: int = 0
    needle_fraction: float = 0.0
    needle_len: int | tuple[int, ...] | None = None
    needle_tasks: tuple[str, ...] | None = None
    copy_fraction: float = 0.0
    copy_forms: tuple[str, ...] = COPY_FORMS
    _packed: dict = field(default_factory=dict, repr=False)  # (seq_len, epoch) -> PackedDataset
    _needles: object = field(default=None, repr=False)

    def _epoch(self, seq_len: int, epoch: int):
        key = (seq_len, epoch)
        if key not in self._packed:
            from megactx.train.data import PackedDataset

            if len(self._packed) >= 2:  # consecutive steps touch at most two epochs
                self._packed.pop(next(iter(self._packed)))
            rows = self.data.pretraining_sequences(seq_len - 1, "train", self.seed + epoch)
            self._packed[key] = PackedDataset(rows, seed=self.seed + epoch)
        return self._packed[key]

    def _needle_task(self, n: int, seq_len: int) -> dict[str, torch.Tensor]:
        if self._needles is None:
            self._needles = self.data.needles("train")
        tasks = tuple(STANDARD_TASKS[t] for t in self.needle_tasks or STANDARD_TASKS)
        return NeedleDataset(self._needles, seq_len - 1, num_examples=n + 1, tasks=tasks, seed=self.seed)[n]

    def _needle(self, n: int, seq_len: int) -> dict[str, torch.Tensor]:
        """Needle row n: one task of seq_len tokens, or k packed tasks of the row's needle length
        (tasks n·K … n·K + k − 1, K = seq_len // the shortest length: every row's tasks differ)."""
        cycle = needle_lengths(self.needle_len)
        task_len = cycle[n % len(cycle)]
        K = max(1, seq_len // min(length or seq_len for length in cycle))
        if not task_len or task_len * 2 > seq_len:
            return self._needle_task(n * K, seq_len)
        k = seq_len // task_len
        lengths = [task_len] * (k - 1) + [seq_len - task_len * (k - 1)]
        tasks = [self._needle_task(n * K + i, length) for i, length in enumerate(lengths)]
        no_target = torch.zeros(1, dtype=torch.bool)  # a task's last token does not predict the next task's first
        masks = [m for t in tasks[:-1] for m in (t["loss_mask"], no_target)] + [tasks[-1]["loss_mask"]]
        return {"input_ids": torch.cat([t["input_ids"] for t in tasks]), "loss_mask": torch.cat(masks)}

    def _copy(self, row: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """Copy row k (k-th among copy rows) from code row `row` [L], in form copy_forms[k mod n].
        "half": the row's first half, then the same tokens again. "window": its first L − w tokens,
        then tokens a .. a + w − 1 again (w = L // 4, a ~ U[0, L − 2w] drawn from k). Targets: the
        repeat but its first token, which nothing announces."""
        ids = row["input_ids"]
        L = len(ids)
        if self.copy_forms[k % len(self.copy_forms)] == "half":
            w, a = L // 2, 0  # the second half repeats the first: [0, L − w) then [0, w)
        else:
            w = L // 4
            a = random.Random(f"{self.seed}/copy/{k}").randint(0, L - 2 * w)
        mask = torch.zeros(L - 1, dtype=torch.bool)
        mask[L - w :] = True  # targets j + 1 = L − w + 1 .. L − 1: the repeat's second token on
        return {"input_ids": torch.cat([ids[: L - w], ids[a : a + w]]), "loss_mask": mask}

    def examples(self, start: int, count: int, seq_len: int) -> dict[str, torch.Tensor]:
        every = round(1 / self.needle_fraction) if self.needle_fraction else 0
        copy_every = round(1 / self.copy_fraction) if self.copy_fraction else 0
        per_epoch = len(self._epoch(seq_len, 0))  # every epoch packs the same documents: same row count
        rows, needle, copy = [], [], []
        for n in range(start, start + count):
            needle.append(bool(every) and n % every == 0)
            code = n - (n // every + 1 if every else 0)  # code rows before this one: rows minus needle rows
            copy.append(not needle[-1] and bool(copy_every) and code % copy_every == 0)
            if needle[-1]:
                rows.append(self._needle(n // every, seq_len))
            else:
                row = self._epoch(seq_len, n // per_epoch)[n % per_epoch]
                rows.append(self._copy(row, code // copy_every) if copy[-1] else row)
        batch = {"input_ids": torch.stack([r["input_ids"] for r in rows]),
                 "loss_mask": torch.stack([r["loss_mask"] for r in rows])}
        if every:
            batch["needle_rows"] = torch.tensor(needle)  # the Objective weighs their loss apart
        if copy_every:
            batch["copy_rows"] = torch.tensor(copy)
        return batch


def prepare_recipe_data(recipe: Recipe, data_dir: str | Path | None, out_dir: Path, init: Path | None = None
                        ) -> tuple[Recipe, object | None, list[Path]]:
    """For code data: prepare the corpus and tokenizer in data_dir (default <out>/data), fit the
    recipe's vocabulary and EOS to the tokenizer, and write the tokenizer files every checkpoint
    carries. init: a model directory the run starts from; a new data directory takes its
    tokenizer, and one with another tokenizer is refused (its ids would mean other tokens).
    -> (recipe, TrainingData or None, tokenizer files)."""
    if recipe.data == "synthetic":
        return recipe, None, []
    from megactx.train.data import directory_lock, prepare_data
    from megactx.train.tokenizer import fingerprint, load_tokenizer

    init_tok = load_tokenizer(init) if init is not None and (init / "tokenizer.json").is_file() else None
    data = prepare_data(Path(data_dir) if data_dir else out_dir / "data", vocab_size=recipe.model.vocab_size,
                        tokenizer=init_tok, tokenizer_source=f"--init {init}'s")
    tok_dir = out_dir / "tokenizer"
    with directory_lock(out_dir):  # stages started side by side in one run write it once
        if not (tok_dir / "tokenizer.json").exists():
            data.save_tokenizer(tok_dir)
        elif fingerprint(load_tokenizer(tok_dir)) != fingerprint(data.tokenizer):
            raise ValueError(f"{tok_dir} (the run's tokenizer, which its checkpoints carry) differs from "
                             f"{data.tokenizer_dir}: this run was trained with another tokenizer; use its data "
                             "directory or a new --out")
    files = [tok_dir / f for f in TOKENIZER_FILES if (tok_dir / f).exists()]
    model = recipe.model.replace(vocab_size=data.tokenizer.get_vocab_size(), eos_token_id=[data.end_id],
                                 pad_token_id=data.end_id, bos_token_id=None)
    return dataclasses.replace(recipe, model=model), data, files


def stage_source(recipe: Recipe, index: int, data) -> TokenSource:
    if recipe.data == "synthetic":
        return RandomTokens(recipe.model.vocab_size, seed=recipe.seed)
    stage = recipe.stages[index]
    return CodeSource(data, seed=recipe.seed, needle_fraction=stage.needle_fraction, needle_len=stage.needle_len,
                      needle_tasks=stage.needle_tasks, copy_fraction=stage.copy_fraction,
                      copy_forms=recipe.copy_forms)


# ---------------------------------------------------------------------------------------------
# Running stages
# ---------------------------------------------------------------------------------------------
def stage_progress(stage_dir: Path) -> int:
    """Optimizer steps a stage directory's checkpoint has done (0: none)."""
    state = stage_dir / CHECKPOINT / STATE_FILE
    return torch.load(state, map_location="cpu", weights_only=False)["step"] if state.exists() else 0


UNLEARNT_NEEDLE_LOSS = 1.0  # nats/token over a stage's last 10%: chance ≈ ln 10 a digit, a model that retrieves < 0.5


def retrieval_warning(name: str, kind: str, history: list[dict]) -> str | None:
    """A warning when a finished stage's needle answers, over its last 10% of steps, still cost
    more than UNLEARNT_NEEDLE_LOSS: retrieval is a late jump in the dense stage (it came at steps
    ~1650-2500 in the 8-layer runs of docs/megactx-tiny.md, and in one 16-layer run of 2000 steps not
    at all), and the stages after such a model do not learn it either. None when it is learnt or
    the stage has no needle rows."""
    losses = [row["needle"] for row in history[-max(1, len(history) // 10):]
              if isinstance(row.get("needle"), float) and not math.isnan(row["needle"])]  # NaN: no needle rows
    if not losses or (mean := sum(losses) / len(losses)) <= UNLEARNT_NEEDLE_LOSS:
        return None
    return (f"{name}: warning: the needle answers still cost {mean:.2f} nats/token over the last 10% of steps "
            f"(chance about 2.3; a model that retrieves is below 0.5): it has not learnt retrieval, and the "
            f"stages after it will not find needles. Train again from the first stage that warns, in a new --out, "
            f"with more steps (--stage-steps {kind}=N for this one) or another --seed")


def weights_digest(model_dir: str | Path) -> str:
    """sha256 over a model directory's *.safetensors files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def stage_model(recipe: Recipe, index: int, out_dir: Path, init: Path | None = None) -> Transformer:
    """The model stage `index` starts from: fresh (seeded) for the first stage, else the previous
    stage's finished checkpoint adapted to this stage's architecture; `init` (a model directory)
    instead of either."""
    cfg = stage_model_config(recipe, index)
    prev = recipe.previous(index)
    if init is None and prev is None:
        return build_model(cfg, seed=recipe.seed)
    if init is None:
        prev_dir = out_dir / recipe.stage_name(prev)
        prev_steps = recipe.stages[prev].train.steps
        if stage_progress(prev_dir) < prev_steps:
            raise ValueError(f"stage {recipe.stage_name(index)} starts from {prev_dir / CHECKPOINT}, which is not "
                             f"finished ({stage_progress(prev_dir)} of {prev_steps} steps); run "
                             f"{recipe.stage_name(prev)} first")
        init = prev_dir / CHECKPOINT
    else:
        wants = [cfg] if prev is None else [cfg, stage_model_config(recipe, prev)]
        init_matches(ModelConfig.from_pretrained(init), wants, init, recipe.stage_name(index))
    kind = recipe.stages[index].kind
    model = adapt_model(load_model(init, dtype=torch.float32), cfg, fresh_indexers=kind == "warmup", seed=recipe.seed)
    if kind == "mtp_warmup":
        seeded_mtp_layer(recipe, model)
    return model


INIT_MUST_MATCH = ("rope_parameters", "index_topk")  # what recipe options change and no tensor shows


def init_matches(have: ModelConfig, wants: list[ModelConfig], init: Path, stage: str) -> None:
    """Refuse to start `stage` from a model directory (--init) trained with other positions or
    another top-k than this recipe gives the stage (wants[0]) or the stage before it (wants[1:]: a
    model that stage would have left, which this one adapts as it does in a whole run, e.g. `extend`
    from a `sparse` model at its 4K positions): the weights would load and mean something else. A
    YaRN model that this stage's YaRN stretches further (a larger factor over the same original
    length, e.g. a 64K model extended again with --context or --yarn-factor) is adapted the same way."""
    if any(all(getattr(have, k) == getattr(want, k) for k in INIT_MUST_MATCH) for want in wants):
        return
    if have.index_topk == wants[0].index_topk and further_stretch(have.rope_parameters, wants[0].rope_parameters):
        return
    diff = "; ".join(f"{k}: {getattr(have, k)} there, {getattr(wants[0], k)} here"
                     for k in INIT_MUST_MATCH if getattr(have, k) != getattr(wants[0], k))
    raise ValueError(f"--init {init} does not match stage {stage} ({diff}) nor the stage before it, nor does this "
                     "stage stretch its YaRN positions further; give the recipe options the model was trained with "
                     "(--context, --topk, --yarn-factor), or for a stage before the YaRN ones (warmup, sparse) the "
                     "model's positions as --hf-overrides '{\"rope_parameters\": ...}' (its config.json's)")


def further_stretch(have: dict, want: dict) -> bool:
    """Whether rotary parameters `want` are `have`'s YaRN with a larger factor and all else equal."""
    return (have.get("rope_type") == want.get("rope_type") == "yarn" and want["factor"] > have["factor"]
            and {k: v for k, v in have.items() if k != "factor"} == {k: v for k, v in want.items() if k != "factor"})


def seeded_mtp_layer(recipe: Recipe, model: Transformer) -> None:
    """Put the MTP layer of the recipe's seeded initial model into `model`: the MTP warm-up starts
    from an untrained layer. In a whole run that is the layer `model` already holds (no backbone
    stage trains it); a backbone started from a shipped model (--init) carries a trained one."""
    fresh = build_model(stage_model_config(recipe, 0), seed=recipe.seed).state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("mtp."):
                p.copy_(fresh[name])


def run_stage(recipe: Recipe, index: int, out_dir: str | Path, source: TokenSource, extra_files=(),
              ctx: DistContext | None = None, max_steps: int | None = None, time_limit_s: float | None = None,
              progress: bool = True, init: Path | None = None) -> FitResult:
    """Train stage `index` of `recipe` in <out_dir>/<stage name>/ (resuming it if begun). init: a
    model directory whose weights the stage starts from instead of the previous stage's (noted in
    the stage directory's INIT_FILE; a resumed stage must name the same one)."""
    out_dir = Path(out_dir)
    stage = recipe.stages[index]
    stage_dir = out_dir / recipe.stage_name(index)
    noted = json.loads((stage_dir / INIT_FILE).read_text())["init"] if (stage_dir / INIT_FILE).is_file() else None
    if init is None and noted is not None:
        init = Path(noted)  # a resumed stage starts as it began
    elif init is not None and str(init) != noted:
        if stage_progress(stage_dir):
            raise ValueError(f"{stage_dir} was started from {noted or 'the previous stage'}, not {init}; resume "
                             "it as it began, or point --out elsewhere")
        if ctx is None or ctx.is_main:
            stage_dir.mkdir(parents=True, exist_ok=True)
            (stage_dir / INIT_FILE).write_text(json.dumps({"init": str(init), "weights_sha256": weights_digest(init)},
                                                          indent=1) + "\n")
    model = stage_model(recipe, index, out_dir, init)
    set_trainable(model, trained_kind(recipe, index))
    if recipe.compile:
        compile_blocks(model)
    objective = Objective(model, stage_loss_config(recipe, index))
    trainer = Trainer(objective, source, stage.train, out_dir / recipe.stage_name(index), extra_files, ctx,
                      progress, label=f"{recipe.name}/{recipe.stage_name(index)}")
    try:
        return trainer.fit(max_steps, time_limit_s)
    finally:
        trainer.close()


def run_recipe(recipe: Recipe, out_dir: str | Path, stages: list[str] | None = None, data_dir: str | Path | None = None,
               ctx: DistContext | None = None, max_steps: int | None = None, time_limit_s: float | None = None,
               progress: bool = True, log=print, init: str | Path | None = None) -> list[FitResult]:
    """Run `stages` (names or kinds; default all) in recipe order, skipping finished ones and
    stopping at the first that max_steps or time_limit_s (over the whole call) leaves unfinished.
    init: a model directory the first of `stages` starts from instead of the previous stage's
    checkpoint (a run continued elsewhere, or more steps of a stage from a shipped model).
    Returns the results of the stages that ran."""
    out_dir = Path(out_dir)
    ctx = ctx or init_distributed()
    recipe, data, extra = prepare_recipe_data(recipe, data_dir, out_dir, Path(init) if init is not None else None)
    chosen = sorted({recipe.stage_index(s) for s in stages}) if stages else list(range(len(recipe.stages)))
    start, results = time.perf_counter(), []
    for index in chosen:
        name, steps = recipe.stage_name(index), recipe.stages[index].train.steps
        if not recipe.runs(index):
            log(f"{name}: not part of the {recipe.attention} variant, skipped")
            continue
        if stage_progress(out_dir / name) >= steps:
            log(f"{name}: finished ({steps} steps), skipped")
            continue
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - start)
        if agree(left is not None and left <= 0):
            break
        result = run_stage(recipe, index, out_dir, stage_source(recipe, index, data), extra, ctx, max_steps, left,
                           progress, Path(init) if init is not None and index == chosen[0] else None)
        results.append(result)
        loss = f", loss {result.history[-1]['loss']:.4f}" if result.history else ""
        log(f"{name}: {result.step}/{steps} steps{loss}, checkpoint {result.checkpoint}")
        if result.finished and (warning := retrieval_warning(name, recipe.stages[index].kind, result.history)):
            log(warning)
        if not result.finished:
            break
    return results


def export_model(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy a stage checkpoint as a shippable model directory: weights in `dtype` (router and
    indexer head weights stay fp32), config and tokenizer files; no trainer state."""
    checkpoint, out = Path(checkpoint), Path(out)
    save_pretrained(load_model(checkpoint, dtype=torch.float32), out, dtype=dtype)
    for name in TOKENIZER_FILES:
        if (checkpoint / name).exists():
            shutil.copy2(checkpoint / name, out / name)
    return out


MTP_SHARE_KEY = "index_share_for_mtp_iteration"


def mtp_prefix(cfg: ModelConfig) -> str:
    """Checkpoint name prefix of the (first) MTP layer: it follows the decoder layers."""
    return f"model.layers.{cfg.num_hidden_layers}."


def export_mtp_layer(checkpoint: str | Path, out_file: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The MTP layer of `checkpoint` alone, as one safetensors file (checkpoint tensor names; the
    config's index_share_for_mtp_iteration in its metadata), to put on another model of the same
    backbone with `with_mtp_layer`: the MTP ablations differ only there."""
    from safetensors.torch import save_file

    from megactx.model.weights import checkpoint_tensors

    model = load_model(checkpoint, dtype=torch.float32)
    prefix = mtp_prefix(model.cfg)
    kept = Transformer.FP32_PARAMS
    tensors = {name: (t if name.endswith(kept) else t.to(dtype)).detach().contiguous().cpu()
               for name, t in checkpoint_tensors(model) if name.startswith(prefix)}
    if not tensors:
        raise ValueError(f"{checkpoint} has no MTP layer (num_nextn_predict_layers = 0)")
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_file, metadata={MTP_SHARE_KEY: str(model.cfg.index_share_for_mtp_iteration).lower()})
    return out_file


def with_mtp_layer(model_dir: str | Path, mtp_file: str | Path, out_dir: str | Path) -> Path:
    """A copy of `model_dir` whose MTP layer and MTP sharing come from `mtp_file` (written by
    `export_mtp_layer` from a model of the same backbone). Every MTP tensor must be replaced by
    one of the same name and shape."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    with safe_open(str(mtp_file), "pt") as f:
        share = (f.metadata() or {}).get(MTP_SHARE_KEY)
    layer = load_file(str(mtp_file))
    if share not in ("true", "false"):
        raise ValueError(f"{mtp_file} has no {MTP_SHARE_KEY} metadata; write it with export_mtp_layer")
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    replaced = set()
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        names = [n for n in tensors if n.startswith(mtp_prefix(cfg))]
        for name in names:
            if name not in layer or layer[name].shape != tensors[name].shape:
                raise ValueError(f"{mtp_file} does not fit {model_dir}: {name} missing or of another shape")
            tensors[name] = layer[name].to(tensors[name].dtype)
        if names:
            save_file(tensors, str(path), metadata={"format": "pt"})
        replaced.update(names)
    if replaced != set(layer):
        raise ValueError(f"{mtp_file} does not fit {model_dir}: {sorted(set(layer) ^ replaced)[:4]} differ")
    cfg.replace(index_share_for_mtp_iteration=share == "true").save(out_dir)
    return out_dir


def find_max_context(recipe: Recipe, index: int, out_dir: str | Path, lengths: list[int],
                     ctx: DistContext | None = None, budget_s: float | None = None, log=print) -> int:
    """The longest of `lengths` (ascending) at which stage `index` runs one optimizer step of one
    sequence a rank on this GPU without running out of memory, and, with budget_s, whose stage
    (steps × accumulation × measured step time) fits in it. Stops at the first that does not."""
    ctx = ctx or init_distributed()
    if ctx.device.type != "cuda":
        raise ValueError("find_max_context measures GPU memory; run it on a CUDA device")
    stage = recipe.stages[index]
    best = 0
    for seq_len in sorted(lengths):
        model = stage_model(recipe, index, Path(out_dir))
        set_trainable(model, trained_kind(recipe, index))
        objective = Objective(model, stage_loss_config(recipe, index)).to(ctx.device)
        ids = RandomTokens(recipe.model.vocab_size).examples(0, 1, seq_len)["input_ids"].to(ctx.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = objective(ids)
            loss.backward()
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            log(f"context {seq_len}: out of memory")
            break
        finally:
            del objective, model
            torch.cuda.empty_cache()
        seconds = time.perf_counter() - t0
        accum = stage.train.global_batch // (stage.train.micro_batch * ctx.world)
        total = seconds * accum * stage.train.micro_batch * stage.train.steps
        log(f"context {seq_len}: {seconds:.2f} s a sequence, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, "
            f"stage ≈ {total / 60:.1f} min")
        torch.cuda.reset_peak_memory_stats()
        if budget_s is not None and total > budget_s:
            break
        best = seq_len
    if not best:
        raise ValueError(f"none of the context lengths {lengths} fits this GPU / budget")
    return best


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------
def smoke_recipe() -> Recipe:
    """Every stage on a micro model for CI: seconds on a CPU. Top-k 16 under sequences of 48–96
    tokens, so the sparse stages really select; IndexShare pattern FSFS; γ = 7 MTP steps."""
    model = ModelConfig.from_pretrained("tiny").replace(
        vocab_size=128, hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, index_n_heads=4, index_head_dim=32, index_topk=16, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, index_topk_pattern="FSFS", max_position_embeddings=128, eos_token_id=[0])

    def train(steps: int, seq_len: int, lr: float) -> TrainConfig:
        return TrainConfig(steps=steps, seq_len=seq_len, global_batch=4, micro_batch=2, lr=lr, warmup_steps=1)

    stages = [Stage("dense", train(4, 48, 3e-3)), Stage("warmup", train(3, 48, 3e-3)),
              Stage("sparse", train(3, 48, 1e-3)), Stage("extend", train(2, 96, 5e-4), yarn=True),
              Stage("indexers", train(2, 96, 1e-3), kl_candidates=24, indexer_needle_weight=1.0),
              Stage("mtp_warmup", train(2, 48, 3e-3)), Stage("mtp", train(2, 48, 1e-3))]
    return Recipe("smoke", model, stages, chunk_bytes=256 << 10)


def tiny_recipe() -> Recipe:
    """megactx-tiny: the `tiny` preset at 16 layers (hidden 256, MLA, MoE with 4 routed experts and
    a shared one, one MTP layer; 12.9M parameters), top-k 128 and IndexShare 1/4 with four indexers,
    at layers 0, 4, 8 and 15 (FSSSFSSSFSSSSSSF), on the stdlib code corpus (~2.3M train tokens):
    one H200, about 26 minutes for every stage and the MTP layers of the acceptance ladder. Why each
    choice, with the runs that decided it, is in docs/megactx-tiny.md ("How the recipe came to be").

    The pattern: the last layer is the one that retrieves, and wants its own indexer (every pattern
    that shared it, at 8 and at 16 layers, lost the copy rows or the needles); the middle layers'
    code wants an indexer deeper than layer 0's. At equal budget this pattern was +0.93% / +0.25%
    held-out bits per byte against every-layer DSA at 1K / 4K and +1.32% / +1.30% against dense,
    and learnt the copy rows and needles as every-layer DSA did.

    Needle tasks are half the rows of the backbone stages and their answer loss is weighed apart
    from the code's (LossConfig.needle_weight), so that retrieval is learnt at short lengths, its
    attention distilled into the indexers, then extended: 512-token tasks packed four a row in
    `dense` and `warmup` (one value to find: single, multikey, distractors); in `sparse` rows of one
    4096-token task alternate with rows of four of 1024 (every task kind); in `extend` and
    `indexers` one 64K task, then sixteen of 4096. Half the code rows are copy rows (a window
    repeated later in its row, at a fixed or a varying distance: CodeSource), the dense signal that
    teaches finding and continuing earlier text; without them retrieval was never learnt. It is
    learnt abruptly, at a step that moves from run to run (1650-2500 of 3000 at 8 layers; at 16
    layers once not within 2000), so run_recipe warns after a stage that has not learnt it.

    `extend` trains 64K rows at YaRN positions for twice that (yarn_headroom 2: factor 32 over the
    4096 of `sparse`), as the model is served; `indexers` then trains the indexers alone (the
    backbone frozen) on the attention of each query's top 512 keys, with the KL's mean over the
    needle answers weighed as much as its mean over every query: a 64K row's few retrieving queries
    otherwise carry no weight, and the 8-layer model went from 87.5% to 96.5% of 200 needles at 64K.

    Tokens: dense 3000 × 16 × 2048 ≈ 98M (a quarter code rows, a quarter copy rows: ~9 passes over
    the corpus), warm-up 3.3M, sparse 300 × 8 × 4096 ≈ 10M, extend 80 × 2 × 64K ≈ 10.5M, indexers
    50 × 2 × 64K ≈ 6.6M, MTP 100 × 16 × 2048 + 450 × 8 × 4096 ≈ 18M per variant (the backbone
    frozen; at 150 steps, as first shipped, the TV layer's acceptance was still rising: 450 took
    the 16-layer model's expected accepted drafts from 0.89 to 1.2 in training).
    max_position_embeddings is 1M so that the needle evaluation may run past the trained length
    (YaRN covers 32 × 4096 = 128K of it; 256K needles: 0%). Scale the steps with
    `megactx train --steps-scale`; the 8-layer model shipped before is
    `--hf-overrides '{"num_hidden_layers": 8, "n_routed_experts": 8}' --pattern FSSSSSSF`."""
    model = ModelConfig.from_pretrained("tiny").replace(num_hidden_layers=16, n_routed_experts=4, index_topk=128,
                                                        index_topk_pattern="FSSSFSSSFSSSSSSF",
                                                        max_position_embeddings=1 << 20)

    def train(steps: int, seq_len: int, batch: int, micro: int, lr: float, warmup: int) -> TrainConfig:
        return TrainConfig(steps=steps, seq_len=seq_len, global_batch=batch, micro_batch=micro, lr=lr,
                           warmup_steps=warmup, save_every=100)

    lookups = ("single", "multikey", "distractors")  # one value to find: the retrieval circuit first
    stages = [Stage("dense", train(3000, 2048, 16, 16, 2e-3, 60), needle_fraction=0.5, needle_len=512,
                    needle_tasks=lookups, copy_fraction=0.5),
              Stage("warmup", train(100, 2048, 16, 16, 1e-3, 10), needle_fraction=0.5, needle_len=512,
                    needle_tasks=lookups, copy_fraction=0.5),
              Stage("sparse", train(300, 4096, 8, 8, 1e-3, 30), needle_fraction=0.5, needle_len=(4096, 1024),
                    copy_fraction=0.5),
              Stage("extend", train(80, 65536, 2, 1, 3e-4, 6), needle_fraction=0.5, needle_len=(65536, 4096),
                    copy_fraction=0.5, yarn=True),
              Stage("indexers", train(50, 65536, 2, 1, 5e-4, 10), needle_fraction=0.5, needle_len=(65536, 4096),
                    copy_fraction=0.5, kl_candidates=512, indexer_needle_weight=1.0),
              Stage("mtp_warmup", train(100, 2048, 16, 16, 1e-3, 10)),
              Stage("mtp", train(450, 4096, 8, 8, 1e-3, 15))]
    return Recipe("tiny", model, stages, data="code", chunk_bytes=1 << 30, yarn_headroom=2.0)


RECIPES = {"smoke": smoke_recipe, "tiny": tiny_recipe}
