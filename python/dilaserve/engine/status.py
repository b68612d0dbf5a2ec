"""A snapshot of the engine for those who watch it (the server's `/v1/cluster`, `/ready` and
`/metrics`): plain values copied out, so readers never reach into the scheduler or the
reconfigurer, and an engine in another process can send the same record."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class InstanceStatus:
    id: int
    tp: int
    gpus: tuple[int, ...]
    node: int
    #: `starting`, `serving` or `stopping` (draining or shutting down).
    state: str
    restarts: int
    #: Known to the scheduler: ready, and not yet removed (serving or draining).
    registered: bool = False
    #: The scheduler's view, while it serves: tokens of the step in flight, resident
    #: requests, their tokens and the KV tokens they hold (a prompt block several of them
    #: read from the prefix store counted once), steps run.
    batch_tokens: int | None = None
    residents: int | None = None
    resident_tokens: int | None = None
    kv_used_tokens: int | None = None
    steps_run: int | None = None


@dataclass(frozen=True)
class PlanStatus:
    adopted: bool
    reason: str
    #: Instances per TP degree of the plan.
    degrees: dict[int, int]


@dataclass(frozen=True)
class EngineStatus:
    instances: tuple[InstanceStatus, ...]
    active_requests: int
    overloaded: bool
    #: The last plan computed, adopted or not.
    plan: PlanStatus | None
    planner_runs: int
    planner_solve_seconds: float
    worker_restarts: int
    #: Where step wall time goes (`StepTimes` as a dict).
    step_times: dict[str, float]
    #: The served model's tokens per step per threshold (`Engine.tokens_per_step`).
    tokens_per_step: dict = field(default_factory=dict)
    #: Prefix sharing's lookups and hits in prompt tokens (`protocol.PrefixUse` as a dict).
    prefix_cache: dict[str, int] = field(default_factory=dict)
    #: When the snapshot was taken, in seconds on the engine's clock (a snapshot sent by a
    #: core in another process is up to `core_process.STATUS_INTERVAL_S` old).
    taken_s: float = 0.0

    @property
    def ready(self) -> bool:
        """Every instance has started (at least one); a draining one still counts."""
        return bool(self.instances) and all(i.registered for i in self.instances)
