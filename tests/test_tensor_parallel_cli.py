"""The command line's tensor parallelism: `dilaserve profile --tp` measures real per-degree
tables on rank processes, and `dilaserve plan --model` plans only the degrees a model can be
split into."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_planner_cli import write_trace

from dilaserve import LatencyProfile
from dilaserve.cli import main
from dilaserve.models.testing import write_tiny_checkpoint


def test_profile_measures_a_tp2_instance(tmp_path: Path, capsys) -> None:
    out = tmp_path / "profile.json"
    argv = ["profile", "--tp", "1,2", "--tokens", "64", "--repeats", "1", "--threads", "1"]
    assert main([*argv, "--device", "cpu", "-o", str(out)]) == 0
    profile = LatencyProfile.load(str(out))
    assert profile.degrees() == [1, 2]
    for tp in (1, 2):
        for kind in ("no_cache", "recompute", "cache"):
            assert [t for t, _ in profile.points(tp, kind)] == [64]
    tables = json.loads(out.read_text())["tables"]
    assert {(t["tp"], t["kind"]) for t in tables} == {
        (tp, kind) for tp in (1, 2) for kind in ("no_cache", "recompute", "cache")
    }
    assert "tp=2 recompute" in capsys.readouterr().out


def test_profile_refuses_a_degree_the_model_does_not_allow(tmp_path: Path, capsys) -> None:
    argv = ["profile", "--tp", "3", "--tokens", "64", "-o", str(tmp_path / "p.json")]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "TP 3 is impossible" in err and "allowed degrees: 1, 2, 4, 8" in err


@pytest.fixture(scope="module")
def dream28(tmp_path_factory) -> Path:
    """Dream-7B's attention shape (28 query heads, 4 KV heads) at toy width."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("dream28"),
        "dream",
        hidden_size=112,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=64,
    )


def test_plan_with_a_model_uses_only_its_degrees(tmp_path: Path, dream28: Path, capsys) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    argv = ["plan", "--trace", str(trace), "--nodes", "1", "--gpus-per-node", "8", "--json"]
    assert main([*argv, "--window", "60", "--model", str(dream28)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {d["degree"] for d in result["capacity"]["degrees"]} <= {1, 2, 4}
    assert main([*argv, "--window", "60", "--model", str(dream28), "--degrees", "1,8"]) == 2
    assert "TP 8 is impossible" in capsys.readouterr().err
