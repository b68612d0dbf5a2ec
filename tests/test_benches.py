"""Every benchmark runs to completion on the current code: each one's quick mode is run as
a user runs the script, and must print its named JSON lines. Marked `bench` (minutes in
all on two cores); they are part of the default suite so that a change that breaks a
benchmark fails a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ROOT / "benches"

#: Each bench script and lines its quick mode must print.
LINES = {
    "block_diffusion.py": [
        "ratio_bd_cache_vs_full_recompute_b1",
        "ratio_bd_cache_vs_full_recompute_b8",
        "bd_tokens_identical_batched_vs_alone",
        "prefix_hit_token_share",
        "bd_prefix_saved_prefill_tokens",
        "bd_prefix_kv_rows_ratio",
        "bd_tokens_identical_prefix_shared_vs_not",
    ],
    "engine.py": ["step_rtt_ms", "migration_ms", "engine_overhead_frac_2inst"],
    "live_emulated.py": [
        "live16_vs_sim_attainment_abs_diff_pp",
        "live16_attainment_gain_pp_vs_infaas",
        "live16_attainment_gain_pp_vs_llumnix",
    ],
    "engine_scale.py": [
        "engine_idle_share_1inst",
        "engine_idle_share_64inst_16ms",
        "engine_core_us_per_step",
        "http_idle_share_16inst",
        "worker_host_ms_per_step_b64",
    ],
    "gpu_check.py": [],  # without CUDA it prints one line saying so
    "live.py": ["live_light_attainment_gap_pp"],
    "planner.py": ["plan_ms_16gpu", "ratio_highs_vs_pulp_16gpu"],
    "predictor.py": ["mae_ratio_online_vs_oneshot", "predict_ms_10k_x6_rust"],
    "ray.py": ["ray_step_rtt_ms", "ray_launch_s_per_instance"],
    "runtime.py": ["ratio_runtime_vs_reference_loop", "kv_pool_bytes_per_token"],
    "scheduler.py": ["sched_round_ms_1k_req_16_inst", "binding_overhead_frac_10k"],
    "sim.py": [
        "sim16_attainment_gain_pp_vs_infaas",
        "sim16_day_reconfig_gain_pp_vs_best_static",
        "sim16_shift_reconfig_gain_pp_vs_best_static",
        "sim16_prefill_attainment_gain_pp_vs_infaas",
        "sim16_prefill_attainment_gain_pp_vs_llumnix",
        "sim16_prefill_light_attainment",
        "sim16_bd_attainment_gain_pp_vs_infaas",
        "sim16_bd_attainment_gain_pp_vs_llumnix",
        "sim16_migration_p99_ratio",
        "sim16_oneshot_attainment_gap_pp",
        "sim16_ablation_cost_pp_reconfiguration",
        "sim_s_100k_req_1024gpu",
    ],
    "sim_vs_live.py": ["sim_vs_live_attainment_abs_diff_pp", "sim_vs_live_ablation_sign_agreement"],
    "tp.py": ["tp2_step_time_ratio", "tp_commit_bytes_per_position"],
}


def test_every_bench_has_a_quick_run_here():
    scripts = {p.name for p in BENCHES.glob("*.py")}
    assert scripts == set(LINES)


@pytest.mark.bench
@pytest.mark.parametrize("script", sorted(LINES))
def test_the_quick_mode_runs_to_completion(script, tmp_path):
    env = os.environ | {"MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(BENCHES / script), "--quick"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-2000:]
    names = {line.get("name") for line in lines}
    missing = [name for name in LINES[script] if name not in names]
    assert not missing, f"{script} printed no {missing}:\n{done.stdout[-3000:]}"
