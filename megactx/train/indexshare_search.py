"""`megactx indexshare-search`: the training-free IndexShare search (IndexCache).

Starting from a checkpoint's pattern (`ModelConfig.indexer_types`), greedily flip full layers to
shared: each round tries every remaining full layer except layer 0 (a shared layer reuses the
top-k of the nearest full layer below it, and layer 0 has none below), measures the LM loss on a
calibration set with that one layer flipped, and keeps the flip with the lowest loss. With a data
directory the calibration holds held-out code and needle retrieval tasks, and the loss adds their
answers' loss to the code's (`Calibration`), so that the layer that retrieves keeps its indexer. It stops at
a target number of full layers (default: as many as GLM-5.2's 1-in-4 rule gives) or before a flip
that would raise the loss more than a budget above the starting pattern's.

    megactx indexshare-search --model ckpt --data-dir runs/tiny/data --out ckpt-indexshare
    megactx indexshare-search --model ckpt --num-full 3 --loss-budget 0.05 --out ckpt-3full

A flipped layer keeps its weights during the search; its indexer is simply not run (the layer is
handed its source layer's top-k). The output directory is a copy of the checkpoint whose
config.json carries `index_topk_pattern` and whose flipped layers have no indexer tensors, plus
`indexshare_search.json` and `indexshare_search.md` (each round's loss, and the loss of the
uniform GLM-5.2 pattern for comparison).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from megactx.config import ModelConfig
from megactx.model.transformer import Transformer
from megactx.train.losses import IGNORE

# GLM-5.2's uniform IndexShare rule: full <=> max(i - offset + 1, 0) % freq == 0 (21 of 78 layers).
UNIFORM_FREQ = 4
UNIFORM_OFFSET = 3
REPORT_JSON = "indexshare_search.json"
REPORT_MD = "indexshare_search.md"
FULL, SHARED = "F", "S"
DEFAULT_SEQ_LEN = 1024
DEFAULT_NUM_SEQUENCES = 16


# ---------------------------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------------------------
def pattern_of(cfg: ModelConfig) -> str:
    """The config's IndexShare pattern as one letter a layer: F (full) or S (shared)."""
    return "".join(FULL if t == "full" else SHARED for t in cfg.indexer_types)


def uniform_pattern(num_layers: int, freq: int = UNIFORM_FREQ, offset: int = UNIFORM_OFFSET) -> str:
    """The uniform pattern of ModelConfig's rule (default: GLM-5.2's, layers 0, 1, 2, 6, 10, ...)."""
    return "".join(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers))


def flip(pattern: str, layer: int) -> str:
    """`pattern` with full layer `layer` made shared."""
    if layer <= 0 or pattern[layer] != FULL:
        raise ValueError(f"layer {layer} cannot be flipped in {pattern}: it must be a full layer other than 0")
    return pattern[:layer] + SHARED + pattern[layer + 1:]


def set_pattern(model: Transformer, pattern: str) -> None:
    """Route `model`'s top-k by `pattern` (in place: model.cfg is replaced). Every F layer must own
    an indexer; S layers may keep theirs (it is not run)."""
    if len(pattern) != model.cfg.num_hidden_layers:
        raise ValueError(f"pattern must have {model.cfg.num_hidden_layers} letters, got {len(pattern)}")
    missing = [i for i, c in enumerate(pattern) if c == FULL and model.model.layers[i].self_attn.indexer is None]
    if missing:
        raise ValueError(f"pattern {pattern} makes layers {missing} full, but they have no indexer weights; "
                         "a search can only flip full layers to shared")
    model.cfg = model.cfg.replace(index_topk_pattern=pattern)


# ---------------------------------------------------------------------------------------------
# Calibration loss
# ---------------------------------------------------------------------------------------------
def random_calibration(vocab_size: int, num_sequences: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """[num_sequences, seq_len + 1] int64 random tokens, each row's second half a copy of its first
    (an induction task, so attention and the indexers have something to find). For tests."""
    gen = torch.Generator().manual_seed(seed)
    half = (seq_len + 2) // 2
    first = torch.randint(0, vocab_size, (num_sequences, half), generator=gen)
    return torch.cat([first, first], dim=1)[:, : seq_len + 1]


@dataclass
class Calibration:
    """What a pattern's loss is measured on: code [N, S + 1] int64 (every next token scored) and,
    optionally, retrieval tasks needles [M, S + 1] whose answers alone are scored (answer_mask
    [M, S] bool, True where the target needles[:, j + 1] is an answer token). The loss is the
    code's mean next-token cross-entropy plus the answers': code alone barely notices a flip that
    blinds the layer that retrieves (a few answer tokens in thousands), which costs retrieval all."""

    code: torch.Tensor
    needles: torch.Tensor | None = None
    answer_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name, rows in (("code", self.code), ("needles", self.needles)):
            if rows is not None and (rows.dim() != 2 or rows.shape[1] < 2):
                raise ValueError(f"calibration {name}: sequences must be [N, S + 1] token ids with S >= 1, "
                                 f"got shape {tuple(rows.shape)}")
        paired = (self.needles is None) == (self.answer_mask is None)
        if not paired or (self.needles is not None and self.answer_mask.shape != (self.needles.shape[0],
                                                                                  self.needles.shape[1] - 1)):
            raise ValueError("needles [M, S + 1] need an answer_mask [M, S] (and only they do)")

    @property
    def seq_len(self) -> int:
        return self.code.shape[1] - 1

    def loss(self, model: Transformer, batch_size: int = 1) -> float:
        code = calibration_loss(model, self.code, batch_size)
        return code if self.needles is None else code + calibration_loss(model, self.needles, batch_size,
                                                                         self.answer_mask)


@torch.no_grad()
def calibration_loss(model: Transformer, sequences: torch.Tensor, batch_size: int = 1,
                     mask: torch.Tensor | None = None) -> float:
    """Mean next-token cross-entropy (nats) of `model` over sequences [N, S + 1] int64 (row i's
    inputs are its first S tokens, its labels the last S; mask [N, S] bool: the labels scored,
    None = all), in batches of `batch_size` rows."""
    device = model.lm_head.weight.device
    total, count = 0.0, 0
    for r0 in range(0, sequences.shape[0], batch_size):
        rows = sequences[r0 : r0 + batch_size].to(device)
        labels = rows[:, 1:]
        if mask is not None:
            labels = labels.masked_fill(~mask[r0 : r0 + batch_size].to(device), IGNORE)
        logits = model(rows[:, :-1])  # [B, S, vocab] fp32
        total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum").item()
        count += int((labels != IGNORE).sum())
    return total / max(count, 1)


# ---------------------------------------------------------------------------------------------
# The greedy search
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SearchRound:
    """One greedy round: the loss of every candidate flip, and the one kept."""

    flipped: int  # the layer made shared
    pattern: str  # the pattern after the flip
    loss: float  # its calibration loss (nats a token)
    candidates: dict[int, float]  # layer -> loss with that layer flipped (this round's trials)


@dataclass
class SearchResult:
    start_pattern: str
    start_loss: float
    uniform_pattern: str
    uniform_loss: float | None  # None when the checkpoint lacks an indexer the uniform pattern needs
    num_full: int  # the target
    loss_budget: float | None
    rounds: list[SearchRound] = field(default_factory=list)
    compared: dict[str, float | None] = field(default_factory=dict)  # hand-made pattern -> its loss (as uniform_loss)
    stop_reason: str = ""

    @property
    def pattern(self) -> str:
        return self.rounds[-1].pattern if self.rounds else self.start_pattern

    @property
    def loss(self) -> float:
        return self.rounds[-1].loss if self.rounds else self.start_loss

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(pattern=self.pattern, loss=self.loss, full_layers=[i for i, c in enumerate(self.pattern) if c == FULL])
        for r in d["rounds"]:
            r["candidates"] = {str(k): v for k, v in r["candidates"].items()}
        return d

    def table(self) -> str:
        """Markdown: one row a round (start, each flip), then the uniform pattern and the compared ones; then what the
        first round measured: the cost of sharing each layer alone (the layers the model cannot
        spare show here, whatever the greedy order)."""
        lines = ["| round | flipped | full layers | loss | Δ vs start | pattern |", "|---|---|---|---|---|---|"]

        def row(name: str, layer: str, pattern: str, loss: float | None) -> str:
            loss_s = "n/a" if loss is None else f"{loss:.4f}"
            delta = "n/a" if loss is None else f"{loss - self.start_loss:+.4f}"
            return f"| {name} | {layer} | {pattern.count(FULL)} | {loss_s} | {delta} | `{pattern}` |"

        lines.append(row("start", "-", self.start_pattern, self.start_loss))
        for k, r in enumerate(self.rounds, 1):
            lines.append(row(str(k), str(r.flipped), r.pattern, r.loss))
        lines.append(row("uniform", "-", self.uniform_pattern, self.uniform_loss))
        lines += [row("compared", "-", pattern, loss) for pattern, loss in self.compared.items()]
        lines.append(f"\nstopped: {self.stop_reason}\n")
        if self.rounds:
            first = self.rounds[0].candidates
            lines += ["Round 1, each layer shared alone (with the nearest full layer below it):", "",
                      "| layer | loss | Δ vs start |", "|---|---|---|"]
            lines += [f"| {i} | {loss:.4f} | {loss - self.start_loss:+.4f} |" for i, loss in sorted(first.items())]
        return "\n".join(lines) + "\n"


def default_num_full(num_layers: int) -> int:
    """Full layers of GLM-5.2's uniform rule for `num_layers` layers (21 of 78)."""
    return uniform_pattern(num_layers).count(FULL)


def indexshare_search(model: Transformer, sequences: torch.Tensor | Calibration, num_full: int | None = None,
                      loss_budget: float | None = None, batch_size: int = 1, progress: bool = True,
                      log: Callable[[str], object] = lambda s: None, compare: Sequence[str] = ()) -> SearchResult:
    """Greedy training-free IndexShare search on `model` (its cfg is restored on return).

    sequences: [N, S + 1] int64 calibration tokens, or a Calibration (code and retrieval tasks);
    S should exceed cfg.index_topk, else every pattern selects every key and all losses tie.
    num_full: stop at this many full layers (default `default_num_full`). loss_budget: stop
    before a flip whose loss exceeds the starting loss by more than this many nats a token (None:
    no budget). The report shows the loss of GLM-5.2's uniform rule for this depth beside the
    search's, and that of each hand-made pattern in `compare` (e.g. a plain 1-in-4, the shipped one)."""
    cfg = model.cfg
    n = cfg.num_hidden_layers
    start = pattern_of(cfg)
    num_full = default_num_full(n) if num_full is None else num_full
    if not 1 <= num_full <= n:
        raise ValueError(f"num_full must be in 1..{n} (layer 0 always stays full), got {num_full}")
    if loss_budget is not None and loss_budget < 0:
        raise ValueError(f"loss_budget must be >= 0 nats, got {loss_budget}")
    calibration = sequences if isinstance(sequences, Calibration) else Calibration(sequences)
    if calibration.seq_len <= cfg.index_topk:
        log(f"warning: calibration sequences of {calibration.seq_len} tokens are not longer than index_topk "
            f"({cfg.index_topk}): every pattern attends to every key, so the losses will tie")

    def loss_of(pattern: str) -> float:
        set_pattern(model, pattern)
        return calibration.loss(model, batch_size)

    try:
        for pattern in compare:
            if len(pattern) != n or set(pattern) - {FULL, SHARED} or pattern[0] != FULL:
                raise ValueError(f"compare: a pattern to compare with must be {n} letters of {FULL}/{SHARED} "
                                 f"starting with {FULL}, got {pattern!r}")

        def loss_if_possible(pattern: str) -> float | None:  # None: a full layer of it has no indexer here
            layers = model.model.layers
            return loss_of(pattern) if all(layers[i].self_attn.indexer is not None
                                           for i, c in enumerate(pattern) if c == FULL) else None

        result = SearchResult(start, loss_of(start), uniform_pattern(n), None, num_full, loss_budget)
        result.uniform_loss = loss_if_possible(result.uniform_pattern)
        result.compared = {pattern: loss_if_possible(pattern) for pattern in compare}
        pattern = start
        trials = sum(max(pattern.count(FULL) - 1 - k, 0) for k in range(max(pattern.count(FULL) - num_full, 0)))
        with tqdm(total=trials, desc="indexshare search", unit="trial", disable=not progress) as bar:
            while pattern.count(FULL) > num_full:
                candidates = {}
                for layer in [i for i, c in enumerate(pattern) if c == FULL and i > 0]:
                    candidates[layer] = loss_of(flip(pattern, layer))
                    bar.update()
                best = min(candidates, key=lambda i: (candidates[i], i))  # ties: the lower layer
                if loss_budget is not None and candidates[best] - result.start_loss > loss_budget:
                    result.stop_reason = (f"loss budget: the best flip (layer {best}) would reach "
                                          f"{candidates[best]:.4f}, more than {loss_budget} above the start")
                    break
                pattern = flip(pattern, best)
                result.rounds.append(SearchRound(best, pattern, candidates[best], candidates))
                log(f"round {len(result.rounds)}: layer {best} -> shared, loss {candidates[best]:.4f}, "
                    f"{pattern.count(FULL)} full")
            else:
                result.stop_reason = (f"reached {num_full} full layers" if result.rounds else
                                      f"the starting pattern has {start.count(FULL)} full layers, not more "
                                      f"than the target {num_full}")
    finally:
        model.cfg = cfg
    return result


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def write_checkpoint(model: Transformer, pattern: str, out: str | Path, source: str | Path | None = None) -> Path:
    """Write `model` with IndexShare `pattern` as a checkpoint in `out`: config.json with
    index_topk_pattern, the weights minus the indexers of shared layers (in the model's dtype; FP8
    again if the config is FP8), and the tokenizer files of `source` if given."""
    from megactx.model.weights import save_pretrained
    from megactx.train.recipe import TOKENIZER_FILES, adapt_model

    if model.cfg.model_type != "glm_moe_dsa":
        raise ValueError(f"model_type {model.cfg.model_type!r} has no IndexShare pattern in its config (only "
                         "glm_moe_dsa does); convert the checkpoint to glm_moe_dsa first")
    out = Path(out)
    if source is not None and out.resolve() == Path(source).resolve():
        raise ValueError(f"out ({out}) must differ from the source checkpoint: it would overwrite its weights")
    cfg = model.cfg.replace(index_topk_pattern=pattern)
    quantize = "fp8" if cfg.quantization_config is not None else None
    save_pretrained(adapt_model(model, cfg), out, quantize=quantize)
    for name in TOKENIZER_FILES if source is not None else ():
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, out / name)
    return out


def write_report(result: SearchResult, out: str | Path, calibration: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """`indexshare_search.json` and `indexshare_search.md` in `out`; `calibration` (what the loss
    was measured on, e.g. source and shape) is recorded beside the result."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    calibration = calibration or {}
    (out / REPORT_JSON).write_text(json.dumps({**result.to_json(), "calibration": calibration}, indent=2) + "\n")
    about = ", ".join(f"{k}: {v}" for k, v in calibration.items())
    loss = ("mean next-token cross-entropy of the code plus that of the needle tasks' answers, nats a token"
            if calibration.get("needle_tasks") else "mean next-token cross-entropy, nats a token")
    (out / REPORT_MD).write_text("# IndexShare search\n\n" + (f"Calibration: {about}.\n\n" if about else "")
                                 + f"Loss: {loss}.\n\n" + result.table())
    return out / REPORT_JSON, out / REPORT_MD


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def add_indexshare_search_parser(subparsers: Any) -> None:
    """Register `indexshare-search` on an argparse subparsers object."""
    p = subparsers.add_parser("indexshare-search", help="training-free IndexShare search: greedily flip full "
                              "layers to shared by lowest calibration loss", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (glm_moe_dsa)")
    p.add_argument("--out", type=Path, required=True,
                   help="output directory: the checkpoint with the found pattern, and the search report")
    p.add_argument("--num-full", type=int, default=None,
                   help="stop at this many full layers (default: GLM-5.2's 1-in-4 rule, e.g. 21 of 78)")
    p.add_argument("--compare", default="", metavar="PATTERN[,PATTERN...]",
                   help="hand-made patterns whose loss the report shows beside the search's and GLM-5.2's "
                        "uniform rule's, e.g. FSSSFSSS")
    p.add_argument("--loss-budget", type=float, default=None,
                   help="stop before a flip that raises the loss more than this many nats above the start")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="prepared corpus (megactx.train.data): calibrate on its held-out split "
                        "(default: random induction sequences, for smoke tests only)")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                   help=f"calibration sequence length; must exceed index_topk (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--num-sequences", type=int, default=DEFAULT_NUM_SEQUENCES,
                   help=f"calibration sequences (default {DEFAULT_NUM_SEQUENCES})")
    p.add_argument("--needles", type=int, default=None,
                   help="needle retrieval tasks (megactx.train.needles, all kinds, held-out haystacks) added to "
                        "the calibration, their answer loss added to the code's (default: as many as "
                        "--num-sequences with --data-dir, none with random tokens)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences a forward (default 1)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="model dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--backend", choices=("torch", "triton"), default="torch",
                   help="forward used to measure the loss (default: torch, the reference)")
    p.add_argument("--seed", type=int, default=0, help="order of the calibration documents / random tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_indexshare_search)


def _calibration(args: argparse.Namespace, vocab_size: int) -> Calibration:
    if args.data_dir is None:
        if args.needles:
            raise ValueError("--needles needs --data-dir (the tasks' haystacks are held-out code)")
        return Calibration(random_calibration(vocab_size, args.num_sequences, args.seq_len, args.seed))
    from megactx.train.data import prepare_data

    if not args.data_dir.is_dir():
        raise ValueError(f"--data-dir {args.data_dir} does not exist; prepare one with `python -m "
                         "megactx.train.data` (or `megactx train`), or leave --data-dir out for random tokens")
    # the data directory's tokenizer must be the model's: prepare_data refuses another vocabulary size
    data = prepare_data(args.data_dir, vocab_size=vocab_size)
    sequences = data.pretraining_sequences(args.seq_len, split="held_out", seed=args.seed)
    if sequences.shape[0] == 0:
        raise ValueError(f"the held-out split of {args.data_dir} has fewer than {args.seq_len + 1} tokens; "
                         "lower --seq-len")
    num_needles = args.num_sequences if args.needles is None else args.needles
    if not num_needles:
        return Calibration(sequences[: args.num_sequences])
    from megactx.train.needles import NeedleDataset

    tasks = NeedleDataset(data.needles("held_out"), args.seq_len, num_examples=num_needles, seed=args.seed)
    rows = [tasks[i] for i in range(num_needles)]
    return Calibration(sequences[: args.num_sequences], torch.stack([r["input_ids"] for r in rows]),
                       torch.stack([r["loss_mask"] for r in rows]))


def run_indexshare_search(args: argparse.Namespace) -> int:
    from megactx.model.weights import load_model

    prog = "megactx indexshare-search"
    if args.needles is not None and args.needles < 0:
        print(f"{prog}: error: --needles must be >= 0, got {args.needles}", file=sys.stderr)
        return 2
    for name in ("seq_len", "num_sequences", "batch_size"):
        if getattr(args, name) < 1:
            print(f"{prog}: error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    try:
        cfg = ModelConfig.from_pretrained(args.model)
        if cfg.model_type != "glm_moe_dsa":
            raise ValueError(f"{args.model} is a {cfg.model_type} checkpoint; IndexShare patterns live in "
                             "glm_moe_dsa configs only")
        model = load_model(args.model, device=device, dtype=dtype, backend=args.backend)
        calibration = _calibration(args, cfg.vocab_size)
        num_needles = 0 if calibration.needles is None else calibration.needles.shape[0]
        print(f"calibration: {calibration.code.shape[0]} sequences of {calibration.seq_len} tokens "
              f"({'held-out corpus' if args.data_dir else 'random tokens'}), {num_needles} needle tasks",
              file=sys.stderr)
        result = indexshare_search(model, calibration, args.num_full, args.loss_budget, args.batch_size,
                                   progress=not args.no_progress, log=lambda s: tqdm.write(s, file=sys.stderr),
                                   compare=[p for p in args.compare.split(",") if p])
        write_checkpoint(model, result.pattern, args.out, args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    write_report(result, args.out, {"source": f"{args.data_dir} (held-out split)" if args.data_dir else "random tokens",
                                    "num_sequences": calibration.code.shape[0], "needle_tasks": num_needles,
                                    "seq_len": calibration.seq_len,
                                    "backend": args.backend, "dtype": str(dtype).removeprefix("torch.")})
    print(result.table())
    print(f"pattern {result.pattern} ({result.pattern.count(FULL)} full layers) written to {args.out / 'config.json'}")
    return 0
