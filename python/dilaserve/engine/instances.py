"""What the engine keeps per instance: placement, its worker, the step in flight, and the
step-time accounting behind `engine_overhead_frac`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dilaserve.protocol import WorkerReady

from .launcher import WorkerHandle


@dataclass
class InflightStep:
    number: int
    #: When it was sent, or (a step ahead) when the step before it reported, if later.
    sent_at: float
    #: The scheduler's estimate of its duration (the latency profile's).
    predicted_s: float = 0.0


@dataclass
class StepTimes:
    """Where the wall time of steps goes, summed over every completed step: the worker's
    own step execution, the rest of the round trip (transport, serialization, command
    handling), and the gap from a report to the instance's next command (engine work);
    beside them what the latency profile predicted (the worker's time drifting from it
    means the profile no longer describes the machine)."""

    steps: int = 0
    #: Of them, steps sent ahead (overlap): queued behind the instance's step in flight.
    steps_ahead: int = 0
    worker_s: float = 0.0
    round_trip_s: float = 0.0
    dispatch_gap_s: float = 0.0
    predicted_s: float = 0.0

    @property
    def overhead_frac(self) -> float:
        """Share of step wall time spent outside the workers' step execution."""
        wall = self.round_trip_s + self.dispatch_gap_s
        return (wall - self.worker_s) / wall if wall > 0 else 0.0


@dataclass
class InstanceRecord:
    """One instance as the engine runs it: placement, its worker, its step in flight."""

    id: int
    tp: int
    gpus: tuple[int, ...]
    node: int
    handle: WorkerHandle | None = None
    ready: WorkerReady | None = None
    #: Known to the scheduler (ready and not removed).
    registered: bool = False
    #: Planned stop or SIGTERM: drain, then shut down.
    stopping: bool = False
    shutdown_sent: bool = False
    restarts: int = 0
    inflight: InflightStep | None = None
    #: With overlap: the step sent behind it; it starts when `inflight` reports.
    ahead: InflightStep | None = None
    #: When its last report came in and the round that handles it: a step sent in that
    #: round followed its predecessor without waiting for work.
    reported_at: tuple[float, int] | None = None
    started: asyncio.Future[None] = field(default_factory=lambda: asyncio.Future())
    stopped: asyncio.Future[None] = field(default_factory=lambda: asyncio.Future())
