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


EMBEDDED_MODELS = (MODEL_NAME, MOE_MODEL_NAME)


def default_model_dir(name: str = MODEL_NAME) -> Path:
    """Directory of a shipped checkpoint (config.json, model.safetensors, tokenizer)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"no embedded model {name!r}; the package ships {EMBEDDED_MODELS}")
    return Path(str(files("dilaserve") / "assets" / name))


def model_path(model: str | None) -> str:
    """The checkpoint directory `--model` names: an existing directory, else an embedded
    model's name (dilaserve-tiny when none is given)."""
    if model is None or (model in EMBEDDED_MODELS and not Path(model).exists()):
        return str(default_model_dir(model or MODEL_NAME))
    return model
