"""Tiny random checkpoints in the exact on-disk format of the released models.

Tests and benchmarks use them in place of the 7-8B checkpoints: `config.json` with the
family's real keys, safetensors under the real tensor names (optionally sharded), and a
byte-level BPE tokenizer laid out as each family ships it (LLaDA: `tokenizer.json` with a
built-in class; Dream: a custom `DreamTokenizer` class over `vocab.json` + `merges.txt`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .checkpoint import CONFIG_FILE, FAMILIES, save_checkpoint
from .model import DiffusionLM
from .tokenizer import write_tokenizer_config

TokenizerLayout = Literal["json", "bpe_files"]

# A few merges so the vocabulary is real BPE, not only single bytes.
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("Ġ", "a")]
TINY_VOCAB = 288

SPECIAL_TOKENS = {
    "llada": [
        "<|startoftext|>",
        "<|endoftext|>",
        "<|mdm_mask|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "dream": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"],
    "llada2": ["<|startoftext|>", "<|endoftext|>", "<|role_end|>", "<|mask|>", "<role>", "</role>"],
    "sdar": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"],
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, as byte-level BPE uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = (b for b in range(256) if b not in printable)
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return mapping


def bpe_vocab() -> dict[str, int]:
    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    return vocab


def special_ids(family: str) -> dict[str, int]:
    base = len(bpe_vocab())
    return {token: base + i for i, token in enumerate(SPECIAL_TOKENS[family])}


def tiny_config(family: str) -> dict[str, Any]:
    """A tiny config.json for `family`, with the keys of the released checkpoint."""
    ids = special_ids(family)
    if family == "llada":
        eos = ids["<|endoftext|>"]
        return {
            "activation_type": "silu",
            "alibi": False,
            "alibi_bias_max": 8.0,
            "architectures": ["LLaDAModelLM"],
            "attention_dropout": 0.0,
            "attention_layer_norm": False,
            "attention_layer_norm_with_affine": True,
            "auto_map": {
                "AutoConfig": "configuration_llada.LLaDAConfig",
                "AutoModel": "modeling_llada.LLaDAModelLM",
                "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            },
            "bias_for_layer_norm": False,
            "block_group_size": 1,
            "block_type": "llama",
            "d_model": 64,
            "embedding_dropout": 0.0,
            "embedding_size": TINY_VOCAB,
            "eos_token_id": eos,
            "flash_attention": False,
            "include_bias": False,
            "include_qkv_bias": False,
            "init_cutoff_factor": None,
            "init_device": "meta",
            "init_fn": "mitchell",
            "init_std": 0.02,
            "input_emb_norm": False,
            "layer_norm_type": "rms",
            "layer_norm_with_affine": True,
            "mask_token_id": ids["<|mdm_mask|>"],
            "max_sequence_length": 1024,
            "mlp_hidden_size": 128,
            "mlp_ratio": 4,
            "model_type": "llada",
            "multi_query_attention": None,
            "n_heads": 4,
            "n_kv_heads": 4,
            "n_layers": 2,
            "pad_token_id": eos,
            "precision": "amp_bf16",
            "residual_dropout": 0.0,
            "rms_norm_eps": 1e-05,
            "rope": True,
            "rope_full_precision": True,
            "rope_theta": 500000.0,
            "scale_logits": False,
            "transformers_version": "4.46.3",
            "use_cache": False,
            "vocab_size": TINY_VOCAB,
            "weight_tying": False,
        }
    if family == "dream":
        eos = ids["<|endoftext|>"]
        return {
            "architectures": ["DreamModel"],
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_dream.DreamConfig",
                "AutoModel": "modeling_dream.DreamModel",
            },
            "bos_token_id": ids["<|beginoftext|>"],
            "eos_token_id": eos,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "mask_token_id": ids["<|mask|>"],
            "max_position_embeddings": 1024,
            "max_window_layers": 2,
            "model_type": "Dream",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "pad_token_id": eos,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "transformers_version": "4.46.2",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": TINY_VOCAB,
        }
    if family == "llada2":
        eos = ids["<|endoftext|>"]
        return {
            "architectures": ["LLaDA2MoeModelLM"],
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
            },
            "embedding_dropout": 0.0,
            "eos_token_id": eos,
            "first_k_dense_replace": 1,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "mask_token_id": ids["<|mask|>"],
            "max_position_embeddings": 1024,
            "max_window_layers": 2,
            "model_type": "llada2_moe",
            "moe_intermediate_size": 32,
            "n_group": 4,
            "norm_head": False,
            "num_attention_heads": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "num_shared_experts": 1,
            "output_dropout": 0.0,
            "output_router_logits": False,
            "pad_token_id": eos,
            "partial_rotary_factor": 0.5,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 600000,
            "routed_scaling_factor": 2.5,
            "tie_word_embeddings": False,
            "topk_group": 2,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.52.3",
            "use_bias": False,
            "use_cache": False,
            "use_qk_norm": True,
            "use_qkv_bias": False,
            "use_rmsnorm": True,
            "vocab_size": TINY_VOCAB,
        }
    if family == "sdar":
        return {
            "architectures": ["SDARForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_sdar.SDARConfig",
                "AutoModel": "modeling_sdar.SDARModel",
                "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
            },
            "block_size": 4,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "head_dim": 24,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "mask_token_id": ids["<|MASK|>"],
            "max_position_embeddings": 1024,
            "max_window_layers": 2,
            "model_type": "sdar",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.52.4",
            "use_cache": False,
            "use_sliding_window": False,
            "vocab_size": TINY_VOCAB,
        }
    raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")


def write_tiny_checkpoint(
    path: str | Path,
    family: str,
    *,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    tokenizer_layout: TokenizerLayout | None = None,
    **overrides: Any,
) -> Path:
    """Writes a random `family` checkpoint plus tokenizer to directory `path`.

    `overrides` replace config.json keys (the family's own names, e.g. `n_layers=3` for
    LLaDA, `num_key_value_heads=1` for Dream). The tokenizer layout defaults to the one
    the family ships. Same seed, same weights.
    """
    directory = Path(path)
    raw = {**tiny_config(family), **overrides}
    config = FAMILIES[family].parse(raw, directory / CONFIG_FILE)
    model = DiffusionLM(config)
    randomize(model, seed)
    save_checkpoint(model, directory, max_shard_bytes=max_shard_bytes)
    layout = tokenizer_layout or ("bpe_files" if family == "dream" else "json")
    write_tiny_tokenizer(directory, family, layout)
    return directory


def randomize(model: DiffusionLM, seed: int) -> None:
    """Weights ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2): every
    parameter visibly affects the logits, so a wrongly loaded tensor cannot go unnoticed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif param.dim() == 1:
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)


def write_tiny_tokenizer(directory: Path, family: str, layout: TokenizerLayout) -> None:
    specials = special_ids(family)
    vocab, roles = bpe_vocab(), _special_roles(family)
    settings: dict[str, Any] = {"clean_up_tokenization_spaces": False, "model_max_length": 1024}
    if family == "dream":
        settings |= {
            "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
            "tokenizer_class": "DreamTokenizer",
            "errors": "replace",
            "split_special_tokens": False,
        }
    else:
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_tokenizer_config(directory, specials, roles, **settings)
    if layout == "json":
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(
            [AddedToken(token, special=True, normalized=False) for token in specials]
        )
        tokenizer.save(str(directory / "tokenizer.json"))
    else:
        (directory / "vocab.json").write_text(
            json.dumps(vocab, ensure_ascii=False), encoding="utf-8"
        )
        merges = "".join(f"{left} {right}\n" for left, right in MERGES)
        (directory / "merges.txt").write_text("#version: 0.2\n" + merges, encoding="utf-8")


def _special_roles(family: str) -> dict[str, str]:
    """Token roles as the released tokenizer configs declare them (LLaDA leaves the mask
    token out; `load_tokenizer` takes it from config.json)."""
    if family == "llada":
        return {
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
        }
    if family == "sdar":
        return {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|MASK|>",
        }
    if family == "llada2":
        return {
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
        }
    return {
        "bos_token": "<|beginoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
    }
