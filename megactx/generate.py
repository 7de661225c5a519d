"""`megactx generate`: complete one prompt with the engine, streaming the text to the terminal as it
is generated, then a one-line summary on stderr (tokens, tokens/s, time to first token, finish
reason).

    megactx generate --prompt "def fib(n):" --max-tokens 64 --temperature 0
    echo "Hello" | megactx generate --prompt - --chat

Without --model it uses the shipped megactx-tiny model (models/megactx-tiny in the repository,
see megactx.models). An install without the repository has no model: then a random `tiny`
checkpoint is made once (a few seconds) and cached under $XDG_CACHE_HOME/megactx/random-tiny
(default ~/.cache/megactx); its output is noise, but it runs the whole engine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

PROG = "megactx generate"
RANDOM_PRESET = "tiny"
RANDOM_SEED = 0
DEFAULT_MAX_TOKENS = 128
PREFILL_PROGRESS_TOKENS = 8192  # prompts from this long show their prefill's progress on stderr
DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
# SamplingParams names a bad field in the first word of its ValueError; a person typed the flag.
FLAG_OF_FIELD = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed",
                 "max_tokens": "--max-tokens", "stop": "--stop"}
NO_TRAINED_MODEL = "no trained model here: using random weights, output is noise"


# ------------------------------------------------------------------------------ the default model
def cache_root() -> Path:
    """$XDG_CACHE_HOME/megactx, or ~/.cache/megactx."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megactx"


def random_checkpoint(root: Path | None = None, log: Callable[[str], object] | None = None) -> Path:
    """The cached random `tiny` checkpoint (seed 0) under `root` (default `cache_root()`), made on
    first use. It is written to a temporary directory and renamed into place, so a second process
    making it at the same time never sees half a checkpoint. `log` gets one line when it is made."""
    path = (root or cache_root()) / f"random-{RANDOM_PRESET}"
    if (path / "config.json").is_file():
        return path
    from megactx.testing import make_random_checkpoint

    path.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"making a random {RANDOM_PRESET} checkpoint in {path} (once)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        # config.json is written with the weights, so its presence above means a whole checkpoint
        make_random_checkpoint(tmp, preset=RANDOM_PRESET, seed=RANDOM_SEED)
        os.replace(tmp, path)
    except OSError:
        if not (path / "config.json").is_file():  # not another process winning the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model(model: str | None, log: Callable[[str], object]) -> tuple[Path, bool]:
    """(checkpoint directory, whether it has random weights): `model` as given; else the shipped
    megactx-tiny (`megactx.models.shipped_model`); else, in an install without it, the cached
    random checkpoint, announced through `log` with the warning that its output is noise."""
    from megactx.models import shipped_model, shipped_model_missing

    if model is not None:
        if not Path(model).is_dir():
            raise FileNotFoundError(f"--model {model} is not a checkpoint directory (config.json, *.safetensors, "
                                    "tokenizer.json)")
        return Path(model), False
    shipped = shipped_model()
    if shipped is not None:
        return shipped, False
    path = random_checkpoint(log=log)
    log(f"{NO_TRAINED_MODEL} ({path}): {shipped_model_missing()}; pass --model PATH for a real checkpoint")
    return path, True


# ------------------------------------------------------------------------------ streaming
@dataclass
class Completion:
    """What `stream_completion` saw. Times are host seconds from the call: ttft_s to the first
    generated token, total_s to the last."""

    prompt_tokens: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    ttft_s: float | None
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> str:
        ttft = f"{self.ttft_s * 1e3:.0f} ms" if self.ttft_s is not None else "–"
        return (f"{len(self.token_ids)} tokens in {self.total_s:.2f} s ({self.tokens_per_s:.1f} tokens/s), "
                f"TTFT {ttft}, finish: {self.finish_reason} ({self.prompt_tokens} prompt tokens)")


def stream_completion(llm, prompt_ids: list[int], params, out: TextIO) -> Completion:
    """Generate from `prompt_ids` with `llm.stream`, writing each text delta to `out` as it comes
    (flushed, so a terminal shows it at once)."""
    start = time.perf_counter()
    first = last = None
    text, tokens, reason = [], [], None
    for delta in llm.stream(prompt_ids, params, prefill_progress=len(prompt_ids) >= PREFILL_PROGRESS_TOKENS):
        last = time.perf_counter()
        if first is None and delta.token_ids:
            first = last
        tokens += delta.token_ids
        if delta.text:
            text.append(delta.text)
            out.write(delta.text)
            out.flush()
        reason = delta.finish_reason or reason
    total = (last or time.perf_counter()) - start
    return Completion(len(prompt_ids), "".join(text), tokens, reason, None if first is None else first - start, total)


# ------------------------------------------------------------------------------ CLI
def add_generate_parser(sub) -> None:
    from megactx.cli import add_hf_overrides_argument

    p = sub.add_parser("generate", help="complete one prompt, streaming the text as it is generated",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True,
                   help="the prompt text; '-' reads it from stdin (less one trailing newline, which echo adds)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory (config.json + *.safetensors + tokenizer.json); default: the shipped "
                        "megactx-tiny (models/megactx-tiny), or without it a cached random tiny checkpoint")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]; 1 = off (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely; 0 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of this request's sampling (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the completion before this text; repeat for several (in bash, $'\\n' is a newline)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the checkpoint's chat template")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when torch sees a GPU)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                   help="weights and activations (default auto: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context the KV cache is sized for (default: prompt + --max-tokens, at most the model's)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads on a CPU (default 1: a small model's ops are too small to split; raise it "
                        "for a large checkpoint)")
    add_hf_overrides_argument(p)
    p.set_defaults(func=run_generate)


@contextmanager
def cpu_threads(num_threads: int, device: str) -> Iterator[None]:
    """Run the block on `num_threads` torch threads when `device` is a CPU, restoring the count
    after. A tiny model's ops are too small to split: with several threads they spin against each
    other (and against other processes), which on a busy 2-core machine makes decoding 20x slower."""
    import torch

    if torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity where the OS says, else all of them."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def read_prompt(value: str, stdin: TextIO) -> str:
    """The --prompt text: the value itself, or stdin for '-' less one trailing newline."""
    if value != "-":
        return value
    text = stdin.read()
    return text[:-1] if text.endswith("\n") else text


def sampling_params_from_args(args: argparse.Namespace):
    """SamplingParams of the flags; a ValueError names the flag (--top-p, not top_p)."""
    from megactx import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              max_tokens=args.max_tokens, stop=list(args.stop))
    except ValueError as e:
        message = str(e)
        field_name = message.split(" ", 1)[0]
        if field_name in FLAG_OF_FIELD:
            message = FLAG_OF_FIELD[field_name] + message[len(field_name):]
        raise ValueError(message) from None


def context_length(prompt_tokens: int, max_tokens: int, model_len: int, max_model_len: int | None) -> int:
    """The context to size the engine's cache for: --max-model-len, or by default just the prompt +
    --max-tokens (one request; a CPU allocates the whole cache up front). ValueError, before the
    model loads, when the request cannot fit."""
    if max_model_len is not None and max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of {model_len} tokens")
    limit, name = (max_model_len, f"--max-model-len {max_model_len}") if max_model_len else (
        model_len, f"the model's context of {model_len} tokens")
    if prompt_tokens + max_tokens > limit:
        room = limit - prompt_tokens
        hint = f"give --max-tokens {room} or less" if room > 0 else "shorten the prompt"
        raise ValueError(f"the prompt has {prompt_tokens} tokens and --max-tokens is {max_tokens}: together more "
                         f"than {name}; {hint}")
    return max_model_len or prompt_tokens + max_tokens


def _torch_settings(args: argparse.Namespace):
    """(device, dtype or None) from the flags; ValueError says what to pass instead."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {device!r}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {device!r}")
    dtype = DTYPES[args.dtype]
    return device, None if dtype is None else getattr(torch, dtype)


def run_generate(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None,
                 stderr: TextIO | None = None) -> int:
    """`megactx generate`: 0 on success, 2 on bad flags or a checkpoint that cannot be used, 130
    when interrupted (Ctrl-C)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr

    def say(message: str) -> None:
        print(f"{PROG}: {message}", file=stderr, flush=True)

    def fail(message: str) -> int:
        say(f"error: {message}")
        return 2

    try:
        params = sampling_params_from_args(args)
        if args.max_model_len is not None and args.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2 tokens (a prompt token + a generated one), "
                             f"got {args.max_model_len}")
        device, dtype = _torch_settings(args)
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        prompt = read_prompt(args.prompt, stdin)
        if not prompt:
            raise ValueError("--prompt is empty" + (" (stdin had no text)" if args.prompt == "-" else ""))
    except ValueError as e:
        return fail(str(e))

    from megactx import LLM, ModelConfig
    from megactx.engine.tokenizer import Tokenizer

    try:
        path, _ = resolve_model(args.model, say)
        cfg = ModelConfig.from_pretrained(path, args.hf_overrides)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json: generate needs the checkpoint's tokenizer to encode "
                             "--prompt")
        tokenizer = Tokenizer(path)
        if args.chat:
            if tokenizer.chat_template is None:
                raise ValueError(f"--chat: the tokenizer of {path} has no chat template; drop --chat to complete "
                                 "the raw prompt")
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt_ids = tokenizer.encode(prompt)
        max_model_len = context_length(len(prompt_ids), params.max_tokens, cfg.max_position_embeddings,
                                       args.max_model_len)
        with cpu_threads(args.threads, device):
            start = time.perf_counter()
            # one request: a warm-up of every step shape would take longer than the shapes it meets
            llm = LLM(path, device=device, dtype=dtype, max_model_len=max_model_len, max_num_seqs=1, warm_up=False,
                      hf_overrides=args.hf_overrides)
            dtype_name = str(llm.model.dtype).removeprefix("torch.")
            say(f"loaded {path} on {llm.device} ({dtype_name}) in {time.perf_counter() - start:.1f} s")
            done = stream_completion(llm, prompt_ids, params, stdout)
    except (OSError, ValueError) as e:  # a missing file, a ConfigError, a prompt longer than the context
        return fail(str(e))
    except KeyboardInterrupt:
        print(file=stdout, flush=True)
        say("interrupted")
        return 130
    if not done.text.endswith("\n"):
        print(file=stdout, flush=True)  # the shell prompt starts on its own line
    say(done.summary())
    return 0
