"""dilaserve-tiny: the small LLaDA-format diffusion LM shipped inside the package.

It is the default model of `dilaserve generate`, `eval` and `serve`: trained by
`dilaserve train-tiny` on a generated task suite (`tasks`) with checkable answers, so its
speed-quality trade-off over the confidence threshold can be measured (`evaluate`).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

MODEL_NAME = "dilaserve-tiny"
#: The embedded block diffusion model (LLaDA2.x format, MoE).
MOE_MODEL_NAME = "dilaserve-tiny-moe"


def default_model_dir() -> Path:
    """Directory of the shipped checkpoint (config.json, model.safetensors, tokenizer)."""
    return Path(str(files("dilaserve") / "assets" / MODEL_NAME))
