"""`dilaserve eval`: the speed-quality table of a model over τ and KV-cache modes."""

from __future__ import annotations

import argparse
import json
import sys

from dilaserve.cli.args import floats
from dilaserve.cli.common import add_model_arguments, load_model_from_args, model_dir
from dilaserve.models import load_tokenizer
from dilaserve.tiny.evaluate import EVAL_SEED, THRESHOLDS, SweepRow, modes_of, plot, sweep
from dilaserve.tiny.tasks import GENERATORS, make_problems


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="accuracy, steps and throughput over thresholds and cache modes (held-out tasks)",
        description=(
            "Decode held-out problems of the dilaserve-tiny task suite under every threshold "
            "and KV-cache mode; report accuracy, mean steps, tokens per step and tokens/s, "
            "and, with --plot, save a PNG plot of accuracy and steps against the threshold."
        ),
    )
    p.add_argument("--json", action="store_true", help="one JSON object per (τ, cache) line")
    p.add_argument("--n", type=int, default=500, help="number of held-out problems")
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="seed of the held-out problems")
    p.add_argument("--thresholds", type=floats, default=list(THRESHOLDS))
    p.add_argument(
        "--tasks",
        type=lambda s: tuple(s.split(",")),
        help=f"only problems of these tasks, e.g. add (default: all of {','.join(GENERATORS)})",
    )
    p.add_argument(
        "--caches",
        type=lambda s: s.split(","),
        help="e.g. none,dual (default: none,prefix,dual, or none,block for a block diffusion "
        "model)",
    )
    p.add_argument(
        "--block-length", type=int, help="default: 32, or a block diffusion model's block"
    )
    p.add_argument("--batch-size", type=int, default=64, help="problems decoded together")
    p.add_argument("--plot", help="PNG file to write the plot to (none without it)")
    add_model_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.n <= 0 or args.batch_size <= 0 or (args.block_length or 1) <= 0:
        raise ValueError("--n, --batch-size and --block-length must be positive")
    if any(not 0.0 <= t <= 1.0 for t in args.thresholds):
        raise ValueError(f"thresholds must lie in [0, 1], got {args.thresholds}")
    unknown_tasks = sorted(set(args.tasks or ()) - set(GENERATORS))
    if unknown_tasks:
        raise ValueError(f"unknown tasks {unknown_tasks}; choose from {list(GENERATORS)}")
    model = load_model_from_args(args)
    modes = modes_of(model)
    unknown = sorted(set(args.caches or ()) - set(modes))
    if unknown:
        raise ValueError(f"unknown cache modes {unknown} for this model; choose from {list(modes)}")
    rows = sweep(
        model,
        load_tokenizer(model_dir(args)),
        make_problems(args.n, args.seed, args.tasks),
        thresholds=args.thresholds,
        cache_modes=args.caches,
        block_length=args.block_length,
        batch_size=args.batch_size,
        on_row=_print_json if args.json else None,
    )
    if not args.json:
        print(format_table(rows))
    if args.plot:
        path = plot(rows, args.plot)
        print(f"plot saved to {path}", file=sys.stderr)
    return 0


def _print_json(row: SweepRow) -> None:
    print(json.dumps(row.to_dict()), flush=True)


def format_table(rows: list[SweepRow]) -> str:
    """A Markdown table, one row per (cache mode, τ)."""
    lines = [
        "| cache | τ | accuracy | mean steps | tokens/step | tokens/s | n |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.cache} | {r.threshold:.1f} | {100 * r.accuracy:.1f} % | {r.mean_steps:.2f} "
            f"| {r.tokens_per_step:.2f} | {r.tokens_per_s:.0f} | {r.n} |"
        )
    return "\n".join(lines)
