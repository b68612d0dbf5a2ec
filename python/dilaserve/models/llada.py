"""The LLaDA family (GSAI-ML/LLaDA-8B-*): config keys and tensor names of its checkpoints.

LLaDA is an OLMo-derived LLaMA-style encoder: RMSNorm, RoPE, SwiGLU (`ff_proj` is the
gate, `up_proj` the up projection, `ff_out` the down projection), no causal mask. Unset
keys take the defaults of LLaDA's own `ModelConfig`, so an unusual config is rejected
rather than silently read as LLaDA-8B.
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
from .errors import CheckpointError


def parse_llada_config(raw: Mapping[str, Any], source: Path) -> ModelConfig:
    reject_unsupported(
        source,
        block_type=(raw.get("block_type", "sequential"), "llama"),
        layer_norm_type=(raw.get("layer_norm_type", "default"), "rms"),
        activation_type=(raw.get("activation_type", "swiglu"), "silu"),
        rope=(raw.get("rope", False), True),
        alibi=(raw.get("alibi", False), False),
        attention_layer_norm=(raw.get("attention_layer_norm", False), False),
        layer_norm_with_affine=(raw.get("layer_norm_with_affine", True), True),
        block_group_size=(raw.get("block_group_size", 1), 1),
        clip_qkv=(raw.get("clip_qkv"), None),
    )
    hidden = require(raw, "d_model", int, source)
    heads = require(raw, "n_heads", int, source)
    kv_heads = raw.get("n_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if raw.get("multi_query_attention") else heads
    check_heads(source, hidden, heads, kv_heads)
    vocab = require(raw, "vocab_size", int, source)
    embedding_rows = raw.get("embedding_size") or vocab
    if embedding_rows < vocab:
        raise CheckpointError(f"{source}: embedding_size {embedding_rows} < vocab_size {vocab}")
    include_bias = bool(raw.get("include_bias", True))
    norm_bias = raw.get("bias_for_layer_norm")
    eos = optional_token(raw, "eos_token_id", source)
    pad = optional_token(raw, "pad_token_id", source)
    return ModelConfig(
        family="llada",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=raw.get("mlp_hidden_size") or raw.get("mlp_ratio", 4) * hidden,
        num_layers=require(raw, "n_layers", int, source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        mask_token_id=require(raw, "mask_token_id", int, source),
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else (eos if eos is not None else 0),
        logit_shift=0,
        max_position_embeddings=int(raw.get("max_sequence_length", 1024)),
        embedding_rows=embedding_rows,
        tie_word_embeddings=bool(raw.get("weight_tying", True)),
        qkv_bias=include_bias or bool(raw.get("include_qkv_bias", False)),
        linear_bias=include_bias,
        norm_bias=include_bias if norm_bias is None else bool(norm_bias),
        input_scale=hidden**0.5 if raw.get("input_emb_norm", False) else 1.0,
        logit_scale=hidden**-0.5 if raw.get("scale_logits", False) else 1.0,
        raw=dict(raw),
    )


LLADA = Family(
    name="llada",
    model_types=("llada",),
    architectures=("LLaDAModelLM",),
    parse=parse_llada_config,
    top={
        "embed": "model.transformer.wte",
        "norm": "model.transformer.ln_f",
        "lm_head": "model.transformer.ff_out",
    },
    block_prefix="model.transformer.blocks.{}.",
    block={
        "attn_norm": "attn_norm",
        "attn.q": "q_proj",
        "attn.k": "k_proj",
        "attn.v": "v_proj",
        "attn.o": "attn_out",
        "mlp_norm": "ff_norm",
        "mlp.gate": "ff_proj",
        "mlp.up": "up_proj",
        "mlp.down": "ff_out",
    },
)
