"""`dilaserve serve` configuration and `dilaserve bench` against a live server."""

from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from dilaserve.bench.client import Client
from dilaserve.bench.report import summarize
from dilaserve.bench.workload import poisson_times, task_arrivals, trace_arrivals
from dilaserve.cli import build_parser
from dilaserve.cli.serve import (
    DEFAULTS,
    accuracy_drop,
    engine_config,
    parse_instances,
    scheduler_settings,
    settings_from,
)
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.protocol import CacheMode
from dilaserve.scheduler import PRESETS, SCHEDULER_SETTINGS, Policy, SchedulerConfigError
from dilaserve.settings import flatten
from dilaserve.traces import AZURE_CONV, read_trace


def test_instances_spec():
    assert parse_instances("2x1,1x2") == (1, 1, 2)
    for bad in ("2", "0x1", "ax1", "1x-2"):
        with pytest.raises(ValueError):
            parse_instances(bad)


def test_thresholds_and_quality_floor_flags():
    values = settings_from(
        build_parser().parse_args(["serve", "--thresholds", "0.9,0.7", "--max-accuracy-drop", "5"])
    )
    engine = engine_config(values)
    assert engine.thresholds == (0.9, 0.7) and engine.max_accuracy_drop == pytest.approx(0.05)
    assert engine_config(dict(DEFAULTS)).max_accuracy_drop == pytest.approx(0.03)
    assert accuracy_drop("none") is None
    assert engine_config({**DEFAULTS, "thresholds": [0.8, 0.6]}).thresholds == (0.8, 0.6)
    for bad in ("0,0.9", "1.5", ""):
        with pytest.raises(SchedulerConfigError, match="threshold"):
            engine_config({**DEFAULTS, "thresholds": bad})
    with pytest.raises(ValueError, match="thresholds: 'a' is invalid"):
        engine_config({**DEFAULTS, "thresholds": "a,b"})
    with pytest.raises(ValueError, match="negative"):
        accuracy_drop("-1")


def test_a_block_diffusion_model_gets_its_cache_and_refuses_another_block_length(tmp_path):
    directory = str(write_tiny_checkpoint(tmp_path, "llada2", block_length=4))
    engine = engine_config({**DEFAULTS, "model": directory})
    assert engine.cache is CacheMode.BLOCK
    with pytest.raises(ValueError, match="decodes blocks of 4 positions"):
        engine_config({**DEFAULTS, "model": directory, "block_length": 8})


def test_toml_config_then_flags(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('instances = "3x1"\nslo_scale = 4.0\npolicy = "llumnix"\nport = 9000\n')
    args = build_parser().parse_args(["serve", "--config", str(config), "--port", "9100"])
    values = settings_from(args)
    assert values["port"] == 9100 and values["slo_scale"] == 4.0
    engine = engine_config(values)
    assert engine.instances == (1, 1, 1) and engine.slo_scale == 4.0
    assert engine.policy.threshold == "fixed" and engine.policy.migration
    config.write_text("no_such_key = 1\n")
    with pytest.raises(ValueError, match="no_such_key"):
        settings_from(argparse.Namespace(config=str(config)))


def test_poisson_and_trace_workloads():
    rng = random.Random(3)
    times = poisson_times(5.0, 200.0, rng)
    assert 900 < len(times) < 1100 and times == sorted(times)
    arrivals = task_arrivals(times[:10], seed=1)
    assert [a.time for a in arrivals] == times[:10]
    trace = read_trace(AZURE_CONV)
    assert len(trace) == 19366 and trace[0][0] == 0.0
    # The trace's own rate is 5.5 req/s; compressed or stretched, the mean rate holds (it
    # used to be inverted). Its first minutes run below the mean: 1004 of 1200.
    for rate, duration in ((4.0, 300.0), (20.0, 60.0)):
        replay = trace_arrivals(trace, rate, duration, length_scale=0.1, rng=rng)
        assert 0.75 * rate * duration < len(replay) < 1.1 * rate * duration
        assert max(a.time for a in replay) < duration
    assert {a.problem.task for a in replay} <= {"add", "rep", "draw", "tr"}


def test_bench_client_against_a_live_server(start_server):
    live = start_server(instances=(1,))
    client = Client(live.url)
    isolated = asyncio.run(client.isolated_latency(repeats=1))
    assert set(isolated) == {"add", "rep", "draw", "tr"} and all(v > 0 for v in isolated.values())
    slo = {task: 5 * s for task, s in isolated.items()}
    arrivals = task_arrivals(poisson_times(4.0, 3.0, random.Random(0)), seed=2)
    outcomes = asyncio.run(client.run(arrivals, slo))
    summary = summarize("dilaserve", 4.0, outcomes, 3.0)
    assert summary.requests == len(arrivals) and summary.rejected == 0
    assert 0.0 <= summary.attainment <= 1.0 and summary.accuracy > 0.5
    assert summary.p50_latency_s <= summary.p99_latency_s


def test_every_scheduler_setting_is_a_flag_and_a_toml_key(tmp_path, capsys):
    """The core declares the settings once: each is a `serve` flag and a TOML key, with its
    doc as help, and reaches the engine's scheduler config."""
    derived = ("caching", "exact_cache")  # follow --cache and the model family
    leaves = [f for f in flatten(SCHEDULER_SETTINGS) if f["name"] not in derived]
    assert {f["name"] for f in leaves} <= set(DEFAULTS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    flags = " ".join(capsys.readouterr().out.split())
    for f in leaves:
        assert "--" + f["name"].replace("_", "-") in flags, f["name"]
        assert " ".join(f["doc"].split()[:4]) in flags, f["name"]
    config = tmp_path / "serve.toml"
    config.write_text("max_batch_tokens = 2048\ntarget_utilisation = 0.8\nmigration = false\n")
    args = build_parser().parse_args(["serve", "--config", str(config), "--slo-window-s", "3"])
    engine = engine_config(settings_from(args))
    scheduler = engine.scheduler_config()
    assert (scheduler.max_batch_tokens, scheduler.target_utilisation) == (2048, 0.8)
    assert scheduler.slo_window_s == 3.0 and not scheduler.policy.migration
    assert scheduler.caching, "caching follows --cache, not a flag of its own"
    assert not scheduler.exact_cache, "only the block cache is exact"


def test_serve_policy_flags_compose() -> None:
    def policy(**flags):
        return scheduler_settings({**DEFAULTS, **flags})["policy"]

    assert policy() == Policy.dilaserve()
    assert policy(admission="best-effort").admission == "best_effort"
    assert policy(admission="off", load_model="window") == (
        Policy.dilaserve().without_admission().window_load_control()
    )
    assert policy(policy="infaas").admission == "off"
    assert policy(policy="infaas", fixed_tau="0.7") == Policy.infaas_like(0.7)
    assert policy(policy="one-shot") == Policy.dilaserve().one_shot()
    assert policy(policy="llumnix", migration=False) == Policy.infaas_like()
    assert set(PRESETS) >= {"dilaserve", "infaas", "llumnix", "no-migration", "paper"}
    with pytest.raises(SchedulerConfigError, match="unknown policy"):
        policy(policy="fastest")
    with pytest.raises(ValueError, match="admission"):
        policy(admission="sometimes")
