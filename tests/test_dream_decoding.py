"""Dream's generation rules in the worker: each row's scores and commit against a per-row
reference on fixed logits, the filters, the random rule's and `alg_temp`'s draws against
Dream's distributions, and whole decodes against Dream's generate on a tiny Dream model."""

from __future__ import annotations

import math

import pytest
import torch

from dilaserve.decoding import ConfidenceRule
from dilaserve.kernels import argmax_confidence, threshold_commit_reference
from dilaserve.models import load_model
from dilaserve.protocol import RequestState, StepEntry
from dilaserve.worker.batch_decoding import RowSampling, RowSchedule
from dilaserve.worker.local_group import run_on_group
from dilaserve.worker.runner import StepRunner
from dilaserve.worker.sampling import first_fired, kept_tokens

M = 99
BLOCK = 8
PROMPT = [3, 17, 42, 5, 9]


def _state(rid: int = 0, masked: int = BLOCK, timestep: int = 0, **options) -> RequestState:
    """A request whose first block has its last `masked` positions masked."""
    state = RequestState.new(rid, [1, 2], BLOCK, block_length=BLOCK, mask_token_id=M, **options)
    state.output_ids[: BLOCK - masked] = [7] * (BLOCK - masked)
    state.timestep = timestep
    return state


# -- a straightforward reference, one row and one position at a time ------------------------


def _nucleus(probs: list[float], top_p: float) -> set[int]:
    """The most probable tokens until their mass exceeds top_p (the crossing one kept)."""
    kept, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
        kept.add(token)
        mass += probs[token]
        if mass > top_p:
            break
    return kept


def _kept(scaled: torch.Tensor, top_p: float, top_k: int | None) -> set[int]:
    probs = torch.softmax(scaled, dim=-1).tolist()
    kept = set(range(len(probs))) if top_p >= 1 else _nucleus(probs, top_p)
    if top_k is not None:
        kth = sorted(scaled.tolist(), reverse=True)[top_k - 1]
        kept &= {t for t, value in enumerate(scaled.tolist()) if value >= kth}
    return kept


def _reference_position(
    logits: torch.Tensor, state: RequestState, noise: torch.Tensor | None, uniform: float
) -> tuple[int, float, float]:
    """(token, confidence, rank) of one position as Dream's `sample_tokens` and `_sample`
    define them (LLaDA's noiseless probability without `alg`)."""
    t = state.temperature
    scaled = logits.float() / t if t > 0 else logits.float()
    kept = _kept(scaled, state.top_p, state.top_k)
    dropped = [v not in kept for v in range(logits.shape[-1])]
    z = scaled.masked_fill(torch.tensor(dropped), -torch.inf)
    draw = logits.double() / t if t > 0 else logits.double()
    draw = draw.masked_fill(torch.tensor(dropped), -torch.inf)
    if noise is not None and t > 0:  # a categorical draw from softmax(z) as Gumbel-max
        draw = draw - torch.log(-torch.log(noise))
    token = int(draw.argmax())
    probs = torch.softmax(z, dim=-1)
    if state.alg is None:
        confidence = float(torch.softmax(logits.float(), dim=-1)[token])
        return token, confidence, confidence
    ordered = sorted(probs.tolist(), reverse=True)
    neg_entropy = float((probs * torch.log(probs + 1e-10)).sum())
    score, confidence = {
        ConfidenceRule.PROBABILITY: (float(probs[token]),) * 2,
        ConfidenceRule.MARGIN: (ordered[0] - ordered[1],) * 2,
        ConfidenceRule.ENTROPY: (neg_entropy, math.exp(neg_entropy)),
        ConfidenceRule.RANDOM: (uniform, uniform),
    }[state.alg]
    if state.alg_temp > 0:
        score = score / state.alg_temp - math.log(-math.log(uniform))
    return token, confidence, score


ROWS = [
    {},
    {"temperature": 0.7},
    {"alg": "maskgit_plus"},
    {"alg": "maskgit_plus", "temperature": 1.3, "top_p": 0.8},
    {"alg": "topk_margin", "top_k": 3},
    {"alg": "topk_margin", "temperature": 0.5, "top_k": 4, "top_p": 0.9},
    {"alg": "entropy"},
    {"alg": "entropy", "temperature": 0.9, "top_p": 0.6, "alg_temp": 0.4},
    {"alg": "origin", "temperature": 1.1},
    {"alg": "maskgit_plus", "alg_temp": 0.2},
    {"top_p": 0.5, "top_k": 2, "temperature": 1.5},
]


def test_every_rule_scores_rows_like_the_per_row_reference():
    states = [_state(i, **options) for i, options in enumerate(ROWS)]
    b, m, vocab = len(states), 5, 12
    logits = 3 * torch.randn(b, m, vocab, generator=torch.Generator().manual_seed(1))
    sampling = RowSampling.of(states, torch.device("cpu"))
    assert sampling is not None
    x0, confidence = argmax_confidence(logits, torch.ones(b, m, dtype=torch.bool))
    x0, confidence, rank = sampling.apply(logits, x0, confidence, torch.Generator().manual_seed(7))
    # Row 0 has no option: the step draws for the others only, in the documented order —
    # token noise, then one uniform per position.
    assert sampling.rows.tolist() == list(range(1, b))
    replay = torch.Generator().manual_seed(7)
    noise = torch.rand((b - 1, m, vocab), dtype=torch.float64, generator=replay)
    uniform = torch.rand((b - 1, m), generator=replay)
    for i, state in enumerate(states):
        for j in range(m):
            drawn = (None, 0.5) if i == 0 else (noise[i - 1, j], float(uniform[i - 1, j]))
            token, conf, score = _reference_position(logits[i, j], state, *drawn)
            assert int(x0[i, j]) == token, (ROWS[i], j)
            assert float(confidence[i, j]) == pytest.approx(conf, rel=1e-5, abs=1e-6)
            assert float(rank[i, j]) == pytest.approx(score, rel=1e-5, abs=1e-6)


def test_rows_without_options_take_the_argmax_and_its_probability():
    states = [_state(0), _state(1, top_p=0.3, top_k=1)]
    assert RowSampling.of(states, torch.device("cpu")) is None


def test_filters_keep_what_dreams_filters_keep():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scaled = probs.log().expand(1, 1, 4)
    cases = [(0.9, 0, {0, 1, 2}), (0.6, 0, {0, 1}), (0.4, 0, {0}), (0.0, 0, {0}), (1.0, 2, {0, 1})]
    for top_p, top_k, want in cases:
        keep = kept_tokens(scaled, torch.tensor([top_p]), torch.tensor([top_k]))
        assert set(keep[0, 0].nonzero().flatten().tolist()) == want, (top_p, top_k)
    # top-k keeps every token tied with the k-th, as Dream's `logits < kth` does.
    tied = torch.tensor([[[1.0, 1.0, 0.0]]])
    assert kept_tokens(tied, torch.tensor([1.0]), torch.tensor([1])).tolist() == [
        [[True, True, False]]
    ]


def test_filtered_sampling_draws_from_the_renormalised_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(1, 6000, 4)
    states = [_state(0, temperature=1.0, top_p=0.6)]
    x0, _, _ = RowSampling.of(states, torch.device("cpu")).scores(  # type: ignore[union-attr]
        logits, torch.Generator().manual_seed(3)
    )
    freq = torch.bincount(x0.flatten(), minlength=4).float() / x0.numel()
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.02, rtol=0)


# -- the commit ------------------------------------------------------------------------------


def _dream_grid(steps: int) -> list[float]:
    return torch.linspace(1, 1e-3, steps + 1).tolist()


def _dream_count(steps: int, index: int, masked: int) -> int:
    """Dream's count for grid step `index`, in its float32 tensor arithmetic."""
    grid = torch.linspace(1, 1e-3, steps + 1)
    if index == steps - 1:
        return masked
    return int(torch.tensor(float(masked)) * (1 - grid[index + 1] / grid[index]))


def _reference_commit(state, confidence, rank, n, tau):
    """One row's committed positions and grid steps passed, rule by rule."""
    by_rank = sorted(range(n), key=lambda j: (-rank[j], j))
    above = [j for j in range(n) if confidence[j] >= tau]
    if state.steps_per_block is None:
        if above:
            return set(above), 1
        best = (
            by_rank[0] if state.alg_temp > 0 else max(range(n), key=lambda j: (confidence[j], -j))
        )
        return {best}, 1
    steps, g = state.steps_per_block, state.timestep
    if state.alg is None:
        return set(by_rank[: state.transfer_count()]), 1
    grid = _dream_grid(steps)
    if state.alg is ConfidenceRule.RANDOM:
        # Walk Dream's grid: a position still masked after step j with probability
        # t_(j+1) / t_g fires at the first step its uniform exceeds that ratio.
        def fires(u):
            return next(j for j in range(g, steps) if j == steps - 1 or u > grid[j + 1] / grid[g])

        first = min(fires(rank[j]) for j in range(n))
        return {j for j in range(n) if fires(rank[j]) == first}, first - g + 1
    index = next(i for i in range(g, steps) if _dream_count(steps, i, n) > 0)
    return set(by_rank[: _dream_count(steps, index, n)]), index - g + 1


def test_every_schedule_commits_like_the_per_row_reference():
    states = [
        _state(0),
        _state(1, masked=6, steps_per_block=3),
        _state(2, masked=7, steps_per_block=BLOCK, alg="entropy", timestep=1),
        _state(3, steps_per_block=BLOCK, alg="maskgit_plus"),
        _state(4, masked=5, steps_per_block=4, alg="origin", timestep=1),
        _state(5, steps_per_block=BLOCK, alg="origin"),
        _state(6, alg="topk_margin", alg_temp=0.5),
        _state(7, masked=3, steps_per_block=2, alg="topk_margin", alg_temp=0.5, timestep=1),
    ]
    b = len(states)
    masked = torch.tensor([s.masked_in_block for s in states])
    candidate = torch.arange(BLOCK)[None, :] < masked[:, None]
    generator = torch.Generator().manual_seed(5)
    for trial in range(20):
        confidence = torch.rand((b, BLOCK), generator=generator)
        rank = torch.rand((b, BLOCK), generator=generator)
        tau = torch.full((b,), 0.97 if trial % 2 else 0.6)
        x0 = torch.randint(0, 50, (b, BLOCK), generator=generator)
        ids = torch.full((b, BLOCK), M)
        result = threshold_commit_reference(x0, confidence, candidate, tau, ids)
        rank = torch.where(candidate, rank, -torch.inf)
        result, passed = RowSchedule(states, torch.device("cpu")).commit(
            result, rank, candidate, tau, ids, M
        )
        for i, state in enumerate(states):
            n = int(masked[i])
            want, steps = _reference_commit(
                state, confidence[i, :n].tolist(), rank[i, :n].tolist(), n, float(tau[i])
            )
            got = set(result.committed[i].nonzero().flatten().tolist())
            assert got == want and int(passed[i]) == steps, (i, trial)
            assert int(result.counts[i]) == len(want)
            assert ids[i].tolist() == [int(x0[i, j]) if j in want else M for j in range(BLOCK)]


def test_the_random_rule_fires_as_dreams_bernoulli_steps_do():
    """From a block's start, Dream commits each masked position with probability
    p_j = 1 - t_(j+1) / t_j at step j; a step where none fires changes nothing. The chance
    that step j is the first to commit, with c positions: Π_(l<j) (1-p_l)^n · C(n,c) p_j^c
    (1-p_j)^(n-c)."""
    steps, n, rows = 4, 3, 40_000
    grid = _dream_grid(steps)
    p = [1 - grid[j + 1] / grid[j] for j in range(steps - 1)] + [1.0]
    want = {}
    for j in range(steps):
        quiet = math.prod((1 - p[step]) ** n for step in range(j))
        for c in range(1, n + 1):
            want[(j + 1, c)] = quiet * math.comb(n, c) * p[j] ** c * (1 - p[j]) ** (n - c)
    survival = torch.tensor([grid[j + 1] / grid[0] for j in range(steps - 1)]).expand(rows, -1)
    uniform = torch.rand((rows, n), generator=torch.Generator().manual_seed(11))
    fired, passed = first_fired(uniform, survival, torch.ones((rows, n), dtype=torch.bool))
    outcomes = list(zip(passed.tolist(), fired.sum(dim=1).tolist(), strict=True))
    for key, chance in want.items():
        assert outcomes.count(key) / rows == pytest.approx(chance, abs=0.01), key


def test_alg_temp_draws_positions_from_softmax_of_score_over_alg_temp():
    vocab, m, rows, alg_temp = 6, 4, 8000, 0.25
    logits = 2 * torch.randn(1, m, vocab, generator=torch.Generator().manual_seed(2))
    # Two steps over four positions: the first commits int(4 × 0.4995) = 1 of them.
    states = [
        _state(i, masked=m, steps_per_block=2, alg="maskgit_plus", alg_temp=alg_temp)
        for i in range(rows)
    ]
    candidate = torch.arange(BLOCK)[None, :m].expand(rows, m) >= 0
    sampling = RowSampling.of(states, torch.device("cpu"))
    x0, confidence, rank = sampling.scores(  # type: ignore[union-attr]
        logits.expand(rows, m, vocab), torch.Generator().manual_seed(4)
    )
    ids = torch.full((rows, m), M)
    tau = torch.ones(rows)
    result = threshold_commit_reference(x0, confidence, candidate, tau, ids)
    result, _ = RowSchedule(states, torch.device("cpu")).commit(
        result, rank, candidate, tau, ids, M
    )
    assert bool((result.counts == 1).all())
    freq = result.committed.float().mean(dim=0)
    score = torch.softmax(logits[0].float(), dim=-1).max(dim=-1).values
    torch.testing.assert_close(freq, torch.softmax(score / alg_temp, dim=0), atol=0.02, rtol=0)


# -- whole decodes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dream(tiny_dream_dir):
    return load_model(tiny_dream_dir)


def _dream_generate(model, prompt, gen_length, block, steps, alg, top_p=None, top_k=None):
    """Dream's `_sample` at temperature 0, block by block (one block: its own setting):
    logits shifted one position right, every step of its grid run, zero counts included."""
    mask = model.config.mask_token_id
    x = torch.tensor(prompt + [mask] * gen_length)
    n = x.numel()
    grid = torch.linspace(1, 1e-3, steps + 1)
    for lo in range(len(prompt), n, block):
        for i in range(steps):
            masked = x[lo : lo + block] == mask
            raw = model(x[None], torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))[0]
            logits = torch.cat([raw[:1], raw[:-1]])[lo : lo + block][masked].float()
            if top_p is not None:
                probs = torch.softmax(logits, dim=-1).tolist()
                dropped = [[v not in _nucleus(p, top_p) for v in range(len(p))] for p in probs]
                logits = logits.masked_fill(torch.tensor(dropped), torch.finfo(logits.dtype).min)
            if top_k is not None:
                kth = torch.topk(logits, top_k).values[..., -1, None]
                logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
            probs = torch.softmax(logits, dim=-1)
            confidence, x0 = probs.max(dim=-1)
            if alg == "topk_margin":
                top2 = torch.sort(probs, dim=-1, descending=True).values
                confidence = top2[:, 0] - top2[:, 1]
            elif alg == "entropy":
                confidence = (probs * torch.log(probs + 1e-10)).sum(dim=-1)
            num = masked.sum() / 1
            k = int(num * (1 - grid[i + 1] / grid[i])) if i < steps - 1 else int(num)
            full = torch.full((block,), -torch.inf)
            full[masked] = confidence
            proposal = torch.full((block,), mask)
            proposal[masked] = x0
            if k > 0:
                picked = torch.topk(full, k).indices
                x[lo + picked] = proposal[picked]
    return x[len(prompt) :].tolist()


def _decode(runner, gen_length, block=BLOCK, tau=0.9, **options):
    mask = runner.config.mask_token_id
    runner.add(
        RequestState.new(0, PROMPT, gen_length, block_length=block, mask_token_id=mask, **options)
    )
    committed = []
    while not runner.state(0).done:
        (out,) = runner.step([StepEntry(0, tau, runner.next_kind(0))]).outputs
        committed.append(len(out.committed_positions))
    return runner.release(0).output_ids, committed


@pytest.mark.parametrize(
    "alg, block, steps, filters",
    [
        ("maskgit_plus", BLOCK, 4, {}),
        ("topk_margin", BLOCK, 3, {}),
        ("entropy", BLOCK, BLOCK, {}),
        ("entropy", 2 * BLOCK, 5, {"top_k": 3}),
        ("maskgit_plus", 2 * BLOCK, 2 * BLOCK, {"top_p": 0.25}),
    ],
)
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_fixed_schedule_decodes_as_dreams_generate(dream, alg, block, steps, filters, cache):
    runner = StepRunner(dream, cache=cache, max_requests=1, max_seq_len=64)
    got, committed = _decode(runner, 2 * BLOCK, block, alg=alg, steps_per_block=steps, **filters)
    if cache == "none":
        want = _dream_generate(dream, PROMPT, 2 * BLOCK, block, steps, alg, **filters)
        assert got == want
    assert min(committed) >= 1
    # A step Dream runs with nothing to commit is skipped: never more steps than its grid.
    blocks = 2 * BLOCK // block
    assert len(committed) <= blocks * steps
    if steps == block:
        assert len(committed) < blocks * steps


def test_seeded_runners_repeat_every_random_draw(dream):
    options = [
        {"alg": "origin", "temperature": 1.0, "steps_per_block": 4},
        {"alg": "origin", "tau": 0.5},
        {"alg": "entropy", "alg_temp": 0.5, "steps_per_block": 4, "top_p": 0.9},
        {"alg": "topk_margin", "alg_temp": 0.5, "temperature": 0.8, "top_k": 5},
    ]
    for option in options:
        runs = [_decode(StepRunner(dream, max_requests=1), 2 * BLOCK, **option) for _ in range(2)]
        assert runs[0] == runs[1], option
        tokens, committed = runs[0]
        assert M not in tokens and min(committed) >= 1
        if "steps_per_block" in option:
            assert len(committed) <= 2 * option["steps_per_block"]


def test_top_k_one_samples_the_argmax_at_any_temperature(dream):
    greedy, _ = _decode(StepRunner(dream, max_requests=1), 2 * BLOCK, steps_per_block=4)
    hot, _ = _decode(
        StepRunner(dream, max_requests=1), 2 * BLOCK, steps_per_block=4, temperature=2.0, top_k=1
    )
    assert hot == greedy


#: Options scored over every logit, and the argmax rule beside them in one batch.
TP_OPTIONS = [
    {},
    {"alg": "maskgit_plus", "steps_per_block": 4},
    {"alg": "entropy", "steps_per_block": 8, "top_k": 3},
    {"temperature": 2.0, "top_k": 1},
]


def _decode_batch(model) -> list[list[int]]:
    """Every option of `TP_OPTIONS` decoded in shared steps on one runner."""
    runner = StepRunner(model, max_requests=len(TP_OPTIONS))
    mask = model.config.mask_token_id
    for rid, option in enumerate(TP_OPTIONS):
        runner.add(
            RequestState.new(
                rid, PROMPT, 2 * BLOCK, block_length=BLOCK, mask_token_id=mask, **option
            )
        )
    todo = set(range(len(TP_OPTIONS)))
    while todo:
        runner.step([StepEntry(rid, 0.9, runner.next_kind(rid)) for rid in sorted(todo)])
        todo = {rid for rid in todo if not runner.state(rid).done}
    return [runner.release(rid).output_ids for rid in range(len(TP_OPTIONS))]


def test_tensor_parallel_instances_gather_the_logits_that_options_need(dream, tiny_dream_dir):
    # Rank 0 joins the ranks' logit shards for such steps: the same tokens as one rank.
    assert run_on_group(2, tiny_dream_dir, _decode_batch, timeout_s=300) == _decode_batch(dream)
