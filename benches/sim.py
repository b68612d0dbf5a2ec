"""The paper's experiments in the simulator (DESIGN §9): a 16-GPU cluster (4 nodes × 4)
serving the simulated LLaDA-8B/H100 profile on the conv trace, every policy on the live
scheduler; then scale (one million requests on 1024 GPUs).

Progress: dilaserve-tiny's recorded per-step commits, pooled per threshold and rescaled to
Fast-dLLM's LLaDA-8B rates (DESIGN §9); accuracy per threshold: dilaserve-tiny's. SLO:
5 × each request's isolated latency at τ 0.9 on TP-1. Prints JSON lines; writes
docs/sim16-rate.png and docs/sim16-slo.png.

    python benches/sim.py [--quick] [--skip-scale | --scale-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from dilaserve.bench.report import plot
from dilaserve.profiles import SIMULATED_LLADA8B, llada8b_progress
from dilaserve.scheduler import LatencyProfile
from dilaserve.sim import (
    ClusterSetup,
    Workload,
    prefill_heavy_lengths,
    simulate,
    static_layouts,
)
from dilaserve.traces import AZURE_CONV, read_trace

BASELINES = ("infaas", "llumnix")
FIXED = tuple(f"fixed-{t}" for t in (0.5, 0.6, 0.7, 0.8, 0.9))
ABLATIONS = ("no-load-control", "no-migration", "one-shot", "no-reconfig", "paper")


def emit(name: str, value: float, unit: str, baseline: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": value, "unit": unit, "baseline": baseline, **extra}))


def llada8b_setup(nodes: int, gpus: int, **overrides: object) -> ClusterSetup:
    return ClusterSetup(
        profile=LatencyProfile.load(str(SIMULATED_LLADA8B)),
        progress=llada8b_progress(),
        node_gpus=(gpus,) * nodes,
        layout=(1,) * (nodes * gpus),
        **overrides,
    )


def sweep(setup, trace, policies, rates, duration):
    out = {}
    for rate in rates:
        workload = Workload.replay(trace, rate, duration)
        for policy in policies:
            out[policy, rate] = simulate(setup, policy, workload, rate).summary()
    return out


def knee_of(results, rates) -> float:
    """The lowest rate where both fixed-τ baselines fall below 75 % attainment."""
    for rate in rates:
        if all(results[b, rate].attainment < 0.75 for b in BASELINES):
            return rate
    raise RuntimeError("the baselines never fell below 75 %: sweep higher rates")


def paper_experiments(args) -> None:
    trace = read_trace(AZURE_CONV)
    setup = llada8b_setup(4, 4)
    step = 2.0
    rates = [step * i for i in range(8, 28)]
    base = sweep(setup, trace, BASELINES, rates, args.duration)
    knee = knee_of(base, rates)
    at_knee = sweep(setup, trace, ("dilaserve", *ABLATIONS), [knee], args.duration)
    ours, inf, llu = at_knee["dilaserve", knee], base["infaas", knee], base["llumnix", knee]
    for s in (ours, inf, llu, *(at_knee[a, knee] for a in ABLATIONS)):
        print(json.dumps({"sim16_knee": s.to_dict()}))
    emit("sim16_knee_rate", knee, "req/s", "infaas,llumnix < 75 % attainment")
    emit(
        "sim16_attainment_gain_pp_vs_infaas",
        100 * (ours.attainment - inf.attainment),
        "pp",
        "infaas",
        target=">= 21",
        rate=knee,
    )
    emit(
        "sim16_attainment_gain_pp_vs_llumnix",
        100 * (ours.attainment - llu.attainment),
        "pp",
        "llumnix",
        target=">= 30",
        rate=knee,
    )
    best = min(inf.mean_latency_s, llu.mean_latency_s)
    emit(
        "sim16_latency_ratio_vs_best_baseline",
        ours.mean_latency_s / best,
        "ratio",
        "best of infaas, llumnix (mean latency)",
        target="<= 0.65",
        rate=knee,
    )

    # Never worse than any fixed τ at equal quality, from light load to 1.5 × the knee.
    frontier_rates = [r for r in rates if r <= 1.5 * knee][:: 2 if args.quick else 1]
    front = sweep(setup, trace, ("dilaserve", *FIXED), frontier_rates, args.duration)
    gaps = []
    for rate in frontier_rates:
        mine = front["dilaserve", rate]
        rivals = [front[f, rate] for f in FIXED if front[f, rate].mean_tau >= mine.mean_tau - 1e-9]
        if rivals:
            gaps.append((100 * (mine.attainment - max(r.attainment for r in rivals)), rate))
    worst, worst_rate = min(gaps)
    emit(
        "sim16_worst_gap_pp_vs_fixed_frontier",
        worst,
        "pp",
        "best fixed τ with mean τ >= ours, same instance choice",
        target=">= 0",
        rate=worst_rate,
    )

    over = sweep(setup, trace, ("dilaserve",), [2 * knee], args.duration)["dilaserve", 2 * knee]
    emit(
        "sim16_overload_goodput_ratio",
        over.goodput_rps / ours.goodput_rps,
        "ratio",
        "goodput at the knee",
        target=">= 0.8",
        knee=knee,
    )

    every = {**base, **at_knee, **front}
    summaries = [s for (p, _), s in sorted(every.items()) if p in ("dilaserve", *BASELINES)]
    Path("docs").mkdir(exist_ok=True)
    plot(summaries, "docs/sim16-rate.png")

    by_scale = []
    for scale in (1, 2, 3, 5, 7, 10):
        scaled = dataclasses.replace(setup, slo_scale=float(scale))
        workload = Workload.replay(trace, knee, args.duration)
        for policy in ("dilaserve", *BASELINES):
            s = simulate(scaled, policy, workload, knee).summary()
            by_scale.append(dataclasses.replace(s, rate=float(scale)))
            print(json.dumps({"sim16_slo_scale": scale, **s.to_dict()}))
    plot(by_scale, "docs/sim16-slo.png", x_label="SLO scale (× isolated latency)")

    lengths = [(p, o) for _, p, o in trace]
    day = Workload.synthetic("day", knee * 0.8, 7200.0, lengths, seed=3)
    for policy in ("no-reconfig", *BASELINES):
        run = simulate(dataclasses.replace(setup, replan_interval_s=300.0), policy, day, knee * 0.8)
        print(json.dumps({"sim16_day_2h": run.summary().to_dict(), **plan_counts(run)}))
    against_static(setup, day, knee * 0.8, "day", ">= +1", args.quick)
    # Short chat, then long prompts (a prefill-heavy mix), then chat again.
    prefill = prefill_heavy_lengths(2000, seed=5)
    shift = Workload.shifting(knee * 0.875, 3600.0, (lengths, prefill, lengths), seed=4)
    against_static(setup, shift, knee * 0.875, "shift", ">= +2", args.quick)


def plan_counts(run) -> dict:
    return {k: run.stats[k] for k in ("replans", "plans_adopted", "launches")}


def against_static(setup, workload, rate, label, target, quick) -> None:
    """DiLaServe replanning every 5 minutes against DiLaServe on each static layout of the
    same GPUs (every one the nodes can hold; quick: the pure ones), same workload."""
    layouts = static_layouts(setup.node_gpus)
    if quick:
        layouts = [layout for layout in layouts if len(set(layout)) == 1]
    static = {}
    for layout in layouts:
        fixed = dataclasses.replace(setup, layout=layout, replan_interval_s=None)
        static[layout] = simulate(fixed, "dilaserve", workload, rate).summary()
    best_layout = max(static, key=lambda layout: static[layout].attainment)
    run = simulate(dataclasses.replace(setup, replan_interval_s=300.0), "dilaserve", workload, rate)
    ours = run.summary()
    for layout, s in static.items():
        if len(set(layout)) == 1 or layout == best_layout:
            print(json.dumps({f"sim16_{label}_static": list(layout), **s.to_dict()}))
    print(json.dumps({f"sim16_{label}_reconfig": ours.to_dict(), **plan_counts(run)}))
    emit(
        f"sim16_{label}_reconfig_gain_pp_vs_best_static",
        100 * (ours.attainment - static[best_layout].attainment),
        "pp",
        f"best of {len(static)} static layouts",
        target=target,
        best_static=list(best_layout),
        rate=rate,
    )


def scale_experiment(args) -> None:
    trace = read_trace(AZURE_CONV)
    setup = llada8b_setup(128, 8, round_quantum_s=0.002, replan_interval_s=250.0)
    n = 100_000 if args.quick else 1_000_000
    rate = 2000.0
    workload = Workload.synthetic("poisson", rate, n / rate, [(p, o) for _, p, o in trace])
    started = time.perf_counter()
    run = simulate(setup, "dilaserve", workload, rate)
    wall = time.perf_counter() - started
    s = run.summary()
    print(json.dumps({"sim1024": s.to_dict(), "stats": run.stats}))
    emit(
        "sim_s_1m_req_1024gpu" if n == 1_000_000 else "sim_s_100k_req_1024gpu",
        wall,
        "s",
        "wall clock",
        target="<= 60",
        requests=len(workload),
    )
    emit(
        "sched_share_of_step_time_1024gpu",
        run.stats["sched_share_of_step_time"],
        "ratio",
        "mean simulated step time",
        target="<= 0.01",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, help="simulated seconds per run (300; quick: 60)")
    p.add_argument(
        "--quick", action="store_true", help="fewer rates, 60 s runs; 100k requests at scale"
    )
    part = p.add_mutually_exclusive_group()
    part.add_argument("--skip-scale", action="store_true", help="only the 16-GPU experiments")
    part.add_argument("--scale-only", action="store_true", help="only the 1024-GPU run")
    args = p.parse_args()
    args.duration = args.duration or (60.0 if args.quick else 300.0)
    if not args.scale_only:
        paper_experiments(args)
    if not args.skip_scale:
        scale_experiment(args)


if __name__ == "__main__":
    main()
