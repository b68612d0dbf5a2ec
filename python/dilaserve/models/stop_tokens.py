"""The tokens that end an answer, as the released checkpoints declare them.

`config.json` names one EOS, but an instruct model ends its turn with another token:
LLaDA-8B-Instruct with `<|eot_id|>`, Dream-v0-Instruct with `<|im_end|>`. Their
`generation_config.json` lists the ids generation stops at (`eos_token_id`, an int or a
list), and the tokenizer config names the end-of-turn token; the union is the stop set.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import ModelConfig
from .errors import CheckpointError

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
#: End-of-turn tokens of the chat templates of the supported families.
END_OF_TURN = ("<|eot_id|>", "<|im_end|>")


def read_stop_token_ids(directory: Path, config: ModelConfig) -> tuple[int, ...]:
    """Sorted stop ids of the checkpoint in `directory` (empty when it declares none)."""
    stops = set() if config.eos_token_id is None else {config.eos_token_id}
    stops |= _generation_eos(directory / GENERATION_CONFIG)
    stops |= _end_of_turn(directory / TOKENIZER_CONFIG)
    return tuple(sorted(t for t in stops if 0 <= t < config.vocab_size))


def _generation_eos(path: Path) -> set[int]:
    raw = _read(path).get("eos_token_id")
    ids = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(t, int) for t in ids if t is not None):
        raise CheckpointError(f"{path}: eos_token_id must be an id or a list of ids, got {raw!r}")
    return {t for t in ids if t is not None}


def _end_of_turn(path: Path) -> set[int]:
    decoder = _read(path).get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        return set()
    return {
        int(token_id)
        for token_id, entry in decoder.items()
        if isinstance(entry, dict) and entry.get("content") in END_OF_TURN
    }


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return raw if isinstance(raw, dict) else {}
