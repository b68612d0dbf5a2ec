"""Loading a checkpoint's tokenizer from its directory, never running repository code.

A tokenizer config naming a built-in transformers class loads through that class; one
naming none loads through `AutoTokenizer` (which reads `config.json` to choose, and warns
on a model type transformers does not know, such as `llada`). Dream's
`tokenizer_config.json` names its own class (`DreamTokenizer`, shipped as remote code); it
is Qwen2's byte-level BPE, so it loads as `PreTrainedTokenizerFast` from `tokenizer.json`
or as transformers' `Qwen2Tokenizer` from `vocab.json` + `merges.txt`, with the special
tokens of the config files.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .checkpoint import CONFIG_FILE, read_json
from .errors import CheckpointError

TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
BPE_FILES = ("vocab.json", "merges.txt")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of checkpoint directory `path`, with `mask_token` and `pad_token` set
    from `config.json` where the tokenizer files leave them out."""
    directory = Path(path)
    config_file = directory / TOKENIZER_CONFIG
    settings = read_json(config_file) if config_file.is_file() else {}
    if not isinstance(settings, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")
    if _names_custom_class(settings):
        tokenizer = _load_builtin_equivalent(directory, settings)
    elif config_file.is_file() or (directory / TOKENIZER_JSON).is_file():
        named = settings.get("tokenizer_class")
        loader = getattr(transformers, named) if named else AutoTokenizer
        try:
            tokenizer = loader.from_pretrained(
                directory, trust_remote_code=False, local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{config_file}: cannot load tokenizer ({exc})") from exc
    else:
        raise CheckpointError(
            f"{directory / TOKENIZER_JSON}: no tokenizer files ({TOKENIZER_JSON} or "
            f"{TOKENIZER_CONFIG}) in {directory}"
        )
    _complete_special_tokens(tokenizer, directory)
    return tokenizer


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` for a list of ints, without the
    public method's input conversion (`to_py_obj` walks every id and costs five times the
    decode itself, on the serving loop for every streamed block); the rest of the decode
    (special tokens, clean-up) is the tokenizer's own."""
    return functools.partial(tokenizer._decode, skip_special_tokens=True)


def write_tokenizer_config(
    directory: Path, specials: Mapping[str, int], roles: Mapping[str, str], **settings: Any
) -> None:
    """Writes `tokenizer_config.json` (the special tokens as `added_tokens_decoder`, the
    roles, `settings`) and `special_tokens_map.json` (the roles), as released checkpoints
    lay them out."""
    decoder = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in specials.items()
    }
    config = {"added_tokens_decoder": decoder, **settings, **roles}
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(dict(roles), indent=2) + "\n")


def _names_custom_class(settings: dict[str, Any]) -> bool:
    if "AutoTokenizer" in (settings.get("auto_map") or {}):
        return True
    name = settings.get("tokenizer_class")
    return bool(name) and not hasattr(transformers, name)


def _load_builtin_equivalent(directory: Path, settings: dict[str, Any]) -> PreTrainedTokenizerBase:
    if (directory / TOKENIZER_JSON).is_file():
        return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    if all((directory / name).is_file() for name in BPE_FILES):
        return transformers.Qwen2Tokenizer.from_pretrained(directory, local_files_only=True)
    raise CheckpointError(
        f"{directory / TOKENIZER_CONFIG}: names custom tokenizer class "
        f"{settings.get('tokenizer_class')!r}, and neither {TOKENIZER_JSON} nor "
        f"{' + '.join(BPE_FILES)} is there to load it without running its code"
    )


def _complete_special_tokens(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        return
    config = read_json(config_file)
    for role in ("mask", "pad"):
        token_id = config.get(f"{role}_token_id")
        if getattr(tokenizer, f"{role}_token") is None and isinstance(token_id, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


class UnrepresentableTextError(ValueError):
    """A prompt is empty or holds text the model's tokenizer maps to its unknown token."""


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Prompt ids without special tokens; text the tokenizer cannot represent is an error
    rather than a silent unknown token the model was never trained on."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids:
        raise UnrepresentableTextError(f"the model's tokenizer cannot represent part of {text!r}")
    if not ids:
        raise UnrepresentableTextError("the prompt is empty")
    return ids
