"""The simulator's Python face: progress models from recorded decoding, the live
scheduler's policies in simulated time, results in `dilaserve bench`'s shape, the CLI."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dilaserve.bench.report import Summary
from dilaserve.bench.workload import gamma_times, poisson_times
from dilaserve.cli import main
from dilaserve.predictor import progress as progress_model
from dilaserve.profiles import SIMULATED_LLADA8B
from dilaserve.scheduler import LatencyProfile
from dilaserve.sim import (
    ClusterSetup,
    SimInputError,
    Workload,
    place,
    prefill_heavy_lengths,
    simulate,
    speed_classes,
    static_layouts,
)
from dilaserve.tiny import default_model_dir
from dilaserve.traces import AZURE_CONV, read_trace

TRACES = Path(__file__).parent / "predictor" / "data" / "tiny_traces.parquet"
ACCURACY = {0.5: 0.8, 0.6: 0.88, 0.7: 0.95, 0.8: 0.98, 0.9: 0.99, 1.0: 0.99}
LENGTHS = [(100, 128), (400, 256), (1200, 200)]


@pytest.fixture(scope="module")
def setup() -> ClusterSetup:
    tiny = progress_model.load(default_model_dir() / "progress.json")
    rates = [(0.5, 7.0), (0.7, 5.1), (0.9, 3.25), (1.0, 1.0)]
    return ClusterSetup(
        profile=LatencyProfile.load(str(SIMULATED_LLADA8B)),
        progress=progress_model.rescaled(tiny, rates),
        node_gpus=(4,),
        layout=(1, 1, 1, 1),
        replan_interval_s=None,
    )


def test_progress_model_from_recorded_decoding() -> None:
    model = progress_model.check(progress_model.progress_model(pq.read_table(TRACES), ACCURACY))
    rates = dict(progress_model.mean_rates(model))
    assert sorted(rates) == sorted(ACCURACY)
    # Lower thresholds commit more per step; τ = 1.0 commits the fewest.
    assert rates[0.5] > rates[0.7] > rates[0.9] > rates[1.0] >= 1.0
    with pytest.raises(ValueError, match="no accuracy"):
        progress_model.progress_model(pq.read_table(TRACES), {0.5: 0.8})
    scaled = progress_model.rescaled(model, [(0.5, 7.0), (1.0, 1.0)])
    means = dict(progress_model.mean_rates(scaled))
    assert means[0.5] == pytest.approx(7.0, rel=0.05)
    bad = dict(model, accuracy=[2.0] * len(model["thresholds"]))
    with pytest.raises(SimInputError, match="accuracies"):
        progress_model.check(bad)


def test_each_request_draws_from_its_own_task_progress(setup: ClusterSetup) -> None:
    # dilaserve-tiny answers `add` in one step per block and `draw` in several: with
    # progress per task, the simulated requests of each task take their own steps.
    by_task = progress_model.progress_by_class(pq.read_table(TRACES), ACCURACY)
    assert sorted(by_task) == ["add", "draw", "rep", "tr"]
    rates = {task: dict(progress_model.mean_rates(m))[0.9] for task, m in by_task.items()}
    assert rates["add"] > 3 * rates["draw"]
    n = 40
    tasks = ["add", "draw"] * (n // 2)
    workload = Workload(
        np.arange(n, dtype=np.float64),
        np.full(n, 32, dtype=np.uint32),
        np.full(n, 64, dtype=np.uint32),
        float(n),
        progress_class=tasks,
    )
    with_tasks = dataclasses.replace(setup, class_progress=by_task, thresholds=(0.9,))
    steps = simulate(with_tasks, "infaas", workload, 1.0).columns["steps"]
    add = steps[[t == "add" for t in tasks]]
    draw = steps[[t == "draw" for t in tasks]]
    assert add.mean() < draw.mean() / 2
    # A class without a model, or no classes at all, draws from the pooled model.
    unknown = dataclasses.replace(workload, progress_class=["other"] * n)
    np.testing.assert_array_equal(
        simulate(with_tasks, "infaas", unknown, 1.0).columns["steps"],
        simulate(dataclasses.replace(setup, thresholds=(0.9,)), "infaas", workload, 1.0).columns[
            "steps"
        ],
    )
    with pytest.raises(ValueError, match="classes for"):
        simulate(with_tasks, "infaas", dataclasses.replace(workload, progress_class=["add"]), 1.0)


def test_policies_run_on_the_live_scheduler_in_simulated_time(setup: ClusterSetup) -> None:
    light = Workload.synthetic("poisson", 1.0, 60.0, LENGTHS, seed=1)
    heavy = Workload.synthetic("poisson", 24.0, 60.0, LENGTHS, seed=1)
    runs = {
        (p, name): simulate(setup, p, w, rate).summary()
        for p in ("dilaserve", "infaas")
        for name, w, rate in (("light", light, 1.0), ("heavy", heavy, 24.0))
    }
    assert set(dataclasses.asdict(runs["dilaserve", "light"])) == {
        f.name for f in dataclasses.fields(Summary)
    }
    assert runs["dilaserve", "light"].attainment == 1.0
    assert runs["dilaserve", "light"].mean_tau == pytest.approx(0.9)
    assert runs["infaas", "heavy"].mean_tau == pytest.approx(0.9)
    # Under load the SLO-aware policy lowers τ, and keeps more requests within their SLO.
    assert runs["dilaserve", "heavy"].mean_tau < 0.9
    assert runs["dilaserve", "heavy"].attainment > runs["infaas", "heavy"].attainment
    assert runs["dilaserve", "heavy"].accuracy < runs["infaas", "heavy"].accuracy


def test_per_request_output_explains_the_thresholds(setup: ClusterSetup) -> None:
    heavy = Workload.synthetic("poisson", 24.0, 60.0, LENGTHS, seed=1)
    c = {k: np.asarray(v) for k, v in simulate(setup, "dilaserve", heavy, 24.0).columns.items()}
    served = ~np.isnan(c["finish"])
    assert c["capped_steps"][served].sum() > 0, "load control lowered τ under load"
    capped = served & (c["capped_steps"] > 0)
    assert np.all(c["min_cap_tau"][capped] < 0.9)
    assert np.all(c["mean_tau"][capped] <= 0.9)
    fixed = simulate(setup, "infaas", heavy, 24.0).columns
    assert sum(fixed["capped_steps"]) == 0 and np.all(np.isnan(fixed["min_cap_tau"]))


def test_day_workload_follows_its_shape_and_layouts_pack_nodes() -> None:
    day = Workload.synthetic("day", 10.0, 1000.0, LENGTHS, seed=2)
    counts, _ = np.histogram(day.arrival, bins=4, range=(0, 1000))
    assert counts[0] < counts[1] and counts[3] < counts[2], counts
    assert 0.85 * 10_000 < len(day) < 1.15 * 10_000
    placed = place([1, 2, 4, 1], [4, 4])
    assert sorted(tp for _, tp, _, _ in placed) == [1, 1, 2, 4]
    assert all(len(gpus) == tp for _, tp, gpus, _ in placed)
    with pytest.raises(ValueError, match="does not fit"):
        place([4, 4, 4], [4, 4])


def test_a_replay_longer_than_its_scaled_trace_carries_the_rate_to_the_end() -> None:
    # 19,366 requests at 104 req/s last 186 s: a 300 s window used to end with 114 s idle,
    # so the runs past 64 req/s served fewer requests than their rate and window say.
    trace = read_trace(AZURE_CONV)
    replay = Workload.replay(trace, 104.0, 300.0)
    assert 0.9 * 104 * 300 < len(replay) < 1.1 * 104 * 300
    counts, _ = np.histogram(replay.arrival, bins=6, range=(0, 300))
    assert counts.min() > 0.5 * counts.mean(), counts
    assert np.all(np.diff(replay.arrival) >= 0) and replay.arrival[-1] < 300
    # The second pass starts over: its lengths are the trace's from its first request.
    second = int(np.searchsorted(replay.arrival, len(trace) / 104.0))
    assert second == len(trace)
    assert replay.prompt_len[second] == trace[0][1] and replay.output_len[second] == trace[0][2]
    with pytest.raises(ValueError, match="empty trace"):
        Workload.replay([], 1.0, 10.0)


@pytest.mark.parametrize(
    "trace", [[(0.0, 5, 7)], [(0.0, 5, 7), (3.0, 6, 8)], [(0.0, 5, 7), (0.0, 6, 8), (9.0, 1, 2)]]
)
def test_a_replayed_trace_of_any_length_arrives_at_exactly_its_rate(trace) -> None:
    # A pass of n requests lasts n mean gaps, the gap before the next pass included: one
    # row replayed at 10 req/s used to arrive at 5 req/s. (The window may cut a pass.)
    replay = Workload.replay(trace, 10.0, 100.0)
    assert abs(len(replay) - 1000) < len(trace)
    assert replay.prompt_len[: len(trace)].tolist() == [r[1] for r in trace]


@pytest.mark.parametrize(
    ("rate", "duration"), [(0.0, 10.0), (-1.0, 10.0), (float("nan"), 10.0), (1.0, float("inf"))]
)
def test_arrivals_refuse_a_rate_or_window_that_would_never_end(rate, duration) -> None:
    rng = random.Random(0)
    for arrivals in (
        lambda: Workload.replay([(0.0, 5, 7)], rate, duration),
        lambda: poisson_times(rate, duration, rng),
        lambda: gamma_times(rate, 2.0, duration, rng),
    ):
        with pytest.raises(ValueError, match="positive finite rate"):
            arrivals()


@pytest.mark.parametrize("argv", [["--rates", "8,0"], ["--rates", "-2"], ["--duration", "inf"]])
def test_simulate_and_bench_refuse_rates_and_windows_that_would_never_end(argv, capsys) -> None:
    for command in (["simulate"], ["bench", "--url", "http://127.0.0.1:1"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, *argv])
        assert exit_.value.code == 2
        assert "expected positive finite numbers" in capsys.readouterr().err


def test_simulate_cli_prints_bench_lines(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim.jsonl"
    code = main(
        ["simulate", "--nodes", "1", "--arrivals", "poisson", "--rates", "2,4",
         "--duration", "20", "--policies", "dilaserve,fixed-0.7", "--replan-interval", "0",
         "--quiet", "--out", str(out), "--plot", str(tmp_path / "sim.png")]
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["policy"], x["rate"]) for x in lines] == [
        ("dilaserve", 2.0), ("fixed-0.7", 2.0), ("dilaserve", 4.0), ("fixed-0.7", 4.0)
    ]  # fmt: skip
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert main(["simulate", "--policies", "nope", "--quiet"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_simulate_cli_charges_the_engine_time_per_step(tmp_path: Path) -> None:
    def mean_latency(overhead_ms: str) -> float:
        out = tmp_path / f"sim-{overhead_ms}.jsonl"
        code = main(
            ["simulate", "--nodes", "1", "--arrivals", "poisson", "--rates", "2",
             "--duration", "20", "--policies", "infaas", "--replan-interval", "0",
             "--step-overhead-ms", overhead_ms, "--quiet", "--out", str(out)]
        )  # fmt: skip
        assert code == 0
        return json.loads(out.read_text())["mean_latency_s"]

    # Light load, the same draws: dozens of steps per request, each 20 ms longer.
    assert mean_latency("20") > mean_latency("0") + 0.2


def test_a_mixed_layout_serves_within_two_points_of_the_pure_ones(setup: ClusterSetup) -> None:
    # 2 × TP-4 + 8 × TP-1 on 16 GPUs against all TP-1 and all TP-4, at a tight SLO. Priced
    # by its next step alone, a TP-4 instance's quick batches of cache steps drew arrivals
    # while the TP-1 instances idled (busy 9 % of the time), and every step there ran
    # crowded by the others' recompute steps: 87.9 % met against 99.8 % and 99.9 %.
    cluster = dataclasses.replace(setup, node_gpus=(4, 4, 4, 4), slo_scale=1.5)
    workload = Workload.synthetic("poisson", 12.0, 120.0, LENGTHS, seed=3)
    met = {}
    for layout in ((1,) * 16, (4,) * 4, (4, 4) + (1,) * 8):
        run = simulate(dataclasses.replace(cluster, layout=layout), "dilaserve", workload, 12.0)
        met[layout] = run.summary().attainment
        by_degree = run.stats["by_degree"]
        assert sorted(by_degree) == sorted(set(layout))
        for d in by_degree.values():
            assert d["requests"] >= d["steps"] > 0 and d["tokens"] > 0
            assert 0 < d["busy_seconds"] <= run.stats["end_time"] * len(layout)
    mixed = met.pop((4, 4) + (1,) * 8)
    assert mixed >= min(met.values()) - 0.02, (mixed, met)


def test_a_shifting_workload_draws_each_phase_from_its_lengths() -> None:
    chat, long = [(100, 200), (300, 100)], prefill_heavy_lengths(50, seed=1)
    assert all(2000 <= p <= 5000 and 8 <= o <= 64 for p, o in long)
    w = Workload.shifting(20.0, 300.0, (chat, long, chat), seed=2)
    assert np.all(np.diff(w.arrival) >= 0) and w.arrival[-1] < 300.0
    for arrival, p, o in zip(w.arrival, w.prompt_len, w.output_len, strict=True):
        phase = chat if arrival < 100.0 or arrival >= 200.0 else long
        assert (int(p), int(o)) in phase


def test_static_layouts_are_every_way_to_fill_the_nodes() -> None:
    layouts = static_layouts((4, 4, 4, 4))
    assert len(layouts) == len(set(layouts)) == 25
    assert {(1,) * 16, (2,) * 8, (4,) * 4, (4, 2, 2) + (1,) * 8} <= set(layouts)
    for layout in layouts:
        assert sum(layout) == 16
        place(layout, (4, 4, 4, 4))  # each packs onto the nodes
    assert static_layouts((2,), degrees=(1, 2)) == [(1, 1), (2,)]


def test_online_prediction_follows_each_requests_speed(setup: ClusterSetup) -> None:
    # Half the requests decode at 1.5 × the model's mean tokens per step, half at 0.6 ×;
    # the predictor knows the mean rates. Refreshed predictions counted the tokens left at
    # the mean rate and met under a point more than one-shot ones (77.6 vs 76.8 %; with
    # each request's own speed, 84.4 %): a slow request's thresholds stayed high until its
    # deadline was lost.
    speeds = {"fast": 1.5, "slow": 0.6}
    by_kind = speed_classes(setup.progress, speeds)
    mean = dict(progress_model.mean_rates(setup.progress))
    for kind, speed in speeds.items():
        for tau, rate in progress_model.mean_rates(by_kind[kind])[:-1]:
            # Above it by up to 15 %: every step still commits at least one token (at τ 1,
            # a token a step, what is left is that floor).
            target = speed * mean[tau]
            assert 0.95 * target <= rate <= 1.15 * target, (kind, tau, rate, target)
    mixed = dataclasses.replace(setup, class_progress=by_kind, slo_scale=2.0)
    workload = Workload.synthetic("poisson", 6.0, 120.0, LENGTHS, seed=3)
    workload = workload.with_classes(sorted(speeds), seed=1)
    assert sorted(set(workload.progress_class)) == ["fast", "slow"]
    met = {
        p: simulate(mixed, p, workload, 6.0).summary().attainment for p in ("dilaserve", "one-shot")
    }
    assert met["dilaserve"] >= met["one-shot"] + 0.04, met


def test_migration_costs_no_deadlines_near_capacity_and_shortens_the_tail(
    setup: ClusterSetup,
) -> None:
    # 8 TP-1 instances at 95 % attainment. Moved wherever the next step finished first,
    # requests leaving a block flocked to the instance whose next batch was small: with
    # migration 94.5 % met (P99 8.74 s), without it 95.7 % (8.54 s).
    cluster = dataclasses.replace(setup, node_gpus=(4, 4), layout=(1,) * 8)
    workload = Workload.replay(read_trace(AZURE_CONV), 16.0, 120.0)
    runs = {
        p: simulate(cluster, p, workload, 16.0).summary() for p in ("dilaserve", "no-migration")
    }
    ours, still = runs["dilaserve"], runs["no-migration"]
    assert ours.attainment >= still.attainment - 0.005, (ours, still)
    assert ours.p99_latency_s <= still.p99_latency_s, (ours, still)
