"""The scheduler through its Python API: events, decisions, policies and typed errors."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
from sched_profiles import make_profile, report

from dilaserve import _core
from dilaserve.scheduler import (
    THRESHOLD_REASONS,
    AdmissionError,
    InvalidInstanceError,
    InvalidRequestError,
    LatencyProfile,
    LatencyProfileError,
    Migration,
    Policy,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    SchedulerError,
    StepReportError,
    StepResult,
    UnknownInstanceError,
    UnknownRequestError,
    Waiting,
)


@pytest.fixture
def profile() -> LatencyProfile:
    return make_profile()


def test_arrival_to_finish(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(7, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=100.0, prompt_len=10, output_len=40)
    s.arrive(2, arrival=0.0, deadline=0.01, prompt_len=10, output_len=40)
    d = s.schedule(0.0)
    (batch,) = d.batches
    assert batch.instance == 7 and batch.tokens == 2 * (10 + 64)
    assert [(e.request, e.tau, e.kind, e.new_here) for e in batch.entries] == [
        (1, 0.9, "recompute", True),
        (2, 0.5, "recompute", True),
    ]
    assert batch.predicted_finish > 0.0 and d.elapsed_s >= 0.0
    assert d.migrations == [] and d.waiting == []
    # Columns and records agree.
    assert d.entry_requests.tolist() == [1, 2]
    assert d.entry_taus.tolist() == [0.9, 0.5]
    assert [_core.STEP_KINDS[k] for k in d.entry_kinds] == ["recompute", "recompute"]
    assert d.entry_new_here.tolist() == [True, True]
    assert d.batch_instances.tolist() == [7] and d.batch_lens.tolist() == [2]

    info = s.request(1)
    assert info.in_flight and info.instance == 7 and info.output_len == 64
    assert info.allowed == [0.5, 0.6, 0.7, 0.8, 0.9] and info.last_tau == 0.9
    assert s.instance(7).batch == [1, 2]

    assert s.step_done(7, 0.03, report(batch, 16)) == []
    info = s.request(1)
    assert (info.steps_done, info.unmasked, info.next_kind) == (1, 16, "cache")
    finished: list[int] = []
    now = 0.1
    while s.active_requests:
        d = s.schedule(now)
        assert d.batches, "the only instance is idle, so every ready request runs"
        finished += [f.id for f in s.step_done(7, 0.03, report(d.batches[0], 16))]
        now += 0.1
    assert sorted(finished) == [1, 2]
    assert s.instance(7).residents == 0


def test_waiting_reasons_and_cancel(profile: LatencyProfile) -> None:
    s = Scheduler(profile, SchedulerConfig(max_batch_tokens=1000))
    s.arrive(1, arrival=0.0, deadline=9.0, prompt_len=900, output_len=64)
    assert s.schedule(0.0).waiting == [Waiting(1, "no_instance")]
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(2, arrival=0.0, deadline=9.0, prompt_len=900, output_len=64)
    d = s.schedule(0.0)
    assert [e.request for e in d.batches[0].entries] == [1]
    assert d.waiting == [Waiting(2, "no_room")]
    # The busy instance's next step has room beside request 1's cache step: 2 waits for it.
    assert s.schedule(0.0).waiting == [Waiting(2, "queued_busy")]
    s.cancel(2)
    s.cancel(1)
    with pytest.raises(UnknownRequestError, match="unknown request id 1"):
        s.cancel(1)
    # The in-flight step of a cancelled request is still reported, and ignored.
    assert s.step_done(1, 0.05, [StepResult(1, 1)]) == []
    assert s.active_requests == 0


def test_migration_at_block_boundary(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    for rid in range(4):
        s.arrive(rid, arrival=0.0, deadline=100.0, prompt_len=1900, output_len=64)
    d = s.schedule(0.0)
    s.add_instance(2, tp=1, gpus=[1])
    s.step_done(1, 0.1, report(d.batches[0], 8))
    d = s.schedule(0.1)
    assert d.migrations == [], "mid-block requests keep their cache"
    s.step_done(1, 0.1, report(d.batches[0], 24))
    d = s.schedule(0.2)
    assert d.migrations and all(m == Migration(m.request, 1, 2, "rebalance") for m in d.migrations)
    moved = d.batch_for(2)
    assert moved is not None
    assert all(e.new_here and e.kind == "recompute" for e in moved.entries)


def test_baselines_keep_fixed_threshold(profile: LatencyProfile) -> None:
    for policy, migrates in ((Policy.infaas_like(0.7), False), (Policy.llumnix_like(0.7), True)):
        s = Scheduler(profile, SchedulerConfig(policy=policy))
        s.add_instance(1, tp=1, gpus=[0])
        for rid in range(4):
            s.arrive(rid, arrival=0.0, deadline=0.001, prompt_len=1000, output_len=64)
        d = s.schedule(0.0)
        s.add_instance(2, tp=1, gpus=[1])
        s.step_done(1, 0.1, report(d.batches[0], 32))
        d = s.schedule(0.1)
        assert set(d.entry_taus.tolist()) == {0.7}
        assert bool(d.migrations) == migrates


def test_policy_presets_compose() -> None:
    p = Policy.dilaserve().without_load_control().without_migration().one_shot()
    assert (p.load_control, p.migration, p.prediction) == (False, False, "one_shot")
    assert Policy.llumnix_like(0.8) == Policy(
        threshold="fixed",
        fixed_tau=0.8,
        load_control=False,
        instance_choice="least_loaded",
        lookahead_steps=0,
        migration=True,
        migration_gain=0.0,
        load_model="window",
        admission="off",
    )
    q = Policy.dilaserve().window_load_control().without_admission().next_step_choice()
    assert (q.load_model, q.admission, q.lookahead_steps, q.migration_gain) == (
        "window",
        "off",
        0,
        0,
    )
    assert q == Policy.named("paper")


def test_decisions_explain_each_threshold(profile: LatencyProfile) -> None:
    s = Scheduler(profile, SchedulerConfig())
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(0, arrival=0.0, deadline=1e-3, prompt_len=100, output_len=32)
    s.arrive(1, arrival=0.0, deadline=1e6, prompt_len=100, output_len=32)
    d = s.schedule(0.0)
    reasons = [THRESHOLD_REASONS[c] for c in d.entry_reasons]
    assert dict(zip(d.entry_requests.tolist(), reasons, strict=True)) == {0: "late", 1: "fits"}
    late = d.entry_requests.tolist().index(0)
    assert d.entry_estimates_s[late] > d.entry_slo_left_s[late]
    assert np.all(d.entry_taus <= d.entry_cap_taus)


def test_deadline_admission_rejects_what_cannot_finish_in_time(profile: LatencyProfile) -> None:
    """Once a round has measured the capacity, an arrival that cannot meet its deadline even
    at the lowest threshold is refused (reject) or queued behind the rest (best effort)."""
    for admission in ("reject", "best_effort", "off"):
        policy = dataclasses.replace(Policy.dilaserve(), admission=admission)
        s = Scheduler(profile, SchedulerConfig(policy=policy))
        s.add_instance(1, tp=1, gpus=[0])
        for rid in range(20):
            s.arrive(rid, arrival=0.0, deadline=100.0, prompt_len=1000, output_len=256)
        s.schedule(0.0)
        hopeless = {"arrival": 0.0, "deadline": 0.01, "prompt_len": 1000, "output_len": 256}
        if admission == "reject":
            with pytest.raises(AdmissionError, match="lowest threshold"):
                s.arrive(99, **hopeless)
            assert s.active_requests == 20, "a rejected arrival leaves no trace"
        else:
            s.arrive(99, **hopeless)
            assert s.active_requests == 21
        # A request with room to spare is always admitted.
        s.arrive(100, arrival=0.0, deadline=1e6, prompt_len=10, output_len=32)
        # One whose deadline is only the server's default is never refused for it.
        s.arrive(101, **hopeless, explicit_deadline=False)
        assert s.active_requests == (21 if admission == "reject" else 22) + 1


def test_load_control_caps_later_requests(profile: LatencyProfile) -> None:
    policy = Policy.dilaserve().window_load_control()
    s = Scheduler(profile, SchedulerConfig(slo_window_s=4.5, policy=policy))
    s.add_instance(1, tp=1, gpus=[0])
    for rid in range(40):
        s.arrive(rid, arrival=float(rid), deadline=1e6, prompt_len=200, output_len=256)
    d = s.schedule(0.0)
    caps = [s.request(rid).max_tau for rid in range(40)]
    assert caps[0] == 0.9 and caps[-1] == 0.5
    assert caps == sorted(caps, reverse=True)
    for rid, tau in zip(d.entry_requests.tolist(), d.entry_taus.tolist(), strict=True):
        assert tau <= caps[rid]


def test_instance_lifecycle(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=2, gpus=[0, 1], node=3)
    s.arrive(5, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.schedule(0.0)
    s.remove_instance(1)
    assert s.instance_ids() == []
    info = s.request(5)
    assert info.instance is None and not info.in_flight
    s.add_instance(2, tp=2, gpus=[0, 1], node=3)  # the GPUs are free again
    d = s.schedule(0.1)
    assert d.migrations == [Migration(5, 1, 2, "instance_removed")]
    s.drain_instance(2)
    assert s.instance(2).draining
    assert s.instance(2).gpus == [0, 1] and s.instance(2).node == 3


def test_custom_predictor_rates(profile: LatencyProfile) -> None:
    s = Scheduler(profile, SchedulerConfig(predictor_rates=((0.5, 8.0), (0.9, 2.0))))
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    preds = s.request(1).predictions
    assert preds[0] == (6.0, 2.0)  # 2 blocks x 4 steps at tau 0.5, one recompute each
    assert preds[-1] == (30.0, 2.0)  # 16 steps per block at tau 0.9


# ---- bad input -> typed exceptions --------------------------------------------------------


def test_exception_hierarchy() -> None:
    for exc in (
        AdmissionError,
        SchedulerConfigError,
        InvalidRequestError,
        UnknownRequestError,
        InvalidInstanceError,
        UnknownInstanceError,
        StepReportError,
    ):
        assert issubclass(exc, SchedulerError) and issubclass(exc, ValueError)


def test_unknown_ids(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    with pytest.raises(UnknownRequestError, match="unknown request id 42"):
        s.request(42)
    with pytest.raises(UnknownRequestError):
        s.cancel(42)
    with pytest.raises(UnknownInstanceError, match="unknown instance id 9"):
        s.drain_instance(9)
    with pytest.raises(UnknownInstanceError):
        s.step_done(9, 0.1, [])
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.schedule(0.0)
    with pytest.raises(UnknownRequestError, match="42"):
        s.step_done(1, 0.1, [StepResult(42, 1)])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_len": -5}, "prompt_len must be an integer in \\[0, 2\\^32\\), got -5"),
        ({"output_len": -1}, "output_len must be an integer"),
        ({"output_len": 0}, "output length must be at least 1"),
        ({"block_length": -32}, "block_length must be an integer"),
        ({"deadline": -1.0}, "deadline -1 is before arrival 0"),
        ({"arrival": math.nan}, "must be finite"),
        ({"thresholds": []}, "allowed threshold set is empty"),
        ({"thresholds": [0.55]}, "threshold 0.55 is not one of the candidate thresholds"),
        ({"prompt_len": 9000}, "more than the batch budget of 8192"),
    ],
)
def test_bad_requests(profile: LatencyProfile, fields: dict, message: str) -> None:
    s = Scheduler(profile)
    spec = {"arrival": 0.0, "deadline": 10.0, "prompt_len": 10, "output_len": 64} | fields
    with pytest.raises(InvalidRequestError, match=message):
        s.arrive(1, **spec)
    assert s.active_requests == 0


def test_duplicate_request(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    with pytest.raises(InvalidRequestError, match="request 1 already exists"):
        s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)


@pytest.mark.parametrize(
    ("call", "bits"),
    [
        (lambda s: s.arrive(-1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64), 64),
        (lambda s: s.cancel(2**64), 64),
        (lambda s: s.request(-1), 64),
        (lambda s: s.step_done(-1, 0.1, []), 64),
        (lambda s: s.step_done(1, 0.1, [StepResult(-7, 1)]), 64),
        (lambda s: s.add_instance(-2, tp=1, gpus=[1]), 64),
        (lambda s: s.add_instance(2, tp=1, gpus=[-1]), 32),
        (lambda s: s.add_instance(2, tp=-1, gpus=[1]), 32),
        (lambda s: s.drain_instance(-1), 64),
    ],
)
def test_out_of_range_unsigned_arguments_raise_scheduler_errors(
    profile: LatencyProfile, call, bits
) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    with pytest.raises(SchedulerError, match=rf"expected an integer in \[0, 2\^{bits}\)"):
        call(s)
    assert s.instance_ids() == [1] and s.active_requests == 1
    with pytest.raises(TypeError):
        s.cancel("1")


def test_profile_missing_tp_degree() -> None:
    s = Scheduler(make_profile(degrees=(1,)))
    with pytest.raises(LatencyProfileError, match="no TP degree 4"):
        s.add_instance(1, tp=4, gpus=[0, 1, 2, 3])
    assert s.instance_ids() == []
    no_cache_only = LatencyProfile.from_tables([(1, "no_cache", [(64, 0.01)])])
    with pytest.raises(LatencyProfileError, match="no recompute table"):
        Scheduler(no_cache_only).add_instance(1, tp=1, gpus=[0])
    Scheduler(no_cache_only, SchedulerConfig(caching=False)).add_instance(1, tp=1, gpus=[0])


def test_bad_instances(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=2, gpus=[0, 1])
    with pytest.raises(InvalidInstanceError, match="already held by instance 1"):
        s.add_instance(2, tp=1, gpus=[1])
    with pytest.raises(InvalidInstanceError, match="needs 2 GPUs"):
        s.add_instance(2, tp=2, gpus=[5])
    with pytest.raises(InvalidInstanceError, match="instance 1 already exists"):
        s.add_instance(1, tp=1, gpus=[7])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SchedulerConfig(thresholds=()), "candidate threshold set is empty"),
        (SchedulerConfig(thresholds=(0.5, 1.5)), "must be in \\(0, 1\\]"),
        (SchedulerConfig(block_length=0), "block size must be at least 1"),
        (SchedulerConfig(max_batch_tokens=-1), "max_batch_tokens: invalid value: integer `-1`"),
        (SchedulerConfig(slo_window_s=0.0), "SLO window must be positive"),
        (SchedulerConfig(policy=Policy.infaas_like(0.0)), "fixed threshold must be in"),
        (SchedulerConfig(policy=Policy(load_order="lifo")), "policy.load_order: unknown variant"),
        (SchedulerConfig(policy=Policy(predict_every=0)), "interval must be at least 1"),
        (SchedulerConfig(predictor_rates=((0.5, 0.2),)), "at least 1 token per step"),
    ],
)
def test_bad_config(profile: LatencyProfile, config: SchedulerConfig, message: str) -> None:
    with pytest.raises(SchedulerConfigError, match=message):
        Scheduler(profile, config)


def test_bad_step_reports(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    with pytest.raises(StepReportError, match="no step in flight"):
        s.step_done(1, 0.1, [])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.arrive(2, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    s.schedule(0.0)
    bad = [
        ([StepResult(1, 1)], "no result for request 2"),
        ([StepResult(1, 1), StepResult(1, 1), StepResult(2, 1)], "reported twice"),
        ([StepResult(1, 0), StepResult(2, 1)], "committed 0 tokens"),
        ([StepResult(1, 33), StepResult(2, 1)], "committed 33 tokens"),
        ([StepResult(1, -2), StepResult(2, 1)], "committed must be an integer"),
    ]
    for results, message in bad:
        with pytest.raises(StepReportError, match=message):
            s.step_done(1, 0.1, results)
    with pytest.raises(StepReportError, match="measured step time"):
        s.step_done(1, -1.0, [StepResult(1, 1), StepResult(2, 1)])
    assert s.request(1).steps_done == 0, "a rejected report changes nothing"
    s.step_done(1, 0.1, [StepResult(1, 1, (0.1, 0.2, 0.3, 0.3, 0.4)), StepResult(2, 1)])
    assert s.request(1).steps_done == 1


def test_bad_time(profile: LatencyProfile) -> None:
    with pytest.raises(SchedulerError, match="time must be finite"):
        Scheduler(profile).schedule(math.nan)


def test_decision_columns_are_read_only(profile: LatencyProfile) -> None:
    s = Scheduler(profile)
    s.add_instance(1, tp=1, gpus=[0])
    s.arrive(1, arrival=0.0, deadline=10.0, prompt_len=10, output_len=64)
    d = s.schedule(0.0)
    assert isinstance(d.entry_requests, np.ndarray)
    with pytest.raises(ValueError):
        d.entry_taus[0] = 0.1


def readme_example() -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Scheduler library", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's scheduler section has a python example"
    return match.group(1)


def test_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(readme_example(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "finished" in out


def test_settings_are_declared_once_in_the_core() -> None:
    """`SchedulerConfig`, `EngineConfig` and `ClusterSetup` carry the core's settings with
    the core's defaults; the named policies are the core's."""
    from dilaserve.engine import EngineConfig
    from dilaserve.scheduler import POLICY_SETTINGS, PRESETS, SCHEDULER_SETTINGS
    from dilaserve.sim import ClusterSetup

    names = [f["name"] for f in SCHEDULER_SETTINGS]
    config = SchedulerConfig()
    assert [f.name for f in dataclasses.fields(config)][: len(names)] == names
    for f in SCHEDULER_SETTINGS:
        value = getattr(config, f["name"])
        if f["name"] != "policy":
            assert value == (tuple(f["default"]) if isinstance(value, tuple) else f["default"])
    assert Policy() == Policy.dilaserve() and [f["name"] for f in POLICY_SETTINGS] == [
        f.name for f in dataclasses.fields(Policy)
    ]
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(names) - engine_fields == {"caching", "exact_cache"}  # follow the cache mode
    cluster_fields = {f.name for f in dataclasses.fields(ClusterSetup)}
    assert set(names) - cluster_fields == {"policy", "overlap"}  # the simulator is synchronous
    # The engine overlaps steps by default; everything else is the core's default.
    assert EngineConfig().scheduler_config() == SchedulerConfig(overlap=True)
    assert not SchedulerConfig().overlap
    assert {"dilaserve", "infaas", "llumnix", "paper", "no-reconfig"} <= set(PRESETS)
    assert Policy.named("llumnix") == Policy.llumnix_like()
