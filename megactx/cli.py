"""The `megactx` command line. Each subcommand's --help says what it does."""

from __future__ import annotations

import argparse
import sys

from megactx import __version__


def build_parser() -> argparse.ArgumentParser:
    from megactx.analysis.flops import add_flops_parser
    from megactx.demo import add_demo_parser

    parser = argparse.ArgumentParser(
        prog="megactx",
        description="Million-token contexts the GLM-5.2 way: IndexShare sparse attention, MTP drafts.",
    )
    parser.add_argument("--version", action="version", version=f"megactx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_demo_parser(sub)
    add_flops_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
