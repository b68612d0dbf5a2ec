"""The `dilaserve` console script: one module per subcommand, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dilaserve.cli import (
    bench,
    eval,
    generate,
    plan,
    predictor,
    profile,
    serve,
    simulate,
    train_tiny,
)

# Each module registers its subcommand; adding a command is one file and one line here.
COMMANDS = [serve, bench, simulate, generate, eval, profile, plan, train_tiny, predictor]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dilaserve",
        description="DiLaServe: SLO-aware serving of diffusion language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, OSError) as e:
        print(f"dilaserve {args.command}: error: {e}", file=sys.stderr)
        return 2
