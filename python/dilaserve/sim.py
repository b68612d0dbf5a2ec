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
from dilaserve.bench.workload import gamma_times, poisson_times, replayed
from dilaserve.planner import (
    Arrival,
    BinSpec,
    PlannerConfig,
    ThresholdOption,
    mean_isolated_latency,
)
from dilaserve.predictor.progress import mean_rates, rescaled
from dilaserve.scheduler import (
    PRESETS,
    SCHEDULER_SETTINGS,
    LatencyProfile,
    Policy,
    Scheduler,
    SchedulerConfig,
)
from dilaserve.settings import settings_class

SimInputError = _core.SimInputError


def fixed_layout(policy: str) -> bool:
    """Whether the named policy runs on one TP-1 instance per GPU and never replans
    (DESIGN §8's baselines; `fixed-T` policies adapt the layout like DiLaServe)."""
    preset = PRESETS.get(policy)
    return preset is not None and preset["fixed_layout"]


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
    def shifting(
        cls,
        rate: float,
        duration_s: float,
        phases: Sequence[Sequence[tuple[int, int]]],
        seed: int = 0,
    ) -> Workload:
        """Poisson arrivals at `rate` whose mix shifts: the run splits into equal phases,
        each drawing its requests' `(prompt, output)` tokens from its own lengths (short
        chat, then long prompts, then chat again, say)."""
        rng = random.Random(seed)
        times = poisson_times(rate, duration_s, rng)
        span = duration_s / len(phases)
        picks = []
        for t in times:
            lengths = phases[min(int(t / span), len(phases) - 1)]
            picks.append(lengths[rng.randrange(len(lengths))])
        return cls(
            np.asarray(times, dtype=np.float64),
            np.asarray([p for p, _ in picks], dtype=np.uint32),
            np.asarray([o for _, o in picks], dtype=np.uint32),
            duration_s,
        )

    def with_classes(self, kinds: Sequence[str], seed: int = 0) -> Workload:
        """The same requests, each given one of `kinds` at random (its `progress_class`)."""
        rng = random.Random(seed)
        return dataclasses.replace(self, progress_class=[rng.choice(kinds) for _ in self.arrival])

    @classmethod
    def replay(
        cls, trace: Sequence[tuple[float, int, int]], rate: float, duration_s: float
    ) -> Workload:
        """A trace (`bench.workload.read_trace` rows) compressed in time to `rate` requests
        per second, its bursts and lengths kept, over `duration_s` (`replayed`)."""
        rows = replayed(trace, rate, duration_s)
        return cls(
            np.asarray([r[0] for r in rows], dtype=np.float64),
            np.asarray([max(1, r[1]) for r in rows], dtype=np.uint32),
            np.asarray([max(1, r[2]) for r in rows], dtype=np.uint32),
            duration_s,
        )


def speed_classes(progress: dict, speeds: Mapping[str, float]) -> dict[str, dict]:
    """Progress models of kinds of request that decode at `speeds` × `progress`'s mean
    tokens per step at every threshold (tasks of one model differ so), for
    `ClusterSetup.class_progress`."""
    return {
        kind: rescaled(progress, [(t, max(1.0, r * speed)) for t, r in mean_rates(progress)])
        for kind, speed in speeds.items()
    }


def prefill_heavy_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """`n` `(prompt, output)` pairs of a prefill-heavy mix (code completion): prompts of
    2,000–5,000 tokens, outputs of 8–64."""
    rng = random.Random(seed)
    return [(rng.randint(2000, 5000), rng.randint(8, 64)) for _ in range(n)]


def static_layouts(node_gpus: Sequence[int], degrees: Sequence[int] = (1, 2, 4)) -> list:
    """Every multiset of instance degrees that fills the nodes, each node filled by its own
    instances (4 nodes × 4 GPUs, degrees 1/2/4: 25 layouts), largest first as `place`
    takes them."""

    def fills(gpus: int, largest: int) -> list[tuple[int, ...]]:
        if gpus == 0:
            return [()]
        return [
            (d, *rest)
            for d in sorted(degrees, reverse=True)
            if d <= min(gpus, largest)
            for rest in fills(gpus - d, d)
        ]

    layouts: set[tuple[int, ...]] = {()}
    for gpus in node_gpus:
        layouts = {
            tuple(sorted(done + node, reverse=True))
            for done in layouts
            for node in fills(gpus, gpus)
        }
    return sorted(layouts)


def day_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrivals whose rate follows a day (trough at night, peak in the afternoon,
    peak 3× the trough) compressed into `duration_s`, averaging `rate`: thinning of a
    Poisson process at the peak rate."""

    def shape(t: float) -> float:
        return 1.0 - 0.5 * math.cos(2 * math.pi * t / duration_s)

    peak = rate * 1.5
    return [t for t in poisson_times(peak, duration_s, rng) if rng.random() < shape(t) / 1.5]


@dataclass(frozen=True)
class _ClusterSettings:
    """What is simulated besides the workload, the policy and the scheduler's settings."""

    profile: LatencyProfile
    #: A progress model (`dilaserve.predictor.progress`).
    progress: dict
    node_gpus: tuple[int, ...]
    #: TP degrees of the instances of the layout-adapting policies at the start; the
    #: baselines always run one TP-1 instance per GPU.
    layout: tuple[int, ...]
    slo_scale: float = 5.0
    #: Threshold of the SLO unit: a request alone on TP-1 at this threshold.
    slo_tau: float = 0.9
    #: Progress models of workload classes (`Workload.progress_class`); a request of
    #: another class, or of none, draws from `progress`.
    class_progress: Mapping[str, dict] = field(default_factory=dict)
    #: LightGBM predictor of the model (`predictor.txt`); None: the progress model's rates.
    predictor_model: str | None = None
    #: Simulated seconds between replans of the layout-adapting policies; None: never.
    replan_interval_s: float | None = 300.0
    replan_window_s: float = 300.0
    launch_s: float = 30.0
    #: Rehearse each plan on the window's requests (staying vs moving, the transition
    #: included) and adopt it only if moving meets more deadlines; off: the planner's rule.
    rehearse_plans: bool = True
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
        tps = self.slo_tokens_per_step()
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
                    self.exact_cache,
                )
                for k in unique
            ],
            dtype=np.float64,
        )
        return self.slo_scale * alone[which]

    def scheduler(self, policy: Policy) -> Scheduler:
        shared = {f["name"]: getattr(self, f["name"]) for f in CLUSTER_SCHEDULER_SETTINGS}
        return Scheduler(
            self.profile,
            SchedulerConfig(
                **shared,
                policy=policy,
                predictor_rates=None if self.predictor_model else tuple(self.rates()),
                predictor_model=self.predictor_model,
            ),
        )

    def slo_tokens_per_step(self) -> float:
        """Tokens per step of the SLO unit's threshold."""
        return float(np.interp(self.slo_tau, *zip(*self.rates(), strict=True)))

    def replan_json(self, slo_s: float, scaled: bool) -> str:
        """The replanner's options: it plans against `slo_s` seconds for every class, or,
        `scaled`, against each class's own multiple of its isolated latency, as the setup's
        SLOs are (`slo_s`, their mean, then only seeds the planner's config)."""
        if scaled:
            unit = {"scale": self.slo_scale, "tokens_per_step": self.slo_tokens_per_step()}
            slo = {"scaled": unit}
        else:
            slo = {"fixed": {"seconds": slo_s}}
        options = {
            "interval_s": self.replan_interval_s,
            "window_s": self.replan_window_s,
            "launch_s": self.launch_s,
            "node_gpus": list(self.node_gpus),
            "rehearse": self.rehearse_plans,
            "planner": dataclasses.asdict(
                PlannerConfig(
                    slo_seconds=slo_s,
                    degrees=self.planner_degrees,
                    caching=self.caching,
                    exact_cache=self.exact_cache,
                    block_length=self.block_length,
                )
            ),
            "slo": slo,
            "thresholds": [dataclasses.asdict(t) for t in self.threshold_options()],
            "bins": dataclasses.asdict(BinSpec()),
        }
        return json.dumps(options)


#: Scheduler settings a simulated cluster takes (the policy is each run's).
#: The simulator's engine costs `step_overhead_s` a step, a synchronous round trip: it
#: does not overlap steps.
CLUSTER_SCHEDULER_SETTINGS = [
    f for f in SCHEDULER_SETTINGS if f["name"] not in ("policy", "overlap")
]

ClusterSetup = settings_class(
    "ClusterSetup",
    CLUSTER_SCHEDULER_SETTINGS,
    doc="What is simulated besides the workload and the policy: the cluster, its model and "
    "the scheduler's settings (the core's `SchedulerConfig`, the policy aside).",
    bases=(_ClusterSettings,),
    module=__name__,
)


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
    """Runs `workload` under the named policy (`Policy.named`); each request's SLO is
    `slo_s` when given (the deadlines of a live run being reproduced), else
    `setup.slo_seconds`."""
    if slo_s is not None and len(slo_s) != len(workload):
        raise ValueError(f"{len(slo_s)} SLOs for {len(workload)} requests")
    slo = setup.slo_seconds(workload) if slo_s is None else np.asarray(slo_s, dtype=np.float64)
    adapts = not fixed_layout(policy)
    degrees = setup.layout if adapts else (1,) * sum(setup.node_gpus)
    replan = None
    if adapts and setup.replan_interval_s:
        replan = setup.replan_json(float(np.mean(slo)) if len(slo) else 1.0, slo_s is None)
    scheduler = setup.scheduler(Policy.named(policy))
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
