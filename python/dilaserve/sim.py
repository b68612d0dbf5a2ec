"""Typed face of the trace-driven simulator (`dilaserve._core.simulate`): the live
scheduler and planner in simulated time, workers replaced by a latency profile and a
progress model recorded from real decoding (`dilaserve.predictor.progress`).

Results come in the shape of `dilaserve bench` (`dilaserve.bench.Summary`), so simulated
and live runs compare line by line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dilaserve import _core
from dilaserve.bench.report import Summary
from dilaserve.bench.workload import compressed, gamma_times, poisson_times
from dilaserve.planner import (
    Arrival,
    BinSpec,
    PlannerConfig,
    ThresholdOption,
    mean_isolated_latency,
)
from dilaserve.predictor.progress import mean_rates
from dilaserve.scheduler import LatencyProfile, Policy, Scheduler, SchedulerConfig

SimInputError = _core.SimInputError


def fixed(tau: float) -> Policy:
    """A fixed threshold with DiLaServe's instance choice and migration: the policy the
    SLO-aware one must never lose to at equal quality."""
    return dataclasses.replace(Policy.dilaserve(), threshold="fixed", fixed_tau=tau)


#: Policies by name: DESIGN §8's baselines and ablations (the names `dilaserve bench` uses),
#: and `no-reconfig` (DiLaServe on the baselines' layout, never replanned).
POLICIES: dict[str, Policy] = {
    "dilaserve": Policy.dilaserve(),
    "infaas": Policy.infaas_like(0.9),
    "llumnix": Policy.llumnix_like(0.9),
    "no-load-control": Policy.dilaserve().without_load_control(),
    "no-migration": Policy.dilaserve().without_migration(),
    "one-shot": Policy.dilaserve().one_shot(),
    "no-reconfig": Policy.dilaserve(),
    "no-admission": Policy.dilaserve().without_admission(),
    "paper": Policy.dilaserve().window_load_control().without_admission(),
}

#: Policies that run on all-TP-1 instances and never replan (DESIGN §8).
FIXED_LAYOUT = frozenset({"infaas", "llumnix", "no-reconfig", "paper"})


def policy_named(name: str) -> Policy:
    """A policy of `POLICIES`, or `fixed-T`: threshold T with DiLaServe's instance choice."""
    if name in POLICIES:
        return POLICIES[name]
    if name.startswith("fixed-"):
        return fixed(float(name.removeprefix("fixed-")))
    raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)} and fixed-T")


@dataclass(frozen=True)
class Workload:
    """Requests to simulate: arrival seconds and token counts, one entry per request, and
    optionally each one's kind (a task name, say), whose progress model
    `ClusterSetup.class_progress` may give."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    duration_s: float
    progress_class: Sequence[str] | None = None

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def synthetic(
        cls,
        arrivals: str,
        rate: float,
        duration_s: float,
        lengths: Sequence[tuple[int, int]],
        seed: int = 0,
        gamma_cv: float = 2.0,
    ) -> Workload:
        """`poisson`, `gamma` (bursty, `gamma_cv`) or `day` (a day's rate shape compressed
        into `duration_s`, mean `rate`) arrivals; each request's `(prompt, output)` tokens
        drawn from `lengths`."""
        rng = random.Random(seed)
        if arrivals == "poisson":
            times = poisson_times(rate, duration_s, rng)
        elif arrivals == "gamma":
            times = gamma_times(rate, gamma_cv, duration_s, rng)
        elif arrivals == "day":
            times = day_times(rate, duration_s, rng)
        else:
            raise ValueError(f"arrivals must be poisson, gamma or day, got {arrivals!r}")
        picks = [lengths[rng.randrange(len(lengths))] for _ in times]
        return cls(
            np.asarray(times, dtype=np.float64),
            np.asarray([p for p, _ in picks], dtype=np.uint32),
            np.asarray([o for _, o in picks], dtype=np.uint32),
            duration_s,
        )

    @classmethod
    def replay(
        cls, trace: Sequence[tuple[float, int, int]], rate: float, duration_s: float
    ) -> Workload:
        """A trace (`bench.workload.read_trace` rows) compressed in time to `rate` requests
        per second, its bursts and lengths kept, cut at `duration_s`."""
        rows = [row for row in compressed(trace, rate) if row[0] < duration_s]
        return cls(
            np.asarray([r[0] for r in rows], dtype=np.float64),
            np.asarray([max(1, r[1]) for r in rows], dtype=np.uint32),
            np.asarray([max(1, r[2]) for r in rows], dtype=np.uint32),
            duration_s,
        )


def day_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrivals whose rate follows a day (trough at night, peak in the afternoon,
    peak 3× the trough) compressed into `duration_s`, averaging `rate`: thinning of a
    Poisson process at the peak rate."""

    def shape(t: float) -> float:
        return 1.0 - 0.5 * math.cos(2 * math.pi * t / duration_s)

    peak = rate * 1.5
    return [t for t in poisson_times(peak, duration_s, rng) if rng.random() < shape(t) / 1.5]


@dataclass(frozen=True)
class ClusterSetup:
    """What is simulated besides the workload and the policy."""

    profile: LatencyProfile
    #: A progress model (`dilaserve.predictor.progress`).
    progress: dict
    node_gpus: tuple[int, ...]
    #: TP degrees of the instances of the layout-adapting policies at the start; the
    #: baselines always run one TP-1 instance per GPU.
    layout: tuple[int, ...]
    slo_scale: float = 5.0
    thresholds: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9)
    #: Threshold of the SLO unit: a request alone on TP-1 at this threshold.
    slo_tau: float = 0.9
    block_length: int = 32
    caching: bool = True
    max_batch_tokens: int = 8192
    max_queued: int | None = None
    #: Progress models of workload classes (`Workload.progress_class`); a request of
    #: another class, or of none, draws from `progress`.
    class_progress: Mapping[str, dict] = field(default_factory=dict)
    #: LightGBM predictor of the model (`predictor.txt`); None: the progress model's rates.
    predictor_model: str | None = None
    #: Simulated seconds between replans of the layout-adapting policies; None: never.
    replan_interval_s: float | None = 300.0
    replan_window_s: float = 300.0
    launch_s: float = 30.0
    planner_degrees: tuple[int, ...] = (1, 2, 4)
    round_quantum_s: float = 0.0
    #: Seconds each step costs besides the profiled worker execution: the engine's
    #: dispatch and transport around it (`/v1/cluster`'s `step_times` measures it live).
    step_overhead_s: float = 0.0
    seed: int = 0

    def rates(self) -> list[tuple[float, float]]:
        return mean_rates(self.progress)

    def threshold_options(self) -> list[ThresholdOption]:
        table = self.rates()
        xs, ys = [t for t, _ in table], [r for _, r in table]
        return [ThresholdOption(t, float(np.interp(t, xs, ys))) for t in self.thresholds]

    def slo_seconds(self, workload: Workload) -> np.ndarray:
        """`slo_scale` × each request's isolated latency (DESIGN §9)."""
        tps = float(np.interp(self.slo_tau, *zip(*self.rates(), strict=True)))
        # One isolated latency per distinct (prompt, output) pair, found through one int64
        # key per request (a million requests have some ten thousand pairs).
        keys = workload.prompt_len.astype(np.int64) << 32 | workload.output_len.astype(np.int64)
        unique, which = np.unique(keys, return_inverse=True)
        alone = np.array(
            [
                mean_isolated_latency(
                    self.profile,
                    [Arrival(0.0, int(k >> 32), int(k & 0xFFFFFFFF))],
                    tps,
                    self.caching,
                    self.block_length,
                )
                for k in unique
            ],
            dtype=np.float64,
        )
        return self.slo_scale * alone[which]

    def scheduler(self, policy: Policy) -> Scheduler:
        return Scheduler(
            self.profile,
            SchedulerConfig(
                thresholds=self.thresholds,
                block_length=self.block_length,
                caching=self.caching,
                max_batch_tokens=self.max_batch_tokens,
                max_queued=self.max_queued,
                policy=policy,
                predictor_rates=None if self.predictor_model else tuple(self.rates()),
                predictor_model=self.predictor_model,
            ),
        )

    def replan_json(self, slo_s: float) -> str:
        options = {
            "interval_s": self.replan_interval_s,
            "window_s": self.replan_window_s,
            "launch_s": self.launch_s,
            "node_gpus": list(self.node_gpus),
            "planner": dataclasses.asdict(
                PlannerConfig(
                    slo_seconds=slo_s,
                    degrees=self.planner_degrees,
                    caching=self.caching,
                    block_length=self.block_length,
                )
            ),
            "thresholds": [dataclasses.asdict(t) for t in self.threshold_options()],
            "bins": dataclasses.asdict(BinSpec()),
        }
        return json.dumps(options)


def place(degrees: Sequence[int], node_gpus: Sequence[int]) -> list[tuple[int, int, list, int]]:
    """`(id, tp, gpus, node)` of instances of `degrees` packed onto the nodes, largest
    first, each TP group within one node."""
    free = [list(range(n)) for n in node_gpus]
    placed = []
    for tp in sorted(degrees, reverse=True):
        node = next((n for n, gpus in enumerate(free) if len(gpus) >= tp), None)
        if node is None:
            raise ValueError(f"layout {list(degrees)} does not fit nodes {list(node_gpus)}")
        gpus, free[node] = free[node][:tp], free[node][tp:]
        placed.append((len(placed), tp, gpus, node))
    return placed


@dataclass(frozen=True)
class SimRun:
    """One simulated run: per-request columns (numpy arrays) and the run's counters."""

    policy: str
    rate: float
    duration_s: float
    columns: dict
    stats: dict

    def summary(self) -> Summary:
        c = self.columns
        answered = ~np.isnan(c["finish"])
        latency = (c["finish"] - c["arrival"])[answered]
        met = int(np.sum(answered & (c["finish"] <= c["deadline"])))
        n = len(c["arrival"])
        nan = float("nan")
        return Summary(
            policy=self.policy,
            rate=self.rate,
            requests=n,
            attainment=met / n if n else nan,
            mean_latency_s=float(latency.mean()) if latency.size else nan,
            p50_latency_s=float(np.quantile(latency, 0.5)) if latency.size else nan,
            p99_latency_s=float(np.quantile(latency, 0.99)) if latency.size else nan,
            throughput_rps=float(answered.sum()) / self.duration_s,
            goodput_rps=met / self.duration_s,
            accuracy=float(c["accuracy"][answered].mean()) if latency.size else nan,
            mean_tau=float(np.nanmean(c["mean_tau"][answered])) if latency.size else nan,
            rejected=int(c["rejected"].sum()),
        )


def simulate(
    setup: ClusterSetup,
    policy: str,
    workload: Workload,
    rate: float,
    slo_s: Sequence[float] | None = None,
) -> SimRun:
    """Runs `workload` under the named policy (see `policy_named`); each request's SLO is
    `slo_s` when given (the deadlines of a live run being reproduced), else
    `setup.slo_seconds`."""
    if slo_s is not None and len(slo_s) != len(workload):
        raise ValueError(f"{len(slo_s)} SLOs for {len(workload)} requests")
    slo = setup.slo_seconds(workload) if slo_s is None else np.asarray(slo_s, dtype=np.float64)
    adapts = policy not in FIXED_LAYOUT
    degrees = setup.layout if adapts else (1,) * sum(setup.node_gpus)
    replan = None
    if adapts and setup.replan_interval_s:
        replan = setup.replan_json(float(np.mean(slo)) if len(slo) else 1.0)
    scheduler = setup.scheduler(policy_named(policy))
    models, classes = progress_classes(setup, workload)
    columns, stats = _core.simulate(
        scheduler._core,
        place(degrees, setup.node_gpus),
        workload.arrival.tolist(),
        workload.prompt_len.tolist(),
        workload.output_len.tolist(),
        slo.tolist(),
        json.dumps(models),
        progress_class=classes,
        seed=setup.seed,
        round_quantum_s=setup.round_quantum_s,
        step_overhead_s=setup.step_overhead_s,
        replan_json=replan,
    )
    return SimRun(policy, rate, workload.duration_s, columns, stats)


def progress_classes(
    setup: ClusterSetup, workload: Workload
) -> tuple[list[dict], list[int] | None]:
    """The progress models the core draws from (`setup.progress` first) and each request's
    index into them (None: every request the first)."""
    if workload.progress_class is None or not setup.class_progress:
        return [setup.progress], None
    if len(workload.progress_class) != len(workload):
        raise ValueError(f"{len(workload.progress_class)} classes for {len(workload)} requests")
    names = sorted(setup.class_progress)
    index = {name: i + 1 for i, name in enumerate(names)}
    models = [setup.progress, *(setup.class_progress[name] for name in names)]
    return models, [index.get(c, 0) for c in workload.progress_class]
