"""Arguments shared by the subcommands that load a model."""

from __future__ import annotations

import argparse

import torch

from dilaserve.models import load_model


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF-format checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )


def load_model_from_args(args: argparse.Namespace) -> torch.nn.Module:
    return load_model(args.model, dtype=args.dtype, device=args.device)
