"""Token-state bookkeeping: blocks, completion, EOS stopping, wire round trip."""

import pytest

from dilaserve.worker.state import CacheMode, InvalidRequestError, RequestState, StepKind

M = 99


def test_new_rounds_output_to_whole_blocks():
    s = RequestState.new("r", [1, 2], 70, block_length=32, mask_token_id=M)
    assert s.output_length == 96
    assert s.num_masked == 96
    assert s.current_block == 0
    assert not s.done


@pytest.mark.parametrize("gen,block", [(0, 32), (-1, 32), (8, 0)])
def test_new_rejects_bad_lengths(gen, block):
    with pytest.raises(InvalidRequestError):
        RequestState.new("r", [1], gen, block_length=block, mask_token_id=M)


def test_current_block_and_done():
    s = RequestState.new("r", [1], 8, block_length=4, mask_token_id=M)
    s.output_ids[:4] = [5, 6, 7, 8]
    assert s.current_block == 1
    s.output_ids[4:] = [1, 1, 1, 1]
    assert s.done and s.current_block == 2 and s.first_masked() is None


def test_eos_stops_only_when_everything_before_it_is_unmasked():
    s = RequestState.new("r", [1], 8, block_length=4, mask_token_id=M, eos_token_id=3)
    s.output_ids = [5, M, 3, M, M, M, M, M]
    assert not s.done
    s.output_ids[1] = 6
    assert s.done
    assert s.generated_ids() == [5, 6]


def test_step_kind_follows_cache_mode_and_block_steps():
    s = RequestState.new("r", [1], 8, block_length=4, mask_token_id=M)
    assert s.next_step_kind(CacheMode.NONE) is StepKind.NO_CACHE
    assert s.next_step_kind(CacheMode.DUAL) is StepKind.RECOMPUTE
    s.block_steps = 2
    assert s.next_step_kind(CacheMode.PREFIX) is StepKind.CACHE


def test_dict_round_trip_validates():
    s = RequestState.new("r", [1, 2], 8, block_length=4, mask_token_id=M)
    assert RequestState.from_dict(s.to_dict()) == s
    data = s.to_dict() | {"output_ids": [M] * 5}
    with pytest.raises(InvalidRequestError):
        RequestState.from_dict(data)
