"""Engine fixtures: engines on the embedded dilaserve-tiny, driven from synchronous tests
through an event loop on a background thread."""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from dilaserve.engine import Engine, EngineConfig
from dilaserve.engine.offline import LoopThread

T = TypeVar("T")


class EngineHarness(LoopThread):
    """An engine whose coroutines the test runs with `run`."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.engine = Engine(config)
        self.run(self.engine.start(), timeout=300)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = 300) -> T:
        return super().run(coroutine, timeout)

    def call(self, fn, *args):
        """Runs a plain function on the engine's loop (the engine is not thread-safe)."""

        async def call():
            return fn(*args)

        return self.run(call())

    @contextlib.contextmanager
    def patched(self, target: object, name: str, value: object) -> Iterator[None]:
        """Sets `target.name` to `value` on the engine's loop for the block, then restores
        it (a spy on the engine's transport, say)."""
        original = getattr(target, name)
        self.call(setattr, target, name, value)
        try:
            yield
        finally:
            self.call(setattr, target, name, original)

    def close(self) -> None:
        self.run(self.engine.shutdown(), timeout=60)
        self.stop()


@pytest.fixture
def make_engine(tiny_profile) -> Iterator:
    """`make_engine(**config)` starts an engine that is shut down after the test."""
    started: list[EngineHarness] = []

    def make(**overrides) -> EngineHarness:
        config = EngineConfig(**{"profile": tiny_profile, "threads_per_worker": 1, **overrides})
        harness = EngineHarness(config)
        started.append(harness)
        return harness

    yield make
    for harness in started:
        harness.close()


@pytest.fixture(scope="module")
def shared_engine(tiny_profile) -> Iterator[EngineHarness]:
    """One single-instance engine for the tests of a module that leave it as they found it."""
    harness = EngineHarness(EngineConfig(profile=tiny_profile, threads_per_worker=1))
    yield harness
    harness.close()
