"""Engine settings and per-request parameters."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dilaserve.decoding import ConfidenceRule, option_problem
from dilaserve.protocol import CacheMode
from dilaserve.scheduler import SCHEDULER_SETTINGS, Policy, SchedulerConfig, check_settings
from dilaserve.settings import settings_class

from .errors import BadRequestError

#: Scheduler settings the engine takes (`caching` and `exact_cache` follow its `cache`
#: mode). The engine overlaps steps unless told not to; the core's default (off) is the
#: simulator's.
ENGINE_SCHEDULER_SETTINGS = [
    {**f, "default": True} if f["name"] == "overlap" else f
    for f in SCHEDULER_SETTINGS
    if f["name"] not in ("caching", "exact_cache")
]


@dataclass(frozen=True)
class _EngineSettings:
    """The engine's own settings; `EngineConfig` adds the scheduler's."""

    #: Checkpoint directory; None serves the embedded dilaserve-tiny.
    model: str | Path | None = None
    instances: tuple[int, ...] = (1,)
    device_slots: int | None = None
    cache: CacheMode = CacheMode.DUAL
    dtype: str = "float32"
    device: str = "cpu"
    #: Torch intra-op threads per worker; None gives each slot an equal share of the cores,
    #: so instances on one CPU do not oversubscribe it.
    threads_per_worker: int | None = None
    #: Resident requests per instance (the KV pool holds at most this many full-length
    #: sequences; admission counts the pool's tokens).
    max_requests_per_instance: int = 64
    #: KV pool budget per worker rank: bytes (int), a fraction of free device memory
    #: (float), or None for the worker's default share.
    kv_cache_memory: int | float | None = None
    #: Under the block cache, requests share the exact K/V of common prompt blocks.
    prefix_caching: bool = True
    #: Quality floor: the scheduler never chooses a threshold whose accuracy, measured on
    #: the model (its `progress.json`), is more than this fraction below the top
    #: threshold's; None (or a model without measurements) allows every threshold.
    max_accuracy_drop: float | None = 0.03
    #: `(threshold, mean tokens per step)` of the scheduler's default predictor.
    predictor_rates: tuple[tuple[float, float], ...] | None = None
    #: A request's default SLO is this many times its estimated latency alone on TP-1.
    slo_scale: float = 5.0
    #: Latency profile JSON; None measures one with `dilaserve profile` (cached per model),
    #: or, emulating, takes the shipped LLaDA-8B/H100 one.
    profile: str | Path | None = None
    #: Emulated workers (`dilaserve.worker.emulated`): no model, each step takes the
    #: profile's time and commits tokens drawn from `progress`.
    emulate: bool = False
    #: Progress model JSON of emulated workers; None: LLaDA-8B's (`llada8b_progress`).
    progress: str | Path | None = None
    #: Output positions of a request that does not say.
    default_max_tokens: int = 64
    stop_at_eos: bool = True
    #: Re-plan the cluster this often (seconds) from the arrivals of the last interval;
    #: None turns periodic planning off.
    replan_interval_s: float | None = None
    #: TP degrees the planner may choose; None: every degree the model allows that the
    #: latency profile has tables for and the slots can hold.
    planner_degrees: tuple[int, ...] | None = None
    #: How many times a crashed instance is restarted before it is given up.
    max_restarts: int = 3
    #: A step that fails this many times for a request fails the request.
    max_step_retries: int = 3

    def __post_init__(self) -> None:
        if not self.instances:
            raise ValueError("an engine needs at least one instance")
        if any(d < 1 for d in self.instances):
            raise ValueError(f"TP degrees must be positive, got {self.instances}")
        if self.slots < sum(self.instances):
            raise ValueError(
                f"{sum(self.instances)} device slots are needed for instances "
                f"{self.instances}, but device_slots is {self.slots}"
            )
        if self.block_length <= 0 or self.max_requests_per_instance <= 0:
            raise ValueError("block_length and max_requests_per_instance must be positive")
        if self.slo_scale <= 0:
            raise ValueError(f"slo_scale must be positive, got {self.slo_scale}")
        check_settings(self.scheduler_config())

    def scheduler_config(self, **predictor: object) -> SchedulerConfig:
        """The scheduler's settings of this engine; `predictor` names its step predictor
        (`SchedulerConfig`'s predictor fields)."""
        shared = {f["name"]: getattr(self, f["name"]) for f in ENGINE_SCHEDULER_SETTINGS}
        return SchedulerConfig(
            **shared,
            caching=self.cache is not CacheMode.NONE,
            exact_cache=self.cache is CacheMode.BLOCK,
            **predictor,
        )

    @property
    def measured_degrees(self) -> tuple[int, ...]:
        """TP degrees a start-up latency profile must cover (TP 1 always: default SLOs are
        a multiple of a request's latency alone on TP-1)."""
        return tuple(sorted({1, *self.instances, *(self.planner_degrees or ())}))

    @property
    def slots(self) -> int:
        return self.device_slots if self.device_slots is not None else sum(self.instances)

    @property
    def worker_threads(self) -> int:
        if self.threads_per_worker:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // self.slots)


EngineConfig = settings_class(
    "EngineConfig",
    ENGINE_SCHEDULER_SETTINGS,
    doc="""How the engine serves one model: its own settings and the scheduler's (the core's
    `SchedulerConfig`, `caching` and `exact_cache` aside: they follow `cache`).

    `instances` lists the TP degree of each instance started with the engine; instances
    take device slots `0, 1, ...` of one node with `device_slots` slots (GPUs, or virtual
    CPU slots), which is also what reconfiguration may use. A TP-d instance takes d
    consecutive slots, one per rank.""",
    bases=(_EngineSettings,),
    nested={"policy": Policy},
    module=__name__,
)


@dataclass(frozen=True)
class GenerationParams:
    """What a caller may ask of one request."""

    #: Output positions (rounded up to whole blocks); None uses the engine's default.
    max_tokens: int | None = None
    #: Deadline in seconds after arrival; None uses the engine's SLO scale.
    slo_s: float | None = None
    #: Pins τ for every step; None lets the scheduler choose.
    threshold: float | None = None
    block_length: int | None = None
    priority: int = 0
    #: 0 decodes each position's argmax; above 0, samples with Gumbel noise.
    temperature: float = 0.0
    #: The fixed schedule (this many steps per block, τ ignored); None: threshold rule.
    steps_per_block: int | None = None
    #: With `steps_per_block`: the threshold rule, committing at least the schedule's
    #: share each step (LLaDA2's `threshold` with `steps`).
    threshold_floor: bool = False
    #: Dream's rule ordering positions (`maskgit_plus`, `topk_margin`, `entropy`,
    #: `origin`); None: the argmax's (or sample's) noiseless probability.
    alg: ConfidenceRule | str | None = None
    #: Above 0, positions are drawn from softmax(score / alg_temp) (confidence rules).
    alg_temp: float = 0.0
    #: Nucleus and top-k filtering of the sampled distribution (1 / None: off).
    top_p: float = 1.0
    top_k: int | None = None
    #: The request's own random stream: the same seed, prompt and options decode the same
    #: tokens wherever the request runs (with a pinned `threshold`: the scheduler's choice
    #: of τ depends on the load). None: the instance's shared stream.
    seed: int | None = None

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise BadRequestError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.slo_s is not None and not self.slo_s > 0:
            raise BadRequestError(f"slo_s must be positive, got {self.slo_s}")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise BadRequestError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.block_length is not None and self.block_length <= 0:
            raise BadRequestError(f"block_length must be positive, got {self.block_length}")
        if not 0.0 <= self.temperature <= 2.0:
            raise BadRequestError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.steps_per_block is not None and self.steps_per_block <= 0:
            raise BadRequestError(f"steps_per_block must be positive, got {self.steps_per_block}")
        if self.threshold_floor and (self.steps_per_block is None or self.alg is not None):
            raise BadRequestError("threshold_floor needs steps_per_block and no alg")
        problem = option_problem(
            alg=self.alg,
            alg_temp=self.alg_temp,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
        )
        if problem is not None:
            raise BadRequestError(problem[1])
