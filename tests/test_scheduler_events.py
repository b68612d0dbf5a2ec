"""What an asyncio engine needs from the scheduler's Python API: instance capacity,
completion-time choice with busy instances, reservations, failed steps, drained instances,
reused ids, admission, and the per-step and per-request records it gets back."""

from __future__ import annotations

import itertools
import math

import pytest
from sched_profiles import flat_profile, make_profile, report

from dilaserve import _core, scheduler
from dilaserve.scheduler import (
    AdmissionError,
    Batch,
    BatchEntry,
    FinishedRequest,
    LatencyProfile,
    Migration,
    Policy,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    StepReportError,
    StepResult,
    UnknownInstanceError,
    Waiting,
)


@pytest.fixture
def profile() -> LatencyProfile:
    return make_profile()


def ids(batch: Batch | None) -> list[int]:
    return [] if batch is None else [e.request for e in batch.entries]


def test_new_names_are_exported() -> None:
    assert "no_kv_room" in scheduler.WAIT_REASONS and "queued_busy" in scheduler.WAIT_REASONS
    assert "step_aborted" in scheduler.MIGRATION_REASONS
    assert _core.AdmissionError is AdmissionError
    assert issubclass(AdmissionError, SchedulerError)


def test_instances_bound_resident_requests_and_batches(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0], kv_tokens=500)
    s.add_instance(2, tp=1, gpus=[1], max_requests=1)
    s.add_instance(3, tp=1, gpus=[2], max_batch_tokens=200)
    for rid in range(4):
        s.arrive(rid, arrival=0.0, deadline=100.0, prompt_len=268, output_len=32)
    d = s.schedule(0.0)
    assert len(ids(d.batch_for(1))) == 1 and len(ids(d.batch_for(2))) == 1
    assert d.batch_for(3) is None, "a 300-token step exceeds its 200-token budget"
    info = s.instance(1)
    assert (info.kv_tokens, info.max_requests, info.max_batch_tokens) == (500, None, 8192)
    assert info.resident_tokens <= 500
    assert s.instance(2).residents == 1 and s.instance(3).max_batch_tokens == 200
    with pytest.raises(SchedulerError, match="kv_tokens must be at least 1"):
        s.add_instance(4, tp=1, gpus=[3], kv_tokens=0)


def test_no_kv_room_and_reservation(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0], kv_tokens=700)
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=368, output_len=32)
    s.arrive(2, arrival=0.0, deadline=10.0, prompt_len=368, output_len=32)
    d = s.schedule(0.0)
    assert ids(d.batch_for(1)) == [1]
    assert d.waiting == [Waiting(2, "no_kv_room")]
    assert s.instance(1).reserved_for == 2
    s.step_done(1, 0.05, report(d.batches[0], 32))
    assert ids(s.schedule(0.1).batch_for(1)) == [2]
    assert s.instance(1).reserved_for is None


def test_busy_instance_that_completes_first_is_waited_for(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(4, tp=4, gpus=[0, 1, 2, 3])
    s.arrive(1, arrival=0.0, deadline=100.0, prompt_len=10, output_len=32)
    s.schedule(0.0)
    s.add_instance(1, tp=1, gpus=[4])
    for rid in range(2, 8):
        s.arrive(rid, arrival=0.0, deadline=100.0, prompt_len=1968, output_len=32)
    d = s.schedule(0.0)
    assert d.waiting[0] == Waiting(2, "queued_busy")
    on_tp1 = ids(d.batch_for(1))
    assert on_tp1 and 2 not in on_tp1, "queued tokens load the busy instance"


def test_least_loaded_counts_resident_tokens(profile: LatencyProfile) -> None:
    s = Scheduler(profile, SchedulerConfig(policy=scheduler.Policy.llumnix_like(0.9)))
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=1.0, deadline=100.0, prompt_len=1000, output_len=64)
    d = s.schedule(1.0)
    s.step_done(1, 0.05, report(d.batches[0], 32))
    s.add_instance(2, tp=1, gpus=[1])
    s.arrive(2, arrival=0.0, deadline=100.0, prompt_len=10, output_len=32)
    d = s.schedule(1.1)
    assert ids(d.batch_for(2)) == [2] and ids(d.batch_for(1)) == [1]


def test_small_stream_never_starves_a_large_request(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0], kv_tokens=1000)
    now, rid, waited = 0.0, 10, None
    for round_ in range(200):
        for _ in range(2):
            s.arrive(rid, arrival=now, deadline=now + 50.0, prompt_len=68, output_len=64)
            rid += 1
        if round_ == 3:
            s.arrive(1, arrival=now, deadline=now + 50.0, prompt_len=868, output_len=32)
        d = s.schedule(now)
        if 1 in d.entry_requests.tolist():
            waited = round_ - 3
            break
        for b in d.batches:
            results = [StepResult(e.request, min(4, 32 - e.unmasked_in_block)) for e in b.entries]
            s.step_done(b.instance, 0.05, results)
        now += 0.05
    assert waited is not None and waited <= 40


def test_abort_step(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.arrive(2, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.step_done(1, 0.05, report(s.schedule(0.0).batches[0]))
    d = s.schedule(0.1)
    assert {e.kind for e in d.batches[0].entries} == {"cache"}
    assert s.abort_step(1) == [1, 2]
    with pytest.raises(StepReportError, match="no step in flight"):
        s.abort_step(1)
    assert s.instance(1).batch == [] and s.instance(1).residents == 0
    info = s.request(1)
    assert (info.in_flight, info.instance, info.next_kind, info.steps_done) == (
        False,
        None,
        "recompute",
        1,
    )
    s.add_instance(2, tp=1, gpus=[1])
    s.drain_instance(1)
    d = s.schedule(0.2)
    assert d.migrations == [Migration(1, 1, 2, "step_aborted"), Migration(2, 1, 2, "step_aborted")]
    with pytest.raises(UnknownInstanceError):
        s.abort_step(9)


def test_abort_step_returns_the_requests_of_the_step(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    for rid in (5, 6, 7):
        s.arrive(rid, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.schedule(0.0)
    s.cancel(6)
    assert s.abort_step(1) == [5, 7]


def test_drained_and_undrained_instances(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.add_instance(2, tp=1, gpus=[1])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    d = s.schedule(0.0)
    s.drain_instance(1)
    s.drain_instance(2)
    assert s.drained_instances() == [2], "instance 1 is busy and holds a request"
    s.step_done(1, 0.05, report(d.batches[0], 32))
    assert s.drained_instances() == [2]
    s.undrain_instance(2)
    assert s.drained_instances() == []
    assert ids(s.schedule(0.1).batch_for(2)) == [1]
    assert s.drained_instances() == [1]


def test_reused_id_is_not_confused_with_the_cancelled_one(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(7, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.arrive(8, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    on_a = s.schedule(0.0).batches[0]
    s.cancel(7)
    s.add_instance(2, tp=1, gpus=[1])
    s.arrive(7, arrival=0.1, deadline=10.0, prompt_len=10, output_len=64)
    assert ids(s.schedule(0.1).batch_for(2)) == [7]
    assert s.step_done(1, 0.05, report(on_a, 5)) == []
    new7 = s.request(7)
    assert (new7.in_flight, new7.steps_done, new7.instance) == (True, 0, 2)
    s.step_done(2, 0.05, [StepResult(7, 3)])
    assert s.request(7).unmasked == 3


def test_confidence_statistics(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.arrive(2, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.schedule(0.0)
    conf = (0.1, 0.2, 0.4, 0.45, 0.7)
    bad = (0.1, math.nan, 0.4, 0.45, math.inf)
    s.step_done(1, 0.05, [StepResult(1, 4, conf), StepResult(2, 4, bad)])
    assert s.request(1).confidence == conf
    assert s.request(2).confidence is None, "non-finite statistics are dropped alone"
    s.schedule(0.1)
    s.step_done(1, 0.05, [StepResult(1, 28, conf), StepResult(2, 4, conf)])
    assert s.request(1).confidence is None, "a completed block's statistics are dropped"
    assert s.request(2).confidence == conf


def test_admission_while_overloaded(profile: LatencyProfile) -> None:
    config = SchedulerConfig(
        max_batch_tokens=1000,
        slo_window_s=0.01,
        max_queued=2,
        policy=Policy.dilaserve().without_admission(),
    )
    s = Scheduler(profile, config)
    s.add_instance(1, tp=1, gpus=[0])
    for rid in range(4):
        s.arrive(rid, arrival=0.0, deadline=10.0, prompt_len=900, output_len=64)
    assert not s.overloaded and s.queued_requests == 4
    d = s.schedule(0.0)
    assert d.overloaded and s.overloaded and s.queued_requests == 3
    with pytest.raises(AdmissionError, match="overloaded and 3 requests"):
        s.arrive(4, arrival=0.0, deadline=10.0, prompt_len=10, output_len=32)
    assert s.active_requests == 4
    s.cancel(3)
    s.cancel(2)
    s.arrive(4, arrival=0.0, deadline=10.0, prompt_len=10, output_len=32)


def test_late_request_runs_to_completion(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=0.05, prompt_len=10, output_len=64)
    now, done = 0.0, []
    while not done:
        assert now < 5.0
        done = s.step_done(1, 0.1, report(s.schedule(now).batches[0], 4))
        now += 0.1
    (f,) = done
    assert (f.id, f.steps, f.deadline) == (1, 16, 0.05) and now > f.deadline


def test_entries_carry_tokens_and_block_position(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=100, output_len=64)
    d = s.schedule(0.0)
    assert d.batches[0].entries == [BatchEntry(1, 0.9, "recompute", True, 164, 0, 0)]
    s.step_done(1, 0.05, [StepResult(1, 5)])
    d = s.schedule(0.1)
    (e,) = d.batches[0].entries
    assert (e.kind, e.tokens, e.block, e.unmasked_in_block) == ("cache", 32, 0, 5)
    assert d.entry_tokens.tolist() == [32]
    assert d.entry_blocks.tolist() == [0] and d.entry_unmasked_in_block.tolist() == [5]
    s.step_done(1, 0.05, [StepResult(1, 27)])
    d = s.schedule(0.2)
    assert (d.entry_tokens.tolist(), d.entry_blocks.tolist()) == ([164], [1])


def test_finished_requests_carry_their_history(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.5, deadline=10.0, prompt_len=1900, output_len=64)
    s.arrive(2, arrival=0.5, deadline=10.0, prompt_len=1900, output_len=64)
    s.step_done(1, 0.05, report(s.schedule(1.0).batches[0], 32))
    s.add_instance(2, tp=1, gpus=[1])
    now, commit, finished = 1.1, 2, []
    while s.active_requests:
        d = s.schedule(now)
        for b in d.batches:
            finished += s.step_done(b.instance, 0.05, report(b, commit))
        now, commit = now + 0.1, 15
    for f in sorted(finished, key=lambda f: f.id):
        assert isinstance(f, FinishedRequest)
        assert (f.steps, f.recompute_steps, len(f.taus)) == (4, 2, 4)
        assert (f.arrival, f.deadline, f.first_dispatch) == (0.5, 10.0, 1.0)
        assert all(t in (0.5, 0.6, 0.7, 0.8, 0.9) for t in f.taus)
    # One of the two moves to the new instance at its recompute step; the other stays.
    paths = sorted((f.instances, f.migrations) for f in finished)
    assert paths == [([1], 0), ([1, 2], 1)]


def test_a_pinned_threshold_is_what_every_step_runs_and_records(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(7, arrival=0.0, deadline=100.0, prompt_len=16, output_len=32, pinned_tau=0.73)
    steps = 0
    while True:
        d = s.schedule(float(steps))
        (entry,) = d.batch_for(1).entries
        assert entry.tau == 0.73, "not the nearest candidate: exactly the pinned value"
        assert scheduler.THRESHOLD_REASONS[d.entry_reasons[0]] == "pinned"
        steps += 1
        assert s.served_so_far(7).taus == [0.73] * (steps - 1)
        finished = s.step_done(1, 0.01, [StepResult(7, 8)])
        if finished:
            break
    assert finished[0].taus == [0.73] * 4 and finished[0].steps == 4
    with pytest.raises(SchedulerError, match="pinned"):
        s.arrive(8, arrival=0.0, deadline=9.0, prompt_len=4, output_len=4, pinned_tau=1.5)


def test_each_batch_releases_what_left_its_instance(profile: LatencyProfile) -> None:
    """Residency is the scheduler's: a request that finished, was cancelled or moved away is
    released by its old instance's next command; a request new there is `new_here`."""
    s = Scheduler(profile, SchedulerConfig(policy=Policy.llumnix_like()))
    s.add_instance(1, tp=1, gpus=[0])
    for rid in (1, 2, 3):
        s.arrive(rid, arrival=0.0, deadline=100.0, prompt_len=16, output_len=64)
    batch = s.schedule(0.0).batch_for(1)
    assert ids(batch) == [1, 2, 3] and all(e.new_here for e in batch.entries)
    assert batch.release == ()
    s.step_done(1, 0.01, [StepResult(1, 1, finished=True), *report(batch)[1:]])
    s.cancel(2)
    batch = s.schedule(0.1).batch_for(1)
    assert batch.release == (1, 2) and ids(batch) == [3]
    assert not batch.entries[0].new_here
    s.add_instance(2, tp=1, gpus=[1])
    s.step_done(1, 0.01, [StepResult(3, 31)])  # the block is done: its next step recomputes
    s.drain_instance(1)
    d = s.schedule(0.2)
    (moved,) = d.migrations
    assert (moved.request, moved.from_instance, moved.to_instance) == (3, 1, 2)
    assert ids(d.batch_for(2)) == [3] and d.batch_for(2).entries[0].new_here
    s.undrain_instance(1)
    s.arrive(4, arrival=0.3, deadline=100.0, prompt_len=16, output_len=64)
    batch = s.schedule(0.3).batch_for(1)
    assert ids(batch) == [4] and batch.release == (3,)


def test_one_slow_step_does_not_starve_an_instance_of_work() -> None:
    """With a flat profile (steps barely longer for a bigger batch), one slow step used to
    leave its instance looking slow for good: it got no work, so nothing corrected it, and
    the others took its share. The step-time factor is pooled per degree group."""
    s = Scheduler(flat_profile())
    for i in range(4):
        s.add_instance(i, tp=1, gpus=[i])
    next_id = itertools.count()
    for _ in range(8):
        s.arrive(next(next_id), arrival=0.0, deadline=1e6, prompt_len=16, output_len=64)
    now, running, steps = 0.0, {}, [0] * 4
    while sum(steps) < 2000:
        for b in s.schedule(now).batches:
            slow = 4.0 if sum(steps) == 0 else 1.0  # the very first step is slow
            running[b.instance] = (now + slow * (b.predicted_finish - now), now, b)
            steps[b.instance] += 1
        instance = min(running, key=lambda i: running[i][0])
        end, started, batch = running.pop(instance)
        now = end
        results = [StepResult(e.request, 8) for e in batch.entries]
        for _ in s.step_done(instance, end - started, results):
            s.arrive(next(next_id), arrival=now, deadline=now + 1e6, prompt_len=16, output_len=64)
    mean = sum(steps) / 4
    assert all(mean / 2 <= n <= 2 * mean for n in steps), steps


def test_schedule_commands_are_the_rounds_batches(profile: LatencyProfile) -> None:
    """The engine's form of a round (`schedule_commands`) says what `schedule` decides,
    batch for batch: steps ahead (overlap), releases, requests new to an instance and a
    migration included. Two schedulers get the same events; one answers each way."""
    config = SchedulerConfig(policy=Policy.llumnix_like(), overlap=True)
    pair = (Scheduler(profile, config), Scheduler(profile, config))
    ahead = len(scheduler.STEP_KINDS)

    def both(event: str, *args: object, **kwargs: object) -> None:
        for s in pair:
            getattr(s, event)(*args, **kwargs)

    def round_at(now: float) -> list[scheduler.BatchCommand]:
        d = pair[0].schedule(now)
        got = pair[1].schedule_commands(now)
        expected = [
            (
                b.instance,
                [e.request for e in b.entries],
                [e.tau for e in b.entries],
                [ahead if e.ahead else scheduler.STEP_KINDS.index(e.kind) for e in b.entries],
                list(b.release),
                [e.request for e in b.entries if e.new_here],
                predicted,
            )
            for b, predicted in zip(d.batches, d.batch_predicted_s.tolist(), strict=True)
        ]
        assert [tuple(c) for c in got] == expected
        return got

    both("add_instance", 1, tp=1, gpus=[0])
    for rid in (1, 2, 3):
        both("arrive", rid, arrival=0.0, deadline=100.0, prompt_len=16, output_len=64)
    (first,) = round_at(0.0)
    assert first.new_here == [1, 2, 3]
    (step_ahead,) = round_at(0.001)
    assert set(step_ahead.kinds) == {ahead}
    both(
        "step_done", 1, 0.01, [StepResult(1, 1, finished=True), StepResult(2, 1), StepResult(3, 1)]
    )
    both("cancel", 3)
    both("add_instance", 2, tp=1, gpus=[1])
    both("step_done", 1, 0.01, [StepResult(2, 31)])
    both("drain_instance", 1)
    (moved,) = round_at(0.2)
    assert (moved.instance, moved.new_here) == (2, [2])
    both("undrain_instance", 1)
    both("arrive", 4, arrival=0.3, deadline=100.0, prompt_len=16, output_len=64)
    released = [c.release for c in round_at(0.3) if c.instance == 1]
    assert released and sorted(released[0]) == [1, 2, 3]
