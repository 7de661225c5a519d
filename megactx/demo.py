"""`megactx demo`: what megactx does, in a minute or two on a CPU.

    megactx demo                                   # the shipped megactx-tiny model
    megactx demo --needle-context 16k --max-tokens 256
    megactx demo --model path/to/checkpoint

1. The per-token cost of decoding: FLOPs and KV bytes of GLM-5.2 (IndexShare) against GLM-5.1.
2. Needle retrieval at a long context through the sparse path: a line `key_... = "402913"`
   hidden in held-out standard-library code, asked for after it, answered greedily by the engine
   from token-id prompts. It is the `single` task of `megactx eval needles` (same case for the same
   --seed and context). Each query attends only to the top-k keys its layer's indexer picked.
3. A code completion streamed with MTP speculative decoding (the MTP layer drafts γ tokens, one
   target forward verifies them), its mean acceptance length and tokens/s, then the same completion
   without speculation. Both are greedy, so their texts must be identical.

The model is --model, else the shipped megactx-tiny (models/megactx-tiny in the repository).
Without it (an install without the repository), or with --random, the demo shows a random model of
the tiny preset instead: its IndexShare schedule, the top-k each shared layer reuses, the two MLA
forms agreeing, greedy MTP drafting with IndexShare + KVShare, and the engine (paged KV, prefix
caching, speculative decoding) producing the reference model's greedy tokens. Its outputs are noise.

On a CPU the engine runs the kernels' PyTorch twins on --threads threads. By default the needle's
prefill, whose ops are large, takes every core this process may use, and the rest takes one: a tiny
model's decoding ops are too small to share, and threads spin against each other. The needle's
prefill takes most of the time, and it grows with the square of --needle-context: each query's
indexer scores every earlier key, in each of the shipped model's four indexer layers (64K tokens,
the default and its trained length: 211 s on an idle 2-core AMD EPYC machine, where the 8-layer
model it replaced, two indexers, took 99 s; 32K: 67 s).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

if TYPE_CHECKING:
    from megactx.config import ModelConfig
    from megactx.generate import Completion
    from megactx.model.transformer import Transformer
    from megactx.train.needles import NeedleCase, NeedleGenerator

PROG = "megactx demo"
DEFAULT_NEEDLE_CONTEXT = "64k"  # megactx-tiny's trained length
MIN_NEEDLE_CONTEXT = 128  # room for a haystack besides the question, the needle and the answer
DEFAULT_MAX_TOKENS = 128
DEFAULT_SPECULATIVE_TOKENS = 7
CPU_PREFILL_CHUNK = 512  # prefill tokens a step on a CPU: the twins' [chunk, keys] buffers stay in cache
CUDA_PREFILL_CHUNK = 8192
COMPLETION_PROMPT = '''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self._items = []

    def push(self, item):
'''


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="FLOPs analysis, needle retrieval at 64K tokens, code completion with MTP "
                                    "speculative decoding (the shipped megactx-tiny model)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint directory (config.json, *.safetensors, tokenizer.json) (default: the shipped "
                        "megactx-tiny, models/megactx-tiny)")
    p.add_argument("--random", action="store_true",
                   help="show a random model of the tiny preset instead (reference forward, IndexShare schedule, "
                        "engine against the reference); the default without the shipped model")
    p.add_argument("--needle-context", default=None,
                   help=f"prompt + answer tokens of the needle case; several run one case each, e.g. 4k,16k "
                        f"(k = 1024) (default {DEFAULT_NEEDLE_CONTEXT}, or the model's context where shorter)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens of the code completion at most (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--prompt", default=COMPLETION_PROMPT, help="the code completion's prompt (default: the start of a "
                                                               "Python class)")
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS,
                   help=f"γ, tokens the MTP layer drafts a step (default {DEFAULT_SPECULATIVE_TOKENS}); 0 = "
                        "plain decoding only")
    p.add_argument("--context", default="32k,128k,1m", help="context lengths for the FLOPs table (default 32k,128k,1m)")
    p.add_argument("--seed", type=int, default=0, help="seed of the needle case and of the random model (default 0)")
    p.add_argument("--seqlen", type=int, default=256, help="random model: prompt length of its forward (default 256)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on a CPU (default: every core for the needle's prefill, 1 for the rest, "
                        "whose ops are too small to split)")
    p.set_defaults(func=run_demo)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run_demo(args: argparse.Namespace) -> int:
    """`megactx demo`: 0 when it ran, 2 on bad flags or a checkpoint that cannot be used."""
    from megactx.analysis.flops import format_table, parse_context, token_cost
    from megactx.config import ModelConfig
    from megactx.generate import cpu_threads
    from megactx.models import shipped_model, shipped_model_missing
    from megactx.train.evaluate import parse_contexts

    try:
        flops_contexts = parse_context(args.context)
        needle_contexts = parse_contexts(args.needle_context or DEFAULT_NEEDLE_CONTEXT)
        if min(needle_contexts) < MIN_NEEDLE_CONTEXT:
            raise ValueError(f"--needle-context must be at least {MIN_NEEDLE_CONTEXT} tokens (the question, the "
                             f"needle and the answer take about 60), got {min(needle_contexts)}")
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        if args.num_speculative_tokens < 0:
            raise ValueError(f"--num-speculative-tokens must be >= 0 (0 = off), got {args.num_speculative_tokens}")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        if args.random and args.model:
            raise ValueError("--random shows a random model; drop --model, or drop --random to show the checkpoint")
        _check_device(args.device)
    except ValueError as e:
        return _fail(str(e).replace("--contexts", "--needle-context"))  # parse_contexts names eval's flag

    with cpu_threads(args.threads or 1, args.device):
        start = time.perf_counter()
        print("== Per-token cost of decoding, GLM-5.2 (IndexShare) vs GLM-5.1 (an indexer in every layer) ==\n")
        results = {name: [token_cost(ModelConfig.from_pretrained(name), c) for c in flops_contexts]
                   for name in ("glm-5.2", "glm-5.1")}
        print(format_table(results))
        model = args.model or (None if args.random else shipped_model())
        if model is None:
            if not args.random:
                print(f"\n({shipped_model_missing()}: showing a RANDOM model instead, whose outputs are noise; "
                      "pass --model PATH for a trained checkpoint)")
            random_model_demo(args.seqlen, args.seed)
        else:
            try:
                checkpoint_demo(Path(model), needle_contexts, args)
            except (OSError, ValueError) as e:  # a missing file, a ConfigError, a context the model lacks
                return _fail(str(e).replace("--contexts", "--needle-context"))
        print(f"\n(demo took {time.perf_counter() - start:.0f} s)")
    return 0


def _check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but torch {torch.__version__} sees no CUDA GPU; use --device cpu")


# ------------------------------------------------------------------------------ a checkpoint
def checkpoint_demo(path: Path, needle_contexts: list[int], args: argparse.Namespace) -> None:
    """Sections 2 and 3 of the module docstring for the checkpoint at `path`, after a line about
    the model. Without a tokenizer.json they are skipped (both need text)."""
    from megactx.analysis.flops import context_label
    from megactx.config import ModelConfig
    from megactx.generate import cpu_threads, usable_cores
    from megactx.model import load_model
    from megactx.train.data import needle_generator
    from megactx.train.evaluate import held_out_corpus

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {path}: no config.json there; pass a checkpoint directory")
    cfg = ModelConfig.from_pretrained(path)
    if max(needle_contexts) > cfg.max_position_embeddings:
        if args.needle_context is not None:
            raise ValueError(f"--needle-context {max(needle_contexts)} exceeds the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
        needle_contexts = [cfg.max_position_embeddings]  # the default, beyond a shorter model: its whole context
    on_cuda = torch.device(args.device).type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    start = time.perf_counter()
    model = load_model(path, device=args.device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    schedule = "".join("F" if t == "full" else "S" for t in cfg.indexer_types)
    print(f"\n== {path.resolve().name} ({path}): {n_params / 1e6:.1f}M parameters, loaded in "
          f"{time.perf_counter() - start:.1f} s on {args.device} ({str(dtype).removeprefix('torch.')}) ==")
    print(f"{cfg.num_hidden_layers} layers, IndexShare schedule {schedule} (F = runs its indexer, S = reuses the "
          f"top-k of the nearest F below), top-k {cfg.index_topk}, MTP layers: {cfg.num_nextn_predict_layers}, "
          f"vocabulary {cfg.vocab_size}")
    if not (path / "tokenizer.json").is_file():
        print(f"\n{path} has no tokenizer.json: skipping needle retrieval and code completion, which need text")
        return
    chunk = CUDA_PREFILL_CHUNK if on_cuda else CPU_PREFILL_CHUNK
    generator = needle_generator(path, "held_out", held_out_corpus())
    for context in needle_contexts:
        # the heading first: the engine's progress bar (stderr) shows the prefill under it
        print(f"\n== Needle retrieval at {context_label(context)} tokens, sparse attention ==", flush=True)
        with cpu_threads(args.threads or usable_cores(), args.device):  # a long prefill's ops are large
            run = needle_demo(model, path, generator, context, args.seed, args.device, chunk)
        show_needle(run, cfg)
    gamma = args.num_speculative_tokens if cfg.num_nextn_predict_layers else 0
    if args.num_speculative_tokens and not gamma:
        print("\n(this checkpoint has no MTP layer: no speculative decoding)")
    completion_demo(model, path, args.prompt, args.max_tokens, gamma, args.device)


@dataclass
class NeedleRun:
    """One needle case through the engine: what it asked, what came back, how long it took."""

    case: NeedleCase
    context: int  # the context the case was made for: prompt + the task's answer budget
    seed: int
    output: str  # the decoded completion
    seconds: float  # prefill + decoding
    ttft_s: float  # to the first answer token: the prefill, mostly

    @property
    def correct(self) -> bool:
        return self.case.is_correct(self.output)


def needle_demo(model: Transformer, path: Path, generator: NeedleGenerator, context: int, seed: int, device: str,
                prefill_chunk: int) -> NeedleRun:
    """The `single` needle case of `megactx eval needles --contexts CONTEXT --cases 1 --seed SEED`,
    answered greedily by an engine over `model` with the tokenizer of the checkpoint at `path`.
    generator: `needle_generator(path, "held_out", held_out_corpus())`, as the evaluation makes it
    (haystacks: the held-out split of this interpreter's stdlib in the checkpoint's tokens)."""
    from megactx import LLM
    from megactx.train.evaluate import EngineAnswerer, needle_cases
    from megactx.train.needles import STANDARD_TASKS

    case = next(needle_cases(generator, STANDARD_TASKS["single"], context, 1, seed))
    llm = LLM(model, tokenizer=path, device=device, max_model_len=context, max_num_seqs=1,
              max_num_batched_tokens=prefill_chunk, warm_up=False)  # one request: nothing to warm up for
    start = time.perf_counter()
    output = EngineAnswerer(llm, use_tqdm=True)([case])[0]  # the prefill's progress, minutes on a CPU
    seconds = time.perf_counter() - start
    return NeedleRun(case, context, seed, output, seconds, llm.stats.time_to_first_token[-1])


def show_needle(run: NeedleRun, cfg: ModelConfig) -> None:
    from megactx.analysis.flops import context_label
    from megactx.train.tokenizer import END

    case = run.case
    n = len(case.input_ids)
    needle = next(x for x in case.needles if x.role == "asked")
    answer = run.output.split(END)[0].strip()
    topk = min(cfg.index_topk, n)
    full = len(cfg.full_layers)
    print(f"(the case of `megactx eval needles --tasks single --contexts {context_label(run.context)} --cases 1 "
          f"--seed {run.seed}`)")
    print(f"hidden at token {needle.position:,} of {n:,} (depth {needle.offset / case.haystack_len:.2f}): "
          f"{needle.text.strip()}")
    print(f"question:  {case.question}")
    print(f"expected:  {case.answer}")
    print(f"answer:    {answer!r}  ->  {'correct' if run.correct else 'WRONG'}")
    print(f"attention: each query attends to at most {topk} of up to {n:,} keys ({topk / n:.1%}); {full} of "
          f"{cfg.num_hidden_layers} layers score every earlier key with their indexer, "
          f"{cfg.num_hidden_layers - full} reuse the top-k of the nearest one below")
    print(f"time:      {run.seconds:.1f} s, of which the prefill of {n:,} tokens took {run.ttft_s:.1f} s "
          f"({n / run.ttft_s:,.0f} tokens/s)")


@dataclass
class SpecComparison:
    """The same greedy completion with and without MTP speculative decoding."""

    speculative: Completion | None  # None without speculation
    plain: Completion
    mean_acceptance_length: float  # tokens a verify emits: accepted drafts + 1 (0.0 without speculation)

    @property
    def identical(self) -> bool:
        return self.speculative is None or self.speculative.token_ids == self.plain.token_ids


def completion_demo(model: Transformer, path: Path, prompt: str, max_tokens: int, gamma: int,
                    device: str) -> SpecComparison:
    """Complete `prompt` greedily with γ = `gamma` speculative tokens, streaming it to stdout, then
    without speculation (silently); print the speeds, the acceptance length and whether the texts
    agree. gamma = 0: the plain completion only, streamed."""
    from megactx import LLM, SamplingParams
    from megactx.engine.tokenizer import Tokenizer
    from megactx.generate import context_length, stream_completion

    prompt_ids = Tokenizer(path).encode(prompt)
    max_model_len = context_length(len(prompt_ids), max_tokens, model.cfg.max_position_embeddings, None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def complete(num_speculative_tokens: int, out: TextIO) -> tuple[Completion, float]:
        llm = LLM(model, tokenizer=path, device=device, max_model_len=max_model_len, max_num_seqs=1,
                  num_speculative_tokens=num_speculative_tokens, warm_up=False)
        done = stream_completion(llm, prompt_ids, params, out)
        stats = llm.stats.spec_decode
        return done, stats.mean_acceptance_length if stats else 0.0

    how = (f"MTP speculative decoding (γ = {gamma}: the MTP layer drafts {gamma} tokens, one target forward "
           "verifies them)" if gamma else "plain greedy decoding")
    print(f"\n== Code completion with {how} ==\n")
    print(prompt, end="", flush=True)
    speculative, acceptance = complete(gamma, sys.stdout) if gamma else (None, 0.0)
    plain, _ = complete(0, io.StringIO() if gamma else sys.stdout)
    shown = speculative or plain
    if not shown.text.endswith("\n"):
        print()
    print("-" * 72)
    if speculative is not None:
        print(f"with speculation (γ = {gamma}): {speculative.summary()}")
        print(f"  mean acceptance length {acceptance:.2f} tokens a verify (accepted drafts + 1)")
    print(f"without speculation:     {plain.summary()}")
    result = SpecComparison(speculative, plain, acceptance)
    if speculative is not None:
        speedup = speculative.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else float("nan")
        print(f"speed-up {speedup:.2f}x; greedy texts identical with and without speculation: {result.identical}")
    return result


# ------------------------------------------------------------------------------ a random model
def random_model_demo(seqlen: int, seed: int) -> None:
    """The reference forward of a random tiny-preset model: IndexShare schedule, per-layer top-k,
    naive vs absorbed MLA, MTP drafts, then the engine against the reference."""
    from megactx.config import ModelConfig
    from megactx.generate import RANDOM_PRESET
    from megactx.model import build_model, draft

    cfg = ModelConfig.from_pretrained(RANDOM_PRESET)
    torch.manual_seed(seed)
    model = build_model(cfg, seed=seed)
    n_params = sum(p.numel() for p in model.parameters())
    schedule = "".join("F" if t == "full" else "S" for t in cfg.indexer_types)
    print(f"\n== Reference forward of a RANDOM {RANDOM_PRESET} model ({n_params / 1e6:.1f}M parameters) ==")
    print(f"layers: {cfg.num_hidden_layers}, indexer schedule {schedule} (F = runs its indexer, "
          f"S = reuses the top-k of the nearest F below), top-k {cfg.index_topk}, "
          f"MTP layers: {cfg.num_nextn_predict_layers}")

    input_ids = torch.randint(0, cfg.vocab_size, (1, seqlen), generator=torch.Generator().manual_seed(seed))
    topk_seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: topk_seen.__setitem__(i, out[1]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(input_ids)
        naive_s = time.perf_counter() - t0
        model.set_attention(absorbed=True)
        t0 = time.perf_counter()
        absorbed = model(input_ids)
        absorbed_s = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    print(f"logits {tuple(logits.shape)}: naive MLA {naive_s * 1e3:.0f} ms, absorbed MLA {absorbed_s * 1e3:.0f} ms, "
          f"max |difference| {(logits - absorbed).abs().max().item():.2e}")
    last = seqlen - 1
    for i in range(cfg.num_hidden_layers):
        src = cfg.topk_source(i)
        keys = topk_seen[i][0, last]
        keys = keys[keys >= 0]
        origin = "own indexer" if src == i else f"top-k of layer {src}"
        print(f"  layer {i:2d} [{schedule[i]}] last token attends to {keys.numel():4d} of {seqlen} keys "
              f"({origin})")

    steps = 4
    with torch.no_grad():
        shared = draft(model, input_ids, steps, kv_share=True)
        baseline = draft(model, input_ids, steps, kv_share=False)
    print(f"\nMTP greedy drafts ({steps} steps) after token {shared.next_token.item()}: "
          f"IndexShare+KVShare {shared.tokens[0].tolist()}, baseline {baseline.tokens[0].tolist()}")
    print("(random weights: the drafts mean nothing)")
    _engine_demo(model, input_ids[0].tolist())


def _engine_demo(model, prompt: list[int], new_tokens: int = 12) -> None:
    """The engine on the same model: two requests sharing the prompt (the second hits the prefix
    cache), the output checked against greedy decoding with the reference forward, then the same
    with MTP speculative decoding."""
    from megactx import LLM, SamplingParams

    print("\n== The engine (paged KV over the kernels' PyTorch twins on a CPU) ==")
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    want = ids[len(prompt):]
    for gamma in (0, 3):
        llm = LLM(model, device="cpu", dtype=torch.float32, max_model_len=len(prompt) + 64, max_num_seqs=4,
                  num_speculative_tokens=gamma)
        t0 = time.perf_counter()
        first = llm.generate([prompt], greedy, use_tqdm=False)[0]
        second = llm.generate([prompt[:-1] + [prompt[-1] ^ 1]], greedy, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        label = "no speculation" if gamma == 0 else f"MTP speculation, γ = {gamma}"
        print(f"{label}: {new_tokens} tokens, equal to the reference's greedy tokens: {first.token_ids == want}; "
              f"second request reused {second.num_cached_tokens} cached prompt tokens; {seconds:.2f} s")
        if gamma:
            stats = llm.stats.spec_decode
            print(f"  mean acceptance length {stats.mean_acceptance_length:.2f} "
                  "(random MTP weights: drafts are rarely right)")
        else:
            print(f"  {llm.memory_report()}")
