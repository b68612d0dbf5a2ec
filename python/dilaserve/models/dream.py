"""The Dream family (Dream-org/Dream-v0-*): config keys and tensor names of its checkpoints.

Dream is Qwen2 trained as a diffusion model: GQA, bias on the Q/K/V projections only,
RMSNorm, RoPE, SwiGLU, no causal mask. It keeps Qwen2's next-token head, so the logits
for position p come from the hidden state at p - 1 (`logit_shift = 1`). Unset keys take
the defaults of Dream's own `DreamConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import (
    Family,
    ModelConfig,
    check_heads,
    optional_token,
    reject_unsupported,
    require,
)


def parse_dream_config(raw: Mapping[str, Any], source: Path) -> ModelConfig:
    reject_unsupported(
        source,
        hidden_act=(raw.get("hidden_act", "silu"), "silu"),
        rope_scaling=(raw.get("rope_scaling"), None),
        use_sliding_window=(raw.get("use_sliding_window", False), False),
    )
    hidden = require(raw, "hidden_size", int, source)
    heads = require(raw, "num_attention_heads", int, source)
    kv_heads = raw.get("num_key_value_heads") or heads
    check_heads(source, hidden, heads, kv_heads)
    vocab = require(raw, "vocab_size", int, source)
    eos = optional_token(raw, "eos_token_id", source)
    pad = optional_token(raw, "pad_token_id", source)
    return ModelConfig(
        family="dream",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=require(raw, "intermediate_size", int, source),
        num_layers=require(raw, "num_hidden_layers", int, source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        mask_token_id=require(raw, "mask_token_id", int, source),
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else (eos if eos is not None else 0),
        logit_shift=1,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        embedding_rows=vocab,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True,
        linear_bias=False,
        norm_bias=False,
        raw=dict(raw),
    )


DREAM = Family(
    name="dream",
    model_types=("dream",),
    architectures=("DreamModel",),
    parse=parse_dream_config,
    top={"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"},
    block_prefix="model.layers.{}.",
    block={
        "attn_norm": "input_layernorm",
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.o": "self_attn.o_proj",
        "mlp_norm": "post_attention_layernorm",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj",
    },
)
