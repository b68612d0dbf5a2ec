"""Model definitions (LLaDA, Dream) and HF-format checkpoint loading.

`load_model(path, dtype, device)` reads a released checkpoint directory unmodified (with a
tensor-parallel group: only this rank's slices); every model implements the worker's
forward contract (`DiffusionLM.forward`).
"""

from .checkpoint import FAMILIES, load_model, read_config, save_checkpoint
from .config import Family, ModelConfig
from .dream import DREAM
from .errors import CheckpointError
from .llada import LLADA
from .model import CacheAccessMode, DiffusionLM
from .parallel import (
    Collective,
    Shard,
    UnsupportedDegreeError,
    allowed_degrees,
    check_degree,
)
from .tokenizer import UnrepresentableTextError, encode_prompt, load_tokenizer, text_decoder

__all__ = [
    "DREAM",
    "FAMILIES",
    "LLADA",
    "CacheAccessMode",
    "CheckpointError",
    "Collective",
    "DiffusionLM",
    "Family",
    "ModelConfig",
    "Shard",
    "UnrepresentableTextError",
    "UnsupportedDegreeError",
    "allowed_degrees",
    "check_degree",
    "encode_prompt",
    "load_model",
    "load_tokenizer",
    "read_config",
    "save_checkpoint",
    "text_decoder",
]
