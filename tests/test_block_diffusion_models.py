"""Block diffusion families against independent reference forwards written from the
public implementations (the HF release's `modeling_llada2_moe.py`, SDAR's
`modeling_sdar.py`): eager attention with
an additive block-causal mask over the whole sequence, experts run token by token. They
read the saved safetensors by the checkpoint's own names, so a mis-mapped tensor fails."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from dilaserve.models import load_model
from dilaserve.models.checkpoint import read_config
from dilaserve.models.errors import CheckpointError
from dilaserve.models.testing import write_tiny_checkpoint

BLOCK = 4


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def partial_rope(x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float):
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]  # broadcast over heads: x is [h, n, d]
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def block_mask(n: int, block: int) -> torch.Tensor:
    """The release's additive mask: log of a block lower-triangular 0/1 matrix."""
    blocks = math.ceil(n / block)
    tril = torch.tril(torch.ones(blocks, blocks))
    full = tril.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :n]
    return full.log()


def swiglu(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = x @ w[f"{prefix}.gate_proj.weight"].T
    up = x @ w[f"{prefix}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


def llada2_moe_block(x: torch.Tensor, w: dict, prefix: str, cfg: dict) -> torch.Tensor:
    """`LLaDA2MoeSparseMoeBlock` at inference, one token at a time."""
    experts, groups = cfg["num_experts"], cfg["n_group"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ w[f"{prefix}.gate.weight"].T
        scores = torch.sigmoid(logits)
        routing = scores + w[f"{prefix}.gate.expert_bias"]
        group_scores = routing.view(groups, -1).topk(2, dim=-1)[0].sum(-1)
        chosen_groups = set(group_scores.topk(cfg["topk_group"])[1].tolist())
        allowed = torch.tensor([e // (experts // groups) in chosen_groups for e in range(experts)])
        picked = routing.masked_fill(~allowed, float("-inf")).topk(cfg["num_experts_per_tok"])[1]
        weights = scores[picked] / (scores[picked].sum() + 1e-20) * cfg["routed_scaling_factor"]
        for e, weight in zip(picked.tolist(), weights, strict=True):
            out[t] += weight * swiglu(x[t], w, f"{prefix}.experts.{e}")
    if cfg.get("num_shared_experts"):
        out = out + swiglu(x, w, f"{prefix}.shared_experts")
    return out


def llada2_reference(directory, ids: list[int], block: int) -> torch.Tensor:
    """`LLaDA2MoeModelLM.forward` over the whole sequence with the block-causal mask."""
    cfg = read_config(directory)[1].raw
    w = load_file(str(directory / "model.safetensors"))
    eps, heads = cfg["rms_norm_eps"], cfg["num_attention_heads"]
    kv, d = cfg["num_key_value_heads"], cfg["head_dim"]
    rope_dim = int(d * cfg["partial_rotary_factor"])
    n = len(ids)
    positions = torch.arange(n)
    mask = block_mask(n, block)
    x = w["model.word_embeddings.weight"][torch.tensor(ids)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        h = rms(x, w[f"{p}.input_layernorm.weight"], eps)
        qkv = (h @ w[f"{p}.attention.query_key_value.weight"].T).view(n, heads + 2 * kv, d)
        q, k, v = (t.transpose(0, 1) for t in qkv.split([heads, kv, kv], dim=1))
        q = rms(q, w[f"{p}.attention.query_layernorm.weight"], eps)
        k = rms(k, w[f"{p}.attention.key_layernorm.weight"], eps)
        q = partial_rope(q, positions, rope_dim, cfg["rope_theta"])
        k = partial_rope(k, positions, rope_dim, cfg["rope_theta"])
        k = k.repeat_interleave(heads // kv, dim=0)
        v = v.repeat_interleave(heads // kv, dim=0)
        scores = q @ k.transpose(1, 2) * d**-0.5 + mask
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, heads * d)
        x = x + attn @ w[f"{p}.attention.dense.weight"].T
        h = rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        if layer < cfg["first_k_dense_replace"]:
            x = x + swiglu(h, w, f"{p}.mlp")
        else:
            x = x + llada2_moe_block(h, w, f"{p}.mlp", cfg)
    x = rms(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


def test_llada2_matches_the_reference_forward_over_a_prompt_and_two_blocks(tmp_path):
    directory = write_tiny_checkpoint(tmp_path, "llada2", block_length=BLOCK)
    model = load_model(directory)
    assert model.config.block_size == BLOCK and model.config.moe is not None
    mask = model.config.mask_token_id
    # A prompt whose last block is partial, then two blocks: one decoded, one all masks.
    ids = [5, 17, 250, 33, 91, 8, 64, 120, 77, 3, mask, 200, mask, mask, mask, mask]
    expected = llada2_reference(directory, ids, BLOCK)
    n = len(ids)
    got = model(torch.tensor([ids]), torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))
    assert (got[0] - expected).abs().max().item() <= 1e-4
    # The mask matters: without it (a bidirectional forward) the prompt's logits move.
    free = llada2_reference(directory, ids, n)
    assert (free[:8] - expected[:8]).abs().max().item() > 1e-2


def sdar_reference(directory, ids: list[int], block: int) -> torch.Tensor:
    """`SDARForCausalLM.forward` over the whole sequence with the block-causal mask."""
    cfg = read_config(directory)[1].raw
    w = load_file(str(directory / "model.safetensors"))
    eps, heads = cfg["rms_norm_eps"], cfg["num_attention_heads"]
    kv, d = cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(ids)
    positions = torch.arange(n)
    mask = block_mask(n, block)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        h = rms(x, w[f"{p}.input_layernorm.weight"], eps)

        def heads_of(name: str, count: int, h=h, p=p) -> torch.Tensor:
            return (h @ w[f"{p}.self_attn.{name}.weight"].T).view(n, count, d).transpose(0, 1)

        q = rms(heads_of("q_proj", heads), w[f"{p}.self_attn.q_norm.weight"], eps)
        k = rms(heads_of("k_proj", kv), w[f"{p}.self_attn.k_norm.weight"], eps)
        v = heads_of("v_proj", kv)
        q = partial_rope(q, positions, d, cfg["rope_theta"])
        k = partial_rope(k, positions, d, cfg["rope_theta"]).repeat_interleave(heads // kv, 0)
        v = v.repeat_interleave(heads // kv, dim=0)
        scores = q @ k.transpose(1, 2) * d**-0.5 + mask
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, heads * d)
        x = x + attn @ w[f"{p}.self_attn.o_proj.weight"].T
        x = x + swiglu(rms(x, w[f"{p}.post_attention_layernorm.weight"], eps), w, f"{p}.mlp")
    x = rms(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


def test_sdar_matches_the_reference_forward_over_a_prompt_and_two_blocks(tmp_path):
    directory = write_tiny_checkpoint(tmp_path, "sdar")
    model = load_model(directory)
    config = model.config
    assert config.block_size == BLOCK and config.head_dim * config.num_heads != config.hidden_size
    mask = config.mask_token_id
    ids = [5, 17, 250, 33, 91, 8, 64, 120, 77, 3, mask, 200, mask, mask, mask, mask]
    expected = sdar_reference(directory, ids, BLOCK)
    n = len(ids)
    got = model(torch.tensor([ids]), torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))
    assert (got[0] - expected).abs().max().item() <= 1e-4


def test_llada2_config_rejects_what_it_does_not_implement(tmp_path):
    with pytest.raises(CheckpointError, match="norm_head"):
        write_tiny_checkpoint(tmp_path / "a", "llada2", norm_head=True)
    with pytest.raises(CheckpointError, match="groups"):
        write_tiny_checkpoint(tmp_path / "b", "llada2", n_group=3)
