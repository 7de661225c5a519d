"""`megactx train`: run the DSA / IndexShare recipe's stages (see megactx.train.recipe).

    megactx train --smoke --out runs/smoke                 # every stage on a micro model, CPU, seconds
    megactx train --recipe tiny --out runs/tiny            # megactx-tiny on the stdlib corpus (GPU)
    megactx train --recipe tiny --out runs/tiny --stages sparse,extend --time-limit 25
    megactx train --recipe tiny --out runs/tiny --stages mtp_warmup,mtp --mtp-loss tv
    megactx train --recipe tiny --out runs/tiny --stages warmup,sparse --attention dsa   # an ablation
    megactx train --recipe tiny --out runs/more --stages extend --init models/megactx-tiny  # more steps
    megactx train --recipe tiny --out runs/y64 --stages extend,indexers --init models/megactx-tiny \
        --yarn-factor 64                                   # its 64K rows trained at 256K positions
    megactx train --recipe tiny --out runs/dsa16 --stages warmup --attention dsa --init models/megactx-tiny \
        --hf-overrides "{\"rope_parameters\": $(jq -c .rope_parameters models/megactx-tiny/config.json)}"
                 # an indexer in every layer of a trained IndexShare model (new ones for its shared layers,
                 # the backbone frozen), e.g. for `megactx indexshare-search` from every layer
    torchrun --nproc-per-node 2 -m megactx train --recipe tiny --out runs/tiny   # data parallel

Every stage resumes its own checkpoint and starts from the previous stage's, so a run cut by
--time-limit or --max-steps continues where it stopped when the same command is run again.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

AUTO = "auto"
AUTO_CONTEXTS = tuple(1 << p for p in range(16, 21))  # --context auto tries 64K, 128K, ... 1M tokens


def add_train_parser(subparsers: Any) -> None:
    """Register `train` on an argparse subparsers object."""
    from megactx.cli import add_hf_overrides_argument
    from megactx.train.recipe import RECIPES, STAGE_KINDS

    p = subparsers.add_parser("train", help="train a model with the DSA / IndexShare recipe (resumable stages)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=sorted(RECIPES), default="tiny", help="the recipe (default: tiny)")
    p.add_argument("--smoke", action="store_true", help="shorthand for --recipe smoke: every stage, micro model, CPU")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<recipe>)")
    p.add_argument("--stages", default=None,
                   help=f"comma-separated stages to run, in recipe order (default: all of {', '.join(STAGE_KINDS)})")
    p.add_argument("--data", choices=("synthetic", "code"), default=None, help="override the recipe's data")
    p.add_argument("--data-dir", type=Path, default=None, help="prepared corpus + tokenizer (default: <out>/data)")
    p.add_argument("--steps-scale", type=float, default=1.0, help="multiply every stage's steps (default: 1)")
    p.add_argument("--stage-steps", default=None,
                   help="steps of some stages, e.g. extend=120,mtp=250 (after --steps-scale; the LR schedule "
                        "follows); give the same ones when resuming a run")
    p.add_argument("--max-steps", type=int, default=None, help="at most this many steps a stage in this run")
    p.add_argument("--time-limit", type=float, default=None, help="stop (with a checkpoint) after this many minutes")
    p.add_argument("--context", default=None,
                   help=f"sequence length of the extend and indexers stages, or '{AUTO}': the longest that fits "
                        "this GPU (and --context-budget)")
    p.add_argument("--yarn-factor", type=float, default=None, metavar="F",
                   help="YaRN factor of the extend stage and those after it (default: its rows over the sparse "
                        "stage's, times the recipe's headroom: 32 for tiny at 64K, positions for 128K); one above "
                        "the rows' stretch trains the rotary positions the model will be served with past its "
                        "trained rows")
    p.add_argument("--context-budget", type=float, default=None,
                   help="with --context auto: minutes the extend stage may take")
    p.add_argument("--attention", choices=("indexshare", "dsa", "dense"), default=None,
                   help="architecture from the warmup stage on: the recipe's IndexShare pattern (default), an "
                        "indexer in every layer (dsa), or dense attention; the last two are ablations whose "
                        "stage directories carry the name (warmup-dsa, sparse-dsa, sparse-dense; the dense "
                        "ablation has no warmup); with --init, the warmup stage gives the layers that turn full "
                        "new indexers")
    p.add_argument("--mtp-loss", choices=("ce", "tv", "ce+tv"), default=None, help="MTP objective (default: ce)")
    p.add_argument("--mtp-share", action=argparse.BooleanOptionalAction, default=None,
                   help="IndexShare + KVShare across MTP steps (default: on)")
    p.add_argument("--select-fp8", action="store_true",
                   help="sparse stages select each query's keys from FP8-simulated indexer scores, as the serving "
                        "engine's FP8 indexer cache does (the indexer KL still trains the exact scores)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each layer's MLP / MoE block and attention projections before a stage "
                        "trains (the same math, fewer and fused kernels); the first step also compiles. On an H200, "
                        "a 16-layer megactx-tiny's dense stage: 323K against 298K tokens/s, 18 s of compilation")
    p.add_argument("--chunk-mb", type=int, default=None, metavar="MIB",
                   help="transient memory of one chunk of query rows in the training attention, the indexer "
                        "selection and KL, and the LM head (default 256): larger chunks make fewer, larger "
                        "kernels. A sparse step of a 16-layer megactx-tiny (8 x 4096 tokens) runs 20.5K top-level "
                        "ops at 256 and 13.6K at 2048 (counted on a CPU)")
    p.add_argument("--kl-candidates", type=int, default=None, metavar="N",
                   help="the sparse, extend and indexers stages train each full layer's indexer by a KL over each "
                        "query's top-N keys by indexer score, where N is more than the top-k the layers attend to "
                        "(their attention scored over those N for the target only), so a key ranked just outside "
                        "the selection still gets a gradient (warmup's dense KL spans every key) (default: the "
                        "recipe's; tiny: 512 in indexers, else 0)")
    p.add_argument("--indexer-needle-weight", type=float, default=None, metavar="W",
                   help="the warmup, sparse, extend and indexers stages add the indexer KL's mean over the needle "
                        "rows' answer positions, weighted W, to its mean over every position: the few queries that "
                        "retrieve in a long row (default: the recipe's; tiny: 1 in indexers, else 0)")
    p.add_argument("--copy-forms", default=None,
                   help="comma-separated forms the copy rows cycle through, of half (the row's first half "
                        "repeated) and window (a window repeated from a start drawn per row) (default: "
                        "half,window)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the initialisation, the data order, the needles and the copy windows "
                        "(default: 0); give the same one when resuming a run")
    p.add_argument("--topk", type=int, default=None,
                   help="keys each query's sparse attention selects (the model's index_topk; default: the "
                        "recipe's); give the same one when resuming a run")
    p.add_argument("--pattern", default=None,
                   help="IndexShare pattern from the warmup stage on, one letter a layer: F runs its indexer, S "
                        "reuses the top-k of the nearest F below (the model's index_topk_pattern; default: the "
                        "recipe's, e.g. FSSSFSSSFSSSSSSF for tiny); give the same one when resuming a run")
    add_hf_overrides_argument(p, help="change fields of the recipe's model config, nested objects merged key by "
                                      "key, e.g. the 8-layer megactx-tiny of before: '{\"num_hidden_layers\": 8, "
                                      "\"n_routed_experts\": 8}' with --pattern FSSSSSSF; give the same ones when "
                                      "resuming a run")
    p.add_argument("--init", type=Path, default=None, metavar="MODEL_DIR",
                   help="start the first of --stages from this model directory's weights instead of the previous "
                        "stage's checkpoint, e.g. more extend steps on a shipped model: --stages extend --init "
                        "models/megactx-tiny (noted in the stage directory's init.json). A new data directory "
                        "takes the model's tokenizer; one prepared with another is refused")
    p.add_argument("--parallel", choices=("auto", "fsdp", "ddp"), default=None, help="data-parallel wrapper")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--export", type=Path, default=None,
                   help="after the run, write the last finished stage's model (bf16, with tokenizer) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)


def stage_steps(spec: str) -> dict[str, int]:
    """'extend=120,mtp=250' -> {'extend': 120, 'mtp': 250}, or a ValueError that names the bad part."""
    from megactx.train.recipe import STAGE_KINDS

    steps: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, value = part.partition("=")
        if kind.strip() not in STAGE_KINDS or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--stage-steps takes STAGE=STEPS pairs with STAGE one of {', '.join(STAGE_KINDS)} "
                             f"and STEPS >= 1, got {part!r}")
        steps[kind.strip()] = int(value)
    return steps


def build_recipe(args: argparse.Namespace):
    from megactx.train.recipe import INDEXER_KL_KINDS, RECIPES

    recipe = RECIPES["smoke" if args.smoke else args.recipe]()
    changes: dict[str, Any] = {}
    if args.data:
        changes["data"] = args.data
    if args.attention:
        changes["attention"] = args.attention
    if args.mtp_loss:
        changes["mtp_loss"] = args.mtp_loss
    if args.mtp_share is not None:
        changes["mtp_share"] = args.mtp_share
    if args.copy_forms:
        changes["copy_forms"] = tuple(f.strip() for f in args.copy_forms.split(",") if f.strip())
    if args.select_fp8:
        changes["select_fp8"] = True
    if args.compile:
        changes["compile"] = True
    if args.chunk_mb is not None:
        if args.chunk_mb < 1:
            raise ValueError(f"--chunk-mb must be at least 1 MiB, got {args.chunk_mb}")
        changes["chunk_bytes"] = args.chunk_mb << 20
    if args.seed is not None:
        changes["seed"] = args.seed
    model: dict[str, Any] = {}
    if args.hf_overrides:
        from megactx.config import ModelConfig, apply_overrides

        before = recipe.model.to_dict()
        after = apply_overrides(before, args.hf_overrides)
        model.update({f.name: after[f.name] for f in dataclasses.fields(ModelConfig)
                      if after.get(f.name) != before.get(f.name)})  # fields only: rope_theta lives in its rope
    if args.topk is not None:
        if args.topk < 1:
            raise ValueError(f"--topk must be a positive number of keys, got {args.topk}")
        model["index_topk"] = args.topk
    if args.pattern is not None:
        model["index_topk_pattern"] = args.pattern
    if model:
        from megactx.config import ConfigError

        try:
            changes["model"] = recipe.model.replace(**model)
        except ConfigError as e:
            raise ValueError(f"--pattern / --topk / --hf-overrides: {e}") from None
    recipe = dataclasses.replace(recipe, **changes)
    if args.steps_scale != 1.0:
        recipe = recipe.scaled(args.steps_scale)
    if args.stage_steps:
        steps = stage_steps(args.stage_steps)
        recipe = dataclasses.replace(recipe, stages=[
            dataclasses.replace(s, train=dataclasses.replace(s.train, steps=steps[s.kind])) if s.kind in steps else s
            for s in recipe.stages])
    indexer_kl = {}
    if args.kl_candidates is not None:
        if args.kl_candidates < 0:
            raise ValueError(f"--kl-candidates must be >= 0 keys, got {args.kl_candidates}")
        indexer_kl["kl_candidates"] = args.kl_candidates
    if args.indexer_needle_weight is not None:
        if args.indexer_needle_weight < 0:
            raise ValueError(f"--indexer-needle-weight must be >= 0, got {args.indexer_needle_weight}")
        indexer_kl["indexer_needle_weight"] = args.indexer_needle_weight
    if indexer_kl:
        recipe = dataclasses.replace(recipe, stages=[
            dataclasses.replace(s, **indexer_kl) if s.kind in INDEXER_KL_KINDS else s for s in recipe.stages])
    if args.parallel:
        for stage in recipe.stages:
            stage.train = dataclasses.replace(stage.train, parallel=args.parallel)
    if args.context and args.context != AUTO:
        try:
            length = int(args.context)
        except ValueError:
            raise ValueError(f"--context must be a number of tokens or '{AUTO}', got {args.context!r}") from None
        recipe = set_long_context(recipe, length)
    if args.yarn_factor is not None:  # checked against the rows the stages have by now (--context)
        try:
            recipe = dataclasses.replace(recipe, yarn_factor=args.yarn_factor)
        except ValueError as e:
            raise ValueError(f"--yarn-factor: {e}") from None
    return recipe


def set_long_context(recipe, length: int):
    """The recipe with the rows of the stages at the longest context (extend, indexers) `length`
    tokens long (checked as a new recipe is: a yarn_factor against the new stretch)."""
    from megactx.train.recipe import LONG_KINDS

    return dataclasses.replace(recipe, stages=[
        dataclasses.replace(s, train=dataclasses.replace(s.train, seq_len=length)) if s.kind in LONG_KINDS else s
        for s in recipe.stages])


def run_train(args: argparse.Namespace) -> int:
    from megactx.train.recipe import export_model, find_max_context, run_recipe, stage_progress
    from megactx.train.trainer import CHECKPOINT, init_distributed

    try:
        recipe = build_recipe(args)
    except ValueError as e:
        print(f"megactx train: error: {e}", file=sys.stderr)
        return 2
    out = args.out or Path("runs") / recipe.name
    ctx = init_distributed(args.device)
    stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
    log = print if ctx.is_main else (lambda *a, **k: None)
    try:
        if args.context == AUTO:
            index = recipe.stage_index("extend")
            budget = None if args.context_budget is None else args.context_budget * 60
            length = find_max_context(recipe, index, out, list(AUTO_CONTEXTS), ctx, budget, log)
            recipe = set_long_context(recipe, length)
            log(f"extend and indexers stages: context {length}")
        run_recipe(recipe, out, stages, args.data_dir, ctx, args.max_steps,
                   None if args.time_limit is None else args.time_limit * 60, not args.no_progress, log, args.init)
    except ValueError as e:
        print(f"megactx train: error: {e}", file=sys.stderr)
        return 2
    if args.export and ctx.is_main:
        done = [i for i in range(len(recipe.stages))
                if stage_progress(out / recipe.stage_name(i)) >= recipe.stages[i].train.steps]
        if not done:
            print("megactx train: error: no finished stage to export yet", file=sys.stderr)
            return 2
        path = export_model(out / recipe.stage_name(done[-1]) / CHECKPOINT, args.export)
        log(f"exported {recipe.stage_name(done[-1])} to {path}")
    return 0
