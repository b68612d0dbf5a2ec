"""The LLaDA2.x family (inclusionAI/LLaDA2.0-mini, -flash, 2.1): config keys and tensor
names of its checkpoints (`model_type` `llada2_moe`).

A block diffusion model: attention is block-causal over blocks of absolute positions, so a
finished block's K/V is exact. Its layers are Ling's: a fused `query_key_value`
projection, per-head QK RMSNorm before a partial RoPE, GQA, and a mixture-of-experts MLP
(`moe.py`) after `first_k_dense_replace` dense layers. Unset keys take the defaults of
the release's `LLaDA2MoeConfig` and of its `generate` (mask token, block length).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import (
    Family,
    ModelConfig,
    MoEConfig,
    check_head_groups,
    optional_token,
    reject_unsupported,
    require,
)
from .errors import CheckpointError

#: `generate`'s defaults in the release, for configs that do not name them.
DEFAULT_MASK_TOKEN_ID = 156895
DEFAULT_EOS_TOKEN_ID = 156892
DEFAULT_BLOCK_LENGTH = 32


def block_size_of(raw: Mapping[str, Any], source: Path, default: int) -> int:
    """The block length a block diffusion config names (`block_length` or `block_size`)."""
    value = raw.get("block_length", raw.get("block_size", default))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: block length must be a positive integer, got {value!r}")
    return value


def parse_llada2_config(raw: Mapping[str, Any], source: Path) -> ModelConfig:
    reject_unsupported(
        source,
        hidden_act=(raw.get("hidden_act", "silu"), "silu"),
        rope_scaling=(raw.get("rope_scaling"), None),
        norm_head=(raw.get("norm_head", False), False),
        use_sliding_window=(raw.get("use_sliding_window", False), False),
    )
    hidden = require(raw, "hidden_size", int, source)
    heads = require(raw, "num_attention_heads", int, source)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    check_head_groups(source, heads, kv_heads)
    rotary = int(head_dim * float(raw.get("partial_rotary_factor", 0.5)))
    if rotary <= 0 or rotary % 2 or rotary > head_dim:
        raise CheckpointError(f"{source}: partial rotary covers {rotary} of {head_dim} dims")
    layers = require(raw, "num_hidden_layers", int, source)
    moe = _moe_config(raw, source)
    dense = raw.get("intermediate_size")
    if dense is None and (moe is None or moe.first_dense > 0):
        raise CheckpointError(f"{source}: required key 'intermediate_size' is missing")
    vocab = require(raw, "vocab_size", int, source)
    eos = optional_token(raw, "eos_token_id", source)
    eos = DEFAULT_EOS_TOKEN_ID if eos is None else eos
    pad = optional_token(raw, "pad_token_id", source)
    mask = raw.get("mask_token_id", DEFAULT_MASK_TOKEN_ID)
    return ModelConfig(
        family="llada2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=dense if dense is not None else moe.expert_inner,  # type: ignore[union-attr]
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        mask_token_id=mask,
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else eos,
        logit_shift=0,
        max_position_embeddings=int(raw.get("max_position_embeddings", 16384)),
        embedding_rows=vocab,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("use_qkv_bias", False)),
        linear_bias=False,
        norm_bias=False,
        qk_norm=bool(raw.get("use_qk_norm", True)),
        rotary_dim=rotary,
        block_size=block_size_of(raw, source, DEFAULT_BLOCK_LENGTH),
        fused_qkv=True,
        attn_out_bias=bool(raw.get("use_bias", True)),
        moe=moe,
        raw=dict(raw),
    )


def _moe_config(raw: Mapping[str, Any], source: Path) -> MoEConfig | None:
    experts = raw.get("num_experts", 16)
    if experts is None:
        return None
    top_k = int(raw.get("num_experts_per_tok", 2))
    groups, top_groups = int(raw.get("n_group", 8)), int(raw.get("topk_group", 4))
    inner = raw.get("moe_intermediate_size")
    if inner is None:
        raise CheckpointError(f"{source}: required key 'moe_intermediate_size' is missing")
    if groups <= 0 or experts % groups or not 0 < top_groups <= groups:
        raise CheckpointError(
            f"{source}: {experts} experts cannot form {groups} groups with {top_groups} chosen"
        )
    if not 0 < top_k <= top_groups * (experts // groups):
        raise CheckpointError(f"{source}: cannot route to {top_k} experts per token")
    shared = raw.get("num_shared_experts") or 0
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        n_group=groups,
        topk_group=top_groups,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        expert_inner=int(inner),
        shared_inner=int(inner) * int(shared),
        first_dense=int(raw.get("first_k_dense_replace", 0)),
    )


LLADA2 = Family(
    name="llada2",
    model_types=("llada2_moe",),
    architectures=("LLaDA2MoeModelLM",),
    parse=parse_llada2_config,
    top={"embed": "model.word_embeddings", "norm": "model.norm", "lm_head": "lm_head"},
    block_prefix="model.layers.{}.",
    block={
        "attn_norm": "input_layernorm",
        "attn.qkv": "attention.query_key_value",
        "attn.q_norm": "attention.query_layernorm",
        "attn.k_norm": "attention.key_layernorm",
        "attn.o": "attention.dense",
        "mlp_norm": "post_attention_layernorm",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj",
        "mlp.router": "mlp.gate",
        "mlp.experts.{}.gate": "mlp.experts.{}.gate_proj",
        "mlp.experts.{}.up": "mlp.experts.{}.up_proj",
        "mlp.experts.{}.down": "mlp.experts.{}.down_proj",
        "mlp.shared.gate": "mlp.shared_experts.gate_proj",
        "mlp.shared.up": "mlp.shared_experts.up_proj",
        "mlp.shared.down": "mlp.shared_experts.down_proj",
    },
)
