"""Decoding a block diffusion model with its exact block KV cache (`CacheMode.BLOCK`)
gives the tokens of the reference loop, which re-runs the whole prefix every step with the
block-causal mask and keeps no cache (the release's `generate`), in any batch and after a
migration."""

from __future__ import annotations

import pytest
import torch

from dilaserve.models import load_model
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.protocol import (
    CacheMode,
    RequestState,
    StepCommand,
    StepEntry,
    StepKind,
    TokenStateError,
    prompt_block_keys,
)
from dilaserve.worker.generate import generate
from dilaserve.worker.process import execute
from dilaserve.worker.runner import StepRunner

BLOCK = 4
TAU = 0.04  # a random model's confidences are low: this commits several tokens per step
PROMPTS = [[5, 17, 250, 33, 91, 8, 64, 120, 77, 3], [40, 41, 42, 43], [7, 9]]
GEN = 10


@pytest.fixture(scope="module", params=["llada2", "sdar"])
def model(request, tmp_path_factory):
    family = request.param
    overrides = {"block_length": BLOCK} if family == "llada2" else {}
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **overrides)
    return load_model(directory)


def reference_generate(model, prompt: list[int], gen_length: int, tau: float) -> list[int]:
    """Every step forwards positions `[0, end of the current block)`; commits the block's
    masked positions whose confidence reaches τ, at least the most confident one."""
    mask = model.config.mask_token_id
    total = -(-(len(prompt) + gen_length) // BLOCK) * BLOCK
    x = prompt + [mask] * (total - len(prompt))
    for block in range(len(prompt) // BLOCK, total // BLOCK):
        start, end = block * BLOCK, (block + 1) * BLOCK
        while mask in x[start:end]:
            with torch.no_grad():
                logits = model(
                    torch.tensor([x[:end]]),
                    torch.arange(end)[None],
                    torch.ones(1, end, dtype=torch.bool),
                )[0, start:end]
            logits[:, mask] = float("-inf")
            confidence, tokens = logits.softmax(-1).max(-1)
            masked = [i for i in range(BLOCK) if x[start + i] == mask]
            picked = [i for i in masked if confidence[i] >= tau]
            for i in picked or [max(masked, key=lambda i: confidence[i].item())]:
                x[start + i] = int(tokens[i])
    return x[len(prompt) :]


def runner(model, cache=CacheMode.BLOCK) -> StepRunner:
    return StepRunner(model, cache=cache, max_requests=4, max_seq_len=64, kv_cache_memory=1 << 22)


def test_batched_exact_cache_decoding_matches_the_full_recompute_reference(model):
    expected = [reference_generate(model, p, GEN, TAU) for p in PROMPTS]
    batched = generate(runner(model), PROMPTS, gen_length=GEN, threshold=TAU)
    assert [g.output_ids for g in batched] == expected
    # Blocks start at absolute multiples of the block length: an output ends where the
    # block holding its last position ends, counted from the sequence's start.
    assert [len(e) for e in expected] == [10, 12, 10]
    alone = [generate(runner(model), [p], gen_length=GEN, threshold=TAU)[0] for p in PROMPTS]
    assert [g.output_ids for g in alone] == expected
    # Steps feed only the current block (and the one just finished): far fewer tokens.
    cached, uncached = runner(model), runner(model, CacheMode.NONE)
    assert [
        g.output_ids for g in generate(uncached, PROMPTS, gen_length=GEN, threshold=TAU)
    ] == expected
    generate(cached, PROMPTS, gen_length=GEN, threshold=TAU)
    assert cached.forward_tokens < uncached.forward_tokens / 2


def test_a_request_migrated_mid_block_resumes_with_a_recompute_step_and_the_same_tokens(model):
    prompt = PROMPTS[0]
    expected = reference_generate(model, prompt, 12, TAU)
    config = model.config
    state = RequestState.new(
        1, prompt, 12, block_length=BLOCK, mask_token_id=config.mask_token_id, aligned=True
    )
    first, second = runner(model), runner(model)
    first.add(state)
    for kind in (StepKind.RECOMPUTE, StepKind.CACHE, StepKind.CACHE):
        first.step([StepEntry(1, TAU, kind)])
    assert first.next_kind(1) is StepKind.CACHE
    second.add(first.export(1))  # any step: the new instance rebuilds the exact prefix
    assert second.next_kind(1) is StepKind.RECOMPUTE
    while not second.finished(1):
        second.step([StepEntry(1, TAU, second.next_kind(1))])
    assert second.state(1).generated_ids() == expected


def test_a_stop_token_in_the_prompt_tail_does_not_end_the_request(model):
    eos = model.config.eos_token_id
    state = RequestState.new(
        1,
        [5, 6, eos],
        6,
        block_length=BLOCK,
        mask_token_id=model.config.mask_token_id,
        stop_token_ids=[eos],
        aligned=True,
    )
    assert state.lead == 3 and state.prompt_ids == [] and not state.done
    r = runner(model)
    r.add(state)
    assert not r.finished(1)
    r.step([StepEntry(1, TAU, StepKind.RECOMPUTE)])
    assert not r.finished(1) and r.state(1).output_ids[:3] == [5, 6, eos]


def test_cache_modes_and_blocks_must_fit_the_model(model, tmp_path):
    with pytest.raises(ValueError, match="block diffusion"):
        runner(model, CacheMode.DUAL)
    llada = load_model(write_tiny_checkpoint(tmp_path, "llada"))
    with pytest.raises(ValueError, match="needs a block diffusion model"):
        runner(llada, CacheMode.BLOCK)
    r = runner(model)
    unaligned = RequestState.new(
        1, [5, 6, 7], 4, block_length=BLOCK, mask_token_id=model.config.mask_token_id
    )
    with pytest.raises(TokenStateError, match="aligned"):
        r.add(unaligned)
    assert len(r) == 0


def test_the_generate_command_decodes_a_block_diffusion_checkpoint_with_its_exact_cache(
    tmp_path, capsys
):
    from dilaserve.cli import main

    directory = write_tiny_checkpoint(tmp_path, "llada2", block_length=BLOCK)
    args = ["generate", "12+34=", "--model", str(directory), "--max-tokens", "6", "--stats"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "committed_tokens=" in err and int(err.split("committed_tokens=")[1].split()[0]) <= 8
    assert main([*args, "--cache", "dual"]) == 2
    assert "exact" in capsys.readouterr().err


def test_serving_a_block_diffusion_checkpoint_with_an_approximate_cache_is_refused(
    tmp_path, capsys
):
    from dilaserve.cli import main

    directory = write_tiny_checkpoint(tmp_path, "sdar")
    assert main(["serve", "--model", str(directory), "--cache", "dual", "--port", "0"]) == 2
    assert "caches exactly" in capsys.readouterr().err


def test_the_engine_serves_a_block_diffusion_model_with_the_tokens_of_offline_decoding(
    tmp_path, tiny_profile
):
    from dilaserve.engine import EngineConfig, GenerationParams
    from dilaserve.engine.offline import LLM

    directory = write_tiny_checkpoint(tmp_path, "llada2", block_length=BLOCK)
    model = load_model(directory)
    want = generate(runner(model), PROMPTS, gen_length=GEN, threshold=TAU, stop_at_eos=True)
    config = EngineConfig(
        model=str(directory),
        cache=CacheMode.BLOCK,
        instances=(1,),
        profile=tiny_profile,
        threads_per_worker=1,
    )
    with LLM(config) as llm:
        # The engine resolves the block length once, from the model, for every part.
        assert llm.engine.config.block_length == BLOCK != config.block_length
        params = GenerationParams(max_tokens=GEN, threshold=TAU)
        outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [g.output_ids for g in want]
    assert all(o.finished for o in outputs) and sum(len(g.output_ids) for g in want) >= 10


def test_llada2s_threshold_with_a_floor_commits_at_least_the_schedules_share(model):
    """`generate(threshold, steps)` of the release: every position above τ, and at least
    the block's share of `steps` per step (here 2 steps per block of 4: 2 per step)."""
    mask = model.config.mask_token_id
    r = runner(model)
    for rid, floor in ((1, True), (2, False), (3, True)):
        r.add(
            RequestState.new(
                rid,
                PROMPTS[1],
                8,
                block_length=BLOCK,
                mask_token_id=mask,
                aligned=True,
                steps_per_block=2 if floor else None,
                threshold_floor=floor,
            )
        )
    # τ = 1 commits nothing by itself: the floor commits the share, the plain rule one;
    # τ = 0 commits past the floor.
    taus = {1: 1.0, 2: 1.0, 3: 0.0}
    report = r.step([StepEntry(rid, tau, StepKind.RECOMPUTE) for rid, tau in taus.items()])
    assert [len(o.committed_positions) for o in report.outputs] == [2, 1, 4]
    with pytest.raises(TokenStateError, match="floor"):
        RequestState.new(4, [1], 4, block_length=BLOCK, mask_token_id=mask, threshold_floor=True)


def test_requests_sharing_a_system_prompt_compute_its_blocks_once_and_decode_as_alone(model):
    """Prefix sharing: the second request reads the first's K/V of their three common
    prompt blocks in place instead of computing it (held once in the pool: its own extent
    holds only what follows them), and both decode exactly as they do alone."""
    system = [5, 17, 250, 33, 91, 8, 64, 120, 77, 3, 12, 19]  # three blocks of four
    first, second = system + [40, 41, 42, 43], system + [7, 9, 11]
    expected = [reference_generate(model, p, GEN, TAU) for p in (first, second)]
    mask = model.config.mask_token_id
    r = runner(model)

    def add(rid, prompt):
        r.add(
            RequestState.new(rid, prompt, GEN, block_length=BLOCK, mask_token_id=mask, aligned=True)
        )

    add(1, first)
    assert r.step([StepEntry(1, TAU, StepKind.RECOMPUTE)]).forward_tokens == 20
    add(2, second)
    assert r.prefix.stats.hit_tokens == 12 and r.next_kind(2) is StepKind.RECOMPUTE
    assert r.pool.extent(2)[1] == r.state(2).seq_length - 12
    # Its first step feeds only its own block (the prompt's tail and three masks).
    assert r.step([StepEntry(2, TAU, StepKind.RECOMPUTE)]).forward_tokens == 4
    while not (r.finished(1) and r.finished(2)):
        live = [rid for rid in (1, 2) if not r.finished(rid)]
        r.step([StepEntry(rid, TAU, r.next_kind(rid)) for rid in live])
    assert [r.state(rid).generated_ids() for rid in (1, 2)] == expected
    # A third copy of the first prompt finds all four of its blocks.
    r.release(1)
    add(3, first)
    assert r.prefix.stats.hit_tokens == 12 + 16
    assert r.pool.extent(3)[1] == r.state(3).seq_length - 16
    assert r.step([StepEntry(3, TAU, StepKind.RECOMPUTE)]).forward_tokens == 4
    unshared = StepRunner(
        model,
        cache=CacheMode.BLOCK,
        max_requests=4,
        max_seq_len=64,
        kv_cache_memory=1 << 22,
        prefix_caching=False,
    )
    assert unshared.prefix is None


def test_a_step_report_names_the_stored_blocks_each_arrival_reads(model):
    """So that the scheduler counts a block several residents read once: keys as the
    engine computes them from the prompt, only for arrivals that read some."""
    system = [5, 17, 250, 33, 91, 8, 64, 120]  # two blocks of four
    mask = model.config.mask_token_id
    r = runner(model)

    def arrival(rid, prompt):
        return RequestState.new(
            rid, prompt, GEN, block_length=BLOCK, mask_token_id=mask, aligned=True
        )

    first = execute(
        r,
        StepCommand.of(
            1, [StepEntry(1, TAU, StepKind.RECOMPUTE)], admit=[arrival(1, system + [1, 2, 3, 4])]
        ),
    )
    assert first.prefix_reads == {} and first.failure is None
    second_prompt = system + [9, 9, 9, 9]
    report = execute(
        r,
        StepCommand.of(
            2,
            [StepEntry(2, TAU, StepKind.RECOMPUTE), StepEntry(3, TAU, StepKind.RECOMPUTE)],
            admit=[arrival(2, second_prompt), arrival(3, [7, 7, 7, 7])],
        ),
    )
    assert report.failure is None and not report.errors
    assert report.prefix_reads == {2: prompt_block_keys(second_prompt, BLOCK)[:2]}
