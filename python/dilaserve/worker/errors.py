"""The worker's one exception hierarchy; the worker process turns each into a per-request
`RequestError` or a failed `StepReport`, never into a lost process."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """Base of every error the worker raises on purpose."""


class RequestNotHeldError(WorkerError, KeyError):
    """The runner holds no request with this id."""


class StepRejectedError(WorkerError, ValueError):
    """A step entry cannot run here (threshold, finished request, wrong step kind)."""


class StepFailedError(WorkerError):
    """A step's read-back broke the commit rules (a kernel fault): nothing of it was
    applied, so every request keeps the state it had before the step."""


class MigrationError(WorkerError):
    """A request cannot leave its runner now: its next step reads a KV cache held here."""


class CacheFullError(WorkerError):
    """The KV pool has too few free tokens for a request."""


class CacheSlotError(WorkerError, KeyError):
    """A KV extent was named that the pool does not hold (unknown id, double free)."""


class GroupLostError(WorkerError):
    """A collective of the tensor-parallel group failed (a rank died or hung): the group
    cannot be trusted again, so the whole instance goes down and the engine restarts it;
    its requests resume elsewhere from the engine's copy of their state."""
