"""Arguments shared by the subcommands that load a model."""

from __future__ import annotations

import argparse

import torch

from dilaserve.models import load_model
from dilaserve.tiny import MODEL_NAME, MOE_MODEL_NAME, model_path


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model (default: the embedded dilaserve-tiny), --dtype and --device."""
    p.add_argument(
        "--model",
        default=None,
        help=f"HF-format checkpoint directory, or {MOE_MODEL_NAME} (default: {MODEL_NAME})",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )


def model_dir(args: argparse.Namespace) -> str:
    """The checkpoint directory the arguments name: --model, else the embedded model."""
    return model_path(args.model)


def default_dtype(device: str) -> str:
    """bfloat16 on CUDA (what the released checkpoints are and GPUs run fastest), float32
    on the CPU (where bfloat16 matmuls are slower, not faster)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def load_model_from_args(args: argparse.Namespace) -> torch.nn.Module:
    dtype = args.dtype or default_dtype(args.device)
    return load_model(model_dir(args), dtype=dtype, device=args.device)
