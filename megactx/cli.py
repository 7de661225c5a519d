"""The `megactx` command line. Each subcommand's --help says what it does."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from megactx import __version__


def build_parser() -> argparse.ArgumentParser:
    from megactx.analysis.flops import add_flops_parser
    from megactx.demo import add_demo_parser
    from megactx.engine.steplog import add_steplog_parser
    from megactx.generate import add_generate_parser
    from megactx.serve import add_serve_parser
    from megactx.train.cli import add_train_parser
    from megactx.train.evaluate import add_eval_parser
    from megactx.train.indexshare_search import add_indexshare_search_parser

    parser = argparse.ArgumentParser(
        prog="megactx",
        description="Million-token contexts the GLM-5.2 way: IndexShare sparse attention, MTP drafts.",
    )
    parser.add_argument("--version", action="version", version=f"megactx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_demo_parser(sub)
    add_flops_parser(sub)
    add_bench_parser(sub)
    add_train_parser(sub)
    add_eval_parser(sub)
    add_indexshare_search_parser(sub)
    add_steplog_parser(sub)
    return parser


def add_gpu_memory_argument(parser: argparse.ArgumentParser, purpose: str = "") -> None:
    """--gpu-memory-utilization (vLLM's flag), defaulting to LLM's; `purpose` ends its help."""
    import inspect

    from megactx.engine.llm import LLM

    default = inspect.signature(LLM.__init__).parameters["gpu_memory_utilization"].default
    parser.add_argument("--gpu-memory-utilization", type=float, default=default,
                        help="fraction of the GPU's memory the engine may use; what weights and activations leave "
                             f"goes to the KV cache{purpose} (default %(default)s)")


def add_hf_overrides_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """--hf-overrides JSON (vLLM's flag): config fields changed before the model is built."""
    parser.add_argument("--hf-overrides", type=_hf_overrides, default=None, metavar="JSON",
                        help=help or "change fields of the checkpoint's config.json before the model is built, "
                                     "nested objects merged key by key; e.g. '{\"rope_parameters\": {\"factor\": "
                                     "64}}' serves megactx-tiny (YaRN factor 32 over 4K: positions to 128K) with "
                                     "positions to 256K")


def _hf_overrides(text: str) -> dict[str, Any]:
    from megactx.config import ConfigError, parse_overrides

    try:
        return parse_overrides(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# `megactx bench SUITE`: each suite is the module benchmarks.<SUITE>, which defines HELP, a module
# docstring (the --help text), add_arguments(parser) and run(args) -> exit code; a suite plugs in
# by adding its name here.
BENCH_SUITES = ("kernels", "engine", "spec", "profile", "chunk", "compile")


def add_bench_parser(subparsers: Any) -> None:
    """Register `bench` and one sub-subcommand per suite on an argparse subparsers object."""
    p = subparsers.add_parser("bench", help="benchmarks on this machine: " + ", ".join(BENCH_SUITES),
                              description="Benchmarks: JSON + Markdown + PNG under benchmarks/results/, with the "
                                          "machine's own ceilings and every peer measured in the same run.")
    suites = p.add_subparsers(dest="suite", metavar="SUITE")
    p.set_defaults(func=lambda args: _print_help(p))
    for name in BENCH_SUITES:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as e:
            if e.name != "benchmarks":
                raise
            # an install without the repository's benchmarks/ package: say so when asked to run
            sp = suites.add_parser(name, help="(needs the benchmarks/ package of the megactx repository)")
            sp.set_defaults(func=_missing_benchmarks)
            continue
        sp = suites.add_parser(name, help=module.HELP, description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(func=module.run)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def _missing_benchmarks(args: argparse.Namespace) -> int:
    print("megactx bench: error: the benchmarks package is not importable; run from a checkout of the "
          "megactx repository, or install it with `pip install -e .` there", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
