"""Building blocks shared by every family: RMSNorm, RoPE, SwiGLU, and bidirectional
attention over packed rows, reading and writing the KV pool as a forward asks. Given a
tensor-parallel group, attention holds the rank's heads and the MLP its slice of the inner
width, each ending in one all-reduce (`parallel.RowParallelLinear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .moe import MixtureOfExperts
from .packed import PoolAccess, attend
from .parallel import Collective, RowParallelLinear


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the model dtype, as LLaDA and Qwen2 both do."""

    def __init__(self, size: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        out = self.weight * normed
        return out if self.bias is None else out + self.bias


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[T, 1, head_dim]` for the absolute `positions` `[T]` of packed
    tokens."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (exponents / head_dim)
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates `[T, heads, head_dim]` in float32 (half-split pairing, as HF Llama/Qwen2);
    with tables narrower than the head, only its leading dimensions (partial rotary)."""
    dim = cos.shape[-1]
    xf = x[..., :dim].float()
    half = dim // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = (xf * cos + rotated * sin).to(x.dtype)
    return out if dim == x.shape[-1] else torch.cat((out, x[..., dim:]), dim=-1)


def output_projection(
    in_features: int, out_features: int, bias: bool, group: Collective | None
) -> nn.Module:
    """The layer that maps a split activation back to the residual stream: a plain linear
    layer on one rank, row-parallel (one all-reduce) over several."""
    if group is None or group.world_size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, group)


class SwiGLU(nn.Module):
    """Gate and up are column-parallel (`inner` is this rank's slice), down row-parallel."""

    def __init__(
        self, hidden: int, inner: int, bias: bool, group: Collective | None = None
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=bias)
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.down = output_projection(inner, hidden, bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    """Attention over this rank's heads: query heads and KV heads are split into contiguous
    ranges, so a rank's query heads read only its own KV heads (GQA groups never straddle
    ranks when both counts divide by the degree). Bidirectional, or block-causal as the
    forward's masks say."""

    def __init__(self, config: ModelConfig, group: Collective | None = None) -> None:
        super().__init__()
        world = 1 if group is None else group.world_size
        hidden, dim = config.hidden_size, config.head_dim
        self.heads, self.kv_heads = config.num_heads // world, config.num_kv_heads // world
        self.head_dim = dim
        if config.fused_qkv:
            width = (self.heads + 2 * self.kv_heads) * dim
            self.qkv = nn.Linear(hidden, width, bias=config.qkv_bias)
        else:
            self.q = nn.Linear(hidden, self.heads * dim, bias=config.qkv_bias)
            self.k = nn.Linear(hidden, self.kv_heads * dim, bias=config.qkv_bias)
            self.v = nn.Linear(hidden, self.kv_heads * dim, bias=config.qkv_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(dim, config.rms_norm_eps, False)
            self.k_norm = RMSNorm(dim, config.rms_norm_eps, False)
        o_bias = config.linear_bias if config.attn_out_bias is None else config.attn_out_bias
        self.o = output_projection(self.heads * dim, hidden, o_bias, group)

    def _project(self, x: torch.Tensor, part: str) -> torch.Tensor:
        """`[T, heads, head_dim]` queries, keys or values of `x`, keys and queries normed
        when the model norms them."""
        heads = self.heads if part == "q" else self.kv_heads
        if hasattr(self, "qkv"):
            q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
            start = {"q": 0, "k": q_width, "v": q_width + kv_width}[part]
            width = q_width if part == "q" else kv_width
            out = F.linear(
                x,
                self.qkv.weight[start : start + width],
                None if self.qkv.bias is None else self.qkv.bias[start : start + width],
            )
        else:
            out = getattr(self, part)(x)
        out = out.view(x.shape[0], heads, self.head_dim)
        if part != "v" and hasattr(self, "q_norm"):
            out = (self.q_norm if part == "q" else self.k_norm)(out)
        return out

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        lengths: tuple[int, ...],
        layer: int,
        cache: PoolAccess | None,
        keep: torch.Tensor | None = None,
        masks: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`x` `[T, hidden]` packed rows of `lengths` tokens each. With `keep` `[rows, m]`
        (indices into the T tokens), only those tokens query: the output is theirs.
        `masks` are the queries' block-causal masks (`packed.block_causal_masks`)."""
        k = apply_rope(self._project(x, "k"), *rope)
        v = self._project(x, "v")
        q_lengths = None
        if keep is not None:
            picked = keep.reshape(-1)
            x, rope = x[picked], (rope[0][picked], rope[1][picked])
            q_lengths = (keep.shape[1],) * keep.shape[0]
        q = apply_rope(self._project(x, "q"), *rope)
        pool = None
        if cache is not None:
            if cache.slots is not None:
                cache.pool.write(layer, cache.slots, k, v)
            pool = cache.pool.layer(layer)
        reads = shared = None
        if cache is not None:
            reads, shared = cache.reads, cache.shared
        out = attend(q, k, v, lengths, pool, reads, q_lengths, masks, shared)
        return self.o(out.reshape(x.shape[0], self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; the MLP is a
    mixture of experts from the config's first MoE layer on."""

    def __init__(
        self, config: ModelConfig, group: Collective | None = None, index: int = 0
    ) -> None:
        super().__init__()
        world = 1 if group is None else group.world_size
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_bias)
        self.attn = Attention(config, group)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_bias)
        moe = config.moe
        self.mlp: nn.Module
        if moe is not None and index >= moe.first_dense:
            self.mlp = MixtureOfExperts(config.hidden_size, moe, group)
        else:
            inner = config.intermediate_size // world
            self.mlp = SwiGLU(config.hidden_size, inner, config.linear_bias, group)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        lengths: tuple[int, ...],
        layer: int,
        cache: PoolAccess | None,
        keep: torch.Tensor | None = None,
        masks: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """With `keep` (the last layer, when only some tokens' logits are wanted) the
        attention queries, the residual and the MLP run on those tokens only."""
        out = self.attn(self.attn_norm(x), rope, lengths, layer, cache, keep, masks)
        x = (x if keep is None else x[keep.reshape(-1)]) + out
        return x + self.mlp(self.mlp_norm(x))
