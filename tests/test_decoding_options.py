"""Dream's generation options on the token state: validation, its timestep schedule's
counts (against Dream's float32 tensor arithmetic), skipped steps and the wire format."""

from __future__ import annotations

import pytest
import torch

from dilaserve.decoding import (
    ConfidenceRule,
    dream_step,
    dream_transfer_count,
    option_problem,
)
from dilaserve.protocol import (
    RequestState,
    StepCommand,
    TokenStateError,
    decode_engine_message,
    encode,
)

M = 99


def _dream_count(steps: int, index: int, masked: int) -> int:
    """Dream's `_sample` arithmetic: tensors on a `linspace` grid, a float32 mask count."""
    timesteps = torch.linspace(1, 1e-3, steps + 1)
    if index == steps - 1:
        return masked
    num_mask_token = torch.tensor([[True] * masked]).sum() / 1
    t, s = timesteps[index], timesteps[index + 1]
    return int(num_mask_token * (1 - s / t))


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 8, 16, 32, 64])
def test_transfer_counts_are_dreams(steps):
    for index in range(steps):
        for masked in (1, 2, 5, 8, 31, 32, 64):
            assert dream_transfer_count(steps, index, masked) == _dream_count(steps, index, masked)


def test_steps_that_would_commit_nothing_are_skipped():
    # 8 steps over 8 positions: Dream's first step commits int(8 × 0.1249) = 0 tokens.
    assert dream_transfer_count(8, 0, 8) == 0
    assert dream_step(8, 0, 8) == (1, 1)
    # The last step takes whatever is left, so a step is always found.
    assert dream_step(8, 7, 3) == (7, 3)
    state = RequestState.new(
        1, [1], 8, block_length=8, mask_token_id=M, steps_per_block=8, alg="entropy"
    )
    assert state.dream_step() == (1, 1) and state.transfer_count() == 1


def test_commit_advances_the_grid_by_the_steps_passed_and_resets_per_block():
    state = RequestState.new(
        1, [1], 8, block_length=4, mask_token_id=M, steps_per_block=4, alg="maskgit_plus"
    )
    state.commit(0, [0], [5], timesteps=2)
    assert state.timestep == 2 and state.block_steps == 1
    state.commit(0, [1, 2, 3], [5, 5, 5], timesteps=2)
    assert state.timestep == 0 and state.block_steps == 0 and state.current_block == 1


def test_the_random_rule_has_no_count_to_skip_by():
    state = RequestState.new(
        1, [1], 8, block_length=8, mask_token_id=M, steps_per_block=4, alg="origin"
    )
    with pytest.raises(TokenStateError, match="no count"):
        state.transfer_count()


@pytest.mark.parametrize(
    "options, param",
    [
        ({"alg": "greedy"}, "alg"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"alg_temp": -1.0}, "alg_temp"),
        ({"alg_temp": float("inf"), "alg": "entropy"}, "alg_temp"),
        ({"alg_temp": 0.5}, "alg_temp"),
        ({"alg_temp": 0.5, "alg": "origin"}, "alg_temp"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_bad_options_name_their_parameter(options, param):
    full = {"alg": None, "alg_temp": 0.0, "top_p": 1.0, "top_k": None} | options
    problem = option_problem(**full)
    assert problem is not None and problem[0] == param
    with pytest.raises(TokenStateError, match=param):
        RequestState.new(1, [1], 8, block_length=8, mask_token_id=M, **options)


def test_dreams_schedule_never_takes_more_steps_than_positions():
    with pytest.raises(TokenStateError, match="exceeds the block length"):
        RequestState.new(
            1, [1], 8, block_length=8, mask_token_id=M, steps_per_block=9, alg="entropy"
        )
    # LLaDA's equal shares keep their meaning: one position per step at most.
    RequestState.new(1, [1], 8, block_length=8, mask_token_id=M, steps_per_block=9)


def test_good_options_pass_and_only_sampling_or_a_rule_needs_the_full_logits():
    assert option_problem(alg="topk_margin", alg_temp=0.2, top_p=0.0, top_k=1) is None
    plain = RequestState.new(1, [1], 8, block_length=8, mask_token_id=M, top_p=0.9, top_k=3)
    assert not plain.needs_full_logits
    for options in ({"temperature": 0.5}, {"alg": "maskgit_plus"}):
        state = RequestState.new(1, [1], 8, block_length=8, mask_token_id=M, **options)
        assert state.needs_full_logits


def test_options_cross_the_wire_as_dreams_names():
    state = RequestState.new(
        7,
        [1, 2],
        8,
        block_length=4,
        mask_token_id=M,
        alg="topk_margin",
        alg_temp=0.3,
        top_p=0.9,
        top_k=5,
        steps_per_block=2,
    )
    state.timestep = 1
    decoded = decode_engine_message(encode(StepCommand(step=1, admit=[state])))
    (got,) = decoded.admit
    assert got == state and got.alg is ConfidenceRule.MARGIN and got.timestep == 1
    assert b"topk_margin" in encode(StepCommand(step=1, admit=[state]))
