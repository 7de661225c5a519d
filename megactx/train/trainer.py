"""The training loop: one `Trainer` runs one stage's `Objective` to its step count.

What it does for every stage: AdamW over the parameters that require grad (no decay on norms and
biases), a linear warm-up + cosine LR schedule, bf16 autocast on CUDA, gradient accumulation up
to the global batch, gradient clipping, the aux-loss-free expert-bias update of the MoE routers
(DeepSeek-V3), data parallelism over `torch.distributed` (FSDP2 `fully_shard` per decoder layer,
DDP where FSDP2 is missing or asked for), a tqdm bar with the loss and tokens/s, metrics as JSON
lines and a loss-curve PNG, and checkpoints that resume exactly.

Checkpoint: `<out_dir>/checkpoint/` is a Hugging Face directory (`save_pretrained`, fp32, plus any
extra files such as the tokenizer) that `load_model`, the engine and transformers read, with
`trainer_state.pt` beside the weights: step, data position, optimizer, LR schedule, RNG states
and the metric history. A new `Trainer` on the same out_dir resumes from it: same weights, same
next batch, same optimizer moments, so the loss trajectory continues as if never interrupted.

Data: any `TokenSource`, a deterministic indexed stream of token sequences. Step s reads
sequences [s·G, (s+1)·G) for a global batch of G; rank r's micro-batch m of them is fixed by
(s, m, r), so the data position is just the step, and W ranks see exactly the batch one process
would. With `TrainConfig.data_workers`, a DataLoader worker process builds the next micro-batches
(in pinned memory on CUDA) while the GPU runs the current one: the same batches, ahead of time.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from megactx.model.moe import Router
from megactx.model.transformer import Transformer
from megactx.model.weights import save_pretrained

STATE_FILE = "trainer_state.pt"
CHECKPOINT = "checkpoint"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "train_config.json"  # the TrainConfig, beside metrics.jsonl
PLOT_FILE = "loss.png"
SEED_STRIDE = 1_000_003  # RandomTokens: a prime far above any example count, so seeds never share examples


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
class TokenSource(Protocol):
    def examples(self, start: int, count: int, seq_len: int) -> dict[str, torch.Tensor]:
        """Examples start .. start + count − 1 of the stream, the same for the same arguments (that
        is what makes resume and data parallelism exact): {"input_ids": int64 [count, seq_len]} and
        optionally "loss_mask": bool [count, seq_len − 1], True where target input_ids[:, j + 1]
        counts in the LM loss (absent: every target counts). CPU tensors."""
        ...


@dataclass
class RandomTokens:
    """A synthetic stream for tests and smoke runs: random tokens in 0..vocab_size−1, each
    sequence's second half a copy of its first (an induction task: attention, and so the indexers,
    have something to find). Example n depends only on (seed, n)."""

    vocab_size: int
    seed: int = 0
    copy: bool = True

    def examples(self, start: int, count: int, seq_len: int) -> dict[str, torch.Tensor]:
        out = torch.empty(count, seq_len, dtype=torch.long)
        for i in range(count):
            gen = torch.Generator().manual_seed(self.seed * SEED_STRIDE + start + i)
            half = (seq_len + 1) // 2 if self.copy else seq_len
            first = torch.randint(0, self.vocab_size, (half,), generator=gen)
            out[i] = torch.cat([first, first])[:seq_len] if self.copy else first
        return {"input_ids": out}


# ---------------------------------------------------------------------------------------------
# Configuration, schedule, distributed context
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """One stage's optimisation settings.

    steps: optimizer steps. seq_len: tokens a sequence. global_batch: sequences an optimizer step
    over all ranks; micro_batch: sequences a forward on one rank (global_batch must be a multiple
    of micro_batch × world size; the quotient is the gradient accumulation). lr: peak LR after
    warmup_steps of linear warm-up, then cosine down to lr × min_lr_ratio at `steps`.
    precision: "bf16" (autocast), "fp32", or "auto" (bf16 on CUDA, fp32 on the CPU).
    save_every: optimizer steps between checkpoints (0: at the end only). parallel: "auto" (FSDP2,
    else DDP), "fsdp" or "ddp". expert_bias_speed: step of the routers' bias update (0: off).
    data_workers: processes that build micro-batches ahead of the step (None: 1 on CUDA, where the
    host's batch building would otherwise leave the GPU idle, 0 on the CPU)."""

    steps: int
    seq_len: int
    global_batch: int
    micro_batch: int
    lr: float = 1e-3
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    precision: str = "auto"
    save_every: int = 0
    parallel: str = "auto"
    expert_bias_speed: float = 1e-3
    data_workers: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "global_batch", "micro_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        if self.data_workers is not None and (not isinstance(self.data_workers, int) or self.data_workers < 0):
            raise ValueError(f"data_workers must be None or an integer >= 0, got {self.data_workers!r}")
        if self.parallel not in ("auto", "fsdp", "ddp"):
            raise ValueError(f"parallel must be 'auto', 'fsdp' or 'ddp', got {self.parallel!r}")
        self.betas = tuple(self.betas)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warm-up to 1 over
    warmup_steps, then cosine from 1 to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None = None) -> DistContext:
    """Join the process group that torchrun describes (WORLD_SIZE > 1 in the environment: NCCL on
    CUDA, gloo on the CPU) or run alone. device: None picks CUDA when there is one."""
    use_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world, local = 0, 1, 0
    if use_cuda:
        torch.cuda.set_device(local)
        return DistContext(rank, world, torch.device("cuda", local))
    return DistContext(rank, world, torch.device(device or "cpu"))


def agree(flag: bool) -> bool:
    """Rank 0's value of `flag` on every rank: a decision to stop (a wall-clock limit) must be the
    same everywhere, or the ranks' collectives stop matching."""
    if not dist.is_initialized():
        return flag
    value = [flag]
    dist.broadcast_object_list(value, src=0)
    return bool(value[0])


def wrap_parallel(objective: nn.Module, ctx: DistContext, strategy: str) -> nn.Module:
    """FSDP2 (each decoder layer and MTP layer a unit, the objective the root) or DDP; the
    objective itself when alone. strategy: "auto" | "fsdp" | "ddp".

    The units keep their parameters gathered from their forward to their backward
    (reshard_after_forward=False): the training forward calls parts of a layer outside the layer's
    own forward (the indexer's KL at the end of its group, the MTP head's norm), and in the stages
    that freeze the backbone no gradient reaches a layer's output to trigger FSDP's re-gather.
    Gradients and optimizer state stay sharded; the full parameters are held once per rank."""
    if ctx.world == 1:
        return objective
    if strategy in ("auto", "fsdp"):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            if strategy == "fsdp":
                raise
        else:
            model = objective.model
            for layer in [*model.model.layers, *model.mtp]:
                fully_shard(layer, reshard_after_forward=False)
            fully_shard(objective, reshard_after_forward=False)
            return objective
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(objective, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def compile_blocks(model: nn.Module) -> None:
    """torch.compile, in place, the parts of every decoder and MTP layer whose work is a fixed chain
    of small ops: the MLP / MoE block (the router, the experts and the shared expert) and the
    attention's q and kv projections with their rope. A training step of megactx-tiny issues
    thousands of small kernels (7,340 top-level aten ops for one forward and backward of a
    16-layer model), and fusing them is what compiling buys. The attention itself stays eager
    (TrainingAttention's chunks, top-k and gathers), as does the MoE's routed form off CUDA, whose
    expert loop reads which experts got tokens (a graph break). Layers share their compiled graphs.

    The same math in another order: values agree to rounding, except that the router's ties
    (equal expert scores, e.g. an untrained router) may break the other way."""
    for layer in [*model.model.layers, *model.mtp]:
        layer.mlp.compile()
        attn = layer.self_attn
        attn.project_q = torch.compile(attn.project_q)
        attn.project_kv = torch.compile(attn.project_kv)


# ---------------------------------------------------------------------------------------------
# MoE expert-bias balancing
# ---------------------------------------------------------------------------------------------
class ExpertBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): after each optimizer step, every trainable
    router's e_score_correction_bias[e] += speed · sign(mean load − load[e]), loads counted over
    the step's tokens on every rank. It steers which experts are chosen without entering the loss."""

    def __init__(self, module: nn.Module, speed: float):
        self.speed = speed
        self.routers = [r for r in module.modules() if isinstance(r, Router) and r.weight.requires_grad]
        self.loads = {id(r): torch.zeros(r.n_experts, device=r.weight.device) for r in self.routers}
        self.hooks = [r.register_forward_hook(self._count) for r in self.routers] if speed > 0 else []

    @torch.compiler.disable  # eager under --compile: traced, its per-router lookup recompiled every layer
    def _count(self, router: Router, args, output) -> None:
        _, ids = output  # [N, top_k]
        load = self.loads[id(router)].to(ids.device)
        flat = ids.flatten()  # scatter_add, not bincount: bincount on CUDA syncs with the host (for its max)
        self.loads[id(router)] = load.scatter_add(0, flat, torch.ones_like(flat, dtype=load.dtype))

    @torch.no_grad()
    def update(self) -> None:
        if not self.hooks:
            return
        for router in self.routers:
            load = self.loads[id(router)]
            if dist.is_initialized():
                dist.all_reduce(load)
            bias = router.e_score_correction_bias
            delta = (self.speed * torch.sign(load.mean() - load)).to(bias.dtype)
            if hasattr(bias, "device_mesh"):  # an FSDP2 shard: lay the (replicated) delta out alike
                from torch.distributed.tensor import distribute_tensor

                delta = distribute_tensor(delta, bias.device_mesh, bias.placements)
            bias.add_(delta)
            self.loads[id(router)] = torch.zeros_like(load)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


class _MicroBatches(torch.utils.data.IterableDataset):
    """Rank `rank`'s micro-batches of optimizer steps first .. end - 1, in training order (see the
    module docstring: micro-batch m of step s is fixed by (s, m, rank))."""

    def __init__(self, source: TokenSource, cfg: TrainConfig, world: int, rank: int, first: int, end: int):
        self.source, self.cfg, self.world, self.rank, self.first, self.end = source, cfg, world, rank, first, end

    def get(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        start = step * cfg.global_batch + (micro * self.world + self.rank) * cfg.micro_batch
        return self.source.examples(start, cfg.micro_batch, cfg.seq_len)

    def __iter__(self):
        accum = self.cfg.global_batch // (self.cfg.micro_batch * self.world)
        for step in range(self.first, self.end):
            for micro in range(accum):
                yield self.get(step, micro)


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
@dataclass
class FitResult:
    step: int  # optimizer steps done in total
    finished: bool  # step == cfg.steps
    checkpoint: Path
    history: list[dict]


class Trainer:
    """Train `objective` (losses.Objective: forward(input_ids, loss_mask=None) -> (loss, metrics))
    on `source`.

    out_dir holds the checkpoint, metrics.jsonl and loss.png; an existing checkpoint there is
    resumed (its config must match the objective's model). extra_files (e.g. tokenizer.json) are
    copied into every checkpoint. ctx: the distributed context (init_distributed()); progress:
    show a tqdm bar on rank 0."""

    def __init__(self, objective: nn.Module, source: TokenSource, cfg: TrainConfig, out_dir: str | Path,
                 extra_files: Sequence[str | Path] = (), ctx: DistContext | None = None, progress: bool = True,
                 label: str = "train"):
        self.ctx = ctx or init_distributed()
        per_step = cfg.micro_batch * self.ctx.world
        if cfg.global_batch % per_step:
            raise ValueError(f"global_batch ({cfg.global_batch}) must be a multiple of micro_batch × world size "
                             f"({cfg.micro_batch} × {self.ctx.world})")
        self.cfg, self.source, self.label = cfg, source, label
        self.accum = cfg.global_batch // per_step
        self.out_dir = Path(out_dir)
        self.extra_files = [Path(f) for f in extra_files]
        self.progress = progress
        self.objective = objective.to(self.ctx.device)
        self.module = wrap_parallel(self.objective, self.ctx, cfg.parallel)
        precision = cfg.precision if cfg.precision != "auto" else ("bf16" if self.ctx.device.type == "cuda" else "fp32")
        self.autocast = partial(torch.autocast, self.ctx.device.type, dtype=torch.bfloat16,
                                enabled=precision == "bf16")

        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("no parameter requires grad: nothing to train (see recipe.set_trainable)")
        self.params = [p for _, p in named]
        groups = [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                                    min_ratio=cfg.min_lr_ratio))
        self.balancer = ExpertBalancer(self.module, cfg.expert_bias_speed)
        self.step = 0
        self.history: list[dict] = []
        self._resume()

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, max_steps: int | None = None, time_limit_s: float | None = None) -> FitResult:
        """Train until cfg.steps, or max_steps more steps, or time_limit_s of wall time (checked
        after each step), whichever comes first; checkpoint at save_every and at the end."""
        from tqdm import tqdm

        end = self.cfg.steps if max_steps is None else min(self.cfg.steps, self.step + max_steps)
        start_time, saved_at = time.perf_counter(), self.step
        if self.ctx.is_main:  # what the stage trains with, readable without loading the checkpoint
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / CONFIG_FILE).write_text(json.dumps(asdict(self.cfg), indent=1) + "\n")
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=self.label, unit="step", dynamic_ncols=True,
                   disable=not (self.progress and self.ctx.is_main))
        batches = self._batches(end)
        while self.step < end:
            row = self.train_step(batches)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            if self.cfg.save_every and self.step % self.cfg.save_every == 0 and self.step < end:
                self.save()
                saved_at = self.step
            if time_limit_s is not None and agree(time.perf_counter() - start_time > time_limit_s):
                break
        bar.close()
        del batches  # stops the data workers
        if self.step != saved_at or not (self.out_dir / CHECKPOINT / STATE_FILE).exists():
            self.save()
        return FitResult(self.step, self.step >= self.cfg.steps, self.out_dir / CHECKPOINT, self.history)

    def _batches(self, end: int):
        """The micro-batches of steps self.step .. end - 1 in order: built here one at a time, or
        ahead by cfg.data_workers DataLoader processes."""
        batches = _MicroBatches(self.source, self.cfg, self.ctx.world, self.ctx.rank, self.step, end)
        cuda = self.ctx.device.type == "cuda"
        workers = (1 if cuda else 0) if self.cfg.data_workers is None else self.cfg.data_workers
        if not workers:
            return iter(batches)
        return iter(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=workers, pin_memory=cuda,
                                                prefetch_factor=2 * self.accum))

    def train_step(self, batches=None) -> dict:
        """One optimizer step over the global batch, from `batches` (an iterator of this step's
        micro-batches and those after, see _batches; None: built here); returns its metrics row
        (also appended to history): rank-averaged metrics, lr, grad_norm, tokens_per_s."""
        t0 = time.perf_counter()
        self.module.train()
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, torch.Tensor] = {}  # micro-batches that had each metric (NaN: a term without rows)
        if batches is None:  # this step's micro-batches, built here
            batches = iter(_MicroBatches(self.source, self.cfg, self.ctx.world, self.ctx.rank, self.step,
                                         self.step + 1))
        for micro in range(self.accum):
            batch = {k: v.to(self.ctx.device, non_blocking=True) for k, v in next(batches).items()}
            with self._grad_sync(micro == self.accum - 1), self.autocast():
                loss, metrics = self.module(**batch)
            (loss / self.accum).backward()
            for k, v in metrics.items():
                v = v.detach().float().to(self.ctx.device)
                sums[k] = sums.get(k, 0.0) + torch.nan_to_num(v, nan=0.0)
                counts[k] = counts.get(k, 0.0) + (~v.isnan()).float()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.update()
        self.step += 1

        names = sorted(sums)
        values = torch.stack([sums[k] for k in names] + [counts[k] for k in names]
                             + [grad_norm.float().to(self.ctx.device)])
        if dist.is_initialized():
            dist.all_reduce(values)
            values[-1] /= self.ctx.world  # every rank holds the same clipped norm
        n = len(names)
        means = (values[:n] / values[n : 2 * n]).tolist()  # over the micro-batches (of all ranks) that had it
        row = {"step": self.step, **{k: m for k, m in zip(names, means) if not math.isnan(m)},
               "grad_norm": values[-1].item(), "lr": lr}
        row["tokens_per_s"] = self.cfg.global_batch * self.cfg.seq_len / (time.perf_counter() - t0)
        self.history.append(row)
        if self.ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    def _grad_sync(self, sync: bool):
        """Skip the gradient all-reduce / reduce-scatter on all but the last micro-step."""
        if hasattr(self.module, "set_requires_gradient_sync"):  # FSDP2
            self.module.set_requires_gradient_sync(sync)
            return nullcontext()
        if hasattr(self.module, "no_sync") and not sync:  # DDP
            return self.module.no_sync()
        return nullcontext()

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write out_dir/checkpoint atomically (a new directory renamed over the old one)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.module, options=full)
        optim_sd = get_optimizer_state_dict(self.module, self.optimizer, options=full)
        final = self.out_dir / CHECKPOINT
        if self.ctx.is_main:
            tmp, old = final.with_name(CHECKPOINT + ".tmp"), final.with_name(CHECKPOINT + ".old")
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained(self._cpu_model(model_sd), tmp)
            for f in self.extra_files:
                shutil.copy2(f, tmp / f.name)
            torch.save({"step": self.step, "sequences_seen": self.step * self.cfg.global_batch,
                        "config": asdict(self.cfg), "optimizer": optim_sd, "scheduler": self.scheduler.state_dict(),
                        "rng": _rng_state(), "history": self.history}, tmp / STATE_FILE)
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
            self.plot()
        if dist.is_initialized():
            dist.barrier()
        return final

    def _cpu_model(self, state: dict[str, torch.Tensor]) -> Transformer:
        """A CPU Transformer holding the (full, unsharded) weights of the objective's model."""
        cfg = self.objective.model.cfg
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device="cpu")
        prefix = "model."
        model.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        return model

    def _resume(self) -> None:
        path = self.out_dir / CHECKPOINT
        if not (path / STATE_FILE).exists() and (old := path.with_name(CHECKPOINT + ".old")).exists():
            path = old  # a save was interrupted between its two renames
        if not (path / STATE_FILE).exists():
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from megactx.config import ModelConfig
        from megactx.model.weights import load_model

        saved_cfg = ModelConfig.from_pretrained(path)
        if saved_cfg.to_dict() != self.objective.model.cfg.to_dict():
            raise ValueError(f"{path} holds a model of another config than this stage's; resume with the same "
                             "recipe and stage, or point out_dir elsewhere")
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        weights = {"model." + k: v for k, v in load_model(path, dtype=torch.float32).state_dict().items()}
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.module, weights, options=full)
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=full)
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        self.step, self.history = state["step"], state["history"]
        if self.ctx.is_main:  # metrics logged after that checkpoint are about to be redone
            with open(self.out_dir / METRICS_FILE, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in self.history)

    # -- curves ---------------------------------------------------------------------------------------
    def plot(self) -> Path | None:
        """loss.png: one panel a loss metric over optimizer steps."""
        return plot_history(self.history, self.out_dir / PLOT_FILE, title=self.label)

    def close(self) -> None:
        self.balancer.close()


def plot_history(history: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Plot every loss-like metric of `history` (rows of {step, name: value}) into one PNG."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skip = {"step", "lr", "tokens_per_s", "grad_norm"}
    names = list(dict.fromkeys(k for row in history for k in row if k not in skip))  # a term may skip rows
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    steps = [row["step"] for row in history]
    for ax, name in zip(axes[0], names):
        ax.plot(steps, [row.get(name, float("nan")) for row in history], lw=1.2)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
