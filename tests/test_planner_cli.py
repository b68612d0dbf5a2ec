"""`dilaserve plan` on a small trace written by the test, and the shipped simulated profile."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from dilaserve import LatencyProfile
from dilaserve.cli import main
from dilaserve.profiles import SIMULATED_LLADA8B


def write_trace(path: Path, n: int = 120, spacing_s: float = 0.5) -> Path:
    """An Azure-LLM-style CSV: 7-digit fractional timestamps, context and generated tokens."""
    start = datetime(2023, 11, 16, 18, 15, 46)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        t = start + timedelta(seconds=i * spacing_s)
        lines.append(
            f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond:06d}0,{100 + 37 * (i % 9)},{40 + 23 * (i % 7)}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_shipped_profile_matches_the_design_sanity_numbers() -> None:
    profile = LatencyProfile.load(SIMULATED_LLADA8B)
    assert profile.degrees() == [1, 2, 4, 8]
    for kind in ("no_cache", "recompute", "cache"):
        t1 = profile.latency(1, kind, 4096)
        assert profile.latency(2, kind, 4096) / t1 == pytest.approx(0.75)
        assert profile.latency(4, kind, 4096) / t1 == pytest.approx(0.45)


def test_plan_prints_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    argv = ["plan", "--trace", str(trace), "--gpus-per-node", "4", "--nodes", "2"]
    code = main([*argv, "--slo-scale", "5", "--window", "60"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "120 requests in [0, 60) s" in out
    assert "TP-" in out and "adopted" in out and "launch TP-" in out


def test_plan_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    argv = ["plan", "--trace", str(trace), "--nodes", "1", "--gpus-per-node", "8", "--json"]
    assert main([*argv, "--caching", "--window", "60"]) == 0
    result = json.loads(capsys.readouterr().out)
    gpus = sum(d["degree"] * d["instances"] for d in result["capacity"]["degrees"])
    assert 0 < gpus <= 8
    assert result["adopted"] is True
    assert len(result["capacity"]["classes"]) >= 1


def test_plan_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["plan", "--trace", str(bad)]) == 2
    assert "expected a CSV with columns" in capsys.readouterr().err
    trace = write_trace(tmp_path / "trace.csv")
    assert main(["plan", "--trace", str(trace), "--window-start", "1000"]) == 2
    assert "no arrivals in the window" in capsys.readouterr().err
    assert main(["plan", "--trace", str(trace), "--nodes", "0"]) == 2
