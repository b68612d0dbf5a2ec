"""The engine's one exception hierarchy, raised to callers of `Engine.generate`. The server
maps each to an HTTP status once (400, 429, 503)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base of every error the engine raises to a caller."""


class BadRequestError(EngineError, ValueError):
    """The request itself is invalid (empty prompt, too long, τ outside (0, 1], ...).
    `index`: which of several requests submitted together (`Engine.add_requests`)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class OverloadedError(EngineError):
    """Admission control refused the request: even the lowest thresholds cannot carry the
    load and the queue is full. Retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownRequestError(EngineError, KeyError):
    """No request with this id was ever issued by this engine."""


class RequestCancelledError(EngineError):
    """The request was cancelled before it finished."""


class RequestFailedError(EngineError):
    """A worker refused the request or its steps kept failing; other requests go on."""


class EngineStoppedError(EngineError):
    """The engine is not running (never started, shutting down, or no instance left)."""


class LaunchError(EngineError):
    """An instance could not be placed: its node left, no node offers the devices, or the
    placement did not come up in time."""
