"""Model definitions (LLaDA, Dream) and HF-format checkpoint loading.

`load_model(path, dtype, device)` reads a released checkpoint directory unmodified;
every model implements the worker's forward contract (`DiffusionLM.forward`).
"""

from .checkpoint import FAMILIES, load_model, read_config, save_checkpoint
from .config import Family, ModelConfig
from .dream import DREAM
from .errors import CheckpointError
from .llada import LLADA
from .model import CacheAccessMode, DiffusionLM
from .tokenizer import UnrepresentableTextError, encode_prompt, load_tokenizer

__all__ = [
    "DREAM",
    "FAMILIES",
    "LLADA",
    "CacheAccessMode",
    "CheckpointError",
    "DiffusionLM",
    "Family",
    "ModelConfig",
    "UnrepresentableTextError",
    "encode_prompt",
    "load_model",
    "load_tokenizer",
    "read_config",
    "save_checkpoint",
]
