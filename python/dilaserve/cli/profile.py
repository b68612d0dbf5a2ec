"""`dilaserve profile`: measure step latency on this device and write the profile JSON."""

from __future__ import annotations

import argparse

import torch

from dilaserve.cli.common import add_model_arguments, default_dtype, model_dir
from dilaserve.models import read_config
from dilaserve.profiling import (
    DEFAULT_CACHE_CONTEXTS,
    DEFAULT_TOKEN_GRID,
    ProfileSettings,
    measure_degrees,
    write_profile,
)
from dilaserve.protocol import CacheMode


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure per-step latency (recompute / cache / no-cache) and write a profile",
        description=(
            "Time one denoising step of each kind over a grid of batch-token counts on the "
            "current device (cache steps also over cached-context lengths), and write the "
            "latency-profile JSON that the scheduler and planner load."
        ),
    )
    add_model_arguments(p)
    p.add_argument("--output", "-o", default="profile.json", help="profile JSON to write")
    p.add_argument(
        "--block-length", type=int, help="default: 32, or a block diffusion model's block"
    )
    p.add_argument(
        "--tokens",
        type=_ints,
        default=list(DEFAULT_TOKEN_GRID),
        help="comma-separated batch-token counts to measure",
    )
    p.add_argument("--max-request-tokens", type=int, default=512)
    p.add_argument(
        "--cache-context",
        type=_ints,
        default=list(DEFAULT_CACHE_CONTEXTS),
        help="comma-separated sequence lengths (tokens per request) at which cache steps "
        "are timed; a cache step attends to all of them",
    )
    p.add_argument(
        "--cache-mode",
        choices=[CacheMode.DUAL.value, CacheMode.PREFIX.value, CacheMode.BLOCK.value],
        help="cache the cache steps run (prefix feeds the block and its suffix; default: "
        "dual, or block — the exact cache — for a block diffusion model)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads per process (as a worker rank runs)",
    )
    p.add_argument(
        "--tp",
        type=_ints,
        default=[1],
        help="comma-separated TP degrees to measure, each on a real instance of that many "
        "rank processes (default: 1)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    _, config = read_config(model_dir(args))
    exact = bool(config.block_size)
    settings = ProfileSettings(
        block_length=args.block_length or config.block_size or 32,
        token_grid=args.tokens,
        max_request_tokens=args.max_request_tokens,
        cache_contexts=args.cache_context,
        cache_mode=CacheMode(args.cache_mode or ("block" if exact else "dual")),
        repeats=args.repeats,
    )
    settings.check()
    if min(args.tp) <= 0:
        raise ValueError("--tp degrees must be positive")
    measured = measure_degrees(
        model_dir(args),
        args.tp,
        settings,
        dtype=args.dtype or default_dtype(args.device),
        device=args.device,
        threads=args.threads,
    )
    profile = write_profile(measured, args.output)
    for tp in profile.degrees():
        for kind in ("no_cache", "recompute", "cache"):
            for context in profile.contexts(tp, kind) or [None]:
                points = ", ".join(
                    f"{t}:{s * 1e3:.2f}ms" for t, s in profile.points(tp, kind, context)
                )
                at = f" @{context}" if context is not None else ""
                print(f"tp={tp} {kind:>9}{at}: {points}")
    print(f"wrote {args.output}")
    return 0
