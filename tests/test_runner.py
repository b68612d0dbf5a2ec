"""Step-level decoding: the runner against a reference loop, batching, caching, migration."""

from __future__ import annotations

import pytest
import torch

from dilaserve.models import load_model
from dilaserve.protocol import RequestState, StepEntry, StepKind, TokenStateError
from dilaserve.worker.errors import (
    CacheFullError,
    MigrationError,
    RequestNotHeldError,
    StepFailedError,
    StepRejectedError,
)
from dilaserve.worker.generate import generate
from dilaserve.worker.runner import StepRunner

BLOCK = 8
CACHE_MODES = ["none", "prefix", "dual"]


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tiny_llada_dir, tiny_dream_dir):
    path = tiny_llada_dir if request.param == "llada" else tiny_dream_dir
    return load_model(path, dtype="float32", device="cpu")


def _prompts(model, lengths=(5, 11, 3)):
    g = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    mask = model.config.mask_token_id
    prompts = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompts.append([t if t != mask else (t + 1) % vocab for t in ids])
    return prompts


def _step(runner, batch):
    """One step of `(request id, τ)` pairs, each of the kind that continues it there."""
    return runner.step([StepEntry(rid, tau, runner.next_kind(rid)) for rid, tau in batch])


def _reference_decode(model, prompt, gen_length, taus):
    """LLaDA-style generate: full forward each step, commit by the threshold rule."""
    cfg = model.config
    x = torch.tensor(prompt + [cfg.mask_token_id] * gen_length)
    p = len(prompt)
    steps = 0
    for block in range(gen_length // BLOCK):
        lo, hi = p + block * BLOCK, p + (block + 1) * BLOCK
        while (x[lo:hi] == cfg.mask_token_id).any():
            n = x.numel()
            with torch.no_grad():
                logits = model(x[None], torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))[
                    0
                ].float()
            if cfg.logit_shift:
                logits = torch.cat([logits[:1], logits[:-1]])
            logits[:, cfg.mask_token_id] = -float("inf")
            probs = torch.softmax(logits[lo:hi], dim=-1)
            conf, x0 = probs.max(dim=-1)
            masked = x[lo:hi] == cfg.mask_token_id
            conf = torch.where(masked, conf, torch.tensor(-float("inf")))
            tau = taus(steps)
            commit = masked & (conf >= tau)
            if not commit.any():
                commit = torch.zeros_like(masked)
                commit[int(conf.argmax())] = True
            x[lo:hi] = torch.where(commit, x0, x[lo:hi])
            steps += 1
    return x[p:].tolist(), steps


@pytest.mark.parametrize("taus", [lambda s: 1.0, lambda s: [0.0, 1.0, 0.05][s % 3]])
def test_no_cache_matches_reference_loop(model, taus):
    prompt = _prompts(model, (6,))[0]
    expected, expected_steps = _reference_decode(model, prompt, 2 * BLOCK, taus)
    runner = StepRunner(model, cache="none")
    runner.add(
        RequestState.new(
            1, prompt, 2 * BLOCK, block_length=BLOCK, mask_token_id=model.config.mask_token_id
        )
    )
    steps = 0
    while not runner.state(1).done:
        out = _step(runner, [(1, taus(steps))]).outputs[0]
        assert out.kind is StepKind.NO_CACHE
        steps += 1
    assert runner.state(1).output_ids == expected
    assert steps == expected_steps


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_batch_equals_alone(model, cache):
    prompts = _prompts(model)
    taus = [0.0, 1.0, 0.0]
    gens = [2 * BLOCK, BLOCK, 3 * BLOCK]
    runner = StepRunner(model, cache=cache, max_requests=4, max_seq_len=64)
    alone = []
    for prompt, tau, gen in zip(prompts, taus, gens, strict=True):
        alone.append(generate(runner, [prompt], gen_length=gen, block_length=BLOCK, threshold=tau))
    states = [
        RequestState.new(10 + i, p, g, block_length=BLOCK, mask_token_id=model.config.mask_token_id)
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]
    # Stagger arrivals so that recompute and cache steps share a batch.
    runner.add(states[0])
    _step(runner, [(10, taus[0])])
    runner.add(states[1])
    runner.add(states[2])
    kinds_seen = set()
    active = {10: taus[0], 11: taus[1], 12: taus[2]}
    while active:
        result = _step(runner, list(active.items()))
        kinds_seen.add(frozenset(o.kind for o in result.outputs))
        active = {o.request_id: active[o.request_id] for o in result.outputs if not o.done}
    for i, a in enumerate(alone):
        final = runner.state(10 + i)
        assert final.output_ids == a[0].output_ids
        assert final.steps_done == a[0].steps
    if cache != "none":
        assert any(len(k) == 2 for k in kinds_seen), "no step mixed recompute and cache rows"


def _count_fed_tokens(model, monkeypatch):
    calls = []
    original = model.forward

    def counting(batch, **kw):
        calls.append(batch.lengths)
        return original(batch, **kw)

    monkeypatch.setattr(model, "forward", counting)
    return calls


def test_dual_cache_steps_feed_only_the_block(model, monkeypatch):
    prompts = _prompts(model, (9, 4))
    runner = StepRunner(model, cache="dual", max_requests=2, max_seq_len=64)
    calls = _count_fed_tokens(model, monkeypatch)
    results = generate(runner, prompts, gen_length=2 * BLOCK, block_length=BLOCK, threshold=1.0)
    per_row = BLOCK + model.config.logit_shift
    full = {len(p) + 2 * BLOCK for p in prompts}
    fed = [n for lengths in calls for n in lengths]
    assert set(fed) == full | {per_row}, "a row fed more than its block in a cache step"
    # One recompute step opens each block of each request, over the whole sequence.
    assert sum(n in full for n in fed) == 2 * len(prompts)
    assert len(calls) == len(results[0].state.output_ids)  # one model call per step
    assert all(r.steps == 2 * BLOCK for r in results)  # tau = 1.0: one token per step


def test_step_kinds_and_stats(model):
    runner = StepRunner(model, cache="dual", max_requests=1, max_seq_len=64)
    prompt = _prompts(model, (5,))[0]
    runner.add(
        RequestState.new(
            1, prompt, 2 * BLOCK, block_length=BLOCK, mask_token_id=model.config.mask_token_id
        )
    )
    kinds = []
    while not runner.state(1).done:
        out = _step(runner, [(1, 1.0)]).outputs[0]
        kinds.append(out.kind)
        lo, q25, med, mean, q75 = out.confidence_stats
        assert 0.0 < lo <= q25 <= med <= q75 <= 1.0
        assert lo <= mean <= 1.0
        assert len(out.committed_positions) == 1
        assert out.block == out.committed_positions[0] // BLOCK
    assert kinds == ([StepKind.RECOMPUTE] + [StepKind.CACHE] * (BLOCK - 1)) * 2


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_migration_resumes_identically(model, cache):
    prompt = _prompts(model, (7,))[0]
    mask = model.config.mask_token_id
    taus = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]

    def fresh():
        return RequestState.new(1, prompt, 3 * BLOCK, block_length=BLOCK, mask_token_id=mask)

    straight = StepRunner(model, cache=cache, max_requests=2, max_seq_len=64)
    straight.add(fresh())
    i = 0
    while not straight.state(1).done:
        _step(straight, [(1, taus[i % len(taus)])])
        i += 1

    a = StepRunner(model, cache=cache, max_requests=2, max_seq_len=64)
    b = StepRunner(model, cache=cache, max_requests=3, max_seq_len=64)
    b.add(RequestState.new(2, prompt, BLOCK, block_length=BLOCK, mask_token_id=mask))
    a.add(fresh())
    i = 0
    while a.state(1).current_block == 0 or a.state(1).block_steps != 0:
        _step(a, [(1, taus[i % len(taus)])])
        i += 1
    moved = a.export(1)
    assert 1 not in a
    b.add(moved)
    assert b.next_kind(1) is (StepKind.NO_CACHE if cache == "none" else StepKind.RECOMPUTE)
    while not b.state(1).done:
        _step(b, [(1, taus[i % len(taus)])])
        i += 1
    assert b.state(1).output_ids == straight.state(1).output_ids
    assert b.state(1).steps_done == straight.state(1).steps_done


def test_no_migration_before_a_cache_step(model):
    mask = model.config.mask_token_id
    runner = StepRunner(model, cache="dual", max_requests=1, max_seq_len=64)
    runner.add(RequestState.new(1, [1, 2, 3], 2 * BLOCK, block_length=BLOCK, mask_token_id=mask))
    _step(runner, [(1, 1.0)])
    with pytest.raises(MigrationError):
        runner.export(1)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_command_decides_the_step_kind(model, cache):
    """A request that arrives mid-block (migrated, or resumed after a lost worker) runs a
    recompute step that rebuilds its cache, then continues with cache steps; a cache step
    without this instance's K/V is refused, and so is a kind foreign to the cache mode."""
    mask = model.config.mask_token_id
    home = StepRunner(model, cache=cache, max_requests=1, max_seq_len=64)
    home.add(RequestState.new(1, [1, 2, 3], 2 * BLOCK, block_length=BLOCK, mask_token_id=mask))
    _step(home, [(1, 1.0)])
    mid_block = home.state(1)
    assert mid_block.block_steps == 1
    other = StepRunner(model, cache=cache, max_requests=1, max_seq_len=64)
    other.add(mid_block)
    with pytest.raises(StepRejectedError, match="cache step needs"):
        other.step([StepEntry(1, 1.0, StepKind.CACHE)])
    with pytest.raises(StepRejectedError, match="cannot run with cache mode"):
        other.step([StepEntry(1, 1.0, StepKind.NO_CACHE)])
    out = other.step([StepEntry(1, 1.0, StepKind.RECOMPUTE)]).outputs[0]
    assert out.kind is StepKind.RECOMPUTE and out.block == 0
    assert other.next_kind(1) is StepKind.CACHE
    while not other.state(1).done:
        _step(other, [(1, 1.0)])
    assert other.state(1).num_masked == 0


def test_bad_input_is_rejected_without_harming_others(model):
    mask = model.config.mask_token_id
    runner = StepRunner(model, cache="dual", max_requests=2, max_seq_len=40)
    runner.add(RequestState.new(3, [1, 2], BLOCK, block_length=BLOCK, mask_token_id=mask))
    before = runner.state(3)
    out = [mask] * BLOCK
    bad = [
        RequestState(4, [1, 2], [mask] * 5, BLOCK, mask),
        RequestState(4, [], out, BLOCK, mask),
        RequestState(4, [mask], out, BLOCK, mask),
        RequestState(4, [model.config.vocab_size], out, BLOCK, mask),
        RequestState(4, [1] * 40, out, BLOCK, mask),
        RequestState(4, [1], out, BLOCK, mask + 1),
        RequestState(3, [1], out, BLOCK, mask),
        RequestState(4, [1], out, BLOCK, mask, steps_done=-1),
    ]
    for state in bad:
        with pytest.raises(TokenStateError):
            runner.add(state)
    with pytest.raises(RequestNotHeldError):
        _step(runner, [(99, 0.5)])
    with pytest.raises(ValueError, match="twice"):
        _step(runner, [(3, 0.5), (3, 0.5)])
    with pytest.raises(ValueError, match="outside"):
        _step(runner, [(3, 1.5)])
    with pytest.raises(ValueError):
        _step(runner, [])
    assert runner.state(3) == before
    assert len(runner) == 1
    result = _step(runner, [(3, 0.0)])
    assert result.outputs[0].done
    with pytest.raises(ValueError, match="finished"):
        _step(runner, [(3, 0.0)])


def test_a_read_back_that_breaks_the_rules_fails_the_step_and_changes_nothing(model, monkeypatch):
    """A kernel fault that commits nothing in a row (the rule is at least one) fails the
    step with a typed error; no row of it is applied, and the runner keeps serving."""
    mask = model.config.mask_token_id
    runner = StepRunner(model, cache="dual", max_requests=2, max_seq_len=40)
    for rid in (1, 2):
        runner.add(
            RequestState.new(rid, [1, 2, rid], BLOCK, block_length=BLOCK, mask_token_id=mask)
        )
    before = [runner.state(1), runner.state(2)]
    honest = runner._scores_and_commit

    def faulty(*args):
        result, timesteps = honest(*args)
        committed = result.committed.clone()
        committed[0] = False
        return result._replace(committed=committed), timesteps

    monkeypatch.setattr(runner, "_scores_and_commit", faulty)
    with pytest.raises(StepFailedError, match="request 1"):
        _step(runner, [(1, 0.0), (2, 0.0)])
    assert [runner.state(1), runner.state(2)] == before
    monkeypatch.undo()
    result = _step(runner, [(1, 0.0), (2, 0.0)])
    assert [o.done for o in result.outputs] == [True, True]


def test_kv_tokens_are_recycled_and_bound_admission(model):
    mask = model.config.mask_token_id
    runner = StepRunner(model, cache="dual", max_requests=1, max_seq_len=64)
    assert runner.kv_tokens == 64  # one request of max_seq_len, well under any budget
    for _ in range(3):
        (out,) = generate(runner, [[1, 2, 3]], gen_length=BLOCK, block_length=BLOCK, threshold=0.0)
        assert out.steps == 1
    assert runner.pool is not None and runner.pool.free_tokens == 64
    # Tokens, not requests, bound admission: two short requests share the pool...
    runner.add(RequestState.new(5, [1] * 20, 4 * BLOCK, block_length=BLOCK, mask_token_id=mask))
    runner.add(RequestState.new(6, [1] * 4, BLOCK, block_length=BLOCK, mask_token_id=mask))
    assert runner.pool.free_tokens == 64 - (20 + 4 * BLOCK) - (4 + BLOCK) == 0
    # ... and one token more does not fit.
    with pytest.raises(CacheFullError, match="KV tokens"):
        runner.add(RequestState.new(7, [1], BLOCK, block_length=BLOCK, mask_token_id=mask))
    assert 7 not in runner
    runner.release(5)
    runner.add(RequestState.new(7, [1], BLOCK, block_length=BLOCK, mask_token_id=mask))


def test_mask_token_is_never_committed(model, monkeypatch):
    original = model.forward
    mask = model.config.mask_token_id

    def mask_loving(*args, **kw):
        logits = original(*args, **kw)
        logits[..., mask] += 100.0
        return logits

    monkeypatch.setattr(model, "forward", mask_loving)
    runner = StepRunner(model, cache="dual", max_requests=1, max_seq_len=64)
    (out,) = generate(runner, [[1, 2, 3]], gen_length=BLOCK, block_length=BLOCK, threshold=0.5)
    assert mask not in out.output_ids
    assert out.steps <= BLOCK


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_rows_with_different_block_lengths_share_a_step(model, cache):
    """A recompute row with 8-token blocks and a cache row with 4-token blocks in one step
    (their logits have different widths) decode as they do alone."""
    mask = model.config.mask_token_id
    prompts = _prompts(model, (5, 7))
    lengths = (BLOCK, BLOCK // 2)
    runner = StepRunner(model, cache=cache, max_requests=2, max_seq_len=64)
    alone = [
        generate(runner, [p], gen_length=2 * BLOCK, block_length=b, threshold=1.0)[0]
        for p, b in zip(prompts, lengths, strict=True)
    ]
    for i, (p, b) in enumerate(zip(prompts, lengths, strict=True)):
        runner.add(RequestState.new(20 + i, p, 2 * BLOCK, block_length=b, mask_token_id=mask))
    _step(runner, [(21, 1.0)])
    active = [20, 21]
    while active:
        result = _step(runner, [(rid, 1.0) for rid in active])
        active = [o.request_id for o in result.outputs if not o.done]
    for i, ref in enumerate(alone):
        assert runner.state(20 + i).output_ids == ref.output_ids


def test_compaction_moves_a_requests_cache_under_it(model):
    """Freed extents leave holes too small for a long request: the pool slides the live
    extents down, K/V and all, and a request mid-block keeps decoding as it would alone."""
    mask = model.config.mask_token_id
    prompts = _prompts(model, (4, 4, 4, 4))
    runner = StepRunner(model, cache="dual", max_requests=2, max_seq_len=60)
    assert runner.kv_tokens == 120
    (alone,) = generate(
        runner, [prompts[1]], gen_length=4 * BLOCK, block_length=BLOCK, threshold=1.0
    )
    for rid in (0, 1, 2):
        runner.add(
            RequestState.new(rid, prompts[rid], 4 * BLOCK, block_length=BLOCK, mask_token_id=mask)
        )
    for _ in range(3):  # request 1 is mid-block, its next step a cache step
        _step(runner, [(1, 1.0)])
    runner.release(0)
    runner.release(2)
    runner.add(RequestState.new(3, prompts[3], 7 * BLOCK, block_length=BLOCK, mask_token_id=mask))
    assert runner.pool.compactions == 1 and runner.pool.base(1) == 0
    assert runner.next_kind(1) is StepKind.CACHE
    while not runner.state(1).done:
        _step(runner, [(1, 1.0), (3, 1.0)])
    assert runner.state(1).output_ids == alone.output_ids
