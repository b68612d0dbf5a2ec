"""Family-neutral model configuration, and the description of a model family.

A checkpoint's `config.json` uses its family's own keys (LLaDA: `d_model`, `n_heads`, ...;
Dream: `hidden_size`, `num_attention_heads`, ...). Each family parses them into one
`ModelConfig`, which is all the model code sees; the raw dict is kept so that a saved
checkpoint carries the original keys unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a mixture-of-experts model (LLaDA2.x): a sigmoid router whose
    `expert_bias` steers only the choice, `top_k` experts picked within the `topk_group`
    best of `n_group` groups, their weights renormalised and scaled, plus `shared_inner`
    width of always-on shared experts. Layers before `first_dense` are dense."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    expert_inner: int
    shared_inner: int
    first_dense: int


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and special tokens of a loaded model, in one vocabulary for all families."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    mask_token_id: int
    eos_token_id: int | None
    pad_token_id: int
    logit_shift: int
    max_position_embeddings: int
    embedding_rows: int
    tie_word_embeddings: bool
    qkv_bias: bool
    linear_bias: bool
    norm_bias: bool
    input_scale: float = 1.0
    logit_scale: float = 1.0
    #: Per-head RMSNorm of queries and keys before RoPE (Qwen3, LLaDA2.x).
    qk_norm: bool = False
    #: Leading head dimensions RoPE rotates (partial rotary); 0: all of them.
    rotary_dim: int = 0
    #: Block diffusion: attention is block-causal over blocks of this many absolute
    #: positions and decoding goes block by block with an exact KV cache; 0: bidirectional.
    block_size: int = 0
    #: One fused Q/K/V projection (LLaDA2.x's `query_key_value`), heads in that order.
    fused_qkv: bool = False
    #: Bias of the attention's output projection where it differs from `linear_bias`
    #: (LLaDA2.x's `use_bias` covers only that layer).
    attn_out_bias: bool | None = None
    moe: MoEConfig | None = None
    #: Tokens that end an answer: the EOS, the generation config's `eos_token_id`s and the
    #: chat template's end-of-turn token (`stop_tokens.read_stop_token_ids`).
    stop_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Family:
    """How one model family names its config keys and tensors.

    `top` maps our top-level module names (`embed`, `norm`, `lm_head`) and `block` our
    per-layer module names to the checkpoint's; `block_prefix` is formatted with the
    layer index.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    parse: Callable[[Mapping[str, Any], Path], ModelConfig]
    top: Mapping[str, str]
    block_prefix: str
    block: Mapping[str, str]

    def matches(self, raw: Mapping[str, Any]) -> bool:
        model_type = str(raw.get("model_type", "")).lower()
        if model_type:
            return model_type in self.model_types
        return any(arch in self.architectures for arch in raw.get("architectures") or [])

    def checkpoint_name(self, name: str) -> str:
        """Checkpoint tensor name of our parameter `name` (e.g. `layers.3.attn.q.weight`;
        an expert's index is a `{}` in the `block` keys: `mlp.experts.{}.gate`)."""
        module, _, param = name.rpartition(".")
        parts = module.split(".")
        if parts[0] == "layers":
            rest = parts[2:]
            numbers = [p for p in rest if p.isdigit()]
            sub = ".".join("{}" if p.isdigit() else p for p in rest)
            mapped = self.block[sub].format(*numbers)
            return f"{self.block_prefix.format(int(parts[1]))}{mapped}.{param}"
        return f"{self.top[module]}.{param}"


def require(raw: Mapping[str, Any], key: str, kind: type, source: Path) -> Any:
    """`raw[key]` checked to be of `kind` (bool is not accepted as int)."""
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"{source}: required key {key!r} is missing")
    value = raw[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise CheckpointError(f"{source}: key {key!r} must be {kind.__name__}, got {value!r}")
    return value


def optional_token(raw: Mapping[str, Any], key: str, source: Path) -> int | None:
    """A token id that may be absent, or (as some configs write eos) a list of ids."""
    value = raw.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{source}: key {key!r} must be a token id, got {value!r}")
    return value


def reject_unsupported(source: Path, **settings: tuple[Any, Any]) -> None:
    """Fails on any `name=(value, supported)` pair whose value the model does not implement."""
    for name, (value, supported) in settings.items():
        if value != supported:
            raise CheckpointError(
                f"{source}: {name}={value!r} is not supported (only {supported!r})"
            )


def check_heads(source: Path, hidden: int, heads: int, kv_heads: int) -> None:
    """Heads that split the hidden size evenly (the head width is `hidden // heads`)."""
    if heads <= 0 or hidden % heads:
        raise CheckpointError(f"{source}: hidden size {hidden} is not divisible by {heads} heads")
    check_head_groups(source, heads, kv_heads)


def check_head_groups(source: Path, heads: int, kv_heads: int) -> None:
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise CheckpointError(f"{source}: {heads} heads are not a multiple of {kv_heads} KV heads")


def check_token_ids(config: ModelConfig, source: Path) -> None:
    """Special tokens must be ids the model can embed and predict."""
    tokens = {
        "mask_token_id": config.mask_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    for name, value in tokens.items():
        if value is not None and not 0 <= value < config.vocab_size:
            raise CheckpointError(
                f"{source}: {name}={value} is outside the vocabulary [0, {config.vocab_size})"
            )
