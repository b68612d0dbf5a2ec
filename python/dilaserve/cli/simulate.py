"""`dilaserve simulate`: run policies over a workload on a simulated cluster — the live
scheduler and planner in simulated time, workers replaced by a latency profile and a
progress model recorded from real decoding — and print, per policy and rate, the same
JSON lines as `dilaserve bench` (attainment, mean / P50 / P99 latency, throughput,
estimated accuracy, mean τ), with a PNG plot of attainment and latency against rate."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from dilaserve.bench.report import plot
from dilaserve.cli.args import positive_float, positive_floats
from dilaserve.cli.serve import parse_instances
from dilaserve.planner import FAST_DLLM_THRESHOLDS
from dilaserve.predictor import progress as progress_model
from dilaserve.profiles import SIMULATED_LLADA8B
from dilaserve.scheduler import PRESETS, LatencyProfile, Policy
from dilaserve.sim import ClusterSetup, Workload, simulate
from dilaserve.tiny import default_model_dir
from dilaserve.traces import TRACE_HELP, read_trace

#: ShareGPT-like (prompt, output) lengths when no trace is given (DESIGN §9 medians).
DEFAULT_LENGTHS = [(28, 224), (140, 264), (344, 544), (1698, 928)]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="run policies on a simulated cluster", description=__doc__)
    p.add_argument("--profile", help="latency profile JSON (default: simulated LLaDA-8B/H100)")
    p.add_argument(
        "--progress",
        help="progress model JSON (default: dilaserve-tiny's, rescaled to Fast-dLLM's "
        "LLaDA-8B rates unless --no-rescale)",
    )
    p.add_argument("--no-rescale", action="store_true", help="use the progress model as is")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument(
        "--layout", help="starting instances of DiLaServe, e.g. '8x1,2x4' (default: all TP-1)"
    )
    p.add_argument(
        "--policies",
        default="dilaserve,infaas,llumnix",
        help=f"comma-separated, of {', '.join(PRESETS)} or fixed-T (a fixed threshold T)",
    )
    p.add_argument("--rates", type=positive_floats, default=[16.0, 24.0, 32.0], help="requests/s")
    p.add_argument(
        "--duration", type=positive_float, default=300.0, help="simulated seconds per rate"
    )
    p.add_argument("--arrivals", choices=["poisson", "gamma", "day", "trace"], default="trace")
    p.add_argument("--gamma-cv", type=float, default=2.0)
    p.add_argument(
        "--trace",
        help=f"{TRACE_HELP}; lengths (and arrivals with --arrivals trace) come from it",
    )
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = scale x isolated latency")
    p.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="engine time per step besides the profiled worker step (/v1/cluster step_times)",
    )
    p.add_argument(
        "--replan-interval",
        type=float,
        default=300.0,
        help="simulated seconds between replans (0: never)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON lines to this file")
    p.add_argument("--plot", help="PNG of attainment and latency against rate")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def setup_from(args: argparse.Namespace) -> ClusterSetup:
    profile = LatencyProfile.load(args.profile or str(SIMULATED_LLADA8B))
    progress = progress_model.load(args.progress or default_model_dir() / "progress.json")
    if not args.no_rescale:
        rates = [(t.threshold, t.tokens_per_step) for t in FAST_DLLM_THRESHOLDS] + [(1.0, 1.0)]
        progress = progress_model.rescaled(progress, rates)
    gpus = args.nodes * args.gpus_per_node
    layout = parse_instances(args.layout) if args.layout else (1,) * gpus
    return ClusterSetup(
        profile=profile,
        progress=progress,
        node_gpus=(args.gpus_per_node,) * args.nodes,
        layout=layout,
        slo_scale=args.slo_scale,
        step_overhead_s=args.step_overhead_ms / 1e3,
        replan_interval_s=args.replan_interval or None,
        seed=args.seed,
    )


def workload_for(args: argparse.Namespace, rate: float) -> Workload:
    trace = read_trace(args.trace) if args.trace else None
    if args.arrivals == "trace":
        if trace is None:
            raise ValueError("--arrivals trace needs --trace")
        return Workload.replay(trace, rate, args.duration)
    lengths = [(p, o) for _, p, o in trace] if trace else DEFAULT_LENGTHS
    return Workload.synthetic(
        args.arrivals, rate, args.duration, lengths, seed=args.seed, gamma_cv=args.gamma_cv
    )


def run(args: argparse.Namespace) -> int:
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for name in policies:
        Policy.named(name)  # unknown names fail before anything runs
    setup = setup_from(args)
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
    summaries = []
    try:
        runs = [(rate, policy) for rate in args.rates for policy in policies]
        for rate, policy in tqdm(runs, disable=args.quiet, file=sys.stderr, desc="simulate"):
            summary = simulate(setup, policy, workload_for(args, rate), rate).summary()
            summaries.append(summary)
            line = json.dumps(summary.to_dict())
            print(line, flush=True)
            if out:
                out.write(line + "\n")
    finally:
        if out:
            out.close()
    if args.plot:
        plot(summaries, Path(args.plot))
    return 0
