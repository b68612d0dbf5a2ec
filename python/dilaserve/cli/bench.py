"""`dilaserve bench`: replay arrivals (Poisson, Gamma, or a request trace scaled in time
and length) against the server with task prompts whose answers are checked; per policy
and rate print SLO attainment, mean / P50 / P99 latency, throughput, accuracy and mean τ
as JSON lines, and plot attainment and latency against rate."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

from dilaserve.bench import SweepSpec, plot, run_sweep
from dilaserve.cli.args import positive_float, positive_floats
from dilaserve.scheduler import PRESETS, Policy
from dilaserve.traces import TRACE_HELP


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="load-test the server per policy and rate", description=__doc__
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server (one policy: the one it serves)")
    target.add_argument(
        "--spawn", action="store_true", help="start `dilaserve serve` for each policy"
    )
    p.add_argument(
        "--policies",
        default="dilaserve,infaas,llumnix",
        help=f"comma-separated, of {', '.join(PRESETS)} or fixed-T",
    )
    p.add_argument("--rates", type=positive_floats, default=[1.0, 2.0, 4.0], help="requests/s")
    p.add_argument(
        "--duration", type=positive_float, default=30.0, help="seconds of arrivals per rate"
    )
    p.add_argument("--arrivals", choices=["poisson", "gamma", "trace"], default="poisson")
    p.add_argument("--gamma-cv", type=float, default=2.0, help="burstiness of gamma arrivals")
    p.add_argument("--trace", help=TRACE_HELP)
    p.add_argument("--length-scale", type=float, default=0.1, help="trace output length factor")
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = scale x isolated latency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra `dilaserve serve` flags with --spawn")
    p.add_argument("--api-key", default=os.environ.get("DILASERVE_API_KEY"))
    p.add_argument("--out", help="also write the JSON lines to this file")
    p.add_argument("--plot", help="PNG of attainment and latency against rate")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for name in policies:
        Policy.named(name)  # unknown names fail before anything runs
    if args.url and len(policies) != 1:
        raise ValueError("--url measures the one policy that server runs: give one --policies")
    spec = SweepSpec(
        policies=policies,
        rates=args.rates,
        duration_s=args.duration,
        arrivals=args.arrivals,
        gamma_cv=args.gamma_cv,
        trace=args.trace,
        length_scale=args.length_scale,
        slo_scale=args.slo_scale,
        seed=args.seed,
        serve_args=args.serve_args.split(),
    )
    expected = sum(len(spec.workload(r)) for r in spec.rates) * len(policies)
    out = open(args.out, "w") if args.out else None  # noqa: SIM115
    with tqdm(total=expected, disable=args.quiet, file=sys.stderr, unit="req") as bar:

        def emit(summary) -> None:
            line = json.dumps(summary.to_dict())
            bar.write(line, file=sys.stdout)
            if out is not None:
                out.write(line + "\n")

        summaries, slo = run_sweep(spec, args.url, args.api_key, emit, bar.update)
    if out is not None:
        out.close()
    print(json.dumps({"slo_s_by_task": slo}), file=sys.stderr)
    if args.plot:
        plot(summaries, args.plot)
    return 0
