"""The SDAR family (JetAstra/SDAR-*-Chat): config keys and tensor names of its checkpoints
(`model_type` `sdar`).

A block diffusion model on Qwen3's layers: separate Q/K/V projections without bias,
per-head QK RMSNorm before a full RoPE, GQA with an explicit head width, SwiGLU, and
block-causal attention over blocks of absolute positions (`block_size` in config.json,
4 in the releases). Unset keys take the defaults of the release's `SDARConfig` and of its
`generate.py` (mask token `<|MASK|>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import (
    Family,
    ModelConfig,
    check_head_groups,
    optional_token,
    reject_unsupported,
    require,
)
from .llada2 import block_size_of

#: `generate.py`'s defaults in the release, for configs that do not name them.
DEFAULT_MASK_TOKEN_ID = 151669
DEFAULT_BLOCK_LENGTH = 4


def parse_sdar_config(raw: Mapping[str, Any], source: Path) -> ModelConfig:
    reject_unsupported(
        source,
        hidden_act=(raw.get("hidden_act", "silu"), "silu"),
        rope_scaling=(raw.get("rope_scaling"), None),
        use_sliding_window=(raw.get("use_sliding_window", False), False),
    )
    hidden = require(raw, "hidden_size", int, source)
    heads = require(raw, "num_attention_heads", int, source)
    kv_heads = raw.get("num_key_value_heads") or heads
    check_head_groups(source, heads, kv_heads)
    vocab = require(raw, "vocab_size", int, source)
    eos = optional_token(raw, "eos_token_id", source)
    pad = optional_token(raw, "pad_token_id", source)
    return ModelConfig(
        family="sdar",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=require(raw, "intermediate_size", int, source),
        num_layers=require(raw, "num_hidden_layers", int, source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        mask_token_id=raw.get("mask_token_id", DEFAULT_MASK_TOKEN_ID),
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else (eos if eos is not None else 0),
        logit_shift=0,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        embedding_rows=vocab,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        linear_bias=False,
        norm_bias=False,
        qk_norm=True,
        block_size=block_size_of(raw, source, DEFAULT_BLOCK_LENGTH),
        attn_out_bias=bool(raw.get("attention_bias", False)),
        raw=dict(raw),
    )


SDAR = Family(
    name="sdar",
    model_types=("sdar",),
    architectures=("SDARForCausalLM",),
    parse=parse_sdar_config,
    top={"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"},
    block_prefix="model.layers.{}.",
    block={
        "attn_norm": "input_layernorm",
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
        "attn.o": "self_attn.o_proj",
        "mlp_norm": "post_attention_layernorm",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj",
    },
)
