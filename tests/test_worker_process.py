"""What a worker does with one command: residency changes, then the step for every entry
it can run; a refused request is reported alone and the others still step."""

from __future__ import annotations

import pytest

from dilaserve.models import load_model
from dilaserve.protocol import RequestState, StepCommand, StepEntry, StepKind
from dilaserve.worker.process import execute
from dilaserve.worker.runner import StepRunner

BLOCK = 8


@pytest.fixture
def runner(tiny_llada_dir):
    model = load_model(tiny_llada_dir, dtype="float32", device="cpu")
    return StepRunner(model, cache="dual", max_requests=2, max_seq_len=64)


def _state(runner, rid, prompt=(1, 2, 3)):
    mask = runner.config.mask_token_id
    return RequestState.new(rid, list(prompt), 2 * BLOCK, block_length=BLOCK, mask_token_id=mask)


def test_admits_steps_and_releases(runner):
    report = execute(
        runner,
        StepCommand.of(5, [StepEntry(1, 1.0, StepKind.RECOMPUTE)], admit=[_state(runner, 1)]),
    )
    assert report.step == 5 and report.failure is None and not report.errors
    assert [o.request_id for o in report.outputs] == [1]
    assert report.forward_tokens == 3 + 2 * BLOCK
    report = execute(runner, StepCommand(step=6, release=[1, 99]))
    assert report.outputs == [] and 1 not in runner


def test_a_refused_request_does_not_stop_the_others(runner):
    mask = runner.config.mask_token_id
    bad = RequestState(2, [mask], [mask] * BLOCK, BLOCK, mask)  # prompt holds the mask token
    command = StepCommand.of(
        1,
        [
            StepEntry(1, 1.0, StepKind.RECOMPUTE),
            StepEntry(2, 1.0, StepKind.RECOMPUTE),
            StepEntry(3, 1.0, StepKind.CACHE),  # no K/V here yet
            StepEntry(4, 1.0, StepKind.RECOMPUTE),  # never admitted
        ],
        admit=[_state(runner, 1), bad, _state(runner, 3)],
    )
    report = execute(runner, command)
    assert [o.request_id for o in report.outputs] == [1]
    assert {e.request_id for e in report.errors} == {2, 3, 4}
    assert "mask token" in next(e.message for e in report.errors if e.request_id == 2)


def test_a_failed_step_changes_nothing(runner, monkeypatch):
    execute(runner, StepCommand(step=1, admit=[_state(runner, 1)]))
    before = runner.state(1)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(runner.model, "forward", out_of_memory)
    report = execute(runner, StepCommand.of(2, [StepEntry(1, 1.0, StepKind.RECOMPUTE)]))
    assert report.failure is not None and "out of memory" in report.failure
    assert runner.state(1) == before


def test_a_step_ahead_runs_the_kind_the_state_calls_for_and_skips_a_finished_request(runner):
    """`AUTO` (a step sent ahead): recompute where no K/V of the block is held, cache
    where it is, and nothing for a request the step before finished."""
    auto = [StepEntry(1, 1.0, StepKind.AUTO)]  # τ 1: one position a step
    execute(runner, StepCommand(step=0, admit=[_state(runner, 1)]))
    kinds = []
    while not runner.finished(1):
        report = execute(runner, StepCommand.of(len(kinds) + 1, auto))
        assert not report.errors
        kinds += report.kinds
    block = [StepKind.RECOMPUTE] + [StepKind.CACHE] * (BLOCK - 1)
    assert kinds == 2 * block
    report = execute(runner, StepCommand.of(99, auto))
    assert report.outputs == [] and not report.errors
    # An entry of a request this worker never held is still refused.
    report = execute(runner, StepCommand.of(100, [StepEntry(9, 1.0, StepKind.AUTO)]))
    assert [e.request_id for e in report.errors] == [9]
