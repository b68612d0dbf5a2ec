"""`dilaserve generate`: decode one prompt offline with the step runner and print the answer."""

from __future__ import annotations

import argparse
import sys

from dilaserve.cli.common import add_model_arguments, load_model_from_args, model_dir
from dilaserve.models import encode_prompt, load_tokenizer
from dilaserve.protocol import CacheMode
from dilaserve.worker.generate import generate
from dilaserve.worker.runner import StepRunner


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="decode one prompt with threshold-based parallel unmasking and print the answer",
        description=(
            "Decode PROMPT block by block: each step commits every masked position of the "
            "current block whose confidence reaches --threshold (at least one). Stops at EOS."
        ),
    )
    p.add_argument("prompt", help='e.g. "12345+67890="')
    p.add_argument("--threshold", type=float, default=0.9, help="confidence threshold τ")
    p.add_argument(
        "--cache",
        default=None,
        choices=[m.value for m in CacheMode],
        help="KV cache (default: 'block', the exact cache, for a block diffusion model; "
        "else 'dual')",
    )
    p.add_argument(
        "--block-length",
        type=int,
        default=None,
        help="default: a block diffusion model's own (its blocks are the model's), else 32",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output positions (default: the prompt's token count plus one, rounded up to "
        "whole blocks: enough for every task dilaserve-tiny knows)",
    )
    p.add_argument("--stats", action="store_true", help="also print steps and tokens per step")
    add_model_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.threshold <= 1.0:
        raise ValueError(f"--threshold must be in [0, 1], got {args.threshold}")
    if (args.block_length is not None and args.block_length <= 0) or (
        args.max_tokens is not None and args.max_tokens <= 0
    ):
        raise ValueError("--block-length and --max-tokens must be positive")
    tokenizer = load_tokenizer(model_dir(args))
    prompt_ids = encode_prompt(tokenizer, args.prompt)
    model = load_model_from_args(args)
    cache = args.cache or CacheMode.default_for(model.config.block_size)
    runner = StepRunner(model, cache=cache, max_requests=1)
    (result,) = generate(
        runner,
        [prompt_ids],
        gen_length=args.max_tokens or len(prompt_ids) + 1,  # RequestState rounds up to blocks
        block_length=args.block_length,
        threshold=args.threshold,
        stop_at_eos=True,
    )
    print(tokenizer.decode(result.output_ids, skip_special_tokens=True))
    if args.stats:
        committed = result.state.num_committed
        print(
            f"steps={result.steps} committed_tokens={committed} "
            f"tokens_per_step={committed / result.steps:.2f}",
            file=sys.stderr,
        )
    return 0
