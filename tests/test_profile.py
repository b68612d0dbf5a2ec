"""`dilaserve profile` and the Rust latency-profile type seen from Python."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dilaserve import LatencyProfile, LatencyProfileError
from dilaserve.cli import main
from dilaserve.models import load_model
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.profiles import SIMULATED_LLADA8B
from dilaserve.profiling import ProfileError, ProfileSettings, measure_profile
from dilaserve.protocol import CacheMode
from dilaserve.tiny import default_model_dir


def test_profile_command_writes_a_loadable_profile(tiny_llada_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(
        [
            "profile",
            "--model",
            str(tiny_llada_dir),
            "--output",
            str(out),
            "--tokens",
            "16,48",
            "--block-length",
            "8",
            "--cache-context",
            "24",
            "--repeats",
            "1",
        ]
    )
    assert code == 0
    profile = LatencyProfile.load(str(out))
    assert profile.degrees() == [1]
    assert profile.block_length == 8
    assert profile.device == "cpu"
    assert [t for t, _ in profile.points(1, "no_cache")] == [16, 48]
    assert [t for t, _ in profile.points(1, "recompute")] == [16, 48]
    assert [t for t, _ in profile.points(1, "cache")] == [16, 48]
    assert profile.contexts(1, "cache") == [24]
    assert profile.contexts(1, "recompute") == []
    for kind in ("no_cache", "recompute", "cache"):
        assert all(s > 0 for _, s in profile.points(1, kind))
    assert "wrote" in capsys.readouterr().out


SMALL_GRID = ProfileSettings(block_length=8, token_grid=(16, 48), cache_contexts=(24,), repeats=1)


def test_cache_steps_are_measured_over_context_lengths(tiny_llada_dir):
    settings = replace(SMALL_GRID, cache_contexts=(40, 16))
    measured = measure_profile(load_model(tiny_llada_dir), settings)
    assert measured["version"] == 2
    cache = [t for t in measured["tables"] if t["kind"] == "cache"]
    assert [t["context"] for t in cache] == [16, 40]
    profile = LatencyProfile.from_json(json.dumps(measured))
    assert profile.contexts(1, "cache") == [16, 40]
    assert [t for t, _ in profile.points(1, "cache", 40)] == [16, 48]
    assert profile.step_time(1, "cache", 16, 28) > 0


def test_prefix_cache_steps_count_the_suffix_they_feed(tiny_llada_dir):
    # One request's prefix-cache step feeds its block and the one-block suffix after it.
    settings = ProfileSettings(
        block_length=8,
        token_grid=(8, 16),
        cache_contexts=(24,),
        cache_mode=CacheMode.PREFIX,
        repeats=1,
    )
    measured = measure_profile(load_model(tiny_llada_dir), settings)
    (cache,) = [t for t in measured["tables"] if t["kind"] == "cache"]
    assert [t for t, _ in cache["points"]] == [16]
    dual = measure_profile(load_model(tiny_llada_dir), replace(settings, cache_mode=CacheMode.DUAL))
    (cache,) = [t for t in dual["tables"] if t["kind"] == "cache"]
    assert [t for t, _ in cache["points"]] == [8, 16]


def test_a_block_diffusion_model_is_profiled_with_its_exact_cache(tmp_path, capsys):
    """With no --block-length or --cache-mode, a block diffusion model is timed with its own
    block and the exact cache: a cache step feeds one block per request and attends to
    whole blocks; a block length the model does not decode is refused."""
    directory = write_tiny_checkpoint(tmp_path / "bd", "llada2", block_length=8)
    out = tmp_path / "profile.json"
    grid = ["--tokens", "16,48", "--cache-context", "24", "--repeats", "1"]
    assert main(["profile", "--model", str(directory), "--output", str(out), *grid]) == 0
    profile = LatencyProfile.load(str(out))
    assert profile.block_length == 8
    assert profile.contexts(1, "cache") == [24]
    assert [t for t, _ in profile.points(1, "cache", 24)] == [16, 48]
    assert [t for t, _ in profile.points(1, "recompute")] == [16, 48]
    bad = ["profile", "--model", str(directory), "--output", str(out), "--block-length", "4"]
    assert main([*bad, *grid]) != 0
    assert "blocks of 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="whole 8-token"):
        replace(SMALL_GRID, cache_mode=CacheMode.BLOCK, cache_contexts=(20,)).check()


def test_profiles_the_shipped_trained_model():
    # A trained model is sure of many answers; the cache step is still timed.
    profile = measure_profile(load_model(default_model_dir()), SMALL_GRID)
    assert {t["kind"] for t in profile["tables"]} == {"no_cache", "recompute", "cache"}


def test_a_model_that_finishes_every_block_at_once_raises(tiny_llada_dir):
    model = load_model(tiny_llada_dir)
    forward = model.forward

    def certain(*args, **kwargs):
        logits = forward(*args, **kwargs)
        return torch.zeros_like(logits).index_fill_(-1, torch.tensor([5]), 100.0)

    model.forward = certain
    with pytest.raises(ProfileError, match="no cache step"):
        measure_profile(model, SMALL_GRID)


def test_profile_command_rejects_bad_grid(tiny_llada_dir, tmp_path, capsys):
    code = main(["profile", "--model", str(tiny_llada_dir), "--tokens", "0,8"])
    assert code == 2
    assert "positive" in capsys.readouterr().err
    code = main(["profile", "--model", str(tiny_llada_dir), "--cache-context", "16"])
    assert code == 2
    assert "--cache-context" in capsys.readouterr().err


def test_profile_command_names_a_missing_checkpoint(tmp_path, capsys):
    code = main(["profile", "--model", str(tmp_path / "nowhere")])
    assert code == 2
    assert "config.json" in capsys.readouterr().err


def _profile_json(tables):
    return json.dumps({"version": 1, "tables": tables})


def test_cache_step_time_follows_the_context_and_old_files_load():
    tables = [
        {"tp": 1, "kind": "cache", "context": 256, "points": [[32, 0.004]]},
        {"tp": 1, "kind": "cache", "context": 1024, "points": [[32, 0.010]]},
    ]
    p = LatencyProfile.from_json(json.dumps({"version": 2, "tables": tables}))
    assert p.step_time(1, "cache", 32, 640) == pytest.approx(0.007)
    assert p.latency(1, "cache", 32) == pytest.approx(0.004)
    back = LatencyProfile.from_json(p.to_json())
    assert back.contexts(1, "cache") == [256, 1024]
    with pytest.raises(LatencyProfileError, match="context 512"):
        p.points(1, "cache", 512)
    # Version-1 files and the shipped profile (no contexts) still load.
    old = LatencyProfile.from_json(
        _profile_json([{"tp": 1, "kind": "cache", "points": [[32, 0.004]]}])
    )
    assert old.step_time(1, "cache", 32, 5000) == pytest.approx(0.004)
    shipped = LatencyProfile.load(SIMULATED_LLADA8B)
    assert shipped.degrees() == [1, 2, 4, 8]
    assert shipped.contexts(1, "cache") == []


def test_latency_interpolates_and_extrapolates():
    p = LatencyProfile.from_json(
        _profile_json([{"tp": 1, "kind": "cache", "points": [[32, 0.01], [64, 0.02]]}])
    )
    assert p.latency(1, "cache", 48) == pytest.approx(0.015)
    assert p.latency(1, "cache", 8) == pytest.approx(0.01)
    assert p.latency(1, "cache", 96) == pytest.approx(0.03)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "JSON"),
        (_profile_json([{"tp": 1, "kind": "warp", "points": [[1, 0.1]]}]), "warp"),
        (_profile_json([{"tp": 1, "kind": "cache", "points": []}]), "no points"),
        (_profile_json([{"tp": 1, "kind": "cache", "points": [[4, 0.1], [2, 0.2]]}]), "invalid"),
        (json.dumps({"version": 7, "tables": []}), "version"),
    ],
)
def test_malformed_profiles_raise(text, message):
    with pytest.raises(LatencyProfileError, match=message):
        LatencyProfile.from_json(text)


def test_negative_degrees_and_token_counts_raise():
    with pytest.raises(LatencyProfileError, match=r"expected an integer in \[0, 2\^32\)"):
        LatencyProfile.from_tables([(-1, "cache", [(32, 0.01)])])
    with pytest.raises(LatencyProfileError, match="got -32"):
        LatencyProfile.from_tables([(1, "cache", [(-32, 0.01)])])
    with pytest.raises(LatencyProfileError, match="got -1"):
        LatencyProfile.from_tables([(1, "cache", [(32, 0.01)])]).latency(-1, "cache", 8)


def test_missing_degree_or_kind_raises():
    p = LatencyProfile.from_tables([(1, "cache", [(32, 0.01)])])
    with pytest.raises(LatencyProfileError, match="no TP degree 2"):
        p.latency(2, "cache", 10)
    with pytest.raises(LatencyProfileError, match="no recompute table"):
        p.latency(1, "recompute", 10)
    with pytest.raises(OSError):
        LatencyProfile.load("/nonexistent/profile.json")


def test_every_subcommand_has_help(capsys):
    from dilaserve.cli import COMMANDS, build_parser

    parser = build_parser()
    names = [a for a in parser._subparsers._group_actions[0].choices]  # noqa: SLF001
    assert len(names) == len(COMMANDS)
    for name in names:
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0
        assert "usage: dilaserve " + name in capsys.readouterr().out
