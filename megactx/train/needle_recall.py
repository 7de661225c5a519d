"""`megactx eval needle-recall`: when a needle is missed, did the indexer drop it or the attention?

    megactx eval needle-recall --model models/megactx-tiny --contexts 16k,64k --cases 100 --out runs/recall

Each case (the needle cases of `megactx eval needles`, same seed, same cases) runs teacher-forced:
its prompt and expected answer in one paged forward, the engine's path (Triton kernels and an FP8
indexer cache on CUDA, their PyTorch twins on a CPU). Greedy decoding answers a case exactly right
if and only if every answer position's argmax is the expected token, so the teacher-forced verdict
is the needle evaluation's. At each answer position it also notes whether each full layer's top-k
(the keys that layer and the layers sharing its indexer attend to) holds a source of the token that
position must produce: a token of the asked needle's line equal to it. Positions whose token does
not occur in the line (the answer's first space, the end token) are not counted.

The report gives, per context and full layer, how often the selection held every source the answer
needed, among the right answers and among the wrong ones. A wrong answer whose retrieving layer
selected every source is the attention's miss; one whose selection lacked a source, the indexer's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megactx.analysis.flops import context_label
from megactx.train.needles import Needle, NeedleCase, NeedleTask


@dataclass
class RecallCase:
    context: int
    depth: float
    correct: bool  # every answer position's argmax is the expected token
    selected: dict[int, list[bool]]  # full layer -> per counted answer position: a source in its top-k

    def held_all(self, layer: int) -> bool:
        return all(self.selected[layer])


def asked_needle(case: NeedleCase) -> Needle:
    return next(n for n in case.needles if n.role == "asked")


def answer_sources(case: NeedleCase) -> list[torch.Tensor]:
    """Per answer position but the last (the end token): the prompt positions, within the asked
    needle's line, holding the token that position must produce (empty where it holds none)."""
    asked = asked_needle(case)
    line = torch.arange(asked.position, asked.position + asked.length)
    prompt = torch.tensor(case.input_ids)
    return [line[prompt[line] == token] for token in case.answer_ids[:-1]]


@torch.no_grad()
def recall_case(model, ops, case: NeedleCase, context: int) -> RecallCase:
    """One teacher-forced paged forward of `case` (a single sequence, so a key's slot is its
    position), the full layers' top-k caught as their decoder layers return it."""
    full = model.cfg.full_layers
    caught: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(lambda mod, args, out, i=i: caught.__setitem__(i, out[1]))
             for i in full]
    try:
        device = model.lm_head.weight.device
        ids = torch.tensor([case.input_ids + case.answer_ids[:-1]], device=device)
        logits = model.forward_paged_prompts(ids, ops)[0, len(case.input_ids) - 1:]  # [answer, vocab]
    finally:
        for h in hooks:
            h.remove()
    answer = torch.tensor(case.answer_ids, device=device)
    correct = bool((logits.argmax(-1) == answer).all())
    first = len(case.input_ids) - 1  # the row that produces the answer's first token
    sources = answer_sources(case)
    selected = {}
    for layer in full:
        rows = caught[layer].reshape(-1, caught[layer].shape[-1])[first:].cpu()  # [answer, K] slots (= positions)
        selected[layer] = [bool(torch.isin(src, row).any()) for src, row in zip(sources, rows) if len(src)]
    return RecallCase(context, asked_needle(case).depth, correct, selected)


def evaluate_recall(model, ops, generator, task: NeedleTask, contexts: Sequence[int], num_cases: int, seed: int,
                    progress: bool = True) -> list[RecallCase]:
    from tqdm import tqdm

    from megactx.train.evaluate import needle_cases

    results = []
    for context in contexts:
        cases = needle_cases(generator, task, context, num_cases, seed)
        for case in tqdm(cases, total=num_cases, desc=f"needle recall {context_label(context)}", disable=not progress):
            results.append(recall_case(model, ops, case, context))
    return results


def recall_markdown(results: list[RecallCase], model: str, task: str, seed: int, engine: str) -> str:
    lines = [f"# Needle recall of the indexers: {model}", "",
             f"task {task}, seed {seed}; teacher-forced (exact match as greedy decoding); {engine}", "",
             "Held all: cases whose layer's top-k held a source of every answer token, among the right and "
             "the wrong answers; positions: the fraction of answer positions whose source it held.", "",
             "| context | cases | right | layer | held all, right | held all, wrong | positions, right | "
             "positions, wrong |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for context in sorted({r.context for r in results}):
        rows = [r for r in results if r.context == context]
        right, wrong = [r for r in rows if r.correct], [r for r in rows if not r.correct]
        for layer in sorted(rows[0].selected):
            def held(group, layer=layer):
                return f"{sum(r.held_all(layer) for r in group) / len(group):.0%}" if group else "–"

            def positions(group, layer=layer):
                flags = [f for r in group for f in r.selected[layer]]
                return f"{sum(flags) / len(flags):.1%}" if flags else "–"

            lines.append(f"| {context_label(context)} | {len(rows)} | {len(right) / len(rows):.1%} | {layer} | "
                         f"{held(right)} | {held(wrong)} | {positions(right)} | {positions(wrong)} |")
    return "\n".join(lines) + "\n"


def run_needle_recall(args: argparse.Namespace) -> int:
    from megactx.model import load_model
    from megactx.model.paged import kernel_ops
    from megactx.train.corpus import Corpus
    from megactx.train.data import needle_generator
    from megactx.train.evaluate import _checkpoint_dir, _fail, held_out_corpus, model_contexts, parse_tasks

    try:
        model_dir = _checkpoint_dir(args.model)
        [task] = parse_tasks(args.task)
        contexts = model_contexts(model_dir, args.contexts)
        if args.cases < 1:
            raise ValueError(f"--cases must be at least 1, got {args.cases}")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
        model = load_model(model_dir, device=device, backend=backend,
                           dtype=torch.bfloat16 if backend == "triton" else torch.float32)
        index_dtype = args.index_cache_dtype or ("fp8" if backend == "triton" else "auto")
        model.set_backend(backend, "auto", index_dtype)
        corpus = held_out_corpus(Corpus.from_directory(args.corpus) if args.corpus else None)
        generator = needle_generator(model_dir, "held_out", corpus)
        results = evaluate_recall(model, kernel_ops(backend), generator, task, contexts, args.cases, args.seed,
                                  not args.no_progress)
    except (OSError, ValueError) as e:
        return _fail(str(e))
    engine = (f"{'Triton kernels' if backend == 'triton' else 'PyTorch twins of the kernels'}, indexer cache "
              f"{'FP8' if index_dtype == 'fp8' else 'exact'}")
    text = recall_markdown(results, str(args.model), task.label, args.seed, engine)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "needle_recall.json").write_text(json.dumps(
            {"model": str(args.model), "task": task.label, "seed": args.seed, "engine": engine,
             "cases": [asdict(r) for r in results]}, indent=1))
        (args.out / "needle_recall.md").write_text(text)
        print(f"wrote {args.out / 'needle_recall.md'}")
    return 0


def add_recall_parser(kinds) -> None:
    r = kinds.add_parser("needle-recall", help="did a missed needle's indexer drop it, or its attention?",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--model", required=True, help="checkpoint directory (with tokenizer.json)")
    r.add_argument("--contexts", default="4k", help="comma-separated lengths, e.g. 16k,64k (default 4k)")
    r.add_argument("--cases", type=int, default=100, help="cases a context (default 100)")
    r.add_argument("--seed", type=int, default=0, help="seed of the cases, as in `eval needles` (default 0)")
    r.add_argument("--task", default="single", help="one needle task (default single)")
    r.add_argument("--corpus", type=Path, default=None,
                   help="corpus snapshot directory for the haystacks (default: this interpreter's stdlib, held out)")
    r.add_argument("--index-cache-dtype", choices=("auto", "fp8"), default=None,
                   help="indexer keys: fp8 as production runs them, or auto (exact) (default: fp8 on CUDA)")
    r.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--out", type=Path, default=None, help="directory for needle_recall.json and .md")
    r.set_defaults(func=run_needle_recall)
