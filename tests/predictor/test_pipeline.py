"""Collection, training, calibration and refresh-interval evaluation, end to end on the
embedded model and the shipped traces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dilaserve.cli import main as cli
from dilaserve.models import load_model, load_tokenizer
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.predictor.calibrate import RateTable, rates_from_table
from dilaserve.predictor.collect import (
    CollectConfig,
    Prompt,
    collect,
    load,
    plan_runs,
    recorded_config,
)
from dilaserve.predictor.evaluate import best_interval, refresh_errors, sorted_by_run
from dilaserve.predictor.features import BLOCK_FEATURES, FEATURE_NAMES
from dilaserve.predictor.train import TrainConfig, train
from dilaserve.tiny import default_model_dir
from dilaserve.worker.runner import StepRunner

DATA = Path(__file__).parent / "data" / "tiny_traces.parquet"


@pytest.fixture(scope="module")
def small_table() -> pa.Table:
    d = default_model_dir()
    runner = StepRunner(load_model(d), cache="dual", max_requests=8)
    prompts = [
        Prompt("draw:aabcdefg,abbcdfgh,abccdfgh,abcddfgh>", 9, "draw"),
        Prompt("12345+67890=", 7, "add"),
        Prompt("tr:" + "abcdefghij" * 4 + ">", 41, "tr"),
    ]
    config = CollectConfig(thresholds=(0.5, 1.0), switched_runs=1, max_switch_step=1, batch_size=8)
    return collect(runner, load_tokenizer(d), prompts, config)


def test_runs_cover_every_threshold_and_switch():
    runs = plan_runs(2, CollectConfig(thresholds=(0.5, 0.9), switched_runs=3))
    assert len(runs) == 2 * (2 + 3)
    fixed = [r for r in runs if r.switch_step == 0]
    assert {(r.prompt, r.tau) for r in fixed} == {(p, t) for p in (0, 1) for t in (0.5, 0.9)}
    assert all(r.tau != r.tau_before and r.switch_step >= 1 for r in runs if r not in fixed)


def test_collected_rows_carry_true_labels(small_table):
    assert set(FEATURE_NAMES) <= set(small_table.column_names)
    rows = sorted_by_run(small_table).to_pylist()
    assert {r["task"] for r in rows} == {"draw", "add", "tr"}
    by_run: dict[int, list[dict]] = {}
    for r in rows:
        by_run.setdefault(r["run"], []).append(r)
    for states in by_run.values():
        n = states[0]["total_steps"]
        assert [s["steps_done"] for s in states] == list(range(n))
        assert [s["remaining_steps"] for s in states] == list(range(n, 0, -1))
        # With the dual cache a recompute step opens each block.
        assert states[0]["remaining_recompute"] == sum(s["kind"] == "recompute" for s in states)
        assert all(s["next_full"] == (s["block_steps"] == 0) for s in states)
        assert math.isnan(states[0]["confidence_min"])  # nothing reported at arrival
        for s in states:
            assert s["labeled"] == (s["steps_done"] >= s["switch_step"])
            assert s["step_tau"] == (s["tau"] if s["labeled"] else s["tau_before"])
            if s["block_steps"] == 0:
                # A block's statistics are dropped once it completes.
                assert math.isnan(s["confidence_min"])
            else:
                assert 0.0 <= s["confidence_min"] <= s["confidence_q75"] <= 1.0
        assert states[-1]["total_committed"] >= states[-1]["unmasked"]
    tr = [s for s in rows if s["task"] == "tr" and s["switch_step"] == 0 and s["tau"] == 1.0]
    # Two blocks offered; EOS may end the request in the first (the labels count what ran).
    assert tr[0]["output_length"] == 64 and 1 <= tr[0]["remaining_recompute"] <= 2


def test_calibration_measures_tokens_per_step(small_table, tmp_path):
    rates = rates_from_table(small_table)
    assert [t for t, _ in rates.points] == [0.5, 1.0]
    assert rates.points[0][1] > rates.points[1][1] >= 1.0
    path = rates.save(tmp_path / "predictor_rates.json")
    assert RateTable.load(path) == rates
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 1, "block_length": 32, "runs": 1, "points": [[0.5, 0.2]]}))
    with pytest.raises(ValueError, match="rate"):
        RateTable.load(bad)


def test_perfect_predictions_have_no_error_at_any_interval(small_table):
    table = sorted_by_run(small_table)
    remaining = table.column("remaining_steps").to_numpy().astype(float)
    recompute = table.column("remaining_recompute").to_numpy().astype(float)

    def perfect(rows):
        return remaining[rows] - recompute[rows], recompute[rows]

    errs = refresh_errors(table, perfect, [1, 2, 4, None])
    # Counting executed steps off a true prediction keeps it true: only predictions made
    # before a run's switch (labels of another τ) can err.
    assert errs[1].mae == 0.0
    assert best_interval(errs) >= 1


def test_training_reports_heldout_error_and_saves(traces, tmp_path):
    result = train(traces, TrainConfig(max_rounds=15, recompute_rounds=5, num_threads=1))
    assert set(result.heldout) == {"total", "recompute", "recompute_structural"}
    assert result.heldout["total"].mae < 2.0
    assert not (result.split.train & result.split.heldout).any()
    # dilaserve-tiny decodes every block it is offered (almost always): counting blocks wins.
    assert result.heldout["recompute_structural"].mae < 0.01
    stale = tmp_path / "predictor_recompute.txt"
    stale.write_text("stale")
    total, recompute = result.save(tmp_path)
    assert total.name == "predictor.txt"
    assert recompute is None and not stale.exists()


def test_cli_train_and_calibrate(capsys, tmp_path):
    data = str(DATA)
    args = ["predictor", "train", "--data", data, "--out", str(tmp_path), "--max-rounds", "10"]
    assert cli([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["heldout"]["total"]["mae"] > 0
    assert summary["predict_every"] >= 1 and set(summary["refresh"]) == {"1", "2", "4", "8", "16"}
    assert (tmp_path / "predictor.txt").is_file()
    out = tmp_path / "rates.json"
    assert cli(["predictor", "calibrate", "--data", data, "--out", str(out)]) == 0
    rates = RateTable.load(out)
    assert len(rates.points) == 6 and np.all(np.diff([r for _, r in rates.points]) < 0)


def test_a_block_diffusion_model_is_collected_with_its_exact_cache_and_blocks(tmp_path, capsys):
    """`collect` decodes a block diffusion model with the block cache, aligned to its own
    blocks; `train` then gives the boosters the remaining-blocks feature."""
    directory = write_tiny_checkpoint(tmp_path / "bd", "llada2", block_length=4)
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello world " * (1 + i % 3), "max_tokens": 6 + i % 5} for i in range(24)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = tmp_path / "traces.parquet"
    decode = ["--model", str(directory), "--prompts", str(prompts), "--quiet"]
    args = ["predictor", "collect", "--out", str(data), "--thresholds", "0.5,1.0", *decode]
    assert cli([*args, "--switched-runs", "1"]) == 0
    table = load(data)
    assert recorded_config(table)["cache"] == "block"
    assert set(table.column("block_length").to_pylist()) == {4}
    # Aligned: every prompt's blocks plus the output's are whole 4-token blocks.
    lengths = np.add(table.column("prompt_length"), table.column("output_length"))
    assert np.all(lengths % 4 == 0)
    capsys.readouterr()
    out = tmp_path / "boosters"
    assert cli(["predictor", "train", "--data", str(data), "--out", str(out), "--json"]) == 0
    header = (out / "predictor.txt").read_text().split("feature_names=")[1].splitlines()[0]
    assert header.split() == [*FEATURE_NAMES, *BLOCK_FEATURES]


def test_cli_progress_takes_the_accuracy_of_the_traces_cache_mode(capsys, tmp_path):
    taus = sorted(set(load(DATA).column("step_tau").to_pylist()))
    rows = [
        {"threshold": t, "cache": cache, "accuracy": accuracy - t / 10}
        for t in taus
        for cache, accuracy in (("none", 0.5), ("dual", 1.0))
    ]
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "progress.json"
    args = ["predictor", "progress", "--data", str(DATA), "--eval", str(evals)]
    assert cli([*args, "--out", str(out)]) == 0
    model = json.loads(out.read_text())
    assert model["thresholds"] == taus
    assert model["accuracy"] == [1.0 - t / 10 for t in taus]  # the traces were dual's
    evals.write_text(json.dumps(rows[0]) + "\n")
    assert cli([*args, "--out", str(out)]) == 2
    assert "no rows of the traces' cache mode 'dual'" in capsys.readouterr().err
