"""Tensor parallelism below the engine: which degrees a model allows, sharded loading, the
vocabulary-parallel commit against the fused one, and TP-2 (two CPU processes, gloo)
against TP-1 — logits of random LLaDA and Dream models, and the exact tokens of
dilaserve-tiny on task problems in every cache mode."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from dilaserve.kernels import (
    NO_TOKEN,
    PARTIAL_BYTES,
    combine_vocab_partials,
    confidence_commit_reference,
    partial_ids,
    threshold_commit,
    threshold_commit_triton,
    vocab_partials_reference,
    vocab_partials_triton,
)
from dilaserve.models import (
    DREAM,
    LLADA,
    UnsupportedDegreeError,
    allowed_degrees,
    check_degree,
    encode_prompt,
    load_model,
    load_tokenizer,
)
from dilaserve.models import checkpoint as checkpoint_module
from dilaserve.models.parallel import split_dim
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.tiny import default_model_dir
from dilaserve.tiny.tasks import gen_length, make_problems
from dilaserve.worker.generate import generate
from dilaserve.worker.kv_cache import KVCachePool
from dilaserve.worker.local_group import run_on_group, spawn_ranks
from dilaserve.worker.runner import StepRunner
from dilaserve.worker.tp_group import TensorParallelGroup

# Released configurations, as far as the degree rules read them.
DREAM_7B = {
    "model_type": "Dream",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "mask_token_id": 151666,
    "eos_token_id": 151643,
}
LLADA_8B = {
    "model_type": "llada",
    "d_model": 4096,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "mlp_hidden_size": 12288,
    "vocab_size": 126464,
    "embedding_size": 126464,
    "mask_token_id": 126336,
    "rope": True,
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
}


# --- which degrees a model allows ------------------------------------------------------------


def test_dream_7b_cannot_run_at_tp_8_and_says_why():
    config = DREAM.parse(DREAM_7B, Path("dream/config.json"))
    assert allowed_degrees(config) == (1, 2, 4)
    with pytest.raises(UnsupportedDegreeError) as error:
        check_degree(config, 8, "dream/config.json")
    message = str(error.value)
    assert "dream/config.json" in message and "TP 8" in message
    assert "28 query heads" in message and "4 KV heads" in message
    assert "allowed degrees: 1, 2, 4" in message


def test_llada_8b_allows_every_candidate_degree():
    config = LLADA.parse(LLADA_8B, Path("llada/config.json"))
    assert allowed_degrees(config) == (1, 2, 4, 8)


def test_padded_vocabulary_must_divide(tmp_path):
    d = write_tiny_checkpoint(tmp_path, "llada", embedding_size=289)
    with pytest.raises(UnsupportedDegreeError, match="289 padded vocabulary"):
        load_model(d, group=_FakeGroup(0, 2))


# --- sharded loading reads only the rank's slices -------------------------------------------


class _FakeGroup:
    """Rank and size only: enough to build and load a shard (its forward is not run)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, tensor: torch.Tensor) -> None:
        raise AssertionError("not run in this test")


class _RecordingHandle:
    def __init__(self, handle, whole: list[str]) -> None:
        self._handle, self._whole = handle, whole

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_tensor(self, name):
        self._whole.append(name)
        return self._handle.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self._handle, name)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_rank_loads_exactly_its_slices_and_never_a_whole_split_tensor(
    tmp_path, monkeypatch, family
):
    d = write_tiny_checkpoint(tmp_path, family, max_shard_bytes=40_000)
    full = load_model(d).state_dict()
    whole: list[str] = []
    real_open = checkpoint_module._open
    monkeypatch.setattr(
        checkpoint_module, "_open", lambda path: _RecordingHandle(real_open(path), whole)
    )
    for rank in range(2):
        shard = load_model(d, group=_FakeGroup(rank, 2)).state_dict()
        assert shard.keys() == full.keys()
        for name, tensor in shard.items():
            dim = 1 if name.endswith(("attn.o.weight", "mlp.down.weight")) else 0
            split = tensor.shape != full[name].shape
            if split:
                size = tensor.shape[dim]
                expected = full[name].narrow(dim, rank * size, size)
                assert torch.equal(tensor, expected), name
            else:
                assert torch.equal(tensor, full[name]), name
    # Only replicated tensors (norms, row-parallel biases) were read whole.
    family_names = checkpoint_module.FAMILIES[family]
    split = {family_names.checkpoint_name(n) for n in full if split_dim(n) is not None}
    assert whole and not split & set(whole)


# --- the vocabulary-parallel commit equals the fused one -------------------------------------


def _shards(logits: torch.Tensor, world: int, rows: int) -> list[tuple[torch.Tensor, int]]:
    """Each rank's (logits shard, first token id) for `rows` padded embedding rows."""
    vocab = logits.shape[-1]
    per = rows // world
    out = []
    for rank in range(world):
        start = rank * per
        stop = max(start, min(vocab, start + per))
        out.append((logits[..., min(start, vocab) : stop], start))
    return out


@pytest.mark.parametrize("world, rows", [(1, 40), (2, 40), (4, 64), (8, 64)])
def test_combined_partials_commit_like_full_logits(world, rows):
    generator = torch.Generator().manual_seed(world)
    b, m, vocab = 3, 6, 37
    logits = torch.randn(b, m, vocab, generator=generator) * 4
    logits[..., 5] = float("-inf")  # the mask token
    logits[1, 2, 30] = logits[1, 2, 3] = logits[1, 2].max() + 1  # a tie across shards
    candidate = torch.rand(b, m, generator=generator) < 0.7
    tau = torch.tensor([0.3, 0.6, 0.95])
    partials = [
        vocab_partials_reference(shard, start) for shard, start in _shards(logits, world, rows)
    ]
    x0, confidence = combine_vocab_partials(torch.stack(partials))
    ids, ids_ref = torch.zeros(b, m, dtype=torch.long), torch.zeros(b, m, dtype=torch.long)
    got = threshold_commit(x0, confidence, candidate, tau, ids)
    want = confidence_commit_reference(logits, candidate, tau, ids_ref)
    assert torch.equal(got.x0, want.x0) and torch.equal(ids, ids_ref)
    assert torch.equal(got.committed, want.committed)
    torch.testing.assert_close(got.confidence, want.confidence)
    assert int(got.x0[1, 2]) in (-1, 3)  # the tie goes to the lowest id


def test_a_shard_without_scorable_tokens_contributes_nothing():
    empty = vocab_partials_reference(torch.zeros(2, 3, 0), 64)
    only_mask = vocab_partials_reference(torch.full((2, 3, 1), float("-inf")), 40)
    for partials in (empty, only_mask):
        assert torch.all(partials[..., 0] == float("-inf")) and torch.all(partials[..., 1] == 0)
        assert torch.all(partial_ids(partials) == NO_TOKEN)
    live = vocab_partials_reference(torch.tensor([[[0.0, 1.0]]]), 0)
    x0, confidence = combine_vocab_partials(torch.stack([live, empty[:1, :1]]))
    assert int(x0) == 1
    torch.testing.assert_close(confidence, torch.tensor([[1 / (1 + torch.e**-1)]]))


@pytest.mark.parametrize("block_v", [None, 16])
def test_triton_partials_and_threshold_match_the_references(block_v):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 5, 50, generator=generator) * 4).to(device)
    logits[0, 1, :] = float("-inf")
    for start in (0, 1000):
        got = vocab_partials_triton(logits, start, block_v=block_v)
        want = vocab_partials_reference(logits, start)
        assert torch.equal(partial_ids(got), partial_ids(want))
        torch.testing.assert_close(got[..., :2], want[..., :2])
    x0, confidence = combine_vocab_partials(vocab_partials_reference(logits, 0)[None])
    candidate = torch.rand(2, 5, generator=generator).to(device) < 0.8
    tau = torch.tensor([0.5, 0.99], device=device)
    ids_kernel = torch.zeros(2, 5, dtype=torch.long, device=device)
    ids_ref = ids_kernel.clone()
    got = threshold_commit_triton(x0, confidence, candidate, tau, ids_kernel)
    want = threshold_commit(x0.cpu(), confidence.cpu(), candidate.cpu(), tau.cpu(), ids_ref.cpu())
    assert torch.equal(got.committed.cpu(), want.committed) and torch.equal(got.x0.cpu(), want.x0)


@pytest.mark.parametrize("vocab", [1_000, 152_064])
def test_commit_exchanges_12_bytes_per_position_whatever_the_vocabulary(vocab):
    logits = torch.randn(2, 4, vocab // 2)
    partials = vocab_partials_reference(logits, vocab // 2)
    assert partials.numel() * partials.element_size() == PARTIAL_BYTES * 2 * 4
    assert PARTIAL_BYTES == 12


# --- TP-2 on two CPU processes (gloo) against TP-1 -------------------------------------------

LOGITS_CASES = {
    # biases everywhere (row-parallel biases added once), tied embeddings, padded vocabulary
    "llada": {"include_bias": True, "weight_tying": True, "embedding_size": 296},
    # GQA (4 query heads, 2 KV heads), QKV bias, shifted logits
    "dream": {},
    # fused QKV split per part, QK-norm, partial RoPE, block-causal masks, experts split
    # like the dense MLP with a replicated router, a dense first layer
    "llada2": {"block_length": 4},
    # explicit head width (not hidden / heads), block-causal masks
    "sdar": {},
}


def _inputs() -> dict[str, torch.Tensor]:
    """Two rows (one padded) and a block of the first to re-run over the cache."""
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 280, (2, 12), generator=generator)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 9:] = False
    positions = torch.where(valid, torch.arange(12)[None, :], 0)
    return {"ids": ids, "valid": valid, "positions": positions}


def _three_forwards(model) -> list[torch.Tensor]:
    """This process's logits of: no cache, writing the cache, and re-reading a block of 4
    positions (fresh tokens) over the cached rest — the three cache accesses."""
    x = _inputs()
    pool = KVCachePool(
        num_layers=model.config.num_layers,
        capacity=32,
        num_kv_heads=model.local_kv_heads,
        head_dim=model.config.head_dim,
        dtype=model.dtype,
        device=model.device,
    )
    rows = torch.tensor([16, 0])
    with torch.inference_mode():
        off = model(x["ids"], x["positions"], x["valid"])
        write = model(
            x["ids"], x["positions"], x["valid"], cache=pool, cache_base=rows, cache_mode="write"
        )
        block_ids = (x["ids"][:, 4:8] + 1) % 280
        read = model(
            block_ids,
            x["positions"][:, 4:8].clone().fill_(0) + torch.arange(4, 8),
            torch.ones(2, 4, dtype=torch.bool),
            cache=pool,
            cache_base=rows,
            cache_mode="read",
            cache_len=torch.tensor([12, 9]),
        )
    return [off, write, read]


def _logits_rank(rank: int, world: int, init: str, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = TensorParallelGroup(rank, world, init)
    try:
        model = load_model(model_dir, group=group)
        gathered = []
        for logits in _three_forwards(model):
            # Test-only: the serving path never gathers logits; here every shard is compared.
            width = model.config.embedding_rows // world
            padded = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]))
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded)
            gathered.append(torch.cat(parts, dim=-1)[..., : model.config.vocab_size])
        if rank == 0:
            torch.save(gathered, out)
    finally:
        group.close()


@pytest.mark.parametrize("family", sorted(LOGITS_CASES))
def test_tp2_logits_equal_tp1(tmp_path, family):
    model_dir = write_tiny_checkpoint(tmp_path / family, family, **LOGITS_CASES[family])
    want = _three_forwards(load_model(model_dir))
    with tempfile.TemporaryDirectory() as rendezvous:
        out = str(tmp_path / "logits.pt")
        args = (2, f"file://{rendezvous}/store", str(model_dir), out)
        spawn_ranks(_logits_rank, args, 2, timeout_s=180)
    got = torch.load(out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


CACHE_MODES = ("none", "prefix", "dual")


def _decode_every_mode(model, prompts, length) -> dict[str, list[tuple[list[int], int]]]:
    """Decodes the batch in each cache mode with a τ that changes every step."""
    results = {}
    for cache in CACHE_MODES:
        runner = StepRunner(model, cache=cache, max_requests=len(prompts))
        generations = generate(
            runner,
            prompts,
            gen_length=length,
            threshold=lambda state: (0.9, 0.7, 0.5)[state.steps_done % 3],
            stop_at_eos=True,
        )
        results[cache] = [(g.output_ids, g.steps) for g in generations]
    return results


def test_tp2_decodes_exactly_the_tokens_of_tp1_in_every_cache_mode():
    tokenizer = load_tokenizer(default_model_dir())
    problems = make_problems(8, 2024)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    length = max(gen_length(p, 32) for p in problems)
    want = _decode_every_mode(load_model(default_model_dir()), prompts, length)
    got = run_on_group(2, default_model_dir(), _decode_every_mode, prompts, length, timeout_s=300)
    for cache in CACHE_MODES:
        assert got[cache] == want[cache], cache


def _decode_block_diffusion(model, prompts, length) -> list[list[tuple[list[int], int]]]:
    """The prompts decoded twice on one runner: the second time, their whole blocks are
    read from the prefix store (every rank reads the same shared segments)."""
    runner = StepRunner(model, cache="block", max_requests=len(prompts), max_seq_len=64)
    passes = []
    for _ in range(2):
        generations = generate(
            runner, prompts, gen_length=length, threshold=lambda s: (0.2, 0.05)[s.steps_done % 2]
        )
        passes.append([(g.output_ids, g.steps) for g in generations])
    assert runner.prefix is not None and runner.prefix.stats.hit_tokens >= 8
    return passes


def test_tp2_decodes_a_moe_block_diffusion_model_exactly_like_tp1(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path, "llada2", block_length=4)
    prompts = [[5, 17, 250, 33, 91, 8, 64], [40, 41, 42, 43], [7]]
    want = _decode_block_diffusion(load_model(model_dir), prompts, 9)
    got = run_on_group(2, str(model_dir), _decode_block_diffusion, prompts, 9, timeout_s=300)
    assert got == want
    assert want[0] == want[1]  # read shared or computed, the same tokens
