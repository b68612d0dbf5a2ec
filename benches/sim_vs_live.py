"""The simulator against the live system: dilaserve-tiny on this machine (two TP-1
instances), the same latency profile (measured once by `dilaserve profile` and given to the
server with `--profile`), the engine's time per step around the worker's (measured live at
light load), progress recorded from the same model (`dilaserve predictor collect` at the
served thresholds, one progress model per task of its suite: an `add` answer takes one step
per block, a `draw` several), its LightGBM step predictor, the same arrivals, prompts,
output lengths and deadlines (SLO = 5 × each task's isolated latency at τ 0.9, measured
live), and the same quality floor. Every live and simulated summary is printed as a JSON
line, then per policy and rate the differences, and the worst over all of them:

- `sim_vs_live_attainment_abs_diff_pp`: |simulated − live| SLO attainment, points;
- `sim_vs_live_mean_latency_rel_diff`: |simulated − live| / live mean latency;
- `sim_vs_live_ablation_sign_agreement`: the share of (ablation, rate) pairs where the
  simulator and the live run agree on what removing the mechanism does to attainment
  (helps, hurts, or within a point either way).

`python benches/sim_vs_live.py [--rates R,R,...] [--duration S] [--policies P,P] [--quick]`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import numpy as np

from dilaserve.bench import SweepSpec, run_sweep
from dilaserve.bench.client import Client
from dilaserve.bench.sweep import spawned_server
from dilaserve.bench.workload import Arrival
from dilaserve.engine import EngineConfig
from dilaserve.engine.quality import quality_floor
from dilaserve.models import encode_prompt, load_tokenizer
from dilaserve.predictor import collect as traces
from dilaserve.predictor import progress as progress_model
from dilaserve.scheduler import LatencyProfile
from dilaserve.sim import ClusterSetup, Workload, simulate
from dilaserve.tiny import default_model_dir
from dilaserve.tiny.tasks import gen_length

BLOCK = 32
#: Attainment differences within this many points count as no effect.
DEAD_BAND_PP = 1.0
#: The ablations (`dilaserve` without one mechanism) whose effect is compared.
ABLATIONS = ("no-load-control", "no-migration", "one-shot", "no-admission")
#: Cached contexts the profile times cache steps at: the tiny tasks' sequence lengths.
CACHE_CONTEXTS = "64,128,256"


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def measure_profile(path: Path, repeats: int | None = None) -> Path:
    """`dilaserve profile` of dilaserve-tiny with one thread per rank, as each of the two
    workers runs on this machine (`repeats` timings per point: the command's default)."""
    subprocess.run(
        [
            *(sys.executable, "-m", "dilaserve", "profile"),
            *("--threads", "1", "--cache-context", CACHE_CONTEXTS, "--output", str(path)),
            *(() if repeats is None else ("--repeats", str(repeats))),
        ],
        check=True,
    )
    return path


def step_overhead(serve_args: list[str]) -> float:
    """Seconds the live engine spends per step besides the worker's own step (dispatch,
    transport, result handling: `/v1/cluster`'s `step_times`), over requests sent one at a
    time to a server of its own."""

    async def measure(url: str) -> dict:
        await Client(url).isolated_latency()
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/cluster") as r:
            return (await r.json())["step_times"]

    with spawned_server("dilaserve", serve_args) as url:
        t = asyncio.run(measure(url))
    return (t["round_trip_s"] - t["worker_s"] + t["dispatch_gap_s"]) / t["steps"]


def task_progress(
    thresholds: tuple[float, ...], shipped: dict, path: Path, runs: int = 200
) -> dict[str, dict]:
    """Per-task progress models of dilaserve-tiny, recorded by `dilaserve predictor collect`
    at `thresholds` (the accuracy per threshold: the shipped model's)."""
    subprocess.run(
        [
            *(sys.executable, "-m", "dilaserve", "predictor", "collect", "--out", str(path)),
            *("--n", str(runs), "--switched-runs", "0", "--block-length", str(BLOCK), "--quiet"),
            *("--thresholds", ",".join(map(str, thresholds))),
        ],
        check=True,
    )
    accuracy = {
        t: float(np.interp(t, shipped["thresholds"], shipped["accuracy"])) for t in thresholds
    }
    return progress_model.progress_by_class(traces.load(path), accuracy, model="dilaserve-tiny")


def workload_of(arrivals: list[Arrival], duration_s: float, tokenizer) -> Workload:
    """The live run's requests as the simulator takes them: arrival time, prompt tokens,
    the output positions the client asks for, and the task."""
    return Workload(
        np.asarray([a.time for a in arrivals], dtype=np.float64),
        np.asarray([len(encode_prompt(tokenizer, a.problem.prompt)) for a in arrivals], np.uint32),
        np.asarray([gen_length(a.problem, BLOCK) for a in arrivals], dtype=np.uint32),
        duration_s,
        progress_class=[a.problem.task for a in arrivals],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="8,16,24,32")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    parser.add_argument(
        "--policies",
        help="dilaserve and the ablations among them are compared (default: dilaserve, "
        "infaas, no-load-control, no-migration, one-shot; quick: dilaserve, infaas, "
        "no-migration)",
    )
    parser.add_argument("--profile", help="use this profile instead of measuring one")
    parser.add_argument(
        "--quick", action="store_true", help="one rate (8 req/s) for 3 s, a coarse profile"
    )
    args = parser.parse_args()
    if args.quick:
        args.rates, args.duration = "8", 3.0
        args.policies = args.policies or "dilaserve,infaas,no-migration"
    args.policies = args.policies or "dilaserve,infaas,no-load-control,no-migration,one-shot"
    model_dir = default_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(
            args.profile or measure_profile(Path(tmp) / "profile.json", 1 if args.quick else None)
        )
        spec = SweepSpec(
            policies=args.policies.split(","),
            rates=[float(r) for r in args.rates.split(",")],
            duration_s=args.duration,
            serve_args=["--instances", "2x1", "--profile", str(profile_path)],
        )
        overhead_s = step_overhead(list(spec.serve_args))
        print(json.dumps({"step_overhead_ms": round(1e3 * overhead_s, 3)}), flush=True)
        live, slo = run_sweep(spec, on_summary=lambda s: print(json.dumps(s.to_dict())))
        profile = LatencyProfile.load(str(profile_path))
        shipped = progress_model.load(model_dir / "progress.json")
        thresholds = quality_floor(EngineConfig().thresholds, model_dir, 0.03)
        runs = 40 if args.quick else 200
        by_task = task_progress(thresholds, shipped, Path(tmp) / "traces.parquet", runs)
    setup = ClusterSetup(
        profile=profile,
        progress=shipped,
        class_progress=by_task,
        node_gpus=(2,),
        layout=(1, 1),
        thresholds=thresholds,
        block_length=BLOCK,
        predictor_model=str(model_dir / "predictor.txt"),
        replan_interval_s=None,
        step_overhead_s=overhead_s,
    )
    tokenizer = load_tokenizer(model_dir)
    worst_attainment = worst_latency = 0.0
    attained = {}
    for ours in live:
        arrivals = spec.workload(ours.rate)
        deadlines = [slo[a.problem.task] for a in arrivals]
        workload = workload_of(arrivals, spec.duration_s, tokenizer)
        sim = simulate(setup, ours.policy, workload, ours.rate, slo_s=deadlines).summary()
        print(json.dumps({"simulated": True, **sim.to_dict()}))
        attained[ours.policy, ours.rate] = (ours.attainment, sim.attainment)
        attainment = 100 * abs(sim.attainment - ours.attainment)
        latency = abs(sim.mean_latency_s - ours.mean_latency_s) / ours.mean_latency_s
        where = {"policy": ours.policy, "rate": ours.rate}
        emit("sim_vs_live_attainment_abs_diff_pp_at", attainment, "pp", **where)
        emit("sim_vs_live_mean_latency_rel_diff_at", latency, "ratio", **where)
        worst_attainment = max(worst_attainment, attainment)
        worst_latency = max(worst_latency, latency)
    emit("sim_vs_live_attainment_abs_diff_pp", worst_attainment, "pp", target=5.0, of="worst")
    emit("sim_vs_live_mean_latency_rel_diff", worst_latency, "ratio", target=0.15, of="worst")
    ablation_signs(attained)


def ablation_signs(attained: dict) -> None:
    """Per ablation and rate, whether the simulator and the live run agree on the sign of
    `dilaserve`'s attainment minus the ablation's (within `DEAD_BAND_PP`: none)."""

    def sign(points: float) -> int:
        return 0 if abs(points) < DEAD_BAND_PP else (1 if points > 0 else -1)

    agree = []
    for (policy, rate), (live, sim) in sorted(attained.items()):
        if policy not in ABLATIONS or ("dilaserve", rate) not in attained:
            continue
        ours_live, ours_sim = attained["dilaserve", rate]
        live_pp, sim_pp = 100 * (ours_live - live), 100 * (ours_sim - sim)
        agree.append(sign(live_pp) == sign(sim_pp))
        where = {"policy": policy, "rate": rate, "live_pp": round(live_pp, 2)}
        emit(
            "sim_vs_live_ablation_sign_at",
            float(agree[-1]),
            "bool",
            sim_pp=round(sim_pp, 2),
            **where,
        )
    if agree:
        emit("sim_vs_live_ablation_sign_agreement", sum(agree) / len(agree), "share", target=1.0)


if __name__ == "__main__":
    main()
