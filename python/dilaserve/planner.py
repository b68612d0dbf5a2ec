"""Cluster reconfiguration planner (DESIGN §7): typed inputs and plans around the Rust core.

Stage 1 chooses instances per TP degree, their batch size and each request class's threshold
mix; Stage 2 keeps as many running instances as possible and orders launches and stops. The
solve runs in Rust (HiGHS by default, microlp as a pure-Rust fallback) with the GIL released;
this module only converts between dataclasses and the core's JSON form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dilaserve import _core
from dilaserve._core import LatencyProfile, PlannerInputError, PlannerSolveError

__all__ = [
    "FAST_DLLM_THRESHOLDS",
    "Arrival",
    "BinSpec",
    "CapacityPlan",
    "ClassPlan",
    "DegreePlan",
    "Deployment",
    "Gains",
    "Instance",
    "LaunchAction",
    "Plan",
    "PlanValue",
    "PlannerConfig",
    "PlannerInputError",
    "PlannerInputs",
    "PlannerSolveError",
    "RequestClass",
    "StopAction",
    "ThresholdOption",
    "TransitionPlan",
    "available_solvers",
    "classes_from_arrivals",
    "mean_isolated_latency",
    "plan",
    "plan_capacity",
    "plan_transition",
]

Solver = Literal["highs", "microlp"]
SolveStatus = Literal["optimal", "gap_limit", "time_limit"]

DEFAULT_BATCH_TOKENS: tuple[int, ...] = tuple(1024 << i for i in range(8))


@dataclass(frozen=True)
class RequestClass:
    """Requests of similar length arriving at ``rate`` per second (margin included)."""

    prompt_tokens: float
    output_tokens: float
    rate: float
    #: The class's own latency objective in seconds; None: `PlannerConfig.slo_seconds`.
    slo_seconds: float | None = None


@dataclass(frozen=True)
class ThresholdOption:
    """A candidate confidence threshold and the mean tokens committed per step at it."""

    threshold: float
    tokens_per_step: float


# Fast-dLLM's measured tokens per step on GSM8K (DESIGN §9).
FAST_DLLM_THRESHOLDS: tuple[ThresholdOption, ...] = (
    ThresholdOption(0.5, 7.01),
    ThresholdOption(0.6, 6.17),
    ThresholdOption(0.7, 5.12),
    ThresholdOption(0.8, 4.24),
    ThresholdOption(0.9, 3.25),
)


@dataclass(frozen=True)
class Instance:
    """A TP group of ``degree`` GPUs on one node."""

    node: int
    degree: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Deployment:
    """What the cluster runs: instances and the batch size (tokens) of each TP degree."""

    instances: tuple[Instance, ...] = ()
    batch_tokens: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannerConfig:
    """The SLO and the choices Stage 1 ranges over; defaults follow DESIGN §7 and §9."""

    slo_seconds: float
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    batch_tokens: tuple[int, ...] = DEFAULT_BATCH_TOKENS
    caching: bool = False
    #: With `caching`, block diffusion's exact cache: one prefill per request, no
    #: recompute at a block's end.
    exact_cache: bool = False
    block_length: int = 32
    time_limit_seconds: float = 10.0
    mip_gap: float = 1e-4
    min_improvement: float = 0.10
    #: Whether latency slack alone may adopt a plan (DESIGN §7); off: served load and
    #: quality only (see the core's `PlannerConfig`).
    adopt_for_latency_slack: bool = False
    solver: Solver = "highs"


@dataclass(frozen=True)
class PlannerInputs:
    """One planning call: request classes, thresholds, GPUs per node and settings."""

    classes: Sequence[RequestClass]
    node_gpus: Sequence[int]
    config: PlannerConfig
    thresholds: Sequence[ThresholdOption] = FAST_DLLM_THRESHOLDS
    current: Deployment | None = None


@dataclass(frozen=True)
class Arrival:
    """One observed request: arrival time in seconds and token counts."""

    time: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class BinSpec:
    """Quantile bins over prompt and output length; rates scaled by ``1 + rate_margin``."""

    prompt_bins: int = 2
    output_bins: int = 4
    rate_margin: float = 0.10


@dataclass(frozen=True)
class DegreePlan:
    degree: int
    instances: int
    batch_tokens: int | None
    utilisation: float
    capacity_tokens_per_second: float


@dataclass(frozen=True)
class ClassPlan:
    threshold_mix: tuple[float, ...]
    mean_threshold: float
    steps_per_request: float
    latency_seconds: float
    slo_reachable: bool
    degree_share: tuple[float, ...]


@dataclass(frozen=True)
class PlanValue:
    """Objective values: served share of the load, mean threshold, latency slack."""

    sustained_load: float
    quality: float
    latency_slack: float


@dataclass(frozen=True)
class CapacityPlan:
    """Stage 1: instances per degree, per-class threshold mix, predicted capacity and slack."""

    status: SolveStatus
    overloaded: bool
    value: PlanValue
    headroom: float
    thresholds: tuple[float, ...]
    degrees: tuple[DegreePlan, ...]
    instances_per_node: tuple[tuple[int, ...], ...]
    classes: tuple[ClassPlan, ...]


@dataclass(frozen=True)
class StopAction:
    """Migrate the requests of current instance ``instance`` away, then stop it."""

    instance: int
    node: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class LaunchAction:
    """Start a new TP group on these GPUs of ``node``."""

    node: int
    degree: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class TransitionPlan:
    """Stage 2: kept and stopped current instances, new ones, and the ordered actions."""

    status: SolveStatus
    kept: tuple[int, ...]
    stopped: tuple[int, ...]
    launched: tuple[Instance, ...]
    actions: tuple[StopAction | LaunchAction, ...]
    instances: tuple[Instance, ...]


@dataclass(frozen=True)
class Gains:
    sustained_load: float
    quality: float
    latency_slack: float


@dataclass(frozen=True)
class Plan:
    """Both stages plus the adoption verdict against the running deployment."""

    capacity: CapacityPlan
    current_value: PlanValue | None
    gains: Gains | None
    adopted: bool
    reason: str
    transition: TransitionPlan | None
    instances_per_node: tuple[tuple[int, ...], ...]
    stage1_seconds: float
    stage2_seconds: float


def _inputs_json(inputs: PlannerInputs) -> str:
    raw = asdict(inputs)
    current = raw["current"]
    if current is not None:
        current["batch_tokens"] = {str(k): v for k, v in current["batch_tokens"].items()}
    return json.dumps(raw)


def _instance(raw: Mapping[str, Any]) -> Instance:
    return Instance(raw["node"], raw["degree"], tuple(raw["gpus"]))


def _action(raw: Mapping[str, Any]) -> StopAction | LaunchAction:
    if raw["action"] == "stop":
        return StopAction(raw["instance"], raw["node"], tuple(raw["gpus"]))
    return LaunchAction(raw["node"], raw["degree"], tuple(raw["gpus"]))


def _capacity(raw: Mapping[str, Any]) -> CapacityPlan:
    return CapacityPlan(
        status=raw["status"],
        overloaded=raw["overloaded"],
        value=PlanValue(**raw["value"]),
        headroom=raw["headroom"],
        thresholds=tuple(raw["thresholds"]),
        degrees=tuple(DegreePlan(**d) for d in raw["degrees"]),
        instances_per_node=tuple(tuple(n) for n in raw["instances_per_node"]),
        classes=tuple(
            ClassPlan(
                threshold_mix=tuple(c["threshold_mix"]),
                mean_threshold=c["mean_threshold"],
                steps_per_request=c["steps_per_request"],
                latency_seconds=c["latency_seconds"],
                slo_reachable=c["slo_reachable"],
                degree_share=tuple(c["degree_share"]),
            )
            for c in raw["classes"]
        ),
    )


def _transition(raw: Mapping[str, Any]) -> TransitionPlan:
    return TransitionPlan(
        status=raw["status"],
        kept=tuple(raw["kept"]),
        stopped=tuple(raw["stopped"]),
        launched=tuple(_instance(i) for i in raw["launched"]),
        actions=tuple(_action(a) for a in raw["actions"]),
        instances=tuple(_instance(i) for i in raw["instances"]),
    )


def plan(inputs: PlannerInputs, profile: LatencyProfile) -> Plan:
    """Runs Stage 1, evaluates the running deployment, applies the adoption rule and, if the
    new plan is adopted, Stage 2. Raises PlannerInputError on bad input."""
    return plan_from_json(_core.plan_json(_inputs_json(inputs), profile))


def plan_from_json(plan_json: str) -> Plan:
    """A `Plan` from the core's JSON form of it (`plan_json`'s output)."""
    raw = json.loads(plan_json)
    return Plan(
        capacity=_capacity(raw["capacity"]),
        current_value=PlanValue(**raw["current_value"]) if raw["current_value"] else None,
        gains=Gains(**raw["gains"]) if raw["gains"] else None,
        adopted=raw["adopted"],
        reason=raw["reason"],
        transition=_transition(raw["transition"]) if raw["transition"] else None,
        instances_per_node=tuple(tuple(n) for n in raw["instances_per_node"]),
        stage1_seconds=raw["stage1_seconds"],
        stage2_seconds=raw["stage2_seconds"],
    )


def plan_capacity(inputs: PlannerInputs, profile: LatencyProfile) -> CapacityPlan:
    """Stage 1 only."""
    return _capacity(json.loads(_core.plan_capacity_json(_inputs_json(inputs), profile)))


def plan_transition(
    node_gpus: Sequence[int],
    targets: Mapping[int, int],
    current: Deployment | None = None,
    solver: Solver = "highs",
    time_limit_seconds: float = 10.0,
) -> TransitionPlan:
    """Stage 2 alone: from ``current`` to ``targets`` instances per TP degree, keeping as
    many running instances as possible. Raises PlannerInputError when the targets do not
    fit on the nodes."""
    raw = asdict(current or Deployment())
    raw["batch_tokens"] = {str(k): v for k, v in raw["batch_tokens"].items()}
    inputs = {
        "node_gpus": list(node_gpus),
        "targets": {str(d): n for d, n in targets.items()},
        "current": raw,
        "solver": solver,
        "time_limit_seconds": time_limit_seconds,
    }
    return _transition(json.loads(_core.plan_transition_json(json.dumps(inputs))))


def _arrival_tuples(arrivals: Sequence[Arrival]) -> list[tuple[float, int, int]]:
    return [(a.time, a.prompt_tokens, a.output_tokens) for a in arrivals]


def classes_from_arrivals(
    arrivals: Sequence[Arrival], start: float, end: float, spec: BinSpec | None = None
) -> list[RequestClass]:
    """Bins the arrivals of ``[start, end)`` into request classes."""
    spec = spec or BinSpec()
    raw = _core.classes_from_arrivals(
        _arrival_tuples(arrivals),
        start,
        end,
        spec.prompt_bins,
        spec.output_bins,
        spec.rate_margin,
    )
    return [RequestClass(p, o, r) for p, o, r in raw]


def mean_isolated_latency(
    profile: LatencyProfile,
    arrivals: Sequence[Arrival],
    tokens_per_step: float,
    caching: bool = False,
    block_length: int = 32,
    exact_cache: bool = False,
) -> float:
    """Mean seconds a request of ``arrivals`` takes alone on a TP-1 instance (DESIGN §9 SLO)."""
    return _core.mean_isolated_latency(
        profile, _arrival_tuples(arrivals), tokens_per_step, caching, block_length, exact_cache
    )


def available_solvers() -> list[str]:
    """MILP backends compiled into the extension."""
    return list(_core.planner_solvers())
