"""Models and checkpoints: logits against an independent implementation, cache modes,
batching with padding, dtypes, save/load, tokenizers, and errors naming the bad file."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dilaserve.models import (
    CheckpointError,
    load_model,
    load_tokenizer,
    save_checkpoint,
    text_decoder,
)
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.tiny import default_model_dir
from dilaserve.tiny.tasks import make_problems
from dilaserve.worker.kv_cache import KVCachePool

# ---------------------------------------------------------------------------------------
# Independent reference: the published architectures written out from the checkpoint's
# own tensor names and config keys, float64, one sequence, explicit loops.


def _checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return {name: t.double() for name, t in tensors.items()}


def _rms_norm(x, weight, bias, eps):
    out = torch.stack([row / math.sqrt(float((row * row).mean()) + eps) for row in x]) * weight
    return out if bias is None else out + bias


def _linear(x, tensors, name):
    out = x @ tensors[name + ".weight"].T
    return out + tensors[name + ".bias"] if name + ".bias" in tensors else out


def _rotate(vec, position, theta):
    """RoPE on one head vector: pair (t, t + D/2) turns by position * theta^(-2t/D)."""
    dim = vec.numel()
    out = vec.clone()
    for t in range(dim // 2):
        angle = position * theta ** (-2 * t / dim)
        c, s = math.cos(angle), math.sin(angle)
        out[t] = vec[t] * c - vec[t + dim // 2] * s
        out[t + dim // 2] = vec[t + dim // 2] * c + vec[t] * s
    return out


def _layout(raw):
    if raw["model_type"] == "llada":
        heads = raw["n_heads"]
        prefix = "model.transformer.blocks.{}."
        return {
            "hidden": raw["d_model"],
            "heads": heads,
            "kv_heads": raw.get("n_kv_heads") or heads,
            "layers": raw["n_layers"],
            "eps": raw["rms_norm_eps"],
            "theta": raw["rope_theta"],
            "vocab": raw["vocab_size"],
            "embed": "model.transformer.wte",
            "final_norm": "model.transformer.ln_f",
            "head": "model.transformer.wte" if raw["weight_tying"] else "model.transformer.ff_out",
            "names": {
                k: prefix + v
                for k, v in {
                    "attn_norm": "attn_norm",
                    "q": "q_proj",
                    "k": "k_proj",
                    "v": "v_proj",
                    "o": "attn_out",
                    "ff_norm": "ff_norm",
                    "gate": "ff_proj",
                    "up": "up_proj",
                    "down": "ff_out",
                }.items()
            },
        }
    heads = raw["num_attention_heads"]
    prefix = "model.layers.{}."
    return {
        "hidden": raw["hidden_size"],
        "heads": heads,
        "kv_heads": raw.get("num_key_value_heads") or heads,
        "layers": raw["num_hidden_layers"],
        "eps": raw["rms_norm_eps"],
        "theta": raw["rope_theta"],
        "vocab": raw["vocab_size"],
        "embed": "model.embed_tokens",
        "final_norm": "model.norm",
        "head": "model.embed_tokens" if raw["tie_word_embeddings"] else "lm_head",
        "names": {
            k: prefix + v
            for k, v in {
                "attn_norm": "input_layernorm",
                "q": "self_attn.q_proj",
                "k": "self_attn.k_proj",
                "v": "self_attn.v_proj",
                "o": "self_attn.o_proj",
                "ff_norm": "post_attention_layernorm",
                "gate": "mlp.gate_proj",
                "up": "mlp.up_proj",
                "down": "mlp.down_proj",
            }.items()
        },
    }


def reference_logits(directory: Path, ids: list[int], positions: list[int]) -> torch.Tensor:
    """Logits `[n, vocab]` (unshifted) of one sequence, bidirectional attention."""
    raw = json.loads((directory / "config.json").read_text())
    tensors = _checkpoint_tensors(directory)
    lay = _layout(raw)
    dim = lay["hidden"] // lay["heads"]
    group = lay["heads"] // lay["kv_heads"]

    def norm(x, name):
        return _rms_norm(x, tensors[name + ".weight"], tensors.get(name + ".bias"), lay["eps"])

    x = tensors[lay["embed"] + ".weight"][ids]
    for layer in range(lay["layers"]):
        name = {k: v.format(layer) for k, v in lay["names"].items()}
        h = norm(x, name["attn_norm"])
        q, k, v = (_linear(h, tensors, name[p]) for p in "qkv")
        attended = torch.zeros_like(q)
        for head in range(lay["heads"]):
            kv = head // group
            qs = [
                _rotate(q[i, head * dim : (head + 1) * dim], p, lay["theta"])
                for i, p in enumerate(positions)
            ]
            ks = [
                _rotate(k[j, kv * dim : (kv + 1) * dim], p, lay["theta"])
                for j, p in enumerate(positions)
            ]
            vs = v[:, kv * dim : (kv + 1) * dim]
            for i in range(len(ids)):
                scores = torch.stack([qs[i] @ kj for kj in ks]) / math.sqrt(dim)
                attended[i, head * dim : (head + 1) * dim] = torch.softmax(scores, 0) @ vs
        x = x + _linear(attended, tensors, name["o"])
        h = norm(x, name["ff_norm"])
        gate = _linear(h, tensors, name["gate"])
        x = x + _linear(
            gate * torch.sigmoid(gate) * _linear(h, tensors, name["up"]), tensors, name["down"]
        )
    x = norm(x, lay["final_norm"])
    return (x @ tensors[lay["head"] + ".weight"].T)[:, : lay["vocab"]]


# ---------------------------------------------------------------------------------------
# Fixtures and helpers

VARIANTS = {
    "llada_sharded": ("llada", {"max_shard_bytes": 40_000}),
    # GQA, every bias LLaDA can have, tied head, embedding rows beyond the vocabulary.
    "llada_variant": (
        "llada",
        {
            "n_kv_heads": 2,
            "include_bias": True,
            "bias_for_layer_norm": None,
            "weight_tying": True,
            "embedding_size": 320,
            "n_layers": 3,
        },
    ),
    "dream_sharded": ("dream", {"max_shard_bytes": 40_000}),
    "dream_tied_mqa": ("dream", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}


@pytest.fixture(scope="module")
def checkpoint_dirs(tiny_llada_dir, tiny_dream_dir, tmp_path_factory):
    dirs = {"llada": tiny_llada_dir, "dream": tiny_dream_dir}
    for name, (family, options) in VARIANTS.items():
        dirs[name] = write_tiny_checkpoint(tmp_path_factory.mktemp(name), family, seed=3, **options)
    return dirs


@pytest.fixture(params=["llada", "dream"])
def family_dir(request, tiny_llada_dir, tiny_dream_dir):
    return tiny_llada_dir if request.param == "llada" else tiny_dream_dir


def _tokens(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g)


def _single(model, ids, positions=None):
    n = ids.numel()
    pos = torch.arange(n) if positions is None else positions
    return model(ids[None], pos[None], torch.ones(1, n, dtype=torch.bool))[0]


SLOT = 32  # pool rows per test request


def _pool(model, slots=4):
    c = model.config
    return KVCachePool(
        c.num_layers, slots * SLOT, c.num_kv_heads, c.head_dim, model.dtype, model.device
    )


def _base(*slots):
    """First pool rows of test requests in `slots` (each SLOT rows long)."""
    return torch.tensor([s * SLOT for s in slots])


# ---------------------------------------------------------------------------------------
# Logits


@pytest.mark.parametrize("name", ["llada", "dream", *VARIANTS])
def test_logits_equal_independent_implementation(checkpoint_dirs, name):
    directory = checkpoint_dirs[name]
    model = load_model(directory, dtype="float32", device="cpu")
    ids = _tokens(model, 9, seed=1)
    positions = torch.arange(9) + 5  # absolute positions need not start at 0
    expected = reference_logits(directory, ids.tolist(), positions.tolist())
    got = _single(model, ids, positions)
    assert got.dtype == torch.float32
    assert got.shape == (9, model.config.vocab_size)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_has_index_and_several_shards(checkpoint_dirs):
    directory = checkpoint_dirs["llada_sharded"]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((directory / s).is_file() for s in shards)
    assert not (directory / "model.safetensors").exists()


def test_real_tensor_names(checkpoint_dirs):
    llada = set(_checkpoint_tensors(checkpoint_dirs["llada"]))
    assert {
        "model.transformer.wte.weight",
        "model.transformer.ln_f.weight",
        "model.transformer.ff_out.weight",
        "model.transformer.blocks.1.q_proj.weight",
        "model.transformer.blocks.1.attn_out.weight",
        "model.transformer.blocks.1.ff_proj.weight",
        "model.transformer.blocks.1.up_proj.weight",
        "model.transformer.blocks.1.ff_out.weight",
        "model.transformer.blocks.1.attn_norm.weight",
        "model.transformer.blocks.1.ff_norm.weight",
    } <= llada
    dream = set(_checkpoint_tensors(checkpoint_dirs["dream"]))
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    } <= dream
    assert "model.layers.1.self_attn.o_proj.bias" not in dream


def test_config_exposes_contract_fields(tiny_llada_dir, tiny_dream_dir):
    llada = load_model(tiny_llada_dir).config
    dream = load_model(tiny_dream_dir).config
    assert (llada.family, llada.logit_shift, dream.family, dream.logit_shift) == (
        "llada",
        0,
        "dream",
        1,
    )
    raw = json.loads((tiny_dream_dir / "config.json").read_text())
    assert dream.num_kv_heads == raw["num_key_value_heads"] < dream.num_heads
    assert dream.mask_token_id == raw["mask_token_id"]
    assert dream.max_position_embeddings == raw["max_position_embeddings"]
    assert llada.head_dim * llada.num_heads == llada.hidden_size


def test_logits_index_gathers_requested_positions(family_dir):
    model = load_model(family_dir)
    ids = torch.stack([_tokens(model, 8, seed=2), _tokens(model, 8, seed=3)])
    positions = torch.arange(8).expand(2, 8)
    valid = torch.ones(2, 8, dtype=torch.bool)
    full = model(ids, positions, valid)
    index = torch.tensor([[0, 5, 7], [6, 6, 1]])
    picked = model(ids, positions, valid, logits_index=index)
    torch.testing.assert_close(picked, torch.stack([full[r, index[r]] for r in range(2)]))


# ---------------------------------------------------------------------------------------
# Cache modes


def test_write_then_read_all_positions_equal_off(family_dir):
    model = load_model(family_dir)
    ids = _tokens(model, 12, seed=4)[None]
    positions = torch.arange(12)[None]
    valid = torch.ones(1, 12, dtype=torch.bool)
    pool, rows = _pool(model), _base(2)
    off = model(ids, positions, valid)
    written = model(ids, positions, valid, cache=pool, cache_base=rows, cache_mode="write")
    read = model(
        ids,
        positions,
        valid,
        cache=pool,
        cache_base=rows,
        cache_mode="read",
        cache_len=torch.tensor([12]),
    )
    torch.testing.assert_close(written, off)
    torch.testing.assert_close(read, off, rtol=1e-5, atol=1e-5)
    assert pool.keys[0][2 * SLOT : 2 * SLOT + 12].abs().sum() > 0
    untouched = torch.ones(4 * SLOT, dtype=torch.bool)
    untouched[2 * SLOT : 2 * SLOT + 12] = False
    assert pool.keys[0][untouched].abs().sum() == 0  # other requests' rows untouched


def test_read_of_a_block_over_fresh_cache_equals_off(family_dir):
    """With the cache holding exactly this sequence's K/V, feeding only a block in "read"
    mode reproduces the full forward at the block's positions."""
    model = load_model(family_dir)
    ids = _tokens(model, 14, seed=5)
    positions = torch.arange(14)
    pool, rows = _pool(model), _base(1)
    off = _single(model, ids)
    model(
        ids[None],
        positions[None],
        torch.ones(1, 14, dtype=torch.bool),
        cache=pool,
        cache_base=rows,
        cache_mode="write",
    )
    block = slice(4, 10)
    read = model(
        ids[None, block],
        positions[None, block],
        torch.ones(1, 6, dtype=torch.bool),
        cache=pool,
        cache_base=rows,
        cache_mode="read",
        cache_len=torch.tensor([14]),
    )
    torch.testing.assert_close(read[0], off[block], rtol=1e-5, atol=1e-5)


def _stale_read(model, old, new, block_start):
    """Writes `old` in full, then reads `new`'s block `[block_start:]` over that cache."""
    n = old.numel()
    pool, rows = _pool(model), _base(0)
    model(
        old[None],
        torch.arange(n)[None],
        torch.ones(1, n, dtype=torch.bool),
        cache=pool,
        cache_base=rows,
        cache_mode="write",
    )
    read = model(
        new[None, block_start:],
        torch.arange(block_start, n)[None],
        torch.ones(1, n - block_start, dtype=torch.bool),
        cache=pool,
        cache_base=rows,
        cache_mode="read",
        cache_len=torch.tensor([n]),
    )
    return read[0], pool


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_read_attends_over_stale_prefix_and_fresh_block(tmp_path, family):
    """The block sees its fresh K/V and the prefix's stored K/V. With one layer the stored
    prefix K/V depend on prefix tokens only, so they are not stale and the read is exact;
    with two layers they are stale and the read only approximates the full forward."""
    layers = {"llada": "n_layers", "dream": "num_hidden_layers"}[family]
    one = load_model(write_tiny_checkpoint(tmp_path / "one", family, **{layers: 1}))
    two = load_model(write_tiny_checkpoint(tmp_path / "two", family, **{layers: 2}))
    old = _tokens(one, 10, seed=6)
    new = old.clone()
    new[6:] = _tokens(one, 4, seed=7)
    read, pool = _stale_read(one, old, new, 6)
    torch.testing.assert_close(read, _single(one, new)[6:], rtol=1e-5, atol=1e-5)
    alone = _single(one, new[6:], torch.arange(6, 10))
    assert not torch.allclose(read, alone, atol=1e-3)  # the prefix was attended to
    fresh = _pool(one)
    one(
        new[None],
        torch.arange(10)[None],
        torch.ones(1, 10, dtype=torch.bool),
        cache=fresh,
        cache_base=_base(0),
        cache_mode="write",
    )
    torch.testing.assert_close(pool.keys[0][:10], fresh.keys[0][:10])
    read, _ = _stale_read(two, old, new, 6)
    assert not torch.allclose(read, _single(two, new)[6:], atol=1e-3)


# ---------------------------------------------------------------------------------------
# Batching with padding


def _batch(model, seqs, starts, pad_left):
    """Padded `[b, n]` ids/positions/valid; row i holds `seqs[i]` at positions from
    `starts[i]`, padded on the left where `pad_left[i]`."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), model.config.pad_token_id)
    positions = torch.zeros(len(seqs), n, dtype=torch.long)
    valid = torch.zeros(len(seqs), n, dtype=torch.bool)
    columns = []
    for i, (seq, start, left) in enumerate(zip(seqs, starts, pad_left, strict=True)):
        col = slice(n - len(seq), n) if left else slice(0, len(seq))
        ids[i, col] = seq
        positions[i, col] = torch.arange(start, start + len(seq))
        valid[i, col] = True
        columns.append(col)
    return ids, positions, valid, columns


def test_padded_batch_rows_equal_rows_alone(family_dir):
    model = load_model(family_dir)
    seqs = [_tokens(model, 5, seed=8), _tokens(model, 11, seed=9), _tokens(model, 3, seed=10)]
    starts = [0, 3, 7]
    ids, positions, valid, columns = _batch(model, seqs, starts, [False, False, True])
    out = model(ids, positions, valid)
    for i, seq in enumerate(seqs):
        alone = _single(model, seq, torch.arange(starts[i], starts[i] + len(seq)))
        torch.testing.assert_close(out[i, columns[i]], alone, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def test_padded_batch_with_cache_rows_equals_rows_alone(family_dir):
    """Write and read through per-row pool extents (not in batch order): padding never
    reaches the pool, and each row reads only its own extent."""
    model = load_model(family_dir)
    seqs = [_tokens(model, 7, seed=11), _tokens(model, 12, seed=12)]
    ids, positions, valid, columns = _batch(model, seqs, [0, 0], [False, True])
    pool, rows = _pool(model), _base(3, 0)
    lengths = torch.tensor([7, 12])
    model(ids, positions, valid, cache=pool, cache_base=rows, cache_mode="write")
    assert pool.keys[1][3 * SLOT + 7 :].abs().sum() == 0  # nothing past row 0's length
    read = model(
        ids, positions, valid, cache=pool, cache_base=rows, cache_mode="read", cache_len=lengths
    )
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(read[i, columns[i]], _single(model, seq), rtol=1e-5, atol=1e-5)


def test_fully_padded_row_stays_finite_and_isolated(tiny_dream_dir):
    model = load_model(tiny_dream_dir)
    seq = _tokens(model, 6, seed=13)
    ids, positions, valid, _ = _batch(model, [seq, seq[:1]], [0, 0], [False, False])
    valid[1] = False
    out = model(ids, positions, valid)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], _single(model, seq), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# dtypes, devices, save/load


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(family_dir, dtype):
    exact = load_model(family_dir, dtype="float32")
    half = load_model(family_dir, dtype=dtype)
    assert all(p.dtype == dtype for p in half.parameters())
    ids = _tokens(exact, 10, seed=14)
    logits = _single(half, ids)
    assert logits.dtype == dtype
    torch.testing.assert_close(logits.float(), _single(exact, ids), rtol=0.05, atol=0.15)


def test_dtype_names_and_unknown_dtype(tiny_llada_dir):
    assert load_model(tiny_llada_dir, dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float64"):
        load_model(tiny_llada_dir, dtype="float64")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_cpu(family_dir, dtype):
    cpu = load_model(family_dir, dtype="float32")
    gpu = load_model(family_dir, dtype=dtype, device="cuda")
    assert gpu.device.type == "cuda"
    ids = _tokens(cpu, 10, seed=15)
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == "float32" else {"rtol": 0.05, "atol": 0.15}
    torch.testing.assert_close(_single(gpu, ids.cuda()).float().cpu(), _single(cpu, ids), **tol)


def test_save_then_load_round_trips(checkpoint_dirs, tmp_path):
    model = load_model(checkpoint_dirs["llada_variant"])
    files = save_checkpoint(model, tmp_path, max_shard_bytes=30_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    again = load_model(tmp_path)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (checkpoint_dirs["llada_variant"] / "config.json").read_text()
    )


def test_same_seed_same_weights(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", "dream", seed=5)
    b = write_tiny_checkpoint(tmp_path / "b", "dream", seed=5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------
# Errors name the file at fault


@pytest.fixture
def broken(tmp_path, tiny_llada_dir):
    """A fresh, writable copy of the tiny LLaDA checkpoint."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_llada_dir, target)
    return target


def _edit_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_config_names_file(broken):
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(broken)


def test_invalid_json_names_file(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_model(broken)


def test_unknown_family_names_file(broken):
    _edit_config(broken, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"config\.json: unknown model family.*gpt2"):
        load_model(broken)


def test_missing_config_key_names_file(broken):
    _edit_config(broken, mask_token_id=None)
    with pytest.raises(CheckpointError, match=r"config\.json: required key 'mask_token_id'"):
        load_model(broken)


def test_unsupported_architecture_option_names_file(broken):
    _edit_config(broken, block_type="sequential")
    with pytest.raises(CheckpointError, match=r"config\.json: block_type='sequential'"):
        load_model(broken)


def test_mask_token_outside_vocabulary_names_file(broken):
    _edit_config(broken, mask_token_id=126336)
    with pytest.raises(CheckpointError, match=r"config\.json: mask_token_id=126336 is outside"):
        load_model(broken)


def test_missing_weights_names_file(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no weights found"):
        load_model(broken)


def test_corrupt_weights_name_file(broken):
    (broken / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable"):
        load_model(broken)


def test_missing_tensor_names_file_and_tensor(broken):
    _edit_weights(broken, lambda t: t.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: missing tensors 'model\.transformer\.blocks\.1"
        r"\.up_proj\.weight'",
    ):
        load_model(broken)


def test_unexpected_tensor_names_file_and_tensor(broken):
    _edit_weights(broken, lambda t: t.update({"model.transformer.extra.weight": torch.ones(2)}))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: unexpected tensors 'model\.transformer\.extra"
    ):
        load_model(broken)


def test_misshaped_tensor_names_file_and_shapes(broken):
    def shrink(tensors):
        name = "model.transformer.blocks.0.k_proj.weight"
        tensors[name] = tensors[name][:-1].clone()

    _edit_weights(broken, shrink)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.transformer"
        r"\.blocks\.0\.k_proj\.weight' has shape \[63, 64\], "
        r"expected \[64, 64\]",
    ):
        load_model(broken)


def test_missing_shard_names_shard(tmp_path, checkpoint_dirs):
    target = tmp_path / "sharded"
    shutil.copytree(checkpoint_dirs["dream_sharded"], target)
    shard = sorted(target.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(
        CheckpointError,
        match=rf"{shard.name}: shard named in "
        r"model\.safetensors\.index\.json not found",
    ):
        load_model(target)


def test_tensor_missing_from_its_shard_names_shard(tmp_path, checkpoint_dirs):
    target = tmp_path / "sharded"
    shutil.copytree(checkpoint_dirs["dream_sharded"], target)
    weight_map = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.v_proj.bias"
    shard = target / weight_map[name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: missing tensor '{name}'"):
        load_model(target)


def test_bad_cache_arguments_are_rejected(tiny_llada_dir):
    model = load_model(tiny_llada_dir)
    ids = _tokens(model, 4)[None]
    positions, valid = torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="cache_mode"):
        model(ids, positions, valid, cache_mode="dual")
    with pytest.raises(ValueError, match="needs cache"):
        model(ids, positions, valid, cache_mode="write")
    with pytest.raises(ValueError, match="needs cache_len"):
        model(
            ids,
            positions,
            valid,
            cache=_pool(model),
            cache_base=_base(0),
            cache_mode="read",
        )


# ---------------------------------------------------------------------------------------
# Tokenizers

TEXT = "the inner answer: 42 <MASK> héllo\nworld"


def test_tokenizer_round_trips_with_config_special_tokens(family_dir):
    tokenizer = load_tokenizer(family_dir)
    config = load_model(family_dir).config
    mask = tokenizer.convert_ids_to_tokens(config.mask_token_id)
    text = TEXT.replace("<MASK>", mask)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert config.mask_token_id in ids  # special tokens are single ids
    assert len(ids) < len(text.encode())  # merges apply
    assert tokenizer.decode(ids) == text
    assert tokenizer.mask_token_id == config.mask_token_id
    assert tokenizer.pad_token_id == config.pad_token_id
    assert tokenizer.eos_token_id == config.eos_token_id
    assert max(tokenizer.get_vocab().values()) < config.vocab_size


def test_text_decoder_decodes_as_the_tokenizer_does(family_dir):
    """The serving loop's decoder skips only `decode`'s input conversion."""
    tokenizer = load_tokenizer(family_dir)
    decode = text_decoder(tokenizer)
    config = load_model(family_dir).config
    ids = tokenizer.encode(TEXT.replace("<MASK>", "  "), add_special_tokens=False)
    for sample in (ids, [config.mask_token_id, *ids, config.eos_token_id], [], ids[:3]):
        assert decode(sample) == tokenizer.decode(sample, skip_special_tokens=True)
    tiny = load_tokenizer(default_model_dir())  # the embedded model's tokenizer too
    for problem in make_problems(20, 3):
        ids = tiny.encode(problem.prompt + problem.answer, add_special_tokens=False)
        assert text_decoder(tiny)(ids) == tiny.decode(ids, skip_special_tokens=True)


def test_custom_tokenizer_class_loads_from_tokenizer_json(tmp_path):
    directory = write_tiny_checkpoint(tmp_path, "dream", tokenizer_layout="json")
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "DreamTokenizer"
    tokenizer = load_tokenizer(directory)
    reference = load_tokenizer(write_tiny_checkpoint(tmp_path / "files", "dream"))
    text = TEXT.replace("<MASK>", "<|mask|>")
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_custom_tokenizer_without_files_names_config(tmp_path, tiny_dream_dir):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_dream_dir, target)
    (target / "vocab.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"tokenizer_config\.json: names custom tokenizer "
        r"class 'DreamTokenizer'",
    ):
        load_tokenizer(target)


def test_missing_tokenizer_files_named(tmp_path, tiny_llada_dir):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_llada_dir, target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: no tokenizer files"):
        load_tokenizer(target)
