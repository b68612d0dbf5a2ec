"""Engine fixtures: engines on the embedded dilaserve-tiny, driven from synchronous tests
through an event loop on a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from dilaserve.engine import Engine, EngineConfig
from dilaserve.scheduler import LatencyProfile

T = TypeVar("T")


class EngineHarness:
    """An engine whose coroutines the test runs with `run`."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = Engine(config)
        self.run(self.engine.start(), timeout=300)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def call(self, fn, *args):
        """Runs a plain function on the engine's loop (the engine is not thread-safe)."""

        async def call():
            return fn(*args)

        return self.run(call())

    def close(self) -> None:
        self.run(self.engine.shutdown(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory) -> str:
    """A latency profile shaped like the tiny model's on a CPU (no measuring in tests)."""
    profile = LatencyProfile.from_tables(
        [
            (1, "no_cache", [(32, 0.004), (512, 0.012), (8192, 0.15)]),
            (1, "recompute", [(32, 0.004), (512, 0.012), (8192, 0.15)]),
            (1, "cache", [(32, 0.003), (512, 0.008), (8192, 0.1)]),
        ]
    )
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    path.write_text(profile.to_json())
    return str(path)


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
