"""`dilaserve plan`: the capacity and transition plan for a window of a request trace."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from dilaserve.models import allowed_degrees, check_degree, read_config
from dilaserve.planner import (
    FAST_DLLM_THRESHOLDS,
    Arrival,
    BinSpec,
    LatencyProfile,
    LaunchAction,
    Plan,
    PlannerConfig,
    PlannerInputs,
    PlannerSolveError,
    classes_from_arrivals,
    mean_isolated_latency,
    plan,
)
from dilaserve.profiles import SIMULATED_LLADA8B
from dilaserve.traces import TRACE_HELP, read_trace

ALL_DEGREES = (1, 2, 4, 8)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan TP instances, batch sizes and thresholds for a trace window",
        description=(
            "Bin a window of a request trace into classes, solve the two-stage "
            "reconfiguration ILP (DESIGN §7) and print the plan."
        ),
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=SIMULATED_LLADA8B,
        help="latency profile JSON (default: the shipped simulated LLaDA-8B/H100 profile)",
    )
    p.add_argument(
        "--trace",
        required=True,
        help=TRACE_HELP,
    )
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument(
        "--slo-scale",
        type=float,
        default=5.0,
        help="SLO as a multiple of the mean latency of a request alone on TP-1",
    )
    p.add_argument(
        "--window-start", type=float, default=0.0, help="seconds after the first arrival"
    )
    p.add_argument("--window", type=float, default=300.0, help="window length in seconds")
    p.add_argument(
        "--degrees", type=_ints, help="comma-separated TP degrees (default: 1,2,4,8 that fit)"
    )
    p.add_argument(
        "--model",
        type=Path,
        help="checkpoint directory: plan only the TP degrees its heads, KV heads, MLP width "
        "and padded vocabulary divide by (reads config.json)",
    )
    p.add_argument("--batch-tokens", type=_ints, help="comma-separated candidate batch sizes")
    p.add_argument("--caching", action="store_true", help="plan for the approximate KV cache")
    p.add_argument("--prompt-bins", type=int, default=2)
    p.add_argument("--output-bins", type=int, default=4)
    p.add_argument("--rate-margin", type=float, default=0.10)
    p.add_argument("--solver", choices=["highs", "microlp"], default="highs")
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds")
    p.add_argument("--mip-gap", type=float, default=1e-4)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)


def trace_arrivals(trace: str) -> list[Arrival]:
    """The planner's arrivals of a trace CSV (or a shipped trace's name)."""
    return [Arrival(t, prompt, output) for t, prompt, output in read_trace(trace)]


def _share(value: float) -> float:
    """A share as printed: solver round-off below zero (including -0.0) shows as 0."""
    return value if value > 0.0 else 0.0


def _format(result: Plan, slo: float) -> str:
    cap = result.capacity
    lines = [f"SLO {slo:.2f} s; solve {cap.status}, stage 1 {result.stage1_seconds * 1e3:.0f} ms"]
    if cap.overloaded:
        lines.append(
            f"OVERLOADED: the cluster sustains {cap.value.sustained_load:.1%} of the load "
            "at the lowest threshold"
        )
    lines.append(
        f"mean threshold {cap.value.quality:.3f}, latency slack "
        f"{cap.value.latency_slack:.1f} req·s/s, headroom ×{cap.headroom:.2f}"
    )
    for d in cap.degrees:
        if d.instances:
            batch = d.batch_tokens if d.batch_tokens is not None else "-"
            lines.append(
                f"  TP-{d.degree}: {d.instances} instances, batch {batch} tokens, "
                f"utilisation {d.utilisation:.0%}"
            )
    header = " ".join(f"{t:>5.2f}" for t in cap.thresholds)
    lines.append(f"  class threshold mix [{header}]  latency")
    for i, c in enumerate(cap.classes):
        mix = " ".join(f"{_share(m):>5.2f}" for m in c.threshold_mix)
        mark = "" if c.slo_reachable else "  (SLO unreachable)"
        lines.append(f"  {i:>5}               [{mix}]  {c.latency_seconds:6.2f} s{mark}")
    lines.append(f"{'adopted' if result.adopted else 'not adopted'}: {result.reason}")
    if result.transition is not None:
        for a in result.transition.actions:
            verb = f"launch TP-{a.degree}" if isinstance(a, LaunchAction) else f"stop #{a.instance}"
            lines.append(f"  {verb} on node {a.node} GPUs {list(a.gpus)}")
    return "\n".join(lines)


def _model_degrees(model: Path, degrees: tuple[int, ...], explicit: bool) -> tuple[int, ...]:
    """The degrees the model can be split into: given degrees are checked (an impossible
    one is an error naming it), default ones filtered."""
    _, config = read_config(model)
    if explicit:
        for degree in degrees:
            check_degree(config, degree, model / "config.json")
        return degrees
    return allowed_degrees(config, degrees)


def run(args: argparse.Namespace) -> int:
    if args.nodes <= 0 or args.gpus_per_node <= 0:
        raise ValueError("--nodes and --gpus-per-node must be positive")
    profile = LatencyProfile.load(args.profile)
    arrivals = trace_arrivals(args.trace)
    start = args.window_start
    classes = classes_from_arrivals(
        arrivals,
        start,
        start + args.window,
        BinSpec(args.prompt_bins, args.output_bins, args.rate_margin),
    )
    window = [a for a in arrivals if start <= a.time < start + args.window]
    top = max(FAST_DLLM_THRESHOLDS, key=lambda t: t.threshold)
    alone = mean_isolated_latency(
        profile, window, top.tokens_per_step, args.caching, profile.block_length or 32
    )
    degrees = args.degrees or tuple(d for d in ALL_DEGREES if d <= args.gpus_per_node)
    if args.model is not None:
        degrees = _model_degrees(args.model, degrees, explicit=args.degrees is not None)
    config = PlannerConfig(
        slo_seconds=args.slo_scale * alone,
        degrees=degrees,
        caching=args.caching,
        block_length=profile.block_length or 32,
        time_limit_seconds=args.time_limit,
        mip_gap=args.mip_gap,
        solver=args.solver,
        **({"batch_tokens": args.batch_tokens} if args.batch_tokens else {}),
    )
    inputs = PlannerInputs(classes, [args.gpus_per_node] * args.nodes, config)
    try:
        result = plan(inputs, profile)
    except PlannerSolveError as e:
        print(f"dilaserve plan: solver error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(
            f"{len(window)} requests in [{start:.0f}, {start + args.window:.0f}) s -> "
            f"{len(classes)} classes, {args.nodes} × {args.gpus_per_node} GPUs"
        )
        print(_format(result, config.slo_seconds))
    return 0
