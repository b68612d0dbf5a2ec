"""dilaserve.planner: typed inputs and plans, load regimes, adoption, errors, and the
transition invariants (no GPU used twice, TP groups inside one node) on random clusters."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilaserve import LatencyProfile, LatencyProfileError
from dilaserve.planner import (
    Arrival,
    BinSpec,
    Deployment,
    Instance,
    LaunchAction,
    Plan,
    PlannerConfig,
    PlannerInputError,
    PlannerInputs,
    RequestClass,
    StopAction,
    ThresholdOption,
    available_solvers,
    classes_from_arrivals,
    mean_isolated_latency,
    plan,
    plan_capacity,
)

THRESHOLDS = (ThresholdOption(0.7, 5.12), ThresholdOption(0.8, 4.24), ThresholdOption(0.9, 3.25))
TP_FACTOR = {1: 1.0, 2: 0.75, 4: 0.45}


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    """Per-step latency: 8 ms plus 27 µs per token at TP-1, scaled per degree."""
    grid = (64, 256, 1024, 4096, 16384)
    return LatencyProfile.from_tables(
        [
            (tp, "no_cache", [(n, f * (0.008 + 2.7e-5 * n)) for n in grid])
            for tp, f in TP_FACTOR.items()
        ]
    )


def cluster(rate: float, **config: object) -> PlannerInputs:
    classes = [RequestClass(200.0, 256.0, rate), RequestClass(800.0, 128.0, rate / 2)]
    cfg = PlannerConfig(
        slo_seconds=20.0, degrees=(1, 2, 4), batch_tokens=(1024, 4096, 16384), mip_gap=0.0
    )
    return PlannerInputs(classes, [4, 4], replace(cfg, **config), THRESHOLDS)


def check_deployment(result: Plan, node_gpus: list[int]) -> None:
    """Every instance on one node, on existing GPUs, none shared; counts match Stage 1."""
    assert result.transition is not None
    used: set[tuple[int, int]] = set()
    for inst in result.transition.instances:
        assert len(inst.gpus) == inst.degree
        for g in inst.gpus:
            assert 0 <= g < node_gpus[inst.node]
            assert (inst.node, g) not in used
            used.add((inst.node, g))
    for i, d in enumerate(result.capacity.degrees):
        assert sum(n[i] for n in result.instances_per_node) == d.instances


def as_deployment(result: Plan) -> Deployment:
    assert result.transition is not None
    batches = {d.degree: d.batch_tokens for d in result.capacity.degrees if d.batch_tokens}
    return Deployment(result.transition.instances, batches)


def test_light_load_keeps_the_top_threshold(profile: LatencyProfile) -> None:
    result = plan(cluster(0.05), profile)
    cap = result.capacity
    assert not cap.overloaded and cap.status in ("optimal", "gap_limit")
    assert cap.value.quality == pytest.approx(0.9, abs=1e-6)
    assert all(c.threshold_mix[-1] == pytest.approx(1.0, abs=1e-6) for c in cap.classes)
    # Latency slack picks the fastest instances: all GPUs as TP-4 at the smallest batch.
    assert [(d.degree, d.instances) for d in cap.degrees if d.instances] == [(4, 2)]
    assert cap.degrees[2].batch_tokens == 1024
    assert result.adopted and result.current_value is None
    assert all(isinstance(a, LaunchAction) for a in result.transition.actions)
    check_deployment(result, [4, 4])


def test_loaded_cluster_lowers_thresholds(profile: LatencyProfile) -> None:
    cap = plan_capacity(cluster(6.0), profile)
    assert not cap.overloaded
    assert 0.7 < cap.value.quality < 0.9 - 1e-3
    assert all(c.latency_seconds <= 20.0 + 1e-6 for c in cap.classes)
    assert all(d.utilisation <= 1.0 + 1e-6 for d in cap.degrees)
    assert cap.headroom >= 1.0 - 1e-6


def test_overload_is_reported_not_hidden(profile: LatencyProfile) -> None:
    cap = plan_capacity(cluster(50.0), profile)
    assert cap.overloaded
    assert 0.0 < cap.value.sustained_load < 1.0
    assert all(c.threshold_mix[0] == pytest.approx(1.0) for c in cap.classes)


def test_replanning_the_same_load_keeps_the_deployment(profile: LatencyProfile) -> None:
    first = plan(cluster(6.0), profile)
    again = plan(replace(cluster(6.0), current=as_deployment(first)), profile)
    assert not again.adopted and again.transition is None
    assert "keeping the running deployment" in again.reason
    assert again.instances_per_node == first.instances_per_node
    forced = plan(replace(cluster(6.0, min_improvement=0.0), current=as_deployment(first)), profile)
    assert forced.adopted and forced.transition is not None
    # Same target counts: every running instance is kept, nothing stops.
    assert len(forced.transition.kept) == len(first.transition.instances)
    assert not any(isinstance(a, StopAction) for a in forced.transition.actions)


def test_bad_inputs_raise_typed_errors(profile: LatencyProfile) -> None:
    with pytest.raises(PlannerInputError, match="no GPUs"):
        plan(replace(cluster(1.0), node_gpus=[]), profile)
    with pytest.raises(PlannerInputError, match="at least one class"):
        plan(replace(cluster(1.0), classes=[]), profile)
    with pytest.raises(LatencyProfileError, match="no TP degree 8"):
        plan(replace(cluster(1.0), node_gpus=[8], config=PlannerConfig(20.0, (1, 8))), profile)
    with pytest.raises(PlannerInputError, match="used twice"):
        twice = Deployment((Instance(0, 2, (0, 1)), Instance(0, 1, (1,))), {1: 1024, 2: 1024})
        plan(replace(cluster(1.0), current=twice), profile)
    with pytest.raises(PlannerInputError, match="slo_seconds"):
        plan(cluster(1.0, slo_seconds=-1.0), profile)
    negative = [Arrival(0.0, prompt_tokens=-5, output_tokens=10)]
    with pytest.raises(PlannerInputError, match=r"expected an integer in \[0, 2\^64\), got -5"):
        classes_from_arrivals(negative, 0.0, 1.0)
    with pytest.raises(PlannerInputError, match="got -1"):
        classes_from_arrivals(negative[:0], 0.0, 1.0, BinSpec(prompt_bins=-1))


@pytest.mark.skipif("microlp" not in available_solvers(), reason="microlp not compiled in")
def test_highs_and_microlp_agree(profile: LatencyProfile) -> None:
    for rate in (0.05, 6.0, 50.0):
        a = plan_capacity(cluster(rate), profile)
        b = plan_capacity(cluster(rate, solver="microlp"), profile)
        assert a.overloaded == b.overloaded
        assert a.value.quality == pytest.approx(b.value.quality, rel=1e-5)
        assert a.value.latency_slack == pytest.approx(b.value.latency_slack, rel=1e-5)


def test_classes_from_arrivals_bins_and_scales() -> None:
    arrivals = [Arrival(i * 0.5, 100 if i % 2 else 900, 50 + i) for i in range(40)]
    classes = classes_from_arrivals(arrivals, 0.0, 20.0, BinSpec(2, 2, rate_margin=0.25))
    assert len(classes) == 4
    assert sum(c.rate for c in classes) == pytest.approx(40 / 20 * 1.25)
    assert {c.prompt_tokens for c in classes} == {100.0, 900.0}
    with pytest.raises(PlannerInputError, match="no arrivals"):
        classes_from_arrivals(arrivals, 100.0, 200.0)
    with pytest.raises(PlannerInputError, match="output tokens"):
        classes_from_arrivals([Arrival(0.0, 10, 0)], 0.0, 1.0)


def test_mean_isolated_latency(profile: LatencyProfile) -> None:
    arrivals = [Arrival(0.0, 64, 64)]
    # 64 output tokens at 4 per step: 16 steps over 128 tokens each.
    expected = 16 * profile.latency(1, "no_cache", 128)
    assert mean_isolated_latency(profile, arrivals, 4.0) == pytest.approx(expected)


@st.composite
def running_cluster(draw: st.DrawFn) -> tuple[list[int], Deployment, float]:
    """A random 1–3 node cluster, part of it running TP-1/2/4 instances on random GPUs."""
    node_gpus = draw(st.lists(st.sampled_from([2, 4, 8]), min_size=1, max_size=3))
    instances = []
    for node, g in enumerate(node_gpus):
        free = draw(st.permutations(list(range(g))))
        while free and draw(st.booleans()):
            d = draw(st.sampled_from([d for d in (1, 2, 4) if d <= len(free)]))
            instances.append(Instance(node, d, tuple(sorted(free[:d]))))
            free = free[d:]
    rate = draw(st.floats(0.05, 20.0))
    return node_gpus, Deployment(tuple(instances), {1: 1024, 2: 1024, 4: 1024}), rate


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(running_cluster())
def test_transitions_never_share_gpus(profile: LatencyProfile, case) -> None:
    node_gpus, current, rate = case
    degrees = tuple(d for d in (1, 2, 4) if d <= max(node_gpus))
    inputs = replace(
        cluster(rate, degrees=degrees, min_improvement=0.0), node_gpus=node_gpus, current=current
    )
    result = plan(inputs, profile)
    check_deployment(result, node_gpus)
    # Replaying the actions never puts two instances on one GPU.
    busy = {(i.node, g) for i in current.instances for g in i.gpus}
    for action in result.transition.actions:
        cells = {(action.node, g) for g in action.gpus}
        if isinstance(action, StopAction):
            assert cells <= busy
            busy -= cells
        else:
            assert not cells & busy
            busy |= cells
    assert busy == {(i.node, g) for i in result.transition.instances for g in i.gpus}


def test_plan_transition_to_chosen_counts_keeps_running_instances():
    from dilaserve.planner import Deployment, Instance, LaunchAction, StopAction, plan_transition

    running = Deployment(instances=(Instance(0, 1, (0,)), Instance(0, 1, (1,))))
    up = plan_transition([3], {1: 3}, running)
    assert up.kept == (0, 1) and [type(a) for a in up.actions] == [LaunchAction]
    assert up.actions[0].gpus == (2,)
    down = plan_transition([3], {1: 1}, Deployment(instances=up.instances))
    assert len(down.kept) == 1 and [type(a) for a in down.actions] == [StopAction] * 2
    with pytest.raises(PlannerInputError, match="do not fit"):
        plan_transition([3], {1: 4}, running)
