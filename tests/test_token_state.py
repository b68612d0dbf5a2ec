"""The core's token state (what the engine resumes requests from) follows the worker's rules
(`RequestState.commit`) step for step, and a packed report is applied all or nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_profiles import make_profile

from dilaserve._core import STEP_KINDS, HeldTokens
from dilaserve.protocol import CONFIDENCE_STATS, RequestState, StepKind, StepOutput, StepReport
from dilaserve.scheduler import Scheduler, StepReportError

MASK, EOS = 99, 7
BLOCK = 4


def serving(requests: dict[int, RequestState], fixed: frozenset[int] = frozenset()) -> Scheduler:
    s = Scheduler(make_profile((1,)))
    s.add_instance(0, tp=1, gpus=[0])
    for rid, state in requests.items():
        s.arrive(
            rid,
            arrival=0.0,
            deadline=100.0,
            prompt_len=state.prompt_length,
            output_len=state.output_length,
            block_length=BLOCK,
            mask_token=MASK,
            stop_tokens=state.stop_token_ids,
            fixed_schedule=rid in fixed,
        )
    return s


def a_step(states: dict[int, RequestState], rng: random.Random) -> StepReport:
    """A report committing some masked positions of each request's current block, applied
    to `states` as the worker applies it."""
    report = StepReport(step=1)
    for rid, state in states.items():
        block = state.current_block
        masked = [
            p
            for p in range(block * BLOCK, (block + 1) * BLOCK)
            if state.output_ids[p] == state.mask_token_id
        ]
        positions = sorted(rng.sample(masked, rng.randint(1, len(masked))))
        tokens = [rng.choice((1, 2, 3, EOS)) for _ in positions]
        timesteps = rng.randint(1, 3)
        state.commit(block, positions, tokens, timesteps)
        stats = (0.5,) * CONFIDENCE_STATS
        report.add(
            StepOutput(rid, StepKind.CACHE, block, positions, tokens, stats, state.done, timesteps)
        )
    return report


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), blocks=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_the_core_token_state_follows_the_workers_rules(seed, blocks):
    rng = random.Random(seed)
    states = {
        rid: RequestState.new(
            rid, [1, 2], n * BLOCK, block_length=BLOCK, mask_token_id=MASK, stop_token_ids=[EOS]
        )
        for rid, n in enumerate(blocks, start=1)
    }
    s = serving({rid: st_.copy() for rid, st_ in states.items()})
    sent_blocks = dict.fromkeys(states, 0)
    while states:
        s.schedule(0.0)
        outcome = s.apply_report(0, 0.01, a_step(states, rng))
        finished = {f.served.id: f for f in outcome.finished}
        updates = dict(outcome.updates)
        for rid, state in list(states.items()):
            if rid in finished:
                assert state.done
                f = finished[rid]
                assert f.generated == state.generated_ids()
                assert f.completion_tokens == sum(t != MASK for t in state.generated_ids())
                del states[rid]
                continue
            assert not state.done
            core = s.token_state(rid)
            assert core.output_ids == state.output_ids
            assert (core.steps_done, core.block_steps, core.timestep) == (
                state.steps_done,
                state.block_steps,
                state.timestep,
            )
            if state.complete_blocks > sent_blocks[rid]:
                ids = state.output_ids[: state.complete_blocks * BLOCK]
                stop = state.stop_position
                assert updates.pop(rid) == (ids[:stop] if stop is not None else ids)
                sent_blocks[rid] = state.complete_blocks
        assert not updates


def test_rates_count_threshold_rule_steps_per_tau_only():
    states = {
        rid: RequestState.new(rid, [1], 8, block_length=BLOCK, mask_token_id=MASK) for rid in (1, 2)
    }
    s = serving({rid: st_.copy() for rid, st_ in states.items()}, fixed=frozenset({2}))
    d = s.schedule(0.0)
    tau = float(d.entry_taus[0])
    outcome = s.apply_report(0, 0.01, a_step(states, random.Random(0)))
    committed = states[1].num_committed
    assert outcome.rates == [(tau, 1, committed)]


def test_a_bad_report_changes_neither_the_tokens_nor_the_scheduler():
    states = {
        rid: RequestState.new(rid, [1], 8, block_length=BLOCK, mask_token_id=MASK) for rid in (1, 2)
    }
    s = serving({rid: st_.copy() for rid, st_ in states.items()})
    s.schedule(0.0)
    good = StepOutput(1, StepKind.RECOMPUTE, 0, [0], [5], (0.5,) * CONFIDENCE_STATS, False)
    outside = StepOutput(2, StepKind.RECOMPUTE, 0, [5], [5], (0.5,) * CONFIDENCE_STATS, False)
    report = StepReport(step=1)
    report.add(good)
    report.add(outside)
    with pytest.raises(StepReportError, match="outside block 0"):
        s.apply_report(0, 0.01, report)
    assert s.token_state(1).output_ids == [MASK] * 8 and s.request(1).unmasked == 0
    report = StepReport(step=1)
    report.add(good)  # request 2 is missing from its batch
    with pytest.raises(StepReportError, match="missing|2"):
        s.apply_report(0, 0.01, report)
    assert s.token_state(1).steps_done == 0


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_the_workers_token_state_follows_request_state(seed, blocks):
    """The worker's token state (`HeldTokens`, which decides `done` from the current block
    alone) agrees with `RequestState.commit` and `RequestState.done`, which scans the whole
    output, after every step: output, counters, cache validity and finish."""
    rng = random.Random(seed)
    state = RequestState.new(1, [5, 6], blocks * BLOCK, block_length=BLOCK, mask_token_id=MASK)
    state.stop_token_ids = [EOS]
    held = HeldTokens()
    held.add(1, state.prompt_ids, state.output_ids, BLOCK, MASK, [EOS], False, (0, 0, 0))
    while not state.done:
        block = state.current_block
        masked = [
            p for p in range(block * BLOCK, (block + 1) * BLOCK) if state.output_ids[p] == MASK
        ]
        chosen = sorted(rng.sample(range(len(masked)), rng.randint(1, len(masked))))
        positions = [masked[j] for j in chosen]
        tokens = [rng.choice((1, 2, EOS)) for _ in positions]
        timesteps = rng.randint(1, 3)
        host = [0.0] * (3 * len(masked) + 1)
        for j, token in zip(chosen, tokens, strict=True):
            host[j], host[len(masked) + j] = 1.0, float(token)
        host[-1] = float(timesteps)
        kind = rng.choice(("recompute", "cache"))
        was_valid = held.cache_valid(1)
        report = held.commit([1], [STEP_KINDS.index(kind)], np.array([host]))
        state.commit(block, positions, tokens, timesteps)
        assert report[2] == positions and report[5] == [state.done]
        assert held.output(1) == state.output_ids and held.done(1) == state.done
        counters = (state.steps_done, state.block_steps, state.timestep, state.masked_in_block)
        assert held.counters(1) == counters
        valid = state.block_steps != 0 and (was_valid or kind == "recompute")
        assert held.cache_valid(1) == valid
