"""`dilaserve train-tiny`: train an embedded model (dilaserve-tiny, dilaserve-tiny-moe)
from scratch."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from dilaserve.tiny import MODEL_NAME, MOE_MODEL_NAME
from dilaserve.tiny.train import TINY_MOE, TrainConfig, Trainer

#: Each embedded model's run.
RUNS = {MODEL_NAME: TrainConfig(), MOE_MODEL_NAME: TINY_MOE}

# Settings exposed as flags; the defaults are those of the shipped model's run.
_FLAGS = (
    "seed",
    "steps",
    "batch_tokens",
    "lr",
    "warmup_steps",
    "d_model",
    "n_layers",
    "n_heads",
    "mlp_hidden_size",
    "threads",
    "save_every",
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-tiny",
        help="train an embedded model (masked diffusion on the task suite)",
        description=(
            "Train dilaserve-tiny (LLaDA format) or dilaserve-tiny-moe (LLaDA2.x format, block "
            "diffusion) with the masked-diffusion objective on the generated task suite. "
            "Deterministic for a seed; saves a resumable state and an HF-format checkpoint "
            "(OUT/checkpoint) every --save-every steps."
        ),
    )
    p.add_argument(
        "--model", choices=sorted(RUNS), default=MODEL_NAME, help="which embedded model's run"
    )
    p.add_argument("--out", required=True, help="run directory (log, state, checkpoint)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        help="bf16 autocast (--no-bf16: float32); default: the model's run",
    )
    types = {f.name: f.type for f in fields(TrainConfig)}
    for name in _FLAGS:
        kind = float if types[name] in (float, "float") else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help="default: the model's run")
    p.set_defaults(run=run)


def run_config(args: argparse.Namespace) -> TrainConfig:
    """The chosen model's run with the settings given as flags."""
    chosen = {
        name: getattr(args, name) for name in (*_FLAGS, "bf16") if getattr(args, name) is not None
    }
    cfg = replace(RUNS[args.model], **chosen)
    if cfg.steps <= 0 or cfg.batch_tokens <= 0 or cfg.threads <= 0:
        raise ValueError("--steps, --batch-tokens and --threads must be positive")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    trainer = Trainer(cfg, args.out)
    if args.resume and trainer.resume():
        print(f"resuming at step {trainer.step}")
    elif (trainer.out_dir / Trainer.STATE_FILE).exists():
        raise ValueError(f"{args.out} already holds a run; pass --resume or another --out")
    trainer.run()
    print(f"trained {cfg.steps} steps; checkpoint in {trainer.out_dir / 'checkpoint'}")
    return 0
