"""benches/gpu_check.py: its comparison logic on the CPU, its kernel and runner checks
where CUDA is present."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dilaserve.worker.runner import StepRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TINY = {"d_model": 64, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 128, "n_layers": 2}


@pytest.fixture(scope="module")
def gpu_check():
    path = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_comparison_of_identical_runs_agrees_fully(gpu_check):
    """CPU against a CPU float32 copy: the comparison sees every commit agree (the logic
    the CUDA run relies on), and a bfloat16 copy still decodes."""
    model = gpu_check.build_model(TINY)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    agreement = gpu_check.compare_runners(model, torch.device("cpu"), prompts=prompts, steps=4)
    assert set(agreement) == {
        f"{c}_{d}" for c in ("none", "prefix", "dual") for d in ("float32", "bfloat16")
    }
    assert all(agreement[f"{c}_float32"] == 1.0 for c in ("none", "prefix", "dual"))
    assert all(0.0 <= share <= 1.0 for share in agreement.values())


def test_decode_steps_records_each_step_and_releases(gpu_check):
    model = gpu_check.build_model(TINY)
    runner = StepRunner(model, cache="dual", max_requests=2, max_seq_len=64)
    trace = gpu_check.decode_steps(runner, [[5, 6, 7]], gen_length=32, steps=3, tau=1.0)
    assert len(trace) == 3 and all(len(t) == 2 for t in trace)  # one position, one token
    assert len(runner) == 0 and runner.pool.free_tokens == runner.kv_tokens


def test_without_cuda_it_says_so_and_succeeds(gpu_check, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert json.loads(capsys.readouterr().out) == {"name": "gpu_check", "skipped": "no CUDA device"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_kernels_match_references(gpu_check, capsys, device):
    """On the CPU the kernels run in the Triton interpreter, so the shapes stay small."""
    small = device == "cpu"
    gpu_check.check_kernels(
        torch.device(device),
        batches=(1, 2) if small else (1, 3),
        vocab=300 if small else 5000,
        hidden=32 if small else 256,
        kv_heads=2,
        head_dim=16,
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 * 2 + 1  # commit (2 lines) and partials per batch, one scatter
    for line in lines:
        if line["name"].endswith("mismatches"):
            assert line["value"] == 0, line
        if line["name"] == "kernel_partials_max_rel_err":
            assert line["argmax_mismatches"] == 0 and line["value"] < 1e-3


@needs_cuda
def test_runner_on_cuda_commits_what_the_cpu_commits(gpu_check):
    model = gpu_check.build_model(TINY)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    agreement = gpu_check.compare_runners(model, torch.device("cuda"), prompts=prompts)
    assert all(agreement[f"{c}_float32"] == 1.0 for c in ("none", "prefix", "dual"))


@needs_cuda
def test_kernels_compile_once_across_batch_shapes(gpu_check):
    model = gpu_check.build_model(TINY).to("cuda")
    runner = StepRunner(model, cache="dual", max_requests=8, max_seq_len=64)
    runner.warm_up()
    compiled = gpu_check.compiled_variants()
    for batch in (1, 3, 8):
        gpu_check.decode_steps(runner, [[5, 6, 7]] * batch, gen_length=32, steps=2, tau=0.9)
    assert gpu_check.compiled_variants() == compiled


@needs_cuda
def test_runtime_bench_runs_on_cuda_and_reports_every_ratio(gpu_check, capsys):
    gpu_check.runtime_bench(torch.device("cuda"))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    names = {line["name"] for line in lines}
    assert {
        "ratio_runtime_vs_reference_loop",
        "ratio_dual_b1_vs_dual_reference_loop",
        "ratio_batch8_vs_batch1",
        "kv_pool_bytes_per_token",
    } <= names
    assert all(line["device"] == "cuda" for line in lines)
