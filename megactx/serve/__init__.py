"""`megactx serve`: an OpenAI-compatible HTTP server over the engine (DESCRIPTION below is its --help).

Modules: protocol (request / response schemas), async_engine (the engine thread and its asyncio
bridge), engine_process (the engine in a process of its own instead), api (the FastAPI app),
metrics (Prometheus). This package's own import is light (argparse
only), so `megactx --help` and the other subcommands do not need FastAPI.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from pathlib import Path

DESCRIPTION = """`megactx serve`: an OpenAI-compatible HTTP server over the engine.

    megactx serve --port 8000                     # the shipped megactx-tiny model
    megactx serve --model path/to/checkpoint --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "megactx-tiny", "prompt": "def fib(n):", "max_tokens": 32}'

Without --model it serves the shipped megactx-tiny (models/megactx-tiny in the megactx repository);
an install without the repository has no model, and --model is then required.

Routes: /v1/completions and /v1/chat/completions (SSE streaming with "stream": true), /v1/models,
/health, /metrics (Prometheus). The model name clients send is --served-model-name (default: the
checkpoint directory's name). Sampling fields are OpenAI's (n, temperature, top_p, max_tokens, stop,
seed, logprobs / top_logprobs, presence and frequency penalties) plus vLLM's extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids).

Overload: --max-queued-requests sequences may wait beyond the --max-num-seqs that run at once;
past that, a request gets 503 with Retry-After (nothing accepted is ever dropped). A client that
disconnects has its request aborted. SIGTERM drains the requests in flight, then exits (by the
signal, as uvicorn does, so a supervisor sees it). Each finished request logs one INFO line (id,
prompt and output tokens, time to first token, latency).
"""

DEFAULT_MAX_QUEUED_REQUESTS = 256  # sequences waiting beyond the running batch before a 503
DEFAULT_NUM_SPECULATIVE_TOKENS = 7  # γ of GLM-5.x's MTP training and of megactx-tiny's
DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: bfloat16 on CUDA, float32 on a CPU
# default context on a CPU: the shipped model's 1M positions do not fit the CPU cache budget, and a
# CPU takes minutes to prefill even 32K tokens with the kernels' PyTorch twins
CPU_MAX_MODEL_LEN = 32768
DEFAULT_GC_THRESHOLD = 0  # the server's and its engine process's young-generation threshold (0: Python's 700)


def settle_heap(gc_threshold: int = 0) -> None:
    """What exists now lives as long as the process: collect, then take it out of the cyclic
    collector's sight (`gc.freeze`), so that a full collection walks only what was allocated since
    (unfrozen, ~0.3M objects: 180 ms of the tiny model's engine on a CPU, holding up its loop
    mid-stream). gc_threshold > 0: allocations between young-generation collections, instead of
    Python's 700 (a request's objects then mostly die before a collection looks at them)."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    # given back at exit (once, however often this runs): objects still frozen when the interpreter
    # shuts down are never freed, and Triton's nanobind bindings then print a page of "leaked
    # instances" warnings (seen at every `megactx serve` shutdown, from its engine process)
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    if gc_threshold > 0:
        gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])


def add_serve_parser(subparsers) -> None:
    """Register `serve` on an argparse subparsers object. Flags mirror LLM's constructor; their
    defaults are LLM's own."""
    from megactx.cli import add_gpu_memory_argument, add_hf_overrides_argument
    from megactx.engine.llm import LLM
    from megactx.engine.spec_decode import DRAFT_ACCEPTANCE, MTP_MODES
    from megactx.serve.async_engine import DEFAULT_MAX_HANDOVERS_PER_S

    defaults = {name: p.default for name, p in inspect.signature(LLM.__init__).parameters.items()}
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, metrics)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (config.json, *.safetensors, tokenizer.json with a chat "
                                   "template) (default: the shipped megactx-tiny, models/megactx-tiny in the "
                                   "repository)")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: the checkpoint "
                                               "directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                                                       "0.0.0.0 listens on every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--max-model-len", type=int, default=defaults["max_model_len"],
                   help="longest context, prompt + output, in tokens (default: the model's max_position_embeddings, "
                        f"on a CPU at most {CPU_MAX_MODEL_LEN})")
    p.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"],
                   help="sequences the running batch holds at once (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"],
                   help="positions one engine step computes: decodes plus prefill chunks (default %(default)s)")
    add_gpu_memory_argument(p)
    p.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8"], default=defaults["kv_cache_dtype"],
                   help="MLA cache format: auto (= --dtype), bf16, or fp8 (656 B a token a layer instead of "
                        "1152) (default %(default)s)")
    p.add_argument("--device", default=defaults["device"],
                   help="torch device: cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and activations: auto = bfloat16 on CUDA, float32 on a CPU (default auto)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="sequences (a request with n completions counts n) that may wait beyond --max-num-seqs; "
                        "past that, new requests get 503 with Retry-After (default %(default)s)")
    p.add_argument("--max-handovers-per-s", type=float, default=DEFAULT_MAX_HANDOVERS_PER_S,
                   help="streamed events a second, all streams together: past that, a stream's tokens go out "
                        "several to an event, so the HTTP work does not slow the engine (0 = an event every "
                        "step; default %(default)s)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="tokens the checkpoint's MTP layer drafts a step, verified in one target forward; 0 = off "
                        f"(default: {DEFAULT_NUM_SPECULATIVE_TOKENS} when the checkpoint has an MTP layer, as "
                        "megactx-tiny and GLM-5.x do, else 0)")
    p.add_argument("--mtp-mode", choices=MTP_MODES, default=defaults["mtp_mode"],
                   help="draft steps >= 2: kvshare (IndexShare + KVShare: reuse step 1's top-k and KV, write "
                        "nothing), baseline (each step indexes and writes its own KV), auto (the checkpoint's "
                        "index_share_for_mtp_iteration) (default %(default)s)")
    p.add_argument("--draft-acceptance", choices=DRAFT_ACCEPTANCE, default=defaults["draft_acceptance"],
                   help="sampled requests: rejection (drafts sampled from the MTP distribution, rejection "
                        "sampling) or target-only (greedy drafts accepted with probability p(x), an ablation); "
                        "greedy requests accept greedily either way (default %(default)s)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap each engine step's host work with the device's work on the step before "
                        "(default: on with CUDA and no speculative decoding; with it, a step of graphed KVShare "
                        "drafts launches the next verify before its host sync)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="before serving, run every step shape the engine's CUDA graphs and Triton kernels meet "
                        "(a few seconds), so that no request waits for a graph capture or a compile "
                        "(default: on with CUDA)")
    p.add_argument("--step-log", metavar="PATH",
                   help="append a JSON line for every engine step to PATH (its time, work, captures; "
                        "`megactx steplog PATH` summarizes it)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so the HTTP work never holds its GIL (default); "
                        "--no-engine-process runs it in a thread of the server's process (one process, and on the "
                        "H200 with 64 streaming clients 28-44%% below offline throughput instead of 9-36%%: "
                        "benchmarks/README.md)")
    p.add_argument("--gc-threshold", type=int, default=DEFAULT_GC_THRESHOLD, metavar="ALLOCATIONS",
                   help="allocations between the cyclic garbage collector's young-generation passes, in the server "
                        "process and in its engine process, from startup on (what exists then is frozen out of "
                        "the collector's sight either way); 0 keeps Python's 700 (default "
                        f"{DEFAULT_GC_THRESHOLD})")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="log level of the server and of its one-line-a-request log (default info)")
    add_hf_overrides_argument(p)
    p.set_defaults(func=run_serve)


def _fail(message: str) -> int:
    print(f"megactx serve: error: {message}", file=sys.stderr)
    return 2


def _max_model_len(path: Path, args: argparse.Namespace) -> int | None:
    """--max-model-len, or on a CPU the model's context capped at CPU_MAX_MODEL_LEN; None: the
    engine's default (the model's context)."""
    import torch

    from megactx.config import ModelConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        on_cpu = torch.device(device).type == "cpu"
    except RuntimeError:  # a bad --device: the engine says so
        on_cpu = False
    if args.max_model_len is not None or not on_cpu:
        return args.max_model_len
    return min(ModelConfig.from_pretrained(path, args.hf_overrides).max_position_embeddings, CPU_MAX_MODEL_LEN)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model (--model, else the shipped one), then serve until SIGTERM / Ctrl-C. Returns 2
    (with a message) for bad flags or no model."""
    from megactx.models import shipped_model, shipped_model_missing

    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 0:
        return _fail(f"--num-speculative-tokens must be >= 0 (0 = off), got {args.num_speculative_tokens}")
    if args.max_queued_requests < 0:
        return _fail(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.gc_threshold < 0:
        return _fail(f"--gc-threshold must be >= 0 (0 = Python's own), got {args.gc_threshold}")
    if args.max_handovers_per_s < 0:
        return _fail(f"--max-handovers-per-s must be >= 0 (0 = an event every step), got {args.max_handovers_per_s}")
    model = args.model or shipped_model()
    if model is None:
        return _fail(f"no --model given, and {shipped_model_missing()}: --model PATH is required, a checkpoint "
                     "directory (config.json, *.safetensors, tokenizer.json); for a random test checkpoint, make "
                     "one with `python -c 'from megactx.testing import make_random_checkpoint as m; "
                     "m(\"tiny-random\")'` and pass --model tiny-random")
    path = Path(model)
    if not (path / "config.json").is_file():
        return _fail(f"--model {model}: no config.json there; pass a Hugging Face checkpoint directory")

    import torch
    import uvicorn

    from megactx.config import ModelConfig
    from megactx.engine.llm import LLM
    from megactx.serve.api import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gamma = args.num_speculative_tokens
    try:
        if gamma is None:
            has_mtp = ModelConfig.from_pretrained(path, args.hf_overrides).num_nextn_predict_layers > 0
            gamma = DEFAULT_NUM_SPECULATIVE_TOKENS if has_mtp else 0
        engine_args = dict(model=str(path), device=args.device,
                           dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
                           kv_cache_dtype=args.kv_cache_dtype, max_model_len=_max_model_len(path, args),
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           num_speculative_tokens=gamma, mtp_mode=args.mtp_mode,
                           draft_acceptance=args.draft_acceptance, async_scheduling=args.async_scheduling,
                           warm_up=args.warm_up, step_log=args.step_log, hf_overrides=args.hf_overrides)
        if args.engine_process:
            from megactx.serve.engine_process import SWITCH_INTERVAL_S, EngineFailed, EngineProcess

            sys.setswitchinterval(SWITCH_INTERVAL_S)  # the pipes' threads get the GIL soon after a message
            try:
                llm = EngineProcess(engine_args, log_level=args.log_level, gc_threshold=args.gc_threshold)
            except EngineFailed as e:
                return _fail(str(e))
        else:
            llm = LLM(**engine_args)
    except ValueError as e:
        return _fail(str(e))
    name = args.served_model_name or path.resolve().name
    app = build_app(llm, served_model_name=name, max_queued_requests=args.max_queued_requests,
                    max_handovers_per_s=args.max_handovers_per_s, gc_threshold=args.gc_threshold)
    logging.getLogger("megactx.serve").info("serving %s as %r on http://%s:%d", path, name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
